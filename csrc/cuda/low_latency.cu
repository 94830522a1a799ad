// Low-latency (decode) dispatch/combine: one-sided writes into per-expert slots, fixed capacity
// T = max_tokens per source rank, no host synchronisation, CUDA-graph safe (flags are reset by
// their consumer, never by a host-side counter). Each call is split into a send kernel and a
// receive kernel so that `return_recv_hook` leaves no SM spinning between the two.
//
// Buffer: LowLatencyLayout (csrc/common/buffer_layout.h). Peers are reached through c.peers[r]
// (NVLink / virtual ranks) or, where that is null, NVSHMEM puts into c.symmetric_base offsets.
//  dispatch send  (warp per global expert e): pairs (token, k) with topk == e, in (token, k)
//                 order, go to slot j of stage[local(e)][me] on owner(e), cast to e4m3 in-kernel
//                 when use_fp8 (csrc/codec/fp8_core.h: bit-identical to codecs/fp8.py); then flag[local(e)][me] = count + 1.
//  dispatch recv  (block per local expert l): waits for every source's flag, resets it, packs
//                 the rows into recv_x[l] grouped by source rank (the plan's slot order).
//  combine send   (block per local expert l): row q of x[l] goes back to its source's
//                 combine_stage[token][k]; then combine_flag[e] = 1 on every source.
//  combine recv   (warp per token): waits for all combine flags, sums w[t,k] * row(t,k).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "../common/buffer_layout.h"
#include "../common/device_sync.h"
#include "../codec/fp8_core.h"
#include "../cuda_bindings/launchers.h"
#include "launch.h"

namespace ep_comm::cuda {

#if defined(EP_COMM_WITH_NVSHMEM)
// Defined in internode.cu (relocatable device code), so this file stays free of NVSHMEM's heavy
// headers and compiles in a few seconds.
__device__ void nvshmem_put_warp(uint8_t* symmetric_dst, const uint8_t* src, int64_t bytes, int pe);
__device__ void nvshmem_fenced_int_put(int* symmetric_flag, int value, int pe);
#endif

namespace {

constexpr int kWarps = 8;
constexpr unsigned kFull = 0xffffffffu;

struct Ranks {
  LowLatencyRank r[kMaxRanks];
};

__device__ __forceinline__ LowLatencyLayout layout_of(const LowLatencyCommon& c) {
  return make_low_latency_layout(c.num_ranks, c.max_local_experts, c.num_experts, c.max_tokens,
                                 c.num_topk, c.hidden);
}

// The peer table, staged in shared memory by each block (a kernel parameter array indexed by a
// runtime rank is copied to local memory): peers[r] is rank r's buffer, or null where NVSHMEM
// puts reach it; peers[kMaxRanks] is this rank's own buffer. A macro: a helper that took the
// parameter by reference would make the same copy.
#define EP_STAGE_PEERS(c, me, peers)                                                                  \
  do {                                                                                                \
    for (int r_ = threadIdx.x; r_ < kMaxRanks; r_ += blockDim.x) peers[r_] = nullptr;               \
    __syncthreads();                                                                                  \
    if (threadIdx.x == 0) {                                                                           \
      _Pragma("unroll") for (int r_ = 0; r_ < kMaxRanks; ++r_) if (r_ < (c).num_ranks) peers[r_] = (c).peers[r_]; \
    }                                                                                                 \
    __syncthreads();                                                                                  \
    if (threadIdx.x == 0) peers[kMaxRanks] = peers[me] ? peers[me] : (c).symmetric_base;            \
    __syncthreads();                                                                                  \
  } while (0)

// Where a row for `peer` at buffer offset `offset` is assembled: straight into the peer's buffer
// when it is load/store reachable, else into this warp's scratch row (then put_row).
__device__ __forceinline__ uint8_t* row_target(uint8_t* const* peers, const LowLatencyLayout& l, int peer,
                                               int64_t offset, int scratch) {
  if (peers[peer]) return peers[peer] + offset;
  return peers[kMaxRanks] + l.send_scratch + scratch * l.stage_row_bytes;
}
__device__ __forceinline__ void put_row(const LowLatencyCommon& c, uint8_t* const* peers, int peer, int64_t offset,
                                        const uint8_t* assembled, int64_t bytes) {
#if defined(EP_COMM_WITH_NVSHMEM)
  if (!peers[peer]) {
    __syncwarp();
    nvshmem_put_warp(c.symmetric_base + offset, assembled, bytes, peer);
  }
#endif
}
// Publishes flag `v` on `peer`: one release (cumulative over what this thread's warp or block
// ordered before it with __syncwarp / __syncthreads), or NVSHMEM's fenced put.
__device__ __forceinline__ void signal(const LowLatencyCommon& c, uint8_t* const* peers, int peer, int64_t offset,
                                       int v) {
  if (peers[peer]) {
    st_release_sys(reinterpret_cast<int*>(peers[peer] + offset), v);
    return;
  }
#if defined(EP_COMM_WITH_NVSHMEM)
  nvshmem_fenced_int_put(reinterpret_cast<int*>(c.symmetric_base + offset), v, peer);
#endif
}

// Writes token `token`'s row (header, bf16 payload or e4m3 + scales) at `out`.
__device__ __forceinline__ void write_row(int64_t H, const uint16_t* x_rows, LowLatencyFlags f, const LLRow& row,
                                          uint8_t* out, int token, int k, int lane) {
  const uint16_t* x = x_rows + token * H;
  if (lane == 0) {
    auto* header = reinterpret_cast<LLHeader*>(out);
    header->src_token = token;
    header->topk_slot = k;
  }
  if (!f.use_fp8) {
    warp_copy16_ro(out + row.payload_offset, x, 2 * H, lane);
    return;
  }
  auto* q = out + row.payload_offset;
  auto* scales = reinterpret_cast<float*>(out + row.scales_offset);
  for (int64_t g = 0; g < H / fp8::kGroup; ++g) {  // a warp per 128-channel group, 4 per lane
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(x + g * fp8::kGroup) + lane);
    const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    float amax = fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y)));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
    const float s = fp8::group_scale(amax, f.round_scale);
    const float v[4] = {a.x / s, a.y / s, b.x / s, b.y / s};
    uint32_t packed = 0;
    for (int i = 0; i < 4; ++i)
      packed |= uint32_t(fp8::float_to_e4m3(v[i])) << (8 * i);
    reinterpret_cast<uint32_t*>(q + g * fp8::kGroup)[lane] = packed;
    if (lane == 0) scales[g] = s;
  }
}

