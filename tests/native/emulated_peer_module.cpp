// ep_comm._cuda's peer-buffer kernel bindings (csrc/cuda_bindings/peer_kernels.cpp) as a module of
// their own, for the CUDA emulation: linked with csrc/cuda/layout.cu, intranode.cu and
// low_latency.cu built on the CPU (tests/support/emulated_cuda.py), it takes the host pointers of
// CPU tensors where ep_comm._cuda takes device pointers, so ep_comm/engines/intranode.py can drive
// the real kernels and bindings on virtual ranks without a GPU
// (tests/test_spinning_kernels_emulated.py). It adds the emulation's controls (csrc/emulation/).
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <stdexcept>

namespace ep_comm::cuda {
void register_peer_kernels(pybind11::module_& m);
}

PYBIND11_MODULE(ep_emulated_peer, m) {
  ep_comm::cuda::register_peer_kernels(m);
  m.def("set_schedule", &ep_emu_set_schedule, pybind11::arg("reverse"),
        "1: later launches resume threads and blocks from the highest index down; 0: from 0 up.");
  m.def("set_device", &ep_emu_set_device, pybind11::arg("sms"), pybind11::arg("blocks_per_sm"),
        "The emulated device of later launches (occupancy, co-resident blocks).");
  m.def("set_resident_limit", &ep_emu_set_resident_limit, pybind11::arg("blocks"),
        "At most this many blocks of a later launch resident at once (0: as the occupancy allows).");
  m.def("set_stall_failure", &ep_emu_set_stall_failure, pybind11::arg("fail"),
        "1: a launch whose blocks stall fails with a description, even when its waits time out.");
  m.def("set_external_peers", &ep_emu_set_external_peers, pybind11::arg("seconds"),
        "seconds > 0: ranks in other processes set flags in shared memory; an idle launch waits up to "
        "this long in real time for them before it counts as stalled (0: it stalls at once).");
  m.def("begin_streams", &ep_emu_begin_streams,
        "Later launches on a non-null stream are queued until run_streams.");
  m.def("run_streams", [] {
    if (ep_emu_run_streams() != 0) throw std::runtime_error(cudaGetErrorString(cudaGetLastError()));
  }, "Runs the queued launches at once, each stream's in order; RuntimeError naming a stall or deadlock.");
}
