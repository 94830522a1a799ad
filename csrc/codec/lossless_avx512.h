// AVX-512 decoder and rANS encoding pass of the lossless codec's chunks (host only; x86-64 with
// AVX-512 F, BW, VL, VBMI and VBMI2): the same results as decode_chunk and rans_encode_chunk in
// lossless_core.h, 16 lanes per instruction; the decoder and the encoder take two chunks in lockstep.
//
// Why two chunks at once: a step's states depend on the previous step's through a table gather
// and a 32-bit multiply (measured on an Emerald Rapids Xeon: a dependent 16-lane gather about 26
// cycles, vpmulld 10), so one chunk leaves the core idle much of the time; a second, independent
// chunk fills it (C++ loop over real blobs: 0.74-0.81x the time of one chunk at a time; three or
// four chunks gained nothing more).
// What AVX-512 adds over the AVX2 decoder: a 16-lane gather for the table lookups, masked expands
// for the renormalisation words and for the raw fields of lanes that decode +0.0, and the 6-bit
// fields unpacked by one byte permute and one multishift. The chunk checksum is accumulated while
// decoding (two adds per 16 values, no multiplies; see ChecksumSums512).
// As the AVX2 decoder, it runs SIMD steps while a step provably stays inside the word and raw
// streams; the remaining steps and all end-of-chunk checks run in the portable core.
#pragma once
#if defined(__x86_64__) && !defined(__CUDACC__)
#include <immintrin.h>

#include <array>
#include <new>
#include <utility>

#include "codec/lossless_avx2.h"  // StreamTail
#include "codec/lossless_core.h"
#include "codec/lossless_scalar.h"  // SymbolHistogram

#define EP_COMM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,popcnt,bmi2")))

// GCC 12's AVX-512 intrinsics start unmasked results from _mm512_undefined_epi32(), which
// -Wmaybe-uninitialized reports at every use (GCC bug 105593): silenced for this header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace ep_comm::lossless {

// The CPU and OS support every AVX-512 subset (and BMI2) the codec uses (libgcc checks the OS's zmm state).
inline bool have_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi") &&
                         __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("popcnt") &&
                         __builtin_cpu_supports("bmi2");
  return ok;
}

// pair_mix of each 32-bit lane (version 7's checksum).
EP_COMM_AVX512 __attribute__((always_inline)) inline __m512i pair_mix_avx512(__m512i u) {
  const __m512i m = _mm512_mullo_epi32(u, _mm512_set1_epi32(static_cast<int>(kPairMix)));
  return _mm512_xor_si512(m, _mm512_srli_epi32(m, 16));
}

// Chunk checksum (checksum_of) 32 values a step without multiplies in the weighted sum: per lane,
// P = the sum of its terms so far and Q = the sum over steps of P; after T steps, sum_s s t_s = T
// P - Q. Versions 2-6 (value 32 s + l in lane l of step s): the checksum is sum_l 64 (T P_l - Q_l)
// + (2 l + 1) P_l; version 7 (`pairs`: pair 16 s + l in lane l, its term pair_mix of it): sum_l 32
// (T P_l - Q_l) + (2 l + 1) P_l (all mod 2^32). ChecksumAvx2 does the same 16 values at a time; the
// decoder keeps this one-vector-per-step form (with ChecksumAvx2 it took 2-9% more time, C++ A/B,
// within that harness's noise of about 5%).
struct ChecksumSums512 {
  __m512i p0, p1, q0, q1;  // lanes 0-15 and 16-31 (pairs: p0 and q0, lanes 0-15)
  bool pairs;
  EP_COMM_AVX512 explicit ChecksumSums512(bool pair_checksum = false)
      : p0(_mm512_setzero_si512()), p1(_mm512_setzero_si512()), q0(_mm512_setzero_si512()),
        q1(_mm512_setzero_si512()), pairs(pair_checksum) {}
  // One step's 32 values.
  EP_COMM_AVX512 __attribute__((always_inline)) void add(__m512i v) {
    if (pairs) {
      p0 = _mm512_add_epi32(p0, pair_mix_avx512(v));
      q0 = _mm512_add_epi32(q0, p0);
      return;
    }
    p0 = _mm512_add_epi32(p0, _mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)));
    p1 = _mm512_add_epi32(p1, _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)));
    q0 = _mm512_add_epi32(q0, p0);
    q1 = _mm512_add_epi32(q1, p1);
  }
  // A step of 32 zeros.
  EP_COMM_AVX512 __attribute__((always_inline)) void add_zeros() {
    q0 = _mm512_add_epi32(q0, p0);
    q1 = _mm512_add_epi32(q1, p1);
  }
  // The checksum of the first 32 `steps` values (steps = the number of add / add_zeros calls).
  EP_COMM_AVX512 uint32_t total(uint32_t steps) const {
    const __m512i t = _mm512_set1_epi32(int(steps));
    const __m512i odd0 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i odd1 = _mm512_add_epi32(odd0, _mm512_set1_epi32(32));
    const int shift = pairs ? 5 : 6;  // log2 of a step's weight increase: 2 x 16 pairs, 2 x 32 values
    const __m512i s0 = _mm512_add_epi32(_mm512_sll_epi32(_mm512_sub_epi32(_mm512_mullo_epi32(t, p0), q0),
                                                         _mm_cvtsi32_si128(shift)),
                                        _mm512_mullo_epi32(odd0, p0));
    const __m512i s1 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_mullo_epi32(t, p1), q1), 6),
                                        _mm512_mullo_epi32(odd1, p1));
    // summed as unsigned (GCC's _mm512_reduce_add_epi32 adds as signed int, which may overflow);
    // pairs: p1 and q1 stay 0
    alignas(64) uint32_t lanes[16];
    _mm512_store_si512(lanes, _mm512_add_epi32(s0, s1));
    uint32_t sum = 0;
    for (const uint32_t lane : lanes) sum += lane;
    return sum;
  }
};

