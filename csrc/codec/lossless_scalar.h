// The host's portable (plain C++, any CPU) encoder passes and decoder of the lossless codec's
// chunks: the "portable" path, which CPUs without AVX2 run (Arm hosts such as Grace or Graviton,
// others), and the parts the SIMD paths share (SymbolHistogram, ChunkSurvey). Same results as
// split_chunk / rans_encode_chunk / decode_chunk in lossless_core.h, which stay the reference.
//
// Encoder: the symbol histogram is counted into four interleaved tables (one table serialised
// repeated symbols through one counter's store and reload), and a chunk without +0.0 packs its raw
// fields 8 at a time.
//
// Decoder (why not decode_chunk itself): decode_chunk decodes value by value with a branch per
// renormalisation and per raw field, and those branches follow the data (a state takes a word
// about every third step), so about a third of them are mispredicted. Here a step's 32 lanes are
// decoded first (table entry, state update, whether a word is needed), then the step's words and
// raw fields are taken without branches: counts tell where each lane's word and field are, and a
// step that mixes +0.0 with other values places fields by a running count. A step is only taken
// here when its words and fields are provably inside the streams; the rest of the chunk and every
// end-of-chunk check run in decode_chunk_from, so the statuses are the core's.
#pragma once
#include <cstdint>

#include "codec/lossless_core.h"

namespace ep_comm::lossless {

// Packs `count` raw fields held one per byte at `bytes` into the 6-bit stream, in place (group g
// of 8 bytes is read before its 6 bytes are written at 6g <= 8g). The bytes from `count` up to
// the next multiple of 8 must be zero; the buffer needs 8 bytes past them.
inline void pack_fields_in_place(uint8_t* bytes, uint32_t count) {
  const uint32_t groups = (count + 7) / 8;
  for (uint32_t g = 0; g < groups; ++g) store_le<uint64_t>(bytes + 6 * g, pack6x8(load_le<uint64_t>(bytes + 8 * g)));
}

// Symbol counts of the encoder's first pass, kept across the chunks of one thread's block: four or
// eight u32 tables of v >> 6 over every value (+0.0 counted at 0 and in `zeros`, moved to symbol
// 1024 when folded), folded into u64 counts before a table can overflow. The tables are 4 KiB + 64
// bytes apart, so that one symbol's counters in different tables do not share their low 12 address
// bits (4K aliasing: a load then waits for an unrelated store; with tables 4 KiB apart the pass
// took 5-11% more time, C++ A/B on real tensors, alternating order, Emerald Rapids Xeon).
struct SymbolHistogram {
  static constexpr int kMaxTables = 8;
  static constexpr int kTableStride = 1024 + 16;
  alignas(64) uint32_t local[kMaxTables][kTableStride] = {};
  uint64_t zeros = 0;
  uint64_t pending = 0;  // values counted since the last fold
  // Adds the counts to hist[1025] and clears them.
  void fold_into(uint64_t* hist) {
    // symbol-major: each count read and cleared once per table, summed in 32 bits (the tables
    // hold fewer than 2^31 + 2^24 values in all: add() folds once 2^31 are pending, and one
    // piece adds at most a chunk of 2^24), vectorised by the compiler
    for (int j = 0; j < 1024; ++j) {
      uint32_t sum = 0;
      for (int k = 0; k < kMaxTables; ++k) {
        sum += local[k][j];
        local[k][j] = 0;
      }
      hist[j] += sum;
    }
    hist[0] -= zeros;
    hist[kZeroSymbol] += zeros;
    zeros = pending = 0;
  }
  void add(uint32_t values, uint32_t zero_values, uint64_t* hist) {
    zeros += zero_values;
    pending += values;
    if (pending >= (1ull << 31)) fold_into(hist);
  }
};

// What the encoder's first pass learns of a chunk besides its symbol counts.
struct ChunkSurvey {
  uint32_t checksum = 0;  // checksum_of the values
  uint32_t zeros = 0;     // values that are +0.0
};

// Symbol histogram, checksum (pairs: version 7's) and +0.0 count of values v[0, n), which are
// values [first, first + n) of a chunk (first even), as survey_chunk_avx2 gives them: four tables
// of SymbolHistogram.
inline ChunkSurvey survey_chunk_scalar(const uint16_t* v, uint32_t n, uint32_t first, SymbolHistogram& h,
                                       uint64_t* hist, bool pairs) {
  uint32_t (*local)[SymbolHistogram::kTableStride] = h.local;
  ChunkSurvey survey;
  uint32_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const uint16_t x = v[i + k];
      ++local[k][x >> kRawBits];
      survey.zeros += x == 0;
    }
  }
  for (; i < n; ++i) {
    ++local[0][v[i] >> kRawBits];
    survey.zeros += v[i] == 0;
  }
  survey.checksum = checksum_of(v, n, first, pairs);
  h.add(n, survey.zeros, hist);
  return survey;
}

