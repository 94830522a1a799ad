// Lossless BF16 codec core, shared by the host build (csrc/host/lossless.cpp) and the CUDA
// kernels (csrc/cuda/lossless_kernels.cu).
//
// Each BF16 value v is split into a symbol and a sign+mantissa byte:
//   symbol = 256 when v == 0x0000 (+0.0), else the 8-bit exponent field (v >> 7) & 0xFF;
//   mantissa byte = (v >> 8 & 0x80) | (v & 0x7F), stored raw, and only for symbols != 256.
// Symbols are coded with rANS (32-bit state, 16-bit renormalisation, 11-bit probabilities) from
// one frequency table per blob. Values are cut into chunks of `chunk_values`; inside a chunk
// value i belongs to lane i % 32 (32 interleaved rANS states, one per warp lane on the GPU).
//
// Blob layout (little-endian, every field naturally aligned):
//   Header (32 bytes): u32 magic 'EPLB', u8 version, u8 ndim, u16 num_table_entries,
//                      u32 chunk_values, u32 num_chunks, u64 num_values,
//                      u32 meta_checksum (of every byte before the directory but these 4),
//                      u32 reserved (0)
//   u64 shape[ndim]
//   table: num_table_entries x {u16 symbol, u16 freq} (symbols ascending, freqs sum to 2048)
//   zero padding to a multiple of 4 bytes
//   directory: num_chunks x ChunkEntry {u32 mode, u32 num_words, u32 num_mantissa, u32 checksum}
//   chunk payloads in order, each zero-padded to a multiple of 4 bytes:
//     mode 0 (rANS): u32 final_state[32], u16 words[num_words], u8 mantissa[num_mantissa]
//     mode 1 (raw):  u16 values[n] (a chunk that rANS would not shrink)
// The checksum of a chunk is sum_i v_i * (2 i + 1) mod 2^32 over its values (i within the chunk),
// so any single corrupted value changes it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/hd.h"

namespace ep_comm::lossless {

constexpr uint32_t kMagic = 0x424C5045u;  // "EPLB"
constexpr uint32_t kVersion = 1;
constexpr int kMaxDims = 8;
constexpr int kLanes = 32;
constexpr int kProbBits = 11;
constexpr uint32_t kProbScale = 1u << kProbBits;
constexpr uint32_t kStateLow = 1u << 16;  // rANS states live in [kStateLow, 2^32)
constexpr int kNumSymbols = 257;
constexpr int kZeroSymbol = 256;
constexpr uint32_t kModeRans = 0;
constexpr uint32_t kModeRaw = 1;
constexpr uint32_t kDefaultChunkValues = 65536;
constexpr uint32_t kMinChunkValues = 32;
constexpr uint32_t kMaxChunkValues = 1u << 24;
constexpr uint64_t kMaxValues = 1ull << 48;
constexpr size_t kHeaderBytes = 32;
constexpr size_t kMetaChecksumOffset = 24;
constexpr size_t kStateBytes = kLanes * 4;

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
  uint32_t num_mantissa;
  uint32_t checksum;
};

// ---- the value <-> (symbol, mantissa byte) split ----
EP_HD uint32_t symbol_of(uint16_t v) { return ((v >> 7) & 0xFFu) | (uint32_t(v == 0) << 8); }
EP_HD uint8_t mantissa_of(uint16_t v) {
  return static_cast<uint8_t>(((v >> 8) & 0x80u) | (v & 0x7Fu));
}
EP_HD uint16_t join_value(uint32_t symbol, uint8_t mantissa) {
  if (symbol == kZeroSymbol) return 0;
  return static_cast<uint16_t>(((mantissa & 0x80u) << 8) | (symbol << 7) | (mantissa & 0x7Fu));
}
EP_HD uint32_t checksum_term(uint16_t v, uint32_t index) { return uint32_t(v) * (2u * index + 1u); }

EP_HD uint64_t align4(uint64_t n) { return (n + 3) & ~uint64_t(3); }

// Bytes of a chunk's payload before padding.
EP_HD uint64_t payload_bytes(const ChunkEntry& e, uint32_t n) {
  if (e.mode == kModeRaw) return 2ull * n;
  return kStateBytes + 2ull * e.num_words + e.num_mantissa;
}

