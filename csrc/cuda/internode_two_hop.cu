// Two-hop (node-aware) dispatch over NVSHMEM: every token crosses the network once per destination
// node, to the forwarding peer (same local index as the source), which forwards it over NVLink to
// its target ranks inside the node. The plan (which rows go where, slots, receive order) is
// ep_comm/plan.py's NodePlan, computed before the launch; these kernels move opaque rows.
//
// Buffer: TwoHopLayout (csrc/common/hierarchy.h), addressed as two_hop_launch.h says (one PE per
// rank, or virtual ranks of one PE). One call, grid.y = virtual rank:
//   rail_put:    block g puts the rows for node g into rail_stage[my node] of the forwarding peer
//                (nvshmemx_putmem_signal_nbi_block; IBGDA when the NIC supports it, NVSHMEM's other
//                transports otherwise) and sets rail_signal[my node] there to the round value.
//   forward:     block g waits (bounded) for rail_signal[g], copies each entry's row to its target's
//                node_stage[my local] through the NVLink peer pointer, then releases
//                node_flag[my local][g] on every local rank of the node.
//   node_gather: every block waits (bounded) for all P x G node flags, then copies rows out in
//                contract order.
// A bounded barrier of all PEs on the stream ends the call, so the next round may reuse the stages. With virtual
// ranks the three launches run in stream order, so every wait is already satisfied when it starts.
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

using DispatchSet = TwoHopRankSet<TwoHopDispatchRank>;

__global__ void rail_put_kernel(TwoHopCommon c, DispatchSet set) {
  const TwoHopDispatchRank& a = set.r[blockIdx.y];
  const NodeShape shape = shape_of(c);
  const TwoHopLayout l = layout_of(c);
  const int g = blockIdx.x;
  const int me_node = node_of(shape, a.rank);
  const int peer = forwarding_peer(shape, a.rank, g);
  const int64_t pb = c.payload_bytes;
  const int64_t first = a.rail_send_offsets[g], rows = a.rail_send_offsets[g + 1] - first;
  uint8_t* buffer = rank_buffer(c, peer);
  uint8_t* dst = buffer + l.rail_stage + static_cast<int64_t>(me_node) * l.rail_rows * pb;
  auto* signal = reinterpret_cast<uint64_t*>(buffer + l.rail_signal) + me_node;
  put_rows_with_signal(c, dst, a.send_rows + first * pb, rows, pb, signal, peer);
}

__global__ void forward_kernel(TwoHopCommon c, DispatchSet set) {
  const TwoHopDispatchRank& a = set.r[blockIdx.y];
  const NodeShape shape = shape_of(c);
  const TwoHopLayout l = layout_of(c);
  const int g = blockIdx.x;
  const int me_local = local_of(shape, a.rank);
  const int64_t pb = c.payload_bytes;
  const WaitCtx w{a.record, c.timeout_ns, a.rank};
  uint8_t* mine = rank_buffer(c, a.rank);
  __shared__ int ok;
  if (threadIdx.x == 0) {
    const auto* signal = reinterpret_cast<const unsigned long long*>(mine + l.rail_signal) + g;
    ok = wait_signal(w, signal, c.round_value, forwarding_peer(shape, a.rank, g), kInternodeRailRecv, g);
  }
  __syncthreads();
  if (!ok) return;
  const uint8_t* rail = mine + l.rail_stage + static_cast<int64_t>(g) * l.rail_rows * pb;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t e = a.fwd_offsets[g] + warp; e < a.fwd_offsets[g + 1]; e += warps) {
    uint8_t* stage = a.node_peers[a.fwd_target[e]] + l.node_stage;
    uint8_t* dst = stage + (static_cast<int64_t>(me_local) * l.node_rows + a.fwd_slot[e]) * pb;
    copy_row(dst, rail + a.fwd_row[e] * pb, pb, lane, 32);
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < c.ranks_per_node) {
    auto* flag = reinterpret_cast<int*>(a.node_peers[threadIdx.x] + l.node_flag) +
                 me_local * num_nodes(shape) + g;
    st_release_sys(flag, static_cast<int>(c.round_value));
  }
}

__global__ void node_gather_kernel(TwoHopCommon c, DispatchSet set) {
  const TwoHopDispatchRank& a = set.r[blockIdx.y];
  const NodeShape shape = shape_of(c);
  const TwoHopLayout l = layout_of(c);
  const int G = num_nodes(shape);
  const int64_t pb = c.payload_bytes;
  const WaitCtx w{a.record, c.timeout_ns, a.rank};
  const uint8_t* mine = rank_buffer(c, a.rank);
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    const int* flags = reinterpret_cast<const int*>(mine + l.node_flag);
    for (int i = 0; i < c.ranks_per_node * G && ok; ++i) {
      const int peer = node_of(shape, a.rank) * c.ranks_per_node + i / G;
      ok = wait_geq(w, flags + i, static_cast<int>(c.round_value), peer, kInternodeNodeRecv, i % G);
    }
  }
  __syncthreads();
  if (!ok) return;
  const uint8_t* stage = mine + l.node_stage;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * warps + warp; i < a.num_recv_rows;
       i += static_cast<int64_t>(gridDim.x) * warps) {
    copy_row(a.recv_rows + i * pb, stage + a.recv_stage_row[i] * pb, pb, lane, 32);
  }
}

}  // namespace

void launch_two_hop_dispatch(const TwoHopCommon& c, const TwoHopDispatchRank* ranks,
                             int num_virtual, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const int G = c.num_ranks / c.ranks_per_node;
  const DispatchSet set = two_hop_set(ranks, num_virtual);
  int64_t most = 0;
  for (int i = 0; i < num_virtual; ++i) most = ranks[i].num_recv_rows > most ? ranks[i].num_recv_rows : most;
  const int blocks = static_cast<int>(most / 8 + 1 < 132 ? most / 8 + 1 : 132);
  EP_LAUNCH(rail_put_kernel, dim3(G, num_virtual), 128, s)(c, set);
  EP_LAUNCH(forward_kernel, dim3(G, num_virtual), 256, s)(c, set);
  EP_LAUNCH(node_gather_kernel, dim3(blocks, num_virtual), 256, s)(c, set);
  two_hop_end_barrier(c, ranks[0].record, s);
}

#else  // built without NVSHMEM: the two-hop path reports itself unavailable (nvshmem_built())

void launch_two_hop_dispatch(const TwoHopCommon&, const TwoHopDispatchRank*, int, void*) {}

#endif

}  // namespace ep_comm::cuda
