// AVX2 encoder and decoder of the lossless codec's chunks (host only; x86-64): the same steps as
// split_chunk / rans_encode_chunk / decode_chunk in lossless_core.h, 8 lanes per instruction,
// byte-identical output.
// The decoder runs SIMD steps while a step provably stays inside the word and mantissa streams;
// the remaining steps and all checks run in the portable core.
#pragma once
#if defined(__x86_64__) && !defined(__CUDACC__)
#include <immintrin.h>

#include <cmath>

#include "codec/lossless_core.h"
#include "codec/lossless_scalar.h"  // SymbolHistogram, ChunkSurvey, pack_fields_in_place

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

// pair_mix of each 32-bit lane (version 7's checksum).
__attribute__((target("avx2"))) inline __m256i pair_mix_avx2(__m256i u) {
  const __m256i m = _mm256_mullo_epi32(u, _mm256_set1_epi32(static_cast<int>(kPairMix)));
  return _mm256_xor_si256(m, _mm256_srli_epi32(m, 16));
}

// Running chunk checksum (checksum_of), 16 values per add(), over the chunk's values from index
// `first` on (even for pairs), without multiplies in the weighted sum: per lane l, P_l = the sum
// of its terms so far and Q_l = the sum of P_l over the steps, so that sum_s s t_s = T P_l - Q_l
// after T steps. Versions 2-6 (a lane per value, value first + 16 s + l in step s): the checksum
// is sum_l 32 (T P_l - Q_l) + (2 (first + l) + 1) P_l; version 7 (pairs: a lane per pair
// first / 2 + 8 s + l, its term pair_mix of it): sum_l 16 (T P_l - Q_l) + (first + 2 l + 1) P_l
// (all mod 2^32). Four adds per 16 values instead of two vpmulld and four adds (C++ A/B on real
// tensors, alternating order, 3 runs: the encoder's histogram pass took 4-13% less time on an
// Emerald Rapids Xeon).
struct ChecksumAvx2 {
  __m256i p0, p1, q0, q1;  // lanes 0-7 and 8-15 (pairs: p0 and q0, lanes 0-7)
  uint32_t first, steps = 0;
  bool pairs;
  __attribute__((target("avx2"))) ChecksumAvx2(uint32_t first_index, bool pair_checksum)
      : p0(_mm256_setzero_si256()), p1(_mm256_setzero_si256()), q0(_mm256_setzero_si256()),
        q1(_mm256_setzero_si256()), first(first_index), pairs(pair_checksum) {}
  // The next 16 values (v[first + 16 k .. first + 16 k + 15] after k earlier calls).
  __attribute__((target("avx2"))) void add(__m256i x) {
    if (pairs) {
      p0 = _mm256_add_epi32(p0, pair_mix_avx2(x));
      q0 = _mm256_add_epi32(q0, p0);
    } else {
      p0 = _mm256_add_epi32(p0, _mm256_cvtepu16_epi32(_mm256_castsi256_si128(x)));
      p1 = _mm256_add_epi32(p1, _mm256_cvtepu16_epi32(_mm256_extracti128_si256(x, 1)));
      q0 = _mm256_add_epi32(q0, p0);
      q1 = _mm256_add_epi32(q1, p1);
    }
    ++steps;
  }
  // The checksum's part over the values added so far.
  __attribute__((target("avx2"))) uint32_t total() const {
    alignas(32) uint32_t p[16], q[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(p), p0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(p + 8), p1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), q0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8), q1);
    uint32_t sum = 0;
    if (pairs) {
      for (uint32_t l = 0; l < 8; ++l) sum += 16u * (steps * p[l] - q[l]) + (first + 2u * l + 1u) * p[l];
    } else {
      for (uint32_t l = 0; l < 16; ++l) sum += 32u * (steps * p[l] - q[l]) + (2u * (first + l) + 1u) * p[l];
    }
    return sum;
  }
};

// checksum_of a chunk's values v[0, n), 16 values per step.
__attribute__((target("avx2"))) inline uint32_t chunk_checksum_avx2(const uint16_t* v, uint32_t n, bool pairs) {
  ChecksumAvx2 checksum(0, pairs);
  uint32_t i = 0;
  for (; i + 16 <= n; i += 16) checksum.add(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)));
  return checksum.total() + checksum_of(v + i, n - i, i, pairs);
}

// Zero-padded copy of the last bytes of a stream, so that SIMD steps near its end read in bounds.
// Covers stream bytes [first, first + kBytes): the stream's last min(size, kBytes / 2) bytes, then
// zeros. SIMD steps read from it once a stream has fewer than kBytes / 2 bytes left.
struct StreamTail {
  static constexpr uint32_t kBytes = 128;
  alignas(16) uint8_t bytes[kBytes];
  uint64_t first;
  StreamTail(const uint8_t* stream, uint64_t size) {
    const uint64_t keep = size < kBytes / 2 ? size : kBytes / 2;
    first = size - keep;
    memset(bytes, 0, kBytes);
    if (keep > 0) memcpy(bytes, stream + first, keep);
  }
};