// ---- frequency table ----
// Scales `counts[257]` (total > 0) to `freq[257]` summing to kProbScale, every seen symbol >= 1.
// Deterministic, so host and device builds produce the same table.
EP_HD void normalize_counts(const uint64_t* counts, uint64_t total, uint32_t* freq) {
  int64_t sum = 0;
  for (int s = 0; s < kNumSymbols; ++s) {
    uint32_t f = 0;
    if (counts[s] != 0) {
      uint64_t scaled = (counts[s] * kProbScale + total / 2) / total;
      f = scaled == 0 ? 1u : static_cast<uint32_t>(scaled);
    }
    freq[s] = f;
    sum += f;
  }
  int64_t diff = int64_t(kProbScale) - sum;
  while (diff != 0) {
    int best = 0;
    for (int s = 1; s < kNumSymbols; ++s)
      if (freq[s] > freq[best]) best = s;
    if (diff > 0) {
      freq[best] += static_cast<uint32_t>(diff);
      diff = 0;
    } else {
      int64_t take = int64_t(freq[best]) - 1;
      if (take > -diff) take = -diff;
      freq[best] -= static_cast<uint32_t>(take);
      diff += take;
    }
  }
}

// Cumulative starts from freq[257]; returns false when the freqs do not sum to kProbScale.
EP_HD bool cumulative(const uint32_t* freq, uint32_t* start) {
  uint32_t acc = 0;
  for (int s = 0; s < kNumSymbols; ++s) {
    start[s] = acc;
    acc += freq[s];
  }
  return acc == kProbScale;
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
  uint32_t pad;
};
EP_HD EncSym make_enc_sym(uint32_t start, uint32_t freq) {
  EncSym e;
  e.start = start;
  e.freq = freq;
  e.rcp = freq <= 1 ? 0 : ~0ull / freq + 1;
  e.bypass = freq == 1 ? ~0u : 0u;
  e.x_max = uint64_t(freq) << (32 - kProbBits);  // (L >> kProbBits << 16) * freq
  e.pad = 0;
  return e;
}
// Branch-free: the renormalisation decision is data-dependent and unpredictable.
EP_HD uint32_t enc_put(uint32_t x, const EncSym& s) {
  uint32_t q = static_cast<uint32_t>(mulhi64(x, s.rcp)) + (x & s.bypass);
  return (q << kProbBits) + (x - q * s.freq) + s.start;
}

// One rANS encode step: renormalise (write at most one 16-bit word just below `cursor`, moving it
// down only when the word is kept) and code `s`. Branch-free; the host, AVX2 and GPU coders share it.
EP_HD uint32_t enc_step(uint32_t x, const EncSym& s, uint16_t*& cursor) {
  const uint32_t need = uint64_t(x) >= s.x_max ? 1u : 0u;
  cursor[-1] = static_cast<uint16_t>(x & 0xFFFFu);
  cursor -= need;
  x >>= need << 4;
  return enc_put(x, s);
}
// Decoder table entry of a slot: symbol (9 bits) << 23 | freq (12 bits) << 11 | slot - start.
EP_HD uint32_t dec_entry(uint32_t symbol, uint32_t freq, uint32_t bias) {
  return (symbol << 23) | (freq << kProbBits) | bias;
}
EP_HD uint32_t entry_symbol(uint32_t e) { return e >> 23; }
EP_HD uint32_t entry_freq(uint32_t e) { return (e >> kProbBits) & 0xFFFu; }
EP_HD uint32_t entry_bias(uint32_t e) { return e & (kProbScale - 1); }
// One decode step of state x: returns the symbol, advances x (before renormalisation).
EP_HD uint32_t dec_step(uint32_t& x, const uint32_t* table) {
  uint32_t e = table[x & (kProbScale - 1)];
  x = entry_freq(e) * (x >> kProbBits) + entry_bias(e);
  return entry_symbol(e);
}

