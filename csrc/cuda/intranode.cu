// Normal-mode dispatch/combine between up to 8 ranks that reach each other's memory directly
// (NVLink peers through CUDA IPC, or R virtual ranks of one process on one GPU).
//
// Buffers: each rank owns an IntranodeLayout buffer (csrc/common/buffer_layout.h) holding one
// ring per (channel c, source rank). Tokens are split into C contiguous channels; per rank a
// launch runs C sender blocks and C receiver blocks (grid.x = 2C, grid.y = virtual rank).
//  - sender block c, W warps per destination r (W = warps_per_peer, 1 to 3): walk channel c's tokens
//    in order; warp m of them writes the rows i = m mod W of those for rank r into sub-ring m of
//    ring (c, me) of rank r (buffer_layout.h), publishing its tail; waits for space via its head.
//  - receiver block c, W warps per source s: warp m drains sub-ring m of ring (c, s) into recv rows
//    ordered by source rank, then channel (= source token order), renumbering top-k ids to local
//    experts. Each (sender warp, receiver warp) pair is a ring of its own: no shared counters.
// The combine runs the rings the other way; its receiver sums, per token, the rows coming back
// from every rank the token went to. Every wait is bounded (csrc/common/device_sync.h).
// When a launch can address every rank's outputs (virtual ranks, or processes that mapped each
// other's tensors through CUDA IPC for the call), the direct-write kernels below skip the rings:
// rows go straight into the receivers' outputs, and the combine reads them from the senders' x.
// Sender and receiver blocks of one launch wait for each other, so the launchers refuse a grid that
// cannot be resident on the device at once (occupancy checked at launch) instead of spinning until
// the timeout.
//
// Memory order of a ring: the sender's lanes store rows, __syncwarp() orders those stores before
// lane 0's st.release.sys of the tail (one system fence per publish, every kPublishRows rows); the
// receiver's lane 0 spins on relaxed loads, acquires once, and __syncwarp() orders the other lanes'
// reads of the rows after that acquire. The head flows back the same way.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "../common/buffer_layout.h"
#include "../common/device_sync.h"
#include "../common/routing.h"
#include "../cuda_bindings/launchers.h"
#include "launch.h"

namespace ep_comm::cuda {
namespace {

constexpr int kPublishRows = 2;  // a sender publishes its ring tail at least every this many rows
constexpr int kIntranodeMaxThreads = 512;  // ring blocks: W warps per peer for R ranks, R * W <= 16

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
  __syncthreads();  // the block's earlier stores precede each thread's release below
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
  for (int i = threadIdx.x; i < c.num_channels * c.num_ranks * kMaxWarpsPerPeer; i += blockDim.x) {
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
  for (int e = threadIdx.x; e < c.num_experts; e += blockDim.x) {
    const int r = c.expert_to_rank[e];
    *word(c.peers[r], lay.expert_counts, me * L + c.expert_to_local[e]) = p.num_tokens_per_expert[e];
  }
  if (!rank_barrier(c, lay, me, w)) return;
  const int* counts = word(c.peers[me], lay.channel_counts, 0);
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) p.meta[i] = ld_relaxed_sys(counts + i);
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += ld_relaxed_sys(word(c.peers[me], lay.expert_counts, s * L + l));
    p.meta[R * C + l] = sum;
  }
  if (threadIdx.x == 0) {
    int total = 0;
    for (int i = 0; i < R * C; ++i) total += ld_relaxed_sys(counts + i);
    p.meta[R * C + L] = total;
  }
}

// Sender side of one ring: publishes `tail` (the rows written so far) with one release after
// __syncwarp() has ordered every lane's row stores before it. Whole warp.
__device__ __forceinline__ void publish_tail(int* remote_tail, int tail, int& published) {
  __syncwarp();
  if (tail != published && (threadIdx.x & 31) == 0) st_release_sys(remote_tail, tail);
  published = tail;
}

