// AVX2 encoder and decoder of the lossless codec's rANS chunks (host only; x86-64): the same steps
// as encode_chunk / decode_chunk in lossless_core.h, 8 lanes per instruction, byte-identical output.
// The decoder runs SIMD steps while a step provably stays inside the word and mantissa streams;
// the remaining steps and all checks run in the portable core.
#pragma once
#if defined(__x86_64__) && !defined(__CUDACC__)
#include <immintrin.h>

#include "codec/lossless_core.h"

namespace ep_comm::lossless {

// expand[mask][i] = number of set bits of mask below bit i: the index, among the lanes that
// consume an item this step, of lane i's item.
struct ExpandTable {
  alignas(32) int32_t idx[256][8];
  ExpandTable() {
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int i = 0; i < 8; ++i) {
        idx[m][i] = k;
        k += (m >> i) & 1;
      }
    }
  }
};

inline const ExpandTable& expand_table() {
  static const ExpandTable table;
  return table;
}

inline bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
  return ok;
}

__attribute__((target("avx2,popcnt"))) inline int decode_chunk_avx2(const uint8_t* payload, const ChunkEntry& e,
                                                                   uint32_t n, const uint32_t* table,
                                                                   uint16_t* out) {
  alignas(32) uint32_t states[kLanes];
  if (!load_states(payload, states)) return kErrStream;
  const uint8_t* words = payload + kStateBytes;
  const uint8_t* mant = words + 2ull * e.num_words;
  const ExpandTable& ex = expand_table();
  const __m256i low11 = _mm256_set1_epi32(int(kProbScale - 1));
  const __m256i low12 = _mm256_set1_epi32(0xFFF);
  const __m256i zero_sym = _mm256_set1_epi32(kZeroSymbol);
  const __m256i m80 = _mm256_set1_epi32(0x80), m7f = _mm256_set1_epi32(0x7F);
  const __m256i zero = _mm256_setzero_si256();
  uint32_t wpos = 0, mpos = 0, t = 0;
  const uint32_t full_steps = n / kLanes;
  __m256i x[4];
  for (int j = 0; j < 4; ++j) x[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(states + 8 * j));
  for (; t < full_steps && wpos + kLanes <= e.num_words && mpos + kLanes <= e.num_mantissa; ++t) {
    __m256i value[4];
    for (int j = 0; j < 4; ++j) {
      __m256i ent = _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), _mm256_and_si256(x[j], low11), 4);
      __m256i sym = _mm256_srli_epi32(ent, 23);
      __m256i freq = _mm256_and_si256(_mm256_srli_epi32(ent, kProbBits), low12);
      __m256i bias = _mm256_and_si256(ent, low11);
      __m256i y = _mm256_add_epi32(_mm256_mullo_epi32(freq, _mm256_srli_epi32(x[j], kProbBits)), bias);
      __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(y, 16), zero);
      int mask = _mm256_movemask_ps(_mm256_castsi256_ps(need));
      __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(words + 2ull * wpos)));
      w = _mm256_permutevar8x32_epi32(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(ex.idx[mask])));
      x[j] = _mm256_blendv_epi8(y, _mm256_or_si256(_mm256_slli_epi32(y, 16), w), need);
      wpos += uint32_t(_mm_popcnt_u32(uint32_t(mask)));
      __m256i is_zero = _mm256_cmpeq_epi32(sym, zero_sym);
      int nz = ~_mm256_movemask_ps(_mm256_castsi256_ps(is_zero)) & 0xFF;
      __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mant + mpos)));
      m = _mm256_permutevar8x32_epi32(m, _mm256_load_si256(reinterpret_cast<const __m256i*>(ex.idx[nz])));
      mpos += uint32_t(_mm_popcnt_u32(uint32_t(nz)));
      __m256i v = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(m, m80), 8),
                                  _mm256_or_si256(_mm256_slli_epi32(sym, 7), _mm256_and_si256(m, m7f)));
      value[j] = _mm256_andnot_si256(is_zero, v);
    }
    for (int j = 0; j < 4; j += 2) {
      __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(value[j], value[j + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * kLanes + 8 * j), packed);
    }
  }
  for (int j = 0; j < 4; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(states + 8 * j), x[j]);
  return decode_chunk_from(payload, e, n, table, out, states, t, wpos, mpos);
}

// compress[mask][p]: source lane of output slot p when the lanes in mask are packed at the top
// (slots 8 - popcount(mask) .. 7, in lane order); lower slots are don't-care.
struct CompressTable {
  alignas(32) int32_t idx[256][8];
  CompressTable() {
    for (int m = 0; m < 256; ++m) {
      int k = __builtin_popcount(m), p = 8 - k;
      for (int i = 0; i < 8; ++i) idx[m][i] = 0;
      for (int i = 0; i < 8; ++i)
        if ((m >> i) & 1) idx[m][p++] = i;
    }
  }
};

inline const CompressTable& compress_table() {
  static const CompressTable table;
  return table;
}

