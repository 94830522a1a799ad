// Portability macros for code shared by the CUDA kernels and the host (CPU) build.
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define EP_HD __host__ __device__ __forceinline__
#else
#define EP_HD inline
#endif

namespace ep_comm {

// Rounds `value` up to a multiple of `alignment` (alignment > 0).
EP_HD int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

EP_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace ep_comm