// Waits (lane 0 spins) until slot `tail` is free, publishing `tail` first so the receiver can make
// progress. Returns false on timeout (whole warp).
__device__ __forceinline__ bool wait_ring_space(const WaitCtx& w, int* remote_tail, const int* remote_head,
                                                int tail, int& published, int& head_cache, int slots, int peer,
                                                int phase, int channel) {
  if (tail - head_cache < slots) return true;
  publish_tail(remote_tail, tail, published);
  int ok = 1;
  if ((threadIdx.x & 31) == 0) {
    ok = wait_geq(w, remote_head, tail - slots + 1, peer, phase, channel);
    if (ok) head_cache = ld_relaxed_sys(remote_head);
  }
  ok = __shfl_sync(0xffffffffu, ok, 0);
  head_cache = __shfl_sync(0xffffffffu, head_cache, 0);
  __syncwarp();  // lane 0's acquire of the head precedes every lane's stores into the freed slots
  return ok != 0;
}

// Receiver side: waits (lane 0 spins) until ring tail > consumed; returns the tail, or -1 on
// timeout. __syncwarp() orders lane 0's acquire before every lane's reads of the rows.
__device__ __forceinline__ int wait_ring_data(const WaitCtx& w, const int* tail, int consumed,
                                              int peer, int phase, int channel) {
  int value = -1;
  if ((threadIdx.x & 31) == 0 && wait_geq(w, tail, consumed + 1, peer, phase, channel))
    value = ld_relaxed_sys(tail);
  value = __shfl_sync(0xffffffffu, value, 0);
  __syncwarp();
  return value;
}

__device__ __forceinline__ int64_t meta_prefix(const int32_t* meta, int index) {
  int64_t offset = 0;
  for (int i = 0; i < index; ++i) offset += meta[i];
  return offset;
}

// First byte of ring (channel, src) in the buffer at `base`; its slot s is at + s * row_bytes.
__device__ __forceinline__ uint8_t* ring_of(uint8_t* base, const IntranodeLayout& lay, int num_ranks,
                                            int channel, int src) {
  return base + ring_row_offset(lay, num_ranks, channel, src, 0);
}
__device__ __forceinline__ int next_slot(int slot, int slots) { return slot + 1 == slots ? 0 : slot + 1; }
// Word of sub-ring m of ring (channel, src) in the ring_tail or ring_head region at `region`.
__device__ __forceinline__ int* sub_ring_word(uint8_t* base, int64_t region, int num_ranks, int channel, int src,
                                              int m) {
  return word(base, region, (int64_t(channel) * num_ranks + src) * kMaxWarpsPerPeer + m);
}
// Rows of a ring's `total` that sub-ring m of W carries (rows i = m mod W).
__device__ __forceinline__ int sub_ring_rows(int total, int m, int W) { return total > m ? (total - m + W - 1) / W : 0; }