__global__ void __launch_bounds__(kWarps * 32) dispatch_send_kernel(LowLatencyCommon c, Ranks set,
                                                                      LowLatencyFlags f) {
  const LowLatencyRank& p = set.r[blockIdx.y];
  const int me = p.rank, K = c.num_topk, T = c.max_tokens;
  const int lane = threadIdx.x & 31;
  __shared__ uint8_t* peers[kMaxRanks + 1];
  EP_STAGE_PEERS(c, me, peers);
  const int expert = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (expert >= c.num_experts) return;
  const uint16_t* const x_rows = p.x;
  const int dst = c.expert_to_rank[expert], local = c.expert_to_local[expert];
  const LowLatencyLayout l = layout_of(c);
  const LLRow row = make_ll_row(c.hidden, f.use_fp8);
  const WaitCtx w{p.record, c.timeout_ns, me};
  int count = 0;
  for (int base = 0; base < p.num_tokens; base += 32) {
    const int t = base + lane;
    int hits = 0;
    if (t < p.num_tokens)
      for (int k = 0; k < K; ++k) hits += p.topk_idx[int64_t(t) * K + k] == expert;
    int prefix = hits;  // inclusive warp scan
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(kFull, prefix, o);
      if (lane >= o) prefix += v;
    }
    const int first = count + prefix - hits;
    unsigned pending = __ballot_sync(kFull, hits > 0);
    while (pending) {
      const int src_lane = __ffs(pending) - 1;
      pending &= pending - 1;
      const int token = base + src_lane;
      int slot = __shfl_sync(kFull, first, src_lane);
      for (int k = 0; k < K; ++k) {
        if (p.topk_idx[int64_t(token) * K + k] != expert) continue;
        if (slot >= T) {
          if (lane == 0) record_failure(w, kCapacityOverflow, dst, kPhaseNone, 0, expert);
          return;
        }
        const int64_t offset = ll_stage_row_offset(l, c.num_ranks, T, local, me, slot);
        uint8_t* out = row_target(peers, l, dst, offset, expert);
        write_row(c.hidden, x_rows, f, row, out, token, k, lane);
        put_row(c, peers, dst, offset, out, row.row_bytes);
        ++slot;
      }
    }
    count += __shfl_sync(kFull, prefix, 31);
  }
  __syncwarp();
  if (lane == 0) signal(c, peers, dst, l.dispatch_flag + 4LL * (local * c.num_ranks + me), count + 1);
}