// The decode table entries of the 8 slots in `slot` (each < kProbScale). Per-lane loads, the slots
// moved to general registers two at a time: faster on Zen 3 than vpgatherdd or a store and eight
// reloads (measured, C++ loop over real blobs: the decoder took about 10% less time than with
// either; the loads sit on the loop's critical path). On an Emerald Rapids Xeon, vpgatherdd took
// 6-28% less time here; CPUs with AVX-512 take lossless_avx512.h's decoder instead.
__attribute__((target("avx2"))) inline __m256i lookup_entries(const DecodeTable& table, __m256i slot) {
  const __m128i lo = _mm256_castsi256_si128(slot), hi = _mm256_extracti128_si256(slot, 1);
  const uint64_t a = uint64_t(_mm_cvtsi128_si64(lo)), b = uint64_t(_mm_extract_epi64(lo, 1));
  const uint64_t c = uint64_t(_mm_cvtsi128_si64(hi)), d = uint64_t(_mm_extract_epi64(hi, 1));
  const uint32_t* t = table.entry;
  return _mm256_setr_epi32(int(t[uint32_t(a)]), int(t[a >> 32]), int(t[uint32_t(b)]), int(t[b >> 32]),
                           int(t[uint32_t(c)]), int(t[c >> 32]), int(t[uint32_t(d)]), int(t[d >> 32]));
}

// The decoder's raw fields, 16 at a time, straight into 16-bit lanes: ctrl[sh] is a pshufb
// control giving 16-bit lane k (k < 8 in the low 128 bits, k - 8 in the high ones) the two bytes
// that hold field k of 16 fields starting 2 sh bits into byte 0 of 16 bytes broadcast to both
// halves; mul[sh][k] = 2^(10 - s) for s the field's bit offset in those two bytes, so that the
// 16-bit product's top 6 bits are the field. One broadcast load, one pshufb, one multiply and one
// shift per 16 fields (C++ A/B on real blobs, Emerald Rapids Xeon: the decoder took 0.97-0.99x
// the time it took with the fields unpacked to bytes first and widened).
struct FieldSpreadTable {
  alignas(32) uint8_t ctrl[4][32];
  alignas(32) uint16_t mul[4][16];
  FieldSpreadTable() {
    for (int sh = 0; sh < 4; ++sh)
      for (int k = 0; k < 16; ++k) {
        const int bit = 2 * sh + kRawBits * k;
        ctrl[sh][2 * k] = static_cast<uint8_t>(bit >> 3);
        ctrl[sh][2 * k + 1] = static_cast<uint8_t>((bit >> 3) + 1);
        mul[sh][k] = static_cast<uint16_t>(1u << (10 - (bit & 7)));
      }
  }
};

inline const FieldSpreadTable& field_spread_table() {
  static const FieldSpreadTable table;
  return table;
}

// 16 packed 6-bit fields starting 2 sh bits into byte p (16 bytes readable) -> one per 16-bit
// lane, in order.
__attribute__((target("avx2"))) inline __m256i spread_fields16(const uint8_t* p, const __m256i& ctrl,
                                                              const __m256i& mul) {
  const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(bytes, ctrl), mul), 10);
}

// The SIMD step at states x, if it decodes 32 +0.0 (every slot above `last_nonzero_slot`) without
// renormalising a state: then advances x and returns true; otherwise leaves x as it was and
// returns false. The zero runs of gradients take this path: no table loads and no stream reads.
__attribute__((target("avx2"))) inline bool zero_step_in_place(__m256i x[4], __m256i last_nonzero_slot,
                                                               const DecodeTable& table) {
  const __m256i zero = _mm256_setzero_si256(), slot_mask = _mm256_set1_epi32(int(table.slot_mask));
  const __m256i prob_bits = _mm256_set1_epi32(int(table.prob_bits));  // per-lane shift counts: vpsrlvd is one uop
  const __m256i start = _mm256_set1_epi32(int(table.zero_start)), freq = _mm256_set1_epi32(int(table.zero_freq));
  __m256i slot[4], all = _mm256_set1_epi32(-1);
  for (int j = 0; j < 4; ++j) {
    slot[j] = _mm256_and_si256(x[j], slot_mask);
    all = _mm256_and_si256(all, _mm256_cmpgt_epi32(slot[j], last_nonzero_slot));
  }
  if (_mm256_movemask_ps(_mm256_castsi256_ps(all)) != 0xFF) return false;
  __m256i y[4], low = zero;
  for (int j = 0; j < 4; ++j) {
    y[j] = _mm256_add_epi32(_mm256_mullo_epi32(freq, _mm256_srlv_epi32(x[j], prob_bits)),
                            _mm256_sub_epi32(slot[j], start));
    low = _mm256_or_si256(low, _mm256_cmpeq_epi32(_mm256_srli_epi32(y[j], 16), zero));
  }
  if (!_mm256_testz_si256(low, low)) return false;
  for (int j = 0; j < 4; ++j) x[j] = y[j];
  return true;
}

