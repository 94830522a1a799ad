// CUDA build of the FP8 codec (csrc/codec/fp8_core.h): one warp per (row, 128-channel group);
// lane l quantizes channels 4l..4l+3 with the same conversion as the host build.
#include <cuda_runtime.h>

#include "codec/fp8_core.h"
#include "codec_launch.h"
#include "launch.h"

namespace {
using namespace ep_comm::fp8;

constexpr int kWarpsPerBlock = 8;

__device__ float warp_amax(float a) {
  for (int o = 16; o > 0; o >>= 1) {
    float b = __shfl_xor_sync(0xFFFFFFFFu, a, o);
    // NaN propagates, as in group_amax
    a = (is_nan(a) || is_nan(b)) ? __uint_as_float(0x7FC00000u) : (b > a ? b : a);
  }
  return a;
}

__global__ void quantize_kernel(const uint16_t* x, int64_t rows, int64_t hidden, bool round_scale, bool use_ue8m0,
                                uint8_t* q, void* scales) {
  const int lane = threadIdx.x & 31;
  const int64_t groups = hidden / kGroup;
  const int64_t total = rows * groups;
  for (int64_t w = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; w < total;
       w += int64_t(gridDim.x) * kWarpsPerBlock) {
    const int64_t r = w / groups, g = w % groups;
    const uint16_t* src = x + r * hidden + g * kGroup + 4 * lane;
    float v[4];
    float amax = 0.0f;
    for (int k = 0; k < 4; ++k) {
      v[k] = bf16_to_float(src[k]);
      float a = fabsf(v[k]);
      if (is_nan(a) || is_nan(amax)) amax = __uint_as_float(0x7FC00000u);
      else if (a > amax) amax = a;
    }
    const float scale = group_scale(warp_amax(amax), round_scale || use_ue8m0);
    uint8_t* dst = q + r * hidden + g * kGroup + 4 * lane;
    for (int k = 0; k < 4; ++k) dst[k] = float_to_e4m3(divide(v[k], scale));
    if (lane == 0) {
      if (use_ue8m0) static_cast<uint8_t*>(scales)[r * groups + g] = ue8m0_of(scale);
      else static_cast<float*>(scales)[r * groups + g] = scale;
    }
  }
}

}  // namespace

extern "C" int ep_fp8_quantize_cuda(const uint16_t* x, int64_t rows, int64_t hidden, int round_scale,
                                    int use_ue8m0, uint8_t* q, void* scales, cudaStream_t stream) {
  if (rows < 0 || hidden <= 0 || hidden % kGroup != 0 || (use_ue8m0 && hidden % (4 * kGroup) != 0))
    return cudaErrorInvalidValue;
  const int64_t warps = rows * (hidden / kGroup);
  if (warps == 0) return cudaSuccess;
  int64_t blocks = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > 65535 * 16) blocks = 65535 * 16;
  EP_LAUNCH(quantize_kernel, static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, stream)(
      x, rows, hidden, round_scale != 0, use_ue8m0 != 0, q, scales);
  return static_cast<int>(cudaGetLastError());
}