// Encoder tables in the layout the AVX2 encoder gathers from.
struct SimdEncTables {
  int32_t freq_start[kNumSymbols];  // start << 12 | freq
};

inline void make_simd_enc_tables(const EncSym* syms, SimdEncTables& t) {
  for (int s = 0; s < kNumSymbols; ++s) t.freq_start[s] = int32_t((syms[s].start << 12) | syms[s].freq);
}

// Same output as encode_chunk. words_end needs 8 words of slack below words_end - n (the 8-word
// stores may touch them). q = x / freq is floor((x + 0.5) / freq) in double precision: (x + 0.5)
// / freq is at least 0.5 / freq >= 2^-12 away from an integer, and the division is correctly
// rounded (error < 2^21 * 2^-53), so the floor is exact.
__attribute__((target("avx2,popcnt"))) inline void encode_chunk_avx2(const uint16_t* v, uint32_t n,
                                                                    const EncSym* syms, const SimdEncTables& tab,
                                                                    uint32_t* states, uint16_t* words_end,
                                                                    uint8_t* mant, ChunkEntry& e) {
  uint32_t checksum = 0, nm = 0;
  for (uint32_t i = 0; i < n; ++i) {
    uint16_t x = v[i];
    checksum += checksum_term(x, i);
    mant[nm] = mantissa_of(x);
    nm += x != 0 ? 1u : 0u;
  }
  alignas(32) uint32_t st[kLanes];
  for (int l = 0; l < kLanes; ++l) st[l] = kStateLow;
  uint16_t* cursor = words_end;
  const uint32_t full_steps = n / kLanes;
  // the partial top step first (coding runs backwards), scalar
  for (int l = int(n - full_steps * kLanes) - 1; l >= 0; --l) {
    const EncSym& s = syms[symbol_of(v[full_steps * kLanes + l])];
    st[l] = enc_step(st[l], s, cursor);
  }
  const CompressTable& ct = compress_table();
  const __m256i ff = _mm256_set1_epi32(0xFF), zero = _mm256_setzero_si256(), lo16 = _mm256_set1_epi32(0xFFFF);
  const __m256i sign = _mm256_set1_epi32(int(0x80000000u));
  const __m256d two31 = _mm256_set1_pd(2147483648.0), half = _mm256_set1_pd(0.5);
  __m256i x[4];
  for (int j = 0; j < 4; ++j) x[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(st + 8 * j));
  for (uint32_t t = full_steps; t-- > 0;) {
    for (int j = 3; j >= 0; --j) {
      __m256i val = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + t * kLanes + 8 * j)));
      __m256i sym = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(val, 7), ff),
                                    _mm256_and_si256(_mm256_cmpeq_epi32(val, zero), _mm256_set1_epi32(256)));
      __m256i fs = _mm256_i32gather_epi32(tab.freq_start, sym, 4);
      __m256i freq = _mm256_and_si256(fs, _mm256_set1_epi32(0xFFF));
      __m256i start = _mm256_srli_epi32(fs, 12);
      // need: x >= freq << 21, i.e. (x >> 21) >= freq
      __m256i need = _mm256_xor_si256(_mm256_cmpgt_epi32(freq, _mm256_srli_epi32(x[j], 21)), _mm256_set1_epi32(-1));
      int mask = _mm256_movemask_ps(_mm256_castsi256_ps(need));
      __m256i w = _mm256_permutevar8x32_epi32(_mm256_and_si256(x[j], lo16),
                                              _mm256_load_si256(reinterpret_cast<const __m256i*>(ct.idx[mask])));
      __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(cursor - 8), _mm256_castsi256_si128(packed));
      cursor -= _mm_popcnt_u32(uint32_t(mask));
      __m256i y = _mm256_blendv_epi8(x[j], _mm256_srli_epi32(x[j], 16), need);
      __m256i ys = _mm256_xor_si256(y, sign);
      __m256d xd0 = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(ys)), two31);
      __m256d xd1 = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(ys, 1)), two31);
      __m256d f0 = _mm256_cvtepi32_pd(_mm256_castsi256_si128(freq));
      __m256d f1 = _mm256_cvtepi32_pd(_mm256_extracti128_si256(freq, 1));
      __m256d q0 = _mm256_floor_pd(_mm256_div_pd(_mm256_add_pd(xd0, half), f0));
      __m256d q1 = _mm256_floor_pd(_mm256_div_pd(_mm256_add_pd(xd1, half), f1));
      __m256i q = _mm256_set_m128i(_mm256_cvttpd_epi32(q1), _mm256_cvttpd_epi32(q0));
      __m256i r = _mm256_sub_epi32(y, _mm256_mullo_epi32(q, freq));
      x[j] = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(q, kProbBits), r), start);
    }
  }
  for (int j = 0; j < 4; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(states + 8 * j), x[j]);
  e.mode = kModeRans;
  e.num_words = static_cast<uint32_t>(words_end - cursor);
  e.num_mantissa = nm;
  e.checksum = checksum;
}

}  // namespace ep_comm::lossless
#endif
