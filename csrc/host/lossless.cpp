// Host (CPU) build of the lossless BF16 codec: binds encode/decode of csrc/codec/lossless_core.h
// (AVX2 and AVX-512 paths from lossless_avx2.h and lossless_avx512.h where the CPU has them, the
// portable decoder of lossless_scalar.h elsewhere), parallel over chunks.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#ifdef __linux__
#include <sys/mman.h>
#endif
#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "gil.h"
#include "codec/lossless_avx2.h"  // x86-64 only; other hosts use the portable core
#include "codec/lossless_avx512.h"
#include "codec/host_parallel.h"
#include "codec/lossless_core.h"
#include "codec/lossless_fields.h"
#include "codec/lossless_scalar.h"
#include "codec/lossless_tables.h"
#include "page_array.h"

namespace py = pybind11;
using namespace ep_comm::lossless;

namespace ep_comm::host {
namespace {

// SIMD levels: what a caller may ask for, and the best the CPU runs.
constexpr int kSimdPortable = 0, kSimdAvx2 = 1, kSimdAvx512 = 2;
#if defined(__x86_64__)
int simd_available() { return have_avx512() ? kSimdAvx512 : have_avx2() ? kSimdAvx2 : kSimdPortable; }
#else
int simd_available() { return kSimdPortable; }
#endif
// The level a call runs: the one asked for, lowered to what the CPU has.
int simd_level(int requested) { return std::min(std::max(requested, kSimdPortable), simd_available()); }

// Threads for `chunks` chunks of `values` values in all: no more than the chunks, and one for small
// inputs, where starting a thread team costs more than it saves.
int resolve_threads(int threads, uint64_t chunks, uint64_t values) {
  if (values < (1u << 17)) return 1;  // before hardware_threads(), which reads sysfs
  int nt = threads > 0 ? threads : hardware_threads();
  return chunks < uint64_t(nt) ? static_cast<int>(chunks > 0 ? chunks : 1) : nt;
}

// The host codec's bindings take tensors as (data pointer, element count) pairs, as the CUDA
// bindings do: the Python wrappers pass tensor.data_ptr() and numel() of contiguous CPU tensors
// they keep alive for the call (a NumPy view of each cost about 3-5 us per call, several percent
// of a 64x7168 message's decode). A null pointer is accepted only for zero elements.
template <typename T>
T* host_span(uintptr_t ptr, uint64_t count, const char* name) {
  if (ptr == 0 && count > 0) throw std::invalid_argument(std::string(name) + " is a null pointer");
  if (ptr % alignof(T) != 0) throw std::invalid_argument(std::string(name) + " is misaligned");
  return reinterpret_cast<T*>(ptr);
}

// A worker's scratch for one chunk of n <= cv values: states (written just below the words once
// their count is known), kSlackWords words of room for the AVX2 encoder's 8-word stores below the
// words, n words (written backwards), then the raw fields: first one byte per field, packed to 6
// bits in place, plus 8-byte store slack. Reused for every chunk the worker codes, so it stays in
// cache; a finished payload is contiguous in it and is copied once, to its place in the blob.
constexpr uint64_t kSlackWords = 16;
uint64_t scratch_bytes(uint32_t cv) {
  return (kStateBytes + 2 * kSlackWords + 2ull * cv + cv + 16 + 63) & ~uint64_t(63);
}

// Chunks coded together by one worker: at most 2 (the AVX-512 rANS pass takes two in lockstep),
// and only when that leaves every one of `threads` workers at least one pair (pairing 2 chunks
// on 2 threads made a 2-thread encode of 131,072 values as slow as 1 thread).
constexpr int kMaxChunksPerClaim = 2;
int chunks_per_claim(int level, uint64_t num_chunks, int threads) {
  return level == kSimdAvx512 && num_chunks >= 2 * uint64_t(threads) ? 2 : 1;
}

// A frequency table the encoder codes chunks with: frequencies, their version 4 encoding (orders,
// bytes) and the coders' symbol tables.
struct CodingTable {
  uint32_t freq[kNumSymbols];
  int prob_bits;
  uint32_t entries, gap_order, freq_order, bytes;  // bytes: in the blob's format, before padding
  EncSym syms[kNumSymbols];
#if defined(__x86_64__)
  SimdEncTables simd;
#endif
};

// The frequencies of counts[1025] (total > 0 values) for a table of `chunks` chunks, as format
// `version` takes them: 11 bits (version 2); for a blob of one chunk of at most kOneStateMaxValues
// values (`one_state`), choose_one_state_prob_bits; else 12 bits where prefer_12_bits says so.
void choose_frequencies(const uint64_t* counts, uint64_t total, uint64_t chunks, bool one_state, int version,
                        CodingTable& t) {
  if (one_state) {
    t.prob_bits = choose_one_state_prob_bits(counts, total, t.freq);
  } else if (version != int(kOldVersion)) {
    uint32_t freq12[kNumSymbols];
    t.prob_bits = choose_prob_bits(counts, total, chunks, t.freq, freq12);
  } else {
    t.prob_bits = kProbBits;
    normalize_counts(counts, total, t.freq, kProbBits);
  }
}

// The coders' symbol tables of `t` from its frequencies (summing to 2^prob_bits, or all zero),
// and its entry count. Only the symbols with a frequency get entries, and +0.0's always (the SIMD
// passes load it once a chunk): the coders look up no other (a chunk's symbols are its table's),
// and a chunk's own table has a few dozen of the 1,025.
void finish_coders(CodingTable& t) {
  t.syms[kZeroSymbol] = make_enc_sym(0, 0, t.prob_bits);
#if defined(__x86_64__)
  const ReciprocalTable& rcp = reciprocal_table();
  t.simd.prob_bits = uint32_t(t.prob_bits);
  t.simd.entry[kZeroSymbol] = 0;
#endif
  uint32_t start = 0;
  t.entries = 0;
  for (int s = 0; s < kNumSymbols; ++s) {
    const uint32_t f = t.freq[s];
    if (f == 0) continue;
    t.syms[s] = make_enc_sym(start, f, t.prob_bits);
#if defined(__x86_64__)
    t.simd.entry[s] = simd_enc_entry(start, f, rcp);
#endif
    start += f;
    ++t.entries;
  }
}

// The rest of `t` from its frequencies (summing to 2^prob_bits, or all zero: no table): entries,
// the table's orders and bytes in format `version`, the coders' symbol tables.
void finish_table(CodingTable& t, int version) {
  finish_coders(t);
  t.gap_order = t.freq_order = 0;
  if (compact_header(uint32_t(version)) && t.entries > 0) table_orders_v4(t.freq, t.gap_order, t.freq_order);
  t.bytes = t.entries == 0                 ? 0
            : version == int(kOldVersion) ? 4 * t.entries
            : version == int(kVersion3)   ? table_bytes_v3(t.freq)
                                          : table_bytes_v4(t.freq, t.gap_order, t.freq_order);
}

// Version 6: a chunk's field sample (lossless_fields.h: the fields of its values at indices that
// are multiples of kFieldSampleStride, +0.0 skipped), taken in pass 1 right after each piece's
// survey, while the piece's values are in cache: a pass of its own before the rANS pass waited on
// memory for each sampled line (~9% of the encode of activations, whose fields then stay raw).
struct FieldSample {
  uint32_t counts[1 << kRawBits] = {};
  uint32_t sampled = 0;
};

// Version 6: a worker's scratch for coding one chunk's raw fields (mode 4, lossless_fields.h): the
// field table, the field stream's values w (cv), its words (written backwards, cv words and
// kSlackWords of slack below) and the mode 4 payload assembled (at most the mode 0 payload it
// replaces, itself at most kStateBytes + 2 cv + raw_bytes(cv), plus the state block and the field
// header and table).
struct FieldScratch {
  CodingTable table;
  std::unique_ptr<uint16_t[]> values, words;
  std::unique_ptr<uint8_t[]> payload;
  const FieldSample* sample = nullptr;  // of the chunk being coded (set by its caller)
  // the field stream prepared (prepare_field_stream) and coded (code_field_streams)
  uint32_t num_fields = 0, nonzero = 0, checksum = 0, field_words = 0;
  uint32_t states[kLanes];
  uint16_t* words_end() { return words.get() + kSlackWords + num_fields; }
  explicit FieldScratch(uint32_t cv)
      : values(new uint16_t[cv + 32]), words(new uint16_t[cv + kSlackWords]),  // (field_values_avx512's slack)
        payload(new uint8_t[2 * kStateBytes + kFieldHeaderBytes + kMaxFieldTableBytes + 4ull * cv + 16]) {}
};

// Adds values [first, first + n) of a chunk (at v) to its field sample s: branch-free (a random
// share of +0.0 mispredicts), two count tables (no chain of increments through one counter).
void sample_fields(const uint16_t* v, uint32_t n, uint32_t first, FieldSample& s) {
  uint32_t c2[2][1 << kRawBits] = {};
  uint32_t sampled = 0, i = (kFieldSampleStride - first % kFieldSampleStride) % kFieldSampleStride;
  for (; i + kFieldSampleStride < n; i += 2 * kFieldSampleStride) {
    const uint16_t a = v[i], b = v[i + kFieldSampleStride];
    c2[0][a & kRawMask] += a != 0;
    c2[1][b & kRawMask] += b != 0;
    sampled += uint32_t(a != 0) + uint32_t(b != 0);
  }
  if (i < n) {
    c2[0][v[i] & kRawMask] += v[i] != 0;
    sampled += v[i] != 0;
  }
  for (int f = 0; f < 1 << kRawBits; ++f) s.counts[f] += c2[0][f] + c2[1][f];
  s.sampled += sampled;
}

// Version 6: whether a chunk with `num_fields` fields (one_state: coded with one state) and field
// sample s may code them smaller (field_sample_may_pay). (prepare_field_stream then decides from
// all the fields.)
bool fields_may_pay(const FieldSample& s, uint32_t num_fields, bool one_state) {
  if (num_fields < min_coded_fields(one_state)) return false;
  uint64_t counts[1 << kRawBits];
  for (int f = 0; f < 1 << kRawBits; ++f) counts[f] = s.counts[f];
  return field_sample_may_pay(counts, s.sampled, num_fields, one_state);
}

// Version 6's recoding of a mode 0 (2) chunk (values v[0, n), entry e, payload at `payload`, for
// which fields_may_pay held) as mode 4 (5) where its fields code smaller, in three steps, so that
// two chunks' field streams are coded in lockstep on AVX-512:
//   prepare_field_stream: the field stream's values, counts and checksum (pairs: version 7's) in fs; false when the
//     counts do not promise the least saving (field_coding_may_pay), else the field table chosen;
//   code_field_streams: the rANS pass of `count` prepared streams at SIMD level `level` (the same
//     words at every level);
//   finish_field_stream: the mode 4 (5) payload assembled in fs, replacing the chunk's when
//     smaller; false (nothing changed) otherwise.
bool prepare_field_stream(const uint16_t* v, uint32_t n, int level, FieldScratch& fs, const ChunkEntry& e,
                          bool pairs) {
  const uint32_t num_fields = e.num_raw;
  const bool one = e.mode == kModeOneState;  // mode 2 -> 5 (one state a stream), else 0 -> 4
  uint64_t counts[1 << kRawBits] = {};
  // the field stream's values, then their counts (four tables: no store-to-load chain on a
  // repeated field) and checksum, each loop without branches
  uint16_t* w = fs.values.get();
  uint32_t checksum = 0;
#if defined(__x86_64__)
  if (level == kSimdAvx512) {
    field_values_avx512(v, n, w, counts, checksum, pairs);
  } else
#endif
  {
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; ++i) {
      w[k] = static_cast<uint16_t>((v[i] & kRawMask) << kRawBits);
      k += v[i] != 0;
    }
    uint32_t counts4[4][1 << kRawBits] = {};
    for (k = 0; k + 4 <= num_fields; k += 4)
      for (int j = 0; j < 4; ++j) ++counts4[j][w[k + j] >> kRawBits];
    for (; k < num_fields; ++k) ++counts4[0][w[k] >> kRawBits];
    checksum = checksum_of(w, num_fields, 0, pairs);
    for (int f = 0; f < 1 << kRawBits; ++f)
      counts[f] = uint64_t(counts4[0][f]) + counts4[1][f] + counts4[2][f] + counts4[3][f];
  }
  if (!field_coding_may_pay(field_entropy_q10(counts, num_fields), num_fields, num_fields, one)) return false;
  CodingTable& t = fs.table;
  uint64_t symbol_counts[kNumSymbols] = {};
  for (uint32_t f = 0; f < 1u << kRawBits; ++f) symbol_counts[field_symbol(f)] = counts[f];
  uint32_t freq12[kNumSymbols];
  t.prob_bits = one ? choose_one_state_prob_bits(symbol_counts, num_fields, t.freq)
                    : choose_prob_bits(symbol_counts, num_fields, 1, t.freq, freq12);
  finish_table(t, int(kVersion4));  // version 4's table encoding (entries until the sum, as read)
  if (t.bytes > kMaxFieldTableBytes) return false;
  fs.num_fields = num_fields;
  fs.nonzero = num_fields - static_cast<uint32_t>(counts[0]);
  fs.checksum = checksum;
  return true;
}

void code_field_streams(int level, FieldScratch* const* fs, int count, bool one_state) {
  if (count == 0) return;
  if (one_state) {
    for (int k = 0; k < count; ++k)
      fs[k]->field_words = rans_encode_one_state(fs[k]->values.get(), fs[k]->num_fields, fs[k]->table.syms,
                                                 fs[k]->states[0], fs[k]->words_end());
    return;
  }
#if defined(__x86_64__)
  if (level == kSimdAvx512) {
    // (initialised: the compiler cannot see that count <= kMaxChunksPerClaim entries are read)
    const uint16_t* vs[kMaxChunksPerClaim] = {};
    uint32_t ns[kMaxChunksPerClaim] = {}, words[kMaxChunksPerClaim] = {};
    const EncSym* syms[kMaxChunksPerClaim] = {};
    const SimdEncTables* simd[kMaxChunksPerClaim] = {};
    uint32_t* state_ptrs[kMaxChunksPerClaim] = {};
    uint16_t* ends[kMaxChunksPerClaim] = {};
    for (int k = 0; k < count; ++k) {
      vs[k] = fs[k]->values.get();
      ns[k] = fs[k]->num_fields;
      syms[k] = fs[k]->table.syms;
      simd[k] = &fs[k]->table.simd;
      state_ptrs[k] = fs[k]->states;
      ends[k] = fs[k]->words_end();
    }
    rans_encode_chunks_avx512(count, vs, ns, syms, simd, state_ptrs, ends, words);
    for (int k = 0; k < count; ++k) fs[k]->field_words = words[k];
    return;
  }
#endif
  for (int k = 0; k < count; ++k) {
    FieldScratch& f = *fs[k];
#if defined(__x86_64__)
    if (level == kSimdAvx2) {
      f.field_words = rans_encode_chunk_avx2(f.values.get(), f.num_fields, f.table.syms, f.table.simd, f.states,
                                             f.words_end(), f.nonzero != f.num_fields);
      continue;
    }
#endif
    f.field_words = rans_encode_chunk(f.values.get(), f.num_fields, f.table.syms, f.states, f.words_end());
  }
}

bool finish_field_stream(uint32_t n, FieldScratch& fs, ChunkEntry& e, const uint8_t*& payload) {
  const bool one = e.mode == kModeOneState;
  const uint64_t states_bytes = one ? kOneStateBytes : kStateBytes;
  const CodingTable& t = fs.table;
  const uint32_t symbol_words = e.num_words, field_words = fs.field_words;
  const uint64_t prefix = field_prefix_bytes(t.bytes);
  const uint64_t coded = 2 * states_bytes + prefix + 2ull * symbol_words + 2ull * field_words;
  if (coded >= payload_bytes(e, n)) return false;
  uint8_t* o = fs.payload.get();
  std::memcpy(o, payload, states_bytes);
  std::memcpy(o + states_bytes, fs.states, states_bytes);
  uint8_t* h = o + 2 * states_bytes;
  write_field_prefix(h, symbol_words, fs.nonzero, fs.checksum, uint32_t(t.prob_bits), t.bytes, t.freq, t.gap_order,
                     t.freq_order);
  std::memcpy(h + prefix, payload + states_bytes, 2ull * symbol_words);
  std::memcpy(h + prefix + 2ull * symbol_words, fs.words_end() - field_words, 2ull * field_words);
  e.mode = one ? kModeOneStateFields : kModeCodedFields;
  e.num_words = static_cast<uint32_t>(prefix / 2 + symbol_words + field_words);
  payload = o;
  return true;
}

// The raw fields of values v[0, n) (`zeros` of them +0.0) packed at `raw` at SIMD level `level`
// (the same bytes at every level); returns their count.
uint32_t pack_raw_fields(int level, const uint16_t* v, uint32_t n, uint32_t zeros, uint8_t* raw) {
#if defined(__x86_64__)
  if (level == kSimdAvx512) return split_fields_avx512(v, n, zeros, raw);
  if (level >= kSimdAvx2) return split_fields_avx2(v, n, zeros, raw);
#endif
  (void)level;
  return split_fields_scalar(v, n, zeros, raw);
}

// Codes `count` (1 or 2) chunks: chunk k's values v[k][0, n[k]) with table *tables[k] in
// scratch[k] (scratch_bytes(n[k]) bytes each); payload[k] gets its payload's first byte
// (payload_bytes(*e[k], n[k]) bytes: in scratch, or v[k] itself for a chunk stored raw) and *e[k]
// its entry. survey[k] is the chunk's ChunkSurvey from pass 1 (checksum, +0.0 count); `level`
// picks the passes: kSimdAvx2 or kSimdAvx512, else the portable ones. `v4`: version 4's (and 5's)
// chunk modes (a chunk of +0.0 only as mode 3; with `one_state`, the blob's only chunk coded as
// mode 2, stored raw unless its payload and the table's padded bytes, `table_bytes`, are smaller
// than its values). fields[k] (version 6; null before): chunk k's FieldScratch, its raw fields
// coded where that pays (prepare_field_stream, code_field_streams, finish_field_stream), their
// checksum version 7's where `pairs`.
void encode_chunks_in(int count, const uint16_t* const* v, const uint32_t* n, const CodingTable* const* tables,
                      const ChunkSurvey* const* survey, int level, bool v4, bool one_state, uint64_t table_bytes,
                      uint8_t* const* scratch, FieldScratch* const* field_scratch, ChunkEntry* const* e,
                      const uint8_t** payload, bool pairs) {
  // the chunks coded with 32 states (mode 0), compacted for the SIMD passes
  int coded[kMaxChunksPerClaim];
  const uint16_t* cv_values[kMaxChunksPerClaim];
  uint32_t cv_n[kMaxChunksPerClaim];
  uint16_t* words_end[kMaxChunksPerClaim];
  const EncSym* cv_syms[kMaxChunksPerClaim];
  uint32_t states[kMaxChunksPerClaim][kLanes];
  uint32_t* state_ptrs[kMaxChunksPerClaim] = {states[0], states[1]};
  uint32_t num_words[kMaxChunksPerClaim];
  uint8_t* fields[kMaxChunksPerClaim];  // raw fields the AVX-512 rANS pass packs (null: packed already)
  uint8_t* cv_fields[kMaxChunksPerClaim];
  // version 6: chunks whose fields may be coded (fields_may_pay), packed only if they are not
  bool try_fields[kMaxChunksPerClaim] = {false, false};
  uint8_t* raw_at[kMaxChunksPerClaim];
  int num_coded = 0;
  for (int k = 0; k < count; ++k) {
    e[k]->checksum = survey[k]->checksum;
    if (v4 && n[k] > 0 && survey[k]->zeros == n[k]) {  // +0.0 only: no payload (checksum 0)
      *e[k] = ChunkEntry{kModeZero, 0, 0, e[k]->checksum};
      payload[k] = reinterpret_cast<const uint8_t*>(v[k]);
      continue;
    }
    uint16_t* end = reinterpret_cast<uint16_t*>(scratch[k] + kStateBytes) + kSlackWords + n[k];
    uint8_t* raw = reinterpret_cast<uint8_t*>(end);
    e[k]->mode = one_state ? kModeOneState : kModeRans;
    fields[k] = nullptr;
    raw_at[k] = raw;
    try_fields[k] = field_scratch != nullptr && !one_state &&
                    fields_may_pay(*field_scratch[k]->sample, n[k] - survey[k]->zeros, false);
    if (try_fields[k]) {  // packed after prepare_field_stream, only if coding them is declined
      e[k]->num_raw = n[k] - survey[k]->zeros;
    }
#if defined(__x86_64__)
    else if (level == kSimdAvx512 && !one_state && survey[k]->zeros == 0) {  // packed by the rANS pass
      fields[k] = raw;
      e[k]->num_raw = n[k];
    }
#endif
    else {
      e[k]->num_raw = pack_raw_fields(level, v[k], n[k], survey[k]->zeros, raw);
    }
    if (one_state) {
      uint32_t state = 0;
      e[k]->num_words = rans_encode_one_state(v[k], n[k], tables[k]->syms, state, end);
      uint8_t* p = reinterpret_cast<uint8_t*>(end - e[k]->num_words) - kOneStateBytes;
      std::memcpy(p, &state, kOneStateBytes);
      payload[k] = p;
      FieldScratch* fs = field_scratch != nullptr ? field_scratch[k] : nullptr;
      if (fs != nullptr && fields_may_pay(*fs->sample, e[k]->num_raw, true) &&
          prepare_field_stream(v[k], n[k], level, *fs, *e[k], pairs)) {
        code_field_streams(level, &fs, 1, true);
        finish_field_stream(n[k], *fs, *e[k], payload[k]);
      }
      continue;
    }
    coded[num_coded] = k;
    cv_values[num_coded] = v[k];
    cv_n[num_coded] = n[k];
    cv_syms[num_coded] = tables[k]->syms;
    cv_fields[num_coded] = fields[k];
    words_end[num_coded++] = end;
  }
#if defined(__x86_64__)
  if (level == kSimdAvx512 && num_coded > 0) {
    const SimdEncTables* simd[kMaxChunksPerClaim];
    for (int j = 0; j < num_coded; ++j) simd[j] = &tables[coded[j]]->simd;
    rans_encode_chunks_avx512(num_coded, cv_values, cv_n, cv_syms, simd, state_ptrs, words_end, num_words, cv_fields);
  } else if (level == kSimdAvx2) {
    for (int j = 0; j < num_coded; ++j)
      num_words[j] = rans_encode_chunk_avx2(cv_values[j], cv_n[j], cv_syms[j], tables[coded[j]]->simd, states[j],
                                            words_end[j], survey[coded[j]]->zeros != 0);
  } else
#endif
  {
    (void)state_ptrs;  // used above on x86-64 only
    for (int j = 0; j < num_coded; ++j)
      num_words[j] = rans_encode_chunk(cv_values[j], cv_n[j], cv_syms[j], states[j], words_end[j]);
  }
  for (int j = 0; j < num_coded; ++j) {
    const int k = coded[j];
    e[k]->num_words = num_words[j];
    uint8_t* p = reinterpret_cast<uint8_t*>(words_end[j] - num_words[j]) - kStateBytes;
    std::memcpy(p, states[j], kStateBytes);
    payload[k] = p;
  }
  FieldScratch* prepared[kMaxChunksPerClaim];
  int prepared_chunk[kMaxChunksPerClaim];
  int num_prepared = 0;
  for (int k = 0; k < count; ++k) {
    const bool larger = e[k]->mode == kModeOneState || e[k]->mode == kModeOneStateFields
                            ? align4(table_bytes) + align4(payload_bytes(*e[k], n[k])) >= align4(2ull * n[k])
                            : payload_bytes(*e[k], n[k]) >= 2ull * n[k];
    if (e[k]->mode != kModeZero && larger) {  // coding does not shrink it: raw
      *e[k] = ChunkEntry{kModeRaw, 0, 0, e[k]->checksum};
      payload[k] = reinterpret_cast<const uint8_t*>(v[k]);
    } else if (try_fields[k]) {
      if (prepare_field_stream(v[k], n[k], level, *field_scratch[k], *e[k], pairs)) {
        prepared[num_prepared] = field_scratch[k];
        prepared_chunk[num_prepared++] = k;
      } else {
        pack_raw_fields(level, v[k], n[k], survey[k]->zeros, raw_at[k]);  // mode 0 after all
      }
    }
  }
  code_field_streams(level, prepared, num_prepared, false);
  for (int j = 0; j < num_prepared; ++j) {
    const int k = prepared_chunk[j];
    if (!finish_field_stream(n[k], *prepared[j], *e[k], payload[k]))
      pack_raw_fields(level, v[k], n[k], survey[k]->zeros, raw_at[k]);  // mode 0 after all
  }
}

// Version 5's per-chunk tables: the choice of csrc/codec/lossless_tables.h (own_table_saving_q10,
// own_table_before, own_table_fits, refit_pays), which the CUDA encoder shares.

// bf16 bit patterns at `values` (num_values u16) with `shape` -> blob (1-D uint8 array).
// Two passes: the symbol histogram, then each chunk coded in its worker's scratch and copied to
// its place in an output allocated for the largest possible blob; the blob is returned as a view
// of that output's first blob-size bytes when the output has a mapping of its own (from 256 KiB)
// and the blob fills at least a third of it (or from 2 MiB, where the rest is given back), else as
// an exact-size copy. Version 5 adds a pass between the two: each chunk's estimated saving from a
// table of its own (own_table_saving_q10), from its symbol counts, kept per piece of pass 1.
py::array_t<uint8_t> encode(uintptr_t values, uint64_t num_values, const std::vector<int64_t>& shape,
                            int64_t chunk_values, int threads, int simd, int version) {
  if (version < int(kOldVersion) || version > int(kNewestVersion)) {
    std::string versions;
    for (uint32_t k = kOldVersion; k < kNewestVersion; ++k) versions += std::to_string(k) + ", ";
    throw std::invalid_argument("version must be one of " + versions + "or " + std::to_string(kNewestVersion));
  }
  const bool pairs = pair_checksum(uint32_t(version));
  const uint16_t* v = host_span<const uint16_t>(values, num_values, "values");
  if (shape.size() > size_t(kMaxDims)) throw std::invalid_argument("at most 8 dimensions");
  uint64_t product = 1;
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument("negative dimension");
    // checked before multiplying, so the product cannot wrap around
    if (d != 0 && product > kMaxValues / static_cast<uint64_t>(d)) throw std::invalid_argument("shape too large");
    product *= static_cast<uint64_t>(d);
  }
  if (product != num_values) throw std::invalid_argument("shape does not match the number of values");
  if (num_values > kMaxValues) throw std::invalid_argument("too many values");
  if (chunk_values < kMinChunkValues || chunk_values > kMaxChunkValues || chunk_values % kLanes != 0)
    throw std::invalid_argument("chunk_values must be a multiple of 32 in [32, 2^24]");
  const uint32_t cv = static_cast<uint32_t>(chunk_values);
  const uint64_t num_chunks = num_chunks_for(num_values, cv);
  if (num_chunks > 0xFFFFFFFFull) throw std::invalid_argument("too many chunks");
  const int nt = resolve_threads(threads, num_chunks, num_values);
  const uint32_t ndim = static_cast<uint32_t>(shape.size());
  uint64_t dims[kMaxDims] = {};
  for (uint32_t d = 0; d < ndim; ++d) dims[d] = static_cast<uint64_t>(shape[d]);
  const uint64_t table_off = header_bytes(uint32_t(version)) + shape_bytes(dims, ndim, uint32_t(version));
  // the largest blob any tables allow; pages past the blob's end are never touched
  const uint64_t capacity = max_blob_bytes_v(num_values, ndim, cv, uint32_t(version));
  py::array_t<uint8_t> out = page_backed_array<uint8_t>(capacity);
  uint8_t* o = out.mutable_data();

