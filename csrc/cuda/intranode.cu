// Normal-mode dispatch/combine between up to 8 ranks that reach each other's memory directly
// (NVLink peers through CUDA IPC, or R virtual ranks of one process on one GPU).
//
// Buffers: each rank owns an IntranodeLayout buffer (csrc/common/buffer_layout.h) holding one
// ring per (channel c, source rank). Tokens are split into C contiguous channels; per rank a
// launch runs C sender blocks and C receiver blocks (grid.x = 2C, grid.y = virtual rank).
//  - sender block c, warp r: walks channel c's tokens in order and writes each token for rank r
//    into ring (c, me) of rank r, publishing the ring tail; waits for space via the ring head.
//  - receiver block c, warp s: drains ring (c, s) into recv rows ordered by source rank, then
//    channel (= source token order), renumbering top-k ids to local experts.
// The combine runs the rings the other way; its receiver sums, per token, the rows coming back
// from every rank the token went to. Every wait is bounded (csrc/common/device_sync.h).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "../common/buffer_layout.h"
#include "../common/device_sync.h"
#include "../common/routing.h"
#include "../cuda_bindings/launchers.h"

namespace ep_comm::cuda {
namespace {

template <class T>
struct RankSet {
  T r[kMaxRanks];
};

__device__ __forceinline__ IntranodeLayout layout_of(const IntranodeCommon& c) {
  return make_intranode_layout(c.num_ranks, c.num_channels, c.max_local_experts, c.ring_slots,
                               c.row_bytes);
}
__device__ __forceinline__ int* word(uint8_t* base, int64_t offset, int64_t index) {
  return reinterpret_cast<int*>(base + offset) + index;
}

// Whole-block barrier across the ranks of one buffer group: each thread r < R tells rank r that
// `me` arrived, then waits until rank r told us. Returns false on timeout.
__device__ bool rank_barrier(const IntranodeCommon& c, const IntranodeLayout& lay, int me,
                             const WaitCtx& w) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  if (threadIdx.x == 0) __threadfence_system();
  __syncthreads();
  if (threadIdx.x < c.num_ranks) {
    const int r = threadIdx.x;
    st_release_sys(word(c.peers[r], lay.arrival, me), c.barrier_value);
    if (!wait_geq(w, word(c.peers[me], lay.arrival, r), c.barrier_value, r, kIntranodeBarrier, 0))
      ok = 0;
  }
  __syncthreads();
  return ok != 0;
}

__device__ void reset_rings(const IntranodeCommon& c, const IntranodeLayout& lay, int me) {
  for (int i = threadIdx.x; i < c.num_channels * c.num_ranks; i += blockDim.x) {
    *word(c.peers[me], lay.ring_tail, i) = 0;
    *word(c.peers[me], lay.ring_head, i) = 0;
  }
}

// ---- notify: counts to every peer, one barrier, then this rank's receive metadata ----------
__global__ void notify_kernel(IntranodeCommon c, RankSet<NotifyRank> set) {
  const NotifyRank& p = set.r[blockIdx.y];
  const int me = p.rank, R = c.num_ranks, C = c.num_channels, L = c.max_local_experts;
  const IntranodeLayout lay = layout_of(c);
  const WaitCtx w{p.record, c.timeout_ns, me};
  reset_rings(c, lay, me);
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int r = i / C, ch = i % C;
    const Range range = channel_range(p.num_tokens, C, ch);
    int count = 0;
    for (int t = range.begin; t < range.end; ++t) count += p.is_token_in_rank[int64_t(t) * R + r];
    *word(c.peers[r], lay.channel_counts, me * C + ch) = count;
  }
  for (int r = 0; r < R; ++r)
    for (int l = threadIdx.x; l < L; l += blockDim.x) *word(c.peers[r], lay.expert_counts, me * L + l) = 0;
  __syncthreads();
  if (threadIdx.x == 0) __threadfence_system();
  __syncthreads();
  for (int e = threadIdx.x; e < c.num_experts; e += blockDim.x) {
    const int r = c.expert_to_rank[e];
    *word(c.peers[r], lay.expert_counts, me * L + c.expert_to_local[e]) = p.num_tokens_per_expert[e];
  }
  if (!rank_barrier(c, lay, me, w)) return;
  const int* counts = word(c.peers[me], lay.channel_counts, 0);
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) p.meta[i] = ld_acquire_sys(counts + i);
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += ld_acquire_sys(word(c.peers[me], lay.expert_counts, s * L + l));
    p.meta[R * C + l] = sum;
  }
  if (threadIdx.x == 0) {
    int total = 0;
    for (int i = 0; i < R * C; ++i) total += ld_acquire_sys(counts + i);
    p.meta[R * C + L] = total;
  }
}

