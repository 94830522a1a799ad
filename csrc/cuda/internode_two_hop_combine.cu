// Two-hop (node-aware) combine over NVSHMEM: the reverse of internode_two_hop.cu, reducing inside
// the node before crossing the network. Sums are float32 in the order ep_comm/hierarchical.py's
// combine uses (local rank ascending on the forwarder, node ascending on the source), so the
// result matches it; the plan arrays are the dispatch's NodePlan read backwards (TwoHopEngine).
//
// Buffer: the dispatch's TwoHopLayout (csrc/common/hierarchy.h); the regions change direction:
//   node_stage[j] on a forwarder: rows returned by local rank j, at the slots j received them in
//   node_flag[j][g] on a forwarder: round value set by local rank j after its rows of node g
//   rail_stage[g] on a source: the partial sums of node g's forwarder, in the source's send order
//   rail_signal[g] on a source: round value set by the put from node g
// One call, grid.y = virtual rank:
//   node_return:    block (l, g) copies the rows that forwarder l brought from node g back into
//                   l's node_stage[my local] (NVLink peer pointer), then releases node_flag.
//   rail_reduce:    block g waits (bounded) for node_flag[*][g], sums each rail row of node g
//                   over the local ranks that got it into `partial` (payload dtype), and puts
//                   those rows with a signal into rail_stage[my node] of the source rank.
//   source_reduce:  every block waits (bounded) for all G rail signals, then each warp sums a
//                   token's partial rows over nodes into combined_x / combined_weights.
// A bounded barrier of all PEs on the stream ends the call (stage reuse).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "launch.h"
#include "two_hop_device.h"

#if defined(EP_COMM_WITH_NVSHMEM)
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace ep_comm::cuda {

#if defined(EP_COMM_WITH_NVSHMEM)
namespace {

using CombineSet = TwoHopRankSet<TwoHopCombineRank>;

__device__ __forceinline__ float load_elem(const uint8_t* row, int64_t h, int dtype) {
  if (dtype == 0) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[h]);
  return reinterpret_cast<const float*>(row)[h];
}
__device__ __forceinline__ void store_elem(uint8_t* row, int64_t h, int dtype, float v) {
  if (dtype == 0) reinterpret_cast<__nv_bfloat16*>(row)[h] = __float2bfloat16_rn(v);
  else reinterpret_cast<float*>(row)[h] = v;
}

// One warp: out = sum over e in [0, n) of the rows at base + rows[e] * pb, in that order, in
// float32 (x rounded to the payload dtype once at the end; weights stay float32).
__device__ void reduce_rows(const TwoHopCombineFormat& f, uint8_t* out_x, float* out_w,
                            const uint8_t* base, const int64_t* rows, int64_t n, int64_t pb,
                            int lane) {
  for (int64_t h = lane; h < f.hidden; h += 32) {
    float acc = 0.0f;
    for (int64_t e = 0; e < n; ++e) acc += load_elem(base + rows[e] * pb, h, f.dtype);
    store_elem(out_x, h, f.dtype, acc);
  }
  if (out_w == nullptr) return;
  for (int k = lane; k < f.num_weights; k += 32) {
    float acc = 0.0f;
    for (int64_t e = 0; e < n; ++e)
      acc += reinterpret_cast<const float*>(base + rows[e] * pb + f.weights_offset)[k];
    out_w[k] = acc;
  }
}

__global__ void node_return_kernel(TwoHopCommon c, CombineSet set) {
  const TwoHopCombineRank& a = set.r[blockIdx.y];
  const NodeShape shape = shape_of(c);
  const TwoHopLayout l = layout_of(c);
  const int G = num_nodes(shape), fwd = blockIdx.x / G, g = blockIdx.x % G;
  const int me_local = local_of(shape, a.rank);
  const int64_t pb = c.payload_bytes;
  uint8_t* stage = a.node_peers[fwd] + l.node_stage + static_cast<int64_t>(me_local) * l.node_rows * pb;
  const int64_t first_of_fwd = a.ret_offsets[fwd * G];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t i = a.ret_offsets[blockIdx.x] + warp; i < a.ret_offsets[blockIdx.x + 1]; i += warps)
    copy_row(stage + (i - first_of_fwd) * pb, a.x + a.ret_row[i] * pb, pb, lane, 32);
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    auto* flag = reinterpret_cast<int*>(a.node_peers[fwd] + l.node_flag) + me_local * G + g;
    st_release_sys(flag, static_cast<int>(c.round_value));
  }
}