  std::unique_ptr<CodingTable> shared(new CodingTable());
  shared->prob_bits = kProbBits;
  shared->entries = shared->bytes = shared->gap_order = shared->freq_order = 0;
  std::unique_ptr<CodingTable[]> extra;  // version 5: extra table k - 1 is chunk_table k's
  uint32_t num_extra = 0;
  uint32_t table_bytes = 0;  // the table section's (version 5: the shared and the extra tables)
  std::vector<ChunkEntry> dir(num_chunks);
  std::vector<uint64_t> offsets(num_chunks + 1);
  // per chunk: 0 = the shared table, k >= 1 = extra table k - 1 (version 5)
  std::vector<uint8_t> chunk_table(num_chunks, 0);
  const bool one_state = compact_header(uint32_t(version)) && num_chunks == 1 &&
                         num_values <= one_state_max_values(uint32_t(version), cv);
  // version 5 with chunks that may take a table of their own (all but maybe the last have cv values)
  const bool own_tables = own_tables_allowed(uint32_t(version), num_chunks, cv);
  without_gil([&] {
    const int level = simd_level(simd);
    [[maybe_unused]] const bool use_simd = level >= kSimdAvx2;
    const auto chunk_n = [&](int64_t c) {
      const uint64_t b = uint64_t(c) * cv;
      return static_cast<uint32_t>(num_values - b < cv ? num_values - b : cv);
    };
    // Both passes run in one team of threads (one thread start per call, not two):
    // pass 1: the symbol histogram and each chunk's checksum and +0.0 count, over
    //   pieces of chunks (a chunk is cut in parts so that every thread gets about 32 pieces even
    //   when a message has few chunks: the threads then reach the barrier within a few us of each
    //   other; with 8 pieces per thread, a 64x7168 message's threads arrived up to 19 us apart;
    //   version 5 takes 8, see pieces_per_thread), counted per thread (version 5: also per piece);
    // the last thread to finish it builds the tables (BlockingBarrier);
    // (version 5: each chunk's saving from a table of its own, per chunk claimed in order; the
    //   last thread to finish picks the chunks that take one and builds the final tables;)
    // pass 2, per chunk (per 2 consecutive chunks on the AVX-512 level, whose rANS passes run in
    //   lockstep), claimed in order: split and rANS in the worker's scratch, then the
    //   payload is copied to its place, which follows the previous chunk's (published through
    //   chunk_end: a worker waits, yielding, for its predecessor's size; the lowest unfinished
    //   chunk never waits, so the loop always progresses).
    constexpr uint32_t kMinPieceValues = 4096;
    const uint64_t first_n = num_chunks > 0 ? chunk_n(0) : 0;
    // version 5 keeps each piece's counts (a fold of the thread's 8 counting tables per piece), so
    // it cuts fewer: 8 pieces a thread (2-thread encode of 64x7168 gradient messages: 3.7-4.0 GB/s
    // against 2.5 with 32)
    const uint64_t pieces_per_thread = own_tables ? 8 : 32;
    uint64_t parts = nt > 1 && num_chunks > 0 ? (pieces_per_thread * uint64_t(nt) + num_chunks - 1) / num_chunks : 1;
    parts = std::max<uint64_t>(1, std::min<uint64_t>(parts, first_n / kMinPieceValues));
    // piece p of chunk c: values [piece_begin(c, p), piece_begin(c, p + 1)) of the chunk
    const auto piece_begin = [&](int64_t c, uint64_t p) -> uint32_t {
      const uint64_t n = chunk_n(c);
      return p >= parts ? static_cast<uint32_t>(n) : static_cast<uint32_t>(n * p / parts / 16 * 16);
    };
    std::vector<uint64_t> hist(uint64_t(nt) * kNumSymbols, 0);
    std::vector<ChunkSurvey> piece_surveys(num_chunks * parts), surveys(num_chunks);
    // version 6: each piece's field sample (then each chunk's, in its first piece's place)
    std::vector<FieldSample> field_samples(version >= int(kVersion6) ? num_chunks * parts : 0);
    // version 5: each piece's symbol counts (then each chunk's, in its first piece's place; not
    // zeroed: pass 1 writes all 1,025 of every piece's), the global counts, each symbol's cost under
    // the first table, each chunk's saving and own table's bytes
    std::unique_ptr<uint32_t[]> piece_counts(new uint32_t[own_tables ? num_chunks * parts * kNumSymbols : 0]);
    std::vector<uint64_t> global_counts(kNumSymbols, 0), shared_cost(kNumSymbols, 0);
    std::vector<uint64_t> saving(own_tables ? num_chunks : 0);
    // version 5: each priced own table (own_table_saving_q10's), kept for the chunk that takes it
    // (not zeroed: written for every chunk with a saving, the only ones that take a table)
    std::unique_ptr<uint32_t[]> own_freq(new uint32_t[own_tables ? num_chunks * kNumSymbols : 0]);
    std::vector<OwnTableShape> own_shape(own_tables ? num_chunks : 0);
    std::vector<uint32_t> section_bytes(own_tables ? num_chunks : 0), by_saving(own_tables ? num_chunks : 0);
    std::unique_ptr<CodingTable> refitted(own_tables ? new CodingTable() : nullptr);
    const auto chunk_counts = [&](uint64_t c) { return piece_counts.get() + c * parts * kNumSymbols; };
    const auto build_first_table = [&] {
      for (uint64_t c = 0; c < surveys.size(); ++c)
        for (uint64_t p = 0; p < parts; ++p) {
          surveys[c].checksum += piece_surveys[c * parts + p].checksum;
          surveys[c].zeros += piece_surveys[c * parts + p].zeros;
          if (p > 0 && !field_samples.empty()) {
            FieldSample& into = field_samples[c * parts];
            const FieldSample& piece = field_samples[c * parts + p];
            for (int f = 0; f < 1 << kRawBits; ++f) into.counts[f] += piece.counts[f];
            into.sampled += piece.sampled;
          }
        }
      if (num_values == 0) {
        finish_table(*shared, version);  // no symbol: every chunk raw or none
        return;
      }
      for (int w = 0; w < nt; ++w)
        for (int s = 0; s < kNumSymbols; ++s) global_counts[s] += hist[uint64_t(w) * kNumSymbols + s];
      choose_frequencies(global_counts.data(), num_values, num_chunks, one_state, version, *shared);
      if (own_tables) {
        for (int s = 0; s < kNumSymbols; ++s)
          shared_cost[s] = shared->freq[s] == 0 ? 0 : symbol_cost_q10(shared->freq[s], uint32_t(shared->prob_bits));
      } else {
        finish_table(*shared, version);
        table_bytes = shared->bytes;
      }
    };
    // version 5: a chunk's saving from a table of its own (0: it keeps the shared one)
    const auto survey_own_table = [&](uint64_t c) {
      const uint32_t n = chunk_n(int64_t(c));
      if (n < kMinOwnTableValues || surveys[c].zeros == n) return;  // too small, or mode 3
      uint64_t counts[kNumSymbols];
      uint32_t* kept = chunk_counts(c);
      for (int s = 0; s < kNumSymbols; ++s) counts[s] = kept[s];
      if (parts > 1) {  // the other pieces' counts added, and the chunk's kept in its first piece's place
        for (uint64_t p = 1; p < parts; ++p)
          for (int s = 0; s < kNumSymbols; ++s) counts[s] += kept[p * kNumSymbols + s];
        for (int s = 0; s < kNumSymbols; ++s) kept[s] = static_cast<uint32_t>(counts[s]);  // n <= 2^24
      }
      uint32_t scratch[kOwnTableScratchWords];
      saving[c] = own_table_saving_q10(counts, n, surveys[c].zeros, shared_cost.data(), section_bytes[c], scratch,
                                       &own_shape[c]);
      if (saving[c] > 0) std::memcpy(own_freq.get() + c * kNumSymbols, scratch, kNumSymbols * sizeof(uint32_t));
    };
    // version 5: picks the chunks that take a table of their own (the largest savings first, as
    // many as kMaxExtraTables and kMaxExtraTableSectionBytes allow, and never every chunk that
    // codes symbols: the lowest of them then keeps the shared table), then the shared table: the
    // first one, or one fitted to the symbols of the chunks that keep it (all-+0.0 chunks left
    // out) where that is estimated to pay (see kOwnTableMarginBytes)
    const auto build_final_tables = [&] {
      uint32_t takers = 0;
      for (uint64_t c = 0; c < num_chunks; ++c)
        if (saving[c] > 0) by_saving[takers++] = static_cast<uint32_t>(c);
      std::sort(by_saving.begin(), by_saving.begin() + takers, [&](uint32_t a, uint32_t b) {
        return own_table_before(saving[a], a, saving[b], b);
      });
      uint64_t section = 0;
      uint32_t kept = 0;
      for (uint32_t i = 0; i < takers && kept < kMaxExtraTables; ++i) {
        const uint32_t c = by_saving[i];
        if (!own_table_fits(section, section_bytes[c])) continue;
        section += section_bytes[c];
        chunk_table[c] = 1;
        ++kept;
      }
      uint64_t keepers = 0, first_taker = num_chunks;
      for (uint64_t c = 0; c < num_chunks; ++c) {
        if (chunk_table[c] != 0) first_taker = std::min(first_taker, c);
        else keepers += surveys[c].zeros != chunk_n(int64_t(c));
      }
      if (keepers == 0 && first_taker < num_chunks) {
        chunk_table[first_taker] = 0;
        --kept;
        keepers = 1;
      }
      if (kept > 0) extra.reset(new (std::nothrow) CodingTable[kept]);
      if (kept > 0 && !extra) {  // no memory for them: every chunk keeps the shared table
        std::fill(chunk_table.begin(), chunk_table.end(), 0);
        kept = 0;
        keepers = num_chunks;
      }
      uint64_t counts[kNumSymbols];
      std::memcpy(counts, global_counts.data(), sizeof(counts));
      for (uint64_t c = 0; c < num_chunks; ++c) {
        const uint32_t n = chunk_n(int64_t(c));
        if (surveys[c].zeros == n) counts[kZeroSymbol] -= n;
        if (chunk_table[c] == 0) continue;
        const uint32_t* own = chunk_counts(c);
        for (int s = 0; s < kNumSymbols; ++s) counts[s] -= own[s];
        // the table priced in the survey (choose_prob_bits' frequencies, as choose_frequencies
        // gives them); its coders are made by the worker that codes the chunk (pass 2)
        CodingTable& t = extra[num_extra];
        chunk_table[c] = static_cast<uint8_t>(++num_extra);
        std::memcpy(t.freq, own_freq.get() + c * kNumSymbols, sizeof(t.freq));
        const OwnTableShape& shape = own_shape[c];
        t.prob_bits = int(shape.prob_bits);
        t.gap_order = shape.gap_order;
        t.freq_order = shape.freq_order;
        t.bytes = shape.bytes;
      }
      uint64_t total = 0;
      for (int s = 0; s < kNumSymbols; ++s) total += counts[s];
      // total == 0: every chunk is +0.0 only or has its own table; total == num_values: no chunk
      // left the shared one, whose refit would be the first table again. The first table stays.
      if (total > 0 && total < num_values) {
        CodingTable& fitted = *refitted;
        choose_frequencies(counts, total, keepers, false, version, fitted);
        uint32_t kg = 0, kf = 0;
        table_orders_v4(shared->freq, kg, kf);
        const uint32_t first_bytes = table_bytes_v4(shared->freq, kg, kf);
        table_orders_v4(fitted.freq, kg, kf);
        const uint32_t fitted_bytes = table_bytes_v4(fitted.freq, kg, kf);
        if (refit_pays(counts, total, keepers, shared_cost.data(), first_bytes, fitted.freq, uint32_t(fitted.prob_bits),
                       fitted_bytes)) {
          std::memcpy(shared->freq, fitted.freq, sizeof(fitted.freq));
          shared->prob_bits = fitted.prob_bits;
        }
      }
      finish_table(*shared, version);
      table_bytes = shared->bytes;
      for (uint32_t k = 0; k < num_extra; ++k) table_bytes += extra_table_bytes(extra[k].bytes);
    };
    constexpr uint64_t kNotReady = ~0ull;
    std::unique_ptr<std::atomic<uint64_t>[]> chunk_end(new std::atomic<uint64_t>[num_chunks]);
    for (uint64_t c = 0; c < num_chunks; ++c) chunk_end[c].store(kNotReady, std::memory_order_relaxed);
    const uint64_t scratch_stride = scratch_bytes(num_values < cv ? static_cast<uint32_t>(num_values) : cv);
    const int per_claim = chunks_per_claim(level, num_chunks, nt);
    const bool v4 = compact_header(uint32_t(version));
    // uninitialised (every byte a payload uses is written first)
    ScratchBuffer scratch(scratch_stride * uint64_t(per_claim) * uint64_t(nt));
    // version 6: each worker's field coding scratch per chunk of a claim
    std::vector<std::unique_ptr<FieldScratch>> field_scratch;
    if (version >= int(kVersion6) && num_values > 0)
      for (int k = 0; k < per_claim * nt; ++k)
        field_scratch.emplace_back(new FieldScratch(num_values < cv ? static_cast<uint32_t>(num_values) : cv));
    uint64_t data_off = 0;
    WorkCounter pieces(int64_t(num_chunks * parts), 1), chunks(int64_t(num_chunks), per_claim);
    WorkCounter surveyed(own_tables ? int64_t(num_chunks) : 0, 1);
    BlockingBarrier tables_ready(nt), final_tables_ready(nt);
    // allocated here: the workers must not throw
    std::unique_ptr<SymbolHistogram[]> local_hists(new SymbolHistogram[nt]);
    run_workers(nt, [&](int worker) {
      uint64_t* h = hist.data() + uint64_t(worker) * kNumSymbols;
      SymbolHistogram& local_hist = local_hists[worker];
      for (int64_t piece, unused; pieces.claim(piece, unused);) {
        const int64_t c = piece / int64_t(parts);
        const uint32_t first = piece_begin(c, uint64_t(piece) % parts), last = piece_begin(c, uint64_t(piece) % parts + 1);
        const uint16_t* values = v + uint64_t(c) * cv + first;
#if defined(__x86_64__)
        if (use_simd) {
          piece_surveys[uint64_t(piece)] = level == kSimdAvx512
                                               ? survey_chunk_avx2<8>(values, last - first, first, local_hist, h, pairs)
                                               : survey_chunk_avx2<4>(values, last - first, first, local_hist, h, pairs);
        } else
#endif
        {
          piece_surveys[uint64_t(piece)] = survey_chunk_scalar(values, last - first, first, local_hist, h, pairs);
        }
        if (!field_samples.empty()) sample_fields(values, last - first, first, field_samples[uint64_t(piece)]);
        if (own_tables) {  // the piece's counts kept, and added to the thread's
          uint32_t* kept = piece_counts.get() + uint64_t(piece) * kNumSymbols;
#if defined(__x86_64__)
          if (level == kSimdAvx512) {
            fold_piece_avx512(local_hist, kept, h);
            continue;
          }
#endif
          uint64_t counts[kNumSymbols] = {};
          local_hist.fold_into(counts);
          for (int s = 0; s < kNumSymbols; ++s) {
            h[s] += counts[s];
            kept[s] = static_cast<uint32_t>(counts[s]);
          }
        }
      }
      local_hist.fold_into(h);
      tables_ready.arrive_and_wait([&] {
        build_first_table();
        data_off = data_offset_at(table_off, table_bytes, static_cast<uint32_t>(num_chunks));
      });
      if (own_tables) {
        for (int64_t c, unused; surveyed.claim(c, unused);) survey_own_table(uint64_t(c));
        final_tables_ready.arrive_and_wait([&] {
          build_final_tables();
          data_off = data_offset_at(table_off, table_bytes, static_cast<uint32_t>(num_chunks));
        });
      }
      uint8_t* my_scratch[kMaxChunksPerClaim];
      FieldScratch* my_fields[kMaxChunksPerClaim] = {nullptr, nullptr};
      for (int k = 0; k < per_claim; ++k) {
        const uint64_t slot = uint64_t(worker) * uint64_t(per_claim) + uint64_t(k);
        my_scratch[k] = scratch.data() + scratch_stride * slot;
        if (!field_scratch.empty()) my_fields[k] = field_scratch[slot].get();
      }
      for (int64_t first, last; chunks.claim(first, last);) {
        const int count = static_cast<int>(last - first);
        const uint16_t* values[kMaxChunksPerClaim];
        uint32_t counts[kMaxChunksPerClaim];
        const CodingTable* tables[kMaxChunksPerClaim];
        const ChunkSurvey* chunk_surveys[kMaxChunksPerClaim];
        ChunkEntry* entries_out[kMaxChunksPerClaim];
        const uint8_t* payloads[kMaxChunksPerClaim];
        for (int k = 0; k < count; ++k) {
          const int64_t c = first + k;
          values[k] = v + uint64_t(c) * cv;
          counts[k] = chunk_n(c);
          const uint32_t t = chunk_table[uint64_t(c)];
          if (t != 0) finish_coders(extra[t - 1]);  // each extra table is one chunk's
          tables[k] = t == 0 ? shared.get() : &extra[t - 1];
          chunk_surveys[k] = &surveys[uint64_t(c)];
          entries_out[k] = &dir[uint64_t(c)];
          if (my_fields[k] != nullptr) my_fields[k]->sample = &field_samples[uint64_t(c) * parts];  // (merged)
        }
        encode_chunks_in(count, values, counts, tables, chunk_surveys, level, v4, one_state, shared->bytes, my_scratch,
                         field_scratch.empty() ? nullptr : my_fields, entries_out, payloads, pairs);
        for (int k = 0; k < count; ++k) {
          const int64_t c = first + k;
          uint64_t begin = data_off;
          if (c > 0)
            while ((begin = chunk_end[c - 1].load(std::memory_order_acquire)) == kNotReady) std::this_thread::yield();
          const uint64_t used = payload_bytes(dir[uint64_t(c)], counts[k]), end = begin + align4(used);
          chunk_end[c].store(end, std::memory_order_release);
          std::memcpy(o + begin, payloads[k], used);
          std::memset(o + begin + used, 0, end - begin - used);
        }
      }
    }, [&](int started) {  // fewer threads started: fewer arrive
      tables_ready.expect(nt, started);
      final_tables_ready.expect(nt, started);
    });
    offsets[0] = data_off;
    for (uint64_t c = 0; c < num_chunks; ++c) offsets[c + 1] = chunk_end[c].load(std::memory_order_relaxed);
    // version 5: a chunk stored raw leaves its own table unused: dropped, the others renumbered
    uint32_t kept_extra = 0;
    for (uint64_t c = 0; c < num_chunks; ++c) {
      const uint32_t t = chunk_table[c];
      if (t == 0) continue;
      if (dir[c].mode == kModeRaw) {
        chunk_table[c] = 0;
        continue;
      }
      if (kept_extra + 1 != t) {  // what the table section is written from (its coders are done)
        CodingTable& to = extra[kept_extra];
        const CodingTable& from = extra[t - 1];
        std::memcpy(to.freq, from.freq, sizeof(to.freq));
        to.prob_bits = from.prob_bits;
        to.entries = from.entries;
        to.gap_order = from.gap_order;
        to.freq_order = from.freq_order;
        to.bytes = from.bytes;
      }
      chunk_table[c] = static_cast<uint8_t>(++kept_extra);
    }
    num_extra = kept_extra;
    // a blob without a rANS chunk needs no table
    bool all_raw = true;
    for (const ChunkEntry& e : dir) all_raw = all_raw && (e.mode == kModeRaw || e.mode == kModeZero);
    if (all_raw) {
      shared->entries = shared->bytes = 0;
      shared->prob_bits = kProbBits;
      num_extra = 0;
    }
    uint32_t final_bytes = shared->bytes;
    for (uint32_t k = 0; k < num_extra; ++k) final_bytes += extra_table_bytes(extra[k].bytes);
    if (final_bytes != table_bytes) {  // the payloads move down by the tables' bytes dropped
      table_bytes = final_bytes;
      const uint64_t new_off = data_offset_at(table_off, table_bytes, static_cast<uint32_t>(num_chunks));
      std::memmove(o + new_off, o + data_off, offsets[num_chunks] - data_off);
      for (uint64_t& off : offsets) off -= data_off - new_off;
    }
    // version 5: a blob of +0.0 only is written as the fewest chunks chunk_values allows (one per
    // 2^24 values): its header, shape and a 16-byte directory entry per chunk, no payload
    uint32_t out_cv = cv;
    uint64_t out_chunks = num_chunks;
    bool all_zero = extra_tables_format(uint32_t(version)) && num_chunks > 1;
    for (const ChunkEntry& e : dir) all_zero = all_zero && e.mode == kModeZero;
    if (all_zero) {
      const uint64_t wide = (num_values + kLanes - 1) / kLanes * kLanes;
      out_cv = static_cast<uint32_t>(wide < kMaxChunkValues ? wide : kMaxChunkValues);
      out_chunks = num_chunks_for(num_values, out_cv);
      dir.assign(out_chunks, ChunkEntry{kModeZero, 0, 0, 0});
      std::fill(chunk_table.begin(), chunk_table.end(), uint8_t(0));
      offsets.assign(out_chunks + 1, data_offset_at(table_off, table_bytes, static_cast<uint32_t>(out_chunks)));
    }
    // header, tables, directory
    const uint64_t dir_off = directory_offset_at(table_off, table_bytes);
    std::memset(o, 0, offsets[0]);
    store_header(o, ndim, shared->entries, out_cv, static_cast<uint32_t>(out_chunks), num_values,
                 uint32_t(shared->prob_bits), table_bytes, uint32_t(version), num_extra);
    store_shape(o, dims, ndim, uint32_t(version));
    uint64_t p = table_off;
    if (shared->entries > 0) {
      if (version == int(kVersion3)) write_table_v3(o + p, shared->freq);
      if (compact_header(uint32_t(version))) write_table_v4(o + p, shared->freq, shared->gap_order, shared->freq_order);
      for (int s = 0; s < kNumSymbols && version == int(kOldVersion); ++s) {
        if (shared->freq[s] == 0) continue;
        store_le<uint16_t>(o + p, static_cast<uint16_t>(s));
        store_le<uint16_t>(o + p + 2, static_cast<uint16_t>(shared->freq[s]));
        p += 4;
      }
    }
    p = table_off + shared->bytes;
    for (uint32_t k = 0; k < num_extra; ++k) {  // version 5: prob_bits, LEB128 length, the table
      const CodingTable& t = extra[k];
      o[p++] = static_cast<uint8_t>(t.prob_bits);
      p += store_leb128(o + p, t.bytes);
      write_table_v4(o + p, t.freq, t.gap_order, t.freq_order);
      p += t.bytes;
    }
    store_le<uint32_t>(o + meta_checksum_offset(uint32_t(version)), meta_checksum(o, dir_off, uint32_t(version)));
    for (uint64_t c = 0; c < out_chunks; ++c) {
      uint8_t* d = o + dir_off + sizeof(ChunkEntry) * c;
      store_le<uint32_t>(d, dir[c].mode | (uint32_t(chunk_table[c]) << 8));
      store_le<uint32_t>(d + 4, dir[c].num_words);
      store_le<uint32_t>(d + 8, dir[c].num_raw);
      store_le<uint32_t>(d + 12, dir[c].checksum);
    }
  });
  const uint64_t blob_bytes = offsets.back();
  if (is_page_backed(capacity)) {
    // a view of the first blob_bytes bytes (keeps `out` alive as its base). When the blob is under
    // a third of it, the whole huge pages past the blob go back to the system, so that a live blob
    // holds at most 3x its bytes plus one huge page; otherwise they are kept, since a mapping
    // reused from the cache has them in place and would fault them in again.
    if (blob_bytes < capacity / 3) release_unused_pages(o, capacity, blob_bytes);
    return py::array_t<uint8_t>({static_cast<py::ssize_t>(blob_bytes)}, {py::ssize_t(1)}, o, out);
  }
  // a mapping of its own (from 256 KiB) holding a blob of at least a third of it: a view too, as
  // above (a 64x7168 message's blob is about 2/3 of its capacity: one copy of it saved). The cache
  // may hand out a mapping up to twice the request, so a live view holds at most about 6x its bytes.
  if (has_own_mapping(capacity) && blob_bytes >= capacity / 3)
    return py::array_t<uint8_t>({static_cast<py::ssize_t>(blob_bytes)}, {py::ssize_t(1)}, o, out);
  // otherwise an exact-size copy, so that the capacity-sized allocation is freed (and reused)
  py::array_t<uint8_t> blob = page_backed_array<uint8_t>(blob_bytes);
  std::memcpy(blob.mutable_data(), o, blob_bytes);
  return blob;
}