__global__ void __launch_bounds__(kWarps * 32) dispatch_recv_kernel(LowLatencyCommon c, Ranks set,
                                                                      LowLatencyFlags f) {
  const LowLatencyRank& p = set.r[blockIdx.y];
  const int me = p.rank, R = c.num_ranks, T = c.max_tokens, local = blockIdx.x;
  __shared__ uint8_t* peers[kMaxRanks + 1];
  EP_STAGE_PEERS(c, me, peers);
  if (local >= p.num_local_experts) return;
  const LowLatencyLayout l = layout_of(c);
  const LLRow row = make_ll_row(c.hidden, f.use_fp8);
  const WaitCtx w{p.record, c.timeout_ns, me};
  uint8_t* base = peers[kMaxRanks];
  __shared__ int counts[kMaxRanks * 32], first[kMaxRanks * 32 + 1], ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  for (int s = threadIdx.x; s < R; s += blockDim.x) {
    int* flag = reinterpret_cast<int*>(base + l.dispatch_flag) + local * R + s;
    const int v = wait_nonzero(w, flag, s, kLowLatencyDispatchRecv, local);
    if (v == 0) ok = 0;
    counts[s] = v - 1;
    *flag = 0;
  }
  __syncthreads();
  if (!ok) return;
  if (threadIdx.x == 0) {
    first[0] = 0;
    for (int s = 0; s < R; ++s) first[s + 1] = first[s] + counts[s];
    p.recv_count[local] = first[R];
  }
  __syncthreads();
  for (int s = threadIdx.x; s < R; s += blockDim.x) {
    p.layout_range[(int64_t(local) * R + s) * 2] = first[s];
    p.layout_range[(int64_t(local) * R + s) * 2 + 1] = counts[s];
  }
  const int64_t H = c.hidden, capacity = int64_t(R) * T;
  const int64_t payload = f.use_fp8 ? H : 2 * H, groups = H / fp8::kGroup;
  const int lane = threadIdx.x & 31;
  for (int q = threadIdx.x >> 5; q < first[R]; q += kWarps) {
    int s = 0;
    while (q >= first[s + 1]) ++s;
    const uint8_t* in = base + ll_stage_row_offset(l, R, T, local, s, q - first[s]);
    const int64_t out = local * capacity + q;
    warp_copy16_comm(p.recv_x + out * payload, in + row.payload_offset, payload, lane);
    if (f.use_fp8) {
      const auto* scales = reinterpret_cast<const volatile float*>(in + row.scales_offset);
      for (int64_t g = lane; g < groups; g += 32) {
        if (f.use_ue8m0) reinterpret_cast<uint8_t*>(p.recv_scales)[out * groups + g] = fp8::ue8m0_of(scales[g]);
        else p.recv_scales[out * groups + g] = scales[g];
      }
    }
    if (lane == 0) {
      const auto* header = reinterpret_cast<const volatile LLHeader*>(in);
      p.recv_src_info[out] = header->src_token;
      p.recv_topk_slot[out] = header->topk_slot;
    }
  }
}

__global__ void __launch_bounds__(kWarps * 32) combine_send_kernel(LowLatencyCommon c, Ranks set) {
  const LowLatencyRank& p = set.r[blockIdx.y];
  const int me = p.rank, R = c.num_ranks, T = c.max_tokens, local = blockIdx.x;
  __shared__ uint8_t* peers[kMaxRanks + 1];
  EP_STAGE_PEERS(c, me, peers);
  if (local >= p.num_local_experts) return;
  const LowLatencyLayout l = layout_of(c);
  const int64_t H = c.hidden, capacity = int64_t(R) * T;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int scratch = c.num_experts + local * kWarps + warp;
  const int total = p.recv_count[local];
  for (int q = warp; q < total; q += kWarps) {
    int s = 0;
    while (s + 1 < R && q >= p.layout_range[(int64_t(local) * R + s + 1) * 2]) ++s;
    const int token = p.recv_src_info[local * capacity + q];
    const int k = p.recv_topk_slot[local * capacity + q];
    const int64_t offset = ll_combine_row_offset(l, c.num_topk, H, token, k);
    uint8_t* out = row_target(peers, l, s, offset, scratch);
    warp_copy16_ro(out, p.x + (local * capacity + q) * H, 2 * H, lane);
    put_row(c, peers, s, offset, out, 2 * H);
  }
  __syncthreads();
  __shared__ int global_expert;
  if (threadIdx.x == 0) global_expert = -1;
  __syncthreads();
  for (int e = threadIdx.x; e < c.num_experts; e += blockDim.x)
    if (c.expert_to_rank[e] == me && c.expert_to_local[e] == local) global_expert = e;
  __syncthreads();
  for (int s = threadIdx.x; s < R; s += blockDim.x)
    signal(c, peers, s, l.combine_flag + 4LL * global_expert, 1);
}