// ---- dispatch ---------------------------------------------------------------------------------
__global__ void __launch_bounds__(kIntranodeMaxThreads, 1)
dispatch_kernel(IntranodeCommon c, RankSet<DispatchRank> set, int64_t hidden_bytes, int num_scales) {
  const DispatchRank& p = set.r[blockIdx.y];
  const int me = p.rank, R = c.num_ranks, C = c.num_channels, K = c.num_topk;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const IntranodeLayout lay = layout_of(c);
  // every rank's rows have room for weights, whether or not this rank has any (a rank with no tokens
  // passes none): the sender writes them when it has them, the receiver reads them when asked to
  const RowLayout row = make_row_layout(hidden_bytes, num_scales, K, true, true, true);
  const WaitCtx w{p.record, c.timeout_ns, me};
  const int W = c.warps_per_peer, slots = static_cast<int>(c.ring_slots) / W;  // slots of a sub-ring
  const int64_t row_bytes = lay.row_bytes;
  const bool sender = blockIdx.x < C;
  const int ch = sender ? blockIdx.x : blockIdx.x - C;
  if (sender) {  // warp u: destination u % R, sub-ring u / R (the launcher gives every pair a warp)
    for (int u = warp; u < R * W; u += blockDim.x >> 5) {
      const int dst = u % R, m = u / R;
      const Range range = channel_range(p.num_tokens, C, ch);
      uint8_t* const peer = c.peers[dst];
      int* remote_tail = sub_ring_word(peer, lay.ring_tail, R, ch, me, m);
      const int* remote_head = sub_ring_word(peer, lay.ring_head, R, ch, me, m);
      uint8_t* const ring = ring_of(peer, lay, R, ch, me) + int64_t(m) * slots * row_bytes;
      int tail = 0, head_cache = 0, published = 0, slot = 0;
      int turn = 0;  // which sub-ring the next row for dst goes to
      for (int base = range.begin; base < range.end; base += 32) {
        const int t = base + lane;
        unsigned hits = __ballot_sync(0xffffffffu, t < range.end && p.is_token_in_rank[int64_t(t) * R + dst]);
        while (hits) {
          const int token = base + __ffs(hits) - 1;
          hits &= hits - 1;
          const bool mine = turn == m;
          turn = turn + 1 == W ? 0 : turn + 1;
          if (!mine) continue;
          if (!wait_ring_space(w, remote_tail, remote_head, tail, published, head_cache, slots, dst,
                               kIntranodeDispatchSend, ch))
            return;
          uint8_t* out = ring + slot * row_bytes;
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
          slot = next_slot(slot, slots);
          // publish only new values: the receiver's last observation must be the last write, so
          // no stale tail lands in its buffer after it resets the rings for the next operation
          if (tail - published >= kPublishRows) publish_tail(remote_tail, tail, published);
        }
      }
      publish_tail(remote_tail, tail, published);
    }
    return;
  }
  uint8_t* const own = c.peers[me];
  for (int u = warp; u < R * W; u += blockDim.x >> 5) {  // warp u: source u % R, sub-ring u / R
    const int src = u % R, m = u / R;
    const int count = sub_ring_rows(p.meta[src * C + ch], m, W);
    const int64_t out_base = meta_prefix(p.meta, src * C + ch) + m;  // row i of the sub-ring: + i * W
    const int* tail = sub_ring_word(own, lay.ring_tail, R, ch, src, m);
    int* head = sub_ring_word(own, lay.ring_head, R, ch, src, m);
    const uint8_t* const ring = ring_of(own, lay, R, ch, src) + int64_t(m) * slots * row_bytes;
    int consumed = 0, slot = 0;
    while (consumed < count) {
      const int available = wait_ring_data(w, tail, consumed, src, kIntranodeDispatchRecv, ch);
      if (available < 0) return;
      for (; consumed < available; ++consumed) {
        const uint8_t* in = ring + slot * row_bytes;
        slot = next_slot(slot, slots);
        const int64_t out = out_base + int64_t(consumed) * W;
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
      __syncwarp();  // every lane's reads of the slots precede their release
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

// One 16-byte vector of a combined row: the loads from every source the token went to are issued
// together (unrolled over kMaxRanks, inactive sources predicated off), then summed in rank order.
// Source r's row is at rows + slot[r] * row_vectors (slot[r] < 0: the token did not go to r).
template <class T>
__device__ __forceinline__ int4 reduce_vector(const int4* rows, const int (&slot)[kMaxRanks], int64_t row_vectors,
                                              int v) {
  int4 in[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r)
    if (slot[r] >= 0) in[r] = ld_volatile_int4(rows + slot[r] * row_vectors + v);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r)
    if (slot[r] >= 0) add_vec(acc, in[r], static_cast<T*>(nullptr));
  return pack_vec(acc, static_cast<T*>(nullptr));
}

// The receiver's per-block state (kernels stay plain functions for the CUDA emulation: their
// __shared__ variables live in the kernel, the template body gets them by reference).
struct CombineShared {
  int position[kCombineWarps][kMaxRanks];  // slot of each warp's token in each source's ring, or -1
  int consumed[kMaxRanks];
  int abort_flag;
};

template <class T>
__device__ __forceinline__ void combine_body(const IntranodeCommon& c, const CombineRank& p, int64_t hidden,
                                             CombineShared& sh) {
  const int me = p.rank, R = c.num_ranks, C = c.num_channels, K = c.num_topk;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const IntranodeLayout lay = layout_of(c);
  const int64_t hidden_bytes = hidden * static_cast<int64_t>(sizeof(T));
  const bool has_weights = p.topk_weights != nullptr;
  const RowLayout row = make_row_layout(hidden_bytes, 0, K, false, true, false);  // as dispatch's: room for weights
  const WaitCtx w{p.record, c.timeout_ns, me};
  const int W = c.warps_per_peer, ring_slots = static_cast<int>(c.ring_slots), slots = ring_slots / W;
  const int64_t row_bytes = lay.row_bytes;
  const bool sender = blockIdx.x < C;
  const int ch = sender ? blockIdx.x : blockIdx.x - C;
  if (sender) {  // return the rows that arrived from `src` through channel ch, in order; warp u:
                 // source u % R, sub-ring u / R (rows m, m + W, ...)
    for (int u = warp; u < R * W; u += blockDim.x >> 5) {
      const int src = u % R, m = u / R;
      const int count = sub_ring_rows(p.meta[src * C + ch], m, W);
      const int64_t first = meta_prefix(p.meta, src * C + ch) + m;  // row i of the sub-ring: + i * W
      uint8_t* const peer = c.peers[src];
      int* remote_tail = sub_ring_word(peer, lay.ring_tail, R, ch, me, m);
      const int* remote_head = sub_ring_word(peer, lay.ring_head, R, ch, me, m);
      uint8_t* const ring = ring_of(peer, lay, R, ch, me) + int64_t(m) * slots * row_bytes;
      int head_cache = 0, published = 0, slot = 0;
      for (int i = 0; i < count; ++i) {
        if (!wait_ring_space(w, remote_tail, remote_head, i, published, head_cache, slots, src,
                             kIntranodeCombineSend, ch))
          return;
        uint8_t* out = ring + slot * row_bytes;
        slot = next_slot(slot, slots);
        const int64_t row_index = first + int64_t(i) * W;
        warp_copy16_ro(out + row.x_offset, p.x + row_index * hidden_bytes, hidden_bytes, lane);
        if (has_weights && lane < K)
          reinterpret_cast<float*>(out + row.weights_offset)[lane] = p.topk_weights[row_index * K + lane];
        if (i + 1 - published >= kPublishRows) publish_tail(remote_tail, i + 1, published);
      }
      publish_tail(remote_tail, count, published);
    }
    return;
  }
  // receiver: tokens of channel ch, kCombineWarps at a time, one warp per token (the block's other
  // warps, there for the senders' W warps per peer, leave)
  if (warp >= kCombineWarps) return;
  auto& position = sh.position;
  auto& consumed = sh.consumed;
  int& abort_flag = sh.abort_flag;
  if (threadIdx.x < R) consumed[threadIdx.x] = 0;
  if (threadIdx.x == 0) abort_flag = 0;
  __syncthreads();
  uint8_t* const own = c.peers[me];
  const int vectors = static_cast<int>(hidden_bytes / 16);
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
      // the token's sources and their slots, once per token: row `pos` of ring (ch, r) is row
      // pos / W of its sub-ring pos % W, which holds slots [m * S / W, (m + 1) * S / W) of the ring,
      // and ring (ch, r) slots [r * S, (r + 1) * S) of the channel's rings, all in rows of row_bytes
      int slot[kMaxRanks];
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) {
        const int pos = r < R ? position[warp][r] : -1;
        const int i = pos / W, m = pos - i * W;
        slot[r] = pos >= 0 ? r * ring_slots + m * slots + i % slots : -1;
        if (pos >= 0 && ok)
          ok = wait_ring_data(w, sub_ring_word(own, lay.ring_tail, R, ch, r, m), i, r, kIntranodeCombineRecv, ch) >= 0;
      }
      const uint8_t* const rows = ring_of(own, lay, R, ch, 0);
      if (!ok) {
        if (lane == 0) abort_flag = 1;
      } else {
        int4* out = reinterpret_cast<int4*>(p.combined_x + token * hidden_bytes);
        const int4* x_rows = reinterpret_cast<const int4*>(rows + row.x_offset);
        for (int v = lane; v < vectors; v += 32) st_int4(out + v, reduce_vector<T>(x_rows, slot, row_bytes / 16, v));
        if (p.combined_topk_weights && lane < K) {
          float sum = 0.0f;
#pragma unroll
          for (int r = 0; r < kMaxRanks; ++r)
            if (slot[r] >= 0)
              sum += reinterpret_cast<const volatile float*>(rows + slot[r] * row_bytes + row.weights_offset)[lane];
          p.combined_topk_weights[int64_t(token) * K + lane] = sum;
        }
      }
    }
    __syncthreads();  // every warp's reads of the slots precede their release
    if (abort_flag) return;
    if (threadIdx.x < R) {
      const int r = threadIdx.x;
      int next = consumed[r];
      for (int j = 0; j < kCombineWarps; ++j) next += position[j][r] >= 0;
      consumed[r] = next;
    }
    __syncthreads();
    if (threadIdx.x < R * W) {  // sub-ring m of ring (ch, r) has given up its rows < consumed[r]
      const int r = threadIdx.x % R, m = threadIdx.x / R;
      st_release_sys(sub_ring_word(own, lay.ring_head, R, ch, r, m), sub_ring_rows(consumed[r], m, W));
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kIntranodeMaxThreads, 1)
combine_kernel_bf16(IntranodeCommon c, RankSet<CombineRank> set, int64_t hidden) {
  __shared__ CombineShared sh;
  combine_body<__nv_bfloat16>(c, set.r[blockIdx.y], hidden, sh);
}
__global__ void __launch_bounds__(kIntranodeMaxThreads, 1)
combine_kernel_f32(IntranodeCommon c, RankSet<CombineRank> set, int64_t hidden) {
  __shared__ CombineShared sh;
  combine_body<float>(c, set.r[blockIdx.y], hidden, sh);
}

// ---- direct writes: every rank's outputs addressable from this launch -----------------------------
// No ring and no waits: sender block c of rank `me`, warp per destination d, writes each of channel
// c's rows for d at its final place in d's outputs (the rows from every (source, channel) before
// (me, c), from d's meta, plus the row's index in the channel), and the combine's
// receiver reads each source's returned row where that source's x holds it. Each row is read once
// and written once: about 2 bytes of DRAM traffic per payload byte, where the ring costs 3 to 3.5.
// set.r[d] is rank d's entry for every rank d of the group; grid.y runs the entries local_begin ..
// local_begin + gridDim.y - 1 (every rank for virtual ranks; this process's one rank with a group,
// the others' entries then holding their tensors as mapped here through CUDA IPC). The kernels do
// not wait for anything: the caller orders them after the peers' outputs exist (dispatch) or their
// x is complete (combine), and orders the peers' later use of this rank's memory after them.

// Rows a rank receives from every (source, channel) before (src, channel): the first `index` =
// src * C + channel words of its meta (the notify's, or the dispatch handle's for a combine)
// summed by the warp.
__device__ __forceinline__ int64_t rows_before(const int32_t* meta, int index, int lane) {
  int64_t sum = 0;
  for (int i = lane; i < index; i += 32) sum += meta[i];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  return sum;
}

constexpr int kDirectMaxThreads = 512;  // 2 warps per destination for 8 ranks, 3 for up to 5

// W = (blockDim.x / 32) / R warps per destination (at least 1): warp w serves destination w % R and
// copies every W-th of its rows (the j-th row to warp j % W), all W walking the same tokens so each
// knows every row's place.
__global__ void __launch_bounds__(kDirectMaxThreads, 1)
dispatch_direct_kernel(IntranodeCommon c, RankSet<DispatchRank> set, int local_begin, int64_t hidden_bytes,
                       int num_scales) {
  const DispatchRank& p = set.r[local_begin + blockIdx.y];
  const int me = p.rank, R = c.num_ranks, C = c.num_channels, K = c.num_topk, ch = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const bool shared = warps >= 2 * R;  // several warps per destination (else a warp per one or more)
  const int per_dst = shared ? warps / R : 1;
  if (shared && warp >= per_dst * R) return;
  const int share = shared ? warp / R : 0;  // which of the destination's warps this is
  const int first_dst = shared ? warp % R : warp, dst_step = shared ? R : warps;
  const Range range = channel_range(p.num_tokens, C, ch);
  for (int dst = first_dst; dst < R; dst += dst_step) {
    const DispatchRank& q = set.r[dst];
    uint8_t* const recv_x = q.recv_x;
    float* const recv_scales = q.recv_scales;
    int64_t* const recv_topk_idx = q.recv_topk_idx;
    float* const recv_topk_weights = q.recv_topk_weights;
    int32_t* const recv_src_idx = q.recv_src_idx;
    int64_t out = rows_before(q.meta, me * C + ch, lane);
    int turn = 0;  // which of the destination's warps copies row `out`
    for (int base = range.begin; base < range.end; base += 32) {
      const int t = base + lane;
      unsigned hits = __ballot_sync(0xffffffffu, t < range.end && p.is_token_in_rank[int64_t(t) * R + dst]);
      for (; hits; hits &= hits - 1, ++out, turn = turn + 1 == per_dst ? 0 : turn + 1) {
        if (turn != share) continue;
        const int token = base + __ffs(hits) - 1;
        warp_copy16_ro(recv_x + out * hidden_bytes, p.x + token * hidden_bytes, hidden_bytes, lane);
        for (int i = lane; i < num_scales; i += 32)
          recv_scales[out * num_scales + i] = p.x_scales[int64_t(token) * num_scales + i];
        if (lane < K) {
          const int64_t local = localize_entry(p.topk_idx[int64_t(token) * K + lane], dst, c.expert_to_rank,
                                               c.expert_to_local);
          recv_topk_idx[out * K + lane] = local;
          if (recv_topk_weights)
            recv_topk_weights[out * K + lane] =
                local >= 0 && p.topk_weights ? p.topk_weights[int64_t(token) * K + lane] : 0.0f;
        }
        if (lane == 0) recv_src_idx[out] = token;
      }
    }
  }
}

// One 16-byte vector of a combined row read straight from the sources' rows (src[r] null: the token
// did not go to r): every load issued before the sums, in rank order as reduce_vector's.
template <class T>
__device__ __forceinline__ int4 reduce_vector_direct(const int4* const (&src)[kMaxRanks], int v) {
  int4 in[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r)
    if (src[r] != nullptr) in[r] = ld_nc_na_int4(src[r] + v);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r)
    if (src[r] != nullptr) add_vec(acc, in[r], static_cast<T*>(nullptr));
  return pack_vec(acc, static_cast<T*>(nullptr));
}

// The direct combine's per-block state: where each warp's token's row sits in each source's x.
struct DirectCombineShared {
  int64_t row[kCombineWarps][kMaxRanks];  // row of x on rank r, or -1
  int64_t next[kMaxRanks];                // the next row from rank r for this channel
};

// Receiver only (grid.x = C): block ch of rank me combines channel ch's tokens, a warp per token.
template <class T>
__device__ __forceinline__ void combine_direct_body(const IntranodeCommon& c, const RankSet<CombineRank>& set,
                                                    int local_begin, int64_t hidden, DirectCombineShared& sh) {
  const CombineRank& p = set.r[local_begin + blockIdx.y];
  const int me = p.rank, R = c.num_ranks, C = c.num_channels, K = c.num_topk, ch = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t hidden_bytes = hidden * static_cast<int64_t>(sizeof(T));
  const int vectors = static_cast<int>(hidden_bytes / 16);
  for (int r = warp; r < R; r += blockDim.x >> 5) {  // r's rows from (me, ch) start here in r's x
    const int64_t first = rows_before(set.r[r].meta, me * C + ch, lane);
    if (lane == 0) sh.next[r] = first;
  }
  __syncthreads();
  const Range range = channel_range(p.num_tokens, C, ch);
  for (int base = range.begin; base < range.end; base += kCombineWarps) {
    if (threadIdx.x < R) {
      const int r = threadIdx.x;
      int64_t next = sh.next[r];
      for (int j = 0; j < kCombineWarps; ++j) {
        const int t = base + j;
        sh.row[j][r] = (t < range.end && p.is_token_in_rank[int64_t(t) * R + r]) ? next++ : -1;
      }
      sh.next[r] = next;
    }
    __syncthreads();
    const int token = base + warp;
    if (token < range.end) {
      const int4* src[kMaxRanks];
      const float* weights[kMaxRanks];
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) {
        const int64_t row = r < R ? sh.row[warp][r] : -1;
        src[r] = row >= 0 ? reinterpret_cast<const int4*>(set.r[r].x + row * hidden_bytes) : nullptr;
        weights[r] = row >= 0 && set.r[r].topk_weights ? set.r[r].topk_weights + row * K : nullptr;
      }
      int4* out = reinterpret_cast<int4*>(p.combined_x + token * hidden_bytes);
      for (int v = lane; v < vectors; v += 32) st_int4(out + v, reduce_vector_direct<T>(src, v));
      if (p.combined_topk_weights && lane < K) {
        float sum = 0.0f;
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r)
          if (weights[r] != nullptr) sum += weights[r][lane];
        p.combined_topk_weights[int64_t(token) * K + lane] = sum;
      }
    }
    __syncthreads();  // every warp has read sh.row before the next tokens' rows replace it
  }
}