// Same result as decode_chunk. A SIMD step (32 values: 4 x 8 lanes) reads, per 8 lanes, 16 bytes
// of words at word wpos; its raw fields are read 28 bytes at once (24 used) at the byte holding
// field rpos when every lane takes one, or else 8 bytes per 8 lanes. Steps read the streams in
// place while the whole step stays inside them, and from zero-padded copies of the streams' last
// 64 bytes near their ends (so short streams, e.g. of chunks of +0.0, decode in SIMD too). A
// stream consumed past its end is corrupted: the step loop stops and the portable core reports it.
// kHasZero = false (the chunk holds no +0.0, as most activation and weight chunks) drops the zero
// tests: every lane then takes the next raw field, 32 fields = 24 bytes per step.
// kHasZero (only when the table has a +0.0 slot range) tests each step's slots: after a step of 32
// +0.0, the next is tried as 32 +0.0 without renormalisation, which only updates the states
// (zero_step_in_place); a step without +0.0 takes its 32 fields at once, as without kHasZero; only
// a step that mixes the two compacts fields per 8 lanes (so chunks with a few scattered +0.0, as
// gradients have, decode nearly as fast as chunks without).
// kFlagZeroHi (with kHasZero = false) sets saw_zero_hi when a SIMD step decoded a symbol whose top
// 10 value bits are zero: a +0.0 slot, which that path cannot tell apart, or the subnormals
// 0x0001-0x003F (one vector compare per 16 values).
template <bool kHasZero, bool kFlagZeroHi = false>
__attribute__((target("avx2,popcnt"))) inline int decode_chunk_avx2_impl(const uint8_t* payload, const ChunkEntry& e,
                                                                        uint32_t n, const DecodeTable& table,
                                                                        uint16_t* out, bool pairs,
                                                                        bool* saw_zero_hi = nullptr) {
  __m256i zero_hi = _mm256_setzero_si256();
  alignas(32) uint32_t states[kLanes];
  if (!load_states(payload, states)) return kErrStream;
  const uint8_t* words = payload + kStateBytes;
  const uint8_t* raw = words + 2ull * e.num_words;
  const uint64_t nraw_bytes = raw_bytes(e.num_raw);
  const ExpandTable& ex = expand_table();
  const FieldSpreadTable& spread = field_spread_table();
  const __m256i low11 = _mm256_set1_epi32(int(kProbScale - 1));
  const __m256i slot_mask = _mm256_set1_epi32(int(table.slot_mask));
  const __m256i prob_bits = _mm256_set1_epi32(int(table.prob_bits));  // per-lane shift counts: vpsrlvd is one uop
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i hi_mask = _mm256_set1_epi16(int16_t(0xFFC0));
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  // +0.0 is the table's last symbol and the frequencies sum to kProbScale (checked when the table
  // is read), so its slots are [zero_start, kProbScale): a lane decodes +0.0 iff its slot is above
  // zero_start - 1 (one signed compare)
  const __m256i last_nonzero_slot = _mm256_set1_epi32(int(table.zero_start) - 1);
  bool try_zero_step = kHasZero;  // kHasZero: the previous step decoded 32 +0.0 (or this is the first)
  const __m256i zero = _mm256_setzero_si256();
  uint32_t wpos = 0, rpos = 0, t = 0;
  const uint32_t full_steps = n / kLanes;
  __m256i x[4];
  for (int j = 0; j < 4; ++j) x[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(states + 8 * j));
  const uint64_t nword_bytes = 2ull * e.num_words;
  const StreamTail word_tail(words, nword_bytes), raw_tail(raw, nraw_bytes);
  // A step reads word bytes [2 wpos, 2 wpos + 64) (8 lanes read 16 bytes at 2 wpos_j, wpos_j <=
  // wpos + 24) and raw bytes [6 rpos / 8, 6 rpos / 8 + 28) (per 8 lanes: 8 bytes from the byte of
  // field rpos_j <= rpos + 24). Out of place, wpos <= num_words and rpos <= num_raw keep both
  // within the tails' 128 bytes.
  constexpr uint64_t kRawReach = 28;
  for (; t < full_steps && wpos <= e.num_words && rpos <= e.num_raw; ++t) {
    if constexpr (kHasZero) {
      if (try_zero_step && zero_step_in_place(x, last_nonzero_slot, table)) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * kLanes), zero);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * kLanes + 16), zero);
        continue;
      }
    }
    uint32_t zero_bits = 0;  // kHasZero: bit 8 j + i set when lane i of group j decodes +0.0
    const bool words_in_place = 2ull * wpos + 64 <= nword_bytes;
    const bool raw_in_place = uint64_t(rpos) * kRawBits / 8 + kRawReach <= nraw_bytes;
    // stream byte b is at src + (b - skip)
    const uint8_t* word_src = words_in_place ? words : word_tail.bytes;
    const uint64_t word_skip = words_in_place ? 0 : word_tail.first;
    const uint8_t* raw_src = raw_in_place ? raw : raw_tail.bytes;
    const uint64_t raw_skip = raw_in_place ? 0 : raw_tail.first;
    __m256i hi[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i slot = _mm256_and_si256(x[j], slot_mask);
      const __m256i ent = lookup_entries(table, slot);
      const __m256i freq = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(ent, kProbBits), low11), one);
      const __m256i bias = _mm256_and_si256(ent, low11);
      const __m256i y = _mm256_add_epi32(_mm256_mullo_epi32(freq, _mm256_srlv_epi32(x[j], prob_bits)), bias);
      const __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(y, 16), zero);
      const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(need));
      __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(word_src + (2ull * wpos - word_skip))));
      w = _mm256_permutevar8x32_epi32(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(ex.idx[mask])));
      x[j] = _mm256_blendv_epi8(y, _mm256_or_si256(_mm256_slli_epi32(y, 16), w), need);
      wpos += uint32_t(_mm_popcnt_u32(uint32_t(mask)));
      hi[j] = _mm256_srli_epi32(ent, 16);  // the symbol's top 10 value bits at bits 6-15, freq bits below
      if constexpr (kHasZero) {
        const __m256i is_zero = _mm256_cmpgt_epi32(slot, last_nonzero_slot);
        zero_bits |= uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(is_zero))) << (8 * j);
      }
    }
    try_zero_step = zero_bits == 0xFFFFFFFFu;  // zero runs are long: try the next step as one
    const bool field_per_lane = zero_bits == 0;
    __m256i fields[2] = {zero, zero};  // field_per_lane: the step's 32 raw fields, 16 bits each
    if (field_per_lane) {
      const uint64_t bit = uint64_t(rpos) * kRawBits;  // a multiple of 8 bits without kHasZero
      const uint32_t sh = kHasZero ? uint32_t(bit & 7) >> 1 : 0u;
      const uint8_t* src = raw_src + ((bit >> 3) - raw_skip);  // fields 16-31 start 12 bytes on
      const __m256i ctrl = _mm256_load_si256(reinterpret_cast<const __m256i*>(spread.ctrl[sh]));
      const __m256i mul = _mm256_load_si256(reinterpret_cast<const __m256i*>(spread.mul[sh]));
      fields[0] = spread_fields16(src, ctrl, mul);
      fields[1] = spread_fields16(src + 12, ctrl, mul);
      rpos += kLanes;
    } else {
      for (int j = 0; j < 4; ++j) {
        // the +0.0 lanes' value is 0 (hi and field dropped); the others take the next fields in order
        const int nonzero = int(~(zero_bits >> (8 * j)) & 0xFF);
        const __m256i keep = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(nonzero), lane_bit), lane_bit);
        const uint64_t bit = uint64_t(rpos) * kRawBits;
        const uint64_t f8 = unpack6x8(load_le<uint64_t>(raw_src + ((bit >> 3) - raw_skip)) >> (bit & 7));
        __m256i r = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(f8)));
        r = _mm256_permutevar8x32_epi32(r, _mm256_load_si256(reinterpret_cast<const __m256i*>(ex.idx[nonzero])));
        rpos += uint32_t(_mm_popcnt_u32(uint32_t(nonzero)));
        hi[j] = _mm256_and_si256(keep, _mm256_or_si256(_mm256_and_si256(hi[j], _mm256_set1_epi32(0xFFC0)), r));
      }
    }
    for (int j = 0; j < 4; j += 2) {
      // 16 values: the pairs' hi bits packed to 16-bit lanes (in order), then their raw fields
      __m256i v = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi[j], hi[j + 1]), 0xD8);
      if (field_per_lane) {
        v = _mm256_and_si256(v, hi_mask);
        if constexpr (kFlagZeroHi) zero_hi = _mm256_or_si256(zero_hi, _mm256_cmpeq_epi16(v, zero));
        v = _mm256_or_si256(v, fields[j / 2]);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * kLanes + 8 * j), v);
    }
  }
  for (int j = 0; j < 4; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(states + 8 * j), x[j]);
  if constexpr (kFlagZeroHi) *saw_zero_hi = !_mm256_testz_si256(zero_hi, zero_hi);
  const int status = decode_chunk_from(payload, e, n, table, out, states, t, wpos, rpos, pairs, false);
  return status == kOk && chunk_checksum_avx2(out, n, pairs) != e.checksum ? int(kErrChecksum) : status;
}

