// pybind11 binding of the two-hop launchers (csrc/cuda_bindings/two_hop_launch.h), in the style of
// module.cpp: a `common` dict and one dict per virtual rank, keyed by the C++ field names, tensors
// as data pointers (Python ints), the stream as a raw cudaStream_t handle. Geometry is validated
// here, before anything touches the GPU.
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

TwoHopCommon common_args(const py::dict& d) {
  TwoHopCommon c{};
  c.symmetric_base = field_ptr<uint8_t>(d, "symmetric_base");
  c.rank_stride = field_num<int64_t>(d, "rank_stride");
  c.my_pe = field_num<int>(d, "my_pe");
  c.num_ranks = field_num<int>(d, "num_ranks");
  c.ranks_per_node = field_num<int>(d, "ranks_per_node");
  c.rail_rows = field_num<int64_t>(d, "rail_rows");
  c.node_rows = field_num<int64_t>(d, "node_rows");
  c.row_bytes = field_num<int64_t>(d, "row_bytes");
  c.payload_bytes = field_num<int64_t>(d, "payload_bytes");
  c.round_value = field_num<unsigned long long>(d, "round_value");
  c.timeout_ns = field_num<unsigned long long>(d, "timeout_ns");
  if (c.symmetric_base == nullptr) throw std::invalid_argument("symmetric_base is null");
  if (c.ranks_per_node <= 0 || c.ranks_per_node > kMaxNodeRanks || c.num_ranks % c.ranks_per_node)
    throw std::invalid_argument("ranks_per_node must be in [1, 8] and divide num_ranks");
  if (c.rank_stride < 0 || c.rank_stride % 128)
    throw std::invalid_argument("rank_stride must be 0 or a positive multiple of 128");
  if (c.row_bytes <= 0 || c.row_bytes % 16) throw std::invalid_argument("row_bytes must be a positive multiple of 16");
  if (c.payload_bytes <= 0 || c.payload_bytes % 16 || c.payload_bytes > c.row_bytes)
    throw std::invalid_argument("payload_bytes must be a positive multiple of 16, at most row_bytes");
  if (c.rail_rows < 0 || c.node_rows < 0) throw std::invalid_argument("rail_rows and node_rows must be >= 0");
  return c;
}

void check_rank_list(const TwoHopCommon& c, size_t n) {
  // the closing barrier's PEs (two_hop_end_barrier): every rank's PE, or this PE alone
  if (c.rank_stride == 0 && (c.my_pe < 0 || c.my_pe >= c.num_ranks))
    throw std::invalid_argument("one PE per rank: my_pe must be in [0, num_ranks)");
  if (c.rank_stride > 0 && c.my_pe != 0)
    throw std::invalid_argument("virtual ranks run on a job of one PE (my_pe 0)");
  if (n == 0 || n > static_cast<size_t>(kMaxRanks))
    throw std::invalid_argument("between 1 and " + std::to_string(kMaxRanks) + " ranks per launch");
  if (c.rank_stride == 0 && n != 1)
    throw std::invalid_argument("one PE per rank (rank_stride 0) launches exactly one rank");
}

void node_peers(const TwoHopCommon& c, const py::dict& d, int rank, uint8_t** out) {
  if (rank < 0 || rank >= c.num_ranks) throw std::invalid_argument("rank out of range");
  if (!d.contains("node_peers")) throw std::invalid_argument("missing field: node_peers");
  auto peers = d["node_peers"].cast<std::vector<uintptr_t>>();
  if (static_cast<int>(peers.size()) != c.ranks_per_node)
    throw std::invalid_argument("node_peers must list every rank of the node");
  for (size_t i = 0; i < peers.size(); ++i) {
    if (peers[i] == 0) throw std::invalid_argument("node_peers: a node rank is not reachable over NVLink");
    out[i] = reinterpret_cast<uint8_t*>(peers[i]);
  }
}

TwoHopDispatchRank dispatch_rank(const TwoHopCommon& c, const py::dict& d) {
  TwoHopDispatchRank a{};
  a.rank = field_num<int>(d, "rank");
  node_peers(c, d, a.rank, a.node_peers);
  a.send_rows = field_ptr<const uint8_t>(d, "send_rows");
  a.rail_send_offsets = field_ptr<const int64_t>(d, "rail_send_offsets");
  a.fwd_offsets = field_ptr<const int64_t>(d, "fwd_offsets");
  a.fwd_row = field_ptr<const int64_t>(d, "fwd_row");
  a.fwd_target = field_ptr<const int32_t>(d, "fwd_target");
  a.fwd_slot = field_ptr<const int64_t>(d, "fwd_slot");
  a.recv_rows = field_ptr<uint8_t>(d, "recv_rows");
  a.recv_stage_row = field_ptr<const int64_t>(d, "recv_stage_row");
  a.num_recv_rows = field_num<int64_t>(d, "num_recv_rows");
  a.record = field_ptr<int32_t>(d, "record");
  if (!a.rail_send_offsets || !a.fwd_offsets || !a.record)
    throw std::invalid_argument("rail_send_offsets, fwd_offsets and record are required");
  return a;
}