__global__ void __launch_bounds__(kCombineWarps * 32, 2)
combine_direct_kernel_bf16(IntranodeCommon c, RankSet<CombineRank> set, int local_begin, int64_t hidden) {
  __shared__ DirectCombineShared sh;
  combine_direct_body<__nv_bfloat16>(c, set, local_begin, hidden, sh);
}
__global__ void __launch_bounds__(kCombineWarps * 32, 2)
combine_direct_kernel_f32(IntranodeCommon c, RankSet<CombineRank> set, int local_begin, int64_t hidden) {
  __shared__ DirectCombineShared sh;
  combine_direct_body<float>(c, set, local_begin, hidden, sh);
}

// The launchers' co-residency check: every block of a launch must be resident at once (senders and
// receivers wait for each other). Refuses the launch (take_launch_error reports why) otherwise.
template <class Kernel>
bool fits_at_once(Kernel kernel, const char* what, int blocks, int threads) {
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess)
    return true;  // the launch itself reports the error
  if (blocks <= per_sm * sms) return true;
  refuse_launch(std::string(what) + ": a grid of " + std::to_string(blocks) + " blocks of " + std::to_string(threads) +
                " threads cannot be resident at once (" + std::to_string(per_sm) + " per SM x " +
                std::to_string(sms) + " SMs); its senders and receivers would wait for each other until the "
                "timeout: use fewer channels or fewer ranks per process");
  return false;
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
  EP_LAUNCH(notify_kernel, dim3(1, num_virtual), 256, static_cast<cudaStream_t>(stream))(c, to_set(ranks, num_virtual));
}

