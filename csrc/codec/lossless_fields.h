// Format version 6's coded raw fields (chunk modes 4 and 5): the layout and its checks (shared by the
// host encoder and decoders and the CUDA decoder), the encoder's choice, and the host's decoding of
// a chunk with coded fields.
//
// A mode 4 chunk is a mode 0 chunk (32 states, the chunk's table) whose num_raw 6-bit raw fields
// are not stored packed but coded by a second rANS stream, the field stream: the num_raw values
// w_k = f_k << 6 (f_k the k-th field, so w_k = 0 where f_k = 0), coded exactly as a mode 0 chunk
// of num_raw values with a table of its own (the field table: symbols f in [1, 64) and the +0.0
// symbol 1024 for f = 0), whose own raw fields are all zero and not stored. Decoding the field
// stream with any mode 0 decoder (a zero raw section supplied) and taking w_k >> 6 gives the
// fields back; the chunk then decodes as mode 0 with them. Gradients' low mantissa bits carry 2 to
// 5 bits of their 6 (the rest of the value's information is in its symbol), so a chunk of them
// shrinks by up to a third of its field bytes.
//
// Payload (the directory entry: mode 4 | table << 8, num_words = the u16 words after the two state
// blocks, num_raw = the fields (>= 1), checksum of the chunk's values as in mode 0):
//   u32 state[32]         the symbols' final states (as mode 0)
//   u32 field_state[32]   the field stream's final states
//   u32 symbol_words S    the symbols' words
//   u32 nonzero_fields Z  fields other than 0 (the field stream's num_raw)
//   u32 field_checksum    the field stream's checksum: w_k's as a chunk's values' (checksum_of;
//                         version 7: the pair checksum)
//   u8 field_prob_bits (11 or 12), u8 0, u16 L (table bytes, 1 to kMaxFieldTableBytes)
//   L bytes               the field table in version 4's encoding, entries until the frequencies
//                         sum to 2^field_prob_bits (as version 5's extra tables), then zero bytes
//                         to a multiple of 4
//   u16 words[S]          the symbols' words (as mode 0)
//   u16 field_words[F]    the field stream's words, F = num_words - (16 + L padded) / 2 - S
// Mode 5 is mode 2 (one rANS state, a blob's only chunk) the same way: u32 state, u32 field_state,
// then the same field header, table and words, both streams coded by one state each, the field
// table's prob_bits 6 to 12; num_words counts the u16 words after the two 4-byte states.
// The encoder writes mode 4 (5) only where its payload is smaller than the chunk's mode 0 (2)
// payload.
#pragma once
#include <cstdint>
#include <cstring>
#include <memory>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "codec/lossless_core.h"

