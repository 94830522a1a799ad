// Lossless BF16 codec core, shared by the host build (csrc/host/lossless.cpp) and the CUDA
// kernels (csrc/cuda/lossless_kernels.cu).
//
// Each BF16 value v (sign 1 | exponent 8 | mantissa 7 bits) is split into a symbol and raw bits:
//   symbol = 1024 when v == 0x0000 (+0.0), else the top 10 bits v >> 6 (sign, exponent and the
//            first mantissa bit: on activations the sign and the first mantissa bit depend on the
//            exponent, so coding them with it saves about 6% over coding the exponent alone);
//   raw    = the low 6 mantissa bits v & 0x3F, stored as packed 6-bit fields, only for symbols
//            != 1024.
// Symbols are coded with rANS (32-bit state, 16-bit renormalisation, 2^prob_bits-slot
// probabilities) from one frequency table per blob, shared by all its chunks (format version 5:
// a chunk may carry its own). Values are cut into chunks of `chunk_values`; inside a chunk coded
// with 32 states (mode 0) value i belongs to lane i % 32 (32 interleaved rANS states, one per warp
// lane on the GPU).
//
// Blob layout, format version 4 (little-endian, every field naturally aligned):
//   Header (20 bytes): u32 magic 'EPLB', u8 version (4), u8 ndim, u16 num_table_entries,
//                      u32 chunk_values,
//                      u32 meta_checksum (of every byte before the directory but these 4),
//                      u8 prob_bits (6 to 12; 11 or 12 when a chunk has mode 0), u8 0, u16 table_bytes
//   shape[ndim]: each dimension in LEB128 (7 bits a byte, low first, shortest form, at most 7
//                bytes); the value and chunk counts follow from it
//   table (table_bytes bytes; none when no chunk is rANS-coded): one byte kg | kf << 4 (kg <= 10,
//          kf <= 11), then a bit stream (bit j of byte b is stream bit 8b + j): per entry, in
//          ascending symbol order, gap = symbol - previous symbol - 1 (previous = -1 before the
//          first) in the order-kg Exp-Golomb code and freq - 1 in the order-kf one, where v in the
//          order-k code is, with q = (v >> k) + 1 = 2^m + r: m zero bits, a one bit, r in m bits,
//          then v's low k bits; zero bits to the end of the last byte. Frequencies are in [1, 2048]
//          and sum to 2^prob_bits; the encoder takes the lowest of the cheapest orders
//   zero padding to a multiple of 4 bytes
//   directory: num_chunks x ChunkEntry {u32 mode, u32 num_words, u32 num_raw, u32 checksum}
//   chunk payloads in order, each zero-padded to a multiple of 4 bytes:
//     mode 0 (rANS, 32 states): u32 final_state[32], u16 words[num_words], raw fields: num_raw
//                    6-bit fields, field k in bits [6k, 6k + 6) of the byte stream (bit j of byte
//                    b is stream bit 8b + j), ceil(6 num_raw / 8) bytes, unused high bits zero
//     mode 1 (raw):  u16 values[n] (a chunk that coding would not shrink)
//     mode 2 (one state): u32 final_state, u16 words[num_words], raw fields as mode 0: the values
//                    coded in order by one rANS state; only in a blob's only chunk of at most
//                    kOneStateMaxValues values (the encoder uses it there, and stores the chunk raw
//                    unless its payload plus the padded table is smaller than the values)
//     mode 3 (+0.0): no payload, num_words = num_raw = 0, checksum 0 (every value +0.0)
// Format version 5 (written on request by the host and CUDA encoders; decoded by the host build and
// the CUDA decoder) is version 4 where a chunk coded with 32 states may carry a frequency table of its
// own:
//   header: the byte after prob_bits (0 in versions 3 and 4) is T, the number of extra tables
//           (at most 255 and at most num_chunks; 0 unless the shared table is present), and
//           table_bytes counts the shared table and the extra tables (the table section), so
//           the directory's offset follows as in version 4. T sits in the fixed header, not in
//           the section, so that a directory entry's table index is checked from the fixed
//           header alone (check_entry) and the format adds no byte to a blob without extra
//           tables;
//   table section: the shared table as in version 4 (num_table_entries entries; it ends at the
//           byte holding its last entry's last bit, the bits after it zero), then per extra
//           table: u8 prob_bits (11 or 12), a LEB128 byte length L (>= 1, shortest form, at most
//           2 bytes), L bytes of a table in version 4's encoding whose entries run until their
//           frequencies sum to 2^prob_bits (no entry count), ending at its L-th byte;
//   directory entries: the u32 mode word is mode | t << 8 (bits 16-31 zero), t = 0 for the
//           shared table, k >= 1 for extra table k - 1; only mode 0 takes t >= 1; every extra
//           table must be some chunk's (kErrTable), a t above T or on another mode is kErrDirectory;
//   the metadata checksum covers the whole table section (every byte before the directory);
//   mode 2 (one state) takes a blob's only chunk of up to one_state_max_values(5, chunk_values)
//   values (a quarter of chunk_values in [kOneStateMaxValues, kOneStateMaxValuesV5]): 124 bytes
//   fewer than 32 states, at the cost of a serial decode;
//   Which chunks take a table of their own is the encoders' choice (csrc/codec/lossless_tables.h,
//   shared by the host and CUDA encoders); any choice decodes. A blob of +0.0 only is written with the largest
//   chunk_values its values allow (one mode 3 chunk per 2^24 values): header, shape and a 16-byte
//   entry per chunk.
// Format version 6 (written by the host and CUDA encoders on request; decoded by the host build
// and the CUDA decoder) is version 5 where a 32-state chunk may code its raw fields with a second rANS
// stream: mode 4, whose payload lossless_fields.h lays out; its directory entry takes a table index
// as mode 0, num_words counts the u16 words after its two state blocks, num_raw >= 1 its fields.
// Mode 5 is mode 2 (one state, a blob's only chunk) with its fields coded the same way by one
// more state.
// Format version 3 (still decoded; written on request) differs in the header (32 bytes: u32
// num_chunks and u64 num_values after chunk_values, u64 dimensions) and the table, num_table_entries
// entries each a gap (one byte when below 128, else 0x80 | gap >> 8, gap & 0xFF) then a frequency
// (one byte freq - 1 when freq <= 128, else 0x80 | (freq - 1) >> 8, (freq - 1) & 0xFF), always the
// shortest form; prob_bits 11 or 12; modes 0 and 1 only. Format version 2 (still decoded) differs
// from version 3 in the header's last word (reserved, 0: prob_bits is 11) and the table:
// num_table_entries x {u16 symbol, u16 freq}, 4 bytes each.
// The encoder picks prob_bits per blob: for a blob of one chunk of at most kOneStateMaxValues
// values, the bits from kMinProbBits to 12 of the smallest estimated size (the symbols'
// cross-entropy under the frequencies plus the table; choose_one_state_prob_bits); otherwise 12
// when every symbol's 12-bit frequency fits in 2048 slots and the estimated size (the table and
// the symbols' cross-entropy under its frequencies) is smaller than with 11 bits by more than 64
// bytes per chunk, else 11. With 11 bits a version 3 table is no larger than version 2's and
// everything else is the same; a rANS lane's bytes are its symbols' information plus between 2
// and 4 bytes (the final state less the renormalisation floor), so two tables' chunks differ from
// their estimates' difference by under 2 bytes a lane.
// Format version 7 (the default) is version 6 with a chunk checksum that is not linear in the
// values (pair_checksum, below); a field stream's checksum likewise.
// The checksum of a chunk, versions 2 to 6, is sum_i v_i * (2 i + 1) mod 2^32 over its values (i
// within the chunk), so any single corrupted value changes it; but it is linear in the values with
// weights in arithmetic progression, so changes (-d, +d, +d, -d) to values 2 apart cancel. A
// corrupted field stream of version 6 decodes to such changes in about 1e-5 of single-bit flips.
// Version 7's checksum is sum_j mix(u_j) * (2 j + 1) mod 2^32 over the chunk's value pairs u_j =
// v_2j | v_2j+1 << 16 (v_n = 0 when n is odd), mix(u) = m ^ (m >> 16) with m = u * kPairMix mod
// 2^32: a change within one pair always changes it (mix is a bijection, the weights odd), and mix
// not being linear, no fixed pattern of changes cancels in it whatever the values.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/hd.h"

