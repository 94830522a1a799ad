// Launch API of csrc/cuda/internode_two_hop.cu (two-hop dispatch) and
// csrc/cuda/internode_two_hop_combine.cu (two-hop combine) over NVSHMEM, shared by the kernels
// (nvcc) and their binding (g++). Plain pointers and sizes, no torch or CUDA headers. The plan
// arrays come from ep_comm/plan.py (NodePlan, via ep_comm/backends/nvshmem.py's TwoHopEngine);
// the kernels move rows and, in the combine, sum them.
//
// Rank buffers (TwoHopLayout, csrc/common/hierarchy.h) live in NVSHMEM symmetric memory, addressed
// in one of two ways:
//   rank_stride == 0: one PE per rank; rank r is PE r and its buffer is `symmetric_base` on PE r.
//   rank_stride  > 0: every rank is a virtual rank of this one PE (tests, one GPU); rank r's
//                     buffer is symmetric_base + r * rank_stride, carved from one nvshmem_malloc,
//                     and puts to it target this PE (`my_pe`).
// Either way the stage regions hold rows packed at the call's `payload_bytes` stride; the layout's
// `row_bytes` is the capacity the regions were sized for (payload_bytes <= row_bytes).
#pragma once
#include <cstdint>

#include "launchers.h"

namespace ep_comm::cuda {

constexpr int kMaxNodeRanks = 8;  // ranks per node the two-hop launch addresses over NVLink

// What every rank of one launch shares.
struct TwoHopCommon {
  uint8_t* symmetric_base;  // symmetric address of the (first) rank buffer
  int64_t rank_stride;      // 0: one PE per rank; > 0: virtual ranks of this PE (see above)
  int my_pe;
  int num_ranks, ranks_per_node;
  int64_t rail_rows, node_rows, row_bytes;  // the buffer's geometry (make_two_hop_layout)
  int64_t payload_bytes;                    // bytes of one row in this call (multiple of 16)
  unsigned long long round_value;           // monotone across calls (dispatch and combine)
  unsigned long long timeout_ns;
};

// One rank of a two-hop dispatch.
struct TwoHopDispatchRank {
  int rank;
  uint8_t* node_peers[kMaxNodeRanks];  // buffer of local rank j of this rank's node, [P]
  // hop 1 (source): rows packed by destination node, [S1, payload_bytes]
  const uint8_t* send_rows;
  const int64_t* rail_send_offsets;  // [G + 1] row offsets per destination node
  // hop 2 (forwarder): entries grouped by source node; entry e forwards row fwd_row[e] of
  // rail_stage[g] to slot fwd_slot[e] of node_stage[my local] on local rank fwd_target[e]
  const int64_t* fwd_offsets;  // [G + 1] entry offsets per source node
  const int64_t* fwd_row;      // [S2]
  const int32_t* fwd_target;   // [S2]
  const int64_t* fwd_slot;     // [S2]
  // receive: out row i = node_stage row recv_stage_row[i] (= forwarder l * node_rows + slot)
  uint8_t* recv_rows;             // [M, payload_bytes]
  const int64_t* recv_stage_row;  // [M]
  int64_t num_recv_rows;
  int32_t* record;  // timeout record (csrc/common/timeout.h)
};

// Combine rows: `hidden` elements of the payload dtype (0 = bfloat16, 1 = float32) at byte 0,
// then `num_weights` float32 at byte `weights_offset` (4-aligned), padded to payload_bytes.
struct TwoHopCombineFormat {
  int64_t hidden;
  int dtype;
  int num_weights;
  int64_t weights_offset;
};

// One rank of a two-hop combine (the dispatch's plan, read backwards).
struct TwoHopCombineRank {
  int rank;
  uint8_t* node_peers[kMaxNodeRanks];
  // hop 1 (expert rank -> forwarders): arrival row a (dispatch arrival order: forwarder l, source
  // node g, token) is x row ret_row[a]; ret_offsets[l * G + g] is where (l, g) starts
  const uint8_t* x;             // [M, payload_bytes] rows in contract order
  const int64_t* ret_row;       // [M]
  const int64_t* ret_offsets;   // [P * G + 1]
  // forwarder: rail row s (grouped by source node, rail_offsets[G + 1]) is the sum, local rank
  // ascending, of node_stage rows red_stage_row[red_offsets[s] .. red_offsets[s + 1])
  const int64_t* rail_offsets;   // [G + 1]
  const int64_t* red_offsets;    // [S1' + 1]
  const int64_t* red_stage_row;  // [S2] (= local rank j * node_rows + slot)
  uint8_t* partial;              // [S1', payload_bytes] scratch: the sums put back to the sources
  // source: token t is the sum, node ascending, of rail_stage rows
  // src_stage_row[src_offsets[t] .. src_offsets[t + 1]) (= node g * rail_rows + position)
  const int64_t* src_offsets;    // [N + 1]
  const int64_t* src_stage_row;  // [S1]
  int64_t num_tokens;
  uint8_t* combined_x;      // [N, hidden] payload dtype
  float* combined_weights;  // [N, num_weights] float32, or nullptr
  int32_t* record;
};

// Runs hop 1 (NVSHMEM put-with-signal to the forwarding peer of every node), hop 2 (NVLink
// forwarding inside the node through peer pointers, one flag per (forwarder, source node)) and
// the receive gather into contract order for `num_virtual` ranks (1 unless rank_stride > 0), then
// an NVSHMEM barrier on the stream (stage reuse).
void launch_two_hop_dispatch(const TwoHopCommon& c, const TwoHopDispatchRank* ranks,
                             int num_virtual, void* stream);

// The reverse: rows back to their forwarders over NVLink, a float32 sum per rail row there (local
// rank ascending), one put-with-signal per node back to the source, a float32 sum per token there
// (node ascending), then an NVSHMEM barrier on the stream.
void launch_two_hop_combine(const TwoHopCommon& c, const TwoHopCombineFormat& f,
                            const TwoHopCombineRank* ranks, int num_virtual, void* stream);

}  // namespace ep_comm::cuda
