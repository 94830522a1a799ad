// Host build of the two-hop routing helpers (csrc/common/hierarchy.h), bound for the CPU tests
// (tests/test_hierarchy_host.py), which check them against ep_comm/plan.py and layout.py. Each
// function loops the per-token / per-block helper a kernel thread calls.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "bindings.h"
#include "common/hierarchy.h"

namespace py = pybind11;

namespace ep_comm::host {
namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Bool = py::array_t<bool, py::array::c_style | py::array::forcecast>;

NodeShape shape_of(int num_ranks, int ranks_per_node) {
  if (ranks_per_node <= 0 || ranks_per_node > 32 || num_ranks % ranks_per_node)
    throw std::invalid_argument("ranks_per_node must be in [1, 32] and divide num_ranks");
  return NodeShape{num_ranks, ranks_per_node};
}

// layout.token_node_mask: [N, R] bool -> [N, G] bool.
Bool token_node_mask(const Bool& in_rank, int ranks_per_node) {
  if (in_rank.ndim() != 2) throw std::invalid_argument("is_token_in_rank must be 2-D");
  const NodeShape s = shape_of(static_cast<int>(in_rank.shape(1)), ranks_per_node);
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
  const NodeShape s = shape_of(static_cast<int>(in_rank.shape(1)), ranks_per_node);
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
  const NodeShape s = shape_of(P * G, P);
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

}  // namespace

void register_hierarchy(py::module_& m) {
  m.def("hier_forwarding_peer", [](int num_ranks, int ranks_per_node, int src, int dst_node) {
    return forwarding_peer(shape_of(num_ranks, ranks_per_node), src, dst_node);
  }, py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("src_rank"), py::arg("dst_node"));
  m.def("hier_token_node_mask", &token_node_mask, py::arg("is_token_in_rank"), py::arg("ranks_per_node"));
  m.def("hier_target_bits", &target_bits, py::arg("is_token_in_rank"), py::arg("ranks_per_node"),
        py::arg("node"));
  m.def("hier_forward_counts", &forward_counts, py::arg("target_bits"), py::arg("rail_recv_counts"),
        py::arg("ranks_per_node"));
  m.def("hier_receive_order", &receive_order, py::arg("node_counts"));
  m.def("hier_two_hop_layout", [](int num_ranks, int ranks_per_node, int64_t rail_rows,
                                  int64_t node_rows, int64_t row_bytes) {
    if (rail_rows < 0 || node_rows < 0) throw std::invalid_argument("rail_rows and node_rows must be >= 0");
    if (row_bytes <= 0 || row_bytes % 16) throw std::invalid_argument("row_bytes must be a positive multiple of 16");
    const TwoHopLayout l = make_two_hop_layout(shape_of(num_ranks, ranks_per_node), rail_rows, node_rows,
                                               row_bytes);
    py::dict d;
    d["rail_signal"] = l.rail_signal;
    d["node_flag"] = l.node_flag;
    d["rail_stage"] = l.rail_stage;
    d["node_stage"] = l.node_stage;
    d["barrier"] = l.barrier;
    d["total_bytes"] = l.total_bytes;
    d["rail_rows"] = l.rail_rows;
    d["node_rows"] = l.node_rows;
    d["row_bytes"] = l.row_bytes;
    return d;
  }, py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("rail_rows"), py::arg("node_rows"),
     py::arg("row_bytes"), "Byte offsets of the two-hop buffer (csrc/common/hierarchy.h TwoHopLayout)");
}

}  // namespace ep_comm::host
