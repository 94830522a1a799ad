// Host build of the routing helpers in csrc/common/ (the code the CUDA kernels run), bound for
// the CPU tests (tests/test_routing_host.py) and for buffer sizing in ep_comm/backends/nvshmem.py.
// Arrays are numpy arrays (C-contiguous); every function loops the same per-token / per-pair
// helpers a kernel thread or warp calls.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "common/buffer_layout.h"
#include "common/routing.h"
#include "common/timeout.h"

namespace py = pybind11;

namespace ep_comm::host {
namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;
using Bool = py::array_t<bool, py::array::c_style | py::array::forcecast>;

void check_2d(const py::array& a, const char* name) {
  if (a.ndim() != 2) throw std::invalid_argument(std::string(name) + " must be 2-D");
}
void check_experts(const I64& topk, const I32& expert_to_rank, int num_ranks) {
  const int64_t* t = topk.data();
  for (int64_t i = 0; i < topk.size(); ++i)
    if (t[i] < -1 || t[i] >= expert_to_rank.size()) throw std::invalid_argument("topk_idx out of [-1, E)");
  for (int64_t e = 0; e < expert_to_rank.size(); ++e)
    if (expert_to_rank.data()[e] < 0 || expert_to_rank.data()[e] >= num_ranks)
      throw std::invalid_argument("expert_to_rank out of [0, R)");
}

// What layout.cu computes: (per rank, per node or empty, per expert, is_token_in_rank [N, R]).
py::tuple dispatch_layout(const I64& topk, const I32& expert_to_rank, int num_ranks, int ranks_per_node) {
  check_2d(topk, "topk_idx");
  check_experts(topk, expert_to_rank, num_ranks);
  const int64_t N = topk.shape(0);
  const int K = static_cast<int>(topk.shape(1));
  const int nodes = (num_ranks > ranks_per_node && num_ranks % ranks_per_node == 0) ? num_ranks / ranks_per_node : 0;
  std::vector<int32_t> per_rank(num_ranks), per_node(nodes), per_expert(expert_to_rank.size());
  Bool mask({N, static_cast<int64_t>(num_ranks)});
  auto m = mask.mutable_unchecked<2>();
  const int32_t* e2r = expert_to_rank.data();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t* row = topk.data() + i * K;
    token_rank_row(row, K, e2r, num_ranks, m.mutable_data(i, 0));
    for (int k = 0; k < K; ++k) {
      if (row[k] < 0) continue;
      ++per_expert[row[k]];
      if (is_first_hit(row, k, e2r)) ++per_rank[entry_owner(row, k, e2r)];
      if (nodes && is_first_hit(row, k, e2r, ranks_per_node)) ++per_node[entry_owner(row, k, e2r) / ranks_per_node];
    }
  }
  return py::make_tuple(per_rank, per_node, per_expert, mask);
}

py::tuple localize(const I64& topk, const F32& weights, int rank, const I32& expert_to_rank,
                   const I32& expert_to_local) {
  check_2d(topk, "topk_idx");
  I64 local({topk.shape(0), topk.shape(1)});
  F32 w({topk.shape(0), topk.shape(1)});
  for (int64_t i = 0; i < topk.size(); ++i) {
    local.mutable_data()[i] = localize_entry(topk.data()[i], rank, expert_to_rank.data(), expert_to_local.data());
    w.mutable_data()[i] = local.data()[i] >= 0 ? weights.data()[i] : 0.0f;
  }
  return py::make_tuple(local, w);
}

// The intranode receive order on `receiver`: [(src, token)] as the dispatch kernel places rows.
// masks[s] is source s's is_token_in_rank [N_s, R]. Channel counts are computed the way the
// notify kernel does; each row lands at recv_row_of(counts, C, s, c, index in channel).
std::vector<std::pair<int, int>> intranode_recv_order(const std::vector<Bool>& masks, int num_channels,
                                                      int receiver) {
  const int R = static_cast<int>(masks.size());
  std::vector<int32_t> counts(static_cast<size_t>(R) * num_channels, 0);
  for (int s = 0; s < R; ++s) {
    check_2d(masks[s], "mask");
    const int N = static_cast<int>(masks[s].shape(0));
    for (int c = 0; c < num_channels; ++c) {
      Range r = channel_range(N, num_channels, c);
      for (int t = r.begin; t < r.end; ++t) counts[s * num_channels + c] += masks[s].at(t, receiver);
    }
  }
  int64_t total = 0;
  for (int32_t v : counts) total += v;
  std::vector<std::pair<int, int>> order(static_cast<size_t>(total), {-1, -1});
  for (int s = 0; s < R; ++s) {
    const int N = static_cast<int>(masks[s].shape(0));
    for (int c = 0; c < num_channels; ++c) {
      Range r = channel_range(N, num_channels, c);
      int64_t index = 0;
      for (int t = r.begin; t < r.end; ++t)
        if (masks[s].at(t, receiver)) order[recv_row_of(counts.data(), num_channels, s, c, index++)] = {s, t};
    }
  }
  return order;
}

// Low-latency slots of one source's pairs for `expert`: [(token, k, index within the source)].
std::vector<std::tuple<int, int, int>> ll_pairs(const I64& topk, int64_t expert) {
  check_2d(topk, "topk_idx");
  const int N = static_cast<int>(topk.shape(0)), K = static_cast<int>(topk.shape(1));
  std::vector<std::tuple<int, int, int>> out;
  for (int t = 0; t < N; ++t)
    for (int k = 0; k < K; ++k)
      if (topk.at(t, k) == expert) out.emplace_back(t, k, ll_pair_index(topk.data(), K, t, k));
  return out;
}