// ---- header ----
struct Header {
  uint32_t ndim = 0;
  uint32_t num_table_entries = 0;
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

EP_HD uint64_t table_offset_for(uint32_t ndim) { return kHeaderBytes + 8ull * ndim; }
EP_HD uint64_t directory_offset_for(uint32_t ndim, uint32_t entries) {
  return align4(table_offset_for(ndim) + 4ull * entries);
}
EP_HD uint64_t data_offset_for(uint32_t ndim, uint32_t entries, uint32_t chunks) {
  return directory_offset_for(ndim, entries) + sizeof(ChunkEntry) * uint64_t(chunks);
}

// Checksum of the header, shape and table (bytes [0, end) but the checksum field itself).
EP_HD uint32_t meta_checksum(const uint8_t* blob, uint64_t end) {
  uint32_t sum = 0;
  for (uint64_t i = 0; i < end; ++i)
    if (i < kMetaChecksumOffset || i >= kMetaChecksumOffset + 4) sum += uint32_t(blob[i]) * uint32_t(2 * i + 1);
  return sum;
}

// Parses and validates the fixed header, the shape, and that table and directory fit.
EP_HD int parse_header(const uint8_t* blob, uint64_t size, Header& h) {
  if (size < kHeaderBytes) return kErrTruncated;
  if (load_le<uint32_t>(blob) != kMagic) return kErrMagic;
  if (blob[4] != kVersion) return kErrVersion;
  h.ndim = blob[5];
  h.num_table_entries = load_le<uint16_t>(blob + 6);
  h.chunk_values = load_le<uint32_t>(blob + 8);
  h.num_chunks = load_le<uint32_t>(blob + 12);
  h.num_values = load_le<uint64_t>(blob + 16);
  if (h.ndim > kMaxDims || load_le<uint32_t>(blob + kMetaChecksumOffset + 4) != 0) return kErrHeader;
  if (h.chunk_values < kMinChunkValues || h.chunk_values > kMaxChunkValues || h.chunk_values % kLanes != 0)
    return kErrHeader;
  if (h.num_values > kMaxValues) return kErrHeader;
  if (num_chunks_for(h.num_values, h.chunk_values) != h.num_chunks) return kErrHeader;
  if (h.num_table_entries > kNumSymbols) return kErrTable;
  if ((h.num_values == 0) != (h.num_table_entries == 0)) return kErrTable;
  h.table_offset = table_offset_for(h.ndim);
  if (size < h.table_offset) return kErrTruncated;
  uint64_t product = 1;
  for (uint32_t d = 0; d < h.ndim; ++d) {
    h.shape[d] = load_le<uint64_t>(blob + kHeaderBytes + 8ull * d);
    if (h.shape[d] > kMaxValues) return kErrShape;
    // checked before multiplying, so the product cannot wrap around
    if (h.shape[d] != 0 && product > kMaxValues / h.shape[d]) return kErrShape;
    product = product * h.shape[d];
  }
  if (product != h.num_values) return kErrShape;
  h.directory_offset = directory_offset_for(h.ndim, h.num_table_entries);
  h.data_offset = data_offset_for(h.ndim, h.num_table_entries, h.num_chunks);
  if (size < h.data_offset) return kErrTruncated;
  for (uint64_t p = h.table_offset + 4ull * h.num_table_entries; p < h.directory_offset; ++p)
    if (blob[p] != 0) return kErrPadding;
  if (meta_checksum(blob, h.directory_offset) != load_le<uint32_t>(blob + kMetaChecksumOffset)) return kErrHeader;
  return kOk;
}

// Reads the table into freq[257] / start[257]; validates order and sum.
EP_HD int read_table(const uint8_t* blob, const Header& h, uint32_t* freq, uint32_t* start) {
  for (int s = 0; s < kNumSymbols; ++s) freq[s] = 0;
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

// Validates chunk `c`'s directory entry (n = its value count).
EP_HD int check_entry(const ChunkEntry& e, uint32_t n) {
  if (e.mode == kModeRaw) return (e.num_words == 0 && e.num_mantissa == 0) ? int(kOk) : int(kErrDirectory);
  if (e.mode != kModeRans) return kErrDirectory;
  if (e.num_words > n || e.num_mantissa > n) return kErrDirectory;
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
  e.num_mantissa = load_le<uint32_t>(p + 8);
  e.checksum = load_le<uint32_t>(p + 12);
  return e;
}

// Largest blob `encode` can produce for `num_values` values in `ndim` dims (worst case: every
// chunk raw, every symbol in the table).
EP_HD uint64_t max_blob_bytes(uint64_t num_values, uint32_t ndim, uint32_t chunk_values) {
  uint64_t chunks = num_chunks_for(num_values, chunk_values);
  return data_offset_for(ndim, kNumSymbols, static_cast<uint32_t>(chunks)) + 2 * num_values + 4 * chunks;
}

// ---- single-chunk coding, sequential form (host; also a reference for the warp kernels) ----

// Encodes chunk values v[0, n) with the blob's table. Writes words backwards ending at
// words_end (returns the count), mantissa bytes forward to mant. Fills `e`.
// words_end must have room for n words before it; mant for n bytes; states for 32 u32.
EP_HD void encode_chunk(const uint16_t* v, uint32_t n, const EncSym* syms, uint32_t* states,
                        uint16_t* words_end, uint8_t* mant, ChunkEntry& e) {
  uint32_t checksum = 0;
  uint32_t nm = 0;
  for (uint32_t i = 0; i < n; ++i) {
    uint16_t x = v[i];
    checksum += checksum_term(x, i);
    mant[nm] = mantissa_of(x);
    nm += x != 0 ? 1u : 0u;
  }
  for (int l = 0; l < kLanes; ++l) states[l] = kStateLow;
  uint16_t* cursor = words_end;
  if (n > 0) {
    uint32_t steps = (n + kLanes - 1) / kLanes;
    for (uint32_t t = steps; t-- > 0;) {
      int top = n - t * kLanes < uint32_t(kLanes) ? int(n - t * kLanes) : kLanes;
      for (int l = top - 1; l >= 0; --l) {
        uint32_t i = t * kLanes + uint32_t(l);
        const EncSym& s = syms[symbol_of(v[i])];
        // cursor[-1] is always inside the n-word area: at most one word per value coded so far
        states[l] = enc_step(states[l], s, cursor);
      }
    }
  }
  e.mode = kModeRans;
  e.num_words = static_cast<uint32_t>(words_end - cursor);
  e.num_mantissa = nm;
  e.checksum = checksum;
}

// Builds the decoder's table: kProbScale packed entries (see dec_entry).
EP_HD void build_decode_table(const uint32_t* freq, const uint32_t* start, uint32_t* table) {
  for (int s = 0; s < kNumSymbols; ++s)
    for (uint32_t k = 0; k < freq[s]; ++k) table[start[s] + k] = dec_entry(uint32_t(s), freq[s], k);
}

// Decodes one rANS chunk from `payload` (payload_bytes(e, n) bytes, already bounds-checked)
// into out[0, n) with the table of build_decode_table. Returns a Status.
// Loads a chunk's initial states; false if one is out of range.
EP_HD bool load_states(const uint8_t* payload, uint32_t* states) {
  bool ok = true;
  for (int l = 0; l < kLanes; ++l) {
    states[l] = load_le<uint32_t>(payload + 4 * l);
    ok = ok && states[l] >= kStateLow;
  }
  return ok;
}

// Decodes steps [t0, end) of a chunk whose first t0 steps are done (states, wpos, mpos describe
// that point), then runs every end-of-chunk check. Host SIMD decoders hand over here.
EP_HD int decode_chunk_from(const uint8_t* payload, const ChunkEntry& e, uint32_t n, const uint32_t* table,
                            uint16_t* out, uint32_t* states, uint32_t t0, uint32_t wpos, uint32_t mpos) {
  const uint8_t* words = payload + kStateBytes;
  const uint8_t* mant = words + 2ull * e.num_words;
  uint32_t checksum = 0;
  uint32_t steps = (n + kLanes - 1) / kLanes;
  for (uint32_t t = t0; t < steps; ++t) {
    uint32_t base = t * kLanes;
    int lanes = n - base < uint32_t(kLanes) ? int(n - base) : kLanes;
    if (lanes == kLanes && wpos + kLanes <= e.num_words && mpos + kLanes <= e.num_mantissa) {
      // fast path: a step reads at most 32 words and 32 mantissa bytes, all in bounds here
      for (int l = 0; l < kLanes; ++l) {
        uint32_t x = states[l];
        uint32_t s = dec_step(x, table);
        uint32_t w = load_le<uint16_t>(words + 2ull * wpos);
        uint32_t need = x < kStateLow ? 1u : 0u;
        states[l] = (x << (need << 4)) | (w & (0u - need));
        wpos += need;
        uint16_t value = join_value(s, mant[mpos]);
        mpos += s != uint32_t(kZeroSymbol) ? 1u : 0u;
        out[base + l] = value;
      }
      continue;
    }
    for (int l = 0; l < lanes; ++l) {
      uint32_t x = states[l];
      uint32_t s = dec_step(x, table);
      if (x < kStateLow) {
        if (wpos >= e.num_words) return kErrStream;
        x = (x << 16) | load_le<uint16_t>(words + 2ull * wpos);
        ++wpos;
      }
      states[l] = x;
      uint16_t value = 0;
      if (s != uint32_t(kZeroSymbol)) {
        if (mpos >= e.num_mantissa) return kErrStream;
        value = join_value(s, mant[mpos++]);
      }
      out[base + l] = value;
    }
  }
  if (wpos != e.num_words || mpos != e.num_mantissa) return kErrStream;
  for (int l = 0; l < kLanes; ++l)
    if (states[l] != kStateLow) return kErrStream;
  for (uint32_t i = 0; i < n; ++i) checksum += checksum_term(out[i], i);
  return checksum == e.checksum ? int(kOk) : int(kErrChecksum);
}

EP_HD int decode_chunk(const uint8_t* payload, const ChunkEntry& e, uint32_t n, const uint32_t* table,
                       uint16_t* out) {
  uint32_t states[kLanes];
  if (!load_states(payload, states)) return kErrStream;
  return decode_chunk_from(payload, e, n, table, out, states, 0, 0, 0);
}

// Raw chunk: copies and checks the checksum.
EP_HD int decode_raw_chunk(const uint8_t* payload, const ChunkEntry& e, uint32_t n, uint16_t* out) {
  uint32_t checksum = 0;
  for (uint32_t i = 0; i < n; ++i) {
    uint16_t v = load_le<uint16_t>(payload + 2ull * i);
    out[i] = v;
    checksum += checksum_term(v, i);
  }
  return checksum == e.checksum ? int(kOk) : int(kErrChecksum);
}

}  // namespace ep_comm::lossless
