// Host (CPU) build of the lossless BF16 codec: binds encode/decode of csrc/codec/lossless_core.h
// (AVX2 paths from lossless_avx2.h where the CPU has them), parallel over chunks.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#ifdef __linux__
#include <sys/mman.h>
#endif
#include <algorithm>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "codec/lossless_avx2.h"  // x86-64 only; other hosts use the portable core
#include "codec/host_parallel.h"
#include "codec/lossless_core.h"
#include "page_array.h"

namespace py = pybind11;
using namespace ep_comm::lossless;

namespace ep_comm::host {
namespace {

#if defined(__x86_64__)
bool simd_available() { return have_avx2(); }
#else
bool simd_available() { return false; }
#endif

// Threads for `chunks` chunks of `values` values in all: no more than the chunks, and one for small
// inputs, where starting a thread team costs more than it saves.
int resolve_threads(int threads, uint64_t chunks, uint64_t values) {
  if (values < (1u << 17)) return 1;  // before hardware_threads(), which reads sysfs
  int nt = threads > 0 ? threads : hardware_threads();
  return chunks < uint64_t(nt) ? static_cast<int>(chunks > 0 ? chunks : 1) : nt;
}

// Two-byte, C-contiguous, 1-D view of a Python buffer.
const uint16_t* u16_data(const py::buffer_info& info, const char* name) {
  if (info.itemsize != 2) throw std::invalid_argument(std::string(name) + " must hold 2-byte values");
  if (info.ndim != 1 || (info.shape[0] > 1 && info.strides[0] != 2))
    throw std::invalid_argument(std::string(name) + " must be 1-D and contiguous");
  return static_cast<const uint16_t*>(info.ptr);
}

struct ChunkScratch {
  uint32_t n = 0;
  ChunkEntry entry{};
  uint8_t* region = nullptr;      // this chunk's work area inside the output allocation
  uint16_t* words_end = nullptr;  // words are [words_end - num_words, words_end); raw fields follow
  uint8_t* raw = nullptr;         // packed raw fields, raw_bytes(entry.num_raw) bytes (= words_end)
  const uint16_t* values = nullptr;
  // the finished payload (payload_bytes(entry, n) bytes), before it is moved to its place
  const uint8_t* payload() const {
    return entry.mode == kModeRaw ? region
                                  : reinterpret_cast<const uint8_t*>(words_end - entry.num_words) - kStateBytes;
  }
};

// Work area of one chunk of n <= cv values, inside the output allocation: states (written just
// below the words once their count is known), kSlack words of room for the AVX2 encoder's 8-word
// stores below the words, n words (written backwards), then the raw fields: first one byte per
// field, packed to 6 bits in place, plus 8-byte store slack. Rounded up to 64 bytes.
constexpr uint64_t kSlackWords = 16;
uint64_t region_bytes(uint32_t cv) {
  return (kStateBytes + 2 * kSlackWords + 2ull * cv + cv + 16 + 63) & ~uint64_t(63);
}

// bf16 bit patterns `values` (num_values u16) with `shape` -> blob (1-D uint8 array).
// Chunks are coded in work areas inside one over-sized output allocation (no separate scratch to
// page in), then moved down into place; the returned array views the first blob-size bytes.
py::array_t<uint8_t> encode(const py::buffer& values, const std::vector<int64_t>& shape,
                            int64_t chunk_values, int threads, bool simd) {
  py::buffer_info info = values.request();
  const uint16_t* v = u16_data(info, "values");
  const uint64_t num_values = static_cast<uint64_t>(info.shape[0]);
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
  // work areas start after the largest possible header, table and directory
  const uint64_t areas = (data_offset_for(ndim, kNumSymbols, static_cast<uint32_t>(num_chunks)) + 63) & ~uint64_t(63);
  const uint64_t region = region_bytes(num_values < cv ? static_cast<uint32_t>(num_values) : cv);
  py::array_t<uint8_t> out = page_backed_array<uint8_t>(areas + region * num_chunks);
  uint8_t* o = out.mutable_data();

  uint32_t freq[kNumSymbols] = {}, start[kNumSymbols] = {};
  std::vector<EncSym> syms(kNumSymbols);
  uint32_t entries = 0;
  std::vector<ChunkScratch> chunks(num_chunks);
  std::vector<uint64_t> offsets(num_chunks + 1);
  {
    py::gil_scoped_release release;
    [[maybe_unused]] const bool use_simd = simd && simd_available();
    // pass 1, per chunk: checksum, raw fields and symbol histogram. Histograms are kept per block
    // of consecutive chunks (a few per thread), not per chunk: small chunks stay cheap.
    const int64_t num_blocks = std::min<int64_t>(int64_t(num_chunks), 4 * int64_t(nt));
    std::vector<uint64_t> hist(uint64_t(num_blocks) * kNumSymbols, 0);
    parallel_for(num_blocks, nt, [&](int64_t block) {
      uint64_t* h = hist.data() + uint64_t(block) * kNumSymbols;
#if defined(__x86_64__)
      std::unique_ptr<SplitHistogram> simd_hist(use_simd ? new SplitHistogram() : nullptr);
#endif
      const int64_t first = int64_t(num_chunks) * block / num_blocks, last = int64_t(num_chunks) * (block + 1) / num_blocks;
      for (int64_t c = first; c < last; ++c) {
        ChunkScratch& cs = chunks[c];
        const uint64_t b = uint64_t(c) * cv;
        cs.n = static_cast<uint32_t>(num_values - b < cv ? num_values - b : cv);
        cs.values = v + b;
        cs.region = o + areas + region * uint64_t(c);
        cs.words_end = reinterpret_cast<uint16_t*>(cs.region + kStateBytes) + kSlackWords + cs.n;
        cs.raw = reinterpret_cast<uint8_t*>(cs.words_end);
        cs.entry.mode = kModeRans;
#if defined(__x86_64__)
        if (use_simd) {
          cs.entry.checksum = split_chunk_avx2(cs.values, cs.n, cs.raw, cs.entry.num_raw, *simd_hist, h);
          continue;
        }
#endif
        cs.entry.checksum = split_chunk(cs.values, cs.n, cs.raw, cs.entry.num_raw);
        for (uint32_t i = 0; i < cs.n; ++i) ++h[symbol_of(cs.values[i])];
      }
#if defined(__x86_64__)
      if (simd_hist) simd_hist->fold_into(h);
#endif
    });
    if (num_values > 0) {
      uint64_t counts[kNumSymbols] = {};
      for (int64_t b = 0; b < num_blocks; ++b)
        for (int s = 0; s < kNumSymbols; ++s) counts[s] += hist[uint64_t(b) * kNumSymbols + s];
      normalize_counts(counts, num_values, freq);
      cumulative(freq, start);
      for (int s = 0; s < kNumSymbols; ++s) {
        entries += freq[s] != 0;
        syms[s] = make_enc_sym(start[s], freq[s]);
      }
    }
#if defined(__x86_64__)
    std::unique_ptr<SimdEncTables> simd_tables(new SimdEncTables());
    make_simd_enc_tables(syms.data(), *simd_tables);
#endif
    // pass 2, per chunk: rANS; the final states go just below the words
    parallel_for(int64_t(num_chunks), nt, [&](int64_t c) {
      ChunkScratch& cs = chunks[c];
      uint32_t states[kLanes];
#if defined(__x86_64__)
      if (use_simd)
        cs.entry.num_words = rans_encode_chunk_avx2(cs.values, cs.n, syms.data(), *simd_tables, states, cs.words_end);
      else
#endif
        cs.entry.num_words = rans_encode_chunk(cs.values, cs.n, syms.data(), states, cs.words_end);
      if (payload_bytes(cs.entry, cs.n) >= 2ull * cs.n) {
        cs.entry = ChunkEntry{kModeRaw, 0, 0, cs.entry.checksum};
        std::memcpy(cs.region, cs.values, 2ull * cs.n);
      } else {
        std::memcpy(const_cast<uint8_t*>(cs.payload()), states, kStateBytes);
      }
    });
    // a blob whose chunks are all raw needs no table
    bool all_raw = true;
    for (const ChunkScratch& cs : chunks) all_raw = all_raw && cs.entry.mode == kModeRaw;
    if (all_raw) entries = 0;
    // header, table, directory
    const uint64_t dir_off = directory_offset_for(ndim, entries);
    const uint64_t data_off = data_offset_for(ndim, entries, static_cast<uint32_t>(num_chunks));
    offsets[0] = data_off;
    for (uint64_t c = 0; c < num_chunks; ++c)
      offsets[c + 1] = offsets[c] + align4(payload_bytes(chunks[c].entry, chunks[c].n));
    std::memset(o, 0, data_off);
    store_header(o, ndim, entries, cv, static_cast<uint32_t>(num_chunks), num_values);
    for (uint32_t d = 0; d < ndim; ++d) store_le<uint64_t>(o + kHeaderBytes + 8ull * d, uint64_t(shape[d]));
    uint64_t p = table_offset_for(ndim);
    for (int s = 0; s < kNumSymbols && entries > 0; ++s) {
      if (freq[s] == 0) continue;
      store_le<uint16_t>(o + p, static_cast<uint16_t>(s));
      store_le<uint16_t>(o + p + 2, static_cast<uint16_t>(freq[s]));
      p += 4;
    }
    store_le<uint32_t>(o + kMetaChecksumOffset, meta_checksum(o, dir_off));
    for (uint64_t c = 0; c < num_chunks; ++c) {
      const ChunkScratch& cs = chunks[c];
      uint8_t* d = o + dir_off + sizeof(ChunkEntry) * c;
      store_le<uint32_t>(d, cs.entry.mode);
      store_le<uint32_t>(d + 4, cs.entry.num_words);
      store_le<uint32_t>(d + 8, cs.entry.num_raw);
      store_le<uint32_t>(d + 12, cs.entry.checksum);
    }
    // move the payloads down into place, in order: chunk c's destination ends at or below its
    // own work area's end (offsets[c] <= areas + c * region), so no unmoved payload is overwritten
    for (uint64_t c = 0; c < num_chunks; ++c) {
      const uint64_t used = payload_bytes(chunks[c].entry, chunks[c].n);
      std::memmove(o + offsets[c], chunks[c].payload(), used);
      std::memset(o + offsets[c] + used, 0, offsets[c + 1] - offsets[c] - used);
    }
  }
  const uint64_t blob_bytes = offsets[num_chunks], work_bytes = areas + region * num_chunks;
  if (is_page_backed(work_bytes)) {
    // a view of the first blob_bytes bytes (keeps `out` alive as its base); the work areas'
    // whole huge pages past them go back to the system
    release_unused_pages(o, work_bytes, blob_bytes);
    return py::array_t<uint8_t>({static_cast<py::ssize_t>(blob_bytes)}, {py::ssize_t(1)}, o, out);
  }
  // small: an exact-size copy, so that the work allocation is freed (and reused by the heap)
  py::array_t<uint8_t> blob(static_cast<py::ssize_t>(blob_bytes));
  std::memcpy(blob.mutable_data(), o, blob_bytes);
  return blob;
}

struct Parsed {
  Header h;
  uint32_t freq[kNumSymbols];
  uint32_t start[kNumSymbols];
};

[[noreturn]] void fail(int status) { throw std::invalid_argument(std::string("lossless blob: ") + error_message(status)); }

void parse(const uint8_t* blob, uint64_t size, Parsed& p) {
  int st = parse_header(blob, size, p.h);
  if (st != kOk) fail(st);
  st = read_table(blob, p.h, p.freq, p.start);
  if (st != kOk) fail(st);
  // the chunk directory must account for exactly the blob's bytes: checked here, before any
  // caller allocates the declared shape. (A valid blob can still declare a large tensor: an
  // all-zero chunk codes to its 128 state bytes; callers that know the size pass expected_shape.)
  uint64_t offset = p.h.data_offset;
  for (uint64_t c = 0; c < p.h.num_chunks; ++c) {
    const uint32_t n = chunk_count(p.h, c);
    const ChunkEntry e = read_entry(blob, p.h, c);
    st = check_entry(p.h, e, n);
    if (st != kOk) fail(st);
    offset += align4(payload_bytes(e, n));
    if (offset > size) fail(kErrSize);
  }
  if (offset != size) fail(kErrSize);
}

const uint8_t* blob_data(const py::buffer_info& info, uint64_t& size) {
  if (info.itemsize != 1 || info.ndim != 1 || (info.shape[0] > 1 && info.strides[0] != 1))
    throw std::invalid_argument("blob must be a 1-D contiguous uint8 buffer");
  size = static_cast<uint64_t>(info.shape[0]);
  return static_cast<const uint8_t*>(info.ptr);
}

// blob -> shape (list of ints); validates the header and table only.
std::vector<int64_t> header_shape(const py::buffer& blob) {
  py::buffer_info info = blob.request();
  uint64_t size = 0;
  const uint8_t* b = blob_data(info, size);
  Parsed p;
  parse(b, size, p);
  return std::vector<int64_t>(p.h.shape, p.h.shape + p.h.ndim);
}

// Decodes a parsed blob `b` (size bytes) into o[num_values]; returns a Status. Releases the GIL.
int decode_parsed(const uint8_t* b, uint64_t size, const Parsed& p, uint16_t* o, int threads, bool simd) {
  const Header& h = p.h;
  const int nt = resolve_threads(threads, h.num_chunks, h.num_values);
  int status = kOk;
  [[maybe_unused]] const bool use_simd = simd && simd_available();
  py::gil_scoped_release release;
  std::vector<ChunkEntry> entries(h.num_chunks);
  std::vector<uint64_t> offsets(uint64_t(h.num_chunks) + 1);
  offsets[0] = h.data_offset;
  for (uint64_t c = 0; c < h.num_chunks && status == kOk; ++c) {
    entries[c] = read_entry(b, h, c);
    status = check_entry(h, entries[c], chunk_count(h, c));
    offsets[c + 1] = offsets[c] + align4(payload_bytes(entries[c], chunk_count(h, c)));
  }
  if (status == kOk && offsets[h.num_chunks] != size) status = kErrSize;
  if (status != kOk) return status;
  std::unique_ptr<DecodeTable> table(new DecodeTable());
  if (h.num_values > 0) build_decode_table(p.freq, p.start, *table);
  std::vector<int> chunk_status(h.num_chunks, kOk);
  parallel_for(int64_t(h.num_chunks), nt, [&](int64_t c) {
    const ChunkEntry& e = entries[c];
    uint32_t n = chunk_count(h, uint64_t(c));
    const uint8_t* payload = b + offsets[c];
    uint64_t used = payload_bytes(e, n);
    int st = kOk;
    for (uint64_t q = offsets[c] + used; q < offsets[c + 1]; ++q)
      if (b[q] != 0) st = kErrPadding;
    uint16_t* dst = o + uint64_t(c) * h.chunk_values;
    if (st == kOk) {
      if (e.mode == kModeRaw) st = decode_raw_chunk(payload, e, n, dst);
#if defined(__x86_64__)
      else if (use_simd) st = decode_chunk_avx2(payload, e, n, *table, dst);
#endif
      else st = decode_chunk(payload, e, n, *table, dst);
    }
    chunk_status[c] = st;
  }, page_grain(int64_t(h.num_chunks), nt, 2ull * h.chunk_values));
  for (int st : chunk_status)
    if (st != kOk) return st;
  return kOk;
}

// blob -> values written to `out` (num_values u16, contiguous). Raises ValueError on any
// inconsistency; never reads outside the blob.
void decode_into(const py::buffer& blob, const py::buffer& out, int threads, bool simd) {
  py::buffer_info info = blob.request();
  uint64_t size = 0;
  const uint8_t* b = blob_data(info, size);
  py::buffer_info oinfo = out.request(true);
  uint16_t* o = const_cast<uint16_t*>(u16_data(oinfo, "out"));
  Parsed p;
  parse(b, size, p);
  if (uint64_t(oinfo.shape[0]) != p.h.num_values) throw std::invalid_argument("out has the wrong size");
  const int status = decode_parsed(b, size, p, o, threads, simd);
  if (status != kOk) fail(status);
}

// Text of a shape, as Python prints a tuple.
std::string shape_text(const uint64_t* dims, size_t ndim) {
  std::string t = "(";
  for (size_t d = 0; d < ndim; ++d) t += std::to_string(dims[d]) + (ndim == 1 || d + 1 < ndim ? "," : "") + (d + 1 < ndim ? " " : "");
  return t + ")";
}

// blob -> (new 1-D u16 array of its values, shape). Large outputs get their own huge-page mapping
// (page_array.h). With `expected_shape`, a blob declaring another shape is rejected before the
// output is allocated. Raises ValueError on any inconsistency; never reads outside the blob.
py::tuple decode_new(const py::buffer& blob, int threads, bool simd, std::optional<std::vector<uint64_t>> expected_shape) {
  py::buffer_info info = blob.request();
  uint64_t size = 0;
  const uint8_t* b = blob_data(info, size);
  Parsed p;
  parse(b, size, p);
  if (expected_shape &&
      (expected_shape->size() != p.h.ndim || !std::equal(expected_shape->begin(), expected_shape->end(), p.h.shape)))
    throw std::invalid_argument("blob holds a tensor of shape " + shape_text(p.h.shape, p.h.ndim) + ", expected " +
                                shape_text(expected_shape->data(), expected_shape->size()));
  py::array_t<uint16_t> out = page_backed_array<uint16_t>(p.h.num_values);
  const int status = decode_parsed(b, size, p, out.mutable_data(), threads, simd);
  if (status != kOk) fail(status);
  return py::make_tuple(out, std::vector<int64_t>(p.h.shape, p.h.shape + p.h.ndim));
}

}  // namespace

void register_lossless(py::module_& m) {
  m.def("lossless_encode", &encode, py::arg("values"), py::arg("shape"),
        py::arg("chunk_values") = int64_t(kDefaultChunkValues), py::arg("threads") = 0, py::arg("simd") = true,
        "bf16 bit patterns (1-D, 2-byte items) and their shape -> self-describing blob (uint8 array);\n"
        "simd=False forces the portable core (the output is identical)");
  m.def("lossless_shape", &header_shape, py::arg("blob"),
        "validates a blob's header and table; returns the encoded tensor's shape");
  m.def("lossless_decode_into", &decode_into, py::arg("blob"), py::arg("out"), py::arg("threads") = 0, py::arg("simd") = true,
        "decodes a blob into out (1-D, 2-byte items, num_values long); ValueError on a bad blob;\n"
        "simd=False forces the portable core (the AVX2 path is used where the CPU has it)");
  m.def("lossless_decode", &decode_new, py::arg("blob"), py::arg("threads") = 0, py::arg("simd") = true,
        py::arg("expected_shape") = py::none(),
        "blob -> (new 1-D uint16 array of its bit patterns, shape list); ValueError on a bad blob, or one\n"
        "declaring another shape than expected_shape (checked before allocating)");
  m.def("lossless_max_blob_bytes", [](uint64_t n, uint32_t ndim, uint32_t cv) {
    return max_blob_bytes(n, ndim, cv);
  }, py::arg("num_values"), py::arg("ndim"), py::arg("chunk_values") = kDefaultChunkValues);
  m.attr("LOSSLESS_DEFAULT_CHUNK_VALUES") = kDefaultChunkValues;
}

}  // namespace ep_comm::host
