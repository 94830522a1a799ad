// ep_comm._cuda's codec bindings (csrc/cuda_bindings/codecs.cpp) as a module of their own, for the
// CUDA emulation: linked with csrc/cuda/codec_launchers.cu and the codec kernels built on the CPU
// (tests/support/emulated_cuda.py), it takes the host pointers of CPU tensors where ep_comm._cuda takes
// device pointers, so ep_comm/codecs/lossless_device.py and fp8.py can drive the real kernels and
// bindings without a GPU (tests/test_codec_lossless_device.py).
#include <pybind11/pybind11.h>

namespace ep_comm::cuda {
void register_codecs(pybind11::module_& m);
}

PYBIND11_MODULE(ep_emulated_codecs, m) { ep_comm::cuda::register_codecs(m); }
