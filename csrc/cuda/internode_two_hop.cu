// Two-hop (node-aware) dispatch over NVSHMEM: every token crosses the network once per destination
// node, to the forwarding peer (same local index as the source), which forwards it over NVLink to
// its target ranks inside the node. The plan (which rows go where, slots, receive order) is
// ep_comm/plan.py's NodePlan, computed before the launch; these kernels move opaque rows.
//
// Buffer: TwoHopLayout (csrc/common/hierarchy.h). One call:
//   rail_put:    block g puts the rows for node g into rail_stage[my node] of the forwarding peer
//                (nvshmemx_putmem_signal_nbi_block; IBGDA when the NIC supports it, NVSHMEM's other
//                transports otherwise) and sets rail_signal[my node] there to the round value.
//   forward:     block g waits (bounded) for rail_signal[g], copies each entry's row to its target's
//                node_stage[my local] through the NVLink peer pointer, then releases
//                node_flag[my local][g] on every local rank of the node.
//   node_gather: every block waits (bounded) for all P x G node flags, then copies rows out in
//                contract order.
// A barrier on the stream ends the call, so the next round may reuse the stages.
#include <cuda_runtime.h>

#include "../common/device_sync.h"
#include "../common/hierarchy.h"
#include "../cuda_bindings/two_hop_launch.h"

#if defined(EP_COMM_WITH_NVSHMEM)
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace ep_comm::cuda {

#if defined(EP_COMM_WITH_NVSHMEM)
namespace {

__device__ __forceinline__ void copy_row(uint8_t* dst, const uint8_t* src, int64_t row_bytes,
                                         int lane, int width) {
  auto* d = reinterpret_cast<int4*>(dst);
  const auto* s = reinterpret_cast<const int4*>(src);
  for (int64_t i = lane; i < row_bytes / 16; i += width) d[i] = s[i];
}

__global__ void rail_put_kernel(TwoHopDispatchArgs a, TwoHopLayout l) {
  const NodeShape shape{a.num_ranks, a.ranks_per_node};
  const int g = blockIdx.x;
  const int me_node = node_of(shape, a.my_rank);
  const int pe = forwarding_peer(shape, a.my_rank, g);
  const int64_t first = a.rail_send_offsets[g], rows = a.rail_send_offsets[g + 1] - first;
  uint8_t* dst = a.symmetric + l.rail_stage + static_cast<int64_t>(me_node) * l.rail_rows * l.row_bytes;
  auto* signal = reinterpret_cast<uint64_t*>(a.symmetric + l.rail_signal) + me_node;
  if (rows > 0) {
    nvshmemx_putmem_signal_nbi_block(dst, a.send_rows + first * l.row_bytes,
                                     static_cast<size_t>(rows * l.row_bytes), signal, a.round_value,
                                     NVSHMEM_SIGNAL_SET, pe);
  } else if (threadIdx.x == 0) {
    nvshmemx_signal_op(signal, a.round_value, NVSHMEM_SIGNAL_SET, pe);
  }
}

// Spins until the 64-bit signal reaches `value`; false (recorded) on timeout or failure elsewhere.
__device__ bool wait_signal(const WaitCtx& w, const unsigned long long* signal,
                            unsigned long long value, int peer, int phase, int detail) {
  const unsigned long long start = global_timer_ns();
  while (ld_acquire_sys_u64(signal) < value) {
    const unsigned long long now = global_timer_ns();
    if (failed(w)) return false;
    if (now - start > w.timeout_ns) {
      record_failure(w, kTimedOut, peer, phase, now - start, detail);
      return false;
    }
  }
  return true;
}

__global__ void forward_kernel(TwoHopDispatchArgs a, TwoHopLayout l) {
  const NodeShape shape{a.num_ranks, a.ranks_per_node};
  const int g = blockIdx.x;
  const int me_local = local_of(shape, a.my_rank);
  const WaitCtx w{a.record, a.timeout_ns, a.my_rank};
  __shared__ int ok;
  if (threadIdx.x == 0) {
    const auto* signal = reinterpret_cast<const unsigned long long*>(a.symmetric + l.rail_signal) + g;
    ok = wait_signal(w, signal, a.round_value, forwarding_peer(shape, a.my_rank, g), kInternodeRailRecv, g);
  }
  __syncthreads();
  if (!ok) return;
  const uint8_t* rail = a.symmetric + l.rail_stage + static_cast<int64_t>(g) * l.rail_rows * l.row_bytes;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t e = a.fwd_offsets[g] + warp; e < a.fwd_offsets[g + 1]; e += warps) {
    uint8_t* stage = a.node_peers[a.fwd_target[e]] + l.node_stage;
    uint8_t* dst = stage + (static_cast<int64_t>(me_local) * l.node_rows + a.fwd_slot[e]) * l.row_bytes;
    copy_row(dst, rail + a.fwd_row[e] * l.row_bytes, l.row_bytes, lane, 32);
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < a.ranks_per_node) {
    auto* flag = reinterpret_cast<int*>(a.node_peers[threadIdx.x] + l.node_flag) +
                 me_local * num_nodes(shape) + g;
    st_release_sys(flag, static_cast<int>(a.round_value));
  }
}

__global__ void node_gather_kernel(TwoHopDispatchArgs a, TwoHopLayout l) {
  const NodeShape shape{a.num_ranks, a.ranks_per_node};
  const int G = num_nodes(shape);
  const WaitCtx w{a.record, a.timeout_ns, a.my_rank};
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = 1;
    const int* flags = reinterpret_cast<const int*>(a.symmetric + l.node_flag);
    for (int i = 0; i < a.ranks_per_node * G && ok; ++i) {
      const int peer = node_of(shape, a.my_rank) * a.ranks_per_node + i / G;
      ok = wait_geq(w, flags + i, static_cast<int>(a.round_value), peer, kInternodeNodeRecv, i % G);
    }
  }
  __syncthreads();
  if (!ok) return;
  const uint8_t* stage = a.symmetric + l.node_stage;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * warps + warp; i < a.num_recv_rows;
       i += static_cast<int64_t>(gridDim.x) * warps) {
    copy_row(a.recv_rows + i * l.row_bytes, stage + a.recv_stage_row[i] * l.row_bytes, l.row_bytes,
             lane, 32);
  }
}

}  // namespace

void launch_two_hop_dispatch(const TwoHopDispatchArgs& a, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const NodeShape shape{a.num_ranks, a.ranks_per_node};
  const TwoHopLayout l = make_two_hop_layout(shape, a.rail_rows, a.node_rows, a.row_bytes);
  const int G = num_nodes(shape);
  rail_put_kernel<<<G, 128, 0, s>>>(a, l);
  forward_kernel<<<G, 256, 0, s>>>(a, l);
  const int blocks = static_cast<int>(a.num_recv_rows / 8 + 1 < 132 ? a.num_recv_rows / 8 + 1 : 132);
  node_gather_kernel<<<blocks, 256, 0, s>>>(a, l);
  nvshmemx_barrier_all_on_stream(s);
}

#else  // built without NVSHMEM: the two-hop path reports itself unavailable (nvshmem_built())

void launch_two_hop_dispatch(const TwoHopDispatchArgs&, void*) {}

#endif

}  // namespace ep_comm::cuda
