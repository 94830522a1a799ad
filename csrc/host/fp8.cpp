// Host (CPU) build of the FP8 codec core (csrc/codec/fp8_core.h): per-row quantization, parallel
// over rows. The e4m3 <-> float conversions it is tested through are bound for the tests only, by
// tests/native/host_test_bindings.cpp.
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "bindings.h"
#include "checks.h"
#include "gil.h"
#include "codec/fp8_core.h"
#include "codec/host_parallel.h"

namespace py = pybind11;
using namespace ep_comm::fp8;

namespace ep_comm::host {
namespace {

// x: [rows, hidden] bf16 bits (itemsize 2) or float32 (itemsize 4); q: [rows, hidden] bytes;
// scales: [rows, hidden/128] float32, or [rows, hidden/512] int32 with use_ue8m0.
void quantize(const py::buffer& x, int64_t rows, int64_t hidden, bool round_scale, bool use_ue8m0,
              const py::buffer& q, const py::buffer& scales, int threads) {
  if (rows < 0 || hidden <= 0 || hidden % kGroup != 0)
    throw std::invalid_argument("hidden must be a positive multiple of 128");
  if (use_ue8m0 && hidden % (4 * kGroup) != 0)
    throw std::invalid_argument("use_ue8m0 needs hidden % 512 == 0");
  py::buffer_info xi = x.request(), qi = q.request(true), si = scales.request(true);
  const int64_t groups = hidden / kGroup;
  const bool bf16 = xi.itemsize == 2;
  const void* xp = contiguous(xi, rows * hidden, bf16 ? 2 : 4, "x");
  auto* qp = static_cast<uint8_t*>(contiguous(qi, rows * hidden, 1, "q"));
  void* sp = contiguous(si, use_ue8m0 ? rows * groups / 4 : rows * groups, 4, "scales");
  // one thread below ~1 MB of input: starting threads would cost more than it saves
  const int nt = rows * hidden < (1 << 19) ? 1 : (threads > 0 ? threads : hardware_threads());
  constexpr int64_t kRowsPerTask = 16;
  auto quantize_one = [&](int64_t r) {
    float* sf = use_ue8m0 ? nullptr : static_cast<float*>(sp) + r * groups;
    uint8_t* su = use_ue8m0 ? static_cast<uint8_t*>(sp) + r * groups : nullptr;
    uint8_t* qr = qp + r * hidden;
    if (bf16) {
      const uint16_t* row = static_cast<const uint16_t*>(xp) + r * hidden;
      quantize_row([row](int64_t i) { return bf16_to_float(row[i]); }, hidden, round_scale, use_ue8m0,
                   qr, sf, su);
    } else {
      const float* row = static_cast<const float*>(xp) + r * hidden;
      quantize_row([row](int64_t i) { return row[i]; }, hidden, round_scale, use_ue8m0, qr, sf, su);
    }
  };
  without_gil([&] {
    parallel_for((rows + kRowsPerTask - 1) / kRowsPerTask, nt, [&](int64_t task) {
      for (int64_t r = task * kRowsPerTask; r < rows && r < (task + 1) * kRowsPerTask; ++r) quantize_one(r);
    });
  });
}

}  // namespace

void register_fp8(py::module_& m) {
  m.def("fp8_quantize", &quantize, py::arg("x"), py::arg("rows"), py::arg("hidden"),
        py::arg("round_scale"), py::arg("use_ue8m0"), py::arg("q"), py::arg("scales"),
        py::arg("threads") = 0,
        "per-128-channel e4m3 quantization of x [rows, hidden] (bf16 bits or float32) into q and scales");
}

}  // namespace ep_comm::host
