// pybind11 binding of the two-hop dispatch launcher (csrc/cuda_bindings/two_hop_launch.h), in the
// style of module.cpp: tensors arrive as data pointers (Python ints) in a dict keyed by the C++
// field names, the stream as a raw cudaStream_t handle.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "launchers.h"
#include "two_hop_launch.h"

namespace py = pybind11;

namespace ep_comm::cuda {
namespace {

template <class T>
T* field_ptr(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("missing field: ") + key);
  py::object v = d[key];
  return v.is_none() ? nullptr : reinterpret_cast<T*>(v.cast<uintptr_t>());
}
template <class T>
T field_num(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw std::invalid_argument(std::string("missing field: ") + key);
  return d[key].cast<T>();
}

TwoHopDispatchArgs dispatch_args(const py::dict& d) {
  TwoHopDispatchArgs a{};
  a.symmetric = field_ptr<uint8_t>(d, "symmetric");
  auto peers = d["node_peers"].cast<std::vector<uintptr_t>>();
  a.num_ranks = field_num<int>(d, "num_ranks");
  a.ranks_per_node = field_num<int>(d, "ranks_per_node");
  a.my_rank = field_num<int>(d, "my_rank");
  if (a.ranks_per_node <= 0 || a.ranks_per_node > kMaxNodeRanks || a.num_ranks % a.ranks_per_node)
    throw std::invalid_argument("ranks_per_node must be in [1, 8] and divide num_ranks");
  if (static_cast<int>(peers.size()) != a.ranks_per_node)
    throw std::invalid_argument("node_peers must list every rank of the node");
  for (size_t i = 0; i < peers.size(); ++i) {
    if (peers[i] == 0) throw std::invalid_argument("node_peers: a node rank is not reachable over NVLink");
    a.node_peers[i] = reinterpret_cast<uint8_t*>(peers[i]);
  }
  a.rail_rows = field_num<int64_t>(d, "rail_rows");
  a.node_rows = field_num<int64_t>(d, "node_rows");
  a.row_bytes = field_num<int64_t>(d, "row_bytes");
  if (a.row_bytes <= 0 || a.row_bytes % 16) throw std::invalid_argument("row_bytes must be a positive multiple of 16");
  a.send_rows = field_ptr<const uint8_t>(d, "send_rows");
  a.rail_send_offsets = field_ptr<const int64_t>(d, "rail_send_offsets");
  a.fwd_offsets = field_ptr<const int64_t>(d, "fwd_offsets");
  a.fwd_row = field_ptr<const int64_t>(d, "fwd_row");
  a.fwd_target = field_ptr<const int32_t>(d, "fwd_target");
  a.fwd_slot = field_ptr<const int64_t>(d, "fwd_slot");
  a.recv_rows = field_ptr<uint8_t>(d, "recv_rows");
  a.recv_stage_row = field_ptr<const int64_t>(d, "recv_stage_row");
  a.num_recv_rows = field_num<int64_t>(d, "num_recv_rows");
  a.round_value = field_num<unsigned long long>(d, "round_value");
  a.timeout_ns = field_num<unsigned long long>(d, "timeout_ns");
  a.record = field_ptr<int32_t>(d, "record");
  return a;
}

}  // namespace

void register_two_hop(py::module_& m) {
  m.def("two_hop_dispatch", [](const py::dict& d, uintptr_t stream) {
    if (!nvshmem_built()) throw std::runtime_error("ep_comm._cuda was built without NVSHMEM");
    launch_two_hop_dispatch(dispatch_args(d), reinterpret_cast<void*>(stream));
    if (const char* error = take_launch_error())
      throw std::runtime_error(std::string("two_hop_dispatch: ") + error);
  }, py::arg("args"), py::arg("stream"),
     "Two-hop dispatch of opaque rows along a NodePlan (see csrc/cuda/internode_two_hop.cu)");
}

}  // namespace ep_comm::cuda
