// Row gather-scatter on the CPU for the portable backend's packing and unpacking of CPU tensors:
// dst row dst_index[i] = src row src_index[i], one memcpy per row. The torch form of it,
// `dst.index_copy_(0, dst_index, src.index_select(0, src_index))`, copies every row twice and
// faults in a fresh temporary of all the rows on each call (a low-latency receive moves about
// 15 MB per rank per call at H=7168).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "bindings.h"
#include "codec/host_parallel.h"
#include "gil.h"

namespace py = pybind11;

namespace ep_comm::host {
namespace {

void check_index(const int64_t* index, uint64_t count, uint64_t rows, const char* name) {
  for (uint64_t i = 0; i < count; ++i)
    if (index[i] < 0 || uint64_t(index[i]) >= rows)
      throw std::invalid_argument(std::string(name) + " holds " + std::to_string(index[i]) + ", outside [0, " +
                                  std::to_string(rows) + ")");
}

// Rows of row_bytes bytes: dst + dst_index[i] * dst_stride <- src + src_index[i] * src_stride, for i
// in [0, count). dst_rows / src_rows bound the indices; dst_index must not repeat (rows are copied
// in parallel). Strides are in bytes.
void copy_rows(uintptr_t dst, uint64_t dst_rows, uint64_t dst_stride, uintptr_t dst_index_ptr, uintptr_t src,
               uint64_t src_rows, uint64_t src_stride, uintptr_t src_index_ptr, uint64_t count, uint64_t row_bytes,
               int threads) {
  if (count == 0 || row_bytes == 0) return;
  if (dst == 0 || src == 0 || dst_index_ptr == 0 || src_index_ptr == 0)
    throw std::invalid_argument("copy_rows: null pointer");
  if (row_bytes > dst_stride || row_bytes > src_stride)
    throw std::invalid_argument("copy_rows: row_bytes exceeds a row stride");
  const int64_t* dst_index = reinterpret_cast<const int64_t*>(dst_index_ptr);
  const int64_t* src_index = reinterpret_cast<const int64_t*>(src_index_ptr);
  check_index(dst_index, count, dst_rows, "dst_index");
  check_index(src_index, count, src_rows, "src_index");
  uint8_t* out = reinterpret_cast<uint8_t*>(dst);
  const uint8_t* in = reinterpret_cast<const uint8_t*>(src);
  without_gil([&] {
    // runs of rows per claim: about 64 KiB of copying each
    const int64_t grain = int64_t(std::max<uint64_t>(1, (64u << 10) / row_bytes));
    parallel_for(int64_t(count), threads, [&](int64_t i) {
      std::memcpy(out + uint64_t(dst_index[i]) * dst_stride, in + uint64_t(src_index[i]) * src_stride, row_bytes);
    }, grain);
  });
}

}  // namespace

void register_row_copy(py::module_& m) {
  m.def("copy_rows", &copy_rows, py::arg("dst"), py::arg("dst_rows"), py::arg("dst_stride"), py::arg("dst_index"),
        py::arg("src"), py::arg("src_rows"), py::arg("src_stride"), py::arg("src_index"), py::arg("count"),
        py::arg("row_bytes"), py::arg("threads"),
        "dst row dst_index[i] = src row src_index[i] (row_bytes bytes each, strides in bytes), i < count");
}

}  // namespace ep_comm::host