py::dict as_dict(const IntranodeLayout& l) {
  py::dict d;
  d["arrival"] = l.arrival; d["channel_counts"] = l.channel_counts; d["expert_counts"] = l.expert_counts;
  d["ring_tail"] = l.ring_tail; d["ring_head"] = l.ring_head; d["ring"] = l.ring;
  d["total_bytes"] = l.total_bytes; d["ring_slots"] = l.ring_slots; d["row_bytes"] = l.row_bytes;
  return d;
}

}  // namespace

void register_routing(py::module_& m) {
  m.def("routing_dispatch_layout", &dispatch_layout, py::arg("topk_idx"), py::arg("expert_to_rank"),
        py::arg("num_ranks"), py::arg("ranks_per_node"),
        "(per rank, per node, per expert, is_token_in_rank) as layout.cu computes them");
  m.def("routing_localize", &localize, py::arg("topk_idx"), py::arg("topk_weights"), py::arg("rank"),
        py::arg("expert_to_rank"), py::arg("expert_to_local"));
  m.def("routing_channel_range", [](int n, int c, int ch) { Range r = channel_range(n, c, ch); return std::make_pair(r.begin, r.end); });
  m.def("routing_exclusive_scan", [](std::vector<int32_t> v) {
    std::vector<int64_t> out(v.size() + 1);
    exclusive_scan(v.data(), static_cast<int>(v.size()), out.data());
    return out;
  });
  m.def("routing_intranode_recv_order", &intranode_recv_order, py::arg("masks"), py::arg("num_channels"),
        py::arg("receiver"));
  m.def("routing_ll_pairs", &ll_pairs, py::arg("topk_idx"), py::arg("expert"));
  m.def("routing_row_layout", [](int64_t hidden_bytes, int num_scales, int num_topk, bool has_topk, bool has_weights, bool has_src) {
    RowLayout l = make_row_layout(hidden_bytes, num_scales, num_topk, has_topk, has_weights, has_src);
    py::dict d;
    d["x"] = l.x_offset; d["scales"] = l.scales_offset; d["topk"] = l.topk_offset;
    d["weights"] = l.weights_offset; d["src"] = l.src_offset; d["row_bytes"] = l.row_bytes;
    return d;
  });
  m.def("routing_intranode_layout", [](int R, int C, int L, int64_t slots, int64_t row_bytes) {
    return as_dict(make_intranode_layout(R, C, L, slots, row_bytes));
  }, py::arg("num_ranks"), py::arg("num_channels"), py::arg("max_local_experts"), py::arg("ring_slots"),
     py::arg("row_bytes"));
  m.def("routing_ring_row_offset", [](int R, int C, int L, int64_t slots, int64_t row_bytes, int ch, int src, int64_t slot) {
    return ring_row_offset(make_intranode_layout(R, C, L, slots, row_bytes), R, ch, src, slot);
  });
  m.def("routing_low_latency_layout", [](int R, int L, int E, int T, int K, int64_t H) {
    LowLatencyLayout l = make_low_latency_layout(R, L, E, T, K, H);
    py::dict d;
    d["dispatch_flag"] = l.dispatch_flag; d["combine_flag"] = l.combine_flag;
    d["dispatch_stage"] = l.dispatch_stage; d["combine_stage"] = l.combine_stage;
    d["send_scratch"] = l.send_scratch; d["barrier"] = l.barrier; d["total_bytes"] = l.total_bytes; d["stage_row_bytes"] = l.stage_row_bytes;
    return d;
  }, py::arg("num_ranks"), py::arg("max_local_experts"), py::arg("num_experts"), py::arg("max_tokens"),
     py::arg("num_topk"), py::arg("hidden"));
  m.def("routing_ll_row", [](int64_t H, bool fp8) {
    LLRow r = make_ll_row(H, fp8);
    return py::make_tuple(r.payload_offset, r.scales_offset, r.row_bytes);
  });
  m.def("routing_exchange_layout", [](int R, int64_t slot) {
    ExchangeLayout l = make_exchange_layout(R, slot);
    return py::make_tuple(l.signal, l.stage, l.slot_bytes, l.total_bytes);
  });
  py::dict fields;
  fields["status"] = static_cast<int>(kStatus); fields["rank"] = static_cast<int>(kRank);
  fields["peer"] = static_cast<int>(kPeer); fields["phase"] = static_cast<int>(kPhase);
  fields["waited_ms"] = static_cast<int>(kWaitedMs); fields["detail"] = static_cast<int>(kDetail);
  fields["words"] = static_cast<int>(kRecordWords);
  m.attr("timeout_record_fields") = fields;
  py::dict phases;
  for (int p = 0; p < kNumPhases; ++p) phases[py::int_(p)] = phase_name(p);
  m.attr("timeout_phase_names") = phases;
  m.def("timeout_fill_record", [](int status, int rank, int peer, int phase, int waited_ms, int detail) {
    std::vector<int32_t> rec(kRecordWords, 0);
    fill_record(rec.data(), status, rank, peer, phase, waited_ms, detail);
    return rec;
  });
}

}  // namespace ep_comm::host