// The raw fields of chunk v[0, n), which holds `zeros` values +0.0, written to `raw` (n + 16
// bytes) as split_chunk does; returns their count. Without +0.0, 8 fields per 8-byte store;
// otherwise one byte per field first (the cursor advancing only past values other than +0.0),
// then packed in place.
inline uint32_t split_fields_scalar(const uint16_t* v, uint32_t n, uint32_t zeros, uint8_t* raw) {
  uint32_t i = 0;
  if (zeros == 0) {
    for (; i + 8 <= n; i += 8) {
      uint64_t bytes = 0;
      for (int k = 0; k < 8; ++k) bytes |= uint64_t(v[i + k] & kRawMask) << (8 * k);
      store_le<uint64_t>(raw + i / 8 * 6, pack6x8(bytes));
    }
    BitWriter bits(raw + i / 8 * 6);
    for (; i < n; ++i) bits.put(raw_of(v[i]), kRawBits);
    bits.finish();
    return n;
  }
  uint32_t nr = 0;
  for (; i < n; ++i) {
    raw[nr] = static_cast<uint8_t>(raw_of(v[i]));
    nr += v[i] != 0;
  }
  for (uint32_t k = nr; k < ((nr + 7) & ~7u); ++k) raw[k] = 0;
  pack_fields_in_place(raw, nr);
  return nr;
}

// Same result as decode_chunk.
inline int decode_chunk_scalar(const uint8_t* payload, const ChunkEntry& e, uint32_t n, const DecodeTable& table,
                               uint16_t* out, bool pairs) {
  uint32_t states[kLanes];
  if (!load_states(payload, states)) return kErrStream;
  const uint8_t* words = payload + kStateBytes;
  const uint8_t* raw = words + 2ull * e.num_words;
  const uint64_t nraw_bytes = raw_bytes(e.num_raw);
  uint32_t wpos = 0, rpos = 0, t = 0;
  const uint32_t full_steps = n / kLanes;
  for (; t < full_steps; ++t) {
    uint32_t x[kLanes], hi[kLanes], need[kLanes], keep[kLanes];
    uint32_t needs = 0, fields = 0;
    for (int l = 0; l < kLanes; ++l) {
      const uint32_t slot = states[l] & table.slot_mask;
      const uint32_t entry = table.entry[slot];
      x[l] = entry_freq(entry) * (states[l] >> table.prob_bits) + entry_bias(entry);
      hi[l] = entry_hi10(entry);
      need[l] = x[l] < kStateLow ? 1u : 0u;
      keep[l] = slot_is_zero(table, slot) ? 0u : 1u;  // 0: the lane decodes +0.0, which takes no field
      needs += need[l];
      fields += keep[l];
    }
    // reads: up to 8 bytes from the byte of the step's last field (a +0.0 lane after it reads 2
    // bytes of the next byte's), all inside the raw stream
    if (wpos + needs > e.num_words || rpos + fields > e.num_raw) break;
    if (fields > 0 && ((uint64_t(kRawBits) * (rpos + fields - 1)) >> 3) + 8 > nraw_bytes) break;
    if (needs == 0) {
      for (int l = 0; l < kLanes; ++l) states[l] = x[l];
    } else {  // word k of the step goes to the k-th lane that needs one (lanes in order)
      // (masks, not conditionals: the compiler turned those into the branches this avoids)
      uint32_t w = wpos;
      for (int l = 0; l < kLanes; ++l) {
        const uint32_t mask = 0u - need[l];
        const uint32_t word = load_le<uint16_t>(words + 2ull * (wpos + ((w - wpos) & mask)));  // < num_words
        states[l] = x[l] ^ ((x[l] ^ ((x[l] << 16) | word)) & mask);
        w += need[l];
      }
      wpos = w;
    }
    uint16_t* o = out + uint64_t(t) * kLanes;
    if (fields == 0) {  // 32 x +0.0
      for (int l = 0; l < kLanes; ++l) o[l] = 0;
    } else if (fields == kLanes) {  // every lane takes the next field: 8 fields per 8-byte read
      for (int g = 0; g < kLanes / 8; ++g) {
        const uint64_t bit = uint64_t(kRawBits) * (rpos + 8u * g);
        const uint64_t f8 = unpack6x8(load_le<uint64_t>(raw + (bit >> 3)) >> (bit & 7));
        for (int k = 0; k < 8; ++k) o[8 * g + k] = join_value(hi[8 * g + k], uint32_t(f8 >> (8 * k)) & kRawMask);
      }
    } else {
      uint32_t r = rpos;
      for (int l = 0; l < kLanes; ++l) {
        const uint64_t bit = uint64_t(kRawBits) * r;
        const uint32_t field = uint32_t(load_le<uint16_t>(raw + (bit >> 3)) >> (bit & 7)) & kRawMask;
        o[l] = static_cast<uint16_t>(((hi[l] << kRawBits) | field) & (0u - keep[l]));
        r += keep[l];
      }
    }
    rpos += fields;
  }
  return decode_chunk_from(payload, e, n, table, out, states, t, wpos, rpos, pairs);
}

}  // namespace ep_comm::lossless