// One piece's counts out of `h` (SymbolHistogram::fold_into's, cleared as it clears them): to
// kept[1025] and added to hist[1025]. The encoder's version 5 pass 1 folds once per piece of a
// chunk, not once per thread: 16 symbols a step instead of the compiler's narrower loop.
EP_COMM_AVX512 inline void fold_piece_avx512(SymbolHistogram& h, uint32_t* kept, uint64_t* hist) {
  const __m512i zero = _mm512_setzero_si512();
  for (int j = 0; j < 1024; j += 16) {
    __m512i sum = zero;
    for (int k = 0; k < SymbolHistogram::kMaxTables; ++k) {
      sum = _mm512_add_epi32(sum, _mm512_load_si512(h.local[k] + j));
      _mm512_store_si512(h.local[k] + j, zero);
    }
    _mm512_storeu_si512(kept + j, sum);
    const __m512i lo = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(sum));
    const __m512i hi = _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(sum, 1));
    _mm512_storeu_si512(hist + j, _mm512_add_epi64(_mm512_loadu_si512(hist + j), lo));
    _mm512_storeu_si512(hist + j + 8, _mm512_add_epi64(_mm512_loadu_si512(hist + j + 8), hi));
  }
  // +0.0 values were counted as symbol 0 (their top bits)
  kept[0] -= static_cast<uint32_t>(h.zeros);
  kept[kZeroSymbol] = static_cast<uint32_t>(h.zeros);
  hist[0] -= h.zeros;
  hist[kZeroSymbol] += h.zeros;
  h.zeros = h.pending = 0;
}

// build_decode_table's result, by vectors: the present symbols found 16 frequencies at a time,
// each one's entries (its value bits and frequency, biases 0 to freq - 1) written 16 at a time.
// A sparse table (a version 5 chunk of few values) costs its present symbols, not 1,025 branches.
EP_COMM_AVX512 inline void build_decode_table_avx512(const uint32_t* freq, const uint32_t* start, DecodeTable& t,
                                                     int prob_bits) {
  t.prob_bits = uint32_t(prob_bits);
  t.slot_mask = (1u << prob_bits) - 1;
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i sixteen = _mm512_set1_epi32(16);
  for (int base = 0; base < kNumSymbols; base += 16) {
    const __mmask16 valid = kNumSymbols - base >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (kNumSymbols - base)) - 1);
    const __m512i f = _mm512_maskz_loadu_epi32(valid, freq + base);
    for (uint32_t present = _mm512_test_epi32_mask(f, f); present != 0; present &= present - 1) {
      const int s = base + __builtin_ctz(present);
      const uint32_t fs = freq[s], hi10 = s == kZeroSymbol ? 0u : uint32_t(s);
      uint32_t* dst = t.entry + start[s];
      __m512i e = _mm512_add_epi32(_mm512_set1_epi32(int(dec_entry(hi10, fs, 0))), iota);  // bias k in lane k
      for (uint32_t k = 0; k < fs; k += 16, e = _mm512_add_epi32(e, sixteen))
        _mm512_mask_storeu_epi32(dst + k, fs - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (fs - k)) - 1), e);
    }
  }
  t.zero_start = start[kZeroSymbol];
  t.zero_freq = freq[kZeroSymbol];
}

// 32 consecutive 6-bit fields starting `shift` bits (0, 2, 4 or 6) into byte p (32 bytes
// readable) -> 32 words, field k in the low 6 bits of word k (the high bits are garbage; callers
// mask them). Qword q (words 4q..4q+3) takes bytes p + 3q .. p + 3q + 7, and each word's low
// byte takes the 8 bits at offset shift + 6k of its qword.
EP_COMM_AVX512 inline __m512i fields_as_words(const uint8_t* p, uint32_t shift) {
  const __m512i spread = _mm512_set_epi8(
      28, 27, 26, 25, 24, 23, 22, 21, 25, 24, 23, 22, 21, 20, 19, 18, 22, 21, 20, 19, 18, 17, 16, 15,
      19, 18, 17, 16, 15, 14, 13, 12, 16, 15, 14, 13, 12, 11, 10, 9, 13, 12, 11, 10, 9, 8, 7, 6,
      10, 9, 8, 7, 6, 5, 4, 3, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i src = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i qwords = _mm512_permutexvar_epi8(spread, src);
  const __m512i offsets = _mm512_add_epi8(_mm512_set1_epi64(0x0012000C00060000ll), _mm512_set1_epi16(int16_t(shift)));
  return _mm512_multishift_epi64_epi8(offsets, qwords);
}

// The decoding step's constant vectors, made once per call and hidden from the compiler's
// constant folding: under the step's register pressure it otherwise rebuilt each one at every step
// (a move, a transfer and a broadcast), where a spilled invariant is one folded load.
struct DecodeConsts {
  __m512i low11, one, low, ffc0, iota;
  EP_COMM_AVX512 DecodeConsts()
      : low11(_mm512_set1_epi32(int(kProbScale - 1))), one(_mm512_set1_epi32(1)), low(_mm512_set1_epi32(int(kStateLow))),
        ffc0(_mm512_set1_epi16(int16_t(0xFFC0))), iota(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)) {
    asm("" : "+v"(low11), "+v"(one), "+v"(low), "+v"(ffc0), "+v"(iota));
  }
};

