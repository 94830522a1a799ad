// The bfloat16 types and conversions of <cuda_bf16.h> that the kernels use, for the CUDA emulation
// (csrc/emulation/cuda_runtime.h): float to bfloat16 rounds to nearest, ties to even (NaN stays a
// NaN), as __floats2bfloat162_rn does on the GPU; bfloat16 to float is exact.
#pragma once
#ifndef EP_CUDA_EMULATION
#error "csrc/emulation/cuda_bf16.h is the CUDA emulation: build with -DEP_CUDA_EMULATION"
#endif

#include <cstdint>
#include <cstring>

#include "cuda_runtime.h"

struct __nv_bfloat16 {
  uint16_t bits;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = uint32_t(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return __nv_bfloat16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