// Same result as decode_chunk (AVX2 steps, then the portable core for the rest and the checks).
inline int decode_chunk_avx2(const uint8_t* payload, const ChunkEntry& e, uint32_t n, const DecodeTable& table,
                             uint16_t* out, bool pairs) {
  if (table.zero_freq == 0) return decode_chunk_avx2_impl<false>(payload, e, n, table, out, pairs);  // no zero slot
  if (e.num_raw != n) return decode_chunk_avx2_impl<true>(payload, e, n, table, out, pairs);
  // The directory says the chunk has no +0.0 (a raw field per value) while other chunks have
  // some: the path without zero tests is exact unless a +0.0 slot comes up, which only a corrupted
  // or crafted chunk can produce and which that path would decode as a value with a raw field
  // (a blob can even be crafted so that this passes every check). So it flags any decoded symbol
  // with zero top bits, and a flagged or failed chunk is decoded again with the zero tests: the
  // result and status are then the portable core's (and the GPU decoder's).
  bool saw_zero_hi = false;
  const int status = decode_chunk_avx2_impl<false, true>(payload, e, n, table, out, pairs, &saw_zero_hi);
  return status == kOk && !saw_zero_hi ? status : decode_chunk_avx2_impl<true>(payload, e, n, table, out, pairs);
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

// Encoder table in the layout the SIMD encoders load from: one 8-byte entry per symbol, so that a
// lane's symbol costs one load.
struct SimdEncTables {
  // low 32 bits: start << 12 | freq; high 32 bits: float 1 / freq rounded toward zero (0 if absent)
  uint64_t entry[kNumSymbols];
  uint32_t prob_bits;  // the table's (start < 2^prob_bits <= 4096, freq <= 2048)
};

// bits[f] = the float 1 / f rounded toward zero (divide_by_freq_avx2 / _avx512), for every
// frequency f in [1, kProbScale]; bits[0] = 0. Computed once: per symbol, at every encode call, the
// division and rounding took several microseconds of a call's fixed cost.
struct ReciprocalTable {
  uint32_t bits[kProbScale + 1];
  ReciprocalTable() {
    bits[0] = 0;
    for (uint32_t f = 1; f <= kProbScale; ++f) {
      const double exact = 1.0 / double(f);
      float rcp = static_cast<float>(exact);
      if (double(rcp) > exact) rcp = std::nextafter(rcp, 0.0f);  // toward zero
      std::memcpy(&bits[f], &rcp, 4);
    }
  }
};

inline const ReciprocalTable& reciprocal_table() {
  static const ReciprocalTable table;
  return table;
}

// A symbol's SimdEncTables entry: cumulative start `start`, frequency `freq`.
inline uint64_t simd_enc_entry(uint32_t start, uint32_t freq, const ReciprocalTable& rcp) {
  return uint64_t((start << 12) | freq) | (uint64_t(rcp.bits[freq]) << 32);
}

// The SimdEncTables of EncSym syms[1025] (every entry; the host encoder fills only its tables'
// present symbols, in finish_coders).
inline void make_simd_enc_tables(const EncSym* syms, SimdEncTables& t) {
  const ReciprocalTable& rcp = reciprocal_table();
  for (int s = 0; s < kNumSymbols; ++s) t.entry[s] = simd_enc_entry(syms[s].start, syms[s].freq, rcp);
  t.prob_bits = syms[0].prob_bits;
}

// byte_compact[mask]: pshufb control moving the bytes of the lanes in mask (8 lanes) to the
// front, in lane order; the other output bytes become zero.
struct ByteCompactTable {
  alignas(16) uint8_t ctrl[256][16];
  ByteCompactTable() {
    for (int m = 0; m < 256; ++m) {
      int p = 0;
      for (int i = 0; i < 16; ++i) ctrl[m][i] = 0x80;
      for (int i = 0; i < 8; ++i)
        if ((m >> i) & 1) ctrl[m][p++] = static_cast<uint8_t>(i);
    }
  }
};

inline const ByteCompactTable& byte_compact_table() {
  static const ByteCompactTable table;
  return table;
}

// How far ahead of its loads survey_chunk_avx2 prefetches the values: the survey is the first pass
// over an encode's input, which usually comes from L3 or DRAM. On a Xeon guest (2 vCPUs, 480 MiB
// L3) the pass without it waited on its loads (half its samples on the first use of a loaded vector);
// encoding 64x7168 weight messages on one thread took 1.07-1.10 GB/s against 1.43-1.57 with it
// (A/B of builds in turn; 512 bytes ahead: 1.28-1.40, 1024: 1.38-1.51, 2048 to 8192 alike).
constexpr int kSurveyPrefetchBytes = 2048;

// Symbol histogram of values v[0, n), which are values [first, first + n) of a chunk (first even;
// the counts of
// symbol_of over every value), counted into `h`
// (`hist` [1025] receives a fold when h's tables run full): kTables (4 or 8) interleaved u32 tables
// of v >> 6 (on Zen 3, 8 tables took 2-13% more time than 4; on an Emerald Rapids Xeon 0-18%
// less, C++ A/B on real tensors: the AVX-512 level takes 8),
// zeros counted 16 at a time with a vector compare (16 +0.0 in a row: one add, not 16 increments
// of one counter, whose store-to-load chain made gradients' zero runs the slowest). The chunk's
// checksum (pairs: version 7's) comes with it: its vector work runs beside the table increments (measured: no
// slower than the counts alone). The checksum and +0.0 count returned are those of these values: a
// chunk's are the sums over the pieces it was surveyed in.
template <int kTables = 4>
__attribute__((target("avx2,popcnt"))) inline ChunkSurvey survey_chunk_avx2(const uint16_t* v, uint32_t n,
                                                                           uint32_t first, SymbolHistogram& h,
                                                                           uint64_t* hist, bool pairs) {
  uint32_t (*local)[SymbolHistogram::kTableStride] = h.local;
  const __m256i zero = _mm256_setzero_si256();
  ChecksumAvx2 checksum(first, pairs);
  uint32_t zero_bytes = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(v + i) + kSurveyPrefetchBytes, _MM_HINT_T0);
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i));
    checksum.add(x);
    const uint32_t zero_mask = uint32_t(_mm256_movemask_epi8(_mm256_cmpeq_epi16(x, zero)));
    zero_bytes += uint32_t(_mm_popcnt_u32(zero_mask));
    if (zero_mask == 0xFFFFFFFFu) {  // 16 x +0.0 (v >> 6 = 0): one add instead of 16 increments of one counter
      local[0][0] += 16;
      continue;
    }
    // the 16 symbols from the vector already loaded, moved to general registers four at a time
    // (10-16% less time for this pass than 16 scalar reloads of v: measured A/B in one process on
    // real tensors)
    const __m256i symbols = _mm256_srli_epi16(x, kRawBits);
    const __m128i lo = _mm256_castsi256_si128(symbols), hi = _mm256_extracti128_si256(symbols, 1);
    const uint64_t quads[4] = {uint64_t(_mm_cvtsi128_si64(lo)), uint64_t(_mm_extract_epi64(lo, 1)),
                               uint64_t(_mm_cvtsi128_si64(hi)), uint64_t(_mm_extract_epi64(hi, 1))};
    static_assert(kTables == 4 || kTables == 8, "4 or 8 tables");
    for (int k = 0; k < 4; ++k) {
      const uint64_t q = quads[k];
      const int base = kTables == 8 ? 4 * (k & 1) : 0;  // 8 tables: quads alternate between halves
      ++local[base][q & 0xFFFF];
      ++local[base + 1][(q >> 16) & 0xFFFF];
      ++local[base + 2][(q >> 32) & 0xFFFF];
      ++local[base + 3][q >> 48];
    }
  }
  ChunkSurvey survey;
  survey.checksum = checksum.total() + checksum_of(v + i, n - i, first + i, pairs);
  survey.zeros = zero_bytes / 2;  // two mask bits per value
  for (; i < n; ++i) {
    survey.zeros += v[i] == 0;
    ++local[0][v[i] >> kRawBits];
  }
  h.add(n, survey.zeros, hist);
  return survey;
}