// The ring kernels give every (peer, sub-ring) pair a warp of its own: 32 * R * W threads, at most
// kIntranodeMaxThreads; and a combine receiver takes kCombineWarps rows of a ring at once, up to
// ceil(kCombineWarps / W) of them from one sub-ring, which must hold them. Refuses the launch
// otherwise.
static bool ring_warps_fit(const IntranodeCommon& c, const char* what) {
  const int W = c.warps_per_peer;
  const int64_t min_slots = W >= 1 ? W * int64_t((kCombineWarps + W - 1) / W) : 0;
  if (W >= 1 && W <= kMaxWarpsPerPeer && 32 * c.num_ranks * W <= kIntranodeMaxThreads && c.ring_slots >= min_slots)
    return true;
  refuse_launch(std::string(what) + ": warps_per_peer " + std::to_string(W) + " with " + std::to_string(c.num_ranks) +
                " ranks needs " + std::to_string(32 * c.num_ranks * W) + " threads per block (at most " +
                std::to_string(kIntranodeMaxThreads) + ") and at least " + std::to_string(min_slots) +
                " ring slots (has " + std::to_string(c.ring_slots) + ")");
  return false;
}

void launch_intranode_dispatch(const IntranodeCommon& c, const DispatchRank* ranks, int num_virtual,
                               int64_t hidden_bytes, int num_scales, int threads_per_block,
                               void* stream) {
  if (!ring_warps_fit(c, "intranode dispatch")) return;
  const int needed = 32 * c.num_ranks * c.warps_per_peer;
  int threads = threads_per_block >= needed ? threads_per_block : needed;
  threads = threads < kIntranodeMaxThreads ? threads : kIntranodeMaxThreads;
  const dim3 grid(2 * c.num_channels, num_virtual);
  if (!fits_at_once(dispatch_kernel, "intranode dispatch", 2 * c.num_channels * num_virtual, threads)) return;
  EP_LAUNCH(dispatch_kernel, grid, threads, static_cast<cudaStream_t>(stream))(
      c, to_set(ranks, num_virtual), hidden_bytes, num_scales);
}

