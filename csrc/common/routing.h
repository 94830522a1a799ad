// Routing arithmetic shared by the kernels and the CPU tests. Each function mirrors a piece of
// ep_comm/layout.py or ep_comm/plan.py (the reference); tests/test_routing_host.py checks them.
//
// Conventions: topk rows are int64 global expert ids in [-1, E); expert_to_rank / expert_to_local
// are int32 [E] maps (ExpertPlacement); "channel" c of N tokens is the contiguous token range
// returned by channel_range, so channel order == token order.
#pragma once
#include "hd.h"

namespace ep_comm {

// Owner rank of topk entry k, or -1 when the entry is -1.
EP_HD int entry_owner(const int64_t* topk_row, int k, const int32_t* expert_to_rank) {
  int64_t e = topk_row[k];
  return e < 0 ? -1 : expert_to_rank[e];
}

// True when entry k is the first entry of its row owned by its rank (a token is sent to a rank
// once, however many of its experts live there). group_size > 1 asks the same per node
// (rank / group_size), for num_tokens_per_rdma_rank.
EP_HD bool is_first_hit(const int64_t* topk_row, int k, const int32_t* expert_to_rank,
                        int group_size = 1) {
  int owner = entry_owner(topk_row, k, expert_to_rank);
  if (owner < 0) return false;
  for (int j = 0; j < k; ++j) {
    int other = entry_owner(topk_row, j, expert_to_rank);
    if (other >= 0 && other / group_size == owner / group_size) return false;
  }
  return true;
}

// One row of is_token_in_rank: mask[r] = token has an expert on rank r (layout.token_rank_mask).
EP_HD void token_rank_row(const int64_t* topk_row, int num_topk, const int32_t* expert_to_rank,
                          int num_ranks, bool* mask) {
  for (int r = 0; r < num_ranks; ++r) mask[r] = false;
  for (int k = 0; k < num_topk; ++k) {
    int owner = entry_owner(topk_row, k, expert_to_rank);
    if (owner >= 0) mask[owner] = true;
  }
}

// layout.localize_topk for one entry: the local id on `rank` (or -1) and its weight (or 0).
EP_HD int64_t localize_entry(int64_t expert, int rank, const int32_t* expert_to_rank,
                             const int32_t* expert_to_local) {
  if (expert < 0 || expert_to_rank[expert] != rank) return -1;
  return expert_to_local[expert];
}

// Token range [begin, end) of channel c when N tokens are split into C contiguous channels.
struct Range {
  int begin;
  int end;
};
EP_HD Range channel_range(int num_tokens, int num_channels, int channel) {
  int per = static_cast<int>(ceil_div(num_tokens, num_channels));
  int begin = per * channel < num_tokens ? per * channel : num_tokens;
  int end = begin + per < num_tokens ? begin + per : num_tokens;
  return Range{begin, end};
}

// out[i] = sum(values[:i]) for i in [0, n]; returns the total (= out[n]).
EP_HD int64_t exclusive_scan(const int32_t* values, int n, int64_t* out) {
  int64_t acc = 0;
  for (int i = 0; i < n; ++i) {
    out[i] = acc;
    acc += values[i];
  }
  out[n] = acc;
  return acc;
}

// Normal-mode receive row of the `index`-th row that source `src` sent through channel `channel`,
// given the receiver's [R_src, C] per-channel counts (row-major). Rows are ordered by source
// rank, then channel, then token: i.e. by source rank then source token (the plan's contract).
EP_HD int64_t recv_row_of(const int32_t* channel_counts, int num_channels, int src, int channel,
                          int64_t index) {
  int64_t offset = 0;
  for (int i = 0; i < src * num_channels + channel; ++i) offset += channel_counts[i];
  return offset + index;
}

// Low-latency mode: slot of top-k pair (token, k) among the pairs of the same source that select
// the same expert, ordered by (token, k). That is the pair's index inside its source's group of
// recv_x[local expert] (plan.build_expert_slot_plan).
EP_HD int ll_pair_index(const int64_t* topk, int num_topk, int token, int k) {
  int64_t expert = topk[static_cast<int64_t>(token) * num_topk + k];
  int index = 0;
  for (int t = 0; t <= token; ++t) {
    int k_end = t == token ? k : num_topk;
    for (int j = 0; j < k_end; ++j) index += topk[static_cast<int64_t>(t) * num_topk + j] == expert;
  }
  return index;
}

}  // namespace ep_comm