// 32 raw fields held one per byte (each below 64) packed to the 6-bit stream: 24 bytes at `out`,
// which needs 28 writable bytes. Bytes (f0, f1) -> f0 + 64 f1 (vpmaddubsw), word pairs -> 24-bit
// lanes (vpmaddwd), then 3 bytes of each 32-bit lane kept.
__attribute__((target("avx2"))) inline void pack_field_bytes32(__m256i bytes, uint8_t* out) {
  const __m256i pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x4001));  // f0 + 64 f1
  const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi32(0x10000001));  // p0 + 4096 p1
  const __m256i packed = _mm256_shuffle_epi8(quads, _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,  //
                                                                     0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 12), _mm256_extracti128_si256(packed, 1));
}

// 32 values' raw fields (their low 6 bits) packed to the 6-bit stream: 24 bytes at `out`, which
// needs 28 writable bytes.
__attribute__((target("avx2"))) inline void pack_fields32(const uint16_t* v, uint8_t* out) {
  const __m256i m3f = _mm256_set1_epi16(0x3F);
  const __m256i a = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)), m3f);
  const __m256i b = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16)), m3f);
  pack_field_bytes32(_mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xD8), out);  // field k at byte k
}

// pack_fields_in_place with 32 fields a step: group k's 32 bytes are read before its 28-byte store
// at 24k, which ends at or below group k + 1's first byte (24k + 28 <= 32k + 32); the last
// partial group as pack_fields_in_place packs it (its bytes from `count` up to the next multiple of
// 8 must be zero, with 8 bytes of room past them).
__attribute__((target("avx2"))) inline void pack_fields_in_place_avx2(uint8_t* bytes, uint32_t count) {
  const uint32_t full = count / 32;
  for (uint32_t k = 0; k < full; ++k)
    pack_field_bytes32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32ull * k)), bytes + 24ull * k);
  // the rest from byte 32 full to 24 full: each 8 bytes read before 6 are written below them (the
  // last vector store ended at 24 full + 4 <= 32 full)
  const uint32_t groups = (count - 32 * full + 7) / 8;
  uint8_t* rest = bytes + 32ull * full;
  uint8_t* to = bytes + 24ull * full;
  for (uint32_t g = 0; g < groups; ++g) store_le<uint64_t>(to + 6 * g, pack6x8(load_le<uint64_t>(rest + 8 * g)));
}

