// CUDA build of the lossless BF16 codec (format and coding steps: csrc/codec/lossless_core.h).
// Encode: histogram -> table (one thread, the host's normalisation) -> one warp per chunk codes
// its 32 lanes exactly as the sequential core does (split_chunk + rans_encode_chunk) -> one block
// writes header, table (none when every chunk is raw, as the host does), directory and offsets
// -> packing.
// Decode: one thread validates header, table and directory -> one warp per chunk decodes with the
// checks of decode_chunk -> the status of the first failing chunk is reported, as on the host.
#include <cuda_runtime.h>

#include "codec/lossless_core.h"
#include "codec_launch.h"

namespace {
using namespace ep_comm::lossless;

constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr unsigned long long kNoError = ~0ull;

struct ShapeArg {
  uint64_t dims[kMaxDims];
};

// Hands out 256-byte-aligned pieces of one workspace allocation; with a null base it only
// measures (the same call sizes the allocation and then carves it).
struct Carver {
  char* base;
  size_t off = 0;
  template <typename T>
  T* take(size_t bytes) {
    char* p = base ? base + off : nullptr;
    off = (off + bytes + 255) & ~size_t(255);
    return reinterpret_cast<T*>(p);
  }
};

// Encoder workspace, carved out of one allocation.
struct EncWs {
  unsigned long long* counts;  // [kNumSymbols]
  EncSym* syms;                // [kNumSymbols]
  ChunkEntry* entries;         // [chunks]
  uint32_t* states;            // [chunks * 32]
  uint64_t* offsets;           // [chunks + 1]
  uint8_t* scratch;            // [chunks * 3 cv]: words in bytes [0, 2 cv), raw fields in [2 cv, 3 cv)
};

size_t carve(uint64_t chunks, uint32_t cv, char* base, EncWs* ws) {
  Carver c{base};
  EncWs w;
  w.counts = c.take<unsigned long long>(8 * kNumSymbols);
  w.syms = c.take<EncSym>(sizeof(EncSym) * kNumSymbols);
  w.entries = c.take<ChunkEntry>(sizeof(ChunkEntry) * chunks);
  w.states = c.take<uint32_t>(4ull * kLanes * chunks);
  w.offsets = c.take<uint64_t>(8 * (chunks + 1));
  w.scratch = c.take<uint8_t>(3ull * cv * chunks);
  if (ws) *ws = w;
  return c.off;
}

__device__ uint32_t chunk_values_of(uint64_t n, uint32_t cv, uint64_t c) {
  return static_cast<uint32_t>(n - c * cv < cv ? n - c * cv : cv);
}
__device__ uint8_t* chunk_scratch(const EncWs& ws, uint32_t cv, uint64_t c) { return ws.scratch + 3ull * cv * c; }

__device__ uint32_t warp_sum(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__global__ void histogram_kernel(const uint16_t* v, uint64_t n, unsigned long long* counts) {
  __shared__ unsigned int local[kNumSymbols];
  for (int s = threadIdx.x; s < kNumSymbols; s += blockDim.x) local[s] = 0;
  __syncthreads();
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    atomicAdd(&local[symbol_of(v[i])], 1u);
  __syncthreads();
  for (int s = threadIdx.x; s < kNumSymbols; s += blockDim.x)
    if (local[s]) atomicAdd(&counts[s], static_cast<unsigned long long>(local[s]));
}

// One thread: the encoder's symbol table, normalised as on the host (all zero for n == 0).
__global__ void table_kernel(EncWs ws, uint64_t n) {
  uint64_t counts[kNumSymbols];
  uint32_t freq[kNumSymbols], start[kNumSymbols];
  for (int s = 0; s < kNumSymbols; ++s) {
    counts[s] = ws.counts[s];
    freq[s] = start[s] = 0;
  }
  if (n > 0) {
    normalize_counts(counts, n, freq);
    cumulative(freq, start);
  }
  for (int s = 0; s < kNumSymbols; ++s) ws.syms[s] = make_enc_sym(start[s], freq[s]);
}

// One warp per chunk; lane l owns values i with i % 32 == l, as in the core.
__global__ void encode_kernel(const uint16_t* values, uint64_t n, uint32_t cv, uint64_t chunks, EncWs ws) {
  const int lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  for (uint64_t c = blockIdx.x * uint64_t(kWarpsPerBlock) + threadIdx.x / 32; c < chunks;
       c += uint64_t(gridDim.x) * kWarpsPerBlock) {
    const uint32_t cn = chunk_values_of(n, cv, c);
    const uint16_t* v = values + c * cv;
    uint16_t* words_end = reinterpret_cast<uint16_t*>(chunk_scratch(ws, cv, c)) + cn;
    uint8_t* raw = chunk_scratch(ws, cv, c) + 2ull * cv;  // 8-byte aligned, cv bytes
    const uint32_t steps = (cn + kLanes - 1) / kLanes;
    // split_chunk: the checksum, and the k-th non-zero value's raw field staged at raw[k]
    uint32_t checksum = 0, nr = 0;
    for (uint32_t t = 0; t < steps; ++t) {
      const uint32_t i = t * kLanes + lane;
      const uint16_t x = i < cn ? v[i] : 0;
      const unsigned nz = __ballot_sync(kFull, x != 0);
      if (x != 0) raw[nr + __popc(nz & below)] = static_cast<uint8_t>(raw_of(x));
      nr += __popc(nz);
      checksum += checksum_term(x, i);  // 0 past the end
    }
    checksum = warp_sum(checksum);
    // pack the staged fields in place, eight per lane (8 bytes -> 6 at byte 6g): the stream
    // split_chunk's BitWriter writes. Zero fields fill the last group (the last byte's unused
    // bits); group g's 6 bytes overlap only staged groups <= g, all read before the first write.
    const uint32_t groups = (nr + 7) / 8;
    if (uint32_t(lane) < 8 * groups - nr) raw[nr + lane] = 0;
    __syncwarp();
    for (uint32_t g0 = 0; g0 < groups; g0 += kLanes) {
      const uint32_t g = g0 + lane;
      const uint64_t packed = g < groups ? pack6x8(reinterpret_cast<const uint64_t*>(raw)[g]) : 0;
      __syncwarp();
      if (g < groups) {
        uint16_t* dst = reinterpret_cast<uint16_t*>(raw) + 3ull * g;
        for (int k = 0; k < 3; ++k) dst[k] = static_cast<uint16_t>(packed >> (16 * k));
      }
      __syncwarp();
    }
    // rans_encode_chunk: steps backwards; in a step lane 31 codes first, so its word lands highest
    uint32_t x = kStateLow;
    uint32_t nw = 0;
    for (uint32_t t = steps; t-- > 0;) {
      const uint32_t i = t * kLanes + lane;
      const bool valid = i < cn;
      const EncSym s = ws.syms[valid ? symbol_of(v[i]) : 0];
      const bool need = valid && enc_needs_word(x, s);
      const unsigned mask = __ballot_sync(kFull, need);
      const uint32_t k = __popc(mask);
      if (need) words_end[-int64_t(nw) - int64_t(k) + __popc(mask & below)] = static_cast<uint16_t>(x & 0xFFFFu);
      nw += k;
      if (need) x >>= 16;
      if (valid) x = enc_put(x, s);
    }
    ws.states[c * kLanes + lane] = x;
    if (lane == 0) {
      ChunkEntry e{kModeRans, nw, nr, checksum};
      if (payload_bytes(e, cn) >= 2ull * cn) e = ChunkEntry{kModeRaw, 0, 0, checksum};
      ws.entries[c] = e;
    }
  }
}

// Header, shape, table (when `table`) and its padding, meta checksum; returns the table's entries.
__device__ uint32_t write_meta(const EncSym* syms, bool table, uint64_t n, const ShapeArg& shape, uint32_t ndim,
                               uint32_t cv, uint64_t chunks, uint8_t* out) {
  uint64_t p = table_offset_for(ndim);
  uint32_t entries = 0;
  for (int s = 0; s < kNumSymbols && table; ++s) {
    if (syms[s].freq == 0) continue;
    store_le<uint16_t>(out + p, static_cast<uint16_t>(s));
    store_le<uint16_t>(out + p + 2, static_cast<uint16_t>(syms[s].freq));
    p += 4;
    ++entries;
  }
  const uint64_t dir = directory_offset_for(ndim, entries);
  for (; p < dir; ++p) out[p] = 0;
  store_le<uint32_t>(out, kMagic);
  out[4] = static_cast<uint8_t>(kVersion);
  out[5] = static_cast<uint8_t>(ndim);
  store_le<uint16_t>(out + 6, static_cast<uint16_t>(entries));
  store_le<uint32_t>(out + 8, cv);
  store_le<uint32_t>(out + 12, static_cast<uint32_t>(chunks));
  store_le<uint64_t>(out + 16, n);
  for (uint32_t d = 0; d < ndim; ++d) store_le<uint64_t>(out + kHeaderBytes + 8ull * d, shape.dims[d]);
  store_le<uint32_t>(out + kMetaChecksumOffset + 4, 0u);
  store_le<uint32_t>(out + kMetaChecksumOffset, meta_checksum(out, dir));
  return entries;
}

// One block: the metadata (no table when every chunk is raw, as on the host), chunk offsets
// (exclusive scan of padded payload sizes), the directory and the blob size.
__global__ void layout_kernel(EncWs ws, uint64_t n, ShapeArg shape, uint32_t ndim, uint32_t cv, uint64_t chunks,
                              uint8_t* out, uint64_t* out_size) {
  __shared__ uint64_t partial[1024];
  __shared__ uint32_t entries;
  const uint64_t per = (chunks + blockDim.x - 1) / blockDim.x;
  const uint64_t lo = threadIdx.x * per, hi = lo + per < chunks ? lo + per : chunks;
  uint64_t sum = 0;
  int all_raw = 1;
  for (uint64_t c = lo; c < hi; ++c) {
    sum += align4(payload_bytes(ws.entries[c], chunk_values_of(n, cv, c)));
    all_raw &= ws.entries[c].mode == kModeRaw;
  }
  partial[threadIdx.x] = sum;
  const bool any_rans = !__syncthreads_and(all_raw);  // also the barrier for `partial`
  if (threadIdx.x == 0) {
    entries = write_meta(ws.syms, any_rans, n, shape, ndim, cv, chunks, out);
    uint64_t acc = data_offset_for(ndim, entries, static_cast<uint32_t>(chunks));
    for (unsigned t = 0; t < blockDim.x; ++t) {
      const uint64_t s = partial[t];
      partial[t] = acc;
      acc += s;
    }
    ws.offsets[chunks] = acc;
    *out_size = acc;
  }
  __syncthreads();
  const uint64_t dir = directory_offset_for(ndim, entries);
  uint64_t acc = partial[threadIdx.x];
  for (uint64_t c = lo; c < hi; ++c) {
    const ChunkEntry e = ws.entries[c];
    ws.offsets[c] = acc;
    acc += align4(payload_bytes(e, chunk_values_of(n, cv, c)));
    uint8_t* d = out + dir + sizeof(ChunkEntry) * c;
    store_le<uint32_t>(d, e.mode);
    store_le<uint32_t>(d + 4, e.num_words);
    store_le<uint32_t>(d + 8, e.num_raw);
    store_le<uint32_t>(d + 12, e.checksum);
  }
}

// One block per chunk: copies its payload (states, words, raw fields; or the values) into place
// and zeroes the padding.
__global__ void pack_kernel(const uint16_t* values, uint64_t n, uint32_t cv, uint64_t chunks, EncWs ws,
                            uint8_t* out) {
  for (uint64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const uint32_t cn = chunk_values_of(n, cv, c);
    const ChunkEntry e = ws.entries[c];
    uint8_t* q = out + ws.offsets[c];
    const uint64_t used = payload_bytes(e, cn), padded = ws.offsets[c + 1] - ws.offsets[c];
    const uint64_t words_at = kStateBytes, raw_at = kStateBytes + 2ull * e.num_words;
    const uint8_t* words = chunk_scratch(ws, cv, c) + 2ull * (cn - e.num_words);
    const uint8_t* raw = chunk_scratch(ws, cv, c) + 2ull * cv;
    for (uint64_t k = threadIdx.x; k < padded; k += blockDim.x) {
      uint8_t byte = 0;
      if (k < used) {
        if (e.mode == kModeRaw) byte = reinterpret_cast<const uint8_t*>(values + c * cv)[k];
        else if (k < words_at) byte = reinterpret_cast<const uint8_t*>(ws.states + c * kLanes)[k];
        else if (k < raw_at) byte = words[k - words_at];
        else byte = raw[k - raw_at];
      }
      q[k] = byte;
    }
  }
}

// ---- decode ----
struct DecWs {
  DecodeTable* table;               // [1]
  uint64_t* offsets;                // [chunks + 1]
  Header* header;                   // [1]
  unsigned long long* first_error;  // [1]: min over failing chunks c of c << 8 | status
};

size_t carve_dec(uint64_t chunks, char* base, DecWs* ws) {
  Carver c{base};
  DecWs w;
  w.table = c.take<DecodeTable>(sizeof(DecodeTable));
  w.offsets = c.take<uint64_t>(8 * (chunks + 1));
  w.header = c.take<Header>(sizeof(Header));
  w.first_error = c.take<unsigned long long>(8);
  if (ws) *ws = w;
  return c.off;
}

// One thread: every check of the host decoder before any chunk is touched.
__global__ void validate_kernel(const uint8_t* blob, uint64_t size, uint64_t n, uint64_t max_chunks, DecWs ws,
                                int* status) {
  *ws.first_error = kNoError;
  Header h;
  int st = parse_header(blob, size, h);
  if (st == kOk && h.num_values != n) st = kErrShape;
  if (st == kOk && h.num_chunks > max_chunks) st = kErrHeader;
  uint32_t freq[kNumSymbols], start[kNumSymbols];
  if (st == kOk) st = read_table(blob, h, freq, start);
  if (st == kOk) {
    uint64_t off = h.data_offset;
    for (uint64_t c = 0; c < h.num_chunks && st == kOk; ++c) {
      const ChunkEntry e = read_entry(blob, h, c);
      const uint32_t cn = chunk_count(h, c);
      st = check_entry(h, e, cn);
      ws.offsets[c] = off;
      off += align4(payload_bytes(e, cn));
    }
    ws.offsets[h.num_chunks] = off;
    if (st == kOk && off != size) st = kErrSize;
  }
  if (st == kOk) build_decode_table(freq, start, *ws.table);  // entries only where the table has them
  *ws.header = h;
  *status = st;
}

// A raw chunk, as decode_raw_chunk; the same status in every lane.
__device__ int decode_raw_warp(const uint8_t* payload, const ChunkEntry& e, uint32_t cn, uint16_t* dst, int lane) {
  uint32_t checksum = 0;
  for (uint32_t i = lane; i < cn; i += kLanes) {
    const uint16_t v = load_le<uint16_t>(payload + 2ull * i);
    dst[i] = v;
    checksum += checksum_term(v, i);
  }
  return warp_sum(checksum) == e.checksum ? int(kOk) : int(kErrChecksum);
}

// A rANS chunk with the checks and statuses of decode_chunk (lane l holds state l; the words and
// raw fields of a step go to its lanes in lane order, as in the sequential loop). Every read is
// bounded by the chunk's counts; the same status in every lane.
__device__ int decode_rans_warp(const uint8_t* payload, const ChunkEntry& e, uint32_t cn, const DecodeTable& table,
                                uint16_t* dst, int lane) {
  const unsigned below = (1u << lane) - 1u;
  uint32_t x = load_le<uint32_t>(payload + 4 * lane);
  if (__any_sync(kFull, x < kStateLow)) return kErrStream;  // load_states
  const uint8_t* words = payload + kStateBytes;
  const uint8_t* raw = words + 2ull * e.num_words;
  const uint64_t nraw_bytes = raw_bytes(e.num_raw);
  uint32_t wpos = 0, rpos = 0, checksum = 0;
  const uint32_t steps = (cn + kLanes - 1) / kLanes;
  for (uint32_t t = 0; t < steps; ++t) {
    const uint32_t i = t * kLanes + lane;
    const bool valid = i < cn;
    bool bad = false;
    uint32_t y = x;
    const uint32_t s = dec_step(y, table);
    const bool need = valid && y < kStateLow;
    const unsigned wmask = __ballot_sync(kFull, need);
    if (need) {
      const uint32_t p = wpos + __popc(wmask & below);
      if (p < e.num_words) y = (y << 16) | load_le<uint16_t>(words + 2ull * p);
      else bad = true;
    }
    wpos += __popc(wmask);
    const bool has_raw = valid && s != uint32_t(kZeroSymbol);
    const unsigned rmask = __ballot_sync(kFull, has_raw);
    uint32_t r = 0;
    if (has_raw) {
      const uint32_t p = rpos + __popc(rmask & below);
      if (p < e.num_raw) r = read_raw_field(raw, nraw_bytes, p);
      else bad = true;
    }
    rpos += __popc(rmask);
    if (__any_sync(kFull, bad)) return kErrStream;
    if (valid) {
      x = y;
      const uint16_t v = join_value(s, r);
      dst[i] = v;
      checksum += checksum_term(v, i);
    }
  }
  // finish_chunk's checks, in its order
  if (wpos != e.num_words || rpos != e.num_raw || __any_sync(kFull, x != kStateLow)) return kErrStream;
  if (!raw_tail_zero(payload, e)) return kErrPadding;
  return warp_sum(checksum) == e.checksum ? int(kOk) : int(kErrChecksum);
}

__global__ void decode_kernel(const uint8_t* blob, uint16_t* out, DecWs ws, const int* status) {
  __shared__ DecodeTable table;
  __shared__ int valid_blob;
  if (threadIdx.x == 0) valid_blob = *status == kOk;  // one read, so the whole block agrees
  __syncthreads();
  if (!valid_blob) return;
  const Header h = *ws.header;
  if (h.num_table_entries > 0)  // else only raw chunks (or none), and no table was built
    for (int k = threadIdx.x; k < int(kProbScale); k += blockDim.x) table.entry[k] = ws.table->entry[k];
  if (threadIdx.x == 0) {
    table.zero_start = ws.table->zero_start;
    table.zero_freq = ws.table->zero_freq;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  for (uint64_t c = blockIdx.x * uint64_t(kWarpsPerBlock) + threadIdx.x / 32; c < h.num_chunks;
       c += uint64_t(gridDim.x) * kWarpsPerBlock) {
    const uint32_t cn = chunk_count(h, c);
    const ChunkEntry e = read_entry(blob, h, c);
    const uint8_t* payload = blob + ws.offsets[c];
    const uint64_t used = payload_bytes(e, cn), padded = ws.offsets[c + 1] - ws.offsets[c];
    uint16_t* dst = out + c * h.chunk_values;
    bool bad = false;
    for (uint64_t k = used + lane; k < padded; k += kLanes) bad |= payload[k] != 0;
    int st = kErrPadding;
    if (!__any_sync(kFull, bad))
      st = e.mode == kModeRaw ? decode_raw_warp(payload, e, cn, dst, lane)
                              : decode_rans_warp(payload, e, cn, table, dst, lane);
    if (lane == 0 && st != kOk) atomicMin(ws.first_error, (static_cast<unsigned long long>(c) << 8) | unsigned(st));
  }
}

// One thread: the status of the lowest failing chunk, as the host decoder reports it.
__global__ void report_kernel(DecWs ws, int* status) {
  const unsigned long long first = *ws.first_error;
  if (*status == kOk && first != kNoError) *status = static_cast<int>(first & 0xFF);
}

int grid_for(uint64_t chunks) {
  uint64_t blocks = (chunks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<int>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

}  // namespace

extern "C" {

size_t ep_lossless_encode_workspace_bytes(uint64_t num_values, uint32_t chunk_values) {
  if (chunk_values == 0) return 0;
  return carve(num_chunks_for(num_values, chunk_values), chunk_values, nullptr, nullptr);
}

size_t ep_lossless_max_blob_bytes(uint64_t num_values, uint32_t ndim, uint32_t chunk_values) {
  return max_blob_bytes(num_values, ndim, chunk_values);
}

int ep_lossless_encode_cuda(const uint16_t* values, uint64_t num_values, const int64_t* host_shape,
                            uint32_t ndim, uint32_t chunk_values, uint8_t* out, uint64_t* out_size,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (ndim > uint32_t(kMaxDims) || chunk_values < kMinChunkValues || chunk_values > kMaxChunkValues ||
      chunk_values % kLanes != 0 || num_values > kMaxValues)
    return cudaErrorInvalidValue;
  ShapeArg shape{};
  uint64_t product = 1;
  for (uint32_t d = 0; d < ndim; ++d) {
    if (host_shape[d] < 0) return cudaErrorInvalidValue;
    shape.dims[d] = static_cast<uint64_t>(host_shape[d]);
    product *= shape.dims[d];
  }
  if (product != num_values) return cudaErrorInvalidValue;
  const uint64_t chunks = num_chunks_for(num_values, chunk_values);
  if (chunks > 0xFFFFFFFFull) return cudaErrorInvalidValue;
  if (workspace_bytes < ep_lossless_encode_workspace_bytes(num_values, chunk_values)) return cudaErrorInvalidValue;
  EncWs ws;
  carve(chunks, chunk_values, static_cast<char*>(workspace), &ws);
  cudaMemsetAsync(ws.counts, 0, 8 * kNumSymbols, stream);
  if (num_values > 0) {
    uint64_t blocks = (num_values + 255) / 256;
    histogram_kernel<<<static_cast<int>(blocks < 1024 ? blocks : 1024), 256, 0, stream>>>(values, num_values,
                                                                                          ws.counts);
  }
  table_kernel<<<1, 1, 0, stream>>>(ws, num_values);
  if (chunks > 0)
    encode_kernel<<<grid_for(chunks), 32 * kWarpsPerBlock, 0, stream>>>(values, num_values, chunk_values, chunks, ws);
  layout_kernel<<<1, 1024, 0, stream>>>(ws, num_values, shape, ndim, chunk_values, chunks, out, out_size);
  if (chunks > 0) {
    const int grid = static_cast<int>(chunks < 65535 ? chunks : 65535);
    pack_kernel<<<grid, 256, 0, stream>>>(values, num_values, chunk_values, chunks, ws, out);
  }
  return static_cast<int>(cudaGetLastError());
}

size_t ep_lossless_decode_workspace_bytes(uint64_t num_values, uint32_t chunk_values) {
  if (chunk_values == 0) return 0;
  return carve_dec(num_chunks_for(num_values, chunk_values), nullptr, nullptr);
}

int ep_lossless_decode_cuda(const uint8_t* blob, uint64_t blob_bytes, uint16_t* out, uint64_t num_values,
                            uint32_t min_chunk_values, int* status, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream) {
  if (min_chunk_values < kMinChunkValues) return cudaErrorInvalidValue;
  const uint64_t max_chunks = num_chunks_for(num_values, min_chunk_values);
  if (workspace_bytes < ep_lossless_decode_workspace_bytes(num_values, min_chunk_values))
    return cudaErrorInvalidValue;
  DecWs ws;
  carve_dec(max_chunks, static_cast<char*>(workspace), &ws);
  validate_kernel<<<1, 1, 0, stream>>>(blob, blob_bytes, num_values, max_chunks, ws, status);
  if (max_chunks > 0) decode_kernel<<<grid_for(max_chunks), 32 * kWarpsPerBlock, 0, stream>>>(blob, out, ws, status);
  report_kernel<<<1, 1, 0, stream>>>(ws, status);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
