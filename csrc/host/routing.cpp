// Host build of the buffer layouts of csrc/common/buffer_layout.h and the timeout record fields
// of csrc/common/timeout.h: the engines (ep_comm/engines/, ep_comm/transports/nvshmem.py,
// ep_comm/paths/fused.py) size and address their NVSHMEM buffers with the offsets the kernels use.
// The per-token routing helpers of csrc/common/routing.h are bound for the tests only, by
// tests/native/host_test_bindings.cpp.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "common/buffer_layout.h"
#include "common/timeout.h"

namespace py = pybind11;

namespace ep_comm::host {
namespace {

py::dict as_dict(const IntranodeLayout& l) {
  py::dict d;
  d["arrival"] = l.arrival; d["channel_counts"] = l.channel_counts; d["expert_counts"] = l.expert_counts;
  d["ring_tail"] = l.ring_tail; d["ring_head"] = l.ring_head; d["ring"] = l.ring;
  d["total_bytes"] = l.total_bytes; d["ring_slots"] = l.ring_slots; d["row_bytes"] = l.row_bytes;
  return d;
}

}  // namespace

void register_routing(py::module_& m) {
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
}

}  // namespace ep_comm::host
