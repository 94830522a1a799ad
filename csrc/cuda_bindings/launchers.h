// Launch API of the kernels in csrc/cuda/*.cu, shared by the kernels (nvcc) and the pybind11
// binding (g++). Plain pointers, sizes and an opaque stream: no torch, no CUDA headers here.
#pragma once
#include <cstdint>
#include <string>

namespace ep_comm::cuda {

constexpr int kMaxRanks = 8;  // NVLink peers / virtual ranks of one launch

// The CUDA runtime's last error as text (clearing it), or nullptr: checked after every launch. A
// launcher that refused to launch (refuse_launch) reports its reason here first.
const char* take_launch_error();
// Records why this thread's launcher did not launch (e.g. a grid that cannot be co-resident).
void refuse_launch(const std::string& reason);

// ---- layout.cu ----------------------------------------------------------------------------
struct LayoutArgs {
  const int64_t* topk_idx;  // [N, K]
  const int32_t* expert_to_rank;  // [E]
  int num_tokens, num_topk, num_experts, num_ranks, ranks_per_node;
  int32_t* num_tokens_per_rank;       // [R]
  int32_t* num_tokens_per_rdma_rank;  // [R / ranks_per_node] or nullptr
  int32_t* num_tokens_per_expert;     // [E]
  bool* is_token_in_rank;             // [N, R]
};
void launch_dispatch_layout(const LayoutArgs& a, void* stream);

// ---- intranode.cu ---------------------------------------------------------------------------
// What every rank of one launch shares: the peer buffers (as seen from this process) and sizes.
struct IntranodeCommon {
  uint8_t* peers[kMaxRanks];  // intranode buffer of each rank (csrc/common/buffer_layout.h)
  const int32_t* expert_to_rank;   // [E]
  const int32_t* expert_to_local;  // [E]
  int num_ranks, num_channels, max_local_experts, num_experts, num_topk;
  int64_t ring_slots, row_bytes;  // the buffer's ring geometry
  unsigned long long timeout_ns;
  int barrier_value;  // monotone across calls: the value every rank writes into arrival[]
  int warps_per_peer;  // ring kernels: warps per peer and sub-rings per ring, 1 .. kMaxWarpsPerPeer
};
// meta (int32, written by notify, read by dispatch/combine and by Python):
//   [0, R*C)          channel_counts[src][c]: rows from src through channel c
//   [R*C, R*C + L)    pairs received per local expert (L = max_local_experts)
//   [R*C + L]         total rows received
inline int meta_words(int num_ranks, int num_channels, int max_local_experts) {
  return num_ranks * num_channels + max_local_experts + 1;
}
struct NotifyRank {
  int rank;
  int num_tokens;
  const bool* is_token_in_rank;          // [N, R]
  const int32_t* num_tokens_per_expert;  // [E]
  int32_t* meta;                         // out
  int32_t* record;                       // timeout record
};
struct DispatchRank {
  int rank;
  int num_tokens;
  const uint8_t* x;           // [N, hidden_bytes]
  const float* x_scales;      // [N, num_scales] or nullptr
  const int64_t* topk_idx;    // [N, K]
  const float* topk_weights;  // [N, K] or nullptr
  const bool* is_token_in_rank;
  const int32_t* meta;
  uint8_t* recv_x;               // [M, hidden_bytes]
  float* recv_scales;            // [M, num_scales] or nullptr
  int64_t* recv_topk_idx;        // [M, K] local ids
  float* recv_topk_weights;      // [M, K] or nullptr
  int32_t* recv_src_idx;         // [M]
  int32_t* record;
};
struct CombineRank {
  int rank;
  int num_tokens;                // N of the original dispatch on this rank
  const uint8_t* x;              // [M, H] rows to return, in receive order
  const float* topk_weights;     // [M, K] or nullptr
  const bool* is_token_in_rank;  // [N, R] of the original dispatch
  const int32_t* meta;           // the dispatch's meta
  uint8_t* combined_x;           // [N, H]
  float* combined_topk_weights;  // [N, K] or nullptr
  int32_t* record;
};
void launch_intranode_notify(const IntranodeCommon& c, const NotifyRank* ranks, int num_virtual,
                             void* stream);
void launch_intranode_dispatch(const IntranodeCommon& c, const DispatchRank* ranks, int num_virtual,
                               int64_t hidden_bytes, int num_scales, int threads_per_block,
                               void* stream);
// dtype: 0 = bfloat16, 1 = float32. The combine starts with a barrier that resets the rings.
void launch_intranode_combine(const IntranodeCommon& c, const CombineRank* ranks, int num_virtual,
                              int64_t hidden, int dtype, void* stream);
// Direct writes (no ring, no waits): the dispatch writes each row into its receiver's outputs after
// the notify, the combine reads each returned row from its sender's x. `ranks` holds an entry for
// every rank of the group (ranks[i].rank == i, num_entries == c.num_ranks) as this process addresses
// its tensors; the launch runs entries [local_begin, local_begin + num_local) (all of them for virtual
// ranks, this process's rank with a group). Of the other entries the kernels read only the dispatch
// outputs and meta (dispatch) or x, topk_weights and meta (combine). Same results as the ring
// kernels'; refused (take_launch_error) when an entry is missing or out of place.
void launch_intranode_dispatch_direct(const IntranodeCommon& c, const DispatchRank* ranks, int num_entries,
                                      int local_begin, int num_local, int64_t hidden_bytes, int num_scales,
                                      int threads_per_block, void* stream);
void launch_intranode_combine_direct(const IntranodeCommon& c, const CombineRank* ranks, int num_entries,
                                     int local_begin, int num_local, int64_t hidden, int dtype, void* stream);

// ---- low_latency.cu -------------------------------------------------------------------------
struct LowLatencyCommon {
  uint8_t* peers[kMaxRanks];  // low-latency buffer of each rank (nullptr: reach it with NVSHMEM)
  uint8_t* symmetric_base;    // this rank's NVSHMEM symmetric buffer (NVSHMEM path), or nullptr
  const int32_t* expert_to_rank;
  const int32_t* expert_to_local;
  int num_ranks, num_experts, max_local_experts, num_topk, max_tokens;
  int64_t hidden;
  unsigned long long timeout_ns;
};
struct LowLatencyRank {
  int rank;
  int num_tokens;
  int num_local_experts;
  const uint16_t* x;           // [N, H] bf16 (dispatch) / [L, R*T, H] bf16 expert outputs (combine)
  const int64_t* topk_idx;     // [N, K]
  const float* topk_weights;   // [N, K] (combine)
  uint8_t* recv_x;             // [L, R*T, H] bf16 or e4m3 (dispatch)
  float* recv_scales;          // [L, R*T, H/128] f32, or UE8M0 bytes when use_ue8m0 (dispatch)
  int32_t* recv_count;         // [L]
  int32_t* recv_src_info;      // [L, R*T] source token of each received row
  int32_t* recv_topk_slot;     // [L, R*T] k of each received row
  int64_t* layout_range;       // [L, R, 2] (first row, count) per source rank
  uint16_t* combined_x;        // [N, H] bf16 (combine)
  int32_t* record;
};
struct LowLatencyFlags {
  bool use_fp8, round_scale, use_ue8m0;
};
void launch_low_latency_dispatch_send(const LowLatencyCommon& c, const LowLatencyRank* ranks,
                                      int num_virtual, LowLatencyFlags f, void* stream);
void launch_low_latency_dispatch_recv(const LowLatencyCommon& c, const LowLatencyRank* ranks,
                                      int num_virtual, LowLatencyFlags f, void* stream);
void launch_low_latency_combine_send(const LowLatencyCommon& c, const LowLatencyRank* ranks,
                                     int num_virtual, void* stream);
void launch_low_latency_combine_recv(const LowLatencyCommon& c, const LowLatencyRank* ranks,
                                     int num_virtual, void* stream);

// ---- internode.cu (NVSHMEM) -----------------------------------------------------------------
bool nvshmem_built();
// Unique id bytes for nvshmem bootstrap (rank 0 creates it, the group broadcasts it).
int nvshmem_unique_id_size();
void nvshmem_get_unique_id(uint8_t* out);
void nvshmem_init_with_unique_id(const uint8_t* id, int rank, int num_ranks);
void nvshmem_finalize_pe();
int nvshmem_my_pe_id();
int nvshmem_num_pes();
void* nvshmem_alloc(int64_t bytes);
void nvshmem_release(void* ptr);
void* nvshmem_peer_ptr(void* ptr, int pe);
void nvshmem_barrier_on_stream(void* stream);
// A barrier of all `num_pes` PEs on `stream` that gives up after `timeout_ns` (recording
// kInternodeBarrier and the missing PE in `record`, which the caller checks after the stream
// synchronises) instead of hanging as nvshmemx_barrier_all_on_stream does when a PE never comes.
// `words` is a symmetric, zero-initialised uint64[num_pes] used by nothing else; `value` must
// grow from one barrier on `words` to the next and be the same on every PE. Completes this PE's
// earlier NVSHMEM puts first (nvshmem_quiet), as nvshmem_barrier_all does. If an earlier wait of
// the launch already failed (record status set), it still tells the peers it arrived but does
// not wait for them.
void launch_bounded_barrier(uint64_t* words, int num_pes, int my_pe, unsigned long long value,
                            unsigned long long timeout_ns, int32_t* record, void* stream);
// launch_bounded_barrier whose `value` is kept on the device: `*round` (device uint64, zero at
// first, used by nothing else) counts this PE's barriers on `words` and each launch advances it,
// so the calls stay correct when captured in a CUDA graph and replayed. Every PE must run the same
// sequence of counted barriers on `words` (and no other barrier on them).
void launch_counted_barrier(uint64_t* words, unsigned long long* round, int num_pes, int my_pe,
                            unsigned long long timeout_ns, int32_t* record, void* stream);
// One round of a byte all-to-all through the symmetric exchange buffer: sends
// send[send_offsets[r], +send_bytes[r]) to every PE r (send_bytes[r] <= slot_bytes), waits for
// every source's bytes, copies source s's bytes to recv + recv_offsets[s]. Offsets/sizes are
// device int64 arrays [R]; `round_value` is monotone across rounds.
void launch_exchange_round(uint8_t* symmetric, int64_t slot_bytes, const uint8_t* send,
                           const int64_t* send_offsets, const int64_t* send_bytes, uint8_t* recv,
                           const int64_t* recv_offsets, const int64_t* recv_bytes, int num_ranks,
                           int my_pe, unsigned long long round_value,
                           unsigned long long timeout_ns, int32_t* record, void* stream);

}  // namespace ep_comm::cuda