// One table's frequencies and cumulative starts, read from a blob.
struct TableFreqs {
  uint32_t freq[kNumSymbols];
  uint32_t start[kNumSymbols];
  uint32_t prob_bits;
};

struct Parsed {
  Header h;
  uint32_t freq[kNumSymbols];
  uint32_t start[kNumSymbols];
  std::vector<TableFreqs> extra;  // version 5's extra tables, in order
};

[[noreturn]] void fail(int status) { throw std::invalid_argument(std::string("lossless blob: ") + error_message(status)); }

void parse(const uint8_t* blob, uint64_t size, Parsed& p) {
  int st = parse_header(blob, size, p.h, kNewestVersion);
  if (st != kOk) fail(st);
  uint64_t shared_bytes = 0;
  st = read_table(blob, p.h, p.freq, p.start, &shared_bytes);
  if (st != kOk) fail(st);
  if (p.h.num_extra_tables > 0) {
    std::vector<ExtraTable> refs(p.h.num_extra_tables);
    st = read_extra_table_refs(blob, p.h, shared_bytes, refs.data());
    if (st != kOk) fail(st);
    p.extra.resize(refs.size());
    for (size_t k = 0; k < refs.size(); ++k) {
      st = read_extra_table(blob, refs[k], p.extra[k].freq, p.extra[k].start);
      if (st != kOk) fail(st);
      p.extra[k].prob_bits = refs[k].prob_bits;
    }
  }
  // the chunk directory must account for exactly the blob's bytes: checked here, before any
  // caller allocates the declared shape. (A valid blob can still declare a large tensor: an
  // all-+0.0 chunk codes to its 16 directory bytes; callers that know the size pass expected_shape.)
  st = read_directory(blob, size, p.h, nullptr, nullptr);
  if (st != kOk) fail(st);
}

