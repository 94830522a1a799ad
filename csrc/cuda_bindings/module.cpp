// ep_comm._cuda: pybind11 binding of the kernel launchers (csrc/cuda_bindings/launchers.h).
// Compiled by g++ without torch or CUDA headers (argument conventions: binding_args.h). The
// peer-buffer kernels' bindings are in peer_kernels.cpp, the two-hop ones in two_hop.cpp, the
// codecs' in codecs.cpp; this file adds NVSHMEM's.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "../common/timeout.h"
#include "binding_args.h"
#include "launchers.h"

namespace py = pybind11;
using namespace ep_comm::cuda;

namespace ep_comm::cuda {
void register_two_hop(py::module_& m);  // two_hop.cpp
void register_codecs(py::module_& m);   // codecs.cpp
void register_peer_kernels(py::module_& m);  // peer_kernels.cpp
}

namespace {

using ep_comm::cuda::bindings::check_launch;
using ep_comm::cuda::bindings::num;
using ep_comm::cuda::bindings::ptr;
using ep_comm::cuda::bindings::stream_of;

void require_nvshmem() {
  if (!nvshmem_built()) throw std::runtime_error("ep_comm._cuda was built without NVSHMEM");
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "ep_comm CUDA kernels: layout, intranode (NVLink / virtual ranks), low-latency, internode";
  m.attr("max_ranks_per_launch") = kMaxRanks;
  m.attr("timeout_record_words") = static_cast<int>(ep_comm::kRecordWords);
  register_two_hop(m);
  register_codecs(m);
  register_peer_kernels(m);
#if defined(EP_COMM_CUDA_ARCHS)
  m.attr("archs") = std::string(EP_COMM_CUDA_ARCHS);
  m.attr("nvshmem") = static_cast<bool>(EP_COMM_NVSHMEM);
  m.attr("nvshmem_reason") = std::string(EP_COMM_NVSHMEM_REASON);
#endif

  m.def("nvshmem_built", &nvshmem_built);
  m.def("nvshmem_unique_id", []() {
    require_nvshmem();
    std::string id(static_cast<size_t>(nvshmem_unique_id_size()), '\0');
    nvshmem_get_unique_id(reinterpret_cast<uint8_t*>(id.data()));
    return py::bytes(id);
  });
  m.def("nvshmem_init", [](const py::bytes& id, int rank, int num_ranks) {
    require_nvshmem();
    std::string s = id;
    if (static_cast<int>(s.size()) != nvshmem_unique_id_size()) throw std::invalid_argument("bad unique id size");
    nvshmem_init_with_unique_id(reinterpret_cast<const uint8_t*>(s.data()), rank, num_ranks);
  });
  m.def("nvshmem_finalize", []() { require_nvshmem(); nvshmem_finalize_pe(); });
  m.def("nvshmem_my_pe", []() { require_nvshmem(); return nvshmem_my_pe_id(); });
  m.def("nvshmem_n_pes", []() { require_nvshmem(); return nvshmem_num_pes(); });
  m.def("nvshmem_malloc", [](int64_t bytes) {
    require_nvshmem();
    void* p = nvshmem_alloc(bytes);
    if (!p) throw std::runtime_error("nvshmem_malloc failed (raise NVSHMEM_SYMMETRIC_SIZE)");
    return reinterpret_cast<uintptr_t>(p);
  });
  m.def("nvshmem_free", [](uintptr_t p) { require_nvshmem(); nvshmem_release(reinterpret_cast<void*>(p)); });
  m.def("nvshmem_ptr", [](uintptr_t p, int pe) {
    require_nvshmem();
    return reinterpret_cast<uintptr_t>(nvshmem_peer_ptr(reinterpret_cast<void*>(p), pe));
  });
  m.def("nvshmem_barrier_on_stream", [](uintptr_t s) { require_nvshmem(); nvshmem_barrier_on_stream(stream_of(s)); });
  // A barrier over PEs [0, num_pes) with a timeout (csrc/cuda/internode.cu bounded_barrier_kernel):
  // words = the symmetric u64[num_pes] region, value = this barrier's number (the same on every
  // PE, growing), record = the caller's TimeoutRecord (a PE that never arrives is recorded there).
  m.def("launch_bounded_barrier", [](uintptr_t words, int num_pes, int my_pe, unsigned long long value,
                                     unsigned long long timeout_ns, uintptr_t record, uintptr_t s) {
    require_nvshmem();
    if (num_pes < 1 || my_pe < 0 || my_pe >= num_pes)
      throw std::invalid_argument("launch_bounded_barrier: my_pe must be in [0, num_pes)");
    launch_bounded_barrier(reinterpret_cast<uint64_t*>(words), num_pes, my_pe, value, timeout_ns,
                           reinterpret_cast<int32_t*>(record), stream_of(s));
  }, py::arg("words"), py::arg("num_pes"), py::arg("my_pe"), py::arg("value"), py::arg("timeout_ns"),
     py::arg("record"), py::arg("stream"));
  // The same barrier numbered by a device counter (round: this PE's uint64 count, zero at first),
  // so that a CUDA graph replaying it stays a barrier (csrc/cuda/internode.cu counted_barrier_kernel).
  m.def("launch_counted_barrier", [](uintptr_t words, uintptr_t round, int num_pes, int my_pe,
                                     unsigned long long timeout_ns, uintptr_t record, uintptr_t s) {
    require_nvshmem();
    if (num_pes < 1 || my_pe < 0 || my_pe >= num_pes)
      throw std::invalid_argument("launch_counted_barrier: my_pe must be in [0, num_pes)");
    launch_counted_barrier(reinterpret_cast<uint64_t*>(words), reinterpret_cast<unsigned long long*>(round),
                           num_pes, my_pe, timeout_ns, reinterpret_cast<int32_t*>(record), stream_of(s));
  }, py::arg("words"), py::arg("round"), py::arg("num_pes"), py::arg("my_pe"), py::arg("timeout_ns"),
     py::arg("record"), py::arg("stream"));
  m.def("exchange_round", [](const py::dict& d, uintptr_t stream) {
    require_nvshmem();
    launch_exchange_round(ptr<uint8_t>(d, "symmetric"), num<int64_t>(d, "slot_bytes"),
                          ptr<const uint8_t>(d, "send"), ptr<const int64_t>(d, "send_offsets"),
                          ptr<const int64_t>(d, "send_bytes"), ptr<uint8_t>(d, "recv"),
                          ptr<const int64_t>(d, "recv_offsets"), ptr<const int64_t>(d, "recv_bytes"),
                          num<int>(d, "num_ranks"), num<int>(d, "my_pe"),
                          num<unsigned long long>(d, "round_value"), num<unsigned long long>(d, "timeout_ns"),
                          ptr<int32_t>(d, "record"), stream_of(stream));
    check_launch("exchange_round");
  });
}