constexpr int kRegisterTopk = 8;  // top-k entries a combine_recv warp keeps in registers

// combine_recv for tokens with at most kRegisterTopk entries: the token's row addresses and weights
// are read once (lane k holds entry k, shuffled into registers), then every 16-byte vector issues
// the loads of all the token's rows before it sums them, k ascending.
__device__ __forceinline__ void combine_token_registers(const uint8_t* base, const LowLatencyLayout& l, int K,
                                                        int64_t H, int token, int64_t my_topk, float my_weight,
                                                        uint16_t* combined, int lane) {
  const int4* rows[kRegisterTopk];
  float weight[kRegisterTopk];
  unsigned active = 0;  // bit k: entry k is summed; inactive entries load a valid row, never used
  const int4* first = reinterpret_cast<const int4*>(base + ll_combine_row_offset(l, K, H, token, 0));
#pragma unroll
  for (int k = 0; k < kRegisterTopk; ++k) {
    const bool on = k < K && __shfl_sync(kFull, my_topk, k) >= 0;
    active |= unsigned(on) << k;
    weight[k] = __shfl_sync(kFull, my_weight, k);
    rows[k] = on ? first + k * (H / 8) : first;
  }
  for (int v = lane; v < H / 8; v += 32) {
    int4 raw[kRegisterTopk];
#pragma unroll
    for (int k = 0; k < kRegisterTopk; ++k) raw[k] = ld_volatile_int4(rows[k] + v);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < kRegisterTopk; ++k) {
      if (!(active >> k & 1u)) continue;
      const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw[k]);
      for (int i = 0; i < 4; ++i) {
        const float2 x = __bfloat1622float2(h[i]);
        acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(weight[k], x.x));  // no FMA: the reference's roundings
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(weight[k], x.y));
      }
    }
    int4 packed;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&packed);
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    st_int4(reinterpret_cast<int4*>(combined) + v, packed);
  }
}

// The same for more entries (up to 32): the token's weights and active entries staged in shared
// memory once, read from there per vector.
__device__ __forceinline__ void combine_token_shared(const uint8_t* base, const LowLatencyLayout& l, int K,
                                                     int64_t H, int token, int64_t my_topk, float my_weight,
                                                     float* weights, int* active, uint16_t* combined, int lane) {
  if (lane < K) {
    weights[lane] = my_weight;
    active[lane] = my_topk >= 0;
  }
  __syncwarp();
  const auto* rows = reinterpret_cast<const int4*>(base + ll_combine_row_offset(l, K, H, token, 0));
  for (int v = lane; v < H / 8; v += 32) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k0 = 0; k0 < K; k0 += kRegisterTopk) {  // kRegisterTopk rows' loads in flight at a time
      int4 raw[kRegisterTopk];
#pragma unroll
      for (int u = 0; u < kRegisterTopk; ++u)
        raw[u] = ld_volatile_int4(rows + (k0 + u < K ? k0 + u : K - 1) * (H / 8) + v);
#pragma unroll
      for (int u = 0; u < kRegisterTopk; ++u) {
        if (k0 + u >= K || !active[k0 + u]) continue;
        const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw[u]);
        for (int i = 0; i < 4; ++i) {
          const float2 x = __bfloat1622float2(h[i]);
          acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(weights[k0 + u], x.x));
          acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(weights[k0 + u], x.y));
        }
      }
    }
    int4 packed;
    auto* h = reinterpret_cast<__nv_bfloat162*>(&packed);
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    st_int4(reinterpret_cast<int4*>(combined) + v, packed);
  }
}