const uint8_t* blob_data(const py::buffer_info& info, uint64_t& size) {
  if (info.itemsize != 1 || info.ndim != 1 || (info.shape[0] > 1 && info.strides[0] != 1))
    throw std::invalid_argument("blob must be a 1-D contiguous uint8 buffer");
  size = static_cast<uint64_t>(info.shape[0]);
  return static_cast<const uint8_t*>(info.ptr);
}

// blob (size bytes at `blob`) -> shape (list of ints); validates the header and table only.
std::vector<int64_t> header_shape(uintptr_t blob, uint64_t size) {
  const uint8_t* b = host_span<const uint8_t>(blob, size, "blob");
  Parsed p;
  parse(b, size, p);
  return std::vector<int64_t>(p.h.shape, p.h.shape + p.h.ndim);
}

// Bytes of a blob's fixed header plus the largest shape: all that metadata_bytes reads.
constexpr uint64_t kHeaderPrefixBytes = kHeaderBytes + 8ull * kMaxDims;

// The device decoder's caller validates a blob's metadata on the host, as decode does, before it
// allocates anything: first metadata_bytes on the blob's first min(blob_bytes, kHeaderPrefixBytes)
// bytes, then parse_metadata on its first metadata_bytes bytes (both copied from the device).

// The bytes of header, shape, table and chunk directory (the offset of the first payload), from
// the blob's first min(blob_bytes, kHeaderPrefixBytes) bytes and its size; checks the fixed header
// (parse_header_fields). Raises ValueError on a bad header.
uint64_t metadata_bytes(const py::buffer& prefix, uint64_t blob_bytes) {
  py::buffer_info info = prefix.request();
  uint64_t size = 0;
  const uint8_t* b = blob_data(info, size);
  const uint64_t expected = blob_bytes < kHeaderPrefixBytes ? blob_bytes : kHeaderPrefixBytes;
  if (size != expected)
    throw std::invalid_argument("prefix must hold the blob's first " + std::to_string(expected) + " bytes, got " +
                                std::to_string(size));
  // parse_header_fields reads only the prefix's bytes (a valid header and shape fit in it)
  Header h;
  const int st = parse_header_fields(b, blob_bytes, h, size, kNewestVersion);
  if (st != kOk) fail(st);
  return h.data_offset;
}