namespace ep_comm::lossless {

// The field stream's symbol of field f: f, or the +0.0 symbol for f = 0 (w = f << 6).
EP_HD uint32_t field_symbol(uint32_t f) { return f == 0 ? uint32_t(kZeroSymbol) : f; }

// Where a mode 4 payload's parts lie, and the field stream as a mode 0 chunk entry.
struct FieldLayout {
  uint32_t symbol_words;    // S
  uint32_t field_words;     // F
  uint32_t prob_bits;       // the field table's
  uint32_t table_bytes;     // L
  uint64_t table_offset;    // of the field table, from the payload's start
  uint64_t words_offset;    // of words[S]; field_words[F] follow
  ChunkEntry field_entry;   // mode 0, F words, Z raw fields, the field checksum
};

// ---- the encoder's choice (host; integer arithmetic, so any encoder of the format can make it alike) ----

// Fields a chunk must have before coding them is tried: below this, the field stream's 128 state
// bytes, header and table take most of what coding can save; a one-state chunk (mode 2 -> 5), whose
// field stream takes 4 state bytes, from 32.
constexpr uint32_t kMinCodedFields = 1024;
constexpr uint32_t kMinCodedFieldsOneState = 32;
// What coding the fields must save, estimated from their histogram, before the field stream is
// coded (the coded stream itself is then kept only where it is smaller): 64 bytes and a 32nd of
// the fields' bytes (one-state chunks: any saving). A mode 4 chunk decodes its fields as a second
// rANS stream, in about as long again as its symbols, so fields of nearly 6 bits' information stay
// raw (MiniLM's activations: 1.2% of their field bytes to gain, for two streams to decode, not one).
constexpr uint64_t kMinFieldSavingBytes = 64;
constexpr uint32_t kMinFieldSavingShift = 5;

// floor(1024 log2(x)) within 1 for x in [1, 2^44]: log2_q10 of x's top 20 bits, plus the shift.
EP_HD uint64_t log2_q10_wide(uint64_t x) {
  uint32_t shift = 0;
  while ((x >> shift) > (1ull << 20)) ++shift;
  return (uint64_t(shift) << 10) + log2_q10(static_cast<uint32_t>(x >> shift));
}

// The empirical entropy of fields counts[64] over `total` (> 0), in 1/1024 bits.
EP_HD uint64_t field_entropy_q10(const uint64_t* counts, uint64_t total) {
  const uint64_t log_total = log2_q10_wide(total);
  uint64_t bits = 0;
  for (int f = 0; f < 1 << kRawBits; ++f)
    if (counts[f] != 0) bits += counts[f] * (log_total - log2_q10_wide(counts[f]));
  return bits;
}

// Whether `num_fields` fields, whose `sampled` (> 0) counted ones have entropy_q10
// (field_entropy_q10), are estimated to code smaller by the least saving: their entropy
// (extrapolated to all of them) plus the field stream's states, their slack (a lane's bytes exceed
// its information by up to 4) and the field header, against their raw bytes.
EP_HD bool field_coding_may_pay(uint64_t entropy_q10, uint64_t sampled, uint32_t num_fields, bool one_state) {
  constexpr uint64_t kByte = 8 << 10;
  const uint64_t raw = raw_bytes(num_fields);
  const uint64_t overhead = kFieldHeaderBytes + (one_state ? 2 * kOneStateBytes : kStateBytes + 4 * kLanes);
  const uint64_t least = one_state ? 0 : kMinFieldSavingBytes + (raw >> kMinFieldSavingShift);
  return entropy_q10 * num_fields / sampled + kByte * (overhead + least) < kByte * raw;
}

// The encoder's first look at a chunk's fields (`num_fields` of them, at least min_coded_fields):
// the fields of every kFieldSampleStride-th value (+0.0 skipped), their counts[64] over `sampled`;
// fields of nearly 6 bits' information (activations', weights') stop here, at the cost of 1,024
// counted values in a chunk of 65,536 (a chunk whose fields do not pay pays this alone). A
// sample's empirical entropy is biased low (by about 63 / (2 ln 2 sampled) bits), so a chunk it
// rules out would not pay; below kMinFieldSample sampled fields it rules out nothing. (The encoder
// then decides from all the fields.)
constexpr uint32_t kFieldSampleStride = 64;
constexpr uint64_t kMinFieldSample = 256;
EP_HD uint32_t min_coded_fields(bool one_state) { return one_state ? kMinCodedFieldsOneState : kMinCodedFields; }
EP_HD bool field_sample_may_pay(const uint64_t* counts, uint64_t sampled, uint32_t num_fields, bool one_state) {
  return sampled < kMinFieldSample ||
         field_coding_may_pay(field_entropy_q10(counts, sampled), sampled, num_fields, one_state);
}

// Bytes of a mode 4 payload's field header and padded table.
EP_HD uint64_t field_prefix_bytes(uint32_t table_bytes) { return kFieldHeaderBytes + align4(table_bytes); }

// Bytes of one of a mode 4 (32 states) or mode 5 (one state) payload's two state blocks.
EP_HD uint64_t field_state_bytes(const ChunkEntry& e) { return e.mode == kModeOneStateFields ? kOneStateBytes : kStateBytes; }

// Writes a mode 4 or 5 payload's field header, field table (freq[1025] of prob_bits, version 4's
// orders kg, kf: table_bytes bytes) and the table's zero padding at h (field_prefix_bytes of it).
EP_HD void write_field_prefix(uint8_t* h, uint32_t symbol_words, uint32_t nonzero, uint32_t checksum, uint32_t prob_bits,
                              uint32_t table_bytes, const uint32_t* freq, uint32_t kg, uint32_t kf) {
  store_le<uint32_t>(h, symbol_words);
  store_le<uint32_t>(h + 4, nonzero);
  store_le<uint32_t>(h + 8, checksum);
  h[12] = static_cast<uint8_t>(prob_bits);
  h[13] = 0;
  store_le<uint16_t>(h + 14, static_cast<uint16_t>(table_bytes));
  write_table_v4(h + kFieldHeaderBytes, freq, kg, kf);
  for (uint64_t b = kFieldHeaderBytes + table_bytes; b < field_prefix_bytes(table_bytes); ++b) h[b] = 0;
}

// Reads and checks a mode 4 or 5 payload's field header (e: its entry, which check_entry passed;
// the payload holds payload_bytes(e, n) bytes): the word counts add up to num_words, Z <=
// num_raw, prob_bits 11 or 12 (mode 5: 6 to 12), L in [1, kMaxFieldTableBytes], the reserved byte
// and the table's padding zero. (The table's contents: read_field_table.)
EP_HD int read_field_layout(const uint8_t* payload, const ChunkEntry& e, FieldLayout& f) {
  const bool one = e.mode == kModeOneStateFields;
  const uint64_t states = 2 * field_state_bytes(e);
  const uint8_t* h = payload + states;
  f.symbol_words = load_le<uint32_t>(h);
  const uint32_t nonzero = load_le<uint32_t>(h + 4);
  const uint32_t checksum = load_le<uint32_t>(h + 8);
  f.prob_bits = h[12];
  f.table_bytes = load_le<uint16_t>(h + 14);
  const bool bits_ok = one ? f.prob_bits >= uint32_t(kMinProbBits) && f.prob_bits <= uint32_t(kMaxProbBits)
                           : f.prob_bits == uint32_t(kProbBits) || f.prob_bits == uint32_t(kMaxProbBits);
  if (h[13] != 0 || !bits_ok) return kErrStream;
  if (f.table_bytes == 0 || f.table_bytes > kMaxFieldTableBytes || nonzero > e.num_raw) return kErrStream;
  const uint64_t prefix_words = field_prefix_bytes(f.table_bytes) / 2;
  if (prefix_words + f.symbol_words > e.num_words) return kErrStream;
  f.field_words = static_cast<uint32_t>(e.num_words - prefix_words - f.symbol_words);
  for (uint64_t b = kFieldHeaderBytes + f.table_bytes; b < field_prefix_bytes(f.table_bytes); ++b)
    if (h[b] != 0) return kErrPadding;
  f.table_offset = states + kFieldHeaderBytes;
  f.words_offset = states + field_prefix_bytes(f.table_bytes);
  f.field_entry = ChunkEntry{one ? kModeOneState : kModeRans, f.field_words, nonzero, checksum};
  return kOk;
}

// Reads a mode 4 or 5 payload's field table (layout f) into freq[1025] / start[1025]: exactly L bytes,
// frequencies summing to 2^prob_bits, symbols in [1, 64) or the +0.0 symbol.
EP_HD int read_field_table(const uint8_t* payload, const FieldLayout& f, uint32_t* freq, uint32_t* start) {
  const int st = read_sized_table(payload + f.table_offset, f.table_bytes, f.prob_bits, freq, start);
  if (st != kOk) return st;
  if (freq[0] != 0) return kErrTable;  // field 0 is the +0.0 symbol's
  for (int s = 1u << kRawBits; s < kZeroSymbol; ++s)
    if (freq[s] != 0) return kErrTable;
  return kOk;
}

// Packs fields w[k] >> 6 (k < count; the field stream's decoded values, each below 2^12) as 6-bit
// fields at `raw` (raw_bytes(count) bytes, the last byte's unused bits zero, and 2 bytes of slack
// after them: eight fields go out as one 8-byte store), eight at a time (on x86-64 the eight bytes
// by one SSE2 shift and pack).
inline void pack_field_values(const uint16_t* w, uint32_t count, uint8_t* raw) {
  uint32_t k = 0;
  for (; k + 8 <= count; k += 8) {
#if defined(__x86_64__)
    const __m128i v = _mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)), kRawBits);
    const uint64_t bytes = uint64_t(_mm_cvtsi128_si64(_mm_packus_epi16(v, v)));