void launch_intranode_combine(const IntranodeCommon& c, const CombineRank* ranks, int num_virtual,
                              int64_t hidden, int dtype, void* stream) {
  if (!ring_warps_fit(c, "intranode combine")) return;
  auto s = static_cast<cudaStream_t>(stream);
  const auto set = to_set(ranks, num_virtual);
  const dim3 grid(2 * c.num_channels, num_virtual);
  const int blocks = 2 * c.num_channels * num_virtual;
  // the receivers' kCombineWarps warps, or more for the senders' W warps per peer
  const int needed = 32 * c.num_ranks * c.warps_per_peer;
  const int threads = needed > kCombineWarps * 32 ? needed : kCombineWarps * 32;
  if (dtype == 0 ? !fits_at_once(combine_kernel_bf16, "intranode combine", blocks, threads)
                 : !fits_at_once(combine_kernel_f32, "intranode combine", blocks, threads))
    return;
  EP_LAUNCH(combine_barrier_kernel, dim3(1, num_virtual), 64, s)(c, set);
  if (dtype == 0) EP_LAUNCH(combine_kernel_bf16, grid, threads, s)(c, set, hidden);
  else EP_LAUNCH(combine_kernel_f32, grid, threads, s)(c, set, hidden);
}

// Direct writes need an entry for every rank of the group, rank i at index i, and run the entries
// [local_begin, local_begin + num_local) of them.
static bool all_ranks_here(const char* what, int num_ranks, const int* ranks_of, int num_entries, int local_begin,
                           int num_local) {
  bool ok = num_entries == num_ranks;
  for (int i = 0; ok && i < num_entries; ++i) ok = ranks_of[i] == i;
  if (!ok) {
    refuse_launch(std::string(what) + ": direct writes need an entry for every rank of the group, rank i at "
                  "index i (" + std::to_string(num_entries) + " entries for " + std::to_string(num_ranks) +
                  " ranks); use the ring kernels");
    return false;
  }
  if (local_begin < 0 || num_local < 1 || local_begin + num_local > num_entries) {
    refuse_launch(std::string(what) + ": the launched entries [" + std::to_string(local_begin) + ", " +
                  std::to_string(local_begin + num_local) + ") are not within the " + std::to_string(num_entries) +
                  " ranks");
    return false;
  }
  return true;
}