// The raw fields of chunk v[0, n), which holds `zeros` values +0.0 (from its survey), written to
// `raw` (n + 16 bytes) as split_chunk does; returns their count. A chunk without +0.0 packs 32
// fields per step straight from the values; otherwise raw fields are first compacted one per
// byte (8-byte stores, the cursor advancing by the count of non-zero values), then packed to 6
// bits in a second, dependency-free loop (pack_fields_in_place_avx2).
__attribute__((target("avx2,popcnt"))) inline uint32_t split_fields_avx2(const uint16_t* v, uint32_t n, uint32_t zeros,
                                                                        uint8_t* raw) {
  uint32_t i = 0;
  if (zeros == 0) {
    for (; i + 32 <= n; i += 32) pack_fields32(v + i, raw + i / 8 * 6);
    BitWriter bits(raw + i / 8 * 6);
    for (; i < n; ++i) bits.put(raw_of(v[i]), kRawBits);
    bits.finish();
    return n;
  }
  const ByteCompactTable& bc = byte_compact_table();
  const __m128i zero = _mm_setzero_si128(), m3f = _mm_set1_epi16(0x3F);
  uint32_t nr = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i v8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i));
    const __m128i is_zero = _mm_cmpeq_epi16(v8, zero);
    const int nz = ~_mm_movemask_epi8(_mm_packs_epi16(is_zero, is_zero)) & 0xFF;
    __m128i r = _mm_packus_epi16(_mm_and_si128(v8, m3f), zero);
    r = _mm_shuffle_epi8(r, _mm_load_si128(reinterpret_cast<const __m128i*>(bc.ctrl[nz])));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(raw + nr), r);
    nr += uint32_t(_mm_popcnt_u32(uint32_t(nz)));
  }
  for (; i < n; ++i)
    if (v[i] != 0) raw[nr++] = static_cast<uint8_t>(raw_of(v[i]));
  store_le<uint64_t>(raw + nr, 0);
  pack_fields_in_place_avx2(raw, nr);
  return nr;
}

// The SSE/AVX rounding mode of the calling thread set to round toward zero for this object's
// lifetime (MXCSR bits 13-14), and the caller's MXCSR (mode and flags) restored when it ends.
// divide_by_freq_avx2 needs it: AVX2 has no per-instruction rounding, unlike AVX-512. C++ does
// not tell the compiler about the mode (no FENV_ACCESS here), so the float operations must stay
// between the two MXCSR writes: they use values loaded inside the pass, and the built code is
// checked (GCC 12 keeps them there; the native fuzz's quotient and encoder checks and the Python
// tests' equal blobs on every path would catch a move).
class RoundTowardZero {
 public:
  RoundTowardZero() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x6000u); }
  ~RoundTowardZero() { _mm_setcsr(saved_); }
  RoundTowardZero(const RoundTowardZero&) = delete;
  RoundTowardZero& operator=(const RoundTowardZero&) = delete;

 private:
  unsigned saved_;
};