// (shape list, chunk_values, chunks with coded fields, format version) from a blob's first metadata_bytes bytes and
// its size: every check decode makes before it allocates (parse: header, table, metadata checksum, each directory entry,
// payload sizes adding up to the blob's size). Raises ValueError on a bad blob.
py::tuple parse_metadata(const py::buffer& metadata, uint64_t blob_bytes) {
  py::buffer_info info = metadata.request();
  uint64_t size = 0;
  const uint8_t* b = blob_data(info, size);
  Header h;
  // parse_header_fields reads only the metadata's bytes; parse reads bytes [0, data_offset) only,
  // data_offset itself coming from the fixed fields
  int st = parse_header_fields(b, blob_bytes, h, size, kNewestVersion);
  if (st != kOk) fail(st);
  if (size != h.data_offset)
    throw std::invalid_argument("metadata must hold the blob's first " + std::to_string(h.data_offset) +
                                " bytes, got " + std::to_string(size));
  Parsed p;
  parse(b, blob_bytes, p);
  uint64_t field_chunks = 0;  // version 6's chunks with coded fields, which the CUDA decoder gives a slot
  for (uint64_t c = 0; c < p.h.num_chunks; ++c) {
    const uint32_t mode = read_entry(b, p.h, c).mode & kModeMask;
    field_chunks += mode == kModeCodedFields || mode == kModeOneStateFields;
  }
  return py::make_tuple(std::vector<int64_t>(p.h.shape, p.h.shape + p.h.ndim), p.h.chunk_values, field_chunks,
                        p.h.version);
}

