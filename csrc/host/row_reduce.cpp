// Combine's per-token sums on the CPU (the portable backend's combines of CPU tensors): the rows
// that come back from every destination rank, summed per source token in float32, read straight
// from the received buffer's blocks. Same float operations in the same order as
// `acc.index_add_(0, token_index, rows[row_index].float() * weights)` into zeros (normal mode's
// ep_comm/row_sum.py reduce_by_source without weights, low-latency combine with them): token t's
// value is ((0 + r_a w_a) + r_b w_b) + ... over its logical rows a < b < ...; a token without
// rows gets 0. Each product is rounded to float32 before it is added (no fused multiply-add:
// setup.py builds with -ffp-contract=off, and the tests compare bits). A NaN added to a NaN may
// keep the other operand's sign and payload than torch's add does (operand order is not fixed on
// either side); every other result is the same bits. It
// differs in what it touches: no gathered or float32 copy of the rows (a 64-token x 7168 message
// per rank is 1.8 MB of bf16, 3.7 MB as float32) and each token's float32 row is summed while it
// sits in L1, tile by tile.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "bindings.h"
#include "codec/host_parallel.h"
#include "gil.h"

namespace py = pybind11;

namespace ep_comm::host {
namespace {

constexpr int kRowsBf16 = 0;
constexpr int kRowsF32 = 1;
// floats of a token's row summed at a time (8 KiB: stays in L1 beside the rows' lines)
constexpr uint64_t kTileFloats = 2048;

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// acc[j] = 0 + row[j] w (first row) or acc[j] += row[j] w, for j in [0, n) (w = 1: no multiply).
template <typename T, bool kFirst, bool kWeighted>
inline void add_row(float* __restrict acc, const T* __restrict row, float w, uint64_t n) {
  for (uint64_t j = 0; j < n; ++j) {
    float v;
    if constexpr (sizeof(T) == 2)
      v = bf16_to_float(row[j]);
    else
      v = row[j];
    if constexpr (kWeighted) {
      const float scaled = v * w;  // rounded here, as torch's mul_ before index_add_
      v = scaled;
    }
    if constexpr (kFirst)
      acc[j] = 0.0f + v;  // as index_add_ into zeros: -0.0 becomes +0.0
    else
      acc[j] += v;
  }
}

template <typename T, bool kWeighted>
void sum_token(float* acc, uint64_t width, const std::vector<const T*>& row_data, const float* weights,
               const int64_t* rows_begin, const int64_t* rows_end) {
  if (rows_begin == rows_end) {
    std::memset(acc, 0, width * sizeof(float));
    return;
  }
  const auto weight = [&](int64_t r) { return kWeighted ? weights[r] : 1.0f; };
  for (uint64_t j0 = 0; j0 < width; j0 += kTileFloats) {
    const uint64_t n = std::min(kTileFloats, width - j0);
    add_row<T, true, kWeighted>(acc + j0, row_data[*rows_begin] + j0, weight(*rows_begin), n);
    for (const int64_t* r = rows_begin + 1; r != rows_end; ++r)
      add_row<T, false, kWeighted>(acc + j0, row_data[*r] + j0, weight(*r), n);
  }
}

// acc [num_tokens, width] float32 (every element written) = the logical rows (times their
// weights) summed per token.
// Physical rows: the blocks block_ptrs[b] of block_rows[b] rows each, in order (rows of `width`
// elements of `dtype`, contiguous). Logical rows i in [0, num_rows): physical row row_index[i]
// (row_index null: physical row i), token token_index[i] in [0, num_tokens), weight weights[i]
// (float32; null: no multiply).
void sum_rows_by_token(uintptr_t acc_ptr, uint64_t num_tokens, uint64_t width, const std::vector<uintptr_t>& block_ptrs,
                       const std::vector<uint64_t>& block_rows, uintptr_t token_index_ptr, uint64_t num_rows,
                       int dtype, int threads, uintptr_t row_index_ptr, uintptr_t weights_ptr) {
  if (dtype != kRowsBf16 && dtype != kRowsF32) throw std::invalid_argument("dtype must be 0 (bf16) or 1 (float32)");
  if (block_ptrs.size() != block_rows.size())
    throw std::invalid_argument("block_ptrs and block_rows must have the same length");
  uint64_t physical = 0;
  for (uint64_t n : block_rows) physical += n;
  const int64_t* row_index = reinterpret_cast<const int64_t*>(row_index_ptr);
  if (row_index == nullptr && physical != num_rows)
    throw std::invalid_argument("block_rows must add up to the rows of token_index");
  const float* weights = reinterpret_cast<const float*>(weights_ptr);
  if (num_tokens > 0 && width > 0 && acc_ptr == 0) throw std::invalid_argument("acc is null");
  for (size_t b = 0; b < block_ptrs.size(); ++b)
    if (block_rows[b] > 0 && width > 0 && block_ptrs[b] == 0) throw std::invalid_argument("a row block is null");
  const int64_t* token_index = reinterpret_cast<const int64_t*>(token_index_ptr);
  if (num_rows > 0 && token_index == nullptr) throw std::invalid_argument("token_index is null");
  float* acc = reinterpret_cast<float*>(acc_ptr);
  const uint64_t elem = dtype == kRowsBf16 ? 2 : 4;
  without_gil([&] {
    // each token's rows in increasing order (a stable counting sort of the rows by token)
    std::vector<int64_t> first(num_tokens + 1, 0), order(num_rows);
    for (uint64_t r = 0; r < num_rows; ++r) {
      const int64_t t = token_index[r];
      if (t < 0 || uint64_t(t) >= num_tokens)
        throw std::invalid_argument("token_index holds " + std::to_string(t) + ", outside [0, " +
                                    std::to_string(num_tokens) + ")");
      if (row_index != nullptr && (row_index[r] < 0 || uint64_t(row_index[r]) >= physical))
        throw std::invalid_argument("row_index holds " + std::to_string(row_index[r]) + ", outside [0, " +
                                    std::to_string(physical) + ")");
      ++first[t + 1];
    }
    for (uint64_t t = 0; t < num_tokens; ++t) first[t + 1] += first[t];
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (uint64_t r = 0; r < num_rows; ++r) order[next[token_index[r]]++] = int64_t(r);
    std::vector<const uint8_t*> physical_rows(physical);
    uint64_t r = 0;
    for (size_t b = 0; b < block_ptrs.size(); ++b)
      for (uint64_t i = 0; i < block_rows[b]; ++i, ++r)
        physical_rows[r] = reinterpret_cast<const uint8_t*>(block_ptrs[b]) + i * width * elem;
    const auto run = [&](auto tag, auto weighted) {
      using T = decltype(tag);
      std::vector<const T*> rows(num_rows);  // logical row -> its data
      for (uint64_t k = 0; k < num_rows; ++k)
        rows[k] = reinterpret_cast<const T*>(physical_rows[row_index ? uint64_t(row_index[k]) : k]);
      // tokens in runs of 8 per claim: a token is 7168 x (2 + 4) bytes of work at H=7168
      parallel_for(int64_t(num_tokens), threads, [&](int64_t t) {
        sum_token<T, decltype(weighted)::value>(acc + uint64_t(t) * width, width, rows, weights,
                                                order.data() + first[t], order.data() + first[t + 1]);
      }, 8);
    };
    if (dtype == kRowsBf16)
      weights ? run(uint16_t{}, std::true_type{}) : run(uint16_t{}, std::false_type{});
    else
      weights ? run(float{}, std::true_type{}) : run(float{}, std::false_type{});
  });
}

}  // namespace

void register_row_reduce(py::module_& m) {
  m.def("sum_rows_by_token", &sum_rows_by_token, py::arg("acc"), py::arg("num_tokens"), py::arg("width"),
        py::arg("block_ptrs"), py::arg("block_rows"), py::arg("token_index"), py::arg("num_rows"), py::arg("dtype"),
        py::arg("threads"), py::arg("row_index") = 0, py::arg("weights") = 0,
        "acc [num_tokens, width] float32 = rows (bf16 or float32 blocks; logical rows row_index, each times "
        "its weight when weights is given) summed per token in logical row order");
}

}  // namespace ep_comm::host