__global__ void __launch_bounds__(kWarps * 32) combine_recv_kernel(LowLatencyCommon c, Ranks set) {
  const LowLatencyRank& p = set.r[blockIdx.y];
  const int me = p.rank, K = c.num_topk;
  __shared__ uint8_t* peers[kMaxRanks + 1];
  EP_STAGE_PEERS(c, me, peers);
  const LowLatencyLayout l = layout_of(c);
  const WaitCtx w{p.record, c.timeout_ns, me};
  const uint8_t* base = peers[kMaxRanks];
  __shared__ int ok;
  __shared__ float weights[kWarps][32];
  __shared__ int active[kWarps][32];
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  for (int e = threadIdx.x; e < c.num_experts; e += blockDim.x) {
    const auto* flag = reinterpret_cast<const int*>(base + l.combine_flag) + e;
    if (!wait_nonzero(w, flag, c.expert_to_rank[e], kLowLatencyCombineRecv, e)) ok = 0;
  }
  __syncthreads();
  if (!ok) return;
  const int warp = threadIdx.x >> 5, token = blockIdx.x * kWarps + warp, lane = threadIdx.x & 31;
  if (token >= p.num_tokens) return;
  const int64_t H = c.hidden;
  const int64_t my_topk = lane < K ? p.topk_idx[int64_t(token) * K + lane] : -1;
  const float my_weight = lane < K ? p.topk_weights[int64_t(token) * K + lane] : 0.0f;
  uint16_t* combined = p.combined_x + token * H;
  if (K <= kRegisterTopk) combine_token_registers(base, l, K, H, token, my_topk, my_weight, combined, lane);
  else combine_token_shared(base, l, K, H, token, my_topk, my_weight, weights[warp], active[warp], combined, lane);
}

// Runs after every combine_recv block has seen the flags: re-arms them for the next call.
__global__ void combine_reset_kernel(LowLatencyCommon c, Ranks set) {
  const LowLatencyRank& p = set.r[blockIdx.y];
  __shared__ uint8_t* peers[kMaxRanks + 1];
  EP_STAGE_PEERS(c, p.rank, peers);
  const LowLatencyLayout l = layout_of(c);
  auto* flags = reinterpret_cast<int*>(peers[kMaxRanks] + l.combine_flag);
  for (int e = threadIdx.x; e < c.num_experts; e += blockDim.x) flags[e] = 0;
}

Ranks to_set(const LowLatencyRank* ranks, int n) {
  Ranks set{};
  for (int i = 0; i < n && i < kMaxRanks; ++i) set.r[i] = ranks[i];
  return set;
}

}  // namespace

void launch_low_latency_dispatch_send(const LowLatencyCommon& c, const LowLatencyRank* ranks,
                                      int num_virtual, LowLatencyFlags f, void* stream) {
  const dim3 grid((c.num_experts + kWarps - 1) / kWarps, num_virtual);
  EP_LAUNCH(dispatch_send_kernel, grid, kWarps * 32, static_cast<cudaStream_t>(stream))(c, to_set(ranks, num_virtual), f);
}
void launch_low_latency_dispatch_recv(const LowLatencyCommon& c, const LowLatencyRank* ranks,
                                      int num_virtual, LowLatencyFlags f, void* stream) {
  EP_LAUNCH(dispatch_recv_kernel, dim3(c.max_local_experts, num_virtual), kWarps * 32, static_cast<cudaStream_t>(stream))(c, to_set(ranks, num_virtual), f);
}
void launch_low_latency_combine_send(const LowLatencyCommon& c, const LowLatencyRank* ranks,
                                     int num_virtual, void* stream) {
  EP_LAUNCH(combine_send_kernel, dim3(c.max_local_experts, num_virtual), kWarps * 32, static_cast<cudaStream_t>(stream))(c, to_set(ranks, num_virtual));
}
void launch_low_latency_combine_recv(const LowLatencyCommon& c, const LowLatencyRank* ranks,
                                     int num_virtual, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const auto set = to_set(ranks, num_virtual);
  int max_tokens = 1;
  for (int i = 0; i < num_virtual; ++i) max_tokens = ranks[i].num_tokens > max_tokens ? ranks[i].num_tokens : max_tokens;
  EP_LAUNCH(combine_recv_kernel, dim3((max_tokens + kWarps - 1) / kWarps, num_virtual), kWarps * 32, s)(c, set);
  EP_LAUNCH(combine_reset_kernel, dim3(1, num_virtual), 256, s)(c, set);
}

}  // namespace ep_comm::cuda
