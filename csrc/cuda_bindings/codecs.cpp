// pybind11 binding of the codec launchers (codec_launchers.h): tensors arrive as data pointers
// (Python ints), the stream as a raw cudaStream_t handle. ep_comm/codecs/lossless_device.py and
// fp8.py own the tensors and check dtypes, devices and sizes before calling; a launch that fails
// raises RuntimeError with the CUDA error.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "codec_launchers.h"

namespace py = pybind11;

namespace ep_comm::cuda {
namespace {

template <class T>
T* device_ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

void check_rc(int rc, const char* what) {
  if (rc != 0) throw std::runtime_error(std::string(what) + " failed: CUDA error " + std::to_string(rc));
}

}  // namespace

void register_codecs(py::module_& m) {
  m.def("lossless_encode_workspace_bytes", &lossless_encode_workspace_bytes, py::arg("num_values"),
        py::arg("chunk_values"), py::arg("version"));
  m.def("lossless_decode_workspace_bytes", &lossless_decode_workspace_bytes, py::arg("num_values"),
        py::arg("chunk_values"), py::arg("field_chunks") = 0);
  m.def("lossless_max_blob_bytes", &lossless_max_blob_bytes, py::arg("num_values"), py::arg("ndim"),
        py::arg("chunk_values"), py::arg("version"));
  m.def(
      "lossless_encode",
      [](uintptr_t values, uint64_t num_values, const std::vector<int64_t>& shape, uint32_t chunk_values,
         uint32_t version, uintptr_t out, uintptr_t out_size, uintptr_t workspace, size_t workspace_bytes,
         uintptr_t stream) {
        check_rc(launch_lossless_encode(device_ptr<const uint16_t>(values), num_values, shape.data(),
                                        static_cast<uint32_t>(shape.size()), chunk_values, version,
                                        device_ptr<uint8_t>(out), device_ptr<uint64_t>(out_size),
                                        device_ptr<void>(workspace), workspace_bytes, device_ptr<void>(stream)),
                 "lossless encode launch");
      },
      py::arg("values"), py::arg("num_values"), py::arg("shape"), py::arg("chunk_values"), py::arg("version"),
      py::arg("out"), py::arg("out_size"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"),
      "bf16 bits [num_values] -> blob in format `version` (4 to 7) at out, its size at out_size (device u64); "
      "asynchronous");
  m.def(
      "lossless_decode",
      [](uintptr_t blob, uint64_t blob_bytes, uintptr_t out, uint64_t num_values, uint32_t min_chunk_values,
         uint64_t field_chunks, uint32_t version, uintptr_t status, uintptr_t workspace, size_t workspace_bytes,
         uintptr_t stream) {
        check_rc(launch_lossless_decode(device_ptr<const uint8_t>(blob), blob_bytes, device_ptr<uint16_t>(out),
                                        num_values, min_chunk_values, field_chunks, version,
                                        device_ptr<int32_t>(status), device_ptr<void>(workspace), workspace_bytes,
                                        device_ptr<void>(stream)),
                 "lossless decode launch");
      },
      py::arg("blob"), py::arg("blob_bytes"), py::arg("out"), py::arg("num_values"), py::arg("min_chunk_values"),
      py::arg("field_chunks"), py::arg("version"), py::arg("status"), py::arg("workspace"),
      py::arg("workspace_bytes"), py::arg("stream"),
      "blob -> out [num_values] bf16 bits, status (device int32: 0 or a lossless::Status); asynchronous;\n"
      "field_chunks: the blob's chunks with coded fields (format 6 on), as the workspace was sized for;\n"
      "version: the blob's format version (its header's), which picks the decode kernels");
  m.def(
      "fp8_quantize",
      [](uintptr_t x, int64_t rows, int64_t hidden, bool round_scale, bool use_ue8m0, uintptr_t q, uintptr_t scales,
         uintptr_t stream) {
        check_rc(launch_fp8_quantize(device_ptr<const uint16_t>(x), rows, hidden, round_scale, use_ue8m0,
                                     device_ptr<uint8_t>(q), device_ptr<void>(scales), device_ptr<void>(stream)),
                 "fp8 quantize launch");
      },
      py::arg("x"), py::arg("rows"), py::arg("hidden"), py::arg("round_scale"), py::arg("use_ue8m0"), py::arg("q"),
      py::arg("scales"), py::arg("stream"),
      "bf16 bits [rows, hidden] -> e4m3 bytes q and scales (float32, or UE8M0 bytes); asynchronous");
}

}  // namespace ep_comm::cuda