// Decodes one mode 0 chunk at SIMD level `level` (decode_chunk's result; pairs: version 7's checksum).
int decode_rans_chunk(int level, const uint8_t* payload, const ChunkEntry& e, uint32_t n, const DecodeTable& table,
                      uint16_t* out, bool pairs) {
#if defined(__x86_64__)
  if (level == kSimdAvx512) return decode_chunk_avx512(payload, e, n, table, out, pairs);
  if (level == kSimdAvx2) return decode_chunk_avx2(payload, e, n, table, out, pairs);
#endif
  (void)level;
  return decode_chunk_scalar(payload, e, n, table, out, pairs);
}

// Decodes a mode 4 chunk at SIMD level `level` (decode_coded_fields_chunk, lossless_fields.h).
int decode_coded_fields_chunk_at(int level, const uint8_t* payload, const ChunkEntry& e, uint32_t n,
                                 const DecodeTable& table, uint16_t* out, FieldDecodeScratch& s, bool pairs) {
  const auto build = [level](const uint32_t* freq, const uint32_t* start, DecodeTable& t, int prob_bits) {
#if defined(__x86_64__)
    if (level == kSimdAvx512) return build_decode_table_avx512(freq, start, t, prob_bits);
#endif
    build_decode_table(freq, start, t, prob_bits);
  };
  const auto decode = [level, pairs](const uint8_t* p, const ChunkEntry& c, uint32_t count, const DecodeTable& t,
                                     uint16_t* o) { return decode_rans_chunk(level, p, c, count, t, o, pairs); };
  return decode_coded_fields_chunk(payload, e, n, table, out, s, pairs, build, decode);
}