namespace ep_comm::lossless {

constexpr uint32_t kMagic = 0x424C5045u;  // "EPLB"
constexpr uint32_t kVersion4 = 4;    // the compact header (20 bytes, LEB128 shape) from here on
constexpr uint32_t kDefaultVersion = 7;  // what the encoders (host and CUDA) write by default
constexpr uint32_t kVersion5 = 5;    // per-chunk tables: written on request (host and CUDA), decoded everywhere
constexpr uint32_t kVersion6 = 6;    // version 5 with coded raw fields (modes 4, 5): written and decoded everywhere
constexpr uint32_t kVersion7 = 7;    // version 6 with the pair checksum: written and decoded everywhere
constexpr uint32_t kNewestVersion = kVersion7;
constexpr uint32_t kVersion3 = 3;    // still decoded and written on request
constexpr uint32_t kOldVersion = 2;  // still decoded and written on request
constexpr int kMaxDims = 8;
constexpr int kLanes = 32;
constexpr int kProbBits = 11;                       // version 2's probabilities; the entry fields' width
constexpr uint32_t kProbScale = 1u << kProbBits;    // also the largest frequency of one symbol
constexpr int kMaxProbBits = 12;                    // version 3 also takes 12
constexpr int kMinProbBits = 6;                     // version 4's one-state blobs take 6 to 12
constexpr uint32_t kMaxProbScale = 1u << kMaxProbBits;
constexpr uint32_t kStateLow = 1u << 16;  // rANS states live in [kStateLow, 2^32)
constexpr int kNumSymbols = 1025;
constexpr int kZeroSymbol = 1024;
constexpr uint32_t kMaxTableBytes = 4 * kNumSymbols;  // a table's largest size (either version)
constexpr int kRawBits = 6;
constexpr uint32_t kRawMask = (1u << kRawBits) - 1;
constexpr uint32_t kModeRans = 0;
constexpr uint32_t kModeRaw = 1;
constexpr uint32_t kModeOneState = 2;  // version 4: one rANS state (a blob's only chunk, at most kOneStateMaxValues)
constexpr uint32_t kModeZero = 3;      // version 4: every value +0.0, no payload
constexpr uint32_t kModeCodedFields = 4;  // version 6: mode 0 with the raw fields rANS-coded (lossless_fields.h)
constexpr uint32_t kModeOneStateFields = 5;  // version 6: mode 2 with the raw fields coded by one more state
constexpr size_t kFieldHeaderBytes = 16;  // version 6: a mode 4 payload's words after its two state blocks
constexpr uint32_t kMaxFieldTableBytes = 512;  // version 6: the most bytes a mode 4 chunk's field table takes
constexpr uint32_t kOneStateMaxValues = 4096;     // version 4's limit, and the least version 5 takes
constexpr uint32_t kOneStateMaxValuesV5 = 16384;  // version 5's largest limit (one_state_max_values)
constexpr uint32_t kMaxExtraTables = 255;  // version 5: a directory entry's table index is 8 bits
constexpr uint32_t kModeMask = 0xFF;       // version 5: a directory entry's mode word is mode | table << 8
constexpr uint32_t kDefaultChunkValues = 65536;
constexpr uint32_t kMinChunkValues = 32;
constexpr uint32_t kMaxChunkValues = 1u << 24;
constexpr uint64_t kMaxValues = 1ull << 48;
constexpr size_t kHeaderBytes = 32;           // versions 2 and 3 (and the most any version takes)
constexpr size_t kMetaChecksumOffset = 24;    // versions 2 and 3
constexpr size_t kHeaderBytesV4 = 20;
constexpr size_t kMetaChecksumOffsetV4 = 12;
constexpr uint32_t kMaxDimBytes = 7;          // a version 4 dimension: LEB128 of at most 2^48
constexpr size_t kStateBytes = kLanes * 4;
constexpr size_t kOneStateBytes = 4;

// Error codes of the decoder (0 = ok); error_message() turns them into text.
enum Status : int {
  kOk = 0,
  kErrTruncated,
  kErrMagic,
  kErrVersion,
  kErrHeader,
  kErrShape,
  kErrTable,
  kErrDirectory,
  kErrSize,
  kErrStream,
  kErrChecksum,
  kErrPadding,
};

inline const char* error_message(int status) {
  switch (status) {
    case kOk: return "ok";
    case kErrTruncated: return "blob is truncated";
    case kErrMagic: return "not a lossless bf16 blob (bad magic)";
    case kErrVersion: return "unsupported lossless blob version";
    case kErrHeader: return "corrupted header";
    case kErrShape: return "shape does not match the number of values";
    case kErrTable: return "corrupted frequency table";
    case kErrDirectory: return "corrupted chunk directory";
    case kErrSize: return "chunk sizes do not add up to the blob size";
    case kErrStream: return "corrupted entropy-coded stream";
    case kErrChecksum: return "checksum mismatch (corrupted payload)";
    case kErrPadding: return "non-zero padding (corrupted blob)";
    default: return "unknown error";
  }
}

struct ChunkEntry {
  uint32_t mode;
  uint32_t num_words;
  uint32_t num_raw;  // 6-bit raw fields (= the chunk's values other than +0.0)
  uint32_t checksum;
};

// ---- the value <-> (symbol, raw bits) split ----
EP_HD uint32_t symbol_of(uint16_t v) { return v == 0 ? uint32_t(kZeroSymbol) : uint32_t(v) >> kRawBits; }
EP_HD uint32_t raw_of(uint16_t v) { return uint32_t(v) & kRawMask; }
EP_HD uint16_t join_value(uint32_t symbol, uint32_t raw) {
  if (symbol == uint32_t(kZeroSymbol)) return 0;
  return static_cast<uint16_t>((symbol << kRawBits) | raw);
}
// Versions 2 to 6: value v's term in its chunk's checksum (value `index` of the chunk).
EP_HD uint32_t checksum_term(uint16_t v, uint32_t index) { return uint32_t(v) * (2u * index + 1u); }

// Version 7 on: the chunk checksum mixes each pair of values (u = v_2j | v_2j+1 << 16) before the
// weighted sum: m = u * kPairMix mod 2^32, mix = m ^ (m >> 16), a bijection of u32 (so, the
// weights being odd, a change within one pair always changes the sum). mix(0) = 0, so +0.0 pairs
// add nothing, as in the linear checksum.
constexpr uint32_t kPairMix = 0x9E3779B1u;  // odd (a prime), near 2^32 over the golden ratio
EP_HD bool pair_checksum(uint32_t version) { return version >= kVersion7; }
EP_HD uint32_t pair_mix(uint32_t u) {
  const uint32_t m = u * kPairMix;
  return m ^ (m >> 16);
}
EP_HD uint32_t pair_term(uint32_t u, uint32_t pair_index) { return pair_mix(u) * (2u * pair_index + 1u); }

// The checksum's part over values v[0, n), which are values [first, first + n) of a chunk (first
// even for pairs; the parts of a chunk's pieces sum to its checksum).
EP_HD uint32_t checksum_of(const uint16_t* v, uint32_t n, uint32_t first, bool pairs) {
  uint32_t sum = 0;
  if (!pairs) {
    for (uint32_t i = 0; i < n; ++i) sum += checksum_term(v[i], first + i);
    return sum;
  }
  uint32_t i = 0;
  for (; i + 2 <= n; i += 2) sum += pair_term(uint32_t(v[i]) | uint32_t(v[i + 1]) << 16, (first + i) / 2);
  if (i < n) sum += pair_term(v[i], (first + i) / 2);
  return sum;
}

EP_HD uint64_t align4(uint64_t n) { return (n + 3) & ~uint64_t(3); }

// Bytes of `num_raw` packed 6-bit fields.
EP_HD uint64_t raw_bytes(uint64_t num_raw) { return (uint64_t(kRawBits) * num_raw + 7) / 8; }

// Bytes of the final states that open a rANS chunk's payload (mode 0 or 2).
EP_HD uint64_t state_bytes(const ChunkEntry& e) { return e.mode == kModeOneState ? kOneStateBytes : kStateBytes; }

// Bytes of a chunk's payload before padding.
EP_HD uint64_t payload_bytes(const ChunkEntry& e, uint32_t n) {
  if (e.mode == kModeRaw) return 2ull * n;
  if (e.mode == kModeZero) return 0;
  if (e.mode == kModeCodedFields) return 2ull * kStateBytes + 2ull * e.num_words;  // version 6
  if (e.mode == kModeOneStateFields) return 2ull * kOneStateBytes + 2ull * e.num_words;
  return state_bytes(e) + 2ull * e.num_words + raw_bytes(e.num_raw);
}

// ---- packed 6-bit fields ----
// Eight 6-bit fields held one per byte (bits 0-5 of bytes 0-7) -> the 48-bit packed form (field k
// at bits 6k..6k+5), and back. Shift-and-mask steps: the same code on host and device.
EP_HD uint64_t pack6x8(uint64_t bytes) {
  uint64_t t = (bytes & 0x003F003F003F003Full) | ((bytes & 0x3F003F003F003F00ull) >> 2);
  t = (t & 0x00000FFF00000FFFull) | ((t & 0x0FFF00000FFF0000ull) >> 4);
  return (t & 0xFFFFFFull) | ((t >> 8) & 0xFFFFFF000000ull);
}
EP_HD uint64_t unpack6x8(uint64_t packed) {
  uint64_t t = (packed & 0xFFFFFFull) | ((packed & 0xFFFFFF000000ull) << 8);
  t = (t & 0x00000FFF00000FFFull) | ((t & 0x00FFF00000FFF000ull) << 4);
  return (t & 0x003F003F003F003Full) | ((t & 0x0FC00FC00FC00FC0ull) << 2);
}

// Appends bit fields to a byte stream, low bits first.
struct BitWriter {
  uint8_t* out;
  uint64_t acc = 0;
  uint32_t nbits = 0;
  EP_HD explicit BitWriter(uint8_t* o) : out(o) {}
  // Appends the low `n` bits of `bits` (n <= 56, higher bits of `bits` zero).
  EP_HD void put(uint64_t bits, uint32_t n) {
    acc |= bits << nbits;
    nbits += n;
    while (nbits >= 8) {
      *out++ = static_cast<uint8_t>(acc);
      acc >>= 8;
      nbits -= 8;
    }
  }
  EP_HD void finish() {
    if (nbits > 0) *out++ = static_cast<uint8_t>(acc);
    acc = 0;
    nbits = 0;
  }
};

// Field k of a packed stream of `bytes` bytes (the caller checked 6k + 6 <= 8 bytes).
EP_HD uint32_t read_raw_field(const uint8_t* raw, uint64_t bytes, uint64_t k) {
  const uint64_t bit = uint64_t(kRawBits) * k, b = bit >> 3;
  uint32_t w = raw[b];
  if (b + 1 < bytes) w |= uint32_t(raw[b + 1]) << 8;
  return (w >> (bit & 7)) & kRawMask;
}

// ---- frequency table ----
// One symbol's frequency before the corrections: its count scaled to 2^prob_bits, at least 1 when
// seen. (count < 2^48 and prob_bits <= 12: the product fits in 64 bits.)
EP_HD uint32_t scaled_frequency(uint64_t count, uint64_t total, int prob_bits = kProbBits) {
  if (count == 0) return 0;
  const uint64_t scaled = ((count << prob_bits) + total / 2) / total;
  return scaled == 0 ? 1u : static_cast<uint32_t>(scaled);
}

// One correction of normalize_counts on the most frequent symbol's frequency `f`: takes all of a
// positive `diff` (what the frequencies lack of kProbScale), or as much of a negative one as keeps
// f >= 1. Updates both.
EP_HD void correct_frequency(uint32_t& f, int64_t& diff) {
  if (diff > 0) {
    f += static_cast<uint32_t>(diff);
    diff = 0;
  } else {
    int64_t take = int64_t(f) - 1;
    if (take > -diff) take = -diff;
    f -= static_cast<uint32_t>(take);
    diff += take;
  }
}

// The symbols a table loop visits, in ascending order: every one (AllSymbols), or a list of them
// (SymbolList: those with a count, present_symbols). The table functions below skip a symbol
// without a count or frequency, so over either they give the same results; the list makes a
// host table choice visit a chunk's few dozen present symbols instead of all 1,025.
struct AllSymbols {
  EP_HD uint32_t size() const { return kNumSymbols; }
  EP_HD int operator[](uint32_t i) const { return int(i); }
};
struct SymbolList {
  const uint16_t* sym;  // ascending
  uint32_t count;
  EP_HD uint32_t size() const { return count; }
  EP_HD int operator[](uint32_t i) const { return sym[i]; }
};

// The symbols s with counts[s] != 0 of counts[1025], ascending, to sym[]; returns their number.
EP_HD uint32_t present_symbols(const uint64_t* counts, uint16_t* sym) {
  uint32_t present = 0;
  for (int s = 0; s < kNumSymbols; ++s) {
    sym[present] = static_cast<uint16_t>(s);
    present += counts[s] != 0;
  }
  return present;
}

// Scales `counts[1025]` (total > 0) to `freq[1025]` summing to 2^prob_bits, every seen symbol >= 1.
// Deterministic, so host and device builds produce the same table.
// Each frequency is scaled_frequency's, its quotient taken from a multiply by 1 / total (an
// estimate within 1 of it: the relative error of the doubles is under 2^-51 and the quotient under
// 2^13) and one integer correction each way, not from a division per symbol; the most frequent
// symbol is found in the same pass for the first correction.
// Over a SymbolList `syms` (every symbol with a count), only the listed symbols' frequencies are
// written: the others stay as they are (0 for a table: the caller zeroes them).
template <class Symbols>
EP_HD void normalize_counts_over(const Symbols& syms, const uint64_t* counts, uint64_t total, uint32_t* freq,
                                 int prob_bits) {
  const double inverse = 1.0 / double(total);
  const uint64_t half = total / 2;
  int64_t sum = 0;
  int best = syms[0];
  for (uint32_t i = 0; i < syms.size(); ++i) {
    const int s = syms[i];
    const uint64_t num = (counts[s] << prob_bits) + half;
    uint64_t q = static_cast<uint64_t>(double(num) * inverse);
    q -= uint64_t(q * total > num);
    q += uint64_t((q + 1) * total <= num);
    const uint32_t f = counts[s] == 0 ? 0u : q == 0 ? 1u : static_cast<uint32_t>(q);
    freq[s] = f;
    sum += f;
    if (f > freq[best]) best = s;
  }
  int64_t diff = int64_t(1) << prob_bits;
  diff -= sum;
  for (bool first = true; diff != 0; first = false) {  // the most frequent symbol, the lowest index on ties
    if (!first) {
      best = syms[0];
      for (uint32_t i = 1; i < syms.size(); ++i)
        if (freq[syms[i]] > freq[best]) best = syms[i];
    }
    correct_frequency(freq[best], diff);
  }
}
EP_HD void normalize_counts(const uint64_t* counts, uint64_t total, uint32_t* freq, int prob_bits = kProbBits) {
  normalize_counts_over(AllSymbols{}, counts, total, freq, prob_bits);
}

// Cumulative starts from freq[1025]; returns false when the freqs do not sum to 2^prob_bits.
EP_HD bool cumulative(const uint32_t* freq, uint32_t* start, int prob_bits = kProbBits) {
  uint32_t acc = 0;
  for (int s = 0; s < kNumSymbols; ++s) {
    start[s] = acc;
    acc += freq[s];
  }
  return acc == (1u << prob_bits);
}

// ---- version 3 tables: size, choice of prob_bits, writing and reading ----
EP_HD uint32_t table_gap_bytes(uint32_t gap) { return gap < 128 ? 1u : 2u; }
EP_HD uint32_t table_freq_bytes(uint32_t freq) { return freq <= 128 ? 1u : 2u; }

// floor(1024 log2(f)) for f in [1, 2^20], by integer squaring (the same on host and device: the
// choice of prob_bits below must be identical on both).
EP_HD uint32_t log2_q10_squaring(uint32_t f) {
  uint32_t k = 0;
  while ((f >> (k + 1)) != 0) ++k;
  uint64_t y = uint64_t(f) << (31 - k);  // f / 2^k in [1, 2) as Q31
  uint32_t r = k << 10;
  for (int bit = 9; bit >= 0; --bit) {
    y = (y * y) >> 31;
    if (y >= (1ull << 32)) {
      y >>= 1;
      r |= 1u << bit;
    }
  }
  return r;
}

// log2_q10_squaring; on the host, frequencies (at most 2^12, the cost estimates' arguments) are
// read from a table of its results, filled once: the table choices take one lookup per symbol
// instead of ten squarings.
EP_HD uint32_t log2_q10(uint32_t f) {
#if !defined(__CUDA_ARCH__)
  struct Table {
    uint32_t v[kMaxProbScale + 1];
    Table() {
      v[0] = 0;
      for (uint32_t g = 1; g <= kMaxProbScale; ++g) v[g] = log2_q10_squaring(g);
    }
  };
  static const Table table;
  if (f - 1 < kMaxProbScale) return table.v[f];
#endif
  return log2_q10_squaring(f);
}

// The estimated size, in 1/1024 bits, of the symbols of counts[1025] coded with frequencies
// freq[1025] of `prob_bits` bits, plus the frequencies' bytes in a version 3 table (the gaps cost
// the same for both choices: every seen symbol has a frequency). counts sum to < 2^48: the sum fits.
// One symbol's part of it: `count` symbols at frequency `freq` (> 0), and the frequency's bytes.
EP_HD uint64_t coded_cost_term_q10(uint64_t count, uint32_t freq, int prob_bits) {
  return count * ((uint64_t(prob_bits) << 10) - log2_q10(freq)) + (uint64_t(8 * table_freq_bytes(freq)) << 10);
}
EP_HD uint64_t coded_cost_q10(const uint64_t* counts, const uint32_t* freq, int prob_bits) {
  uint64_t cost = 0;
  for (int s = 0; s < kNumSymbols; ++s)
    if (freq[s] != 0) cost += coded_cost_term_q10(counts[s], freq[s], prob_bits);
  return cost;
}

// The margin prefer_12_bits asks of 12-bit frequencies: 64 bytes per chunk, in 1/1024 bits.
EP_HD uint64_t wide_table_margin_q10(uint64_t chunks) { return chunks * (uint64_t(64 * 8) << 10); }

// Whether 12-bit frequencies `freq12` (normalize_counts with 12 bits) can be used (every one at
// most 2048: the decoder's entries hold freq - 1 in 11 bits) and are estimated to code `chunks`
// chunks smaller than `freq11` by more than the margin (see the format notes above).
// (coded_cost_q10 of both, in one pass: a symbol has a frequency in both or in neither.)
template <class Symbols>
EP_HD bool prefer_12_bits_over(const Symbols& syms, const uint64_t* counts, const uint32_t* freq11,
                               const uint32_t* freq12, uint64_t chunks) {
  uint64_t cost11 = 0, cost12 = 0;
  for (uint32_t i = 0; i < syms.size(); ++i) {
    const int s = syms[i];
    if (freq12[s] > kProbScale) return false;
    if (freq11[s] == 0) continue;
    cost11 += coded_cost_term_q10(counts[s], freq11[s], kProbBits);
    cost12 += coded_cost_term_q10(counts[s], freq12[s], kMaxProbBits);
  }
  return cost12 + wide_table_margin_q10(chunks) < cost11;
}
EP_HD bool prefer_12_bits(const uint64_t* counts, const uint32_t* freq11, const uint32_t* freq12, uint64_t chunks) {
  return prefer_12_bits_over(AllSymbols{}, counts, freq11, freq12, chunks);
}

// Bytes of the version 3 table of freq[1025].
EP_HD uint32_t table_bytes_v3(const uint32_t* freq) {
  uint32_t bytes = 0;
  int previous = -1;
  for (int s = 0; s < kNumSymbols; ++s) {
    if (freq[s] == 0) continue;
    bytes += table_gap_bytes(uint32_t(s - previous - 1)) + table_freq_bytes(freq[s]);
    previous = s;
  }
  return bytes;
}

// Writes one version 3 table entry at p; returns the bytes written.
EP_HD uint32_t write_table_entry(uint8_t* p, uint32_t gap, uint32_t freq) {
  uint32_t k = 0;
  if (gap < 128) {
    p[k++] = static_cast<uint8_t>(gap);
  } else {
    p[k++] = static_cast<uint8_t>(0x80 | (gap >> 8));
    p[k++] = static_cast<uint8_t>(gap);
  }
  if (freq <= 128) {
    p[k++] = static_cast<uint8_t>(freq - 1);
  } else {
    p[k++] = static_cast<uint8_t>(0x80 | ((freq - 1) >> 8));
    p[k++] = static_cast<uint8_t>(freq - 1);
  }
  return k;
}

// Writes the version 3 table of freq[1025] at p (table_bytes_v3(freq) bytes).
EP_HD void write_table_v3(uint8_t* p, const uint32_t* freq) {
  int previous = -1;
  for (int s = 0; s < kNumSymbols; ++s) {
    if (freq[s] == 0) continue;
    p += write_table_entry(p, uint32_t(s - previous - 1), freq[s]);
    previous = s;
  }
}

// ---- version 4 tables: order-k Exp-Golomb codes in a bit stream ----
// A value v >= 0 in the order-k code: with q = (v >> k) + 1 = 2^m + r (r < 2^m), m zero bits, a
// one bit, r in m bits, then v's low k bits (stream bits low first, as BitWriter puts them):
// 2m + 1 + k bits. A table is one byte kg | kf << 4 (the orders of the gaps and of freq - 1), then
// per entry in ascending symbol order the gap (as in version 3) in order kg and freq - 1 in order
// kf, then zero bits to the byte's end. The encoder takes the lowest of the cheapest orders.
constexpr uint32_t kMaxGapOrder = 10;   // gaps are at most 1024
constexpr uint32_t kMaxFreqOrder = 11;  // freq - 1 is at most 2047
constexpr uint32_t kMaxCodePrefix = 11;  // m of any valid code: q <= 2048

EP_HD uint32_t eg_prefix(uint32_t v, uint32_t k) {
  const uint32_t q = (v >> k) + 1;  // >= 1: floor(log2 q) from the leading zeros
#if defined(__CUDA_ARCH__)
  return 31u - uint32_t(__clz(q));
#else
  return 31u - uint32_t(__builtin_clz(q));
#endif
}
EP_HD uint32_t eg_bits(uint32_t v, uint32_t k) { return 2 * eg_prefix(v, k) + 1 + k; }
// The code's bits (bit 0 first in the stream); eg_bits(v, k) <= 36 of them.
EP_HD uint64_t eg_code(uint32_t v, uint32_t k) {
  const uint32_t m = eg_prefix(v, k), q = (v >> k) + 1;
  const uint64_t r = q - (1u << m), low = v & ((1u << k) - 1u);
  return (uint64_t(1) << m) | (r << (m + 1)) | (low << (2 * m + 1));
}

// The bits of values v[0, count) (each below 2^24) in the order-k code. On the host, each
// prefix is read from the exponent of the float (v >> k) + 1 (exact below 2^24): a loop without
// a bit scan, which the compiler vectorises (the table choices price every order of a chunk's
// table: scalar bit scans took about half of own_table_saving_q10's time).
EP_HD uint64_t eg_bits_sum(const uint32_t* v, uint32_t count, uint32_t k) {
#if defined(__CUDA_ARCH__)
  uint64_t b = 0;
  for (uint32_t i = 0; i < count; ++i) b += eg_bits(v[i], k);
  return b;
#else
  uint32_t exponents = 0;  // 127 + prefix <= 151 a value: 32 bits hold it for 28 million values
  for (uint32_t i = 0; i < count; ++i) {
    const float q = float(int32_t((v[i] >> k) + 1));
    uint32_t u;
    std::memcpy(&u, &q, sizeof(u));
    exponents += u >> 23;
  }
  return 2 * (uint64_t(exponents) - 127ull * count) + uint64_t(count) * (1 + k);
#endif
}

// The cheapest order of the code for values v[0, count) among 0 to max_order (the lowest on ties);
// `bits` gets the values' bits in it.
EP_HD uint32_t eg_cheapest_order(const uint32_t* v, uint32_t count, uint32_t max_order, uint64_t& bits) {
  uint32_t order = 0;
  bits = ~0ull;
  for (uint32_t k = 0; k <= max_order; ++k) {
    const uint64_t b = eg_bits_sum(v, count, k);
    if (b < bits) bits = b, order = k;
  }
  return order;
}

// One table entry's code (gap, then freq - 1) and its length in bits (at most 44).
EP_HD uint64_t table_entry_code_v4(uint32_t gap, uint32_t freq, uint32_t kg, uint32_t kf, uint32_t& bits) {
  const uint32_t gbits = eg_bits(gap, kg);
  bits = gbits + eg_bits(freq - 1, kf);
  return eg_code(gap, kg) | (eg_code(freq - 1, kf) << gbits);
}

// The orders of freq[1025]'s version 4 table: the lowest of the cheapest, each on its own. The
// present entries are gathered first (into the caller's gaps[1025] and f1[1025]: device callers
// pass workspace, not local arrays), so a table of few symbols costs few steps.
EP_HD void table_orders_v4_in(const uint32_t* freq, uint32_t& kg, uint32_t& kf, uint32_t* gaps, uint32_t* f1) {
  uint32_t present = 0;
  int previous = -1;
  for (int s = 0; s < kNumSymbols; ++s) {
    if (freq[s] == 0) continue;
    gaps[present] = uint32_t(s - previous - 1);
    f1[present++] = freq[s] - 1;
    previous = s;
  }
  uint64_t gap_bits = 0, freq_bits = 0;
  kg = eg_cheapest_order(gaps, present, kMaxGapOrder, gap_bits);
  kf = eg_cheapest_order(f1, present, kMaxFreqOrder, freq_bits);
}
EP_HD void table_orders_v4(const uint32_t* freq, uint32_t& kg, uint32_t& kf) {
  uint32_t gaps[kNumSymbols], f1[kNumSymbols];
  table_orders_v4_in(freq, kg, kf, gaps, f1);
}

// Bytes of freq[1025]'s version 4 table with orders kg, kf (0 when no symbol is present).
EP_HD uint32_t table_bytes_v4(const uint32_t* freq, uint32_t kg, uint32_t kf) {
  uint64_t bits = 0;
  int previous = -1;
  for (int s = 0; s < kNumSymbols; ++s) {
    if (freq[s] == 0) continue;
    uint32_t b = 0;
    table_entry_code_v4(uint32_t(s - previous - 1), freq[s], kg, kf, b);
    bits += b;
    previous = s;
  }
  return previous < 0 ? 0u : uint32_t(1 + (bits + 7) / 8);
}

// Writes freq[1025]'s version 4 table with orders kg, kf at p (table_bytes_v4 bytes).
EP_HD void write_table_v4(uint8_t* p, const uint32_t* freq, uint32_t kg, uint32_t kf) {
  p[0] = static_cast<uint8_t>(kg | (kf << 4));
  BitWriter bits(p + 1);
  int previous = -1;
  for (int s = 0; s < kNumSymbols; ++s) {
    if (freq[s] == 0) continue;
    uint32_t n = 0;
    const uint64_t code = table_entry_code_v4(uint32_t(s - previous - 1), freq[s], kg, kf, n);
    bits.put(code, n);  // n <= 44
    previous = s;
  }
  bits.finish();
}

// Reads a bit stream of `bits` bits at p, low bits first, every read bounds-checked.
struct BitReader {
  const uint8_t* p;
  uint64_t bits;
  uint64_t pos = 0;
  EP_HD BitReader(const uint8_t* q, uint64_t b) : p(q), bits(b) {}
  // The next n <= 24 bits into v; false past the end.
  EP_HD bool get(uint32_t n, uint32_t& v) {
    if (pos + n > bits) return false;
    v = 0;
    for (uint32_t i = 0; i < n; ++i, ++pos) v |= uint32_t((p[pos >> 3] >> (pos & 7)) & 1u) << i;
    return true;
  }
  // An order-k code into v; false past the end or when its prefix is longer than any valid one.
  EP_HD bool get_eg(uint32_t k, uint32_t& v) {
    uint32_t m = 0, bit = 0;
    for (;;) {
      if (!get(1, bit)) return false;
      if (bit) break;
      if (++m > kMaxCodePrefix) return false;
    }
    uint32_t r = 0, low = 0;
    if (!get(m, r) || !get(k, low)) return false;
    v = ((((1u << m) | r) - 1u) << k) | low;
    return true;
  }
};

// The fewest probability bits choose_one_state_prob_bits tries for `present` symbols: kMinProbBits,
// or one more than log2(present) rounded up (so every symbol has at least two slots' worth; fewer
// bits were never the cheapest on the benchmark's small tensors, and trying them is slow).
EP_HD int one_state_min_prob_bits(uint32_t present) {
  int bits = 0;
  while ((1u << bits) < present) ++bits;
  return bits + 1 > kMinProbBits ? bits + 1 : kMinProbBits;
}

// The probability bits of a version 4 blob coded as one one-state chunk (counts[1025] over `total`
// > 0 values): of one_state_min_prob_bits(present) to kMaxProbBits, those whose frequencies
// (normalize_counts) are at most 2048, the one of the smallest estimated size (the symbols'
// cross-entropy under the frequencies in 1/1024 bits, by log2_q10, plus 8 << 10 per byte of the
// table, table_bytes_v4), the fewest bits on ties; 11 when none qualifies (a symbol above half the
// values among 1,025). freq[1025] gets its frequencies.
// Computed over the present symbols only (the absent ones have frequency 0 and never take a
// correction), with normalize_counts' and table_bytes_v4's results.
// scratch: u32[4 * kNumSymbols] (a GPU lane passes global memory: four local arrays of 1,025
// words would live in local memory).
EP_HD int choose_one_state_prob_bits_in(const uint64_t* counts, uint64_t total, uint32_t* freq, uint32_t* scratch) {
  uint32_t* sym = scratch;
  uint32_t* gap = scratch + kNumSymbols;
  uint32_t* trial = scratch + 2 * kNumSymbols;
  uint32_t* best_freq = scratch + 3 * kNumSymbols;
  uint32_t present = 0;
  int previous = -1;
  for (int s = 0; s < kNumSymbols; ++s) {
    if (counts[s] == 0) continue;
    sym[present] = uint32_t(s);
    gap[present++] = uint32_t(s - previous - 1);
    previous = s;
  }
  uint64_t gap_bits = 0;  // the gaps' cheapest order: the same for every prob_bits
  eg_cheapest_order(gap, present, kMaxGapOrder, gap_bits);
  uint64_t best_cost = ~0ull;
  int best = kMaxProbBits;
  for (int pb = one_state_min_prob_bits(present); pb <= kMaxProbBits; ++pb) {
    int64_t diff = int64_t(1) << pb;  // normalize_counts
    for (uint32_t i = 0; i < present; ++i) {
      trial[i] = scaled_frequency(counts[sym[i]], total, pb);
      diff -= trial[i];
    }
    while (diff != 0) {
      uint32_t top = 0;
      for (uint32_t i = 1; i < present; ++i)
        if (trial[i] > trial[top]) top = i;
      correct_frequency(trial[top], diff);
    }
    bool fits = true;
    uint64_t cost = 0, freq_bits = ~0ull;
    for (uint32_t i = 0; i < present; ++i) {
      fits = fits && trial[i] <= kProbScale;
      cost += counts[sym[i]] * ((uint64_t(pb) << 10) - log2_q10(trial[i]));
    }
    if (!fits) continue;
    for (uint32_t k = 0; k <= kMaxFreqOrder; ++k) {
      uint64_t bits = 0;
      for (uint32_t i = 0; i < present; ++i) bits += eg_bits(trial[i] - 1, k);
      freq_bits = bits < freq_bits ? bits : freq_bits;
    }
    cost += (8 * (1 + (gap_bits + freq_bits + 7) / 8)) << 10;  // table_bytes_v4
    if (cost < best_cost) {
      best_cost = cost;
      best = pb;
      for (uint32_t i = 0; i < present; ++i) best_freq[i] = trial[i];
    }
  }
  if (best_cost == ~0ull) {
    normalize_counts(counts, total, freq, kProbBits);
    return kProbBits;
  }
  for (int s = 0; s < kNumSymbols; ++s) freq[s] = 0;
  for (uint32_t i = 0; i < present; ++i) freq[sym[i]] = best_freq[i];
  return best;
}
EP_HD int choose_one_state_prob_bits(const uint64_t* counts, uint64_t total, uint32_t* freq) {
  uint32_t scratch[4 * kNumSymbols];
  return choose_one_state_prob_bits_in(counts, total, freq, scratch);
}

// ---- rANS steps (one state) ----
// High 64 bits of a 64x64-bit product.
EP_HD uint64_t mulhi64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// Encoder symbol info: start, freq and rcp = ceil(2^64 / freq) (0 for freq 1), so that
// x / freq == mulhi64(x, rcp) for every 32-bit x: the error x * (rcp * freq - 2^64) / 2^64 is
// below x * freq / 2^64 < 1 / freq.
struct EncSym {
  uint64_t rcp;
  uint64_t x_max;    // renormalise (emit 16 bits) when x >= x_max
  uint32_t start;
  uint32_t freq;
  uint32_t bypass;   // all ones for freq 1 (q = x), else 0
  uint32_t prob_bits;
};
EP_HD EncSym make_enc_sym(uint32_t start, uint32_t freq, int prob_bits = kProbBits) {
  EncSym e;
  e.start = start;
  e.freq = freq;
  e.rcp = freq <= 1 ? 0 : ~0ull / freq + 1;
  e.bypass = freq == 1 ? ~0u : 0u;
  e.x_max = uint64_t(freq) << (32 - prob_bits);  // (L >> prob_bits << 16) * freq
  e.prob_bits = uint32_t(prob_bits);
  return e;
}
// Branch-free: the renormalisation decision is data-dependent and unpredictable.
EP_HD uint32_t enc_put(uint32_t x, const EncSym& s) {
  uint32_t q = static_cast<uint32_t>(mulhi64(x, s.rcp)) + (x & s.bypass);
  return (q << s.prob_bits) + (x - q * s.freq) + s.start;
}

// Whether encoding a symbol from state x first emits a 16-bit word (enc_step's renormalisation).
EP_HD bool enc_needs_word(uint32_t x, const EncSym& s) { return uint64_t(x) >= s.x_max; }

// One rANS encode step: renormalise (write at most one 16-bit word just below `cursor`, moving it
// down only when the word is kept) and code `s`. Branch-free; the host, AVX2 and GPU coders share it.
EP_HD uint32_t enc_step(uint32_t x, const EncSym& s, uint16_t*& cursor) {
  const uint32_t need = enc_needs_word(x, s) ? 1u : 0u;
  cursor[-1] = static_cast<uint16_t>(x & 0xFFFFu);
  cursor -= need;
  x >>= need << 4;
  return enc_put(x, s);
}
// Decoder table: one packed entry per slot (2^prob_bits slots), hi10 (10 bits) << 22 |
// (freq - 1) (11 bits) << 11 | slot - start (11 bits), where hi10 is the symbol's top 10 value bits
// (0 for the +0.0 symbol, whose slots are told apart by their range [zero_start, zero_start +
// zero_freq) instead). Every frequency is at most 2048 (checked when the table is read).
struct DecodeTable {
  uint32_t entry[kMaxProbScale];
  uint32_t zero_start;
  uint32_t zero_freq;  // 0 when +0.0 does not occur
  uint32_t prob_bits;
  uint32_t slot_mask;  // 2^prob_bits - 1
};
EP_HD uint32_t dec_entry(uint32_t hi10, uint32_t freq, uint32_t bias) {
  return (hi10 << 22) | ((freq - 1) << kProbBits) | bias;
}
EP_HD uint32_t entry_hi10(uint32_t e) { return e >> 22; }
EP_HD uint32_t entry_freq(uint32_t e) { return ((e >> kProbBits) & (kProbScale - 1)) + 1; }
EP_HD uint32_t entry_bias(uint32_t e) { return e & (kProbScale - 1); }
EP_HD bool slot_is_zero(const DecodeTable& t, uint32_t slot) { return slot - t.zero_start < t.zero_freq; }
// One decode step of state x: returns the symbol, advances x (before renormalisation).
EP_HD uint32_t dec_step(uint32_t& x, const DecodeTable& t) {
  const uint32_t slot = x & t.slot_mask;
  const uint32_t e = t.entry[slot];
  x = entry_freq(e) * (x >> t.prob_bits) + entry_bias(e);
  return slot_is_zero(t, slot) ? uint32_t(kZeroSymbol) : entry_hi10(e);
}

// ---- header ----
struct Header {
  uint32_t version = kVersion4;
  uint32_t ndim = 0;
  uint32_t num_table_entries = 0;
  uint32_t prob_bits = kProbBits;
  uint32_t table_bytes = 0;  // before padding (version 5: the shared table and the extra tables)
  uint32_t num_extra_tables = 0;  // version 5's T
  uint32_t chunk_values = 0;
  uint32_t num_chunks = 0;
  uint64_t num_values = 0;
  uint64_t shape[kMaxDims] = {};
  uint64_t table_offset = 0;
  uint64_t directory_offset = 0;
  uint64_t data_offset = 0;
};

template <typename T>
EP_HD T load_le(const uint8_t* p) {
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
}
template <typename T>
EP_HD void store_le(uint8_t* p, T v) {
  memcpy(p, &v, sizeof(T));
}

EP_HD uint64_t num_chunks_for(uint64_t num_values, uint32_t chunk_values) {
  return (num_values + chunk_values - 1) / chunk_values;
}

// ---- header layout: versions 2 and 3 (32 bytes, u64 dimensions), version 4 (20 bytes, LEB128
// dimensions: 7 bits a byte, low first, the high bit set on every byte but the last, shortest form)
// Whether format `version` has version 4's 20-byte header and LEB128 dimensions (4 and 5).
EP_HD bool compact_header(uint32_t version) { return version >= kVersion4; }
// Whether format `version` has version 5's extra tables (5 and 6).
EP_HD bool extra_tables_format(uint32_t version) { return version >= kVersion5; }
// The most values a one-state chunk (mode 2, a blob's only chunk) may hold: kOneStateMaxValues in
// version 4; in version 5 a quarter of chunk_values, clamped to [kOneStateMaxValues,
// kOneStateMaxValuesV5]. One state saves 124 state bytes but decodes serially (one GPU lane), so a
// caller that picks small chunks for parallel decoding (the transport's 8192 on a GPU) keeps
// version 4's limit; with the default 65536 it is 16384.
EP_HD uint32_t one_state_max_values(uint32_t version, uint32_t chunk_values) {
  if (version < kVersion5) return kOneStateMaxValues;
  const uint32_t quarter = chunk_values / 4;
  return quarter < kOneStateMaxValues ? kOneStateMaxValues : quarter > kOneStateMaxValuesV5 ? kOneStateMaxValuesV5 : quarter;
}
EP_HD uint64_t header_bytes(uint32_t version) { return compact_header(version) ? kHeaderBytesV4 : kHeaderBytes; }
EP_HD uint64_t meta_checksum_offset(uint32_t version) {
  return compact_header(version) ? kMetaChecksumOffsetV4 : kMetaChecksumOffset;
}
EP_HD uint32_t dim_bytes_v4(uint64_t d) {
  uint32_t b = 1;
  while (d >= 128) d >>= 7, ++b;
  return b;
}
// Bytes of a shape of `ndim` dimensions in format `version`.
EP_HD uint64_t shape_bytes(const uint64_t* dims, uint32_t ndim, uint32_t version) {
  if (!compact_header(version)) return 8ull * ndim;
  uint64_t b = 0;
  for (uint32_t d = 0; d < ndim; ++d) b += dim_bytes_v4(dims[d]);
  return b;
}
// Writes the shape after the header (shape_bytes bytes).
EP_HD void store_shape(uint8_t* o, const uint64_t* dims, uint32_t ndim, uint32_t version) {
  uint8_t* p = o + header_bytes(version);
  for (uint32_t d = 0; d < ndim; ++d) {
    if (!compact_header(version)) {
      store_le<uint64_t>(p, dims[d]);
      p += 8;
      continue;
    }
    uint64_t v = dims[d];
    while (v >= 128) {
      *p++ = static_cast<uint8_t>(0x80 | (v & 0x7F));
      v >>= 7;
    }
    *p++ = static_cast<uint8_t>(v);
  }
}

// The most bytes header and shape take (version 2's and 3's 8 bytes a dimension).
EP_HD uint64_t table_offset_for(uint32_t ndim) { return kHeaderBytes + 8ull * ndim; }
// (table_offset: the header's and shape's bytes; table_bytes: the table's size before padding)
EP_HD uint64_t directory_offset_at(uint64_t table_offset, uint32_t table_bytes) {
  return align4(table_offset + table_bytes);
}
EP_HD uint64_t data_offset_at(uint64_t table_offset, uint32_t table_bytes, uint32_t chunks) {
  return directory_offset_at(table_offset, table_bytes) + sizeof(ChunkEntry) * uint64_t(chunks);
}
// Upper bounds (the layout of versions 2 and 3), for sizing outputs.
EP_HD uint64_t directory_offset_for(uint32_t ndim, uint32_t table_bytes) {
  return directory_offset_at(table_offset_for(ndim), table_bytes);
}
EP_HD uint64_t data_offset_for(uint32_t ndim, uint32_t table_bytes, uint32_t chunks) {
  return directory_offset_for(ndim, table_bytes) + sizeof(ChunkEntry) * uint64_t(chunks);
}

// The fixed header fields: magic, version, ndim, table entries, chunk size, (versions 2 and 3:
// chunk count and value count), and the word after the metadata checksum (the checksum itself
// comes last): versions 3's to 5's prob_bits, (version 5) extra table count and table bytes,
// version 2's zero.
EP_HD void store_header(uint8_t* o, uint32_t ndim, uint32_t entries, uint32_t chunk_values, uint32_t chunks,
                        uint64_t num_values, uint32_t prob_bits = kProbBits, uint32_t table_bytes = 0,
                        uint32_t version = kVersion4, uint32_t extra_tables = 0) {
  store_le<uint32_t>(o, kMagic);
  o[4] = static_cast<uint8_t>(version);
  o[5] = static_cast<uint8_t>(ndim);
  store_le<uint16_t>(o + 6, static_cast<uint16_t>(entries));
  store_le<uint32_t>(o + 8, chunk_values);
  if (!compact_header(version)) {
    store_le<uint32_t>(o + 12, chunks);
    store_le<uint64_t>(o + 16, num_values);
  }
  const uint32_t last = version == kOldVersion ? 0u : prob_bits | (extra_tables << 8) | (table_bytes << 16);
  store_le<uint32_t>(o + meta_checksum_offset(version) + 4, last);
}

// Checksum of the header, shape and table (bytes [0, end) but the checksum field itself, at
// meta_checksum_offset(version)).
EP_HD uint32_t meta_checksum(const uint8_t* blob, uint64_t end, uint32_t version) {
  const uint64_t at = meta_checksum_offset(version);
  uint32_t sum = 0;
  for (uint64_t i = 0; i < end; ++i)
    if (i < at || i >= at + 4) sum += uint32_t(blob[i]) * uint32_t(2 * i + 1);
  return sum;
}

// The checks of parse_header that read fixed fields: header, shape, and that table and directory
// fit (not the table padding and the metadata checksum, which read every metadata byte). Reads
// only bytes below min(size, readable) (readable: how much of the blob the caller holds).
// newest_version: the newest format the caller decodes (a newer one is kErrVersion): kNewestVersion
// for the host and CUDA decoders.
EP_HD int parse_header_fields(const uint8_t* blob, uint64_t size, Header& h, uint64_t readable = ~0ull,
                              uint32_t newest_version = kVersion4) {
  if (readable > size) readable = size;
  if (readable < kHeaderBytesV4) return kErrTruncated;
  if (load_le<uint32_t>(blob) != kMagic) return kErrMagic;
  if (blob[4] != kVersion4 && blob[4] != kVersion3 && blob[4] != kOldVersion &&
      !(blob[4] >= kVersion5 && blob[4] <= kNewestVersion && newest_version >= blob[4]))
    return kErrVersion;
  h.version = blob[4];
  if (readable < header_bytes(h.version)) return kErrTruncated;
  h.ndim = blob[5];
  h.num_table_entries = load_le<uint16_t>(blob + 6);
  h.chunk_values = load_le<uint32_t>(blob + 8);
  h.num_extra_tables = 0;
  if (!compact_header(h.version)) {
    h.num_chunks = load_le<uint32_t>(blob + 12);
    h.num_values = load_le<uint64_t>(blob + 16);
  }
  const uint32_t last = load_le<uint32_t>(blob + meta_checksum_offset(h.version) + 4);
  if (h.version == kOldVersion) {
    if (last != 0) return kErrHeader;
    h.prob_bits = kProbBits;
    h.table_bytes = 4 * h.num_table_entries;
  } else {
    h.prob_bits = last & 0xFF;
    h.table_bytes = last >> 16;
    const bool bits_ok = h.version == kVersion3
                             ? h.prob_bits == uint32_t(kProbBits) || h.prob_bits == uint32_t(kMaxProbBits)
                             : h.prob_bits >= uint32_t(kMinProbBits) && h.prob_bits <= uint32_t(kMaxProbBits);
    if (extra_tables_format(h.version)) h.num_extra_tables = (last >> 8) & 0xFF;
    else if (((last >> 8) & 0xFF) != 0) return kErrHeader;
    if (!bits_ok) return kErrHeader;
    if (h.version == kVersion3) {
      // every entry takes 2 to 4 bytes
      if (h.table_bytes < 2 * h.num_table_entries || h.table_bytes > 4 * h.num_table_entries) return kErrTable;
    } else if ((h.table_bytes == 0) != (h.num_table_entries == 0) ||
               (h.version == kVersion4 && h.table_bytes > kMaxTableBytes)) {
      return kErrTable;  // versions 4 and 5: the orders' byte and at least 2 bits an entry
    }
    // version 5: extra tables only beside a shared table
    if (h.num_extra_tables > 0 && h.num_table_entries == 0) return kErrTable;
  }
  if (h.ndim > kMaxDims) return kErrHeader;
  if (h.chunk_values < kMinChunkValues || h.chunk_values > kMaxChunkValues || h.chunk_values % kLanes != 0)
    return kErrHeader;
  if (h.num_table_entries > kNumSymbols) return kErrTable;
  if (!compact_header(h.version)) {
    if (h.num_values > kMaxValues) return kErrHeader;
    if (num_chunks_for(h.num_values, h.chunk_values) != h.num_chunks) return kErrHeader;
    // no table: an empty tensor, or every chunk stored raw
    if (h.num_values == 0 && h.num_table_entries != 0) return kErrTable;
  }
  uint64_t at = header_bytes(h.version), product = 1;
  for (uint32_t d = 0; d < h.ndim; ++d) {
    if (!compact_header(h.version)) {
      if (readable < at + 8) return kErrTruncated;
      h.shape[d] = load_le<uint64_t>(blob + at);
      at += 8;
    } else {  // LEB128, shortest form, at most kMaxDimBytes bytes
      uint64_t v = 0;
      for (uint32_t k = 0;; ++k) {
        if (k == kMaxDimBytes) return kErrShape;
        if (readable < at + 1) return kErrTruncated;
        const uint8_t byte = blob[at++];
        v |= uint64_t(byte & 0x7F) << (7 * k);
        if ((byte & 0x80) == 0) {
          if (k > 0 && byte == 0) return kErrShape;
          break;
        }
      }
      h.shape[d] = v;
    }
    if (h.shape[d] > kMaxValues) return kErrShape;
    // checked before multiplying, so the product cannot wrap around
    if (h.shape[d] != 0 && product > kMaxValues / h.shape[d]) return kErrShape;
    product = product * h.shape[d];
  }
  if (compact_header(h.version)) {
    h.num_values = product;
    const uint64_t chunks = num_chunks_for(product, h.chunk_values);
    if (chunks > 0xFFFFFFFFull) return kErrHeader;
    h.num_chunks = static_cast<uint32_t>(chunks);
    if (h.num_values == 0 && h.num_table_entries != 0) return kErrTable;
    if (h.num_extra_tables > h.num_chunks) return kErrTable;  // version 5: each used by a chunk
  }
  if (product != h.num_values) return kErrShape;
  h.table_offset = at;
  h.directory_offset = directory_offset_at(h.table_offset, h.table_bytes);
  h.data_offset = data_offset_at(h.table_offset, h.table_bytes, h.num_chunks);
  if (size < h.data_offset) return kErrTruncated;
  return kOk;
}

// Parses and validates the fixed header, the shape, that table and directory fit, the table's
// zero padding and the metadata checksum (newest_version as in parse_header_fields).
EP_HD int parse_header(const uint8_t* blob, uint64_t size, Header& h, uint32_t newest_version = kVersion4) {
  const int st = parse_header_fields(blob, size, h, ~0ull, newest_version);
  if (st != kOk) return st;
  for (uint64_t p = h.table_offset + h.table_bytes; p < h.directory_offset; ++p)
    if (blob[p] != 0) return kErrPadding;
  if (meta_checksum(blob, h.directory_offset, h.version) != load_le<uint32_t>(blob + meta_checksum_offset(h.version)))
    return kErrHeader;
  return kOk;
}

// Reads a version 3 table (h.table_bytes bytes at `p`, inside the blob) into freq[1025]: every
// entry in its shortest form, symbols below 1025, frequencies in [1, 2048], no byte left over
// (the sum is checked by the caller).
EP_HD int read_table_v3(const uint8_t* p, const Header& h, uint32_t* freq) {
  uint32_t k = 0;
  int previous = -1;
  for (uint32_t i = 0; i < h.num_table_entries; ++i) {
    if (k + 2 > h.table_bytes) return kErrTable;
    uint32_t gap = p[k++];
    if (gap & 0x80) {
      if (k + 2 > h.table_bytes || gap > 0x84) return kErrTable;
      gap = ((gap & 0x7F) << 8) | p[k++];
      if (gap < 128) return kErrTable;
    }
    uint32_t f = p[k++];
    if (f & 0x80) {
      if (k + 1 > h.table_bytes || f > 0x87) return kErrTable;
      f = (((f & 0x7F) << 8) | p[k++]) + 1;
      if (f <= 128) return kErrTable;
    } else {
      f += 1;
    }
    const int sym = previous + 1 + int(gap);
    if (sym >= kNumSymbols) return kErrTable;
    freq[sym] = f;
    previous = sym;
  }
  return k == h.table_bytes ? int(kOk) : int(kErrTable);
}

// Reads the entries of a table in version 4's encoding at p (at most `avail` >= 1 bytes readable)
// into freq[1025] (zero where no entry): `entries` entries, or, with entries = 0 (version 5's
// extra tables), entries until the frequencies sum to 2^prob_bits (a sum passing it is an error);
// orders in range, symbols below 1025, frequencies in [1, 2048]. `used` gets the table's bytes:
// the orders' byte and the stream up to the byte holding its last entry's last bit, whose bits
// after that entry must be zero.
EP_HD int read_table_v4_prefix(const uint8_t* p, uint64_t avail, uint32_t entries, uint32_t prob_bits, uint32_t* freq,
                               uint64_t& used) {
  const uint32_t kg = p[0] & 0xFu, kf = p[0] >> 4;
  if (kg > kMaxGapOrder || kf > kMaxFreqOrder) return kErrTable;
  BitReader bits(p + 1, 8ull * (avail - 1));
  const uint32_t total = 1u << prob_bits;
  uint32_t sum = 0;
  int previous = -1;
  for (uint32_t i = 0; entries == 0 ? sum < total : i < entries; ++i) {
    uint32_t gap = 0, f1 = 0;
    if (!bits.get_eg(kg, gap) || !bits.get_eg(kf, f1)) return kErrTable;
    if (gap >= uint32_t(kNumSymbols) || f1 >= kProbScale) return kErrTable;
    const int sym = previous + 1 + int(gap);
    if (sym >= kNumSymbols) return kErrTable;
    freq[sym] = f1 + 1;
    sum += f1 + 1;
    if (entries == 0 && sum > total) return kErrTable;
    previous = sym;
  }
  used = 1 + (bits.pos + 7) / 8;
  uint32_t rest = 0;
  if (!bits.get(uint32_t(8 * (used - 1) - bits.pos), rest) || rest != 0) return kErrTable;
  return kOk;
}

// Reads a version 4 table (h.table_bytes bytes at `p`, inside the blob) into freq[1025]: orders in
// range, symbols below 1025, frequencies in [1, 2048], the bits after the last entry zero and
// fewer than 8 (the sum is checked by the caller).
EP_HD int read_table_v4(const uint8_t* p, const Header& h, uint32_t* freq) {
  if (h.num_table_entries == 0) return h.table_bytes == 0 ? int(kOk) : int(kErrTable);
  uint64_t used = 0;
  const int st = read_table_v4_prefix(p, h.table_bytes, h.num_table_entries, h.prob_bits, freq, used);
  if (st != kOk) return st;
  return used == h.table_bytes ? int(kOk) : int(kErrTable);
}

// ---- version 5: extra tables ----
// Where a version 5 extra table lies in its blob: the table's bytes (version 4's encoding) at
// `offset`, `bytes` of them, with 2^prob_bits slots.
struct ExtraTable {
  uint64_t offset;
  uint32_t bytes;
  uint32_t prob_bits;
};

// LEB128 of v: its bytes (at most 3 for v < 2^21).
EP_HD uint32_t leb128_bytes(uint64_t v) { return dim_bytes_v4(v); }
// Writes v in LEB128 at p; returns the bytes written.
EP_HD uint32_t store_leb128(uint8_t* p, uint64_t v) {
  uint32_t k = 0;
  while (v >= 128) {
    p[k++] = static_cast<uint8_t>(0x80 | (v & 0x7F));
    v >>= 7;
  }
  p[k++] = static_cast<uint8_t>(v);
  return k;
}

// Bytes of one extra table's framing and table (version 5): prob_bits, LEB128 length, the table.
EP_HD uint32_t extra_table_bytes(uint32_t table_bytes) { return 1 + leb128_bytes(table_bytes) + table_bytes; }

// Version 5: the framing of the h.num_extra_tables extra tables, which follow the shared table's
// `shared_bytes` bytes and end the table section (h.table_bytes bytes in all): per table one byte
// prob_bits (11 or 12), its length L >= 1 in LEB128 (shortest form, at most 2 bytes), L bytes.
// refs[k] gets extra table k's place; the tables must fill the section exactly. (No table's
// contents are read here: read_extra_table reads one.)
EP_HD int read_extra_table_refs(const uint8_t* blob, const Header& h, uint64_t shared_bytes, ExtraTable* refs) {
  uint64_t at = h.table_offset + shared_bytes;
  const uint64_t end = h.table_offset + h.table_bytes;
  for (uint32_t k = 0; k < h.num_extra_tables; ++k) {
    if (at + 2 > end) return kErrTable;
    const uint32_t prob_bits = blob[at++];
    if (prob_bits != uint32_t(kProbBits) && prob_bits != uint32_t(kMaxProbBits)) return kErrTable;
    uint32_t length = blob[at++];
    if (length & 0x80) {
      if (at + 1 > end || blob[at] == 0 || (blob[at] & 0x80)) return kErrTable;
      length = (length & 0x7F) | (uint32_t(blob[at++]) << 7);
    }
    if (length == 0 || at + length > end) return kErrTable;
    refs[k] = ExtraTable{at, length, prob_bits};
    at += length;
  }
  return at == end ? int(kOk) : int(kErrTable);
}

// Reads a table in version 4's encoding of exactly `bytes` bytes at p, its entries running until
// the frequencies sum to 2^prob_bits, into freq[1025] / start[1025] (version 5's extra tables,
// version 6's field tables).
EP_HD int read_sized_table(const uint8_t* p, uint64_t bytes, uint32_t prob_bits, uint32_t* freq, uint32_t* start) {
  for (int s = 0; s < kNumSymbols; ++s) freq[s] = start[s] = 0;
  uint64_t used = 0;
  const int st = read_table_v4_prefix(p, bytes, 0, prob_bits, freq, used);
  if (st != kOk) return st;
  if (used != bytes) return kErrTable;
  return cumulative(freq, start, int(prob_bits)) ? int(kOk) : int(kErrTable);
}

// Reads extra table `ref` into freq[1025] / start[1025]: exactly its bytes, frequencies summing to
// 2^prob_bits.
EP_HD int read_extra_table(const uint8_t* blob, const ExtraTable& ref, uint32_t* freq, uint32_t* start) {
  return read_sized_table(blob + ref.offset, ref.bytes, ref.prob_bits, freq, start);
}

// Reads the (shared) table into freq[1025] / start[1025]; validates order and sum. Version 5:
// shared_bytes gets the shared table's bytes (the extra tables follow; without any, the table
// fills the section).
EP_HD int read_table(const uint8_t* blob, const Header& h, uint32_t* freq, uint32_t* start,
                     uint64_t* shared_bytes = nullptr) {
  for (int s = 0; s < kNumSymbols; ++s) freq[s] = start[s] = 0;
  if (shared_bytes != nullptr) *shared_bytes = h.table_bytes;
  if (extra_tables_format(h.version) && h.num_table_entries > 0) {
    uint64_t used = 0;
    const int st = read_table_v4_prefix(blob + h.table_offset, h.table_bytes, h.num_table_entries, h.prob_bits, freq,
                                        used);
    if (st != kOk) return st;
    if (h.num_extra_tables == 0 ? used != h.table_bytes : used >= h.table_bytes) return kErrTable;
    if (shared_bytes != nullptr) *shared_bytes = used;
    return cumulative(freq, start, int(h.prob_bits)) ? int(kOk) : int(kErrTable);
  }
  if (h.version != kOldVersion) {
    const int st = h.version == kVersion3 ? read_table_v3(blob + h.table_offset, h, freq)
                                          : read_table_v4(blob + h.table_offset, h, freq);
    if (st != kOk) return st;
    if (h.num_table_entries == 0) return kOk;
    return cumulative(freq, start, int(h.prob_bits)) ? int(kOk) : int(kErrTable);
  }
  int previous = -1;
  for (uint32_t i = 0; i < h.num_table_entries; ++i) {
    const uint8_t* p = blob + h.table_offset + 4ull * i;
    uint32_t sym = load_le<uint16_t>(p);
    uint32_t f = load_le<uint16_t>(p + 2);
    if (int(sym) <= previous || sym >= uint32_t(kNumSymbols) || f == 0 || f > kProbScale)
      return kErrTable;
    previous = int(sym);
    freq[sym] = f;
  }
  if (h.num_table_entries == 0) return kOk;
  return cumulative(freq, start) ? int(kOk) : int(kErrTable);
}

// A version 5 directory entry's table: 0 = the blob's shared table, k >= 1 = extra table k - 1
// (0 in older versions, whose mode words check_entry limits to the modes).
EP_HD uint32_t entry_table(const ChunkEntry& e) { return (e.mode >> 8) & 0xFFu; }

// Validates a chunk's directory entry (n = its value count) against the blob's header. Version
// 5: bits 8-15 of the mode word are the chunk's table (at most h.num_extra_tables; other than 0
// only for mode 0), bits 16-31 zero.
EP_HD int check_entry(const Header& h, const ChunkEntry& entry, uint32_t n) {
  ChunkEntry e = entry;
  uint32_t table = 0;
  if (extra_tables_format(h.version)) {
    if ((e.mode >> 16) != 0) return kErrDirectory;
    table = entry_table(e);
    e.mode &= kModeMask;
    const bool coded_fields = e.mode == kModeCodedFields && h.version >= kVersion6;
    if (table > h.num_extra_tables || (table != 0 && e.mode != kModeRans && !coded_fields)) return kErrDirectory;
    // version 6's modes 4 and 5 (mode 0 and mode 2 with coded fields): num_words counts the field
    // header's, the symbols' and the fields' words (lossless_fields.h), num_raw >= 1 the fields;
    // mode 5 where mode 2 may be (a blob's only chunk, up to one_state_max_values)
    const bool one_state_fields = e.mode == kModeOneStateFields && h.version >= kVersion6;
    if (coded_fields || one_state_fields)
      return h.num_table_entries > 0 && e.num_raw >= 1 && e.num_raw <= n && e.num_words >= kFieldHeaderBytes / 2 &&
                     e.num_words <= 2ull * n + (kFieldHeaderBytes + kMaxFieldTableBytes) / 2 &&
                     (coded_fields ? table != 0 || h.prob_bits >= uint32_t(kProbBits)
                                   : h.num_chunks == 1 && n <= one_state_max_values(h.version, h.chunk_values))
                 ? int(kOk)
                 : int(kErrDirectory);
  }
  if (e.mode == kModeRaw) return (e.num_words == 0 && e.num_raw == 0) ? int(kOk) : int(kErrDirectory);
  if (e.mode == kModeZero)  // versions 4 and 5; all +0.0: no fields, checksum 0
    return (compact_header(h.version) && e.num_words == 0 && e.num_raw == 0 && e.checksum == 0) ? int(kOk)
                                                                                                : int(kErrDirectory);
  if (e.mode == kModeOneState && (!compact_header(h.version) || n > one_state_max_values(h.version, h.chunk_values)))
    return kErrDirectory;
  if ((e.mode != kModeRans && e.mode != kModeOneState) || h.num_table_entries == 0) return kErrDirectory;
  // 32-state chunks: 11 or 12 probability bits (the SIMD decoders' constants; an extra table has
  // them); fewer: one-state only
  if (e.mode == kModeRans && table == 0 && h.prob_bits < uint32_t(kProbBits)) return kErrDirectory;
  if (e.num_words > n || e.num_raw > n) return kErrDirectory;
  return kOk;
}

EP_HD uint32_t chunk_count(const Header& h, uint64_t c) {
  uint64_t begin = c * h.chunk_values;
  uint64_t left = h.num_values - begin;
  return static_cast<uint32_t>(left < h.chunk_values ? left : h.chunk_values);
}

EP_HD ChunkEntry read_entry(const uint8_t* blob, const Header& h, uint64_t c) {
  const uint8_t* p = blob + h.directory_offset + sizeof(ChunkEntry) * c;
  ChunkEntry e;
  e.mode = load_le<uint32_t>(p);
  e.num_words = load_le<uint32_t>(p + 4);
  e.num_raw = load_le<uint32_t>(p + 8);
  e.checksum = load_le<uint32_t>(p + 12);
  return e;
}

// Walks a blob's chunk directory (host side; the CUDA decoder checks it in parallel): checks each
// entry (check_entry) and that the padded payloads account for exactly the blob's `size` bytes;
// returns the first failure in chunk order (kErrSize when the payloads overrun or fall short),
// then (version 5) kErrTable when an extra table is no chunk's. When given, entries[c] gets chunk
// c's entry (its mode without version 5's table bits), tables[c] its table (entry_table) and
// offsets[c] / offsets[c + 1] its payload's start and padded end (offsets[0] = data_offset).
EP_HD int read_directory(const uint8_t* blob, uint64_t size, const Header& h, ChunkEntry* entries, uint64_t* offsets,
                         uint32_t* tables = nullptr) {
  uint64_t offset = h.data_offset;
  uint32_t used[(kMaxExtraTables + 1) / 32] = {};  // bit k: extra table k + 1 has a chunk
  if (offsets != nullptr) offsets[0] = offset;
  for (uint64_t c = 0; c < h.num_chunks; ++c) {
    const uint32_t n = chunk_count(h, c);
    ChunkEntry e = read_entry(blob, h, c);
    const int st = check_entry(h, e, n);
    if (st != kOk) return st;
    const uint32_t table = entry_table(e);
    e.mode &= kModeMask;
    if (table != 0) used[(table - 1) / 32] |= 1u << ((table - 1) % 32);
    offset += align4(payload_bytes(e, n));
    if (offset > size) return kErrSize;
    if (entries != nullptr) entries[c] = e;
    if (tables != nullptr) tables[c] = table;
    if (offsets != nullptr) offsets[c + 1] = offset;
  }
  if (offset != size) return kErrSize;
  for (uint32_t k = 0; k < h.num_extra_tables; ++k)
    if (((used[k / 32] >> (k % 32)) & 1u) == 0) return kErrTable;
  return kOk;
}

// Largest blob `encode` can produce for `num_values` values in `ndim` dims (worst case: every
// chunk raw, every symbol in the table, in either version).
EP_HD uint64_t max_blob_bytes(uint64_t num_values, uint32_t ndim, uint32_t chunk_values) {
  uint64_t chunks = num_chunks_for(num_values, chunk_values);
  return data_offset_for(ndim, kMaxTableBytes, static_cast<uint32_t>(chunks)) + 2 * num_values + 4 * chunks;
}

// ---- single-chunk coding, sequential form (host; also a reference for the warp kernels) ----

// The split pass of a chunk: returns its checksum (pairs: version 7's) and writes the raw fields
// of values v[0, n) (packed, raw_bytes(count) bytes) to `raw`, their count to num_raw. `raw`
// needs n bytes.
EP_HD uint32_t split_chunk(const uint16_t* v, uint32_t n, uint8_t* raw, uint32_t& num_raw, bool pairs) {
  uint32_t nr = 0;
  BitWriter bits(raw);
  for (uint32_t i = 0; i < n; ++i) {
    const uint16_t x = v[i];
    if (x != 0) {
      bits.put(raw_of(x), kRawBits);
      ++nr;
    }
  }
  bits.finish();
  num_raw = nr;
  return checksum_of(v, n, 0, pairs);
}

// The rANS pass of a chunk: codes the symbols of v[0, n) with the blob's table, writing words
// backwards below words_end (room for n words); returns the number of words; `states` gets the
// 32 final states.
EP_HD uint32_t rans_encode_chunk(const uint16_t* v, uint32_t n, const EncSym* syms, uint32_t* states,
                                 uint16_t* words_end) {
  for (int l = 0; l < kLanes; ++l) states[l] = kStateLow;
  uint16_t* cursor = words_end;
  const uint32_t steps = (n + kLanes - 1) / kLanes;
  for (uint32_t t = steps; t-- > 0;) {
    const int top = n - t * kLanes < uint32_t(kLanes) ? int(n - t * kLanes) : kLanes;
    for (int l = top - 1; l >= 0; --l) {
      // cursor[-1] is always inside the n-word area: at most one word per value coded so far
      states[l] = enc_step(states[l], syms[symbol_of(v[t * kLanes + uint32_t(l)])], cursor);
    }
  }
  return static_cast<uint32_t>(words_end - cursor);
}

// The start of a SIMD rANS pass: every state at kStateLow, then the values past the chunk's last
// full step of 32 (the partial top step: coding runs backwards) coded here; returns the number of
// full steps, which the SIMD pass codes from `cursor` on.
EP_HD uint32_t rans_encode_partial_step(const uint16_t* v, uint32_t n, const EncSym* syms, uint32_t* states,
                                        uint16_t*& cursor) {
  for (int l = 0; l < kLanes; ++l) states[l] = kStateLow;
  const uint32_t full_steps = n / kLanes;
  for (int l = int(n - full_steps * kLanes) - 1; l >= 0; --l)
    states[l] = enc_step(states[l], syms[symbol_of(v[full_steps * kLanes + uint32_t(l)])], cursor);
  return full_steps;
}

// Encodes chunk values v[0, n): words backwards ending at words_end (room for n words), raw
// fields forward to `raw` (room for n bytes), final states to `states`. Fills `e`.
EP_HD void encode_chunk(const uint16_t* v, uint32_t n, const EncSym* syms, uint32_t* states,
                        uint16_t* words_end, uint8_t* raw, ChunkEntry& e, bool pairs) {
  e.mode = kModeRans;
  e.checksum = split_chunk(v, n, raw, e.num_raw, pairs);
  e.num_words = rans_encode_chunk(v, n, syms, states, words_end);
}

// Builds the decoder's table from freq[1025] / start[1025] (summing to 2^prob_bits).
EP_HD void build_decode_table(const uint32_t* freq, const uint32_t* start, DecodeTable& t, int prob_bits = kProbBits) {
  t.prob_bits = uint32_t(prob_bits);
  t.slot_mask = (1u << prob_bits) - 1;
  for (int s = 0; s < kNumSymbols; ++s) {
    const uint32_t hi10 = s == kZeroSymbol ? 0u : uint32_t(s);
    for (uint32_t k = 0; k < freq[s]; ++k) t.entry[start[s] + k] = dec_entry(hi10, freq[s], k);
  }
  t.zero_start = start[kZeroSymbol];
  t.zero_freq = freq[kZeroSymbol];
}

// Loads a chunk's initial states; false if one is out of range.
EP_HD bool load_states(const uint8_t* payload, uint32_t* states) {
  bool ok = true;
  for (int l = 0; l < kLanes; ++l) {
    states[l] = load_le<uint32_t>(payload + 4 * l);
    ok = ok && states[l] >= kStateLow;
  }
  return ok;
}

// The unused high bits of a rANS chunk's last raw byte are zero.
EP_HD bool raw_tail_zero(const uint8_t* payload, const ChunkEntry& e) {
  const uint64_t bits = uint64_t(kRawBits) * e.num_raw;
  return bits % 8 == 0 || (payload[state_bytes(e) + 2ull * e.num_words + bits / 8] >> (bits % 8)) == 0;
}

// Checks run after a chunk's values are decoded: every word and raw field consumed, states back
// at their initial value, the unused bits of the last raw byte zero, and the checksum (pairs:
// version 7's). verify_checksum = false leaves the checksum (the last check) to the caller: the
// host's SIMD decoders compute it with vector instructions.
EP_HD int finish_chunk(const uint8_t* payload, const ChunkEntry& e, uint32_t n, const uint16_t* out,
                       const uint32_t* states, uint32_t wpos, uint32_t rpos, bool pairs, bool verify_checksum = true) {
  if (wpos != e.num_words || rpos != e.num_raw) return kErrStream;
  for (int l = 0; l < kLanes; ++l)
    if (states[l] != kStateLow) return kErrStream;
  if (!raw_tail_zero(payload, e)) return kErrPadding;
  if (!verify_checksum) return kOk;
  return checksum_of(out, n, 0, pairs) == e.checksum ? int(kOk) : int(kErrChecksum);
}

// Decodes steps [t0, end) of a chunk whose first t0 steps are done (states, wpos, rpos describe
// that point), then runs every end-of-chunk check. `payload` holds payload_bytes(e, n) bytes
// (bounds-checked by the caller); every read below is checked against the chunk's counts.
// Host SIMD decoders hand over here.
EP_HD int decode_chunk_from(const uint8_t* payload, const ChunkEntry& e, uint32_t n, const DecodeTable& table,
                            uint16_t* out, uint32_t* states, uint32_t t0, uint32_t wpos, uint32_t rpos,
                            bool pairs, bool verify_checksum = true) {
  const uint8_t* words = payload + kStateBytes;
  const uint8_t* raw = words + 2ull * e.num_words;
  const uint64_t nraw_bytes = raw_bytes(e.num_raw);
  const uint32_t steps = (n + kLanes - 1) / kLanes;
  for (uint32_t t = t0; t < steps; ++t) {
    const uint32_t base = t * kLanes;
    const int lanes = n - base < uint32_t(kLanes) ? int(n - base) : kLanes;
    for (int l = 0; l < lanes; ++l) {
      uint32_t x = states[l];
      const uint32_t s = dec_step(x, table);
      if (x < kStateLow) {
        if (wpos >= e.num_words) return kErrStream;
        x = (x << 16) | load_le<uint16_t>(words + 2ull * wpos);
        ++wpos;
      }
      states[l] = x;
      uint32_t r = 0;
      if (s != uint32_t(kZeroSymbol)) {
        if (rpos >= e.num_raw) return kErrStream;
        r = read_raw_field(raw, nraw_bytes, rpos++);
      }
      out[base + l] = join_value(s, r);
    }
  }
  return finish_chunk(payload, e, n, out, states, wpos, rpos, pairs, verify_checksum);
}

EP_HD int decode_chunk(const uint8_t* payload, const ChunkEntry& e, uint32_t n, const DecodeTable& table,
                       uint16_t* out, bool pairs) {
  uint32_t states[kLanes];
  if (!load_states(payload, states)) return kErrStream;
  return decode_chunk_from(payload, e, n, table, out, states, 0, 0, 0, pairs);
}

// ---- one-state chunks (mode 2, version 4): the chunk's values coded in order by one rANS state ----

// Codes the symbols of v[0, n) with one state, last value first, writing words backwards below
// words_end (room for n words); returns the number of words; `state` gets the final state.
EP_HD uint32_t rans_encode_one_state(const uint16_t* v, uint32_t n, const EncSym* syms, uint32_t& state,
                                     uint16_t* words_end) {
  uint32_t x = kStateLow;
  uint16_t* cursor = words_end;
  for (uint32_t i = n; i-- > 0;) x = enc_step(x, syms[symbol_of(v[i])], cursor);
  state = x;
  return static_cast<uint32_t>(words_end - cursor);
}

// Decodes a mode 2 chunk (payload_bytes(e, n) bytes at `payload`, bounds-checked by the caller)
// with the checks of decode_chunk: the state in range, every word and raw field consumed, the
// state back at its initial value, the last raw byte's unused bits zero, the checksum (pairs:
// version 7's).
// (decode_one_state_streams: the same with the state, the words and the raw fields at `state`,
// `words` and `raw`, wherever they lie: version 6's mode 5 decodes its two streams with it.)
EP_HD int decode_one_state_streams(const uint8_t* state, const uint8_t* words, const uint8_t* raw, const ChunkEntry& e,
                                   uint32_t n, const DecodeTable& table, uint16_t* out, bool pairs) {
  uint32_t x = load_le<uint32_t>(state);
  if (x < kStateLow) return kErrStream;
  const uint64_t nraw_bytes = raw_bytes(e.num_raw);
  uint32_t wpos = 0, rpos = 0, checksum = 0, even = 0;  // even: pairs, the value before an odd one
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t s = dec_step(x, table);
    if (x < kStateLow) {
      if (wpos >= e.num_words) return kErrStream;
      x = (x << 16) | load_le<uint16_t>(words + 2ull * wpos);
      ++wpos;
    }
    uint32_t r = 0;
    if (s != uint32_t(kZeroSymbol)) {
      if (rpos >= e.num_raw) return kErrStream;
      r = read_raw_field(raw, nraw_bytes, rpos++);
    }
    const uint16_t v = join_value(s, r);
    out[i] = v;
    if (!pairs) checksum += checksum_term(v, i);
    else if (i % 2 == 0) even = v;
    else checksum += pair_term(even | uint32_t(v) << 16, i / 2);
  }
  if (pairs && n % 2 != 0) checksum += pair_term(even, n / 2);
  if (wpos != e.num_words || rpos != e.num_raw || x != kStateLow) return kErrStream;
  const uint64_t tail_bits = uint64_t(kRawBits) * e.num_raw;  // raw_tail_zero
  if (tail_bits % 8 != 0 && (raw[tail_bits / 8] >> (tail_bits % 8)) != 0) return kErrPadding;
  return checksum == e.checksum ? int(kOk) : int(kErrChecksum);
}
EP_HD int decode_one_state_chunk(const uint8_t* payload, const ChunkEntry& e, uint32_t n, const DecodeTable& table,
                                 uint16_t* out, bool pairs) {
  const uint8_t* words = payload + kOneStateBytes;
  return decode_one_state_streams(payload, words, words + 2ull * e.num_words, e, n, table, out, pairs);
}

// A mode 3 chunk: n values +0.0 (check_entry checked its fields).
EP_HD void decode_zero_chunk(uint32_t n, uint16_t* out) {
  for (uint32_t i = 0; i < n; ++i) out[i] = 0;
}

// Raw chunk: copies and checks the checksum (pairs: version 7's).
EP_HD int decode_raw_chunk(const uint8_t* payload, const ChunkEntry& e, uint32_t n, uint16_t* out, bool pairs) {
  for (uint32_t i = 0; i < n; ++i) out[i] = load_le<uint16_t>(payload + 2ull * i);
  return checksum_of(out, n, 0, pairs) == e.checksum ? int(kOk) : int(kErrChecksum);
}

}  // namespace ep_comm::lossless