void launch_intranode_dispatch_direct(const IntranodeCommon& c, const DispatchRank* ranks, int num_entries,
                                      int local_begin, int num_local, int64_t hidden_bytes, int num_scales,
                                      int threads_per_block, void* stream) {
  int rank_of[kMaxRanks];
  for (int i = 0; i < num_entries && i < kMaxRanks; ++i) rank_of[i] = ranks[i].rank;
  if (!all_ranks_here("intranode direct dispatch", c.num_ranks, rank_of, num_entries, local_begin, num_local)) return;
  int threads = threads_per_block >= 32 * c.num_ranks ? threads_per_block : 32 * c.num_ranks;
  threads = threads < kDirectMaxThreads ? threads : kDirectMaxThreads;
  EP_LAUNCH(dispatch_direct_kernel, dim3(c.num_channels, num_local), threads, static_cast<cudaStream_t>(stream))(
      c, to_set(ranks, num_entries), local_begin, hidden_bytes, num_scales);
}

void launch_intranode_combine_direct(const IntranodeCommon& c, const CombineRank* ranks, int num_entries,
                                     int local_begin, int num_local, int64_t hidden, int dtype, void* stream) {
  int rank_of[kMaxRanks];
  for (int i = 0; i < num_entries && i < kMaxRanks; ++i) rank_of[i] = ranks[i].rank;
  if (!all_ranks_here("intranode direct combine", c.num_ranks, rank_of, num_entries, local_begin, num_local)) return;
  auto s = static_cast<cudaStream_t>(stream);
  const auto set = to_set(ranks, num_entries);
  const dim3 grid(c.num_channels, num_local);
  if (dtype == 0) EP_LAUNCH(combine_direct_kernel_bf16, grid, kCombineWarps * 32, s)(c, set, local_begin, hidden);
  else EP_LAUNCH(combine_direct_kernel_f32, grid, kCombineWarps * 32, s)(c, set, local_begin, hidden);
}

}  // namespace ep_comm::cuda