// One chunk's decoding position: 32 states in two vectors, the stream positions, the steps done.
// step() decodes the next 32 values; the caller checks can_step() first. kProbBitsT: the table's
// prob_bits (11 or 12), a constant so that the slot mask and the shift are immediates, as they
// were when every table had 11 bits.
template <bool kHasZero, int kProbBitsT>
struct ChunkCursor512 {
  const uint8_t* payload;
  const ChunkEntry* entry;
  uint32_t n;
  uint16_t* out;
  const uint8_t* words;
  const uint8_t* raw;
  uint64_t nword_bytes, nraw_bytes;
  StreamTail word_tail, raw_tail;
  // What a step reads and changes, kept apart so that the decoding loop holds it in local
  // variables (registers): held in the cursor, the states were reloaded from memory after every
  // output store (a vector store may alias any object), lengthening each step's dependency chain.
  struct State {
    __m512i x[2];
    ChecksumSums512 sums;
    uint32_t wpos = 0, rpos = 0, t = 0;
    bool try_zero_step = kHasZero;  // kHasZero: the previous step decoded 32 +0.0 (or this is the first)
  };
  State s;
  uint32_t full_steps;
  bool bad_states = false;

  EP_COMM_AVX512 ChunkCursor512(const uint8_t* p, const ChunkEntry& e, uint32_t count, uint16_t* o, bool pairs)
      : payload(p), entry(&e), n(count), out(o), words(p + kStateBytes), raw(words + 2ull * e.num_words),
        nword_bytes(2ull * e.num_words), nraw_bytes(raw_bytes(e.num_raw)), word_tail(words, nword_bytes),
        raw_tail(raw, nraw_bytes), full_steps(count / kLanes) {
    s.sums = ChecksumSums512(pairs);
    alignas(64) uint32_t states[kLanes];
    bad_states = !load_states(payload, states);
    if (bad_states) full_steps = 0;
    s.x[0] = _mm512_load_si512(states);
    s.x[1] = _mm512_load_si512(states + 16);
  }

  // A step reads word bytes [2 wpos, 2 wpos + 64) (one 64-byte load for both vectors of 16 lanes)
  // and raw bytes [6 rpos / 8, 6 rpos / 8 + 32). Out of place, wpos <= num_words and rpos <=
  // num_raw keep both within the tails' 128 bytes.
  bool can_step(const State& st) const {
    return st.t < full_steps && st.wpos <= entry->num_words && st.rpos <= entry->num_raw;
  }

  // The step at the states, if it decodes 32 +0.0 (every slot above last_nonzero_slot) without
  // renormalising a state: then advances the states and returns true (no table or stream reads).
  EP_COMM_AVX512 __attribute__((always_inline)) bool zero_step(State& st, const DecodeTable& table, __m512i last_nonzero_slot) {
    const __m512i slot_mask = _mm512_set1_epi32(int((1u << kProbBitsT) - 1));
    const __m512i s0 = _mm512_and_si512(st.x[0], slot_mask), s1 = _mm512_and_si512(st.x[1], slot_mask);
    if ((_mm512_cmpgt_epi32_mask(s0, last_nonzero_slot) & _mm512_cmpgt_epi32_mask(s1, last_nonzero_slot)) != 0xFFFF)
      return false;
    const __m512i start = _mm512_set1_epi32(int(table.zero_start)), freq = _mm512_set1_epi32(int(table.zero_freq));
    const __m512i y0 = _mm512_add_epi32(_mm512_mullo_epi32(freq, _mm512_srli_epi32(st.x[0], kProbBitsT)), _mm512_sub_epi32(s0, start));
    const __m512i y1 = _mm512_add_epi32(_mm512_mullo_epi32(freq, _mm512_srli_epi32(st.x[1], kProbBitsT)), _mm512_sub_epi32(s1, start));
    const __m512i low = _mm512_set1_epi32(int(kStateLow));
    if ((_mm512_cmplt_epu32_mask(y0, low) | _mm512_cmplt_epu32_mask(y1, low)) != 0) return false;
    st.x[0] = y0;
    st.x[1] = y1;
    return true;
  }