__global__ void rail_reduce_kernel(TwoHopCommon c, TwoHopCombineFormat f, CombineSet set) {
  const TwoHopCombineRank& a = set.r[blockIdx.y];
  const NodeShape shape = shape_of(c);
  const TwoHopLayout l = layout_of(c);
  const int G = num_nodes(shape), g = blockIdx.x;
  const int me_node = node_of(shape, a.rank), me_local = local_of(shape, a.rank);
  const int64_t pb = c.payload_bytes;
  const WaitCtx w{a.record, c.timeout_ns, a.rank};
  uint8_t* mine = rank_buffer(c, a.rank);
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    const int* flags = reinterpret_cast<const int*>(mine + l.node_flag);
    for (int j = 0; j < c.ranks_per_node && ok; ++j)
      ok = wait_geq(w, flags + j * G + g, static_cast<int>(c.round_value),
                    me_node * c.ranks_per_node + j, kInternodeCombineNodeRecv, g);
  }
  __syncthreads();
  if (!ok) return;
  const uint8_t* stage = mine + l.node_stage;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t first = a.rail_offsets[g], rows = a.rail_offsets[g + 1] - first;
  for (int64_t s = first + warp; s < first + rows; s += warps) {
    uint8_t* out = a.partial + s * pb;
    reduce_rows(f, out, f.num_weights ? reinterpret_cast<float*>(out + f.weights_offset) : nullptr,
                stage, a.red_stage_row + a.red_offsets[s], a.red_offsets[s + 1] - a.red_offsets[s], pb,
                lane);
  }
  __threadfence_system();
  __syncthreads();
  const int source = g * c.ranks_per_node + me_local;
  uint8_t* buffer = rank_buffer(c, source);
  uint8_t* dst = buffer + l.rail_stage + static_cast<int64_t>(me_node) * l.rail_rows * pb;
  auto* signal = reinterpret_cast<uint64_t*>(buffer + l.rail_signal) + me_node;
  put_rows_with_signal(c, dst, a.partial + first * pb, rows, pb, signal, source);
}

__global__ void source_reduce_kernel(TwoHopCommon c, TwoHopCombineFormat f, CombineSet set) {
  const TwoHopCombineRank& a = set.r[blockIdx.y];
  const NodeShape shape = shape_of(c);
  const TwoHopLayout l = layout_of(c);
  const int G = num_nodes(shape);
  const int64_t pb = c.payload_bytes;
  const int64_t x_bytes = f.hidden * (f.dtype == 0 ? 2 : 4);
  const WaitCtx w{a.record, c.timeout_ns, a.rank};
  const uint8_t* mine = rank_buffer(c, a.rank);
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    const auto* signals = reinterpret_cast<const unsigned long long*>(mine + l.rail_signal);
    for (int g = 0; g < G && ok; ++g)
      ok = wait_signal(w, signals + g, c.round_value, forwarding_peer(shape, a.rank, g),
                       kInternodeCombineRailRecv, g);
  }
  __syncthreads();
  if (!ok) return;
  const uint8_t* stage = mine + l.rail_stage;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < a.num_tokens;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    float* out_w = a.combined_weights ? a.combined_weights + t * f.num_weights : nullptr;
    reduce_rows(f, a.combined_x + t * x_bytes, out_w, stage, a.src_stage_row + a.src_offsets[t],
                a.src_offsets[t + 1] - a.src_offsets[t], pb, lane);
  }
}

}  // namespace

void launch_two_hop_combine(const TwoHopCommon& c, const TwoHopCombineFormat& f,
                            const TwoHopCombineRank* ranks, int num_virtual, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const int G = c.num_ranks / c.ranks_per_node;
  const CombineSet set = two_hop_set(ranks, num_virtual);
  int64_t most = 0;
  for (int i = 0; i < num_virtual; ++i) most = ranks[i].num_tokens > most ? ranks[i].num_tokens : most;
  const int blocks = static_cast<int>(most / 8 + 1 < 132 ? most / 8 + 1 : 132);
  EP_LAUNCH(node_return_kernel, dim3(c.ranks_per_node * G, num_virtual), 256, s)(c, set);
  EP_LAUNCH(rail_reduce_kernel, dim3(G, num_virtual), 512, s)(c, f, set);
  EP_LAUNCH(source_reduce_kernel, dim3(blocks, num_virtual), 256, s)(c, f, set);
  two_hop_end_barrier(c, ranks[0].record, s);
}

#else  // built without NVSHMEM: the two-hop path reports itself unavailable (nvshmem_built())

void launch_two_hop_combine(const TwoHopCommon&, const TwoHopCombineFormat&, const TwoHopCombineRank*,
                            int, void*) {}

#endif

}  // namespace ep_comm::cuda