#else
    uint64_t bytes = 0;
    for (int j = 0; j < 8; ++j) bytes |= uint64_t(w[k + j] >> kRawBits) << (8 * j);
#endif
    const uint64_t packed = pack6x8(bytes);
    std::memcpy(raw + 6 * (k / 8), &packed, 8);  // (little-endian: the low 6 bytes are the fields)
  }
  BitWriter bits(raw + 6 * (k / 8));
  for (; k < count; ++k) bits.put(uint32_t(w[k]) >> kRawBits, kRawBits);
  bits.finish();
}

// ---- host decoding (the CUDA decoder's: rebuild_fields_warp in csrc/cuda/lossless_kernels.cu) ----

// A worker's scratch for decoding mode 4 chunks of at most cv values: the field table, the field
// stream and the chunk rebuilt as mode 0 payloads (states, words, then raw fields: the field
// stream's zeros, or the fields packed), the field stream's values.
struct FieldDecodeScratch {
  DecodeTable table;
  std::unique_ptr<uint8_t[]> field_payload, chunk_payload;
  std::unique_ptr<uint16_t[]> values;
  FieldLayout layout;       // of the chunk being decoded (prepare_coded_fields)
  ChunkEntry chunk_entry;   // the chunk rebuilt in chunk_payload (finish_coded_fields)
  explicit FieldDecodeScratch(uint32_t cv)
      : field_payload(new uint8_t[kStateBytes + 2ull * cv + raw_bytes(cv) + 64]),
        chunk_payload(new uint8_t[kStateBytes + 2ull * cv + raw_bytes(cv) + 64]),
        values(new uint16_t[cv > 0 ? cv : 1]) {}
};