  EP_COMM_AVX512 __attribute__((always_inline)) void step(State& st, const DecodeTable& table, __m512i last_nonzero_slot,
                                                         const DecodeConsts& k) {
    if constexpr (kHasZero) {
      if (st.try_zero_step && zero_step(st, table, last_nonzero_slot)) {
        _mm512_storeu_si512(out + uint64_t(st.t) * kLanes, _mm512_setzero_si512());
        st.sums.add_zeros();
        ++st.t;
        return;
      }
    }
    const __m512i low11 = k.low11;
    const __m512i slot_mask = _mm512_set1_epi32(int((1u << kProbBitsT) - 1));
    const __m512i low = k.low;
    const bool words_in_place = 2ull * st.wpos + 64 <= nword_bytes;
    const bool raw_in_place = uint64_t(st.rpos) * kRawBits / 8 + 32 <= nraw_bytes;
    // stream byte b is at src + (b - skip)
    const uint8_t* word_src = words_in_place ? words : word_tail.bytes;
    const uint64_t word_skip = words_in_place ? 0 : word_tail.first;
    const uint8_t* raw_src = raw_in_place ? raw : raw_tail.bytes;
    const uint64_t raw_skip = raw_in_place ? 0 : raw_tail.first;
    __m512i ent[2], y[2];
    __mmask16 need[2];
    uint32_t zero_lanes = 0;  // kHasZero: bit l set when lane l decodes +0.0
    for (int j = 0; j < 2; ++j) {
      const __m512i slot = _mm512_and_si512(st.x[j], slot_mask);
      ent[j] = _mm512_i32gather_epi32(slot, table.entry, 4);
      const __m512i freq = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(ent[j], kProbBits), low11),
                                            k.one);
      y[j] = _mm512_add_epi32(_mm512_mullo_epi32(freq, _mm512_srli_epi32(st.x[j], kProbBitsT)),
                              _mm512_and_si512(ent[j], low11));
      need[j] = _mm512_cmplt_epu32_mask(y[j], low);
      if constexpr (kHasZero) zero_lanes |= uint32_t(_mm512_cmpgt_epi32_mask(slot, last_nonzero_slot)) << (16 * j);
    }
    // The renormalising lanes take the next words in lane order (lanes 0-15 of x[0], then x[1]),
    // both vectors' from one load at wpos: the second vector's words, from word popcount(need[0])
    // on, are picked by a register permute. With a second load at wpos + popcount(need[0]) (an
    // address known only once x[0] is updated), x[1]'s update, and the next step's gather on it,
    // waited for a load's latency more; one-thread decoding of weights ran 8% slower.
    const __m512i next_words = _mm512_loadu_si512(word_src + (2ull * st.wpos - word_skip));
    const __m512i words_lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(next_words));
    const __m512i words_hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(next_words, 1));
    const uint32_t taken0 = uint32_t(_mm_popcnt_u32(need[0]));
    const __m512i from = _mm512_add_epi32(k.iota, _mm512_set1_epi32(int(taken0)));
    const __m512i words1 = _mm512_permutex2var_epi32(words_lo, from, words_hi);
    st.x[0] = _mm512_mask_or_epi32(y[0], need[0], _mm512_slli_epi32(y[0], 16), _mm512_maskz_expand_epi32(need[0], words_lo));
    st.x[1] = _mm512_mask_or_epi32(y[1], need[1], _mm512_slli_epi32(y[1], 16), _mm512_maskz_expand_epi32(need[1], words1));
    st.wpos += taken0 + uint32_t(_mm_popcnt_u32(need[1]));
    const uint64_t bit = uint64_t(st.rpos) * kRawBits;
    __m512i fields = fields_as_words(raw_src + ((bit >> 3) - raw_skip), uint32_t(bit & 7));
    if constexpr (kHasZero) {
      st.try_zero_step = zero_lanes == 0xFFFFFFFFu;  // zero runs are long: try the next step as one
      // +0.0 lanes take no field: the others take the next ones in order, +0.0 lanes get 0 (their
      // table entries' top bits are 0 too)
      if (zero_lanes != 0) fields = _mm512_maskz_expand_epi16(~zero_lanes, fields);
      st.rpos += kLanes - uint32_t(_mm_popcnt_u32(zero_lanes));
    } else {
      st.rpos += kLanes;
    }
    // word l = the top 16 bits of lane l's entry (its top 10 value bits at bits 6-15), low 6 bits
    // from the field
    const __m512i top_halves = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                                31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512i hi = _mm512_permutex2var_epi16(ent[0], top_halves, ent[1]);
    const __m512i v = _mm512_ternarylogic_epi32(hi, fields, k.ffc0, 0xE4);  // bit select
    _mm512_storeu_si512(out + uint64_t(st.t) * kLanes, v);
    st.sums.add(v);
    ++st.t;
  }

  // The remaining steps in the portable core, its end-of-chunk checks, then the checksum.
  EP_COMM_AVX512 int finish(const DecodeTable& table) {
    if (bad_states) return kErrStream;
    alignas(64) uint32_t states[kLanes];
    _mm512_store_si512(states, s.x[0]);
    _mm512_store_si512(states + 16, s.x[1]);
    const bool pairs = s.sums.pairs;
    const int status = decode_chunk_from(payload, *entry, n, table, out, states, s.t, s.wpos, s.rpos, pairs, false);
    if (status != kOk) return status;
    const uint32_t done = s.t * kLanes < n ? s.t * kLanes : n;
    const uint32_t checksum = s.sums.total(s.t) + checksum_of(out + done, n - done, done, pairs);
    return checksum == entry->checksum ? int(kOk) : int(kErrChecksum);
  }
};

// Decodes `count` (1 or 2) rANS chunks in lockstep: chunk k's payload[k] (payload_bytes(*e[k],
// n[k]) bytes, bounds-checked by the caller) into out[k] with table[k]; status[k] = its Status.
// Chunk 0's table is of kind (kHasZero0, kProbBits0), chunk 1's of kind (kHasZero1, kProbBits1):
// each cursor is compiled for its own table, so two chunks of different tables (version 5) still
// run in lockstep.
template <bool kHasZero0, int kProbBits0, bool kHasZero1, int kProbBits1>
EP_COMM_AVX512 inline void decode_chunks_avx512_impl(int count, const uint8_t* const* payload,
                                                     const ChunkEntry* const* e, const uint32_t* n,
                                                     const DecodeTable* const* table, uint16_t* const* out,
                                                     int* status, bool pairs) {
  using Cursor0 = ChunkCursor512<kHasZero0, kProbBits0>;
  using Cursor1 = ChunkCursor512<kHasZero1, kProbBits1>;
  const DecodeConsts k;
  const __m512i last_nonzero_slot0 = _mm512_set1_epi32(int(table[0]->zero_start) - 1);
  Cursor0 c0(payload[0], *e[0], n[0], out[0], pairs);
  typename Cursor0::State s0 = c0.s;  // in registers while decoding (see State)
  if (count == 2) {
    const __m512i last_nonzero_slot1 = _mm512_set1_epi32(int(table[1]->zero_start) - 1);
    Cursor1 c1(payload[1], *e[1], n[1], out[1], pairs);
    typename Cursor1::State s1 = c1.s;
    while (c0.can_step(s0) && c1.can_step(s1)) {
      c0.step(s0, *table[0], last_nonzero_slot0, k);
      c1.step(s1, *table[1], last_nonzero_slot1, k);
    }
    while (c1.can_step(s1)) c1.step(s1, *table[1], last_nonzero_slot1, k);
    c1.s = s1;
    status[1] = c1.finish(*table[1]);
  }
  while (c0.can_step(s0)) c0.step(s0, *table[0], last_nonzero_slot0, k);
  c0.s = s0;
  status[0] = c0.finish(*table[0]);
}

// A table's kind for the decoder's templates: bit 0 set for 12 probability bits (else 11), bit 1
// when the table has a +0.0 range.
inline int decode_table_kind(const DecodeTable& t) {
  return int(t.prob_bits == uint32_t(kMaxProbBits)) | int(t.zero_freq != 0) << 1;
}

