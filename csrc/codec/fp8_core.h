// FP8 (e4m3fn) codec core, shared by the host build (csrc/host/fp8.cpp) and the CUDA kernels
// (csrc/cuda/fp8_kernels.cu). Bit-identical to the torch reference in ep_comm/codecs/fp8.py:
//   per row, per group of 128 channels: amax = max |x| (NaN propagates), clamped below at 1e-4;
//   scale = amax / 448 (fp32 division); with round_scale, scale = 2^ceil(log2(scale)) computed on
//   the float's bits; q = e4m3(x / scale) with round-to-nearest-even, |.| >= 448 saturating to
//   448 (infinities too), NaN -> 0x7F with the sign kept (torch's CPU cast); a NaN amax gives
//   the canonical NaN scale, and NaN quotients follow x86's rules (see divide).
//   UE8M0: the biased exponent byte of the power-of-two scale, 4 per int32, group 4i + j in byte j.
#pragma once
#include <cstdint>
#include <cstring>

#include "common/hd.h"

namespace ep_comm::fp8 {

constexpr int kGroup = 128;
constexpr float kMax = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

EP_HD uint32_t bits_of(float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
EP_HD float float_of(uint32_t u) {
  float v;
  memcpy(&v, &u, 4);
  return v;
}
EP_HD bool is_nan(float v) { return (bits_of(v) & 0x7FFFFFFFu) > 0x7F800000u; }
EP_HD float bf16_to_float(uint16_t b) { return float_of(uint32_t(b) << 16); }

// float32 -> e4m3fn byte, round-to-nearest-even, saturating, exactly as torch's CPU cast.
EP_HD uint8_t float_to_e4m3(float f) {
  uint32_t u = bits_of(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return sign | 0x7Fu;          // NaN
  if (u >= 0x43E00000u) return sign | 0x7Eu;         // >= 448 (and inf): saturate
  if (u >= 0x3C800000u) {                            // >= 2^-6: normal in e4m3
    uint32_t v = u - ((127u - 7u) << 23);            // rebias the exponent 127 -> 7
    uint32_t r = (v + 0x7FFFFu + ((v >> 20) & 1u)) >> 20;  // RNE on the 20 dropped bits
    return sign | static_cast<uint8_t>(r);
  }
  // subnormal e4m3: m * 2^-9, m in [0, 8] (8 carries into the smallest normal)
  uint32_t exp = u >> 23;
  if (exp == 0) return sign;                         // fp32 subnormals are far below 2^-10
  uint32_t shift = 141u - exp;                       // value * 2^9 = mant * 2^-(shift)
  if (shift >= 25u) return sign;                     // < 2^-10: rounds to zero
  uint32_t mant = (u & 0x7FFFFFu) | 0x800000u;
  uint32_t q = mant >> shift;
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | static_cast<uint8_t>(q);
}

// e4m3fn byte -> float32 (exact).
EP_HD float e4m3_to_float(uint8_t b) {
  uint32_t sign = uint32_t(b & 0x80u) << 24;
  uint32_t e = (b >> 3) & 0xFu, m = b & 0x7u;
  if (e == 0xF && m == 0x7) return float_of(sign | 0x7FC00000u);
  if (e == 0) return float_of(sign | bits_of(float(m) * (1.0f / 512.0f)));
  return float_of(sign | ((e + 120u) << 23) | (m << 20));
}

// 2^ceil(log2(s)) for s > 0, on the bits (NaN and inf pass through).
EP_HD float pow2_ceil(float s) {
  uint32_t u = bits_of(s);
  if ((u & 0x7F800000u) == 0x7F800000u) return s;
  return float_of((u + 0x7FFFFFu) & 0xFF800000u);
}

// Scale of a group from its amax (NaN propagates through the clamp).
EP_HD float group_scale(float amax, bool round_scale) {
  if (is_nan(amax)) return float_of(0x7FC00000u);  // torch's amax gives the canonical NaN
  float clamped = amax > kAmaxFloor ? amax : kAmaxFloor;
  float scale = clamped / kMax;
  return round_scale ? pow2_ceil(scale) : scale;
}

EP_HD uint8_t ue8m0_of(float pow2_scale) { return static_cast<uint8_t>((bits_of(pow2_scale) >> 23) & 0xFFu); }

// x / scale with x86's NaN rules (what torch's CPU reference computes), on host and device alike:
// a NaN operand is returned as is (x first), an invalid operation (inf / inf) gives the x86
// "indefinite" NaN 0xFFC00000.
EP_HD float divide(float x, float scale) {
  float r = x / scale;
  if (!is_nan(r)) return r;
  if (is_nan(x)) return float_of(bits_of(x) | 0x00400000u);
  if (is_nan(scale)) return float_of(bits_of(scale) | 0x00400000u);
  return float_of(0xFFC00000u);
}

// amax of one group of kGroup values (NaN propagates as in torch.amax).
template <typename Load>
EP_HD float group_amax(Load load, int64_t begin) {
  float amax = 0.0f;
  for (int k = 0; k < kGroup; ++k) {
    float a = float_of(bits_of(load(begin + k)) & 0x7FFFFFFFu);
    if (is_nan(a) || a > amax) amax = a;
    if (is_nan(amax)) break;
  }
  return amax;
}

// Quantizes one row of `hidden` values (hidden % 128 == 0) given by load(i) -> float.
// q[hidden] bytes; scales: float32 [hidden/128], or, with use_ue8m0, bytes[hidden/128] that form
// the packed int32 words in little-endian order (group 4i + j in byte j of word i).
template <typename Load>
EP_HD void quantize_row(Load load, int64_t hidden, bool round_scale, bool use_ue8m0, uint8_t* q,
                        float* scales_f32, uint8_t* scales_ue8m0) {
  for (int64_t g = 0; g < hidden / kGroup; ++g) {
    float scale = group_scale(group_amax(load, g * kGroup), round_scale || use_ue8m0);
    if (use_ue8m0) {
      scales_ue8m0[g] = ue8m0_of(scale);
    } else {
      scales_f32[g] = scale;
    }
    for (int k = 0; k < kGroup; ++k) {
      int64_t i = g * kGroup + k;
      q[i] = float_to_e4m3(divide(load(i), scale));
    }
  }
}

}  // namespace ep_comm::fp8