TwoHopCombineFormat combine_format(const TwoHopCommon& c, const py::dict& d) {
  TwoHopCombineFormat f{};
  f.hidden = field_num<int64_t>(d, "hidden");
  f.dtype = field_num<int>(d, "dtype");
  f.num_weights = field_num<int>(d, "num_weights");
  f.weights_offset = field_num<int64_t>(d, "weights_offset");
  if (f.dtype != 0 && f.dtype != 1) throw std::invalid_argument("dtype must be 0 (bfloat16) or 1 (float32)");
  if (f.hidden <= 0 || f.num_weights < 0) throw std::invalid_argument("hidden must be > 0, num_weights >= 0");
  const int64_t x_bytes = f.hidden * (f.dtype == 0 ? 2 : 4);
  if (f.weights_offset < x_bytes || f.weights_offset % 4 || f.weights_offset + 4 * f.num_weights > c.payload_bytes)
    throw std::invalid_argument("weights_offset must be 4-aligned, after the x bytes, and the row must fit payload_bytes");
  return f;
}

TwoHopCombineRank combine_rank(const TwoHopCommon& c, const py::dict& d) {
  TwoHopCombineRank a{};
  a.rank = field_num<int>(d, "rank");
  node_peers(c, d, a.rank, a.node_peers);
  a.x = field_ptr<const uint8_t>(d, "x");
  a.ret_row = field_ptr<const int64_t>(d, "ret_row");
  a.ret_offsets = field_ptr<const int64_t>(d, "ret_offsets");
  a.rail_offsets = field_ptr<const int64_t>(d, "rail_offsets");
  a.red_offsets = field_ptr<const int64_t>(d, "red_offsets");
  a.red_stage_row = field_ptr<const int64_t>(d, "red_stage_row");
  a.partial = field_ptr<uint8_t>(d, "partial");
  a.src_offsets = field_ptr<const int64_t>(d, "src_offsets");
  a.src_stage_row = field_ptr<const int64_t>(d, "src_stage_row");
  a.num_tokens = field_num<int64_t>(d, "num_tokens");
  a.combined_x = field_ptr<uint8_t>(d, "combined_x");
  a.combined_weights = field_ptr<float>(d, "combined_weights");
  a.record = field_ptr<int32_t>(d, "record");
  if (!a.ret_offsets || !a.rail_offsets || !a.red_offsets || !a.src_offsets || !a.record)
    throw std::invalid_argument("ret_offsets, rail_offsets, red_offsets, src_offsets and record are required");
  return a;
}

}  // namespace

void register_two_hop(py::module_& m) {
  m.def("two_hop_dispatch", [](const py::dict& common, const std::vector<py::dict>& list, uintptr_t stream) {
    const TwoHopCommon c = common_args(common);
    check_rank_list(c, list.size());
    std::vector<TwoHopDispatchRank> ranks;
    for (const auto& d : list) ranks.push_back(dispatch_rank(c, d));
    if (!nvshmem_built()) throw std::runtime_error("ep_comm._cuda was built without NVSHMEM");
    launch_two_hop_dispatch(c, ranks.data(), static_cast<int>(ranks.size()), reinterpret_cast<void*>(stream));
    if (const char* error = take_launch_error())
      throw std::runtime_error(std::string("two_hop_dispatch: ") + error);
  }, py::arg("common"), py::arg("ranks"), py::arg("stream"),
     "Two-hop dispatch of opaque rows along a NodePlan (see csrc/cuda/internode_two_hop.cu)");
  m.def("two_hop_combine", [](const py::dict& common, const py::dict& format,
                              const std::vector<py::dict>& list, uintptr_t stream) {
    const TwoHopCommon c = common_args(common);
    const TwoHopCombineFormat f = combine_format(c, format);
    check_rank_list(c, list.size());
    std::vector<TwoHopCombineRank> ranks;
    for (const auto& d : list) ranks.push_back(combine_rank(c, d));
    if (!nvshmem_built()) throw std::runtime_error("ep_comm._cuda was built without NVSHMEM");
    launch_two_hop_combine(c, f, ranks.data(), static_cast<int>(ranks.size()), reinterpret_cast<void*>(stream));
    if (const char* error = take_launch_error())
      throw std::runtime_error(std::string("two_hop_combine: ") + error);
  }, py::arg("common"), py::arg("format"), py::arg("ranks"), py::arg("stream"),
     "Two-hop combine (sum per node, then per token) along a NodePlan "
     "(see csrc/cuda/internode_two_hop_combine.cu)");
}

}  // namespace ep_comm::cuda