using DecodeChunksFn = void (*)(int, const uint8_t* const*, const ChunkEntry* const*, const uint32_t*,
                                const DecodeTable* const*, uint16_t* const*, int*, bool);

// decode_chunks_avx512_impl for chunk 0's table of kind K0 and chunk 1's of kind K1.
template <int K0, int K1>
EP_COMM_AVX512 void decode_chunks_of_kinds(int count, const uint8_t* const* payload, const ChunkEntry* const* e,
                                           const uint32_t* n, const DecodeTable* const* table, uint16_t* const* out,
                                           int* status, bool pairs) {
  decode_chunks_avx512_impl<(K0 & 2) != 0, (K0 & 1) ? kMaxProbBits : kProbBits, (K1 & 2) != 0,
                            (K1 & 1) ? kMaxProbBits : kProbBits>(count, payload, e, n, table, out, status, pairs);
}

template <int... I>
constexpr std::array<DecodeChunksFn, sizeof...(I)> decoders_of_kinds(std::integer_sequence<int, I...>) {
  return {&decode_chunks_of_kinds<I / 4, I % 4>...};
}

// Same results as decode_chunk on each of `count` (1 or 2) chunks of one blob (its checksum:
// `pairs`), chunk k with table[k], decoded together whatever their tables. +0.0 lanes are told apart by slot (one compare per 16 lanes)
// whenever the table has a +0.0 range, so a crafted chunk whose directory denies +0.0 still
// decodes as the portable core does.
inline void decode_chunks_avx512(int count, const uint8_t* const* payload, const ChunkEntry* const* e,
                                 const uint32_t* n, const DecodeTable* const* table, uint16_t* const* out,
                                 int* status, bool pairs) {
  static constexpr std::array<DecodeChunksFn, 16> kDecoders = decoders_of_kinds(std::make_integer_sequence<int, 16>());
  const int k0 = decode_table_kind(*table[0]);
  const int k1 = count == 2 ? decode_table_kind(*table[1]) : k0;
  kDecoders[size_t(4 * k0 + k1)](count, payload, e, n, table, out, status, pairs);
}

// Field counts by pairs (field_values_avx512): the fields of 4 words f << 6 gathered by one pext
// into two pair indices f0 + 64 f1, each counted in one of two 4096-entry u16 tables (so that a
// repeated pair does not chain its increments through one counter): half the increments of
// counting fields one by one, and no shift or mask per field. Folded into counts[64] every
// kBlockFields fields (a pair's fields f0 and f1 each counted once), so that no u16 sum overflows
// or reads negative in a multiply-add.
struct FieldPairCounts {
  static constexpr uint32_t kBlockFields = 1u << 15;  // at most 2^14 pairs: every sum < 2^15
  alignas(64) uint16_t t[2][1 << (2 * kRawBits)];
  EP_COMM_AVX512 FieldPairCounts() { std::memset(t, 0, sizeof(t)); }
  // The 2 pairs of words w[0, 4).
  EP_COMM_AVX512 __attribute__((always_inline)) void add(const uint16_t* w) {
    uint64_t x;
    std::memcpy(&x, w, 8);
    const uint64_t f = _pext_u64(x, 0x0FC00FC00FC00FC0ull);  // f0 | f1 << 6 | f2 << 12 | f3 << 18
    ++t[0][f & 0xFFF];
    ++t[1][f >> 12];
  }
  // Adds the pairs' fields to counts[64] and clears the tables.
  EP_COMM_AVX512 void fold(uint64_t* counts) {
    const __m512i zero = _mm512_setzero_si512(), ones = _mm512_set1_epi16(1);
    __m512i col0 = zero, col1 = zero;  // by f0: fields 0-31 and 32-63
    for (int f1 = 0; f1 < 1 << kRawBits; ++f1) {
      __m512i* r0 = reinterpret_cast<__m512i*>(t[0] + (f1 << kRawBits));
      __m512i* r1 = reinterpret_cast<__m512i*>(t[1] + (f1 << kRawBits));
      const __m512i a = _mm512_add_epi16(_mm512_load_si512(r0), _mm512_load_si512(r1));
      const __m512i b = _mm512_add_epi16(_mm512_load_si512(r0 + 1), _mm512_load_si512(r1 + 1));
      col0 = _mm512_add_epi16(col0, a);
      col1 = _mm512_add_epi16(col1, b);
      counts[f1] += uint32_t(_mm512_reduce_add_epi32(_mm512_madd_epi16(_mm512_add_epi16(a, b), ones)));
      _mm512_store_si512(r0, zero);
      _mm512_store_si512(r0 + 1, zero);
      _mm512_store_si512(r1, zero);
      _mm512_store_si512(r1 + 1, zero);
    }
    alignas(64) uint16_t col[1 << kRawBits];
    _mm512_store_si512(col, col0);
    _mm512_store_si512(col + 32, col1);
    for (int f0 = 0; f0 < 1 << kRawBits; ++f0) counts[f0] += col[f0];
  }
};