// Sender side of one ring: waits (lane 0) until slot `tail` is free, publishing `tail` first so
// the receiver can make progress. Returns false on timeout (whole warp).
__device__ __forceinline__ bool wait_ring_space(const WaitCtx& w, int* remote_tail,
                                                const int* remote_head, int tail, int& head_cache,
                                                int64_t slots, int peer, int phase, int channel) {
  const int lane = threadIdx.x & 31;
  if (tail - head_cache < slots) return true;
  int ok = 1;
  if (lane == 0) {
    __threadfence_system();
    st_release_sys(remote_tail, tail);
    ok = wait_geq(w, remote_head, tail - static_cast<int>(slots) + 1, peer, phase, channel);
    if (ok) head_cache = ld_acquire_sys(remote_head);
  }
  ok = __shfl_sync(0xffffffffu, ok, 0);
  head_cache = __shfl_sync(0xffffffffu, head_cache, 0);
  return ok != 0;
}

// Receiver side: waits (lane 0) until ring tail > consumed; returns the tail, or -1 on timeout.
__device__ __forceinline__ int wait_ring_data(const WaitCtx& w, const int* tail, int consumed,
                                              int peer, int phase, int channel) {
  int value = -1;
  if ((threadIdx.x & 31) == 0 && wait_geq(w, tail, consumed + 1, peer, phase, channel))
    value = ld_acquire_sys(tail);
  return __shfl_sync(0xffffffffu, value, 0);
}

__device__ __forceinline__ int64_t meta_prefix(const int32_t* meta, int index) {
  int64_t offset = 0;
  for (int i = 0; i < index; ++i) offset += meta[i];
  return offset;
}

// ---- dispatch ---------------------------------------------------------------------------------
__global__ void dispatch_kernel(IntranodeCommon c, RankSet<DispatchRank> set, int64_t hidden_bytes,
                                int num_scales) {
  const DispatchRank& p = set.r[blockIdx.y];
  const int me = p.rank, R = c.num_ranks, C = c.num_channels, K = c.num_topk;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const IntranodeLayout lay = layout_of(c);
  const RowLayout row = make_row_layout(hidden_bytes, num_scales, K, true, p.topk_weights != nullptr, true);
  const WaitCtx w{p.record, c.timeout_ns, me};
  const bool sender = blockIdx.x < C;
  const int ch = sender ? blockIdx.x : blockIdx.x - C;
  if (sender) {
    for (int dst = warp; dst < R; dst += blockDim.x >> 5) {
      const Range range = channel_range(p.num_tokens, C, ch);
      int* remote_tail = word(c.peers[dst], lay.ring_tail, ch * R + me);
      const int* remote_head = word(c.peers[dst], lay.ring_head, ch * R + me);
      int tail = 0, head_cache = 0, published = 0;
      for (int base = range.begin; base < range.end; base += 32) {
        const int t = base + lane;
        unsigned hits = __ballot_sync(0xffffffffu, t < range.end && p.is_token_in_rank[int64_t(t) * R + dst]);
        while (hits) {
          const int token = base + __ffs(hits) - 1;
          hits &= hits - 1;
          if (!wait_ring_space(w, remote_tail, remote_head, tail, head_cache, c.ring_slots, dst,
                               kIntranodeDispatchSend, ch))
            return;
          uint8_t* out = c.peers[dst] + ring_row_offset(lay, R, ch, me, tail);
          warp_copy16_ro(out + row.x_offset, p.x + token * hidden_bytes, hidden_bytes, lane);
          auto* scales = reinterpret_cast<float*>(out + row.scales_offset);
          for (int i = lane; i < num_scales; i += 32) scales[i] = p.x_scales[int64_t(token) * num_scales + i];
          if (lane < K) {
            reinterpret_cast<int64_t*>(out + row.topk_offset)[lane] = p.topk_idx[int64_t(token) * K + lane];
            if (p.topk_weights)
              reinterpret_cast<float*>(out + row.weights_offset)[lane] = p.topk_weights[int64_t(token) * K + lane];
          }
          if (lane == 0) *reinterpret_cast<int32_t*>(out + row.src_offset) = token;
          ++tail;
        }
        __syncwarp();
        // publish only new values: the receiver's last observation must be the last write, so
        // no stale tail lands in its buffer after it resets the rings for the next operation
        if (tail != published && lane == 0) {
          __threadfence_system();
          st_release_sys(remote_tail, tail);
        }
        published = tail;
      }
    }
    return;
  }
  for (int src = warp; src < R; src += blockDim.x >> 5) {
    const int count = p.meta[src * C + ch];
    const int64_t out_base = meta_prefix(p.meta, src * C + ch);
    const int* tail = word(c.peers[me], lay.ring_tail, ch * R + src);
    int* head = word(c.peers[me], lay.ring_head, ch * R + src);
    int consumed = 0;
    while (consumed < count) {
      const int available = wait_ring_data(w, tail, consumed, src, kIntranodeDispatchRecv, ch);
      if (available < 0) return;
      for (; consumed < available; ++consumed) {
        const uint8_t* in = c.peers[me] + ring_row_offset(lay, R, ch, src, consumed);
        const int64_t out = out_base + consumed;
        warp_copy16_comm(p.recv_x + out * hidden_bytes, in + row.x_offset, hidden_bytes, lane);
        const auto* scales = reinterpret_cast<const volatile float*>(in + row.scales_offset);
        for (int i = lane; i < num_scales; i += 32) p.recv_scales[out * num_scales + i] = scales[i];
        if (lane < K) {
          const int64_t expert = reinterpret_cast<const volatile int64_t*>(in + row.topk_offset)[lane];
          const int64_t local = localize_entry(expert, me, c.expert_to_rank, c.expert_to_local);
          p.recv_topk_idx[out * K + lane] = local;
          if (p.recv_topk_weights) {
            const float weight = reinterpret_cast<const volatile float*>(in + row.weights_offset)[lane];
            p.recv_topk_weights[out * K + lane] = local >= 0 ? weight : 0.0f;
          }
        }
        if (lane == 0) p.recv_src_idx[out] = *reinterpret_cast<const volatile int32_t*>(in + row.src_offset);
      }
      __syncwarp();
      if (lane == 0) st_release_sys(head, consumed);
    }
  }
}

