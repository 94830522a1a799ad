// Host build of the two-hop buffer layout of csrc/common/hierarchy.h: ep_comm/engines/two_hop.py
// sizes and addresses its NVSHMEM buffer with the offsets the kernels use. The per-token two-hop
// helpers of that header are bound for the tests only, by tests/native/host_test_bindings.cpp.
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "bindings.h"
#include "checks.h"
#include "common/hierarchy.h"

namespace py = pybind11;

namespace ep_comm::host {

void register_hierarchy(py::module_& m) {
  m.def("hier_two_hop_layout", [](int num_ranks, int ranks_per_node, int64_t rail_rows,
                                  int64_t node_rows, int64_t row_bytes) {
    if (rail_rows < 0 || node_rows < 0) throw std::invalid_argument("rail_rows and node_rows must be >= 0");
    if (row_bytes <= 0 || row_bytes % 16) throw std::invalid_argument("row_bytes must be a positive multiple of 16");
    const TwoHopLayout l = make_two_hop_layout(node_shape(num_ranks, ranks_per_node), rail_rows, node_rows,
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