// Format version 6's field stream of chunk values v[0, n) (lossless_fields.h): w[k] = (v & 63) << 6
// for the values other than +0.0, in order (32 values a step: a mask of the non-zero ones, a
// compress in registers and a full 64-byte store: a compressing store to memory is microcoded and
// several times slower), their counts by field in counts[64] (added), their checksum (checksum_of
// w[0, k), pairs: version 7's; ChecksumSums512); returns their number k. w needs room for n + 32
// values.
EP_COMM_AVX512 inline uint32_t field_values_avx512(const uint16_t* v, uint32_t n, uint16_t* w, uint64_t* counts,
                                                  uint32_t& checksum, bool pairs) {
  const __m512i low = _mm512_set1_epi16(int16_t(kRawMask));
  uint32_t k = 0;
  for (uint32_t i = 0; i < n; i += 32) {
    const __mmask32 in = n - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (n - i)) - 1;
    const __m512i x = _mm512_maskz_loadu_epi16(in, v + i);
    const __mmask32 nonzero = _mm512_test_epi16_mask(x, x);
    _mm512_storeu_si512(w + k, _mm512_maskz_compress_epi16(nonzero, _mm512_slli_epi16(_mm512_and_si512(x, low), kRawBits)));
    k += uint32_t(__builtin_popcount(nonzero));
  }
  // counts and checksum, 32 fields a step; counts by pairs where there are enough fields to pay
  // for the pair tables' clearing and folding, else one by one (the last step's fields too)
  ChecksumSums512 sums(pairs);
  uint32_t j = 0, steps = 0;
  if (k >= 4096) {
    FieldPairCounts pair_counts;
    for (; j + 32 <= k; j += 32, ++steps) {
      sums.add(_mm512_loadu_si512(w + j));
      for (uint32_t q = 0; q < 32; q += 4) pair_counts.add(w + j + q);
      if ((j + 32) % FieldPairCounts::kBlockFields == 0) pair_counts.fold(counts);
    }
    pair_counts.fold(counts);
  }
  uint32_t c4[4][1 << kRawBits] = {};
  for (uint32_t s = j; s < k; ++s) ++c4[s % 4][w[s] >> kRawBits];
  for (int f = 0; f < 1 << kRawBits; ++f) counts[f] += uint64_t(c4[0][f]) + c4[1][f] + c4[2][f] + c4[3][f];
  for (; j < k; j += 32, ++steps) {
    const __mmask32 in = k - j >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - j)) - 1;
    sums.add(_mm512_maskz_loadu_epi16(in, w + j));
  }
  checksum = sums.total(steps);
  return k;
}

// decode_chunks_avx512 of one chunk (decode_chunk's result).
inline int decode_chunk_avx512(const uint8_t* payload, const ChunkEntry& e, uint32_t n, const DecodeTable& table,
                               uint16_t* out, bool pairs) {
  const ChunkEntry* entries[1] = {&e};
  const DecodeTable* tables[1] = {&table};
  int status = kOk;
  decode_chunks_avx512(1, &payload, entries, &n, tables, &out, &status, pairs);
  return status;
}

// q = floor(y / freq) and r = y - q freq, 16 lanes, for y < freq 2^21 (a state after
// renormalisation) and rcp = 1 / freq rounded toward zero (SimdEncTables). float(y), rcp and their
// product are each rounded toward zero (embedded rounding), so the estimate trunc(float(y) * rcp)
// is at most y / freq and above y / freq (1 - 2^-23)^3 > y / freq - 0.75: q - 1 or q, and one
// masked correction finishes (the AVX2 version, rounding to nearest, needs one either way).
EP_COMM_AVX512 inline void divide_by_freq_avx512(__m512i y, __m512i freq, __m512 rcp, __m512i& q, __m512i& r) {
  constexpr int kTowardZero = _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC;
  const __m512 fy = _mm512_cvt_roundepu32_ps(y, kTowardZero);
  q = _mm512_cvtt_roundps_epu32(_mm512_mul_round_ps(fy, rcp, kTowardZero), _MM_FROUND_NO_EXC);
  r = _mm512_sub_epi32(y, _mm512_mullo_epi32(q, freq));  // in [0, 2 freq)
  const __mmask16 under = _mm512_cmpge_epu32_mask(r, freq);
  q = _mm512_mask_add_epi32(q, under, q, _mm512_set1_epi32(1));
  r = _mm512_mask_sub_epi32(r, under, r, freq);
}

// The rANS pass of one chunk (same output as rans_encode_chunk and rans_encode_chunk_avx2), a step
// at a time, so that rans_encode_chunks_avx512 can interleave two chunks. A step's 32 lanes are
// two vectors of 16 states. Their symbols come from one 16-bit shift of the step's 32 values, each
// lane's 8-byte table entry from a gather (four per step); the words of the lanes that
// renormalise are taken from both vectors by one word permute, compressed (vpcompressw over 32
// lanes) and stored with a mask ending at the cursor; divide_by_freq_avx512 gives the quotients.
// words_end needs no slack below words_end - n.
// (C++ loop over real tensors on an Emerald Rapids Xeon, alternating order, medians of 40: 0.71-0.78x
// the time of the previous version, which did each vector of 16 lanes alone, with its own compress
// and a two-sided quotient correction, on activations and weights; 0.89x on gradients. That version
// took 0.52-0.79x the time of the AVX2 pass.)
class RansEncoder512 {
 public:
  // Codes the partial top step of v[0, n) (coding runs backwards) with the portable core. With
  // `raw` (a chunk without +0.0: every value has a raw field), the steps also write their values'
  // raw fields there, packed as split_chunk does, and the partial top step's go there now.
  // `tab`: the SIMD form of `syms` (its entries are read by step, its prob_bits here).
  EP_COMM_AVX512 RansEncoder512(const uint16_t* v, uint32_t n, const EncSym* syms, const SimdEncTables& tab,
                                uint16_t* words_end, uint8_t* raw)
      : v_(v), words_end_(words_end), raw_(raw), prob_bits_(_mm512_set1_epi32(int(tab.prob_bits))),
        renorm_shift_(_mm512_set1_epi32(32 - int(tab.prob_bits))) {
    alignas(64) uint32_t st[kLanes];
    s.cursor = words_end;
    s.steps_left = rans_encode_partial_step(v, n, syms, st, s.cursor);
    if (raw_ != nullptr) {  // the top step's fields start at a byte: 32 fields are 24 bytes
      BitWriter bits(raw_ + uint64_t(s.steps_left) * kStepFieldBytes);
      for (uint32_t i = s.steps_left * kLanes; i < n; ++i) bits.put(raw_of(v[i]), kRawBits);
      bits.finish();
    }
    s.x[0] = _mm512_load_si512(st);
    s.x[1] = _mm512_load_si512(st + 16);
  }