// q = floor(y / freq) and r = y - q freq, 8 lanes, for y < freq 2^21 (a state after
// renormalisation), rcp2 = 2 / freq rounded toward zero (twice SimdEncTables' 1 / freq, exact),
// with MXCSR rounding toward zero (RoundTowardZero). The estimate trunc(float(y >> 1) * rcp2) is
// q or q - 1, so one correction finishes:
// - it is at most y / freq: y >> 1 <= y / 2, and the conversion, rcp2 and the product are all
//   rounded toward zero (y >> 1 < 2^31 converts as a signed integer);
// - each of the three roundings loses less than 2^-23 relative, and y >> 1 >= (y - 1) / 2, so it
//   exceeds (y - 1) / freq - 3 2^-23 y / freq > y / freq - 1 / freq - 0.75 (y / freq < 2^21):
//   above q - 1 for freq >= 4; for freq 1 and 2 nothing is rounded (2^-k reciprocals, y < 2^22)
//   and the estimate is 2 (y >> 1) / freq, q - 1 or q for freq 1 and q for freq 2; freq 3 (the
//   bound above is too loose for it) is checked on every dividend.
// tests/native/lossless_fuzz.cpp checks every dividend for frequencies 1-4 and 144 dividends of
// every other frequency up to 2,048. The two-sided version
// before it (conversion and product rounded to nearest: estimate q - 1, q or q + 1) took about
// 1.15x this pass's time (C++ A/B on real tensors, Emerald Rapids Xeon).
__attribute__((target("avx2"))) inline void divide_by_freq_avx2(__m256i y, __m256i freq, __m256 rcp2, __m256i& q,
                                                               __m256i& r) {
  const __m256 half_y = _mm256_cvtepi32_ps(_mm256_srli_epi32(y, 1));
  q = _mm256_cvttps_epi32(_mm256_mul_ps(half_y, rcp2));
  r = _mm256_sub_epi32(y, _mm256_mullo_epi32(q, freq));  // in [0, 2 freq)
  const __m256i fits = _mm256_cmpgt_epi32(freq, r);
  q = _mm256_sub_epi32(q, _mm256_andnot_si256(fits, _mm256_set1_epi32(-1)));
  r = _mm256_sub_epi32(r, _mm256_andnot_si256(fits, freq));
}

// One rANS encoding step of 8 lanes at states x, from their 8-byte table entries (SimdEncTables)
// in a (lanes 0, 1 | 4, 5) and b (lanes 2, 3 | 6, 7): renormalisation words stored below `cursor`
// (8 words written, the cursor moved down by the words kept), the new states returned. Needs MXCSR
// rounding toward zero (divide_by_freq_avx2).
__attribute__((target("avx2,popcnt"))) inline __m256i rans_put8(__m256i x, __m256i a, __m256i b,
                                                               const CompressTable& ct, uint16_t*& cursor,
                                                               __m256i prob_bits, __m256i renorm_shift) {
  const __m256 af = _mm256_castsi256_ps(a), bf = _mm256_castsi256_ps(b);
  const __m256i fs = _mm256_castps_si256(_mm256_shuffle_ps(af, bf, 0x88));  // low halves, lane order
  const __m256 rcp = _mm256_shuffle_ps(af, bf, 0xDD);                       // high halves
  const __m256i freq = _mm256_and_si256(fs, _mm256_set1_epi32(0xFFF));
  const __m256i start = _mm256_srli_epi32(fs, 12);
  // a word is written unless x < freq << (32 - prob_bits), i.e. (x >> (32 - prob_bits)) < freq
  const __m256i keep = _mm256_cmpgt_epi32(freq, _mm256_srlv_epi32(x, renorm_shift));
  const int mask = ~_mm256_movemask_ps(_mm256_castsi256_ps(keep)) & 0xFF;
  const __m256i w = _mm256_permutevar8x32_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)),
                                                _mm256_load_si256(reinterpret_cast<const __m256i*>(ct.idx[mask])));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(w, w), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(cursor - 8), _mm256_castsi256_si128(packed));
  cursor -= _mm_popcnt_u32(uint32_t(mask));
  const __m256i y = _mm256_blendv_epi8(_mm256_srli_epi32(x, 16), x, keep);
  __m256i q, r;
  divide_by_freq_avx2(y, freq, _mm256_add_ps(rcp, rcp), q, r);
  return _mm256_add_epi32(_mm256_add_epi32(_mm256_sllv_epi32(q, prob_bits), r), start);
}

// Steps the rANS pass stages the table entries of at a time, for a chunk without +0.0 (16 KiB).
constexpr uint32_t kStagedSteps = 64;

// The table entries of steps [first, last) of chunk values v, which hold no +0.0 (a symbol is
// then v >> 6), to `entries` in the order the rANS pass loads them: per step and 8-lane group,
// lanes 0 1 4 5 2 3 6 7 (rans_put8's a and b). Plain loads and stores, kept so (the asm barrier)
// rather than vectorised into gathers.
__attribute__((target("avx2"))) inline void stage_entries(const uint16_t* v, uint32_t first, uint32_t last,
                                                         const SimdEncTables& tab, uint64_t* entries) {
  const uint64_t* e = tab.entry;
  for (uint32_t t = first; t < last; ++t) {
    alignas(32) uint16_t sym[kLanes];
    const __m256i* step = reinterpret_cast<const __m256i*>(v + t * kLanes);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sym), _mm256_srli_epi16(_mm256_loadu_si256(step), kRawBits));
    _mm256_store_si256(reinterpret_cast<__m256i*>(sym + 16), _mm256_srli_epi16(_mm256_loadu_si256(step + 1), kRawBits));
    uint64_t* out = entries + uint64_t(t - first) * kLanes;
    for (int g = 0; g < 4; ++g) {
      const uint16_t* s = sym + 8 * g;
      uint64_t* o = out + 8 * g;
      o[0] = e[s[0]], o[1] = e[s[1]], o[4] = e[s[2]], o[5] = e[s[3]];
      o[2] = e[s[4]], o[3] = e[s[5]], o[6] = e[s[6]], o[7] = e[s[7]];
      asm volatile("" ::: "memory");
    }
  }
}

