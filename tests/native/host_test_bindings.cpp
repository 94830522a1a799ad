// Test-only bindings of the C++ cores that ep_comm._host does not need: the per-token routing
// helpers of csrc/common/routing.h and hierarchy.h (what the kernels run per thread), the timeout
// record writer of csrc/common/timeout.h and the e4m3 conversions of csrc/codec/fp8_core.h.
// The tests check them against ep_comm/layout.py, plan.py and torch (tests/test_routing_host.py,
// test_hierarchy_host.py, test_codec_fp8.py, test_cuda_build.py). Built at test time into the
// module `ep_host_test` by tests/support/native.py, from the same headers as the product.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "codec/fp8_core.h"
#include "common/buffer_layout.h"
#include "common/hierarchy.h"
#include "common/routing.h"
#include "common/timeout.h"
#include "host/checks.h"
#include "host/gil.h"

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

// -- routing (csrc/common/routing.h) ---------------------------------------------------------

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
  m.def("routing_ring_row_offset", [](int R, int C, int L, int64_t slots, int64_t row_bytes, int ch, int src, int64_t slot) {
    return ring_row_offset(make_intranode_layout(R, C, L, slots, row_bytes), R, ch, src, slot);
  });
  m.def("timeout_fill_record", [](int status, int rank, int peer, int phase, int waited_ms, int detail) {
    std::vector<int32_t> rec(kRecordWords, 0);
    fill_record(rec.data(), status, rank, peer, phase, waited_ms, detail);
    return rec;
  });
}

// -- two-hop routing (csrc/common/hierarchy.h) -----------------------------------------------

// layout.token_node_mask: [N, R] bool -> [N, G] bool.
Bool token_node_mask(const Bool& in_rank, int ranks_per_node) {
  if (in_rank.ndim() != 2) throw std::invalid_argument("is_token_in_rank must be 2-D");
  const NodeShape s = node_shape(static_cast<int>(in_rank.shape(1)), ranks_per_node);
  const int64_t N = in_rank.shape(0);
  Bool out({N, static_cast<int64_t>(num_nodes(s))});
  for (int64_t i = 0; i < N; ++i)
    for (int g = 0; g < num_nodes(s); ++g)
      out.mutable_at(i, g) = token_in_node(s, in_rank.data() + i * s.num_ranks, g);
  return out;
}

// The target bits a source puts on each rail row bound for `node` (one entry per token).
std::vector<uint32_t> target_bits(const Bool& in_rank, int ranks_per_node, int node) {
  if (in_rank.ndim() != 2) throw std::invalid_argument("is_token_in_rank must be 2-D");
  const NodeShape s = node_shape(static_cast<int>(in_rank.shape(1)), ranks_per_node);
  std::vector<uint32_t> out(static_cast<size_t>(in_rank.shape(0)));
  for (int64_t i = 0; i < in_rank.shape(0); ++i)
    out[i] = node_target_bits(s, in_rank.data() + i * s.num_ranks, node);
  return out;
}

// plan.forward_counts from per-row target bits: [P, G] int64.
I64 forward_counts(const std::vector<uint32_t>& bits, const std::vector<int64_t>& rail_recv_counts,
                   int ranks_per_node) {
  const int G = static_cast<int>(rail_recv_counts.size());
  I64 out({static_cast<int64_t>(ranks_per_node), static_cast<int64_t>(G)});
  std::fill(out.mutable_data(), out.mutable_data() + out.size(), 0);
  size_t row = 0;
  for (int g = 0; g < G; ++g)
    for (int64_t i = 0; i < rail_recv_counts[g]; ++i, ++row) {
      if (row >= bits.size()) throw std::invalid_argument("rail_recv_counts sum exceeds the rows");
      for (int j = 0; j < ranks_per_node; ++j)
        if (bits[row] >> j & 1u) ++out.mutable_at(j, g);
    }
  if (row != bits.size()) throw std::invalid_argument("rail_recv_counts do not sum to the rows");
  return out;
}

// plan.node_receive_order: (recv_counts [R], order [M]) from node_counts [P, G].
py::tuple receive_order(const I64& node_counts) {
  if (node_counts.ndim() != 2) throw std::invalid_argument("node_counts must be [P, G]");
  const int P = static_cast<int>(node_counts.shape(0)), G = static_cast<int>(node_counts.shape(1));
  const NodeShape s = node_shape(P * G, P);
  const int64_t* c = node_counts.data();
  std::vector<int64_t> recv_counts(static_cast<size_t>(P) * G);
  int64_t total = 0;
  for (int64_t i = 0; i < node_counts.size(); ++i) total += c[i];
  std::vector<int64_t> order(static_cast<size_t>(total));
  for (int l = 0; l < P; ++l)
    for (int g = 0; g < G; ++g) {
      const int64_t n = c[l * G + g];
      recv_counts[g * P + l] = n;
      const int64_t from = arrival_offset(c, G, l, g), to = contract_offset(c, s, l, g);
      for (int64_t i = 0; i < n; ++i) order[to + i] = from + i;
    }
  return py::make_tuple(recv_counts, order);
}

void register_hierarchy(py::module_& m) {
  m.def("hier_forwarding_peer", [](int num_ranks, int ranks_per_node, int src, int dst_node) {
    return forwarding_peer(node_shape(num_ranks, ranks_per_node), src, dst_node);
  }, py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("src_rank"), py::arg("dst_node"));
  m.def("hier_token_node_mask", &token_node_mask, py::arg("is_token_in_rank"), py::arg("ranks_per_node"));
  m.def("hier_target_bits", &target_bits, py::arg("is_token_in_rank"), py::arg("ranks_per_node"),
        py::arg("node"));
  m.def("hier_forward_counts", &forward_counts, py::arg("target_bits"), py::arg("rail_recv_counts"),
        py::arg("ranks_per_node"));
  m.def("hier_receive_order", &receive_order, py::arg("node_counts"));
}

// -- e4m3 conversions (csrc/codec/fp8_core.h) ------------------------------------------------

void register_fp8(py::module_& m) {
  m.def("fp8_cast_into", [](const py::buffer& src, const py::buffer& dst) {
    py::buffer_info si = src.request(), di = dst.request(true);
    if (si.ndim != 1 || di.ndim != 1) throw std::invalid_argument("src and dst must be 1-D");
    const int64_t n = si.shape[0];
    const auto* s = static_cast<const float*>(contiguous(si, n, 4, "src"));
    auto* d = static_cast<uint8_t*>(contiguous(di, n, 1, "dst"));
    without_gil([&] {
      for (int64_t i = 0; i < n; ++i) d[i] = fp8::float_to_e4m3(s[i]);
    });
  }, py::arg("src"), py::arg("dst"), "float32 [n] -> e4m3fn bytes [n] (round-to-nearest-even, saturating)");
  m.def("fp8_to_float", [](uint8_t b) { return fp8::e4m3_to_float(b); }, py::arg("byte"), "e4m3fn byte -> float32");
}

}  // namespace
}  // namespace ep_comm::host

PYBIND11_MODULE(ep_host_test, m) {
  m.doc() = "test-only bindings of ep_comm's C++ cores (tests/native/host_test_bindings.cpp)";
  ep_comm::host::register_routing(m);
  ep_comm::host::register_hierarchy(m);
  ep_comm::host::register_fp8(m);
}