// Decodes a parsed blob `b` (size bytes) into o[num_values] at SIMD level `simd` (lowered to what
// the CPU has); returns a Status. Releases the GIL. The AVX-512 decoder takes chunks two at a time
// (decode_chunks_avx512), even when that leaves threads idle: 2 chunks of a weights tensor took
// 74 us as one pair on one thread, 101 us as one chunk on each of 2 threads (one chunk alone: 62
// us; medians of 300 calls from Python); the others one at a time. A version 5 pair whose chunks
// have different tables decodes in lockstep too.
int decode_parsed(const uint8_t* b, uint64_t size, const Parsed& p, uint16_t* o, int threads, int simd) {
  const Header& h = p.h;
  const int nt = resolve_threads(threads, h.num_chunks, h.num_values);
  const bool pairs = pair_checksum(h.version);
  int status = kOk;
  const int level = simd_level(simd);
  return without_gil([&]() -> int {
    std::vector<ChunkEntry> entries(h.num_chunks);
    std::vector<uint64_t> offsets(uint64_t(h.num_chunks) + 1);
    std::vector<uint32_t> chunk_table(h.num_chunks);
    status = read_directory(b, size, h, entries.data(), offsets.data(), chunk_table.data());
    if (status != kOk) return status;
    // table 0: the shared one; k >= 1: version 5's extra table k - 1
    std::unique_ptr<DecodeTable[]> tables(new DecodeTable[1 + p.extra.size()]);
    const auto build = [&](const uint32_t* freq, const uint32_t* start, DecodeTable& t, int prob_bits) {
#if defined(__x86_64__)
      if (level == kSimdAvx512) return build_decode_table_avx512(freq, start, t, prob_bits);
#endif
      build_decode_table(freq, start, t, prob_bits);
    };
    if (h.num_values > 0) build(p.freq, p.start, tables[0], int(h.prob_bits));
    // version 5's extra tables are built where first needed, by the worker that decodes a chunk
    // of one (usually its only chunk), so that workers build them in parallel; state: 0 not
    // built, 1 being built, 2 built (a worker that finds 1 waits, yielding, for the builder,
    // which is running)
    std::unique_ptr<std::atomic<uint8_t>[]> table_state(new std::atomic<uint8_t>[1 + p.extra.size()]);
    for (size_t k = 0; k <= p.extra.size(); ++k) table_state[k].store(k == 0 ? 2 : 0, std::memory_order_relaxed);
    const auto table_of = [&](int64_t c) -> const DecodeTable& {
      const uint32_t k = chunk_table[uint64_t(c)];
      std::atomic<uint8_t>& state = table_state[k];
      if (state.load(std::memory_order_acquire) != 2) {
        uint8_t expected = 0;
        if (state.compare_exchange_strong(expected, 1, std::memory_order_acquire)) {
          const TableFreqs& t = p.extra[k - 1];
          build(t.freq, t.start, tables[k], int(t.prob_bits));
          state.store(2, std::memory_order_release);
        } else {
          while (state.load(std::memory_order_acquire) != 2) std::this_thread::yield();
        }
      }
      return tables[k];
    };
    const DecodeTable& shared = tables[0];
    std::vector<int> chunk_status(h.num_chunks, kOk);
    // version 6: each worker's scratch for mode 4 chunks, where there are any
    std::vector<std::unique_ptr<FieldDecodeScratch>> field_scratch;
    for (const ChunkEntry& e : entries) {
      if (e.mode != kModeCodedFields && e.mode != kModeOneStateFields) continue;
      const uint32_t most = h.num_values < h.chunk_values ? static_cast<uint32_t>(h.num_values) : h.chunk_values;
      for (int w = 0; w < (level == kSimdAvx512 ? 2 : 1) * nt; ++w)
        field_scratch.emplace_back(new FieldDecodeScratch(most));
      break;
    }
    const int64_t per_task = level == kSimdAvx512 ? 2 : 1;
    const int64_t tasks = (int64_t(h.num_chunks) + per_task - 1) / per_task;
    const auto build_field_table = [level](const uint32_t* freq, const uint32_t* start, DecodeTable& t, int prob_bits) {
#if defined(__x86_64__)
      if (level == kSimdAvx512) return build_decode_table_avx512(freq, start, t, prob_bits);
#endif
      build_decode_table(freq, start, t, prob_bits);
    };
    parallel_for_workers(tasks, nt, [&](int worker, int64_t task) {
      // rANS chunks of this task whose padding is zero, for the SIMD decoders
      const uint8_t* payloads[2];
      const ChunkEntry* rans_entries[2];
      uint32_t counts[2];
      uint16_t* dsts[2];
      int64_t rans_chunks[2];
      int num_rans = 0;
      // version 6's mode 4 chunks of this task (SIMD levels): their field streams, decoded
      // together (a pair in lockstep on AVX-512), then the chunks rebuilt join the rANS chunks
      FieldDecodeScratch* fields[2];
      const uint8_t* field_sources[2];
      int64_t field_chunks[2];
      int num_fields = 0;
      for (int64_t c = task * per_task; c < std::min<int64_t>((task + 1) * per_task, h.num_chunks); ++c) {
        const ChunkEntry& e = entries[c];
        const uint32_t n = chunk_count(h, uint64_t(c));
        const uint8_t* payload = b + offsets[c];
        int st = kOk;
        for (uint64_t q = offsets[c] + payload_bytes(e, n); q < offsets[c + 1]; ++q)
          if (b[q] != 0) st = kErrPadding;
        uint16_t* dst = o + uint64_t(c) * h.chunk_values;
        if (st == kOk) {
          if (e.mode == kModeRaw) {
            st = decode_raw_chunk(payload, e, n, dst, pairs);
          } else if (e.mode == kModeZero) {
            decode_zero_chunk(n, dst);
          } else if (e.mode == kModeOneState) {
            st = decode_one_state_chunk(payload, e, n, shared, dst, pairs);
          } else if (e.mode == kModeCodedFields || e.mode == kModeOneStateFields) {
            FieldDecodeScratch& fs = *field_scratch[size_t(per_task * worker + (c - task * per_task))];
            if (e.mode == kModeOneStateFields || level < kSimdAvx2) {
              st = decode_coded_fields_chunk_at(level, payload, e, n, table_of(c), dst, fs, pairs);
            } else {
              st = prepare_coded_fields(payload, e, n, fs, build_field_table);
              if (st == kOk) {
                fields[num_fields] = &fs;
                field_sources[num_fields] = payload;
                field_chunks[num_fields++] = c;
                continue;
              }
            }
          } else if (level >= kSimdAvx2) {
            payloads[num_rans] = payload;
            rans_entries[num_rans] = &e;
            counts[num_rans] = n;
            dsts[num_rans] = dst;
            rans_chunks[num_rans++] = c;
            continue;
          } else {
            st = decode_chunk_scalar(payload, e, n, table_of(c), dst, pairs);
          }
        }
        chunk_status[c] = st;
      }
#if defined(__x86_64__)
      if (num_fields > 0) {
        const uint8_t* fp[2];
        const ChunkEntry* fe[2];
        uint32_t fn[2];
        const DecodeTable* ft[2];
        uint16_t* fw[2];
        int fst[2];
        for (int k = 0; k < num_fields; ++k) {
          fp[k] = fields[k]->field_payload.get();
          fe[k] = &fields[k]->layout.field_entry;
          fn[k] = entries[field_chunks[k]].num_raw;
          ft[k] = &fields[k]->table;
          fw[k] = fields[k]->values.get();
        }
        if (level == kSimdAvx512) {
          decode_chunks_avx512(num_fields, fp, fe, fn, ft, fw, fst, pairs);
        } else {
          for (int k = 0; k < num_fields; ++k) fst[k] = decode_chunk_avx2(fp[k], *fe[k], fn[k], *ft[k], fw[k], pairs);
        }
        for (int k = 0; k < num_fields; ++k) {
          const int64_t c = field_chunks[k];
          if (fst[k] != kOk) {
            chunk_status[c] = fst[k];
            continue;
          }
          finish_coded_fields(field_sources[k], entries[c], *fields[k]);
          payloads[num_rans] = fields[k]->chunk_payload.get();
          rans_entries[num_rans] = &fields[k]->chunk_entry;
          counts[num_rans] = chunk_count(h, uint64_t(c));
          dsts[num_rans] = o + uint64_t(c) * h.chunk_values;
          rans_chunks[num_rans++] = c;
        }
      }
#endif
      if (num_rans == 0) return;
#if defined(__x86_64__)
      int st[2];
      const DecodeTable* table[2] = {nullptr, nullptr};
      for (int k = 0; k < num_rans; ++k) table[k] = &table_of(rans_chunks[k]);
      if (level == kSimdAvx512) {
        decode_chunks_avx512(num_rans, payloads, rans_entries, counts, table, dsts, st, pairs);
      } else {
        for (int k = 0; k < num_rans; ++k) st[k] = decode_chunk_avx2(payloads[k], *rans_entries[k], counts[k], *table[k], dsts[k], pairs);
      }
      for (int k = 0; k < num_rans; ++k) chunk_status[rans_chunks[k]] = st[k];
#endif
    }, page_grain(tasks, nt, 2ull * h.chunk_values * uint64_t(per_task)));
    for (int st : chunk_status)
      if (st != kOk) return st;
    return kOk;
  });
}