// The rANS pass (same output as rans_encode_chunk). words_end needs 8 words of slack below
// words_end - n (the 8-word stores may touch them). Each lane's symbol is one 8-byte table entry
// (freq, start and 1 / freq in float); divide_by_freq_avx2 gives the quotient, under MXCSR
// rounding toward zero for the pass (the caller's mode is restored before it returns).
// has_zero = false promises that the chunk holds no +0.0 (its survey counted none): the entries
// of 64 steps at a time are then staged by scalar loads and stores (stage_entries) and the steps
// load them as vectors, instead of each step moving its symbols to general registers and
// inserting the 8 entries it loads into vectors (C++ A/B on real tensors, this Xeon forced to
// the AVX2 path: the pass took 0.86-0.91x the time on activations and weights; staging chunks
// with +0.0 too, gradients' took 1.14-1.16x, since runs of +0.0 need no loads at all).
__attribute__((target("avx2,popcnt"))) inline uint32_t rans_encode_chunk_avx2(const uint16_t* v, uint32_t n,
                                                                             const EncSym* syms,
                                                                             const SimdEncTables& tab,
                                                                             uint32_t* states, uint16_t* words_end,
                                                                             bool has_zero = true) {
  alignas(32) uint32_t st[kLanes];
  uint16_t* cursor = words_end;
  const uint32_t full_steps = rans_encode_partial_step(v, n, syms, st, cursor);
  const CompressTable& ct = compress_table();
  const RoundTowardZero round_toward_zero;  // for divide_by_freq_avx2, until the pass returns
  const __m256i prob_bits = _mm256_set1_epi32(int(tab.prob_bits)), renorm_shift = _mm256_set1_epi32(32 - int(tab.prob_bits));
  __m256i x[4];
  for (int j = 0; j < 4; ++j) x[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(st + 8 * j));
  if (!has_zero) {
    alignas(32) uint64_t entries[kStagedSteps * kLanes];
    for (uint32_t last = full_steps; last > 0;) {
      const uint32_t first = last > kStagedSteps ? last - kStagedSteps : 0;
      stage_entries(v, first, last, tab, entries);
      for (uint32_t t = last; t-- > first;) {
        const __m256i* e = reinterpret_cast<const __m256i*>(entries + uint64_t(t - first) * kLanes);
        for (int j = 3; j >= 0; --j)
          x[j] = rans_put8(x[j], _mm256_load_si256(e + 2 * j), _mm256_load_si256(e + 2 * j + 1), ct, cursor, prob_bits,
                           renorm_shift);
      }
      last = first;
    }
  } else {
    const __m256i zero = _mm256_setzero_si256(), zero_sym = _mm256_set1_epi32(kZeroSymbol);
    // a step of 32 +0.0 values (gradients' zero runs) takes the zero symbol's entry without loads
    const __m256i zero_entry = _mm256_set1_epi64x(int64_t(tab.entry[kZeroSymbol]));
    for (uint32_t t = full_steps; t-- > 0;) {
      const __m256i* step = reinterpret_cast<const __m256i*>(v + t * kLanes);
      const __m256i any = _mm256_or_si256(_mm256_loadu_si256(step), _mm256_loadu_si256(step + 1));
      const bool all_zero = _mm256_testz_si256(any, any);
      for (int j = 3; j >= 0; --j) {
        __m256i a = zero_entry, b = zero_entry;  // entries of lanes {0, 1 | 4, 5} and {2, 3 | 6, 7}
        if (!all_zero) {
          const __m256i val =
              _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + t * kLanes + 8 * j)));
          const __m256i sym = _mm256_or_si256(_mm256_srli_epi32(val, kRawBits),
                                              _mm256_and_si256(_mm256_cmpeq_epi32(val, zero), zero_sym));
          // per-lane table loads: faster than gathers here (measured on Zen 3 with the earlier
          // layout of two tables: the pass took 15-30% less time than with vpgatherdd /
          // vgatherdpd) (symbols moved to general registers two at a time, as lookup_entries
          // does: about 3% less time than a store and eight reloads, measured A/B in one process
          // on real tensors)
          const __m128i slo = _mm256_castsi256_si128(sym), shi = _mm256_extracti128_si256(sym, 1);
          const uint64_t k01 = uint64_t(_mm_cvtsi128_si64(slo)), k23 = uint64_t(_mm_extract_epi64(slo, 1));
          const uint64_t k45 = uint64_t(_mm_cvtsi128_si64(shi)), k67 = uint64_t(_mm_extract_epi64(shi, 1));
          const uint64_t* e = tab.entry;
          a = _mm256_inserti128_si256(
              _mm256_castsi128_si256(_mm_set_epi64x(int64_t(e[k01 >> 32]), int64_t(e[uint32_t(k01)]))),
              _mm_set_epi64x(int64_t(e[k45 >> 32]), int64_t(e[uint32_t(k45)])), 1);
          b = _mm256_inserti128_si256(
              _mm256_castsi128_si256(_mm_set_epi64x(int64_t(e[k23 >> 32]), int64_t(e[uint32_t(k23)]))),
              _mm_set_epi64x(int64_t(e[k67 >> 32]), int64_t(e[uint32_t(k67)])), 1);
        }
        x[j] = rans_put8(x[j], a, b, ct, cursor, prob_bits, renorm_shift);
      }
    }
  }
  for (int j = 0; j < 4; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(states + 8 * j), x[j]);
  return static_cast<uint32_t>(words_end - cursor);
}

}  // namespace ep_comm::lossless
#endif