// Decoding a mode 4 or 5 chunk (payload_bytes(e, n) bytes at `payload`, e checked by check_entry,
// n at most the scratch's cv) with the chunk's table takes three steps, so that a caller may decode
// two chunks' streams together:
//   prepare_coded_fields: the field header and table read (s.layout), the field table built by
//     build(freq, start, table, prob_bits) into s.table, the field stream rebuilt as a mode 0
//     (mode 5: mode 2) payload in s.field_payload (its states, its words, a zero raw section):
//     decoding it (s.layout.field_entry, e.num_raw values, s.table) gives the values w_k in
//     s.values;
//   finish_coded_fields: the chunk rebuilt as a mode 0 (2) payload in s.chunk_payload (its states,
//     the symbols' words, the fields w_k >> 6 packed), entry s.chunk_entry: decoding it gives the
//     chunk's values.
// Each stream gets every check of such a chunk (word and field counts, final states, checksum).
template <typename Build>
int prepare_coded_fields(const uint8_t* payload, const ChunkEntry& e, uint32_t n, FieldDecodeScratch& s,
                         Build&& build) {
  FieldLayout& f = s.layout;
  int st = read_field_layout(payload, e, f);
  if (st != kOk) return st;
  // a mode 0 chunk's bound: at most one word per value (so the scratch holds them)
  if (f.symbol_words > n || f.field_words > e.num_raw) return kErrStream;
  uint32_t freq[kNumSymbols], start[kNumSymbols];
  st = read_field_table(payload, f, freq, start);
  if (st != kOk) return st;
  build(freq, start, s.table, int(f.prob_bits));
  const uint64_t sb = field_state_bytes(e);
  const uint8_t* words = payload + f.words_offset;
  uint8_t* fp = s.field_payload.get();
  std::memcpy(fp, payload + sb, sb);
  std::memcpy(fp + sb, words + 2ull * f.symbol_words, 2ull * f.field_words);
  std::memset(fp + sb + 2ull * f.field_words, 0, raw_bytes(f.field_entry.num_raw));
  return kOk;
}
inline void finish_coded_fields(const uint8_t* payload, const ChunkEntry& e, FieldDecodeScratch& s) {
  const FieldLayout& f = s.layout;
  const uint64_t sb = field_state_bytes(e);
  uint8_t* cp = s.chunk_payload.get();
  std::memcpy(cp, payload, sb);
  std::memcpy(cp + sb, payload + f.words_offset, 2ull * f.symbol_words);
  pack_field_values(s.values.get(), e.num_raw, cp + sb + 2ull * f.symbol_words);
  s.chunk_entry = ChunkEntry{e.mode == kModeOneStateFields ? kModeOneState : kModeRans, f.symbol_words, e.num_raw,
                             e.checksum};
}

// The three steps on one chunk: decode(payload, entry, n, table, out) decodes a mode 0 chunk on the
// caller's path (every path gives the same status and values; the blob's checksum, as `pairs`);
// mode 2 decodes with the portable core, as the host decodes mode 2.
template <typename Build, typename Decode>
int decode_coded_fields_chunk(const uint8_t* payload, const ChunkEntry& e, uint32_t n, const DecodeTable& table,
                              uint16_t* out, FieldDecodeScratch& s, bool pairs, Build&& build, Decode&& decode) {
  int st = prepare_coded_fields(payload, e, n, s, build);
  if (st != kOk) return st;
  const bool one = e.mode == kModeOneStateFields;
  const ChunkEntry& fe = s.layout.field_entry;
  st = one ? decode_one_state_chunk(s.field_payload.get(), fe, e.num_raw, s.table, s.values.get(), pairs)
           : decode(s.field_payload.get(), fe, e.num_raw, s.table, s.values.get());
  if (st != kOk) return st;
  finish_coded_fields(payload, e, s);
  return one ? decode_one_state_chunk(s.chunk_payload.get(), s.chunk_entry, n, table, out, pairs)
             : decode(s.chunk_payload.get(), s.chunk_entry, n, table, out);
}

}  // namespace ep_comm::lossless
