// ep_comm._cuda's two-hop bindings (csrc/cuda_bindings/two_hop.cpp) and its NVSHMEM heap calls as a
// module of their own, for the CUDA emulation: linked with csrc/cuda/layout.cu, internode.cu and
// internode_two_hop*.cu built on the CPU over the emulated NVSHMEM (csrc/emulation/nvshmem.h, a job
// of one PE; tests/support/emulated_cuda.py), it takes host pointers where ep_comm._cuda takes device
// pointers, so ep_comm/engines/two_hop.py can drive the real kernels and bindings on virtual ranks
// without a GPU (tests/test_two_hop_emulated.py). It adds the emulation's controls (csrc/emulation/).
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "common/device_sync.h"
#include "launch.h"
#include "launchers.h"

namespace ep_comm::cuda {
void register_two_hop(pybind11::module_& m);
}

namespace {
// Holds back the launches queued after it on its stream: `rounds` release stores to *word, each of
// which lets every other resident block run first (csrc/emulation/grid.h), so the other streams get
// ahead by as much as they can before this stream goes on.
__global__ void hold_stream_kernel(int* word, int rounds) {
  for (int i = 1; i <= rounds; ++i) ep_comm::st_release_sys(word, i);
}
}  // namespace

PYBIND11_MODULE(ep_emulated_two_hop, m) {
  using namespace ep_comm::cuda;
  register_two_hop(m);
  m.def("nvshmem_built", &nvshmem_built);
  m.def("nvshmem_malloc", [](int64_t bytes) {
    void* p = nvshmem_alloc(bytes);
    if (!p) throw std::runtime_error("nvshmem_malloc failed");
    return reinterpret_cast<uintptr_t>(p);
  }, pybind11::arg("bytes"), "A zeroed symmetric allocation of the emulated one-PE job (host memory).");
  m.def("nvshmem_free", [](uintptr_t p) { nvshmem_release(reinterpret_cast<void*>(p)); }, pybind11::arg("ptr"));
  m.def("nvshmem_ptr", [](uintptr_t p, int pe) {
    return reinterpret_cast<uintptr_t>(nvshmem_peer_ptr(reinterpret_cast<void*>(p), pe));
  }, pybind11::arg("ptr"), pybind11::arg("pe"));
  m.def("hold_stream", [](uintptr_t word, int rounds, uintptr_t stream) {
    EP_LAUNCH(hold_stream_kernel, 1, 1, reinterpret_cast<cudaStream_t>(stream))(reinterpret_cast<int*>(word), rounds);
    if (cudaGetLastError() != cudaSuccess) throw std::runtime_error("hold_stream: launch failed");
  }, pybind11::arg("word"), pybind11::arg("rounds"), pybind11::arg("stream"),
        "Queues on `stream` a one-thread launch of `rounds` release stores to the int32 at `word`: the "
        "stream's later launches start after the other streams ran ahead.");
  m.def("set_schedule", &ep_emu_set_schedule, pybind11::arg("reverse"),
        "1: later launches resume threads and blocks from the highest index down; 0: from 0 up.");
  m.def("set_device", &ep_emu_set_device, pybind11::arg("sms"), pybind11::arg("blocks_per_sm"),
        "The emulated device of later launches (occupancy, co-resident blocks).");
  m.def("set_resident_limit", &ep_emu_set_resident_limit, pybind11::arg("blocks"),
        "At most this many blocks of a later launch resident at once (0: as the occupancy allows).");
  m.def("set_stall_failure", &ep_emu_set_stall_failure, pybind11::arg("fail"),
        "1: a launch whose blocks stall fails with a description, even when its waits time out.");
  m.def("begin_streams", &ep_emu_begin_streams,
        "Later launches on a non-null stream are queued until run_streams.");
  m.def("run_streams", [] {
    if (ep_emu_run_streams() != 0) throw std::runtime_error(cudaGetErrorString(cudaGetLastError()));
  }, "Runs the queued launches at once, each stream's in order; RuntimeError naming a stall or deadlock.");
}