  // What a step changes, kept apart so that the coding loop holds it in local variables
  // (registers): held in the encoder, the states went through memory at every step (the word
  // store may alias any object), lengthening each step's dependency chain by a store and a load.
  struct State {
    __m512i x[2];
    uint16_t* cursor;  // the words coded so far start here (they end at words_end)
    uint32_t steps_left;
  };
  State s;

  // Codes the highest step not yet coded. entries: SimdEncTables::entry; zero_entry: its
  // kZeroSymbol entry in every 64-bit lane.
  EP_COMM_AVX512 inline __attribute__((always_inline)) void step(State& st, const long long* entries, __m512i zero_entry) const {
    const __m512i low12 = _mm512_set1_epi32(0xFFF), zero_symbol = _mm512_set1_epi16(kZeroSymbol);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    // word k of the result: the low 16 bits of state k (lanes 0-15 from x[0], 16-31 from x[1])
    const __m512i low_words = _mm512_setr_epi32(0x00020000, 0x00060004, 0x000A0008, 0x000E000C, 0x00120010, 0x00160014,
                                                0x001A0018, 0x001E001C, 0x00220020, 0x00260024, 0x002A0028,
                                                0x002E002C, 0x00320030, 0x00360034, 0x003A0038, 0x003E003C);
    const uint32_t t = --st.steps_left;
    const __m512i vals = _mm512_loadu_si512(v_ + uint64_t(t) * kLanes);
    if (raw_ != nullptr) pack_fields(vals, raw_ + uint64_t(t) * kStepFieldBytes);
    const __mmask32 nonzero = _mm512_test_epi16_mask(vals, vals);
    // a step of 32 +0.0 values (gradients' zero runs) takes the zero symbol's entry without loads
    __m512i lo[2] = {zero_entry, zero_entry}, hi[2] = {zero_entry, zero_entry};  // entries of lanes 0-7, 8-15 of x[j]
    if (nonzero != 0) {
      const __m512i symbols = _mm512_mask_mov_epi16(zero_symbol, nonzero, _mm512_srli_epi16(vals, kRawBits));
      const __m512i sym[2] = {_mm512_cvtepu16_epi32(_mm512_castsi512_si256(symbols)),
                              _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(symbols, 1))};
      for (int j = 0; j < 2; ++j) {
        lo[j] = _mm512_i32gather_epi64(_mm512_castsi512_si256(sym[j]), entries, 8);
        hi[j] = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(sym[j], 1), entries, 8);
      }
    }
    __m512i fs[2];  // start << 12 | freq, lane order
    __mmask16 need[2];
    for (int j = 0; j < 2; ++j) {
      fs[j] = _mm512_permutex2var_epi32(lo[j], even, hi[j]);
      // renormalise where x >= freq << (32 - prob_bits), i.e. (x >> (32 - prob_bits)) >= freq
      need[j] = _mm512_cmpge_epu32_mask(_mm512_srlv_epi32(st.x[j], renorm_shift_), _mm512_and_si512(fs[j], low12));
    }
    const __mmask32 need32 = _mm512_kunpackw(need[1], need[0]);
    const __m512i words = _mm512_maskz_compress_epi16(need32, _mm512_permutex2var_epi16(st.x[0], low_words, st.x[1]));
    const uint32_t count = uint32_t(_mm_popcnt_u32(need32));
    st.cursor -= count;  // the step's words in lane order
    _mm512_mask_storeu_epi16(st.cursor, __mmask32((uint64_t(1) << count) - 1), words);
    for (int j = 0; j < 2; ++j) {
      const __m512 rcp = _mm512_castsi512_ps(_mm512_permutex2var_epi32(lo[j], odd, hi[j]));
      const __m512i freq = _mm512_and_si512(fs[j], low12);
      const __m512i y = _mm512_mask_srli_epi32(st.x[j], need[j], st.x[j], 16);
      __m512i q, r;
      divide_by_freq_avx512(y, freq, rcp, q, r);
      st.x[j] = _mm512_add_epi32(_mm512_add_epi32(_mm512_sllv_epi32(q, prob_bits_), r), _mm512_srli_epi32(fs[j], 12));
    }
  }

  // The raw fields of one step's 32 values (none +0.0) packed to 24 bytes at `out`, as
  // pack_fields32: field pairs f0 + 64 f1, pairs of those p0 + 4096 p1 (24 bits in a 32-bit lane),
  // then the low 3 bytes of each lane gathered by one byte permute and stored under a mask.
  static EP_COMM_AVX512 inline __attribute__((always_inline)) void pack_fields(__m512i vals, uint8_t* out) {
    const __m256i bytes = _mm512_cvtepi16_epi8(_mm512_and_si512(vals, _mm512_set1_epi16(0x3F)));  // field k at byte k
    const __m256i pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x4001));
    const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi32(0x10000001));
    const __m256i low3 = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 16, 17, 18, 20, 21, 22, 24, 25, 26, 28,
                                          29, 30, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_mask_storeu_epi8(out, __mmask32(0xFFFFFF), _mm256_permutexvar_epi8(low3, quads));
  }

  // After the last step: the 32 final states to `states`; returns the number of words.
  EP_COMM_AVX512 uint32_t finish(uint32_t* states) const {
    _mm512_storeu_si512(states, s.x[0]);
    _mm512_storeu_si512(states + 16, s.x[1]);
    return static_cast<uint32_t>(words_end_ - s.cursor);
  }

 private:
  static constexpr uint32_t kStepFieldBytes = kLanes * kRawBits / 8;
  const uint16_t* v_;
  uint16_t* words_end_;
  uint8_t* raw_;  // the chunk's raw fields, packed while coding (null: split_fields packs them)
  __m512i prob_bits_, renorm_shift_;  // shift counts: 2^prob_bits slots, renormalisation at freq << (32 - prob_bits)
};

