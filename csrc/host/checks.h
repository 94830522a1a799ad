// Argument checks of the host bindings, shared with the test-only bindings that the tests build
// over the same cores (tests/native/host_test_bindings.cpp): a bad argument is a ValueError
// (std::invalid_argument) naming it.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/hierarchy.h"

namespace ep_comm::host {

// The address of a C-contiguous buffer of `count` items of `itemsize` bytes.
inline void* contiguous(const pybind11::buffer_info& info, int64_t count, int64_t itemsize, const char* name) {
  if (info.itemsize != itemsize)
    throw std::invalid_argument(std::string(name) + " has item size " + std::to_string(info.itemsize) +
                                ", expected " + std::to_string(itemsize));
  int64_t expected = itemsize;
  for (int64_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != expected)
      throw std::invalid_argument(std::string(name) + " must be C-contiguous");
    expected *= info.shape[d];
  }
  if (expected / itemsize != count)
    throw std::invalid_argument(std::string(name) + " has " + std::to_string(expected / itemsize) +
                                " items, expected " + std::to_string(count));
  return info.ptr;
}

// The node shape of `num_ranks` ranks in nodes of `ranks_per_node` (at most 32: one bit each in a
// row's target mask).
inline NodeShape node_shape(int num_ranks, int ranks_per_node) {
  if (ranks_per_node <= 0 || ranks_per_node > 32 || num_ranks % ranks_per_node)
    throw std::invalid_argument("ranks_per_node must be in [1, 32] and divide num_ranks");
  return NodeShape{num_ranks, ranks_per_node};
}

}  // namespace ep_comm::host
