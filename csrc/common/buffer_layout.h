// Byte layouts of the communication buffers and of the rows that travel through them. Every
// offset a kernel uses is computed here, so the CPU tests (via ep_comm._host) and the Python
// allocator (ep_comm/backends/nvshmem.py) agree with the kernels.
#pragma once
#include "hd.h"

namespace ep_comm {

constexpr int64_t kAlign = 16;    // rows and fields: 16-byte aligned (int4 vector copies)
constexpr int64_t kRegion = 128;  // buffer regions: 128-byte aligned

// One normal-mode dispatch row: [x: hidden_bytes][scales: num_scales f32][topk: K int64 global ids]
// [weights: K f32][src_token: int32], each field 16-byte aligned; stride = row_bytes.
// A combine row uses the same struct with num_scales = 0, has_topk = false: [x][weights].
struct RowLayout {
  int64_t x_offset, scales_offset, topk_offset, weights_offset, src_offset, row_bytes;
};
EP_HD RowLayout make_row_layout(int64_t hidden_bytes, int num_scales, int num_topk, bool has_topk,
                                bool has_weights, bool has_src) {
  RowLayout l{};
  int64_t at = 0;
  l.x_offset = at;
  at = align_up(at + hidden_bytes, kAlign);
  l.scales_offset = at;
  at = align_up(at + 4 * static_cast<int64_t>(num_scales), kAlign);
  l.topk_offset = at;
  at = align_up(at + (has_topk ? 8 * static_cast<int64_t>(num_topk) : 0), kAlign);
  l.weights_offset = at;
  at = align_up(at + (has_weights ? 4 * static_cast<int64_t>(num_topk) : 0), kAlign);
  l.src_offset = at;
  at = align_up(at + (has_src ? 4 : 0), kAlign);
  l.row_bytes = at;
  return l;
}

// Intranode (NVLink / virtual-rank) buffer of one rank, R ranks, C channels, S ring slots:
//   int32 arrival[R]                   barrier values written by each peer
//   int32 channel_counts[R][C]         rows each source sends here per channel (dispatch notify)
//   int32 expert_counts[R][L]          pairs each source sends to each local expert (L = max local)
//   int32 ring_tail[C][R][M]           rows written into sub-ring m of ring (c, src) so far (by src)
//   int32 ring_head[C][R][M]           rows consumed from sub-ring m of ring (c, src) so far (here)
//   rows  ring[C][R][S][row_bytes]     the ring of (channel c, source src)
// M = kMaxWarpsPerPeer. With W warps per peer (1 <= W <= M) ring (c, src) is W sub-rings of S / W
// slots, sub-ring m at slots [m * (S / W), (m + 1) * (S / W)) carrying the ring's rows i = m mod W,
// each with its own tail and head (W = 1: one ring of S slots).
// Every region starts 128-byte aligned. Dispatch and combine reuse the same rings.
constexpr int kMaxWarpsPerPeer = 3;  // warps a ring kernel may give one peer (sub-rings of a ring)
struct IntranodeLayout {
  int64_t arrival, channel_counts, expert_counts, ring_tail, ring_head, ring, total_bytes;
  int64_t ring_slots, row_bytes;
};
EP_HD IntranodeLayout make_intranode_layout(int num_ranks, int num_channels, int max_local_experts,
                                            int64_t ring_slots, int64_t row_bytes) {
  IntranodeLayout l{};
  int64_t at = 0;
  l.arrival = at;
  at = align_up(at + 4LL * num_ranks, kRegion);
  l.channel_counts = at;
  at = align_up(at + 4LL * num_ranks * num_channels, kRegion);
  l.expert_counts = at;
  at = align_up(at + 4LL * num_ranks * max_local_experts, kRegion);
  l.ring_tail = at;
  at = align_up(at + 4LL * num_channels * num_ranks * kMaxWarpsPerPeer, kRegion);
  l.ring_head = at;
  at = align_up(at + 4LL * num_channels * num_ranks * kMaxWarpsPerPeer, kRegion);
  l.ring = at;
  at = align_up(at + static_cast<int64_t>(num_channels) * num_ranks * ring_slots * row_bytes, kRegion);
  l.total_bytes = at;
  l.ring_slots = ring_slots;
  l.row_bytes = row_bytes;
  return l;
}
// Byte offset of slot `slot` (an absolute row counter) of ring (channel, src).
EP_HD int64_t ring_row_offset(const IntranodeLayout& l, int num_ranks, int channel, int src,
                              int64_t slot) {
  return l.ring + ((static_cast<int64_t>(channel) * num_ranks + src) * l.ring_slots +
                   slot % l.ring_slots) * l.row_bytes;
}

// Low-latency row in the dispatch staging area: [header: int32 src_token, int32 k, 2 x pad]
// [payload: hidden_bytes (bf16, or e4m3 when fp8)][scales: H/128 f32 when fp8].
struct LLRow {
  int64_t payload_offset, scales_offset, row_bytes;
};
EP_HD LLRow make_ll_row(int64_t hidden, bool use_fp8) {
  LLRow r{};
  r.payload_offset = kAlign;
  int64_t payload = use_fp8 ? hidden : 2 * hidden;
  r.scales_offset = align_up(r.payload_offset + payload, kAlign);
  r.row_bytes = align_up(r.scales_offset + (use_fp8 ? 4 * (hidden / 128) : 0), kAlign);
  return r;
}
// The 16-byte header at the start of a low-latency row.
struct LLHeader {
  int32_t src_token;  // token index on the source rank
  int32_t topk_slot;  // k: which top-k entry of that token selected this expert
  int32_t reserved[2];
};
static_assert(sizeof(LLHeader) == kAlign, "LLHeader must fill the header field");

// Low-latency buffer of one rank (max_tokens T per source, L = max local experts, E experts):
//   int32 dispatch_flag[L][R]            count + 1 from each source, reset to 0 by the receiver
//   int32 combine_flag[E]                1 when expert e's owner returned its rows, reset here
//   rows  dispatch_stage[L][R][T][row]   LLRow rows, row bytes sized for bf16 (fits fp8 too)
//   bf16  combine_stage[T][K][H]         the row returned for (token, k)
//   rows  send_scratch[E + 8 L][row]     per-warp source rows for NVSHMEM puts to non-P2P peers
//   u64   barrier[R]                     barrier[s]: the last value PE s reached the barrier
//                                        before a send with (bounded_barrier_kernel)
struct LowLatencyLayout {
  int64_t dispatch_flag, combine_flag, dispatch_stage, combine_stage, send_scratch, barrier, total_bytes,
      stage_row_bytes;
};
EP_HD LowLatencyLayout make_low_latency_layout(int num_ranks, int max_local_experts,
                                               int num_experts, int max_tokens, int num_topk,
                                               int64_t hidden) {
  LowLatencyLayout l{};
  LLRow bf16_row = make_ll_row(hidden, false);
  LLRow fp8_row = make_ll_row(hidden, true);
  l.stage_row_bytes = bf16_row.row_bytes > fp8_row.row_bytes ? bf16_row.row_bytes : fp8_row.row_bytes;
  int64_t at = 0;
  l.dispatch_flag = at;
  at = align_up(at + 4LL * max_local_experts * num_ranks, kRegion);
  l.combine_flag = at;
  at = align_up(at + 4LL * num_experts, kRegion);
  l.dispatch_stage = at;
  at = align_up(at + static_cast<int64_t>(max_local_experts) * num_ranks * max_tokens *
                         l.stage_row_bytes, kRegion);
  l.combine_stage = at;
  at = align_up(at + 2LL * max_tokens * num_topk * hidden, kRegion);
  l.send_scratch = at;
  at = align_up(at + (num_experts + 8LL * max_local_experts) * l.stage_row_bytes, kRegion);
  l.barrier = at;
  at = align_up(at + 8LL * num_ranks, kRegion);
  l.total_bytes = at;
  return l;
}
EP_HD int64_t ll_stage_row_offset(const LowLatencyLayout& l, int num_ranks, int max_tokens,
                                  int local_expert, int src, int slot) {
  return l.dispatch_stage +
         ((static_cast<int64_t>(local_expert) * num_ranks + src) * max_tokens + slot) *
             l.stage_row_bytes;
}
EP_HD int64_t ll_combine_row_offset(const LowLatencyLayout& l, int num_topk, int64_t hidden,
                                    int token, int k) {
  return l.combine_stage + (static_cast<int64_t>(token) * num_topk + k) * 2 * hidden;
}

// NVSHMEM byte all-to-all (internode transport) buffer: uint64 signal[R], then R staging slots of
// slot_bytes each (slot s holds what source s sent here in the current round), then uint64
// barrier[R] (barrier[s]: the last round value PE s reached the round's closing barrier with).
struct ExchangeLayout {
  int64_t signal, stage, slot_bytes, barrier, total_bytes;
};
EP_HD ExchangeLayout make_exchange_layout(int num_ranks, int64_t slot_bytes) {
  ExchangeLayout l{};
  l.signal = 0;
  l.stage = align_up(8LL * num_ranks, kRegion);
  l.slot_bytes = align_up(slot_bytes, kRegion);
  l.barrier = l.stage + l.slot_bytes * num_ranks;
  l.total_bytes = l.barrier + align_up(8LL * num_ranks, kRegion);
  return l;
}

}  // namespace ep_comm
