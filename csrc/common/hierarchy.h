// Two-hop (node-aware) routing arithmetic shared by csrc/cuda/internode*.cu and the CPU tests.
// Each function mirrors a piece of ep_comm/plan.py (NodeTopology, forward_counts,
// node_receive_order) or ep_comm/layout.py (token_node_mask); tests/test_hierarchy_host.py checks
// them against those.
//
// Conventions: R ranks form G = R / P nodes of P consecutive ranks; rank r is local rank r % P of
// node r / P. A token goes once to every node holding one of its target ranks, to the forwarding
// peer (same local index as the source), which forwards it to its target ranks inside the node.
// node_counts is the receiver's [P][G] table: rows forwarded by local rank l that came from node g
// (source rank g * P + l). Rows arrive grouped by (forwarder l, source node g, token) and are
// stored in contract order (source rank, token).
#pragma once
#include "hd.h"

namespace ep_comm {

struct NodeShape {
  int num_ranks;
  int ranks_per_node;
};

EP_HD int node_of(NodeShape s, int rank) { return rank / s.ranks_per_node; }
EP_HD int local_of(NodeShape s, int rank) { return rank % s.ranks_per_node; }
EP_HD int num_nodes(NodeShape s) { return s.num_ranks / s.ranks_per_node; }

// The rank of dst_node that receives src_rank's tokens over the network and forwards them.
EP_HD int forwarding_peer(NodeShape s, int src_rank, int dst_node) {
  return dst_node * s.ranks_per_node + local_of(s, src_rank);
}

// True when the token (one row of is_token_in_rank, R bools) goes to some rank of `node`.
EP_HD bool token_in_node(NodeShape s, const bool* in_rank_row, int node) {
  for (int j = 0; j < s.ranks_per_node; ++j)
    if (in_rank_row[node * s.ranks_per_node + j]) return true;
  return false;
}

// Local target ranks of the token on `node` as a bit mask (bit j: local rank j); P <= 32.
EP_HD uint32_t node_target_bits(NodeShape s, const bool* in_rank_row, int node) {
  uint32_t bits = 0;
  for (int j = 0; j < s.ranks_per_node; ++j)
    if (in_rank_row[node * s.ranks_per_node + j]) bits |= 1u << j;
  return bits;
}

// Offset, in arrival order, of the rows forwarded by local rank l from source node g.
EP_HD int64_t arrival_offset(const int64_t* node_counts, int num_nodes_, int l, int g) {
  int64_t at = 0;
  for (int i = 0; i < l * num_nodes_ + g; ++i) at += node_counts[i];
  return at;
}

// Offset, in contract order (source rank g * P + l, then token), of the same rows: where the
// forwarder writes them on the receiver.
EP_HD int64_t contract_offset(const int64_t* node_counts, NodeShape s, int l, int g) {
  const int G = num_nodes(s);
  int64_t at = 0;
  for (int src = 0; src < g * s.ranks_per_node + l; ++src)
    at += node_counts[local_of(s, src) * G + node_of(s, src)];
  return at;
}

// Symmetric (NVSHMEM) buffer of one rank for the two-hop dispatch, G nodes of P ranks, rows of
// row_bytes (a multiple of 16) moved as opaque bytes:
//   uint64 rail_signal[G]                    round value set by the put from source node g
//   int32  node_flag[P][G]                   round value set by forwarder l after node g's rows
//   rows   rail_stage[G][rail_rows]          rows from the rail peer on node g (hop 1)
//   rows   node_stage[P][node_rows]          rows forwarded by local rank l (hop 2), grouped by
//                                            source node then token
//   uint64 barrier[R]                        round value PE r reached the call's closing barrier
//                                            with (one PE per rank; virtual ranks use [0] of
//                                            rank 0's buffer)
// Every region starts 128-byte aligned. row_bytes is the capacity: a call may pack smaller rows
// (its payload_bytes) at that smaller stride inside each region. The combine
// (csrc/cuda/internode_two_hop_combine.cu) runs the regions the other way: node_stage[j] and
// node_flag[j][g] on a forwarder hold what local rank j returns, rail_stage[g] and
// rail_signal[g] on a source what node g's forwarder sends back.
struct TwoHopLayout {
  int64_t rail_signal, node_flag, rail_stage, node_stage, barrier, total_bytes;
  int64_t rail_rows, node_rows, row_bytes;
};
EP_HD TwoHopLayout make_two_hop_layout(NodeShape s, int64_t rail_rows, int64_t node_rows,
                                       int64_t row_bytes) {
  const int64_t G = num_nodes(s), P = s.ranks_per_node, region = 128;
  TwoHopLayout l{};
  int64_t at = 0;
  l.rail_signal = at;
  at = align_up(at + 8 * G, region);
  l.node_flag = at;
  at = align_up(at + 4 * P * G, region);
  l.rail_stage = at;
  at = align_up(at + G * rail_rows * row_bytes, region);
  l.node_stage = at;
  at = align_up(at + P * node_rows * row_bytes, region);
  l.barrier = at;
  at = align_up(at + 8 * G * P, region);
  l.total_bytes = at;
  l.rail_rows = rail_rows;
  l.node_rows = node_rows;
  l.row_bytes = row_bytes;
  return l;
}

}  // namespace ep_comm
