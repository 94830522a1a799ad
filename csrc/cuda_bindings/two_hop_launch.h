// Launch API of csrc/cuda/internode_two_hop.cu (the two-hop, node-aware dispatch over NVSHMEM),
// shared by the kernel (nvcc) and its binding (g++). Plain pointers and sizes, no torch or CUDA
// headers. The plan arrays come from ep_comm/plan.py (NodePlan); the kernels move opaque rows.
#pragma once
#include <cstdint>

namespace ep_comm::cuda {

constexpr int kMaxNodeRanks = 8;  // ranks per node the two-hop launch addresses over NVLink

struct TwoHopDispatchArgs {
  uint8_t* symmetric;                    // this PE's TwoHopLayout buffer (csrc/common/hierarchy.h)
  uint8_t* node_peers[kMaxNodeRanks];    // the same buffer of local rank j (nvshmem_ptr), [P]
  int num_ranks, ranks_per_node, my_rank;
  int64_t rail_rows, node_rows, row_bytes;  // the buffer's geometry (make_two_hop_layout)
  // hop 1 (source): rows packed by destination node, [S1, row_bytes]
  const uint8_t* send_rows;
  const int64_t* rail_send_offsets;  // [G + 1] row offsets per destination node (device)
  // hop 2 (forwarder): entries grouped by source node; entry e forwards row fwd_row[e] of
  // rail_stage[g] to slot fwd_slot[e] of node_stage[my local] on local rank fwd_target[e]
  const int64_t* fwd_offsets;  // [G + 1] entry offsets per source node (device)
  const int64_t* fwd_row;      // [S2]
  const int32_t* fwd_target;   // [S2]
  const int64_t* fwd_slot;     // [S2]
  // receive: out row i = node_stage row recv_stage_row[i] (= forwarder l * node_rows + slot)
  uint8_t* recv_rows;                 // [M, row_bytes]
  const int64_t* recv_stage_row;      // [M]
  int64_t num_recv_rows;
  unsigned long long round_value;     // monotone across calls
  unsigned long long timeout_ns;
  int32_t* record;                    // timeout record (csrc/common/timeout.h)
};

// Runs hop 1 (NVSHMEM put-with-signal to the forwarding peer of every node), hop 2 (NVLink
// forwarding inside the node through peer pointers, one flag per (forwarder, source node)) and
// the receive gather into contract order, then a barrier on the stream (stage reuse).
void launch_two_hop_dispatch(const TwoHopDispatchArgs& a, void* stream);

}  // namespace ep_comm::cuda