// Text of a shape, as Python prints a tuple.
std::string shape_text(const uint64_t* dims, size_t ndim) {
  std::string t = "(";
  for (size_t d = 0; d < ndim; ++d) t += std::to_string(dims[d]) + (ndim == 1 || d + 1 < ndim ? "," : "") + (d + 1 < ndim ? " " : "");
  return t + ")";
}

// Throws ValueError unless the parsed blob's shape is `expected`.
void check_shape(const Parsed& p, const std::vector<uint64_t>& expected) {
  if (expected.size() != p.h.ndim || !std::equal(expected.begin(), expected.end(), p.h.shape))
    throw std::invalid_argument("blob holds a tensor of shape " + shape_text(p.h.shape, p.h.ndim) + ", expected " +
                                shape_text(expected.data(), expected.size()));
}

// blob (size bytes at `blob`) -> values written to `out` (out_count u16), whose tensor has
// `out_shape`: a blob of another shape is rejected before anything is written. Raises ValueError
// on any inconsistency (out's contents are then unspecified); never reads outside the blob.
void decode_into(uintptr_t blob, uint64_t size, uintptr_t out, uint64_t out_count, int threads, int simd,
                 const std::vector<uint64_t>& out_shape) {
  const uint8_t* b = host_span<const uint8_t>(blob, size, "blob");
  uint16_t* o = host_span<uint16_t>(out, out_count, "out");
  Parsed p;
  parse(b, size, p);
  check_shape(p, out_shape);
  if (out_count != p.h.num_values) throw std::invalid_argument("out has the wrong size");
  const int status = decode_parsed(b, size, p, o, threads, simd);
  if (status != kOk) fail(status);
}

// blob (size bytes at `blob`) -> new int16 array of its values' bit patterns, in the blob's shape.
// Large outputs get their own huge-page mapping (page_array.h). With `expected_shape`, a blob
// declaring another shape is rejected before the output is allocated. Raises ValueError on any
// inconsistency; never reads outside the blob.
py::array decode_new(uintptr_t blob, uint64_t size, int threads, int simd,
                     std::optional<std::vector<uint64_t>> expected_shape) {
  const uint8_t* b = host_span<const uint8_t>(blob, size, "blob");
  Parsed p;
  parse(b, size, p);
  if (expected_shape) check_shape(p, *expected_shape);
  py::array_t<int16_t> out = page_backed_array<int16_t>(p.h.num_values);
  const int status = decode_parsed(b, size, p, reinterpret_cast<uint16_t*>(out.mutable_data()), threads, simd);
  if (status != kOk) fail(status);
  return out.reshape(std::vector<py::ssize_t>(p.h.shape, p.h.shape + p.h.ndim));
}

}  // namespace

void register_lossless(py::module_& m) {
  m.def("lossless_encode", &encode, py::arg("values"), py::arg("num_values"), py::arg("shape"),
        py::arg("chunk_values") = int64_t(kDefaultChunkValues), py::arg("threads") = 0, py::arg("simd") = kSimdAvx512,
        py::arg("version") = int(kDefaultVersion),
        "bf16 bit patterns (address of num_values contiguous 2-byte values, kept alive by the caller)\n"
        "and their shape -> self-describing blob (uint8 array);\n"
        "simd: highest SIMD level to use (0 portable, 1 AVX2, 2 AVX-512; the output is identical);\n"
        "version: the blob format to write (4; 5: chunks may carry their own tables, written on the host;\n"
        "or 3 or 2 for comparisons and tests of the older decoder paths)");
  m.attr("LOSSLESS_FORMAT_VERSION") = kDefaultVersion;
  m.def("lossless_shape", &header_shape, py::arg("blob"), py::arg("blob_bytes"),
        "validates a blob's header and table (address and size); returns the encoded tensor's shape");
  m.def("lossless_decode_into", &decode_into, py::arg("blob"), py::arg("blob_bytes"), py::arg("out"),
        py::arg("out_values"), py::arg("threads"), py::arg("simd"), py::arg("out_shape"),
        "decodes a blob (address, size) into out (address of out_values contiguous 2-byte values) whose\n"
        "tensor has out_shape; ValueError on a bad blob or another shape (checked before writing)");
  m.def("lossless_decode", &decode_new, py::arg("blob"), py::arg("blob_bytes"), py::arg("threads") = 0,
        py::arg("simd") = kSimdAvx512, py::arg("expected_shape") = py::none(),
        "blob (address, size) -> new int16 array of its bit patterns in its shape; ValueError on a bad\n"
        "blob, or one declaring another shape than expected_shape (checked before allocating)");
  m.def("lossless_empty_u16", [](uint64_t count) { return page_backed_array<uint16_t>(count); }, py::arg("count"),
        "uninitialised 1-D uint16 array; from 2 MiB in its own huge-page mapping (see page_array.h)");
  m.def("lossless_max_blob_bytes", [](uint64_t n, uint32_t ndim, uint32_t cv, uint32_t version) {
    return max_blob_bytes_v(n, ndim, cv, version);
  }, py::arg("num_values"), py::arg("ndim"), py::arg("chunk_values") = kDefaultChunkValues,
     py::arg("version") = kDefaultVersion);
  m.attr("LOSSLESS_DEFAULT_CHUNK_VALUES") = kDefaultChunkValues;
  m.def("lossless_simd_available", &simd_available,
        "highest SIMD level this CPU runs: 0 portable, 1 AVX2, 2 AVX-512 (F, BW, VL, VBMI, VBMI2)");
  m.def("lossless_metadata_bytes", &metadata_bytes, py::arg("prefix"), py::arg("blob_bytes"),
        "bytes of a blob's header, table and directory, from its first min(blob_bytes,\n"
        "LOSSLESS_HEADER_PREFIX_BYTES) bytes and its size; checks the fixed header; ValueError on a bad one");
  m.def("lossless_parse_metadata", &parse_metadata, py::arg("metadata"), py::arg("blob_bytes"),
        "(shape list, chunk_values, chunks with coded fields) from a blob's first lossless_metadata_bytes\n"
        "bytes and its size, with\n"
        "every check decode makes before allocating; ValueError on a bad blob");
  m.def("lossless_error_message", [](int status) { return std::string(error_message(status)); }, py::arg("status"),
        "text of a lossless::Status code (as in the ValueError of a failed decode)");
  m.attr("LOSSLESS_HEADER_PREFIX_BYTES") = kHeaderPrefixBytes;
#ifdef __linux__
  m.def("lossless_cached_output_bytes", [] { return MappingCache::instance().held_bytes(); },
        "bytes of freed large-output mappings held for reuse (at most 256 MiB)");
  m.def("lossless_release_cached_outputs", [] { MappingCache::instance().clear(); },
        "returns every freed large-output mapping held for reuse to the system");
#else
  m.def("lossless_cached_output_bytes", [] { return uint64_t(0); });
  m.def("lossless_release_cached_outputs", [] {});
#endif
}

}  // namespace ep_comm::host