// ---- combine ----------------------------------------------------------------------------------
__global__ void combine_barrier_kernel(IntranodeCommon c, RankSet<CombineRank> set) {
  const CombineRank& p = set.r[blockIdx.y];
  const IntranodeLayout lay = layout_of(c);
  reset_rings(c, lay, p.rank);
  rank_barrier(c, lay, p.rank, WaitCtx{p.record, c.timeout_ns, p.rank});
}

__device__ __forceinline__ void add_vec(float* acc, int4 v, __nv_bfloat16*) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}
__device__ __forceinline__ void add_vec(float* acc, int4 v, float*) {
  acc[0] += __int_as_float(v.x);
  acc[1] += __int_as_float(v.y);
  acc[2] += __int_as_float(v.z);
  acc[3] += __int_as_float(v.w);
}
__device__ __forceinline__ int4 pack_vec(const float* acc, __nv_bfloat16*) {
  int4 v;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&v);
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return v;
}
__device__ __forceinline__ int4 pack_vec(const float* acc, float*) {
  return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]),
                   __float_as_int(acc[3]));
}

constexpr int kCombineWarps = 8;  // tokens reduced at once by a receiver block; ring_slots >= this

template <class T>
__global__ void __launch_bounds__(kCombineWarps * 32)
combine_kernel(IntranodeCommon c, RankSet<CombineRank> set, int64_t hidden) {
  const CombineRank& p = set.r[blockIdx.y];
  const int me = p.rank, R = c.num_ranks, C = c.num_channels, K = c.num_topk;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const IntranodeLayout lay = layout_of(c);
  const int64_t hidden_bytes = hidden * static_cast<int64_t>(sizeof(T));
  const bool has_weights = p.topk_weights != nullptr;
  const RowLayout row = make_row_layout(hidden_bytes, 0, K, false, has_weights, false);
  const WaitCtx w{p.record, c.timeout_ns, me};
  const bool sender = blockIdx.x < C;
  const int ch = sender ? blockIdx.x : blockIdx.x - C;
  if (sender) {  // return the rows that arrived from `src` through channel ch, in order
    for (int src = warp; src < R; src += blockDim.x >> 5) {
      const int count = p.meta[src * C + ch];
      const int64_t first = meta_prefix(p.meta, src * C + ch);
      int* remote_tail = word(c.peers[src], lay.ring_tail, ch * R + me);
      const int* remote_head = word(c.peers[src], lay.ring_head, ch * R + me);
      int head_cache = 0;
      for (int i = 0; i < count; ++i) {
        if (!wait_ring_space(w, remote_tail, remote_head, i, head_cache, c.ring_slots, src,
                             kIntranodeCombineSend, ch))
          return;
        uint8_t* out = c.peers[src] + ring_row_offset(lay, R, ch, me, i);
        warp_copy16_ro(out + row.x_offset, p.x + (first + i) * hidden_bytes, hidden_bytes, lane);
        if (has_weights && lane < K)
          reinterpret_cast<float*>(out + row.weights_offset)[lane] = p.topk_weights[(first + i) * K + lane];
        if ((i & 7) == 7 || i + 1 == count) {
          __syncwarp();
          if (lane == 0) {
            __threadfence_system();
            st_release_sys(remote_tail, i + 1);
          }
        }
      }
    }
    return;
  }
  // receiver: tokens of channel ch, kCombineWarps at a time, one warp per token
  __shared__ int position[kCombineWarps][kMaxRanks];
  __shared__ int consumed[kMaxRanks];
  __shared__ int abort_flag;
  if (threadIdx.x < R) consumed[threadIdx.x] = 0;
  if (threadIdx.x == 0) abort_flag = 0;
  __syncthreads();
  const Range range = channel_range(p.num_tokens, C, ch);
  for (int base = range.begin; base < range.end; base += kCombineWarps) {
    if (threadIdx.x < R) {
      const int r = threadIdx.x;
      int next = consumed[r];
      for (int j = 0; j < kCombineWarps; ++j) {
        const int t = base + j;
        position[j][r] = (t < range.end && p.is_token_in_rank[int64_t(t) * R + r]) ? next++ : -1;
      }
    }
    __syncthreads();
    const int token = base + warp;
    if (token < range.end) {
      bool ok = true;
      for (int r = 0; r < R && ok; ++r) {
        const int pos = position[warp][r];
        if (pos >= 0) ok = wait_ring_data(w, word(c.peers[me], lay.ring_tail, ch * R + r), pos, r,
                                          kIntranodeCombineRecv, ch) >= 0;
      }
      if (!ok) {
        if (lane == 0) abort_flag = 1;
      } else {
        int4* out = reinterpret_cast<int4*>(p.combined_x + token * hidden_bytes);
        for (int64_t v = lane; v < hidden_bytes / 16; v += 32) {
          float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          for (int r = 0; r < R; ++r) {
            const int pos = position[warp][r];
            if (pos < 0) continue;
            const uint8_t* in = c.peers[me] + ring_row_offset(lay, R, ch, r, pos) + row.x_offset;
            add_vec(acc, ld_volatile_int4(reinterpret_cast<const int4*>(in) + v), static_cast<T*>(nullptr));
          }
          out[v] = pack_vec(acc, static_cast<T*>(nullptr));
        }
        if (p.combined_topk_weights && lane < K) {
          float sum = 0.0f;
          for (int r = 0; r < R; ++r) {
            const int pos = position[warp][r];
            if (pos < 0 || !has_weights) continue;
            const uint8_t* in = c.peers[me] + ring_row_offset(lay, R, ch, r, pos) + row.weights_offset;
            sum += reinterpret_cast<const volatile float*>(in)[lane];
          }
          p.combined_topk_weights[int64_t(token) * K + lane] = sum;
        }
      }
    }
    __syncthreads();
    if (abort_flag) return;
    if (threadIdx.x < R) {
      const int r = threadIdx.x;
      int next = consumed[r];
      for (int j = 0; j < kCombineWarps; ++j) next += position[j][r] >= 0;
      consumed[r] = next;
      st_release_sys(word(c.peers[me], lay.ring_head, ch * R + r), next);
    }
    __syncthreads();
  }
}