// The rANS passes of `count` (1 or 2) chunks: chunk k's values v[k][0, n[k]) coded with its table
// (syms[k], tabs[k]: two chunks may have different tables, of different prob_bits), words
// backwards below words_end[k], final states to states[k]; num_words[k] gets its word count. Where
// raw[k] is not null (a chunk without +0.0), the chunk's raw fields are packed there too (as
// split_fields_avx2 packs them), from the values each step loads: no pass of its own over the
// values, which the survey has left in L2 at best (builds in turn on a Xeon guest, one thread:
// 64x7168 weight messages encoded at 1.67-1.69 GB/s -> 1.67-1.76, whole activations 1.68-1.70 ->
// 1.85). Two
// chunks are coded in lockstep: a step's states depend on the previous step's through the quotient
// (a conversion, a float multiply, a truncation and a 32-bit multiply in a row), so one chunk
// leaves the core idle part of the time (C++ loop over real 64x7168 messages, sum of per-message
// minima of 25 alternating repetitions: 0.92x the pass's time on activations and weights, 0.76x on
// gradients, whose +0.0 steps need no gathers).
EP_COMM_AVX512 inline void rans_encode_chunks_avx512(int count, const uint16_t* const* v, const uint32_t* n,
                                                    const EncSym* const* syms, const SimdEncTables* const* tabs,
                                                    uint32_t* const* states, uint16_t* const* words_end,
                                                    uint32_t* num_words, uint8_t* const* raw = nullptr) {
  const long long* entries[2];
  __m512i zero_entry[2];
  alignas(RansEncoder512) unsigned char storage[2][sizeof(RansEncoder512)];
  RansEncoder512* c[2];
  for (int k = 0; k < count; ++k) {
    entries[k] = reinterpret_cast<const long long*>(tabs[k]->entry);
    zero_entry[k] = _mm512_set1_epi64(int64_t(tabs[k]->entry[kZeroSymbol]));
    c[k] = new (storage[k]) RansEncoder512(v[k], n[k], syms[k], *tabs[k], words_end[k], raw != nullptr ? raw[k] : nullptr);
  }
  if (count == 2) {
    RansEncoder512::State s0 = c[0]->s, s1 = c[1]->s;  // in registers while coding (see State)
    // the longer chunk's extra top steps first (coding runs backwards), then both together
    while (s0.steps_left > s1.steps_left) c[0]->step(s0, entries[0], zero_entry[0]);
    while (s1.steps_left > s0.steps_left) c[1]->step(s1, entries[1], zero_entry[1]);
    while (s0.steps_left > 0) {
      c[0]->step(s0, entries[0], zero_entry[0]);
      c[1]->step(s1, entries[1], zero_entry[1]);
    }
    c[0]->s = s0;
    c[1]->s = s1;
  } else {
    RansEncoder512::State s0 = c[0]->s;
    while (s0.steps_left > 0) c[0]->step(s0, entries[0], zero_entry[0]);
    c[0]->s = s0;
  }
  for (int k = 0; k < count; ++k) {
    num_words[k] = c[k]->finish(states[k]);
    c[k]->~RansEncoder512();
  }
}

// The same with one table (`syms`, `tab`) for both chunks.
EP_COMM_AVX512 inline void rans_encode_chunks_avx512(int count, const uint16_t* const* v, const uint32_t* n,
                                                    const EncSym* syms, const SimdEncTables& tab,
                                                    uint32_t* const* states, uint16_t* const* words_end,
                                                    uint32_t* num_words, uint8_t* const* raw = nullptr) {
  const EncSym* const both_syms[2] = {syms, syms};
  const SimdEncTables* const both_tabs[2] = {&tab, &tab};
  rans_encode_chunks_avx512(count, v, n, both_syms, both_tabs, states, words_end, num_words, raw);
}

// The rANS pass of one chunk (rans_encode_chunks_avx512 with one chunk); returns the number of words.
EP_COMM_AVX512 inline uint32_t rans_encode_chunk_avx512(const uint16_t* v, uint32_t n, const EncSym* syms,
                                                        const SimdEncTables& tab, uint32_t* states,
                                                        uint16_t* words_end) {
  uint32_t num_words = 0;
  rans_encode_chunks_avx512(1, &v, &n, syms, tab, &states, &words_end, &num_words);
  return num_words;
}

// split_fields_avx2's bytes with 32 values a step where the chunk holds +0.0: the fields of the
// step's non-zero values compacted by one vpcompressb and stored as 32 bytes at raw + nr (nr <= i,
// so the store ends inside `raw`'s n bytes while i + 32 <= n), against four 8-value steps with a
// table's shuffle each; then packed as split_fields_avx2 packs them. A chunk without +0.0: as
// split_fields_avx2 (packed straight from the values).
EP_COMM_AVX512 inline uint32_t split_fields_avx512(const uint16_t* v, uint32_t n, uint32_t zeros, uint8_t* raw) {
  if (zeros == 0) return split_fields_avx2(v, n, zeros, raw);
  const __m512i m3f = _mm512_set1_epi16(0x3F);
  uint32_t nr = 0, i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i x = _mm512_loadu_si512(v + i);
    const __mmask32 nonzero = _mm512_test_epi16_mask(x, x);
    const __m256i fields = _mm512_cvtepi16_epi8(_mm512_and_si512(x, m3f));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(raw + nr), _mm256_maskz_compress_epi8(nonzero, fields));
    nr += uint32_t(_mm_popcnt_u32(nonzero));
  }
  for (; i < n; ++i)
    if (v[i] != 0) raw[nr++] = static_cast<uint8_t>(raw_of(v[i]));
  store_le<uint64_t>(raw + nr, 0);
  pack_fields_in_place_avx2(raw, nr);
  return nr;
}

}  // namespace ep_comm::lossless
#pragma GCC diagnostic pop
#endif
