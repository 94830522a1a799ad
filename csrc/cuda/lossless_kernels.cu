// CUDA build of the lossless BF16 codec (format and coding steps: csrc/codec/lossless_core.h).
// Encode: histogram -> table (one thread, the host's normalisation) -> one warp per chunk codes
// its 32 lanes exactly as the sequential core does -> scan of chunk sizes -> packing.
// Decode: one thread validates header, table and directory -> one warp per chunk decodes.
#include <cuda_runtime.h>

#include "codec/lossless_core.h"
#include "codec_launch.h"

namespace {
using namespace ep_comm::lossless;

constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFull = 0xFFFFFFFFu;

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
  unsigned long long* counts;  // [257]
  EncSym* syms;                // [257]
  uint32_t* num_entries;       // [1]
  ChunkEntry* entries;         // [chunks]
  uint32_t* states;            // [chunks * 32]
  uint64_t* offsets;           // [chunks + 1]
  uint8_t* scratch;            // [chunks * 3 * chunk_values]: words (2 cv bytes), mantissa (cv)
};

size_t carve(uint64_t chunks, uint32_t cv, char* base, EncWs* ws) {
  Carver c{base};
  EncWs w;
  w.counts = c.take<unsigned long long>(8 * kNumSymbols);
  w.syms = c.take<EncSym>(sizeof(EncSym) * kNumSymbols);
  w.num_entries = c.take<uint32_t>(4);
  w.entries = c.take<ChunkEntry>(sizeof(ChunkEntry) * chunks);
  w.states = c.take<uint32_t>(4ull * kLanes * chunks);
  w.offsets = c.take<uint64_t>(8 * (chunks + 1));
  w.scratch = c.take<uint8_t>(3ull * cv * chunks);
  if (ws) *ws = w;
  return c.off;
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

// One thread: the table (same normalisation as the host), header, shape and table bytes.
__global__ void table_kernel(EncWs ws, uint64_t n, ShapeArg shape, uint32_t ndim, uint32_t cv, uint8_t* out) {
  uint64_t counts[kNumSymbols];
  uint32_t freq[kNumSymbols], start[kNumSymbols];
  for (int s = 0; s < kNumSymbols; ++s) counts[s] = ws.counts[s];
  uint32_t entries = 0;
  if (n > 0) {
    normalize_counts(counts, n, freq);
    cumulative(freq, start);
  } else {
    for (int s = 0; s < kNumSymbols; ++s) freq[s] = start[s] = 0;
  }
  uint64_t p = table_offset_for(ndim);
  for (int s = 0; s < kNumSymbols; ++s) {
    ws.syms[s] = make_enc_sym(start[s], freq[s]);
    if (freq[s] == 0) continue;
    store_le<uint16_t>(out + p, static_cast<uint16_t>(s));
    store_le<uint16_t>(out + p + 2, static_cast<uint16_t>(freq[s]));
    p += 4;
    ++entries;
  }
  for (; p < directory_offset_for(ndim, entries); ++p) out[p] = 0;
  *ws.num_entries = entries;
  store_le<uint32_t>(out, kMagic);
  out[4] = static_cast<uint8_t>(kVersion);
  out[5] = static_cast<uint8_t>(ndim);
  store_le<uint16_t>(out + 6, static_cast<uint16_t>(entries));
  store_le<uint32_t>(out + 8, cv);
  store_le<uint32_t>(out + 12, static_cast<uint32_t>(num_chunks_for(n, cv)));
  store_le<uint64_t>(out + 16, n);
  for (uint32_t d = 0; d < ndim; ++d) store_le<uint64_t>(out + kHeaderBytes + 8ull * d, shape.dims[d]);
  store_le<uint32_t>(out + kMetaChecksumOffset + 4, 0u);
  store_le<uint32_t>(out + kMetaChecksumOffset, meta_checksum(out, directory_offset_for(ndim, entries)));
}

__device__ uint32_t warp_sum(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// One warp per chunk; lane l owns values i with i % 32 == l, as in encode_chunk.
__global__ void encode_kernel(const uint16_t* values, uint64_t n, uint32_t cv, uint64_t chunks, EncWs ws) {
  const int lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  for (uint64_t c = blockIdx.x * uint64_t(kWarpsPerBlock) + threadIdx.x / 32; c < chunks;
       c += uint64_t(gridDim.x) * kWarpsPerBlock) {
    const uint64_t b = c * cv;
    const uint32_t cn = static_cast<uint32_t>(n - b < cv ? n - b : cv);
    const uint16_t* v = values + b;
    uint16_t* words_end = reinterpret_cast<uint16_t*>(ws.scratch + 3ull * cv * c) + cn;
    uint8_t* mant = ws.scratch + 3ull * cv * c + 2ull * cn;
    const uint32_t steps = (cn + kLanes - 1) / kLanes;
    uint32_t checksum = 0, nm = 0;
    for (uint32_t t = 0; t < steps; ++t) {
      uint32_t i = t * kLanes + lane;
      uint16_t x = i < cn ? v[i] : 0;
      unsigned nz = __ballot_sync(kFull, x != 0);
      if (x != 0) mant[nm + __popc(nz & below)] = mantissa_of(x);
      nm += __popc(nz);
      if (i < cn) checksum += checksum_term(x, i);
    }
    checksum = warp_sum(checksum);
    uint32_t x = kStateLow;
    uint32_t nw = 0;
    for (uint32_t t = steps; t-- > 0;) {
      uint32_t i = t * kLanes + lane;
      bool valid = i < cn;
      EncSym s = ws.syms[valid ? symbol_of(v[i]) : 0];
      bool need = valid && uint64_t(x) >= s.x_max;
      unsigned mask = __ballot_sync(kFull, need);
      uint32_t k = __popc(mask);
      if (need) words_end[-int64_t(nw) - int64_t(k) + __popc(mask & below)] = static_cast<uint16_t>(x & 0xFFFFu);
      nw += k;
      if (need) x >>= 16;
      if (valid) x = enc_put(x, s);
    }
    ws.states[c * kLanes + lane] = x;
    if (lane == 0) {
      ChunkEntry e{kModeRans, nw, nm, checksum};
      if (payload_bytes(e, cn) >= 2ull * cn) e = ChunkEntry{kModeRaw, 0, 0, checksum};
      ws.entries[c] = e;
    }
  }
}

// One block: chunk offsets (exclusive scan of padded payload sizes), the directory, the size.
__global__ void scan_kernel(EncWs ws, uint64_t n, uint32_t ndim, uint32_t cv, uint64_t chunks, uint8_t* out,
                            uint64_t* out_size) {
  __shared__ uint64_t partial[1024];
  const uint32_t entries = *ws.num_entries;
  const uint64_t dir = directory_offset_for(ndim, entries);
  const uint64_t per = (chunks + blockDim.x - 1) / blockDim.x;
  const uint64_t lo = threadIdx.x * per, hi = lo + per < chunks ? lo + per : chunks;
  uint64_t sum = 0;
  for (uint64_t c = lo; c < hi; ++c) {
    uint32_t cn = static_cast<uint32_t>(n - c * cv < cv ? n - c * cv : cv);
    sum += align4(payload_bytes(ws.entries[c], cn));
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t acc = data_offset_for(ndim, entries, static_cast<uint32_t>(chunks));
    for (unsigned t = 0; t < blockDim.x; ++t) {
      uint64_t s = partial[t];
      partial[t] = acc;
      acc += s;
    }
    ws.offsets[chunks] = acc;
    *out_size = acc;
  }
  __syncthreads();
  uint64_t acc = partial[threadIdx.x];
  for (uint64_t c = lo; c < hi; ++c) {
    uint32_t cn = static_cast<uint32_t>(n - c * cv < cv ? n - c * cv : cv);
    ws.offsets[c] = acc;
    acc += align4(payload_bytes(ws.entries[c], cn));
    const ChunkEntry& e = ws.entries[c];
    uint8_t* d = out + dir + sizeof(ChunkEntry) * c;
    store_le<uint32_t>(d, e.mode);
    store_le<uint32_t>(d + 4, e.num_words);
    store_le<uint32_t>(d + 8, e.num_mantissa);
    store_le<uint32_t>(d + 12, e.checksum);
  }
}

// One block per chunk: copies its payload into place and zeroes the padding.
__global__ void pack_kernel(const uint16_t* values, uint64_t n, uint32_t cv, EncWs ws, uint8_t* out) {
  const uint64_t c = blockIdx.x;
  const uint32_t cn = static_cast<uint32_t>(n - c * cv < cv ? n - c * cv : cv);
  const ChunkEntry e = ws.entries[c];
  uint8_t* q = out + ws.offsets[c];
  const uint64_t used = payload_bytes(e, cn), padded = ws.offsets[c + 1] - ws.offsets[c];
  const uint8_t* words_end = ws.scratch + 3ull * cv * c + 2ull * cn;
  const uint8_t* mant = words_end;
  for (uint64_t k = threadIdx.x; k < padded; k += blockDim.x) {
    uint8_t byte = 0;
    if (k < used) {
      if (e.mode == kModeRaw) {
        byte = reinterpret_cast<const uint8_t*>(values + c * cv)[k];
      } else if (k < kStateBytes) {
        byte = reinterpret_cast<const uint8_t*>(ws.states + c * kLanes)[k];
      } else if (k < kStateBytes + 2ull * e.num_words) {
        byte = (words_end - 2ull * e.num_words)[k - kStateBytes];
      } else {
        byte = mant[k - kStateBytes - 2ull * e.num_words];
      }
    }
    q[k] = byte;
  }
}

// ---- decode ----
struct DecWs {
  uint32_t* table;    // [kProbScale]
  uint64_t* offsets;  // [chunks + 1]
  Header* header;     // [1]
};

size_t carve_dec(uint64_t chunks, char* base, DecWs* ws) {
  Carver c{base};
  DecWs w;
  w.table = c.take<uint32_t>(4 * kProbScale);
  w.offsets = c.take<uint64_t>(8 * (chunks + 1));
  w.header = c.take<Header>(sizeof(Header));
  if (ws) *ws = w;
  return c.off;
}

// One thread: every check of the host decoder before any chunk is touched.
__global__ void validate_kernel(const uint8_t* blob, uint64_t size, uint64_t n, uint64_t max_chunks, DecWs ws,
                                int* status) {
  Header h;
  int st = parse_header(blob, size, h);
  if (st == kOk && h.num_values != n) st = kErrShape;
  if (st == kOk && h.num_chunks > max_chunks) st = kErrHeader;
  uint32_t freq[kNumSymbols], start[kNumSymbols];
  if (st == kOk) st = read_table(blob, h, freq, start);
  if (st == kOk) {
    uint64_t off = h.data_offset;
    for (uint64_t c = 0; c < h.num_chunks && st == kOk; ++c) {
      ChunkEntry e = read_entry(blob, h, c);
      uint32_t cn = chunk_count(h, c);
      st = check_entry(e, cn);
      ws.offsets[c] = off;
      off += align4(payload_bytes(e, cn));
    }
    ws.offsets[h.num_chunks] = off;
    if (st == kOk && off != size) st = kErrSize;
  }
  if (st == kOk && n > 0) build_decode_table(freq, start, ws.table);
  *ws.header = h;
  *status = st;
}

__device__ void fail(int* status, int code) { atomicCAS(status, 0, code); }

__global__ void decode_kernel(const uint8_t* blob, uint16_t* out, DecWs ws, int* status) {
  __shared__ uint32_t table[kProbScale];
  __shared__ int valid_blob;
  if (threadIdx.x == 0) valid_blob = *status == kOk;  // one read, so the whole block agrees
  __syncthreads();
  if (!valid_blob) return;
  const Header h = *ws.header;
  for (int k = threadIdx.x; k < int(kProbScale); k += blockDim.x) table[k] = ws.table[k];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  for (uint64_t c = blockIdx.x * uint64_t(kWarpsPerBlock) + threadIdx.x / 32; c < h.num_chunks;
       c += uint64_t(gridDim.x) * kWarpsPerBlock) {
    const uint32_t cn = chunk_count(h, c);
    const ChunkEntry e = read_entry(blob, h, c);
    const uint8_t* payload = blob + ws.offsets[c];
    const uint64_t used = payload_bytes(e, cn), padded = ws.offsets[c + 1] - ws.offsets[c];
    uint16_t* dst = out + c * h.chunk_values;
    bool bad = false;
    for (uint64_t k = used + lane; k < padded; k += 32) bad |= payload[k] != 0;
    if (__any_sync(kFull, bad)) {
      if (lane == 0) fail(status, kErrPadding);
      continue;
    }
    uint32_t checksum = 0;
    if (e.mode == kModeRaw) {
      for (uint32_t i = lane; i < cn; i += 32) {
        uint16_t v = load_le<uint16_t>(payload + 2ull * i);
        dst[i] = v;
        checksum += checksum_term(v, i);
      }
    } else {
      uint32_t x = load_le<uint32_t>(payload + 4 * lane);
      bad = x < kStateLow;
      const uint8_t* words = payload + kStateBytes;
      const uint8_t* mant = words + 2ull * e.num_words;
      uint32_t wpos = 0, mpos = 0;
      const uint32_t steps = (cn + kLanes - 1) / kLanes;
      for (uint32_t t = 0; t < steps && !__any_sync(kFull, bad); ++t) {
        uint32_t i = t * kLanes + lane;
        bool valid = i < cn;
        uint32_t y = x;
        uint32_t s = dec_step(y, table);
        bool need = valid && y < kStateLow;
        unsigned mask = __ballot_sync(kFull, need);
        if (need) {
          uint32_t p = wpos + __popc(mask & below);
          if (p < e.num_words) y = (y << 16) | load_le<uint16_t>(words + 2ull * p);
          else bad = true;
        }
        wpos += __popc(mask);
        if (valid) x = y;
        bool nz = valid && s != uint32_t(kZeroSymbol);
        unsigned nzmask = __ballot_sync(kFull, nz);
        uint16_t value = 0;
        if (nz) {
          uint32_t p = mpos + __popc(nzmask & below);
          if (p < e.num_mantissa) value = join_value(s, mant[p]);
          else bad = true;
        }
        mpos += __popc(nzmask);
        if (valid) {
          dst[i] = value;
          checksum += checksum_term(value, i);
        }
      }
      bad |= wpos != e.num_words || mpos != e.num_mantissa || x != kStateLow;
      if (__any_sync(kFull, bad)) {
        if (lane == 0) fail(status, kErrStream);
        continue;
      }
    }
    checksum = warp_sum(checksum);
    if (lane == 0 && checksum != e.checksum) fail(status, kErrChecksum);
  }
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
  if (workspace_bytes < ep_lossless_encode_workspace_bytes(num_values, chunk_values)) return cudaErrorInvalidValue;
  EncWs ws;
  carve(chunks, chunk_values, static_cast<char*>(workspace), &ws);
  cudaMemsetAsync(ws.counts, 0, 8 * kNumSymbols, stream);
  if (num_values > 0) {
    uint64_t blocks = (num_values + 255) / 256;
    histogram_kernel<<<static_cast<int>(blocks < 1024 ? blocks : 1024), 256, 0, stream>>>(values, num_values,
                                                                                          ws.counts);
  }
  table_kernel<<<1, 1, 0, stream>>>(ws, num_values, shape, ndim, chunk_values, out);
  if (chunks > 0)
    encode_kernel<<<grid_for(chunks), 32 * kWarpsPerBlock, 0, stream>>>(values, num_values, chunk_values, chunks, ws);
  scan_kernel<<<1, 1024, 0, stream>>>(ws, num_values, ndim, chunk_values, chunks, out, out_size);
  if (chunks > 0) pack_kernel<<<static_cast<unsigned>(chunks), 256, 0, stream>>>(values, num_values, chunk_values, ws, out);
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
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