template <class T>
RankSet<T> to_set(const T* ranks, int n) {
  RankSet<T> set{};
  for (int i = 0; i < n && i < kMaxRanks; ++i) set.r[i] = ranks[i];
  return set;
}

}  // namespace

void launch_intranode_notify(const IntranodeCommon& c, const NotifyRank* ranks, int num_virtual,
                             void* stream) {
  notify_kernel<<<dim3(1, num_virtual), 256, 0, static_cast<cudaStream_t>(stream)>>>(c, to_set(ranks, num_virtual));
}

void launch_intranode_dispatch(const IntranodeCommon& c, const DispatchRank* ranks, int num_virtual,
                               int64_t hidden_bytes, int num_scales, int threads_per_block,
                               void* stream) {
  const int threads = threads_per_block >= 32 * c.num_ranks ? threads_per_block : 32 * c.num_ranks;
  dispatch_kernel<<<dim3(2 * c.num_channels, num_virtual), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      c, to_set(ranks, num_virtual), hidden_bytes, num_scales);
}

void launch_intranode_combine(const IntranodeCommon& c, const CombineRank* ranks, int num_virtual,
                              int64_t hidden, int dtype, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const auto set = to_set(ranks, num_virtual);
  combine_barrier_kernel<<<dim3(1, num_virtual), 64, 0, s>>>(c, set);
  const dim3 grid(2 * c.num_channels, num_virtual);
  if (dtype == 0) combine_kernel<__nv_bfloat16><<<grid, kCombineWarps * 32, 0, s>>>(c, set, hidden);
  else combine_kernel<float><<<grid, kCombineWarps * 32, 0, s>>>(c, set, hidden);
}

}  // namespace ep_comm::cuda
