// CUDA build of the lossless BF16 codec (format and coding steps: csrc/codec/lossless_core.h).
// Blobs are byte-identical to the host encoder's; decoding reports the host decoder's statuses.
//
// Encode, format version 4, 5 or 6 (one memset of the histogram, the tickets and a flag, then three
// kernels; format 6's second kernel is rans_fields_kernel):
//   histogram_kernel  one warp per chunk, 32 per block, each lane reading 8 values per 16-byte
//                  load one tile ahead: the chunk's checksum and raw-field (non-zero) count, the
//                  block's symbol histogram (shared, merged by one atomic per seen symbol) -- the
//                  values are read once for all three; version 5 with chunks that may take tables
//                  of their own (own_tables_allowed) reads them a second time for the chunk's
//                  symbol counts (u32 x 1025 a chunk in the workspace). The last block to merge (a
//                  ticket taken after a fence) builds the symbol table (build_table): the host's
//                  normalisation with 11 and 12 bits (parallel argmax for the corrections), the
//                  host's choice between them (prefer_12_bits, block sums), or for a blob of one
//                  chunk of at most one_state_max_values (4,096 values in version 4; in version 5
//                  a quarter of chunk_values in [4096, 16384]) the host's choice of 6 to 12 bits
//                  (choose_one_state_prob_bits, each trial's sums in parallel), the version 4
//                  table's orders and size, the cumulative starts (block scan) and the encoder's
//                  symbol table; version 5: each symbol's cost under it (the surveys' reference);
//   rans_kernel    version 5 with own tables, phase A: chunks handed out by a ticket, each
//                  chunk's saving from a table of its own computed by its warp as the host's
//                  own_table_saving_q10 does (csrc/codec/lossless_tables.h; own_table_saving_warp,
//                  the symbols split over the lanes, in the warp's scratch slot); the block that
//                  finishes the last survey picks the takers as the host does (largest saving
//                  first, ties by lower chunk index, at most 255 and kMaxExtraTableSectionBytes,
//                  never every coding chunk: one block-wide argmax a taker), builds their tables
//                  and the shared table refitted to the other chunks where refit_pays (a warp a
//                  table: choose_prob_bits_warp, table_v4_group, the refit's sums over the lanes),
//                  then publishes a flag that the other blocks wait for (no deadlock: see
//                  rans_kernel). Phase B
//                  (every version): one warp per chunk, chunks handed out in order by a ticket;
//                  lanes = the core's 32 interleaved states, the shared table in shared memory (a
//                  chunk's own table read from the workspace), values read in 512-byte tiles one
//                  tile ahead; the raw fields packed in the same backward pass (their count is
//                  known, so each field's index is). Words and fields go to the warp's scratch
//                  slot (words ending where the fields begin); the chunk's mode as on the host (raw
//                  when coding does not pay; a blob's only small chunk coded by lane 0 with one
//                  state, mode 2; chunks of +0.0 only as mode 3); its offset by a decoupled
//                  look-back over the chunks before it (which were handed out before it, so are
//                  running: no schedule deadlocks). Format 6 (rans_fields_kernel, the same pass):
//                  before the look-back, a 32-state chunk's raw fields are coded as a field stream
//                  where the host does so (code_fields_warp: the sample of every 64th value, the
//                  stream's values compacted into the slot's field area by a ballot prefix, their
//                  counts by shared atomics, the field table chosen by the warp, the stream's rANS
//                  pass by the warp, its words in place; mode 4 when smaller); a one-state chunk's
//                  by lane 0 before its raw-or-coded choice (code_fields_one_state, mode 5).
//                  Then a coded chunk's payload goes to its place
//                  after every table chosen (states, then the slot's words and fields in one
//                  contiguous copy of 4-byte stores, zero padding). A coded chunk implies the
//                  shared table, so its place is known; raw chunks wait for layout_kernel;
//   layout_kernel  block 0: header (version 5: the extra tables' count T in byte 17), the shared
//                  table (none when no chunk is rANS-coded, as on the host; entries' gaps by a
//                  block max-scan, their first bits by a sum-scan of their code lengths, codes
//                  added into shared words), version 5's extra tables (one warp each: prob_bits,
//                  LEB128 length, write_table_v4), metadata checksum over the whole table section
//                  (block reduction), blob size; the other blocks, one warp per chunk: directory
//                  entries (version 5: the chunk's table in the mode word) and raw chunks' values
//                  into place. Version 5 as the host's pass after coding: a chunk with a table of
//                  its own that was stored raw drops it (the others renumbered; block 0 alone then
//                  moves the coded payloads down by the bytes dropped and places every chunk), and
//                  a blob of +0.0 only in several chunks is written as the fewest chunks.
// Decode (three launches, four with coded fields (formats 6 and 7); formats 2 to 7):
//   validate_kernel one block: every check of the host decoder before any chunk is touched, in
//                  parallel (the first failure in the host's order is the one reported), the
//                  chunk offsets (block scan) and the decoder's tables: the shared one, and format
//                  5's extra tables (one warp per table: read_extra_table, then the warp fills its
//                  DecodeTable in the workspace); format 6: each chunk with coded fields gets a
//                  slot of the workspace (a block scan: the caller counts them from the metadata and
//                  sizes the workspace for them);
//   fields_kernel_aligned / _unaligned  (format 6 with chunks of modes 4 and 5 only) one warp per
//                  such chunk (rebuild_fields_warp): the field header and table read by lane 0, the
//                  field stream's decoder table built in the slot, the field stream decoded (the
//                  per-step decoder's step, a zero raw section; mode 5: lane 0) into the chunk's
//                  output, and the chunk rebuilt in the slot as a mode 0 (2) payload: its states
//                  and words copied, its fields packed; or the field stream's status, which the
//                  decoder reports after the chunk's padding check, as the host does;
//   decode_kernel_staged  (blob and output 16-byte aligned) one warp per chunk, 8 per block
//                  sharing the shared decoder table in shared memory; the streams staged in
//                  per-warp shared rings by 16-byte loads, 8-step groups without bounds checks,
//                  values out by 16-byte stores (decode_rans_warp_staged); the checks of
//                  decode_chunk;
//   decode_kernel_aligned / _unaligned  (other addresses) the per-step decoder, one warp per chunk,
//                  decoder table in shared memory; the checks of decode_chunk, a failed bound
//                  reported after the chunk's loop;
//   (every decoder) each chunk decodes with its own table: the shared one from shared memory, or
//                  (format 5, a mode 0 chunk's table t >= 1) its extra table from the workspace
//                  in global memory (L1/L2-cached), a separate instantiation of the same decoder
//                  taken per warp;
//   (every decoder) a one-state chunk (mode 2) decoded by lane 0 (decode_one_state_chunk), a
//                  +0.0 chunk (mode 3) zero-filled by its warp; a format 6 chunk with coded fields
//                  decoded from its rebuilt payload in the slot as mode 0 (2);
//   (every decoder) built twice: for format 7's pair checksum, and as *_linear for formats 2 to
//                  6 (the caller passes the blob's version, which picks them);
//   report_kernel  the status of the first failing chunk, as on the host.
#include <cuda_runtime.h>

#include "codec/lossless_core.h"
#include "codec/lossless_fields.h"
#include "codec/lossless_tables.h"
#include "codec_launch.h"
#include "common/device_sync.h"
#include "launch.h"

namespace {
using namespace ep_comm::lossless;

constexpr int kWarpsPerBlock = 8;
constexpr int kBlockThreads = 32 * kWarpsPerBlock;
constexpr int kMetaThreads = 1024;  // the one-block kernels
constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr unsigned long long kNoError = ~0ull;
constexpr uint32_t kTileValues = 256;  // values per warp tile: 8 per lane, one 16-byte load each
constexpr uint32_t kFieldRing = 512;   // raw fields staged per warp before packing (bytes)
// Tuning knobs, overridable at build time (bench/gpu_prepare.sh builds variants to compare).
#ifndef EP_LOSSLESS_DEC_WARPS
#define EP_LOSSLESS_DEC_WARPS 4
#endif
#ifndef EP_LOSSLESS_DEC_UNROLL
#define EP_LOSSLESS_DEC_UNROLL 1
#endif
// 1: the per-step decoder is built for many resident warps per SM (registers capped by
// __launch_bounds__, EP_LOSSLESS_DEC_MIN_BLOCKS below; shared memory preferred over L1). It was
// built for 64 (32 registers) when it was the only decoder. One chunk per warp leaves occupancy as the
// lever (ncu on an H200, 256 MB: ~24% achieved occupancy, ~12 cycles per issued instruction);
// measured on an H200 (1 GiB, 64K-value chunks): decode 2.61 ms with it, 2.76 ms without. The
// encoder's kernels keep the compiler's register allocation (its passes over the values were
// slower with the same cap on an H200: docs/gpu.md).
#ifndef EP_LOSSLESS_FULL_OCCUPANCY
#define EP_LOSSLESS_FULL_OCCUPANCY 1
#endif
constexpr int kDecWarps = EP_LOSSLESS_DEC_WARPS;    // decoder warps per block (one chunk each)
constexpr int kDecUnroll = EP_LOSSLESS_DEC_UNROLL;  // decoder steps unrolled
// (40 resident warps, at most 48 registers: 64 warps capped them at 32, and the per-step decoder
// then spilled 12-22 bytes; tests/test_sass_codec.py allows no local memory in a codec kernel)
#ifndef EP_LOSSLESS_DEC_MIN_BLOCKS
#define EP_LOSSLESS_DEC_MIN_BLOCKS (EP_LOSSLESS_FULL_OCCUPANCY ? 40 / EP_LOSSLESS_DEC_WARPS : 1)
#endif
constexpr int kDecMinBlocks = EP_LOSSLESS_DEC_MIN_BLOCKS;  // decode
// > 0: in every decode step, lanes 0 and 1 prefetch into L1 the byte this many bytes ahead of the
// word and raw-field cursors. Why: a step's word and raw reads are dependent global loads (the
// word feeds the next step's state), so a warp waits for memory about once per step; 1 GiB
// decodes in 2.61 ms with every chunk's warp resident, about 2,500 cycles per step. Not yet
// measured on a GPU (bench/gpu_prepare.sh builds it as a variant beside the default).
#ifndef EP_LOSSLESS_DEC_PREFETCH
#define EP_LOSSLESS_DEC_PREFETCH 0
#endif
// Shared-memory carveout (percent of the unified L1/shared array) requested for the decoder with
// EP_LOSSLESS_FULL_OCCUPANCY; 100 (all shared) as measured. Prefetching into L1 needs L1 left: 16
// resident blocks use 131 KB of shared memory, so 60 leaves about 100 KB of L1.
#ifndef EP_LOSSLESS_DEC_CARVEOUT
#define EP_LOSSLESS_DEC_CARVEOUT 100
#endif
constexpr uint32_t kDecPrefetch = EP_LOSSLESS_DEC_PREFETCH;
// 1: the decoder keeps a window of each stream in registers (words: 96, raw fields: 384 bytes,
// refilled 32 words / 128 bytes at a time with coalesced loads issued steps before use) and serves
// each lane's word and field by shuffles, so no global load sits between two steps of a state.
// Not yet run on a GPU (bench/gpu_prepare.sh builds it as a variant beside the default).
#ifndef EP_LOSSLESS_DEC_WINDOW
#define EP_LOSSLESS_DEC_WINDOW 0
#endif
// 1: the default decoder's step issues its raw-field loads before it waits for its word load
// (both ballots first, then every load, then the uses), so a step waits for global memory once
// instead of twice. Why: as written by default, the word load is used (the state's
// renormalisation) before the raw fields' position is even computed, and a warp issues in order,
// so each step waits for two global load latencies one after the other; that fits the measured
// ~2,500 cycles per step (H200, 1 GiB, 64 resident warps per SM). Not yet run on a GPU
// (bench/gpu_prepare.sh builds it as a variant); CPU-tested through the CUDA emulation.
#ifndef EP_LOSSLESS_DEC_EARLY_LOADS
#define EP_LOSSLESS_DEC_EARLY_LOADS 0
#endif
// 1 (default): blobs and outputs at 16-byte aligned addresses decode on the staged decoder
// (decode_rans_warp_staged: streams staged in shared memory, 8-step groups, 16-byte stores); 0: on
// the per-step decoder above (with the options above), as before it. The staged decoder issues
// about a third of the per-step decoder's instructions per step (tests/test_sass_codec.py); its
// speed on a GPU is not yet measured (bench/gpu_prepare.sh builds the other as a variant).
#ifndef EP_LOSSLESS_DEC_STAGED
#define EP_LOSSLESS_DEC_STAGED 1
#endif

// A hint: loads the line holding *p into L1 (generic address of global memory).
__device__ __forceinline__ void prefetch_l1(const void* p) {
#ifdef EP_CUDA_EMULATION
  __builtin_prefetch(p);
#else
  asm volatile("prefetch.L1 [%0];" ::"l"(p));
#endif
}

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

// The encoder's SharedSym of a table (the encoder's symbol info in 16 bytes instead of EncSym's 32).
struct SharedSym {
  uint64_t rcp;
  uint32_t start;
  uint32_t freq;
};

// ws.table_info's words.
enum TableInfo : int {
  kInfoGapOrder = 0,   // the shared table's version 4 orders and bytes
  kInfoFreqOrder,
  kInfoSharedBytes,
  kInfoCoded,          // 1 when some chunk is rANS-coded (the blob has its tables)
  kInfoNotZero,        // 1 when some chunk is not +0.0 only (mode 3)
  kInfoTakerRaw,       // version 5: 1 when a chunk with a table of its own is stored raw (the table dropped)
  kInfoExtraTables,    // version 5: the extra tables chosen (before any is dropped)
  kInfoExtraBytes,     // version 5: their bytes with framing
  kInfoWords
};

// Encoder workspace, carved out of one allocation.
struct EncWs {
  unsigned long long* counts;        // [kNumSymbols]: the histogram (zeroed by the launcher, kSyncBytes
                                     // with the tickets and the flag below)
  unsigned long long* block_ticket;  // [1]: histogram_kernel's blocks that have merged their histogram
  unsigned long long* chunk_ticket;  // [1]: rans_kernel's chunks handed out to be coded (phase B)
  unsigned long long* survey_ticket; // [1]: version 5: rans_kernel's chunks handed out to be surveyed (phase A)
  unsigned long long* surveyed;      // [1]: version 5: the chunks surveyed
  unsigned long long* tables_ready;  // [1]: version 5: 1 once the final tables are built (release / acquire)
  unsigned long long* fields_wanted; // [1]: version 6: 1 when some chunk's fields may code smaller
                                     // (histogram_kernel: chunk_fields_may_pay); rans_fields_kernel runs
                                     // then, else rans_kernel
  EncSym* syms;                      // [kNumSymbols]: the shared table (version 5: the final one after phase A)
  ChunkEntry* entries;               // [chunks]: num_raw and checksum by histogram_kernel, the rest by rans_kernel
  unsigned long long* lookback;      // [chunks]: rans_kernel's look-back words (zeroed by histogram_kernel)
  uint64_t* offsets;                 // [chunks]: a chunk's payload offset from the first payload's
  uint32_t* table_info;              // [kInfoWords]: TableInfo
  uint8_t* scratch;                  // [slots * slot_bytes]: one slot per rans_kernel warp that codes
  uint64_t slots;                    // min(chunks, the warps of rans_kernel's grid)
  uint64_t slot_values;              // min(cv, n): the most values of a chunk
  uint64_t slot_bytes;               // kSlotGuard, words [2 slot_values], raw fields, slack, version 6's
                                     // FieldArea (own tables: at least kSurveyScratchBytes)
  // version 5 with own tables (own_tables_allowed), else null:
  uint32_t* chunk_counts;            // [chunks * kNumSymbols]: each chunk's symbol counts (histogram_kernel)
  uint64_t* shared_cost;             // [kNumSymbols]: symbol_cost_q10 under the first shared table
  uint64_t* saving;                  // [chunks]: own_table_saving_q10 (phase A)
  uint32_t* section;                 // [chunks]: the own table's bytes with framing (phase A)
  uint32_t* chunk_table;             // [chunks]: 0 = the shared table, k >= 1 = extra table k - 1
  uint32_t* extra_chunk;             // [extra = min(chunks, kMaxExtraTables)]: extra table k's chunk
  uint32_t* extra_info;              // [extra * 4]: prob_bits, gap order, frequency order, bytes
  uint32_t* extra_freq;              // [extra * kNumSymbols]
  SharedSym* extra_syms;             // [extra * kNumSymbols]
};

constexpr size_t kSyncBytes = 8 * (kNumSymbols + 6);  // counts, the four tickets and the two flags
constexpr size_t kFieldsWantedOffset = 8 * (kNumSymbols + 5);  // fields_wanted's byte offset
// A survey's scratch in a warp's slot: u64 counts[1025], then own_table_saving_q10's words.
constexpr uint64_t kSurveyScratchBytes = 8 * kNumSymbols + 4 * kOwnTableScratchWords;
constexpr uint64_t kSlotGuard = 16;  // below the words: rans_encode_one_state's store below its cursor
constexpr uint64_t kRansMaxBlocks = 2048;  // rans_kernel's grid at most (its warps take chunks by ticket)
constexpr int kRansMinBlocks = 4;          // rans_kernel's blocks resident per SM (its register bound)
// rans_fields_kernel (format 6: the field streams' table choices inlined, a one-state chunk's by lane
// 0): 2 blocks, at most 128 registers (at 3 blocks' 80 it spills)
constexpr int kRansFieldsMinBlocks = 2;
constexpr uint64_t kGridMax = 65535;

uint64_t blocks_for(uint64_t items, uint64_t per_block, uint64_t most) {
  const uint64_t b = (items + per_block - 1) / per_block;
  return b < 1 ? 1 : b < most ? b : most;
}

// A rans_kernel warp's scratch slot for chunks of at most `values` values: its chunk's words end
// at kSlotGuard + 2 values, where its packed raw fields begin; 8 bytes of slack past the longest
// raw fields for the copy's 4-byte loads.
__host__ __device__ uint64_t slot_bytes_for(uint64_t values) {
  return (kSlotGuard + 2 * values + 6 * ((values + 7) / 8) + 8 + 15) & ~15ull;
}

// Version 6: a rans_kernel slot's field area, after its words and raw fields (slot_bytes_for):
// the field stream's values w (coded in place: its words end where the values end) and the field
// table's work (the stream's symbol counts, the field table, scratch for the table's choice).
struct FieldArea {
  uint16_t* w;        // [slot values]
  uint64_t* counts;   // [kNumSymbols]
  uint32_t* freq;     // [kNumSymbols]
  uint32_t* scratch;  // [4 * kNumSymbols]: choose_one_state_prob_bits_in's, then the cumulative starts
};
__host__ __device__ constexpr uint64_t up16(uint64_t b) { return (b + 15) & ~15ull; }
__host__ __device__ uint64_t field_area_bytes(uint64_t values) {
  return up16(2 * values) + up16(8 * kNumSymbols) + up16(4 * kNumSymbols) + up16(16 * kNumSymbols);
}
__device__ FieldArea field_area(uint8_t* slot, uint64_t values) {
  uint8_t* p = slot + slot_bytes_for(values);
  FieldArea a;
  a.w = reinterpret_cast<uint16_t*>(p);
  p += up16(2 * values);
  a.counts = reinterpret_cast<uint64_t*>(p);
  p += up16(8 * kNumSymbols);
  a.freq = reinterpret_cast<uint32_t*>(p);
  p += up16(4 * kNumSymbols);
  a.scratch = reinterpret_cast<uint32_t*>(p);
  return a;
}

size_t carve(uint64_t n, uint32_t cv, uint32_t version, char* base, EncWs* ws) {
  const uint64_t chunks = num_chunks_for(n, cv), warps = kWarpsPerBlock * blocks_for(chunks, kWarpsPerBlock, kRansMaxBlocks);
  const bool own = own_tables_allowed(version, chunks, cv);
  Carver c{base};
  EncWs w;
  w.counts = c.take<unsigned long long>(kSyncBytes);
  w.block_ticket = base ? w.counts + kNumSymbols : nullptr;
  w.chunk_ticket = base ? w.counts + kNumSymbols + 1 : nullptr;
  w.survey_ticket = base ? w.counts + kNumSymbols + 2 : nullptr;
  w.surveyed = base ? w.counts + kNumSymbols + 3 : nullptr;
  w.tables_ready = base ? w.counts + kNumSymbols + 4 : nullptr;
  w.fields_wanted = base ? w.counts + kFieldsWantedOffset / 8 : nullptr;
  w.syms = c.take<EncSym>(sizeof(EncSym) * kNumSymbols);
  w.entries = c.take<ChunkEntry>(sizeof(ChunkEntry) * chunks);
  w.lookback = c.take<unsigned long long>(8 * chunks);
  w.offsets = c.take<uint64_t>(8 * chunks);
  w.table_info = c.take<uint32_t>(4 * kInfoWords);
  w.slots = chunks < warps ? chunks : warps;
  w.slot_values = n < cv ? n : cv;
  w.slot_bytes = slot_bytes_for(w.slot_values);
  if (version >= kVersion6) w.slot_bytes += field_area_bytes(w.slot_values);
  if (own && w.slot_bytes < kSurveyScratchBytes) w.slot_bytes = up16(kSurveyScratchBytes);
  w.scratch = c.take<uint8_t>(w.slots * w.slot_bytes);
  // extra tables: at most one a chunk, kMaxExtraTables in all
  const uint64_t extra = own ? (chunks < kMaxExtraTables ? chunks : kMaxExtraTables) : 0;
  const uint64_t own_chunks = own ? chunks : 0;
  w.chunk_counts = c.take<uint32_t>(4 * kNumSymbols * own_chunks);
  w.shared_cost = c.take<uint64_t>(own ? 8 * kNumSymbols : 0);
  w.saving = c.take<uint64_t>(8 * own_chunks);
  w.section = c.take<uint32_t>(4 * own_chunks);
  w.chunk_table = c.take<uint32_t>(4 * own_chunks);
  w.extra_chunk = c.take<uint32_t>(4 * extra);
  w.extra_info = c.take<uint32_t>(16 * extra);
  w.extra_freq = c.take<uint32_t>(4 * kNumSymbols * extra);
  w.extra_syms = c.take<SharedSym>(sizeof(SharedSym) * kNumSymbols * extra);
  if (!own) {
    w.chunk_counts = w.chunk_table = w.section = w.extra_chunk = w.extra_info = w.extra_freq = nullptr;
    w.shared_cost = w.saving = nullptr;
    w.extra_syms = nullptr;
  }
  if (ws) *ws = w;
  return c.off;
}

__device__ uint32_t chunk_values_of(uint64_t n, uint32_t cv, uint64_t c) {
  return static_cast<uint32_t>(n - c * cv < cv ? n - c * cv : cv);
}

__device__ uint32_t warp_sum(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// This lane's part of checksum_of values v[0, n), which are values [first, first + n) of a chunk
// (first even; mix_pairs: version 7's): lane l takes values (pairs) l, l + 32, ...
__device__ uint32_t lane_checksum(const uint16_t* v, uint32_t n, uint32_t first, bool mix_pairs, int lane) {
  uint32_t sum = 0;
  if (mix_pairs) {
    for (uint32_t j = uint32_t(lane); 2 * j < n; j += kLanes)
      sum += pair_term(uint32_t(v[2 * j]) | (2 * j + 1 < n ? uint32_t(v[2 * j + 1]) << 16 : 0u), first / 2 + j);
  } else {
    for (uint32_t i = uint32_t(lane); i < n; i += kLanes) sum += checksum_term(v[i], first + i);
  }
  return sum;
}
// The same summed over the warp (every lane calls; every lane gets checksum_of).
__device__ uint32_t warp_checksum(const uint16_t* v, uint32_t n, bool mix_pairs, int lane) {
  return warp_sum(lane_checksum(v, n, 0, mix_pairs, lane));
}

// ---- block-wide helpers (blockDim.x == kMetaThreads, every thread calls) ----
template <typename T>
__device__ T block_sum(T v, T* scratch32) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  __syncthreads();  // scratch32 may still be read by a previous call
  if ((threadIdx.x & 31) == 0) scratch32[threadIdx.x / 32] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < kMetaThreads / 32; ++w) total += scratch32[w];
  return total;
}
template <typename T>
__device__ T block_max(T v, T* scratch32) {
  for (int o = 16; o > 0; o >>= 1) {
    const T other = __shfl_xor_sync(kFull, v, o);
    v = other > v ? other : v;
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch32[threadIdx.x / 32] = v;
  __syncthreads();
  T best = scratch32[0];
  for (int w = 1; w < kMetaThreads / 32; ++w) best = scratch32[w] > best ? scratch32[w] : best;
  return best;
}
// Exclusive prefix sum over the threads in index order; *total gets the sum of all.
template <typename T>
__device__ T block_exclusive_scan(T v, T* scratch32, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  T inclusive = v;
  for (int o = 1; o < 32; o <<= 1) {
    const T up = __shfl_up_sync(kFull, inclusive, o);
    if (lane >= o) inclusive += up;
  }
  __syncthreads();
  if (lane == 31) scratch32[warp] = inclusive;
  __syncthreads();
  T before = 0, all = 0;
  for (int w = 0; w < kMetaThreads / 32; ++w) {
    if (w < warp) before += scratch32[w];
    all += scratch32[w];
  }
  *total = all;
  return before + inclusive - v;
}

// Exclusive max-scan over the threads in index order (-1 for thread 0); *total gets the max of all.
__device__ int block_exclusive_max_scan(int v, int* scratch32, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  int inclusive = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int up = __shfl_up_sync(kFull, inclusive, o);
    if (lane >= o) inclusive = up > inclusive ? up : inclusive;
  }
  int exclusive = __shfl_up_sync(kFull, inclusive, 1);
  if (lane == 0) exclusive = -1;
  __syncthreads();
  if (lane == 31) scratch32[warp] = inclusive;
  __syncthreads();
  int before = -1, all = -1;
  for (int w = 0; w < kMetaThreads / 32; ++w) {
    if (w < warp) before = scratch32[w] > before ? scratch32[w] : before;
    all = scratch32[w] > all ? scratch32[w] : all;
  }
  *total = all;
  return exclusive > before ? exclusive : before;
}

// ---- table choices by a warp or a block (every thread calls; results in every thread) ----
// The host's per-symbol loops (lossless_core.h, lossless_tables.h) split over the group's threads,
// thread r taking symbols r, r + size, ...: their sums are of integers (the same in any order) and
// their argmaxes keep the host's lowest index on ties, so the tables and decisions are the host's.
// Arrays of kNumSymbols entries in the warp's workspace or the block's shared memory.
__device__ uint64_t warp_sum64(uint64_t v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
// (a butterfly: every lane adds the same two partial sums at every step, so all lanes end equal)
__device__ double warp_sum_double(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ uint32_t warp_max(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) {
    const uint32_t other = __shfl_xor_sync(kFull, v, o);
    v = other > v ? other : v;
  }
  return v;
}

// The threads that choose a table together, every one calling, each getting the results: a warp
// (WarpGroup, rank = lane) or a block of kMetaThreads (BlockGroup, rank = thread, the sums through
// shared scratch). Thread r takes symbols r, r + kSize, ...
struct WarpGroup {
  static constexpr int kSize = kLanes;
  int rank;
  __device__ void sync() const { __syncwarp(); }
  __device__ uint32_t sum(uint32_t v) const { return warp_sum(v); }
  __device__ uint64_t sum(uint64_t v) const { return warp_sum64(v); }
  __device__ uint32_t max(uint32_t v) const { return warp_max(v); }
  __device__ bool any(bool p) const { return __any_sync(kFull, p) != 0; }
};
struct BlockGroup {
  static constexpr int kSize = kMetaThreads;
  int rank;
  uint32_t* scratch32;  // [kMetaThreads / 32] each
  uint64_t* scratch64;
  __device__ void sync() const { __syncthreads(); }
  __device__ uint32_t sum(uint32_t v) const { return block_sum<uint32_t>(v, scratch32); }
  __device__ uint64_t sum(uint64_t v) const { return block_sum<uint64_t>(v, scratch64); }
  __device__ uint32_t max(uint32_t v) const { return block_max<uint32_t>(v, scratch32); }
  __device__ bool any(bool p) const { return __syncthreads_or(p) != 0; }
};

// normalize_counts of counts[1025] (total > 0) with `prob_bits` into freq[1025] (shared or the
// warp's workspace) by group g.
template <typename Group, typename Count>
__device__ void normalize_group(const Count* counts, uint64_t total, int prob_bits, uint32_t* freq, const Group& g) {
  uint32_t mine = 0;
  for (int s = g.rank; s < kNumSymbols; s += Group::kSize) {
    freq[s] = scaled_frequency(counts[s], total, prob_bits);
    mine += freq[s];
  }
  int64_t diff = (int64_t(1) << prob_bits) - int64_t(g.sum(mine));
  while (diff != 0) {  // the corrections: the most frequent symbol (lowest index on ties)
    g.sync();
    uint32_t key = 0;
    for (int s = g.rank; s < kNumSymbols; s += Group::kSize) {
      const uint32_t k = (freq[s] << 11) | uint32_t(2047 - s);
      key = k > key ? k : key;
    }
    const int best = 2047 - int(g.max(key) & 2047u);
    uint32_t f = freq[best];
    correct_frequency(f, diff);  // in every thread alike: diff stays the group's
    g.sync();
    if (g.rank == 0) freq[best] = f;
  }
  g.sync();
}

// choose_prob_bits (lossless_tables.h) by group g: freq[1025] gets the frequencies, freq12[1025]
// is scratch; returns the probability bits.
template <typename Group, typename Count>
__device__ int choose_prob_bits_group(const Count* counts, uint64_t total, uint64_t chunks, uint32_t* freq,
                                      uint32_t* freq12, const Group& g) {
  normalize_group(counts, total, kProbBits, freq, g);
  normalize_group(counts, total, kMaxProbBits, freq12, g);
  // prefer_12_bits
  bool too_large = false;
  uint64_t cost11 = 0, cost12 = 0;
  for (int s = g.rank; s < kNumSymbols; s += Group::kSize) {
    too_large |= freq12[s] > kProbScale;
    if (freq[s] == 0) continue;
    cost11 += coded_cost_term_q10(counts[s], freq[s], kProbBits);
    cost12 += coded_cost_term_q10(counts[s], freq12[s], kMaxProbBits);
  }
  if (g.any(too_large)) return kProbBits;
  if (!(g.sum(cost12) + wide_table_margin_q10(chunks) < g.sum(cost11))) return kProbBits;
  for (int s = g.rank; s < kNumSymbols; s += Group::kSize) freq[s] = freq12[s];
  g.sync();
  return kMaxProbBits;
}
__device__ int choose_prob_bits_warp(const uint64_t* counts, uint64_t total, uint64_t chunks, uint32_t* freq,
                                     uint32_t* freq12, int lane) {
  return choose_prob_bits_group(counts, total, chunks, freq, freq12, WarpGroup{lane});
}

constexpr uint32_t kAbsent = ~0u;  // present_gaps_warp's (present_gaps_block's) entry of an absent symbol

// gaps[s] = the number of absent symbols between present symbol s (x[s] != 0) and the present one
// before it (as the version 4 table codes it), kAbsent for an absent s; returns the present count.
// Per round of 32 symbols a ballot: the previous present symbol below the lane, or the last one of
// the rounds before.
template <typename T>
__device__ uint32_t present_gaps_warp(const T* x, uint32_t* gaps, int lane) {
  int last = -1;
  uint32_t present = 0;
  for (int base = 0; base < kNumSymbols; base += kLanes) {
    const int s = base + lane;
    const bool here = s < kNumSymbols && x[s] != 0;
    const unsigned mask = __ballot_sync(kFull, here);
    const unsigned below = mask & ((1u << lane) - 1u);
    const int previous = below != 0 ? base + 31 - __clz(below) : last;
    if (s < kNumSymbols) gaps[s] = here ? uint32_t(s - previous - 1) : kAbsent;
    if (mask != 0) last = base + 31 - __clz(mask);
    present += uint32_t(__popc(mask));
  }
  __syncwarp();
  return present;
}

// The Exp-Golomb bits of the present symbols' gaps (gaps: present_gaps_warp's or
// present_gaps_block's) with order k, by group g.
template <typename Group>
__device__ uint32_t gap_bits_group(const uint32_t* gaps, uint32_t k, const Group& g) {
  uint32_t bits = 0;
  for (int s = g.rank; s < kNumSymbols; s += Group::kSize)
    if (gaps[s] != kAbsent) bits += eg_bits(gaps[s], k);
  return g.sum(bits);
}

// The version 4 table of freq[1025] (gaps: its present symbols' gaps, `present` of them) by group
// g: its orders (table_orders_v4: the lowest of the cheapest, each on its own) into kg, kf;
// returns its bytes (table_bytes_v4).
template <typename Group>
__device__ uint32_t table_v4_group(const uint32_t* freq, const uint32_t* gaps, uint32_t present, uint32_t& kg,
                                   uint32_t& kf, const Group& g) {
  uint32_t best_g = ~0u, best_f = ~0u;
  kg = kf = 0;
  for (uint32_t k = 0; k <= kMaxFreqOrder; ++k) {
    uint32_t cf = 0;
    for (int s = g.rank; s < kNumSymbols; s += Group::kSize)
      if (gaps[s] != kAbsent) cf += eg_bits(freq[s] - 1, k);
    cf = g.sum(cf);
    if (cf < best_f) best_f = cf, kf = k;
    if (k <= kMaxGapOrder) {
      const uint32_t cg = gap_bits_group(gaps, k, g);
      if (cg < best_g) best_g = cg, kg = k;
    }
  }
  return present > 0 ? 1 + (best_g + best_f + 7) / 8 : 0u;
}

// cumulative: start[s] = the sum of freq below s (32 symbols a round, a shuffle scan each).
__device__ void cumulative_warp(const uint32_t* freq, uint32_t* start, int lane) {
  uint32_t before = 0;
  for (int base = 0; base < kNumSymbols; base += kLanes) {
    const int s = base + lane;
    const uint32_t f = s < kNumSymbols ? freq[s] : 0u;
    uint32_t inclusive = f;
    for (int o = 1; o < kLanes; o <<= 1) {
      const uint32_t up = __shfl_up_sync(kFull, inclusive, o);
      if (lane >= o) inclusive += up;
    }
    if (s < kNumSymbols) start[s] = before + inclusive - f;
    before += __shfl_sync(kFull, inclusive, kLanes - 1);
  }
  __syncwarp();
}

// own_table_saving_q10 (lossless_tables.h) of chunk counts[1025] (n values, `zeros` of them
// +0.0), by the warp: the same saving and, where it is not 0, the same `section`. scratch: u32
// [3 * kNumSymbols] (the own table's frequencies, the 12-bit ones, the gaps). Its first bound sums
// floating-point terms in another order than the host's, which may decide the early exit otherwise
// only where the exact estimate returns 0 as well (the bound is below every own table's size by
// its 1e-9 share): the saving is the same either way.
__device__ uint64_t own_table_saving_warp(const uint64_t* counts, uint32_t n, uint32_t zeros,
                                          const uint64_t* shared_cost, uint32_t& section, uint32_t* scratch,
                                          int lane) {
  constexpr uint64_t kByte = 8 << 10;
  const uint64_t fixed = kByte * (kStateBytes + raw_bytes(n - zeros)), raw = kByte * 2ull * n;
  const uint64_t margin = kByte * kOwnTableMarginBytes + n;
  uint64_t shared_q10 = 0;
  double sum_c_log_c = 0.0;
  for (int s = lane; s < kNumSymbols; s += kLanes) {
    if (counts[s] == 0) continue;
    shared_q10 += counts[s] * shared_cost[s];
    sum_c_log_c += double(counts[s]) * log2(double(counts[s]));
  }
  shared_q10 = warp_sum64(shared_q10);
  sum_c_log_c = warp_sum_double(sum_c_log_c);
  const uint64_t shared_size = shared_q10 + fixed < raw ? shared_q10 + fixed : raw;
  const double entropy_q10 = 1024.0 * (double(n) * log2(double(n)) - sum_c_log_c);
  const double floor_q10 = entropy_q10 * (1.0 - 1e-9) - 1024.0;
  section = 0;
  if (floor_q10 > 0.0 && double(fixed + margin) + floor_q10 >= double(shared_size)) return 0;
  uint32_t* f = scratch;
  uint32_t* gaps = scratch + 2 * kNumSymbols;
  const uint32_t present = present_gaps_warp(counts, gaps, lane);
  uint32_t gap_bits = ~0u;
  for (uint32_t k = 0; k <= kMaxGapOrder; ++k) {
    const uint32_t bits = gap_bits_group(gaps, k, WarpGroup{lane});
    gap_bits = bits < gap_bits ? bits : gap_bits;
  }
  const uint64_t least_section = extra_table_bytes(uint32_t(1 + (uint64_t(gap_bits) + present + 7) / 8));
  if (floor_q10 > 0.0 && double(fixed + margin + kByte * least_section) + floor_q10 >= double(shared_size)) return 0;
  const uint32_t pb = uint32_t(choose_prob_bits_warp(counts, n, 1, f, scratch + kNumSymbols, lane));
  uint64_t own_q10 = 0;
  for (int s = lane; s < kNumSymbols; s += kLanes)
    if (counts[s] != 0) own_q10 += counts[s] * symbol_cost_q10(f[s], pb);
  own_q10 = warp_sum64(own_q10);
  uint32_t kg = 0, kf = 0;
  section = extra_table_bytes(table_v4_group(f, gaps, present, kg, kf, WarpGroup{lane}));  // (present: every count's f >= 1)
  const uint64_t own_payload = own_q10 + fixed;
  if (own_payload + margin >= raw) return 0;  // it would be stored raw
  const uint64_t own_size = own_payload + kByte * section;
  return own_size + margin < shared_size ? shared_size - own_size : 0;
}

// ---- value tiles: 256 values of a chunk, lane l holding values [8 l, 8 l + 8) of the tile ----
struct Tile8 {
  uint4 bits;
};
// Loads tile values [base, base + 256) of a chunk of cn values; zeros past cn. `aligned`: the
// chunk starts 16-byte aligned (then each lane's 8 values are one 16-byte load).
__device__ Tile8 fetch_tile(const uint16_t* v, uint32_t cn, uint32_t base, bool aligned, int lane) {
  Tile8 t;
  const uint32_t first = base + 8u * lane;
  if (aligned && first + 8 <= cn) {
    t.bits = __ldg(reinterpret_cast<const uint4*>(v + first));
    return t;
  }
  uint16_t h[8];
  for (int k = 0; k < 8; ++k) h[k] = first + k < cn ? v[first + k] : uint16_t(0);
  t.bits.x = h[0] | (uint32_t(h[1]) << 16);
  t.bits.y = h[2] | (uint32_t(h[3]) << 16);
  t.bits.z = h[4] | (uint32_t(h[5]) << 16);
  t.bits.w = h[6] | (uint32_t(h[7]) << 16);
  return t;
}
__device__ void store_tile(uint16_t* sh, const Tile8& t, int lane) {
  reinterpret_cast<uint4*>(sh)[lane] = t.bits;
}

// ---- encode ----
constexpr int kMetaWarps = kMetaThreads / 32;

// present_gaps_warp's gaps of x[1025] by the block (gaps in shared memory): thread t takes
// symbol t, thread 0 also the last one (after a max-scan of the present symbols' indices); returns
// the present count.
template <typename T>
__device__ uint32_t present_gaps_block(const T* x, uint32_t* gaps, int* scratch_int, uint32_t* scratch32) {
  const int t = threadIdx.x;
  const bool here = t < kNumSymbols - 1 && x[t] != 0;
  int last_present = -1;
  const int previous = block_exclusive_max_scan(here ? t : -1, scratch_int, &last_present);
  if (t < kNumSymbols - 1) gaps[t] = here ? uint32_t(t - previous - 1) : kAbsent;
  const bool last = x[kNumSymbols - 1] != 0;
  if (t == 0) gaps[kNumSymbols - 1] = last ? uint32_t(kNumSymbols - 1 - last_present - 1) : kAbsent;
  const uint32_t present = block_sum<uint32_t>(here ? 1u : 0u, scratch32) + (last ? 1u : 0u);
  __syncthreads();  // (block_sum's barriers came before thread 0's store)
  return present;
}

// One symbol table from the blob's histogram counts[1025] (shared memory), normalised exactly as the
// host encoder does (11 and 12 bits, then prefer_12_bits; for a blob of one chunk of at most
// `one_state_max` values (one_state_max_values), choose_one_state_prob_bits; all zero for n == 0):
// ws.syms and ws.table_info (orders, bytes; no chunk coded yet, no extra table), and with own tables
// (version 5) ws.shared_cost. One block of kMetaThreads threads, every thread calls.
__device__ void build_table(const unsigned long long* counts, uint64_t n, uint64_t chunks, uint32_t one_state_max,
                            const EncWs& ws) {
  __shared__ uint32_t freq[kNumSymbols], freq12[kNumSymbols], gaps[kNumSymbols];
  __shared__ uint32_t scratch32[kMetaThreads / 32];
  __shared__ uint64_t scratch64[kMetaThreads / 32];
  __shared__ int scratch_int[kMetaThreads / 32];
  const int t = threadIdx.x;
  const BlockGroup g{t, scratch32, scratch64};
  // the table's gaps: its present symbols are the counted ones (every count's frequency >= 1)
  const uint32_t present = present_gaps_block(counts, gaps, scratch_int, scratch32);
  int prob_bits = kProbBits;
  if (n > 0 && chunks == 1 && n <= one_state_max) {
    // choose_one_state_prob_bits, each trial normalised into freq12 and its sums in parallel
    uint64_t best_cost = ~0ull;
    prob_bits = kMaxProbBits;
    for (int pb = one_state_min_prob_bits(present); pb <= kMaxProbBits; ++pb) {
      normalize_group(counts, n, pb, freq12, g);
      bool too_large = false;
      uint64_t cost = 0;
      for (int s = t; s < kNumSymbols; s += kMetaThreads) {
        too_large |= freq12[s] > kProbScale;
        if (freq12[s] != 0) cost += counts[s] * symbol_cost_q10(freq12[s], uint32_t(pb));
      }
      if (g.any(too_large)) continue;
      cost = g.sum(cost);
      uint32_t kg = 0, kf = 0;
      cost += uint64_t(8 * table_v4_group(freq12, gaps, present, kg, kf, g)) << 10;
      if (cost < best_cost) {
        best_cost = cost;
        prob_bits = pb;
        for (int s = t; s < kNumSymbols; s += kMetaThreads) freq[s] = freq12[s];
      }
      __syncthreads();  // freq12 is read above before the next trial writes it
    }
    if (best_cost == ~0ull) {  // no width qualified: 11 bits
      normalize_group(counts, n, kProbBits, freq, g);
      prob_bits = kProbBits;
    }
  } else if (n > 0) {
    prob_bits = choose_prob_bits_group(counts, n, chunks, freq, freq12, g);
  } else {
    for (int s = t; s < kNumSymbols; s += kMetaThreads) freq[s] = 0;
  }
  __syncthreads();
  uint32_t kg = 0, kf = 0;
  const uint32_t table_bytes = table_v4_group(freq, gaps, present, kg, kf, g);
  if (t < kInfoWords)
    ws.table_info[t] = t == kInfoGapOrder ? kg : t == kInfoFreqOrder ? kf : t == kInfoSharedBytes ? table_bytes : 0u;
  if (ws.shared_cost != nullptr)
    for (int s = t; s < kNumSymbols; s += kMetaThreads)
      ws.shared_cost[s] = freq[s] == 0 ? 0ull : symbol_cost_q10(freq[s], uint32_t(prob_bits));
  // cumulative starts: thread t owns symbol t; thread 0 also owns the last symbol (after the scan)
  uint32_t total = 0;
  const uint32_t start = block_exclusive_scan<uint32_t>(t < kNumSymbols - 1 ? freq[t] : 0u, scratch32, &total);
  ws.syms[t] = make_enc_sym(start, freq[t], prob_bits);
  if (t == 0) ws.syms[kNumSymbols - 1] = make_enc_sym(total, freq[kNumSymbols - 1], prob_bits);
}

// Version 6: whether a chunk of `num_fields` fields (one_state: a blob's only chunk, coded with one
// state) passes the two checks code_fields_warp (code_fields_one_state) makes before it chooses a
// field table: the sample of every kFieldSampleStride-th value (`sample`, `sampled` non-zero ones;
// field_sample_may_pay) and all the fields (`all`; field_coding_may_pay). When no chunk passes,
// no chunk codes its fields, and rans_kernel writes rans_fields_kernel's blob. The entropies' sums
// split over the lanes (u64 sums: the same value in any order). Every lane calls and gets the answer.
__device__ bool chunk_fields_may_pay(const unsigned* sample, uint32_t sampled, const unsigned* all,
                                     uint32_t num_fields, bool one_state, int lane) {
  if (num_fields < min_coded_fields(one_state)) return false;
  const uint64_t log_sampled = sampled > 0 ? log2_q10_wide(sampled) : 0, log_all = log2_q10_wide(num_fields);
  uint64_t sample_bits = 0, all_bits = 0;
  for (int f = lane; f < 1 << kRawBits; f += kLanes) {
    if (sample[f] != 0) sample_bits += uint64_t(sample[f]) * (log_sampled - log2_q10_wide(sample[f]));
    if (all[f] != 0) all_bits += uint64_t(all[f]) * (log_all - log2_q10_wide(all[f]));
  }
  sample_bits = warp_sum64(sample_bits);
  all_bits = warp_sum64(all_bits);
  // field_sample_may_pay's two cases, then code_fields_warp's check over all the fields
  const bool sample_pays =
      sampled < kMinFieldSample || field_coding_may_pay(sample_bits, sampled, num_fields, one_state);
  return sample_pays && field_coding_may_pay(all_bits, num_fields, num_fields, one_state);
}

// Kernel 1: one warp per chunk (grid-stride), each lane reading 8 values per 16-byte load one tile
// ahead: the chunk's checksum and raw-field count (its ChunkEntry; its look-back word zeroed) and
// the block's histogram (shared, merged into ws.counts by one atomic per seen symbol). The last
// block to merge (the block ticket, taken after a fence) builds the symbol table from the merged
// histogram (build_table): each block's adds are ordered before its ticket, so that block sees
// them all. Version 6 (`fields`): each chunk's field counts too (its sample's and all), by shared
// atomics in the warp's counters, and ws.fields_wanted set where chunk_fields_may_pay. Version 7
// (`mix_pairs`): the pair checksum (a lane's 8 values are 4 pairs).
__global__ void __launch_bounds__(kMetaThreads) histogram_kernel(const uint16_t* values, uint64_t n, uint32_t cv,
                                                                uint64_t chunks, bool aligned, uint32_t one_state_max,
                                                                bool fields, bool mix_pairs, EncWs ws) {
  __shared__ unsigned int hist[kNumSymbols];
  __shared__ unsigned long long merged[kNumSymbols];
  // version 6: a warp's field counts, its chunk's sample's [0] and all its fields' [1]
  __shared__ unsigned int field_counts[kMetaWarps][2][1 << kRawBits];
  __shared__ int last_block;
  const int t = threadIdx.x, lane = t & 31, warp = t / 32;
  for (int s = t; s < kNumSymbols; s += kMetaThreads) hist[s] = 0;
  unsigned* sample_counts = field_counts[warp][0];
  unsigned* all_counts = field_counts[warp][1];
  unsigned* warp_counts = &field_counts[warp][0][0];  // both rows
  for (int f = lane; f < 2 << kRawBits; f += kLanes) warp_counts[f] = 0;
  __syncthreads();
  for (uint64_t c = blockIdx.x * uint64_t(kMetaWarps) + warp; c < chunks; c += uint64_t(gridDim.x) * kMetaWarps) {
    const uint32_t cn = chunk_values_of(n, cv, c);
    const uint16_t* v = values + c * cv;
    const uint32_t num_tiles = (cn + kTileValues - 1) / kTileValues;
    uint32_t checksum = 0, nr = 0, zeros = 0, sampled = 0;
    Tile8 next = fetch_tile(v, cn, 0, aligned, lane);
    for (uint32_t tt = 0; tt < num_tiles; ++tt) {
      const Tile8 tile = next;
      if (tt + 1 < num_tiles) next = fetch_tile(v, cn, (tt + 1) * kTileValues, aligned, lane);
      const uint32_t first = tt * kTileValues + 8u * lane;
      const uint32_t pairs[4] = {tile.bits.x, tile.bits.y, tile.bits.z, tile.bits.w};
      if (mix_pairs) {
#pragma unroll
        for (uint32_t k = 0; k < 4; ++k) checksum += pair_term(pairs[k], first / 2 + k);  // (0 past the end)
      }
#pragma unroll
      for (uint32_t k = 0; k < 8; ++k) {
        const uint16_t x = static_cast<uint16_t>(pairs[k / 2] >> (16 * (k % 2)));  // 0 past the end
        if (!mix_pairs) checksum += checksum_term(x, first + k);
        // one shared atomic per non-zero value (aggregating equal symbols with __match_any_sync
        // was measured 2.9x slower on an H200)
        if (x != 0) {
          ++nr;
          atomicAdd(&hist[symbol_of(x)], 1u);
          if (fields) {
            atomicAdd(&all_counts[raw_of(x)], 1u);
            if ((first + k) % kFieldSampleStride == 0) {  // (first is a multiple of 8: lanes 0, 8, ... at k = 0)
              atomicAdd(&sample_counts[raw_of(x)], 1u);
              ++sampled;
            }
          }
        } else if (first + k < cn) {
          ++zeros;
        }
      }
    }
    checksum = warp_sum(checksum);
    nr = warp_sum(nr);
    zeros = warp_sum(zeros);
    if (lane == 0) {
      if (zeros) atomicAdd(&hist[kZeroSymbol], zeros);
      ws.entries[c] = ChunkEntry{kModeRans, 0, nr, checksum};
      ws.lookback[c] = 0;
    }
    if (fields) {
      sampled = warp_sum(sampled);
      __syncwarp();  // every lane's counts added
      const bool one_state = chunks == 1 && n <= one_state_max;
      if (chunk_fields_may_pay(sample_counts, sampled, all_counts, nr, one_state, lane) && lane == 0)
        atomicMax(ws.fields_wanted, 1ull);  // (warps of any block set it) read by the next kernel
      __syncwarp();  // the counts read before they are cleared for the warp's next chunk
      for (int f = lane; f < 2 << kRawBits; f += kLanes) warp_counts[f] = 0;
      __syncwarp();
    }
    if (ws.chunk_counts != nullptr) {  // version 5 with own tables: the chunk's symbol counts, a second read
      uint32_t* own = ws.chunk_counts + c * kNumSymbols;
      for (int s = lane; s < kNumSymbols; s += kLanes) own[s] = s == kZeroSymbol ? zeros : 0u;
      __syncwarp();
      for (uint32_t i = lane; i < cn; i += kLanes) {
        const uint16_t x = v[i];
        if (x != 0) atomicAdd(&own[symbol_of(x)], 1u);
      }
    }
  }
  __syncthreads();
  for (int s = t; s < kNumSymbols; s += kMetaThreads)
    if (hist[s]) atomicAdd(&ws.counts[s], static_cast<unsigned long long>(hist[s]));
  __threadfence();
  __syncthreads();
  if (t == 0) last_block = atomicAdd(ws.block_ticket, 1ull) == gridDim.x - 1ull;
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  for (int s = t; s < kNumSymbols; s += kMetaThreads)
    merged[s] = *reinterpret_cast<volatile unsigned long long*>(&ws.counts[s]);  // from L2, not a stale L1 line
  __syncthreads();
  build_table(merged, n, chunks, one_state_max, ws);
}

// Look-back words (ws.lookback): 0 until published, then kAggregate | the chunk's padded payload
// bytes, then kInclusive | the padded payload bytes of chunks [0, c].
constexpr unsigned long long kAggregate = 1ull << 62, kInclusive = 2ull << 62, kLookBytes = (1ull << 62) - 1;

// A look-back word only grows (0, then an aggregate, then an inclusive sum): published by an
// atomic max, a relaxed store to L2 that the other warps' relaxed loads see.
__device__ void publish_lookback(unsigned long long* word, unsigned long long v) { atomicMax(word, v); }

// Chunk c's payload offset from the first payload's (the padded payload bytes of chunks [0, c)),
// chunk c's own being `bytes` (warp-uniform; every lane calls): a decoupled look-back. The chunk
// publishes its bytes, then reads its predecessors' words 32 at a time (lane l: chunk top - l,
// from top = c - 1 down), each lane spinning until its word is published, and sums them up to the
// first inclusive one; then it publishes its inclusive sum. A chunk only waits on chunks handed out
// before it (tickets, not block indices), whose warps are running and publish their own bytes
// before they wait on anything: so the wait ends on any schedule.
__device__ uint64_t lookback_offset(unsigned long long* look, uint64_t c, uint64_t bytes, int lane) {
  if (lane == 0) publish_lookback(look + c, (c == 0 ? kInclusive : kAggregate) | bytes);
  uint64_t before = 0;
  for (int64_t top = int64_t(c) - 1; top >= 0; top -= kLanes) {
    const int64_t p = top - lane;
    unsigned long long word = kInclusive;  // before chunk 0: an inclusive 0
    if (p >= 0)
      while ((word = ep_comm::ld_relaxed_sys_u64(look + p)) == 0) ep_comm::spin_pause();
    const unsigned inclusive = __ballot_sync(kFull, (word & ~kLookBytes) == kInclusive);
    const unsigned upto = inclusive ? inclusive ^ (inclusive - 1) : kFull;  // the lanes up to the first inclusive one
    before += warp_sum64((upto >> lane) & 1u ? word & kLookBytes : 0ull);
    if (inclusive) break;
  }
  if (lane == 0 && c > 0) publish_lookback(look + c, kInclusive | (before + bytes));
  return before;
}

// The 4 bytes [at, at + 4) of a segment of `len` bytes at `src` (2-byte aligned), zero from len on.
// `overread`: the 2 bytes before src and the 8 after src + len may be read (a scratch slot), so
// every load is an aligned 4-byte one; else only the segment's 2-byte halves are read.
__device__ __forceinline__ uint32_t segment_word(const uint8_t* src, uint64_t at, uint64_t len, bool overread) {
  uint32_t word;
  const uintptr_t a = reinterpret_cast<uintptr_t>(src);
  if ((a & 3) == 0 && (overread || at + 4 <= len)) {
    word = *reinterpret_cast<const uint32_t*>(src + at);
  } else if (overread) {  // src = 2 mod 4: two aligned words, funnel-shifted
    const uint32_t* w = reinterpret_cast<const uint32_t*>(src + at - 2);
    word = static_cast<uint32_t>(((uint64_t(w[1]) << 32) | w[0]) >> 16);
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(src + at);
    word = uint32_t(h[0]) | (at + 2 < len ? uint32_t(h[1]) << 16 : 0u);
  }
  if (at + 4 > len) word = at >= len ? 0u : word & ((1u << (8 * (len - at))) - 1u);
  return word;
}

// A warp's copy of a segment (segment_word's) to dst, zero-padded to `padded` bytes (a multiple
// of 4): one 4-byte store per lane and step, 128 contiguous bytes per warp store. dst is 4-byte
// aligned when `dst_aligned` (payload offsets are multiples of 4; so is the output then).
__device__ void copy_padded(uint8_t* dst, const uint8_t* src, uint64_t len, uint64_t padded, bool overread,
                            bool dst_aligned, int lane) {
  for (uint64_t at = 4ull * lane; at < padded; at += 4ull * kLanes) {
    const uint32_t word = segment_word(src, at, len, overread);
    if (dst_aligned) *reinterpret_cast<uint32_t*>(dst + at) = word;
    else store_le<uint32_t>(dst + at, word);
  }
}

// Packs the raw fields ring[8 g .. 8 g + 8) of groups [first, end) (one byte each, ring indices
// mod kFieldRing) into 6 bytes each at raw + 6 g, lanes taking groups in turn.
__device__ void pack_groups(const uint8_t* ring, uint32_t first, uint32_t end, uint8_t* raw, int lane) {
  for (uint32_t g = first + lane; g < end; g += kLanes) {
    uint64_t bytes = 0;
    for (int k = 0; k < 8; ++k) bytes |= uint64_t(ring[(8 * g + k) % kFieldRing]) << (8 * k);
    const uint64_t packed = pack6x8(bytes);
    uint16_t* dst = reinterpret_cast<uint16_t*>(raw + 6ull * g);
    for (int k = 0; k < 3; ++k) dst[k] = static_cast<uint16_t>(packed >> (16 * k));
  }
}

// One step of a warp's 32 interleaved rANS states (lane l's state x coding symbol `sym`, where
// `valid`), as the core's enc_step: the lanes that renormalise store their low 16 bits below
// words_end, lane 31's highest (the core codes lane 31 first going backwards), nw words so far.
__device__ __forceinline__ void warp_enc_step(const SharedSym& sym, bool valid, uint32_t prob_bits, unsigned below,
                                              uint16_t* words_end, uint32_t& nw, uint32_t& x) {
  const bool need = valid && uint64_t(x) >= (uint64_t(sym.freq) << (32 - prob_bits));  // enc_needs_word
  const unsigned mask = __ballot_sync(kFull, need);
  const uint32_t k = __popc(mask);
  if (need) words_end[-int64_t(nw) - int64_t(k) + __popc(mask & below)] = static_cast<uint16_t>(x & 0xFFFFu);
  nw += k;
  if (need) x >>= 16;
  if (valid) {  // enc_put
    const uint32_t q = static_cast<uint32_t>(__umul64hi(x, sym.rcp)) + (sym.freq == 1 ? x : 0u);
    x = (q << prob_bits) + (x - q * sym.freq) + sym.start;
  }
}

// The rANS pass of chunk values v[0, cn) (nr of them not +0.0) with `table` (2^prob_bits slots),
// one warp (every lane calls): lane l owns values i with i % 32 == l, as in the core
// (rans_encode_chunk); values read in 512-byte tiles one tile ahead, steps backwards (in a step lane
// 31 codes first, so its word lands highest). The same pass packs the raw fields: their count is
// known (histogram_kernel), so a value's field index is known going backwards; staged one byte a
// field in the warp's shared ring, packed 8 to 6 bytes once a group is complete. Words end at
// words_end, where the packed fields (`raw`) begin. `one_state`: only the fields here, the symbols
// coded by lane 0 after (rans_encode_one_state). Returns the words' count; x gets the lane's final
// state. Inlined at each call, so a table in shared memory is read with shared loads.
__device__ __forceinline__ uint32_t code_chunk_warp(const SharedSym* table, uint32_t prob_bits, const uint16_t* v,
                                                    uint32_t cn, uint32_t nr, bool aligned, bool one_state,
                                                    uint16_t* tile, uint8_t* ring, uint16_t* words_end, uint8_t* raw,
                                                    int lane, uint32_t& x) {
  const unsigned below = (1u << lane) - 1u;
  const uint32_t steps = (cn + kLanes - 1) / kLanes;
  const uint32_t num_tiles = (cn + kTileValues - 1) / kTileValues;
  // raw fields: those of values at or after the current step (`after`); groups from `packed` on
  // are packed; zero fields fill the last group (the last byte's unused bits)
  const uint32_t groups = (nr + 7) / 8;
  uint32_t after = 0, packed = groups;
  __syncwarp();
  if (uint32_t(lane) < 8 * groups - nr) ring[(nr + lane) % kFieldRing] = 0;
  uint32_t nw = 0;
  x = kStateLow;
  Tile8 next = fetch_tile(v, cn, (num_tiles - 1) * kTileValues, aligned, lane);
  for (uint32_t tt = num_tiles; tt-- > 0;) {
    __syncwarp();
    store_tile(tile, next, lane);
    __syncwarp();
    if (tt > 0) next = fetch_tile(v, cn, (tt - 1) * kTileValues, aligned, lane);
    for (int s = int(kTileValues / kLanes) - 1; s >= 0; --s) {
      const uint32_t t = tt * (kTileValues / kLanes) + uint32_t(s);
      if (t >= steps) continue;  // warp-uniform
      const uint32_t i = t * kLanes + lane;
      const bool valid = i < cn;
      const uint16_t value = tile[uint32_t(s) * kLanes + lane];  // 0 past the end: no field
      const unsigned nz = __ballot_sync(kFull, value != 0);
      if (value != 0) ring[(nr - after - __popc(nz) + __popc(nz & below)) % kFieldRing] = uint8_t(raw_of(value));
      after += __popc(nz);
      if (one_state) continue;
      warp_enc_step(table[valid ? symbol_of(value) : 0], valid, prob_bits, below, words_end, nw, x);
    }
    // every field of groups [ceil((nr - after) / 8), packed) is in the ring (at most 263 pending)
    __syncwarp();
    const uint32_t complete = (nr - after + 7) / 8;
    pack_groups(ring, complete, packed, raw, lane);
    packed = complete;
  }
  return nw;
}

// ---- version 6: a coded chunk's raw fields coded as a field stream (csrc/codec/lossless_fields.h) ----

// A chunk's field stream, coded: in shared memory (a warp's), so that nothing of it stays in
// registers across the look-back.
struct FieldCode {
  uint32_t words, nonzero, checksum;                 // F, Z, the stream's checksum
  uint32_t prob_bits, gap_order, freq_order, bytes;  // the field table (bytes: L)
  uint32_t x[kLanes];                                // the final field states (mode 5: x[0])
};

// The encoder's symbol info of a field table's entry (ftab: SharedSym[65], field f at f, the +0.0
// symbol at 64), as make_enc_sym makes it.
__device__ __forceinline__ uint32_t field_index(uint32_t f) { return f == 0 ? 64u : f; }
__device__ EncSym field_enc_sym(const SharedSym& s, uint32_t prob_bits) {
  EncSym e;
  e.rcp = s.rcp;
  e.start = s.start;
  e.freq = s.freq;
  e.bypass = s.freq == 1 ? ~0u : 0u;
  e.x_max = uint64_t(s.freq) << (32 - prob_bits);
  e.prob_bits = prob_bits;
  return e;
}

// The field table of counts fcounts[64] over `total` fields (prepare_field_stream's: the counts as
// the stream's symbols, choose_prob_bits or, one state, choose_one_state_prob_bits; version 4's
// orders and bytes) into a.freq and fc, its encoder entries in ftab. 32 states: the warp
// (choose_prob_bits_warp, table_v4_group), every lane calls; one state: lane 0 alone. Returns false
// when its bytes exceed kMaxFieldTableBytes.
__device__ bool field_table(const unsigned long long* fcounts, uint32_t total, bool one_state, const FieldArea& a,
                            SharedSym* ftab, FieldCode& fc, int lane) {
  const int step = one_state ? 1 : kLanes;
  for (int s = lane; s < kNumSymbols; s += step) a.counts[s] = 0;
  if (!one_state) __syncwarp();
  for (uint32_t f = lane; f < 1u << kRawBits; f += step) a.counts[field_symbol(f)] = fcounts[f];
  if (!one_state) __syncwarp();
  int pb;
  uint32_t kg = 0, kf = 0, bytes;
  if (one_state) {
    pb = choose_one_state_prob_bits_in(a.counts, total, a.freq, a.scratch);
    table_orders_v4_in(a.freq, kg, kf, a.scratch, a.scratch + kNumSymbols);
    bytes = table_bytes_v4(a.freq, kg, kf);
  } else {
    pb = choose_prob_bits_warp(a.counts, total, 1, a.freq, a.scratch, lane);
    const uint32_t present = present_gaps_warp(a.freq, a.scratch + kNumSymbols, lane);
    bytes = table_v4_group(a.freq, a.scratch + kNumSymbols, present, kg, kf, WarpGroup{lane});
  }
  if (bytes > kMaxFieldTableBytes) return false;
  if (lane == 0) {
    fc.prob_bits = uint32_t(pb);
    fc.gap_order = kg;
    fc.freq_order = kf;
    fc.bytes = bytes;
  }
  if (one_state) {
    cumulative(a.freq, a.scratch, pb);
  } else {
    cumulative_warp(a.freq, a.scratch, lane);
  }
  for (uint32_t j = lane; j <= 64; j += step) {
    const uint32_t sym = j < 64 ? j : uint32_t(kZeroSymbol);
    const EncSym e = make_enc_sym(a.scratch[sym], a.freq[sym], pb);
    ftab[j] = SharedSym{e.rcp, e.start, e.freq};
  }
  if (!one_state) __syncwarp();
  return true;
}

// A mode 0 chunk (values v[0, cn); e: its entry, its words in the slot) recoded as mode 4 where
// the host encoder does so (fields_may_pay, prepare_field_stream, finish_field_stream: the same
// integer decisions): true with fc filled and e turned into mode 4; false, e unchanged,
// otherwise. One warp, every lane calls. fcounts: the warp's u64[64] in shared memory, ftab its
// SharedSym[65].
// The sample's and the fields' counts by shared atomics; the field stream's values (w_k = the k-th
// field << 6) stored in a.w by a ballot's prefix; its rANS pass as code_chunk_warp's, lane l coding
// the fields k = l mod 32, its words written backwards in place below w + num_raw: after step t
// (fields [32 t, num_raw) coded) at most num_raw - 32 t words are written (one a value at most),
// so they lie at or above field 32 t, which that step read before its ballot.
__device__ bool code_fields_warp(const uint16_t* v, uint32_t cn, bool mix_pairs, ChunkEntry& e, const FieldArea& a,
                                 unsigned long long* fcounts, SharedSym* ftab, int lane, FieldCode& fc) {
  const uint32_t nr = e.num_raw;
  const unsigned below = (1u << lane) - 1u;
  if (nr < min_coded_fields(false)) return false;
  __syncwarp();
  fcounts[lane] = fcounts[lane + kLanes] = 0;
  __syncwarp();
  uint32_t sampled = 0;
  for (uint64_t i = uint64_t(kFieldSampleStride) * lane; i < cn; i += uint64_t(kFieldSampleStride) * kLanes) {
    const uint16_t value = v[i];
    if (value == 0) continue;
    atomicAdd(&fcounts[raw_of(value)], 1ull);
    ++sampled;
  }
  sampled = warp_sum(sampled);
  __syncwarp();
  int go = 0;
  if (lane == 0)
    go = field_sample_may_pay(reinterpret_cast<const uint64_t*>(fcounts), sampled, nr, false) ? 1 : 0;
  if (__shfl_sync(kFull, go, 0) == 0) return false;
  fcounts[lane] = fcounts[lane + kLanes] = 0;
  __syncwarp();
  uint32_t after = 0;
  for (uint32_t base = 0; base < cn; base += kLanes) {
    const uint32_t i = base + lane;
    const uint16_t value = i < cn ? v[i] : uint16_t(0);
    const unsigned nz = __ballot_sync(kFull, value != 0);
    if (value != 0) {
      const uint32_t k = after + __popc(nz & below);
      a.w[k] = static_cast<uint16_t>(raw_of(value) << kRawBits);
      atomicAdd(&fcounts[raw_of(value)], 1ull);
    }
    after += __popc(nz);
  }
  __syncwarp();  // the counts and the values stored
  const uint32_t checksum = warp_checksum(a.w, nr, mix_pairs, lane);
  int pays = 0;
  if (lane == 0)
    pays = field_coding_may_pay(field_entropy_q10(reinterpret_cast<const uint64_t*>(fcounts), nr), nr, nr, false);
  if (__shfl_sync(kFull, pays, 0) == 0 || !field_table(fcounts, nr, false, a, ftab, fc, lane)) return false;
  const uint32_t pb = fc.prob_bits;
  uint32_t x = kStateLow, nw = 0;
  uint16_t* words_end = a.w + nr;
  for (uint32_t t = (nr + kLanes - 1) / kLanes; t-- > 0;) {
    const uint32_t k = t * kLanes + lane;
    const bool valid = k < nr;
    warp_enc_step(ftab[field_index(valid ? uint32_t(a.w[k]) >> kRawBits : 0u)], valid, pb, below, words_end, nw, x);
  }
  const uint32_t bytes = fc.bytes;
  const uint64_t coded = 2 * kStateBytes + field_prefix_bytes(bytes) + 2ull * e.num_words + 2ull * nw;
  if (coded >= payload_bytes(e, cn)) return false;
  fc.x[lane] = x;
  if (lane == 0) {
    fc.words = nw;
    fc.nonzero = nr - static_cast<uint32_t>(fcounts[0]);
    fc.checksum = checksum;
  }
  __syncwarp();
  e = ChunkEntry{kModeCodedFields, static_cast<uint32_t>(field_prefix_bytes(bytes) / 2 + e.num_words + nw), nr,
                 e.checksum};
  return true;
}

// A blob's only chunk, coded with one state (mode 2: values v[0, cn), entry e), recoded as mode 5
// where the host encoder does so (as code_fields_warp, with one state: the field stream coded in
// order by rans_encode_one_state's steps, in place as there). Lane 0 alone.
__device__ bool code_fields_one_state(const uint16_t* v, uint32_t cn, bool mix_pairs, ChunkEntry& e, const FieldArea& a,
                                      unsigned long long* fcounts, SharedSym* ftab, FieldCode& fc) {
  const uint32_t nr = e.num_raw;
  if (nr < min_coded_fields(true)) return false;
  const uint64_t* counts = reinterpret_cast<const uint64_t*>(fcounts);
  for (uint32_t f = 0; f < 1u << kRawBits; ++f) fcounts[f] = 0;
  uint32_t sampled = 0;
  for (uint32_t i = 0; i < cn; i += kFieldSampleStride) {
    if (v[i] == 0) continue;
    ++fcounts[raw_of(v[i])];
    ++sampled;
  }
  if (!field_sample_may_pay(counts, sampled, nr, true)) return false;
  for (uint32_t f = 0; f < 1u << kRawBits; ++f) fcounts[f] = 0;
  uint32_t k = 0;
  for (uint32_t i = 0; i < cn; ++i) {
    if (v[i] == 0) continue;
    a.w[k++] = static_cast<uint16_t>(raw_of(v[i]) << kRawBits);
    ++fcounts[raw_of(v[i])];
  }
  const uint32_t checksum = checksum_of(a.w, nr, 0, mix_pairs);
  if (!field_coding_may_pay(field_entropy_q10(counts, nr), nr, nr, true)) return false;
  if (!field_table(fcounts, nr, true, a, ftab, fc, 0)) return false;
  uint32_t x = kStateLow;
  uint16_t* const words_end = a.w + nr;
  uint16_t* cursor = words_end;
  for (uint32_t j = nr; j-- > 0;)  // enc_step stores at cursor[-1], at or above field j, read first
    x = enc_step(x, field_enc_sym(ftab[field_index(uint32_t(a.w[j]) >> kRawBits)], fc.prob_bits), cursor);
  const uint32_t nw = static_cast<uint32_t>(words_end - cursor);
  const uint64_t coded = 2 * kOneStateBytes + field_prefix_bytes(fc.bytes) + 2ull * e.num_words + 2ull * nw;
  if (coded >= payload_bytes(e, cn)) return false;
  fc.words = nw;
  fc.nonzero = nr - static_cast<uint32_t>(fcounts[0]);
  fc.checksum = checksum;
  fc.x[0] = x;
  e = ChunkEntry{kModeOneStateFields, static_cast<uint32_t>(field_prefix_bytes(fc.bytes) / 2 + e.num_words + nw),
                 nr, e.checksum};
  return true;
}

// A mode 4 or 5 chunk's payload (entry e, fc its field stream; its symbols' states x, its symbol
// words the S words before `symbol_words_end` in the slot, its field words the F words before
// a.w + num_raw, its field table a.freq) at q: the two state blocks, the field header, the table,
// then the words, zero-padded to a multiple of 4 bytes. One warp, every lane calls.
__device__ void store_fields_payload(uint8_t* q, const ChunkEntry& e, uint32_t cn, uint32_t symbol_words,
                                     const uint16_t* symbol_words_end, const FieldArea& a, const FieldCode& fc,
                                     uint32_t x, bool out_aligned, int lane) {
  const uint64_t sb = field_state_bytes(e);
  if (uint64_t(lane) < sb / 4) {
    store_le<uint32_t>(q + 4 * lane, x);
    store_le<uint32_t>(q + sb + 4 * lane, fc.x[lane]);
  }
  uint8_t* h = q + 2 * sb;
  const uint64_t prefix = field_prefix_bytes(fc.bytes);
  if (lane == 0)
    write_field_prefix(h, symbol_words, fc.nonzero, fc.checksum, fc.prob_bits, fc.bytes, a.freq, fc.gap_order,
                       fc.freq_order);
  const uint64_t symbol_bytes = 2ull * symbol_words;
  copy_padded(h + prefix, reinterpret_cast<const uint8_t*>(symbol_words_end - symbol_words), symbol_bytes,
              align4(symbol_bytes), true, out_aligned, lane);
  __syncwarp();  // a padding half-word the field words overwrite is stored first
  uint8_t* fw = h + prefix + symbol_bytes;
  const uint16_t* src = a.w + e.num_raw - fc.words;
  for (uint32_t k = lane; k < fc.words; k += kLanes) store_le<uint16_t>(fw + 2ull * k, src[k]);
  const uint64_t end = payload_bytes(e, cn);
  if (lane == 0)
    for (uint64_t b = end; b < align4(end); ++b) q[b] = 0;
}

// A survey's scratch in a warp's slot: u64 counts[1025], then own_table_saving_q10's words.
__device__ uint64_t* survey_counts(uint8_t* slot) { return reinterpret_cast<uint64_t*>(slot); }
__device__ uint32_t* survey_scratch(uint8_t* slot) { return reinterpret_cast<uint32_t*>(slot + 8 * kNumSymbols); }

// Version 5, phase A: chunk c's saving from a table of its own (own_table_saving_q10 of its counts,
// by the warp in its slot: own_table_saving_warp; 0 for a chunk under kMinOwnTableValues values or
// of +0.0 only, as on the host) into ws.saving[c] and ws.section[c]; its table 0 until final_tables. One warp, every lane
// calls.
__device__ void survey_chunk(uint64_t n, uint32_t cv, uint64_t c, const EncWs& ws, uint8_t* slot, int lane) {
  const uint32_t cn = chunk_values_of(n, cv, c), zeros = cn - ws.entries[c].num_raw;
  uint64_t saving = 0;
  uint32_t section = 0;
  if (cn >= kMinOwnTableValues && zeros != cn) {
    uint64_t* counts = survey_counts(slot);
    const uint32_t* own = ws.chunk_counts + c * kNumSymbols;
    for (int s = lane; s < kNumSymbols; s += kLanes) counts[s] = own[s];
    __syncwarp();
    saving = own_table_saving_warp(counts, cn, zeros, ws.shared_cost, section, survey_scratch(slot), lane);
    __syncwarp();  // the slot is read before the warp's next survey writes it
  }
  if (lane == 0) {
    ws.saving[c] = saving;
    ws.section[c] = section;
    ws.chunk_table[c] = 0;
  }
}

// The later of two candidates (saving, chunk) in own_table_before's order; chunk ~0: none.
__device__ void keep_first_taker(uint64_t& s, uint64_t& c, uint64_t os, uint64_t oc) {
  if (oc != ~0ull && (c == ~0ull || own_table_before(os, oc, s, c))) s = os, c = oc;
}

// Version 5, phase A's end: the host's build_final_tables, by one block of kBlockThreads threads
// (every thread calls) while no chunk is surveyed or coded (every survey is done, no chunk coded
// before ws.tables_ready): the takers, their extra tables (ws.chunk_table, extra_chunk, extra_info,
// extra_freq, extra_syms; table_info's kInfoExtraTables and kInfoExtraBytes) and the shared table,
// refitted where refit_pays (ws.syms, table_info's orders and bytes). `pool`: 16,400 bytes of
// shared memory.
__device__ void final_tables(uint64_t n, uint32_t cv, uint64_t chunks, const EncWs& ws, unsigned char* pool) {
  __shared__ uint32_t picked[kMaxExtraTables];
  __shared__ uint32_t num_picked, fitted_bits;
  __shared__ unsigned long long used, keepers, zero_values, total;
  __shared__ uint64_t best_saving[kWarpsPerBlock], best_chunk[kWarpsPerBlock];
  const int t = threadIdx.x, lane = t & 31, warp = t / 32;
  if (t == 0) {
    num_picked = fitted_bits = 0;
    used = keepers = zero_values = total = 0;
  }
  __syncthreads();
  // The takers, one a round: the first in own_table_before's order, after the previous taker, of
  // the chunks with a saving whose table fits in the bytes left. The host's greedy pass over the
  // chunks sorted in that order takes the same ones: a chunk it passes over did not fit in bytes
  // left that only shrink after, and the bytes left only change at a taker.
  uint64_t prev_s = 0, prev_c = ~0ull;
  for (;;) {
    if (num_picked == kMaxExtraTables) break;  // (block-uniform)
    const uint64_t room_used = used;
    uint64_t bs = 0, bc = ~0ull;
    for (uint64_t c = t; c < chunks; c += kBlockThreads) {
      const uint64_t s = ws.saving[c];
      if (s == 0 || (prev_c != ~0ull && !own_table_before(prev_s, prev_c, s, c))) continue;
      if (own_table_fits(room_used, ws.section[c])) keep_first_taker(bs, bc, s, c);
    }
    for (int o = 16; o > 0; o >>= 1) {
      const uint64_t os = __shfl_xor_sync(kFull, bs, o), oc = __shfl_xor_sync(kFull, bc, o);
      keep_first_taker(bs, bc, os, oc);
    }
    if (lane == 0) best_saving[warp] = bs, best_chunk[warp] = bc;
    __syncthreads();
    for (int w = 0; w < kWarpsPerBlock; ++w) keep_first_taker(bs, bc, best_saving[w], best_chunk[w]);
    __syncthreads();  // best_* read before the next round writes them; num_picked and used read
    if (bc == ~0ull) break;  // (block-uniform)
    if (t == 0) {
      picked[num_picked++] = static_cast<uint32_t>(bc);
      used += ws.section[bc];
    }
    prev_s = bs, prev_c = bc;
    __syncthreads();
  }
  uint32_t np = num_picked;
  for (uint32_t k = t; k < np; k += kBlockThreads) ws.chunk_table[picked[k]] = 1;
  __syncthreads();
  // keepers: the chunks that keep the shared table and code symbols; the +0.0 of chunks of +0.0 only
  unsigned long long my_keepers = 0, my_zeros = 0;
  for (uint64_t c = t; c < chunks; c += kBlockThreads) {
    if (ws.entries[c].num_raw == 0) my_zeros += chunk_values_of(n, cv, c);
    else if (ws.chunk_table[c] == 0) ++my_keepers;
  }
  atomicAdd(&keepers, my_keepers);
  atomicAdd(&zero_values, my_zeros);
  __syncthreads();
  if (keepers == 0 && np > 0) {  // (block-uniform: every thread reads keepers before thread 0 sets it)
    __syncthreads();  // never every chunk that codes symbols: the lowest taker keeps the shared table
    if (t == 0) {
      uint32_t lowest = 0;
      for (uint32_t k = 1; k < np; ++k) lowest = picked[k] < picked[lowest] ? k : lowest;
      ws.chunk_table[picked[lowest]] = 0;
      picked[lowest] = picked[np - 1];
      num_picked = np - 1;
      keepers = 1;
    }
    __syncthreads();
    np = num_picked;
  }
  const uint64_t kp = keepers;
  // extra tables numbered in chunk order, as on the host
  for (uint32_t k = t; k < np; k += kBlockThreads) {
    uint32_t rank = 0;
    for (uint32_t j = 0; j < np; ++j) rank += picked[j] < picked[k];
    ws.chunk_table[picked[k]] = rank + 1;
    ws.extra_chunk[rank] = picked[k];
  }
  __syncthreads();
  // the keepers' symbols (the blob's less the takers' and the +0.0 of chunks of +0.0 only), which
  // the shared table is refitted to where refit_pays; as on the host, no refit when no chunk left
  // the shared table (total == n: the first table again)
  uint64_t* counts = reinterpret_cast<uint64_t*>(pool);
  uint32_t* fitted = reinterpret_cast<uint32_t*>(pool + 8 * kNumSymbols);
  uint32_t* fitted_start = fitted + kNumSymbols;
  unsigned long long my_total = 0;
  for (int s = t; s < kNumSymbols; s += kBlockThreads) {
    uint64_t v = ws.counts[s];
    for (uint32_t k = 0; k < np; ++k) v -= ws.chunk_counts[uint64_t(ws.extra_chunk[k]) * kNumSymbols + s];
    if (s == kZeroSymbol) v -= zero_values;
    counts[s] = v;
    my_total += v;
  }
  atomicAdd(&total, my_total);
  __syncthreads();
  // tables 0 to np - 1: the extra ones (the host's choose_frequencies and finish_table); table np:
  // the refit (choose_frequencies, the table's orders and refit_pays). A warp with a slot each, in
  // the slot's scratch (choose_prob_bits_warp, table_v4_group); the warp's lanes fill an extra
  // table's symbol table, the block the refitted one's.
  const uint32_t tables = np + (total > 0 && total < n ? 1u : 0u);
  const uint32_t table_warps = ws.slots < uint64_t(kWarpsPerBlock) ? uint32_t(ws.slots) : uint32_t(kWarpsPerBlock);
  if (uint32_t(warp) < table_warps) {
    uint8_t* slot = ws.scratch + uint64_t(warp) * ws.slot_bytes;
    uint32_t* scratch = survey_scratch(slot);
    for (uint32_t k = warp; k < tables; k += table_warps) {
      const bool refit = k == np;
      const uint64_t c = refit ? 0 : ws.extra_chunk[k];
      const uint64_t* table_counts = counts;
      if (!refit) {
        uint64_t* own_counts = survey_counts(slot);
        const uint32_t* own = ws.chunk_counts + c * kNumSymbols;
        for (int s = lane; s < kNumSymbols; s += kLanes) own_counts[s] = own[s];
        __syncwarp();
        table_counts = own_counts;
      }
      uint32_t* freq = refit ? fitted : ws.extra_freq + uint64_t(k) * kNumSymbols;
      const int pb = choose_prob_bits_warp(table_counts, refit ? uint64_t(total) : chunk_values_of(n, cv, c),
                                           refit ? kp : 1ull, freq, scratch, lane);
      const uint32_t present = present_gaps_warp(freq, scratch + kNumSymbols, lane);
      uint32_t kg = 0, kf = 0;
      const uint32_t bytes = table_v4_group(freq, scratch + kNumSymbols, present, kg, kf, WarpGroup{lane});
      if (refit) {
        uint64_t first_q10 = 0, fitted_q10 = 0;
        for (int s = lane; s < kNumSymbols; s += kLanes) {
          if (counts[s] == 0) continue;
          first_q10 += counts[s] * ws.shared_cost[s];
          fitted_q10 += counts[s] * symbol_cost_q10(freq[s], uint32_t(pb));
        }
        const uint32_t first_bytes = ws.table_info[kInfoSharedBytes];
        if (refit_pays_sums(warp_sum64(first_q10), warp_sum64(fitted_q10), total, kp, first_bytes, bytes)) {
          cumulative_warp(freq, fitted_start, lane);
          if (lane == 0) {
            ws.table_info[kInfoGapOrder] = kg;
            ws.table_info[kInfoFreqOrder] = kf;
            ws.table_info[kInfoSharedBytes] = bytes;
            fitted_bits = uint32_t(pb);
          }
        }
        continue;
      }
      cumulative_warp(freq, scratch, lane);
      uint32_t* info = ws.extra_info + 4ull * k;
      if (lane == 0) {
        info[0] = uint32_t(pb);
        info[1] = kg;
        info[2] = kf;
        info[3] = bytes;
      }
      for (int s = lane; s < kNumSymbols; s += kLanes) {
        const EncSym e = make_enc_sym(scratch[s], freq[s], pb);
        ws.extra_syms[uint64_t(k) * kNumSymbols + s] = SharedSym{e.rcp, e.start, e.freq};
      }
      __syncwarp();  // the slot is read before the warp's next table writes it
    }
  }
  __syncthreads();
  if (t == 0) {
    uint32_t extra_bytes = 0;
    for (uint32_t k = 0; k < np; ++k) extra_bytes += extra_table_bytes(ws.extra_info[4 * k + 3]);
    ws.table_info[kInfoExtraTables] = np;
    ws.table_info[kInfoExtraBytes] = extra_bytes;
  }
  if (fitted_bits != 0)
    for (int s = t; s < kNumSymbols; s += kBlockThreads)
      ws.syms[s] = make_enc_sym(fitted_start[s], fitted[s], int(fitted_bits));
}

// Kernel 2: one warp per chunk, 8 per block.
// Version 5 with own tables (own_tables_allowed), phase A first: chunks handed out by a ticket
// (ws.survey_ticket) to the warps with a scratch slot, each chunk's saving from a table of its own
// (survey_chunk); the block whose warp finishes the last survey (a count taken after a fence)
// builds the final tables (final_tables) and publishes ws.tables_ready (release); every other block
// waits for it (acquire). No schedule deadlocks: a block waits only once its warps found the
// survey tickets exhausted, so every survey was handed to a running warp, which finishes it
// without waiting on anything, and the block that finishes the last one is running and builds the
// tables without waiting on another block.
// Phase B (every version): chunks handed out by ticket (ws.chunk_ticket) in order, each coded with
// its table (code_chunk_warp: the shared table from shared memory, an extra table from the
// workspace) into the warp's scratch slot. The chunk's mode as on the host (raw when coding does
// not pay; +0.0 only: mode 3; a blob's only chunk of at most one_state_max values: one state,
// mode 2, coded by lane 0), then its offset (lookback_offset) and its payload into its final place
// after every table chosen (a chunk with a table of its own stored raw drops it: layout_kernel
// then moves the payloads down): states from registers, then the slot's words and fields as one
// contiguous copy. Raw chunks are left to layout_kernel, which knows whether the blob has a table
// (the first payload's offset); a coded chunk means it does.
// Traffic per value: the values read once (2 bytes), words and fields written to the slot and read
// back by the same warp right after the look-back, the payload written once.
// (__launch_bounds__: at most 64 registers a thread, so that 4 blocks, 32 warps, stay resident on an
// SM for the coding pass; unbounded, version 5's serial table code takes the kernel to 96
// registers and 2 blocks. Bounded, it compiles without spills: tests/test_sass_codec.py.)
// Version 6 (rans_fields_kernel): the same with code_fields, each coded chunk's raw fields then
// coded as a field stream where the host encoder does so (code_fields_warp; a one-state chunk:
// code_fields_one_state), its payload stored by store_fields_payload.
// (The kernels are not templates: the CUDA emulation poisons a kernel's __shared__ statics, which
// a template's would escape; their body is.)
struct RansShared {
  // the shared table's SharedSym[kNumSymbols]; in phase A's last block, final_tables' arrays first
  __align__(16) unsigned char pool[sizeof(SharedSym) * kNumSymbols];
  __align__(16) uint16_t tiles[kWarpsPerBlock][kTileValues];
  __align__(16) SharedSym field_tables[kWarpsPerBlock][65];  // version 6: a warp's field table
  FieldCode field_codes[kWarpsPerBlock];                     // and its field stream
  __align__(8) uint8_t rings[kWarpsPerBlock][kFieldRing];
  int last_survey;
};
template <bool code_fields>
__device__ __forceinline__ void rans_pass(const uint16_t* values, uint64_t n, uint32_t cv, uint64_t chunks,
                                          bool aligned, const EncWs& ws, uint64_t table_at, uint8_t* out,
                                          bool out_aligned, uint32_t one_state_max, bool mix_pairs, RansShared& sh) {
  unsigned char* pool = sh.pool;
  auto& tiles = sh.tiles;
  auto& rings = sh.rings;
  auto& field_tables = sh.field_tables;
  auto& field_codes = sh.field_codes;
  int& last_survey = sh.last_survey;
  SharedSym* syms = reinterpret_cast<SharedSym*>(pool);
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const uint64_t slot_index = uint64_t(blockIdx.x) * kWarpsPerBlock + warp;
  const bool has_slot = slot_index < ws.slots;  // more warps than chunks: this one takes none
  uint8_t* slot = ws.scratch + (has_slot ? slot_index : 0) * ws.slot_bytes;
  const bool own_tables = ws.chunk_table != nullptr;
  if (own_tables) {
    if (threadIdx.x == 0) last_survey = 0;
    __syncthreads();
    while (has_slot) {
      unsigned long long ticket = 0;
      if (lane == 0) ticket = atomicAdd(ws.survey_ticket, 1ull);
      const uint64_t c = __shfl_sync(kFull, ticket, 0);
      if (c >= chunks) break;
      survey_chunk(n, cv, c, ws, slot, lane);
      if (lane == 0) {
        __threadfence();  // the survey's stores before its count
        if (atomicAdd(ws.surveyed, 1ull) == chunks - 1) last_survey = 1;
      }
    }
    __syncthreads();
    if (last_survey) {
      __threadfence();  // every survey's stores, ordered before the counts this block saw
      final_tables(n, cv, chunks, ws, pool);
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) ep_comm::st_release_sys(reinterpret_cast<int*>(ws.tables_ready), 1);
    } else {
      if (threadIdx.x == 0)
        while (ep_comm::ld_acquire_sys(reinterpret_cast<const int*>(ws.tables_ready)) == 0) ep_comm::spin_pause();
      __syncthreads();
      __threadfence();
    }
  }
  for (int s = threadIdx.x; s < kNumSymbols; s += blockDim.x) {
    const EncSym e = ws.syms[s];
    syms[s] = SharedSym{e.rcp, e.start, e.freq};
  }
  __syncthreads();
  if (!has_slot) return;
  const uint32_t prob_bits = ws.syms[0].prob_bits, shared_bytes = ws.table_info[kInfoSharedBytes];
  // every table chosen: a coded chunk's payload goes after them
  const uint64_t data_at = data_offset_at(table_at, shared_bytes + ws.table_info[kInfoExtraBytes],
                                          static_cast<uint32_t>(chunks));
  const bool one_state = chunks == 1 && n <= one_state_max;
  uint16_t* tile = tiles[warp];
  uint8_t* ring = rings[warp];
  uint16_t* words_end = reinterpret_cast<uint16_t*>(slot + kSlotGuard) + ws.slot_values;
  uint8_t* raw = reinterpret_cast<uint8_t*>(words_end);
  for (;;) {
    unsigned long long ticket = 0;
    if (lane == 0) ticket = atomicAdd(ws.chunk_ticket, 1ull);
    const uint64_t c = __shfl_sync(kFull, ticket, 0);
    if (c >= chunks) break;
    const uint32_t cn = chunk_values_of(n, cv, c);
    const uint16_t* v = values + c * cv;
    const ChunkEntry counted = ws.entries[c];
    const uint32_t nr = counted.num_raw;
    const uint32_t table = own_tables ? ws.chunk_table[c] : 0u;
    uint32_t x = kStateLow, nw = 0;
    if (table == 0) {
      nw = code_chunk_warp(syms, prob_bits, v, cn, nr, aligned, one_state, tile, ring, words_end, raw, lane, x);
    } else {
      nw = code_chunk_warp(ws.extra_syms + uint64_t(table - 1) * kNumSymbols, ws.extra_info[4 * (table - 1)], v, cn,
                           nr, aligned, false, tile, ring, words_end, raw, lane, x);
    }
    if (one_state) {
      uint32_t state = 0, words = 0;
      if (lane == 0) words = rans_encode_one_state(v, cn, ws.syms, state, words_end);
      nw = __shfl_sync(kFull, words, 0);
      x = state;
    }
    ChunkEntry e{one_state ? kModeOneState : kModeRans, nw, nr, counted.checksum};
    // version 6: the fields coded where that pays (a one-state chunk before its raw-or-coded
    // choice, a 32-state one after it, as on the host)
    // (the tile's 512 bytes: the field counts, u64[64]; the tile is not read until the next chunk)
    unsigned long long* fcounts = reinterpret_cast<unsigned long long*>(tile);
    if (code_fields && one_state && nr > 0) {
      int coded = 0;
      if (lane == 0)
        coded = code_fields_one_state(v, cn, mix_pairs, e, field_area(slot, ws.slot_values), fcounts, field_tables[warp],
                                      field_codes[warp]) ? 1 : 0;
      __syncwarp();  // lane 0's field_codes stored
      if (__shfl_sync(kFull, coded, 0) != 0)
        e = ChunkEntry{__shfl_sync(kFull, e.mode, 0), __shfl_sync(kFull, e.num_words, 0), nr, e.checksum};
    }
    const bool raw_pays = one_state ? align4(shared_bytes) + align4(payload_bytes(e, cn)) >= align4(2ull * cn)
                                    : payload_bytes(e, cn) >= 2ull * cn;
    if (raw_pays) e = ChunkEntry{kModeRaw, 0, 0, e.checksum};
    if (nr == 0 && cn > 0) e = ChunkEntry{kModeZero, 0, 0, 0};  // +0.0 only (checksum 0)
    if (code_fields && e.mode == kModeRans)
      code_fields_warp(v, cn, mix_pairs, e, field_area(slot, ws.slot_values), fcounts, field_tables[warp], lane,
                       field_codes[warp]);
    const uint64_t bytes = align4(payload_bytes(e, cn));
    __syncwarp();  // the slot's words and fields are stored before any lane copies them
    const uint64_t offset = lookback_offset(ws.lookback, c, bytes, lane);
    if (lane == 0) {
      ws.entries[c] = e;
      ws.offsets[c] = offset;
      if (e.mode != kModeZero) atomicMax(&ws.table_info[kInfoNotZero], 1u);  // several warps may set them
      if (e.mode == kModeRaw && table != 0) atomicMax(&ws.table_info[kInfoTakerRaw], 1u);
    }
    if (e.mode == kModeRaw || e.mode == kModeZero) continue;
    if (lane == 0) atomicMax(&ws.table_info[kInfoCoded], 1u);
    uint8_t* q = out + data_at + offset;
    if (e.mode == kModeCodedFields || e.mode == kModeOneStateFields) {
      store_fields_payload(q, e, cn, nw, words_end, field_area(slot, ws.slot_values), field_codes[warp], x,
                           out_aligned, lane);
      continue;
    }
    const uint64_t states = state_bytes(e);
    if (uint64_t(lane) < states / 4) {
      if (out_aligned) reinterpret_cast<uint32_t*>(q)[lane] = x;
      else store_le<uint32_t>(q + 4 * lane, x);
    }
    const uint64_t len = 2ull * nw + raw_bytes(nr);
    copy_padded(q + states, raw - 2ull * nw, len, bytes - states, true, out_aligned, lane);
  }
}
// Version 6 launches both: rans_kernel returns at once when ws.fields_wanted is set (some chunk's
// fields may code smaller), rans_fields_kernel when it is not (no chunk codes its fields: its blob
// is rans_kernel's, which keeps 4 blocks an SM).
__global__ void __launch_bounds__(kBlockThreads, kRansMinBlocks)
    rans_kernel(const uint16_t* values, uint64_t n, uint32_t cv, uint64_t chunks, bool aligned, EncWs ws,
                uint64_t table_at, uint8_t* out, bool out_aligned, uint32_t one_state_max, bool version6) {
  __shared__ RansShared sh;
  if (version6 && *ws.fields_wanted != 0) return;
  // (mix_pairs: the field streams' checksum, which this pass does not code; the chunks' came from
  // histogram_kernel)
  rans_pass<false>(values, n, cv, chunks, aligned, ws, table_at, out, out_aligned, one_state_max, false, sh);
}
__global__ void __launch_bounds__(kBlockThreads, kRansFieldsMinBlocks)
    rans_fields_kernel(const uint16_t* values, uint64_t n, uint32_t cv, uint64_t chunks, bool aligned, EncWs ws,
                       uint64_t table_at, uint8_t* out, bool out_aligned, uint32_t one_state_max, bool mix_pairs) {
  __shared__ RansShared sh;
  if (*ws.fields_wanted == 0) return;
  rans_pass<true>(values, n, cv, chunks, aligned, ws, table_at, out, out_aligned, one_state_max, mix_pairs, sh);
}

// The directory entries of chunks c = first, first + stride, ... below `chunks` (one warp each;
// every lane calls) at `dir`, and the payloads of raw chunks (the values themselves) at their
// offsets from data_at. A rANS chunk's table is ws.chunk_table's, mapped through new_table (version
// 5's renumbering after a dropped table) when given.
__device__ void place_chunks(const uint16_t* values, const EncWs& ws, uint64_t n, uint32_t cv, uint64_t chunks,
                             uint64_t first, uint64_t stride, uint64_t dir, uint64_t data_at,
                             const uint32_t* new_table, uint8_t* out, bool out_aligned, int lane) {
  for (uint64_t c = first; c < chunks; c += stride) {
    const ChunkEntry e = ws.entries[c];
    const bool tabled = e.mode == kModeRans || e.mode == kModeCodedFields;  // (modes 0 and 4 name their table)
    uint32_t table = tabled && ws.chunk_table != nullptr ? ws.chunk_table[c] : 0u;
    if (new_table != nullptr) table = new_table[table];
    if (lane < 4) {
      const uint32_t field =
          lane == 0 ? e.mode | (table << 8) : lane == 1 ? e.num_words : lane == 2 ? e.num_raw : e.checksum;
      store_le<uint32_t>(out + dir + sizeof(ChunkEntry) * c + 4 * lane, field);
    }
    if (e.mode != kModeRaw) continue;
    const uint64_t len = 2ull * chunk_values_of(n, cv, c);
    copy_padded(out + data_at + ws.offsets[c], reinterpret_cast<const uint8_t*>(values + c * cv), len, align4(len),
                false, out_aligned, lane);
  }
}

// Kernel 3: block 0 writes the metadata (header, shape, the tables -- none when no chunk is
// rANS-coded, as on the host --, metadata checksum) and the blob's size; every other block, one
// warp per chunk (grid-stride), writes directory entries and the payloads of raw chunks at their
// offsets after the directory. Version 5, as the host's pass after coding: T and the extra tables
// (prob_bits, LEB128 length, table) after the shared one; a chunk with a table of its own stored
// raw drops it (the others renumbered) and block 0 alone then moves the coded payloads down by
// the bytes dropped (in ascending order, one block-wide word step at a time: every step's reads
// come before its writes, which land below the next step's reads) before it writes the entries
// and raw payloads; a blob of +0.0 only in more than one chunk is written as the fewest chunks
// (chunk_values as large as the values allow, at most 2^24).
__global__ void __launch_bounds__(kMetaThreads) layout_kernel(const uint16_t* values, EncWs ws, uint64_t n,
                                                             ShapeArg shape, uint32_t ndim, uint32_t cv,
                                                             uint64_t chunks, uint64_t table_at, uint8_t* out,
                                                             uint64_t* out_size, bool out_aligned, uint32_t version) {
  const int t = threadIdx.x, lane = t & 31, warp = t / 32;
  const bool table = ws.table_info[kInfoCoded] != 0;
  const bool all_zero = extra_tables_format(version) && chunks > 1 && ws.table_info[kInfoNotZero] == 0;
  const uint32_t chosen = table ? ws.table_info[kInfoExtraTables] : 0u;
  const bool renumber = table && ws.table_info[kInfoTakerRaw] != 0;  // an extra table dropped
  const uint32_t shared_bytes = table ? ws.table_info[kInfoSharedBytes] : 0u;
  const uint32_t chosen_bytes = table ? ws.table_info[kInfoExtraBytes] : 0u;
  uint32_t out_cv = cv;
  uint64_t out_chunks = chunks;
  if (all_zero) {
    const uint64_t wide = (n + kLanes - 1) / kLanes * kLanes;
    out_cv = static_cast<uint32_t>(wide < kMaxChunkValues ? wide : kMaxChunkValues);
    out_chunks = num_chunks_for(n, out_cv);
  }
  if (blockIdx.x > 0) {
    if (renumber) return;  // block 0 places every chunk
    const uint32_t table_bytes = shared_bytes + chosen_bytes;
    place_chunks(values, ws, n, cv, out_chunks, (blockIdx.x - 1ull) * kMetaWarps + warp,
                 (gridDim.x - 1ull) * kMetaWarps,
                 directory_offset_at(table_at, table_bytes),
                 data_offset_at(table_at, table_bytes, static_cast<uint32_t>(out_chunks)), nullptr, out, out_aligned,
                 lane);
    return;
  }
  __shared__ uint32_t scratch32[kMetaThreads / 32];
  __shared__ int scratch_int[kMetaThreads / 32];
  __shared__ uint32_t table_words[(kMaxTableBytes + 3) / 4 + 2];
  // version 5: extra table k's place after the shared table (~0 when dropped), a table index's
  // index after the drops, and the kept tables' count and bytes
  __shared__ uint32_t extra_at[kMaxExtraTables], new_table[kMaxExtraTables + 1], kept_tables, kept_bytes;
  if (t == 0) {
    new_table[0] = 0;
    kept_tables = kept_bytes = 0;
  }
  __syncthreads();
  for (uint32_t k = t; k < chosen; k += kMetaThreads) {
    const auto kept = [&](uint32_t j) { return !renumber || ws.entries[ws.extra_chunk[j]].mode != kModeRaw; };
    uint32_t before = 0, bytes_before = 0;
    for (uint32_t j = 0; j < k; ++j)
      if (kept(j)) ++before, bytes_before += extra_table_bytes(ws.extra_info[4 * j + 3]);
    const bool mine = kept(k);
    extra_at[k] = mine ? bytes_before : ~0u;
    new_table[k + 1] = mine ? before + 1 : 0u;
    if (k + 1 == chosen) {
      kept_tables = before + (mine ? 1u : 0u);
      kept_bytes = bytes_before + (mine ? extra_table_bytes(ws.extra_info[4 * k + 3]) : 0u);
    }
  }
  __syncthreads();
  const uint32_t table_bytes = shared_bytes + kept_bytes;
  const uint64_t dir = directory_offset_at(table_at, table_bytes);
  const uint64_t data_at = data_offset_at(table_at, table_bytes, static_cast<uint32_t>(out_chunks));
  const uint64_t payload_bytes_all = chunks > 0 && !all_zero ? ws.lookback[chunks - 1] & kLookBytes : 0ull;
  if (renumber) {
    const uint64_t coded_at = data_offset_at(table_at, shared_bytes + chosen_bytes, static_cast<uint32_t>(chunks));
    for (uint64_t base = 0; coded_at != data_at && base < payload_bytes_all; base += 4ull * kMetaThreads) {
      const uint64_t at = base + 4ull * t;  // offsets and padded payloads are multiples of 4
      uint32_t word = 0;
      if (at < payload_bytes_all) word = load_le<uint32_t>(out + coded_at + at);
      __syncthreads();
      if (at < payload_bytes_all) store_le<uint32_t>(out + data_at + at, word);
      __syncthreads();
    }
    place_chunks(values, ws, n, cv, out_chunks, warp, kMetaWarps, dir, data_at, new_table, out, out_aligned, lane);
  }
  // the version 4 table (write_table_v4), entries in symbol order: thread t owns symbol t, thread 0
  // also the last one; an entry's gap from the previous present symbol (a block max-scan) and its
  // first bit (a block sum-scan of the entries' code lengths); codes added into shared words (the
  // entries' bits do not overlap: adding is or-ing), then copied out
  const uint32_t kg = ws.table_info[kInfoGapOrder], kf = ws.table_info[kInfoFreqOrder];
  for (uint32_t w = t; w < (kMaxTableBytes + 3) / 4 + 2; w += kMetaThreads) table_words[w] = 0;
  const uint32_t f_mine = t < kNumSymbols - 1 ? ws.syms[t].freq : 0u;
  const uint32_t f_last = ws.syms[kNumSymbols - 1].freq;
  int last_present = -1;
  const int previous = block_exclusive_max_scan(f_mine != 0 ? t : -1, scratch_int, &last_present);
  const uint32_t gap = uint32_t(t - previous - 1), gap_last = uint32_t(kNumSymbols - 1 - last_present - 1);
  uint32_t seen = 0, mine_bits = 0, code_bits = 0, last_bits = 0;
  block_exclusive_scan<uint32_t>(f_mine != 0 ? 1u : 0u, scratch32, &seen);
  const uint64_t code = f_mine != 0 ? table_entry_code_v4(gap, f_mine, kg, kf, code_bits) : 0ull;
  const uint64_t code_last = f_last != 0 ? table_entry_code_v4(gap_last, f_last, kg, kf, last_bits) : 0ull;
  const uint32_t pos = block_exclusive_scan<uint32_t>(code_bits, scratch32, &mine_bits);
  const uint32_t entries = table ? seen + (f_last != 0 ? 1u : 0u) : 0u;
  const uint32_t prob_bits = table ? ws.syms[0].prob_bits : uint32_t(kProbBits);
  const auto add_code = [&](uint64_t bits_code, uint32_t at) {
    const uint32_t w = at / 32, sh = at % 32;
    const uint64_t rest = sh == 0 ? bits_code >> 32 : bits_code >> (32 - sh);
    atomicAdd(&table_words[w], static_cast<uint32_t>(bits_code << sh));
    atomicAdd(&table_words[w + 1], static_cast<uint32_t>(rest));
    atomicAdd(&table_words[w + 2], static_cast<uint32_t>(rest >> 32));
  };
  __syncthreads();  // table_words zeroed
  if (table && f_mine != 0) add_code(code, pos);
  if (table && t == 0 && f_last != 0) add_code(code_last, mine_bits);
  __syncthreads();
  if (table && t == 0) out[table_at] = static_cast<uint8_t>(kg | (kf << 4));
  for (uint32_t b = t; table && b + 1 < shared_bytes; b += kMetaThreads)
    out[table_at + 1 + b] = static_cast<uint8_t>(table_words[b / 4] >> (8 * (b % 4)));
  // version 5's extra tables, one warp each (lane 0 writes it: write_table_v4)
  for (uint32_t k = warp; k < chosen; k += kMetaWarps) {
    if (lane != 0 || extra_at[k] == ~0u) continue;
    const uint32_t* info = ws.extra_info + 4ull * k;
    uint8_t* p = out + table_at + shared_bytes + extra_at[k];
    *p++ = static_cast<uint8_t>(info[0]);
    p += store_leb128(p, info[3]);
    write_table_v4(p, ws.extra_freq + uint64_t(k) * kNumSymbols, info[1], info[2]);
  }
  for (uint64_t p = table_at + table_bytes + t; p < dir; p += kMetaThreads) out[p] = 0;
  if (t == 0) {  // store_header, store_shape (constant indices: a parameter array indexed by a
                 // variable would be copied to local memory)
    store_header(out, ndim, entries, out_cv, static_cast<uint32_t>(out_chunks), n, prob_bits, table_bytes, version,
                 kept_tables);
    uint8_t* p = out + kHeaderBytesV4;
#pragma unroll
    for (uint32_t d = 0; d < uint32_t(kMaxDims); ++d) {
      if (d >= ndim) continue;
      uint64_t v = shape.dims[d];
      while (v >= 128) {
        *p++ = static_cast<uint8_t>(0x80 | (v & 0x7F));
        v >>= 7;
      }
      *p++ = static_cast<uint8_t>(v);
    }
  }
  __syncthreads();  // the metadata bytes are written; the checksum reads them
  uint32_t part = 0;
  const uint64_t checksum_at = meta_checksum_offset(version);
  for (uint64_t i = t; i < dir; i += kMetaThreads)
    if (i < checksum_at || i >= checksum_at + 4) part += uint32_t(out[i]) * uint32_t(2 * i + 1);
  const uint32_t checksum = block_sum<uint32_t>(part, scratch32);
  if (t == 0) {
    store_le<uint32_t>(out + checksum_at, checksum);
    *out_size = data_at + payload_bytes_all;
  }
}

// ---- decode ----
struct DecWs {
  DecodeTable* table;               // [1 + extra]: the shared table, then version 5's extra tables in order
                                    // (a chunk's table t is table[t])
  uint64_t* offsets;                // [chunks + 1]
  Header* header;                   // [1]
  unsigned long long* first_error;  // [1]: min over failing chunks c of c << 8 | status
  uint32_t* table_scratch;          // [min(extra, kMetaWarps) * 2 * kNumSymbols]: validate_kernel's
                                    // per-warp freq[1025] and start[1025] of an extra table
  // version 6's chunks with coded fields (modes 4 and 5): field_slot[c] is chunk c's slot among
  // them (validate_kernel), each slot field_slot_bytes of field_space: the field stream's decoder
  // table, its freq[1025] and start[1025], the chunk's fields packed; zeros: the field streams'
  // raw section (zero bytes, raw_bytes(chunk_values) and 16 more)
  uint32_t* field_slot;             // [chunks], or null with no slots
  uint8_t* field_space;             // [field_slots * field_slot_bytes]
  uint8_t* zeros;                   // [field_zero_bytes]
  uint32_t* field_result;           // [2 * field_slots]: fields_kernel's status and symbol word count
  uint64_t field_slots, field_slot_bytes, field_zero_bytes, field_rebuilt_bytes;
  uint32_t field_values;            // the most values of a chunk the slots hold
};

// The most extra tables a blob of at most `chunks` chunks holds (version 5: at most one per chunk
// and kMaxExtraTables), each a DecodeTable of the workspace: sized for that worst case whatever
// the blob's format.
uint64_t max_extra_tables(uint64_t chunks) { return chunks < kMaxExtraTables ? chunks : kMaxExtraTables; }

// Bytes of a version 6 chunk of at most `chunk_values` values rebuilt as a mode 0 payload (states,
// at most one word a value, the packed fields) and the 16-byte blocks the staged decoder reads.
uint64_t field_rebuilt_bytes(uint32_t chunk_values) {
  return kStateBytes + 2ull * chunk_values + raw_bytes(chunk_values) + 32;
}
// Bytes of one version 6 field slot: a DecodeTable, freq[1025] and start[1025], the rebuilt chunk,
// each 256-byte aligned.
uint64_t field_slot_bytes(uint32_t chunk_values) {
  const auto up = [](uint64_t b) { return (b + 255) & ~uint64_t(255); };
  return up(sizeof(DecodeTable)) + up(8ull * kNumSymbols) + up(field_rebuilt_bytes(chunk_values));
}

// The workspace of a blob of at most `chunks` chunks of at most `chunk_values` values, with
// `field_chunks` chunks of modes 4 and 5 (version 6).
size_t carve_dec(uint64_t chunks, uint32_t chunk_values, uint64_t field_chunks, char* base, DecWs* ws) {
  Carver c{base};
  DecWs w;
  const uint64_t extra = max_extra_tables(chunks);
  const uint64_t scratch_warps = extra < uint64_t(kMetaWarps) ? extra : uint64_t(kMetaWarps);
  w.table = c.take<DecodeTable>(sizeof(DecodeTable) * (1 + extra));
  w.offsets = c.take<uint64_t>(8 * (chunks + 1));
  w.header = c.take<Header>(sizeof(Header));
  w.first_error = c.take<unsigned long long>(8);
  w.table_scratch = c.take<uint32_t>(4 * 2 * kNumSymbols * scratch_warps);
  w.field_slots = field_chunks;
  w.field_values = chunk_values;
  w.field_rebuilt_bytes = field_rebuilt_bytes(chunk_values);
  w.field_slot_bytes = field_slot_bytes(chunk_values);
  w.field_zero_bytes = field_chunks > 0 ? raw_bytes(chunk_values) + 16 : 0;
  w.field_slot = field_chunks > 0 ? c.take<uint32_t>(4 * chunks) : nullptr;
  w.field_space = field_chunks > 0 ? c.take<uint8_t>(w.field_slot_bytes * field_chunks) : nullptr;
  w.zeros = field_chunks > 0 ? c.take<uint8_t>(w.field_zero_bytes) : nullptr;
  w.field_result = field_chunks > 0 ? c.take<uint32_t>(8 * field_chunks) : nullptr;
  if (ws) *ws = w;
  return c.off;
}

// The decoder table entry of `slot` (build_decode_table's) from freq[1025] and their cumulative
// starts start[1025] (summing to 2^prob_bits > slot): the slot's symbol is the last whose start is
// at most `slot` (start[0] == 0; a symbol of frequency 0 shares the next one's start).
__device__ uint32_t slot_entry(const uint32_t* freq, const uint32_t* start, uint32_t slot) {
  int lo_s = 0, hi_s = kNumSymbols - 1;  // start[lo_s] <= slot
  while (lo_s < hi_s) {
    const int mid = (lo_s + hi_s + 1) / 2;
    if (start[mid] <= slot) lo_s = mid;
    else hi_s = mid - 1;
  }
  const uint32_t hi10 = lo_s == kZeroSymbol ? 0u : uint32_t(lo_s);
  return dec_entry(hi10, freq[lo_s], slot - start[lo_s]);
}

// Version 5's extra tables, one warp per table (lane 0 reads it with read_extra_table into the
// warp's scratch, the warp fills its DecodeTable, ws.table[1 + k]); returns, in every thread of
// the block (every thread calls), whether one of them is corrupted (kErrTable).
__device__ bool build_extra_tables(const uint8_t* blob, const Header& h, const ExtraTable* refs, const DecWs& ws) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  int bad = 0;
  uint32_t* freq = ws.table_scratch + 2ull * kNumSymbols * warp;
  uint32_t* start = freq + kNumSymbols;
  for (uint32_t k = warp; k < h.num_extra_tables; k += kMetaWarps) {  // (warp-uniform)
    int st = kOk;
    if (lane == 0) st = read_extra_table(blob, refs[k], freq, start);
    st = __shfl_sync(kFull, st, 0);
    __syncwarp();  // lane 0's freq and start are visible to the warp
    if (st != kOk) {
      bad = 1;
      continue;
    }
    DecodeTable& table = ws.table[1 + k];
    const uint32_t prob_bits = refs[k].prob_bits;
    for (uint32_t slot = lane; slot < (1u << prob_bits); slot += kLanes)
      table.entry[slot] = slot_entry(freq, start, slot);
    if (lane == 0) {
      table.zero_start = start[kZeroSymbol];
      table.zero_freq = freq[kZeroSymbol];
      table.prob_bits = prob_bits;
      table.slot_mask = (1u << prob_bits) - 1;
    }
    __syncwarp();  // the scratch is read before lane 0 overwrites it with the warp's next table
  }
  return __syncthreads_or(bad) != 0;
}

// One block: every check of the host decoder (parse_header, the value count, read_table, version
// 5's extra tables, the directory and the size, then version 5's unused tables), each a parallel
// pass, reported in the host's order; then the chunk offsets and the decoder's tables (the shared
// one, and version 5's extra ones, ws.table[1 + k], built as they are checked).
__global__ void __launch_bounds__(kMetaThreads) validate_kernel(const uint8_t* blob, uint64_t size, uint64_t n,
                                                               uint64_t max_chunks, uint32_t version, DecWs ws,
                                                               int* status) {
  __shared__ Header h;
  __shared__ int st;
  __shared__ unsigned long long first_failure;  // the directory's: (chunk << 1) | (0: entry, 1: past the end)
  __shared__ uint32_t freq[kNumSymbols], start[kNumSymbols];
  __shared__ uint32_t scratch32[kMetaThreads / 32];
  __shared__ uint64_t scratch64[kMetaThreads / 32];
  __shared__ ExtraTable refs[kMaxExtraTables];                 // version 5's extra tables
  __shared__ uint32_t used_tables[kMaxExtraTables];            // [k]: 1 when extra table k has a chunk
  const int t = threadIdx.x;
  if (t == 0) {
    *ws.first_error = kNoError;
    st = parse_header_fields(blob, size, h, ~0ull, kNewestVersion);
  }
  __syncthreads();
  // parse_header's loops: the table's zero padding, then the metadata checksum
  if (st == kOk) {
    int bad_pad = 0;
    for (uint64_t p = h.table_offset + h.table_bytes + t; p < h.directory_offset; p += kMetaThreads)
      bad_pad |= blob[p] != 0;
    bad_pad = __syncthreads_or(bad_pad);
    uint32_t part = 0;
    const uint64_t checksum_at = meta_checksum_offset(h.version);
    for (uint64_t i = t; i < h.directory_offset; i += kMetaThreads)
      if (i < checksum_at || i >= checksum_at + 4) part += uint32_t(blob[i]) * uint32_t(2 * i + 1);
    const uint32_t checksum = block_sum<uint32_t>(part, scratch32);
    if (t == 0) {
      if (bad_pad) st = kErrPadding;
      else if (checksum != load_le<uint32_t>(blob + checksum_at)) st = kErrHeader;
      else if (h.num_values != n) st = kErrShape;
      else if (h.num_chunks > max_chunks || h.version != version) st = kErrHeader;
    }
  }
  __syncthreads();
  // read_table: strictly increasing symbols, frequencies in [1, kProbScale], summing to 2^prob_bits
  for (int s = t; s < kNumSymbols; s += kMetaThreads) freq[s] = start[s] = 0;
  const int header_status = st;  // read by every thread before thread 0 may write st below
  __syncthreads();
  if (header_status == kOk && extra_tables_format(h.version)) {
    if (t == 0) {  // the table section in order: the shared table, the extra tables' framing (contents below)
      uint64_t shared_bytes = 0;
      st = read_table(blob, h, freq, start, &shared_bytes);
      if (st == kOk) st = read_extra_table_refs(blob, h, shared_bytes, refs);
    }
  } else if (header_status == kOk && h.version != kOldVersion) {
    if (t == 0) {  // versions 3 and 4: variable-size entries, read in order
      st = h.version == kVersion3 ? read_table_v3(blob + h.table_offset, h, freq)
                                  : read_table_v4(blob + h.table_offset, h, freq);
      uint32_t fsum = 0;
      for (int s = 0; s < kNumSymbols; ++s) fsum += freq[s];
      if (st == kOk && h.num_table_entries > 0 && fsum != (1u << h.prob_bits)) st = kErrTable;
    }
  } else if (header_status == kOk) {
    int bad = 0;
    uint32_t fsum = 0;
    for (uint32_t i = t; i < h.num_table_entries; i += kMetaThreads) {
      const uint8_t* p = blob + h.table_offset + 4ull * i;
      const uint32_t sym = load_le<uint16_t>(p), f = load_le<uint16_t>(p + 2);
      const bool ordered = i == 0 || load_le<uint16_t>(p - 4) < sym;
      if (!ordered || sym >= uint32_t(kNumSymbols) || f == 0 || f > kProbScale) {
        bad = 1;
      } else {
        freq[sym] = f;
        fsum += f;
      }
    }
    bad = __syncthreads_or(bad);
    fsum = block_sum<uint32_t>(fsum, scratch32);
    if (t == 0 && (bad || (h.num_table_entries > 0 && fsum != (1u << h.prob_bits)))) st = kErrTable;
  }
  __syncthreads();
  if (st == kOk && extra_tables_format(h.version) && build_extra_tables(blob, h, refs, ws) && t == 0) st = kErrTable;
  __syncthreads();
  if (st != kOk) {
    if (t == 0) *status = st;
    return;
  }
  // cumulative starts (thread t owns symbol t, thread 0 also the last)
  uint32_t ftotal = 0;
  const uint32_t s0 = block_exclusive_scan<uint32_t>(t < kNumSymbols - 1 ? freq[t] : 0u, scratch32, &ftotal);
  if (t < kNumSymbols - 1) start[t] = s0;
  if (t == 0) start[kNumSymbols - 1] = ftotal;
  // the directory, as read_directory walks it: the first chunk whose entry fails check_entry
  // (kErrDirectory) or whose payload ends past the blob (kErrSize), then the total size; offsets by
  // rounds of 1024 chunks (thread t: chunk r * 1024 + t, coalesced). A failing entry counts 0
  // bytes: only the chunks before the first failure need exact offsets.
  const uint64_t chunks = h.num_chunks;
  if (t == 0) first_failure = kNoError;
  if (uint32_t(t) < kMaxExtraTables) used_tables[t] = 0;
  __syncthreads();
  uint64_t base = h.data_offset, field_base = 0;
  for (uint64_t r = 0; r < chunks; r += kMetaThreads) {
    const uint64_t c = r + t;
    uint64_t bytes = 0;
    bool entry_bad = false;
    uint32_t coded_fields = 0;
    if (c < chunks) {
      ChunkEntry e = read_entry(blob, h, c);
      const uint32_t cn = chunk_count(h, c), table = entry_table(e);
      entry_bad = check_entry(h, e, cn) != kOk;
      e.mode &= kModeMask;  // version 5: the mode without the table
      if (!entry_bad) bytes = align4(payload_bytes(e, cn));
      if (!entry_bad && table != 0) atomicMax(&used_tables[table - 1], 1u);
      coded_fields = !entry_bad && (e.mode == kModeCodedFields || e.mode == kModeOneStateFields);
    }
    uint64_t round_total = 0;
    const uint64_t at = base + block_exclusive_scan<uint64_t>(bytes, scratch64, &round_total);
    if (c < chunks) {
      ws.offsets[c] = at;
      if (entry_bad || at + bytes > size) atomicMin(&first_failure, (static_cast<unsigned long long>(c) << 1) | (entry_bad ? 0ull : 1ull));
    }
    base += round_total;
    if (__syncthreads_or(coded_fields)) {  // version 6: the chunk's field slot (block-uniform)
      uint32_t round_fields = 0;
      const uint64_t slot = field_base + block_exclusive_scan<uint32_t>(coded_fields, scratch32, &round_fields);
      // more slots than the caller counted, or larger chunks than it sized them for (a blob changed
      // since): no slot, a corrupted directory
      if (coded_fields && (slot >= ws.field_slots || chunk_count(h, c) > ws.field_values))
        atomicMin(&first_failure, static_cast<unsigned long long>(c) << 1);
      else if (coded_fields) ws.field_slot[c] = static_cast<uint32_t>(slot);
      field_base += round_fields;
    }
  }
  for (uint64_t i = t; i < ws.field_zero_bytes; i += kMetaThreads) ws.zeros[i] = 0;
  __syncthreads();
  if (first_failure != kNoError) {
    if (t == 0) *status = (first_failure & 1) ? kErrSize : kErrDirectory;
    return;
  }
  if (t == 0) ws.offsets[chunks] = base;
  if (base != size) {
    if (t == 0) *status = kErrSize;
    return;
  }
  // version 5: every extra table is some chunk's (read_directory's last check)
  const bool unused = uint32_t(t) < h.num_extra_tables && used_tables[t] == 0;
  if (__syncthreads_or(unused)) {
    if (t == 0) *status = kErrTable;
    return;
  }
  // build_decode_table, one slot per thread step
  if (h.num_table_entries > 0)
    for (uint32_t slot = t; slot < (1u << h.prob_bits); slot += kMetaThreads)
      ws.table->entry[slot] = slot_entry(freq, start, slot);
  if (t == 0) {
    ws.table->zero_start = start[kZeroSymbol];
    ws.table->zero_freq = freq[kZeroSymbol];
    ws.table->prob_bits = h.prob_bits;
    ws.table->slot_mask = (1u << h.prob_bits) - 1;
    *ws.header = h;
    *status = kOk;
  }
}

// A raw chunk, as decode_raw_chunk (mix_pairs: version 7's checksum, taken from the values
// stored); the same status in every lane.
__device__ int decode_raw_warp(const uint8_t* payload, const ChunkEntry& e, uint32_t cn, uint16_t* dst,
                               bool mix_pairs, int lane) {
  for (uint32_t i = lane; i < cn; i += kLanes) dst[i] = load_le<uint16_t>(payload + 2ull * i);
  __syncwarp();  // every lane's values stored
  return warp_checksum(dst, cn, mix_pairs, lane) == e.checksum ? int(kOk) : int(kErrChecksum);
}

// A mode 3 chunk: cn values +0.0 (check_entry checked its fields); kOk in every lane.
__device__ int decode_zero_warp(uint32_t cn, uint16_t* dst, int lane) {
  for (uint32_t i = lane; i < cn; i += kLanes) dst[i] = 0;
  return kOk;
}

// Word w of a chunk's word stream (bytes 2w, 2w + 1 of `words`, 2-byte aligned when Aligned).
template <bool Aligned>
__device__ uint32_t load_word(const uint8_t* words, uint32_t w) {
  if (Aligned) return reinterpret_cast<const uint16_t*>(words)[w];
  return load_le<uint16_t>(words + 2ull * w);
}

// The streams of a rANS chunk's payload (layout in lossless_core.h).
struct RansStreams {
  const uint8_t* words;
  const uint8_t* raw;
  uint32_t num_words, num_raw, nraw_bytes;
  __device__ RansStreams(const uint8_t* payload, const ChunkEntry& e)
      : words(payload + kStateBytes), raw(payload + kStateBytes + 2ull * e.num_words), num_words(e.num_words),
        num_raw(e.num_raw), nraw_bytes(static_cast<uint32_t>(raw_bytes(e.num_raw))) {}
  // (version 6: words and raw fields elsewhere, e's counts)
  __device__ RansStreams(const uint8_t* w, const uint8_t* r, const ChunkEntry& e)
      : words(w), raw(r), num_words(e.num_words), num_raw(e.num_raw),
        nraw_bytes(static_cast<uint32_t>(raw_bytes(e.num_raw))) {}
};

// One lane's decode step before renormalisation (dec_step): the slot's table entry, the new
// state y, whether the slot is +0.0's, and whether a valid lane needs a word (renormalisation).
struct DecStep {
  uint32_t entry;
  uint32_t y;
  bool zero;
  bool need;
};
__device__ DecStep dec_state_step(uint32_t x, bool valid, const DecodeTable& table, uint32_t zero_start,
                                  uint32_t zero_freq, uint32_t slot_mask, uint32_t prob_bits) {
  const uint32_t slot = x & slot_mask;
  const uint32_t entry = table.entry[slot];
  const uint32_t y = entry_freq(entry) * (x >> prob_bits) + entry_bias(entry);
  return DecStep{entry, y, slot - zero_start < zero_freq, valid && y < kStateLow};
}

// A valid lane's end of step: the renormalised state y, value v stored at dst[i] and (versions
// 2-6) checksummed; version 7's pair checksum (mix_pairs) is taken from dst after the chunk
// (pair_checksum_from).
template <bool MixPairs>
__device__ void keep_value(uint32_t& x, uint32_t y, uint32_t v, uint32_t i, uint16_t* dst, uint32_t& checksum) {
  x = y;
  dst[i] = static_cast<uint16_t>(v);
  if constexpr (!MixPairs) checksum += checksum_term(static_cast<uint16_t>(v), i);
}

// mix_pairs: this lane's part of the pair checksum of a chunk's cn values just stored at dst by
// the warp (every lane calls); else `checksum`, the lane's part kept by keep_value.
__device__ uint32_t pair_checksum_from(const uint16_t* dst, uint32_t cn, bool mix_pairs, uint32_t checksum, int lane) {
  if (!mix_pairs) return checksum;
  __syncwarp();  // every lane's values stored
  return lane_checksum(dst, cn, 0, true, lane);
}

// The end of a warp-decoded rANS chunk: a read past a stream (bad), then finish_chunk's checks in
// its order; the same status in every lane.
__device__ int finish_rans_warp(const uint8_t* payload, const ChunkEntry& e, bool bad, uint32_t wpos, uint32_t rpos,
                                uint32_t x, uint32_t checksum) {
  if (__any_sync(kFull, bad)) return kErrStream;
  if (wpos != e.num_words || rpos != e.num_raw || __any_sync(kFull, x != kStateLow)) return kErrStream;
  if (!raw_tail_zero(payload, e)) return kErrPadding;
  return warp_sum(checksum) == e.checksum ? int(kOk) : int(kErrChecksum);
}

// A rANS chunk with the checks and statuses of decode_chunk (lane l holds state l; the words and
// raw fields of a step go to its lanes in lane order, as in the sequential loop). Every read is
// bounded by the chunk's counts; a read that would pass them marks the chunk bad (kErrStream,
// reported after the loop: the values are undefined then); the same status in every lane.
// OwnTable (here and in the decoders below): `table` is the chunk's own (version 5's extra table
// in the workspace, global memory), else the block's shared copy; two instantiations, inlined
// apart, so the shared one's lookups stay shared-memory loads.
// decode_rans_streams: the same with the 32 states at `states` and the streams st wherever they
// lie (version 6's modes 4: the field stream, the chunk with its fields packed elsewhere).
template <bool Aligned, bool OwnTable, bool MixPairs>
__device__ __forceinline__ int decode_rans_streams(const uint8_t* states, const RansStreams& st, const ChunkEntry& e,
                                                   uint32_t cn, const DecodeTable& table, uint16_t* dst, int lane) {
  const unsigned below = (1u << lane) - 1u;
  uint32_t x = load_le<uint32_t>(states + 4 * lane);
  if (__any_sync(kFull, x < kStateLow)) return kErrStream;  // load_states
  const uint32_t zero_start = table.zero_start, zero_freq = table.zero_freq;
  const uint32_t slot_mask = table.slot_mask, prob_bits = table.prob_bits;
  uint32_t wpos = 0, rpos = 0, checksum = 0;
  bool bad = false;
  const uint32_t steps = (cn + kLanes - 1) / kLanes;
#pragma unroll kDecUnroll
  for (uint32_t t = 0; t < steps; ++t) {
    const uint32_t i = t * kLanes + lane;
    const bool valid = i < cn;
    if constexpr (kDecPrefetch > 0) {  // within the chunk's streams, so never past the blob
      if (lane == 0 && st.num_words > 0) {
        prefetch_l1(st.words + min(2u * wpos + kDecPrefetch, 2u * st.num_words - 1u));
      } else if (lane == 1 && st.nraw_bytes > 0) {
        prefetch_l1(st.raw + min(kRawBits * rpos / 8 + kDecPrefetch, st.nraw_bytes - 1u));
      }
    }
    DecStep d = dec_state_step(x, valid, table, zero_start, zero_freq, slot_mask, prob_bits);
    const unsigned wmask = __ballot_sync(kFull, d.need);
    const bool has_raw = valid && !d.zero;
    uint32_t v = 0;
    if constexpr (EP_LOSSLESS_DEC_EARLY_LOADS) {
      // every load of the step in flight before any is used (same values, checks and statuses)
      const unsigned rmask = __ballot_sync(kFull, has_raw);
      const uint32_t wp = wpos + __popc(wmask & below), rp = rpos + __popc(rmask & below);
      const bool word_ok = d.need && wp < st.num_words, raw_ok = has_raw && rp < st.num_raw;
      const uint32_t bit = kRawBits * rp, b = bit >> 3;
      uint32_t word = 0, lo = 0, hi = 0;
      if (word_ok) word = load_word<Aligned>(st.words, wp);
      if (raw_ok) lo = st.raw[b];
      if (raw_ok && b + 1 < st.nraw_bytes) hi = st.raw[b + 1];
      bad |= (d.need && !word_ok) || (has_raw && !raw_ok);
      if (word_ok) d.y = (d.y << 16) | word;
      if (raw_ok) v = (entry_hi10(d.entry) << kRawBits) | (((lo | (hi << 8)) >> (bit & 7)) & kRawMask);
      wpos += __popc(wmask);
      rpos += __popc(rmask);
    } else {
      if (d.need) {
        const uint32_t p = wpos + __popc(wmask & below);
        if (p < st.num_words) d.y = (d.y << 16) | load_word<Aligned>(st.words, p);
        else bad = true;
      }
      wpos += __popc(wmask);
      const unsigned rmask = __ballot_sync(kFull, has_raw);
      if (has_raw) {
        const uint32_t p = rpos + __popc(rmask & below);
        if (p < st.num_raw) {  // read_raw_field
          const uint32_t bit = kRawBits * p, b = bit >> 3;
          uint32_t w = st.raw[b];
          if (b + 1 < st.nraw_bytes) w |= uint32_t(st.raw[b + 1]) << 8;
          v = (entry_hi10(d.entry) << kRawBits) | ((w >> (bit & 7)) & kRawMask);  // join_value
        } else {
          bad = true;
        }
      }
      rpos += __popc(rmask);
    }
    if (valid) keep_value<MixPairs>(x, d.y, v, i, dst, checksum);
  }
  checksum = pair_checksum_from(dst, cn, MixPairs, checksum, lane);
  // finish_rans_warp's checks, the raw stream's last byte read where it lies
  if (__any_sync(kFull, bad)) return kErrStream;
  if (wpos != e.num_words || rpos != e.num_raw || __any_sync(kFull, x != kStateLow)) return kErrStream;
  const uint32_t tail_bits = kRawBits * e.num_raw;
  if (tail_bits % 8 != 0 && (st.raw[tail_bits / 8] >> (tail_bits % 8)) != 0) return kErrPadding;
  return warp_sum(checksum) == e.checksum ? int(kOk) : int(kErrChecksum);
}
template <bool Aligned, bool OwnTable, bool MixPairs>
__device__ __forceinline__ int decode_rans_warp(const uint8_t* payload, const ChunkEntry& e, uint32_t cn,
                                                const DecodeTable& table, uint16_t* dst, int lane) {
  return decode_rans_streams<Aligned, OwnTable, MixPairs>(payload, RansStreams(payload, e), e, cn, table, dst, lane);
}

// Version 6's field slot `slot` of the workspace: the field stream's decoder table, its freq[1025]
// and start[1025], the chunk rebuilt as a mode 0 (2) payload (states, the symbols' words, the
// fields packed; 16-byte aligned, field_rebuilt_bytes of room), and the slot's status and symbol
// word count.
struct FieldSlot {
  DecodeTable* table;
  uint32_t* freq;
  uint32_t* start;
  uint8_t* rebuilt;
};
__device__ inline uint64_t up256(uint64_t b) { return (b + 255) & ~uint64_t(255); }
__device__ FieldSlot field_slot(const DecWs& ws, uint32_t slot) {
  uint8_t* space = ws.field_space + ws.field_slot_bytes * slot;
  uint32_t* freq = reinterpret_cast<uint32_t*>(space + up256(sizeof(DecodeTable)));
  return FieldSlot{reinterpret_cast<DecodeTable*>(space), freq, freq + kNumSymbols,
                   reinterpret_cast<uint8_t*>(freq) + up256(8ull * kNumSymbols)};
}

// A version 6 chunk with coded fields (mode 4: 32 states, mode 5: one; lossless_fields.h), first
// part, as the host's decode_coded_fields_chunk: lane 0 reads the field header and the field table
// (into the chunk's slot), the warp builds the field stream's decoder table there; the field stream
// decodes as a mode 0 (2) chunk with a zero raw section into dst (the values w_k at dst[k], k <
// num_raw <= cn: the chunk's output, rewritten by the second part); the slot gets the chunk rebuilt
// as a mode 0 (2) payload: its states and symbols' words copied, the fields w_k >> 6 packed after
// them. Returns the status (every check of the host's, in its order); *symbol_words gets S.
template <bool Aligned>
__device__ int rebuild_fields_warp(const uint8_t* payload, const ChunkEntry& e, uint32_t cn, uint16_t* dst, int lane,
                                   const DecWs& ws, const FieldSlot& fs, bool mix_pairs, uint32_t* symbol_words_out) {
  const bool one = e.mode == kModeOneStateFields;
  const uint64_t sb = field_state_bytes(e);
  FieldLayout f{};
  int st = kOk;
  if (lane == 0) {
    st = read_field_layout(payload, e, f);
    // a mode 0 chunk's bound: at most one word per value (so the rebuilt payload fits its room)
    if (st == kOk && (f.symbol_words > cn || f.field_words > e.num_raw)) st = kErrStream;
    if (st == kOk) st = read_field_table(payload, f, fs.freq, fs.start);
  }
  st = __shfl_sync(kFull, st, 0);
  if (st != kOk) return st;
  const uint32_t symbol_words = __shfl_sync(kFull, f.symbol_words, 0);
  const uint32_t prob_bits = __shfl_sync(kFull, f.prob_bits, 0);
  const uint32_t words_offset = __shfl_sync(kFull, static_cast<uint32_t>(f.words_offset), 0);
  const ChunkEntry fe{__shfl_sync(kFull, f.field_entry.mode, 0), __shfl_sync(kFull, f.field_entry.num_words, 0),
                      __shfl_sync(kFull, f.field_entry.num_raw, 0), __shfl_sync(kFull, f.field_entry.checksum, 0)};
  __syncwarp();  // lane 0's freq and start are visible to the warp
  DecodeTable& ft = *fs.table;
  for (uint32_t s = lane; s < (1u << prob_bits); s += kLanes) ft.entry[s] = slot_entry(fs.freq, fs.start, s);
  if (lane == 0) {
    ft.zero_start = fs.start[kZeroSymbol];
    ft.zero_freq = fs.freq[kZeroSymbol];
    ft.prob_bits = prob_bits;
    ft.slot_mask = (1u << prob_bits) - 1;
  }
  __syncwarp();
  const uint8_t* words = payload + words_offset;
  const uint8_t* field_words = words + 2ull * symbol_words;
  const uint32_t num_fields = e.num_raw;
  if (one)
    st = __shfl_sync(kFull, lane == 0 ? decode_one_state_streams(payload + sb, field_words, ws.zeros, fe, num_fields, ft,
                                                                 dst, mix_pairs)
                                      : 0, 0);
  else
    st = mix_pairs ? decode_rans_streams<Aligned, true, true>(payload + sb, RansStreams(field_words, ws.zeros, fe), fe,
                                                              num_fields, ft, dst, lane)
                   : decode_rans_streams<Aligned, true, false>(payload + sb, RansStreams(field_words, ws.zeros, fe), fe,
                                                               num_fields, ft, dst, lane);
  if (st != kOk) return st;
  __syncwarp();  // the field stream's values in dst are visible to the warp
  // the rebuilt payload: states, words, then pack_field_values (eight fields, 6 bytes, a lane and
  // step; the last fields by lane 0)
  uint8_t* r = fs.rebuilt;
  for (uint32_t b = lane; b < sb; b += kLanes) r[b] = payload[b];
  for (uint32_t b = lane; b < 2 * symbol_words; b += kLanes) r[sb + b] = words[b];
  uint8_t* fields = r + sb + 2ull * symbol_words;
  const uint32_t groups = num_fields / 8;
  for (uint32_t g = lane; g < groups; g += kLanes) {
    uint64_t bytes = 0;
    for (int j = 0; j < 8; ++j) bytes |= uint64_t(dst[8 * g + j] >> kRawBits) << (8 * j);
    const uint64_t packed = pack6x8(bytes);
    for (int j = 0; j < 6; ++j) fields[6 * g + j] = static_cast<uint8_t>(packed >> (8 * j));
  }
  if (lane == 0) {
    BitWriter bits(fields + 6 * groups);
    for (uint32_t k = 8 * groups; k < num_fields; ++k) bits.put(uint32_t(dst[k]) >> kRawBits, kRawBits);
    bits.finish();
  }
  *symbol_words_out = symbol_words;
  return kOk;
}

// Word w of a word stream of num_words words, 0 past its end.
template <bool Aligned>
__device__ uint32_t word_or_zero(const uint8_t* words, uint32_t num_words, uint32_t w) {
  return w < num_words ? load_word<Aligned>(words, w) : 0u;
}

// Bytes [b, b + 4) of a raw-field stream of size bytes as a little-endian u32, zeros past its end.
__device__ uint32_t raw4_or_zero(const uint8_t* raw, uint32_t size, uint32_t b) {
  uint32_t v = 0;
  for (uint32_t k = 0; k < 4; ++k)
    if (b + k < size) v |= uint32_t(raw[b + k]) << (8 * k);
  return v;
}

// Element k < 64 of a window held across the warp in two registers (lane l: elements l, 32 + l).
// Every lane of the warp must call it.
__device__ uint32_t window_at(uint32_t first, uint32_t second, uint32_t k) {
  const uint32_t a = __shfl_sync(kFull, first, k & 31), b = __shfl_sync(kFull, second, k & 31);
  return k < 32 ? a : b;
}

// decode_rans_warp with register windows of the two streams (EP_LOSSLESS_DEC_WINDOW): same
// values, checks and statuses. Word window: words [wb, wb + 96), lane l holding wb + l,
// wb + 32 + l, wb + 64 + l; wpos - wb < 32 when a step starts, so its words are in the first 64.
// Raw window: bytes [rb, rb + 384) as u32s, lane l holding those at rb + 4l, + 128, + 256;
// byte(rpos) - rb < 128 when a step starts, so its fields (<= 24 bytes on) are in the first 256.
// A step consumes at most 32 words and 24 bytes, so one slide per step restores both bounds; the
// slid-in registers are read only after the next slide, steps later.
template <bool Aligned, bool OwnTable, bool MixPairs>
__device__ __forceinline__ int decode_rans_warp_window(const uint8_t* payload, const ChunkEntry& e, uint32_t cn,
                                                       const DecodeTable& table, uint16_t* dst, int lane) {
  const unsigned below = (1u << lane) - 1u;
  uint32_t x = load_le<uint32_t>(payload + 4 * lane);
  if (__any_sync(kFull, x < kStateLow)) return kErrStream;  // load_states
  const RansStreams st(payload, e);
  const uint32_t zero_start = table.zero_start, zero_freq = table.zero_freq;
  const uint32_t slot_mask = table.slot_mask, prob_bits = table.prob_bits;
  const uint32_t l = static_cast<uint32_t>(lane);
  uint32_t wb = 0, w0 = word_or_zero<Aligned>(st.words, st.num_words, l),
           w1 = word_or_zero<Aligned>(st.words, st.num_words, 32 + l), w2 = word_or_zero<Aligned>(st.words, st.num_words, 64 + l);
  uint32_t rb = 0, r0 = raw4_or_zero(st.raw, st.nraw_bytes, 4 * l), r1 = raw4_or_zero(st.raw, st.nraw_bytes, 128 + 4 * l),
           r2 = raw4_or_zero(st.raw, st.nraw_bytes, 256 + 4 * l);
  uint32_t wpos = 0, rpos = 0, checksum = 0;
  bool bad = false;
  const uint32_t steps = (cn + kLanes - 1) / kLanes;
  for (uint32_t t = 0; t < steps; ++t) {
    const uint32_t i = t * kLanes + l;
    const bool valid = i < cn;
    DecStep d = dec_state_step(x, valid, table, zero_start, zero_freq, slot_mask, prob_bits);
    const unsigned wmask = __ballot_sync(kFull, d.need);
    const uint32_t wp = wpos + __popc(wmask & below);
    const uint32_t word = window_at(w0, w1, wp - wb);
    if (d.need) {
      if (wp < st.num_words) d.y = (d.y << 16) | word;
      else bad = true;
    }
    wpos += __popc(wmask);
    const bool has_raw = valid && !d.zero;
    const unsigned rmask = __ballot_sync(kFull, has_raw);
    const uint32_t rp = rpos + __popc(rmask & below);
    const uint32_t bit = kRawBits * rp - 8 * rb;  // from the window's start; < 1218
    const uint32_t lo = window_at(r0, r1, bit >> 5), hi = window_at(r0, r1, (bit >> 5) + 1);
    uint32_t v = 0;
    if (has_raw) {
      if (rp < st.num_raw) {  // read_raw_field, join_value
        const uint64_t both = (uint64_t(hi) << 32) | lo;
        v = (entry_hi10(d.entry) << kRawBits) | (static_cast<uint32_t>(both >> (bit & 31)) & kRawMask);
      } else {
        bad = true;
      }
    }
    rpos += __popc(rmask);
    if (valid) keep_value<MixPairs>(x, d.y, v, i, dst, checksum);
    if (wpos - wb >= 32) {  // warp-uniform
      w0 = w1;
      w1 = w2;
      wb += 32;
      w2 = word_or_zero<Aligned>(st.words, st.num_words, wb + 64 + l);
    }
    if ((kRawBits * rpos >> 3) - rb >= 128) {
      r0 = r1;
      r1 = r2;
      rb += 128;
      r2 = raw4_or_zero(st.raw, st.nraw_bytes, rb + 256 + 4 * l);
    }
  }
  checksum = pair_checksum_from(dst, cn, MixPairs, checksum, lane);
  return finish_rans_warp(payload, e, bad, wpos, rpos, x, checksum);
}

// ---- the staged decoder (the default for 16-byte aligned blobs and outputs) ----
// One warp per chunk, as above, but built to issue few instructions per step (an H200 decoding one
// chunk per warp is bound by instruction issue once the loads' latency is hidden):
// - the two streams are staged in per-warp shared rings by coalesced 16-byte loads, a round of
//   512 bytes before each group of 8 steps that could need it, so a step's word and raw field are
//   shared-memory loads at masked offsets (a raw field: two 32-bit loads and a funnel shift);
// - a group of 8 steps (256 values) runs without bounds checks: the rings always hold the group's
//   worst case (8 x 32 words, 8 x 24 raw bytes), and a stream read past its end reads bytes of the
//   blob that are not the stream's (never past the blob) and leaves the cursor past the count,
//   which the end-of-chunk check reports (kErrStream, as the host reports the first such read);
// - values go to a per-warp staging buffer and leave 16 bytes per lane per group (each lane 8
//   consecutive values), the last partial group value by value.
constexpr int kStagedWarps = 8;                 // warps (chunks) per block of the staged decoder
constexpr uint32_t kGroupSteps = 8;             // steps between bounds checks and stores
constexpr uint32_t kWordRingBytes = 2048;       // per warp; holds the group's 512 bytes and a round
constexpr uint32_t kRawRingBytes = 1024;        // per warp; holds the group's 192 bytes and a round
constexpr uint32_t kRoundBytes = 16 * kLanes;   // one refill round: 16 bytes per lane
#ifndef EP_LOSSLESS_DEC_STAGED_MIN_BLOCKS
#define EP_LOSSLESS_DEC_STAGED_MIN_BLOCKS 5     // 40 resident warps per SM: at most 51 registers
#endif

// Per-warp shared buffers of the staged decoder (the raw ring has one more word: a copy of its
// first, so a field's second word is read without wrapping).
struct StagedRings {
  uint4 words[kWordRingBytes / 16];
  uint32_t raw[kRawRingBytes / 4 + 4];
  uint4 values[kGroupSteps * kLanes / 8];
};

// (a & ~mask) | (b & mask): one LOP3 (the compiler splits it in two when `a`'s masked bits are
// known zero).
__device__ __forceinline__ uint32_t bit_select(uint32_t a, uint32_t b, uint32_t mask) {
#ifdef EP_CUDA_EMULATION
  return (a & ~mask) | (b & mask);
#else
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xD8;" : "=r"(d) : "r"(a), "r"(b), "r"(mask));
  return d;
#endif
}

// (hi:lo) >> (s & 31), low 32 bits.
__device__ __forceinline__ uint32_t funnel_right(uint32_t lo, uint32_t hi, uint32_t s) {
#ifdef EP_CUDA_EMULATION
  return static_cast<uint32_t>(((uint64_t(hi) << 32) | lo) >> (s & 31));
#else
  return __funnelshift_r(lo, hi, s);
#endif
}

// One refill round of a ring: bytes [fill, fill + 512) of a stream space that starts at blob byte
// `base` (both multiples of 16) into ring bytes fill mod ring_bytes on; with `mirror`, the ring's
// first word also to mirror[0] (the raw ring's copy). Every lane calls. A block past the blob's last 16-byte block loads
// that block instead (blob and blocks 16-byte aligned: the block holding the blob's last byte lies
// in the blob's last 16-byte granule, never on another page); no stream byte is past the blob, and
// what a step reads of such a block is past its stream, which the end of the chunk reports.
// (space: the blob from the stream space's start; last: the offset of the blob's last 16-byte block
// in it, at most 2^32 - 16: no stream space holds more)
__device__ __forceinline__ void refill_round(const uint4* space, uint32_t last, uint32_t fill, uint4* ring,
                                             uint32_t ring_bytes, int lane, uint32_t* mirror) {
  const uint32_t at = fill + 16u * uint32_t(lane);
  const uint4 block = __ldg(space + (at < last ? at : last) / 16);
  ring[(at & (ring_bytes - 1)) / 16] = block;
  if (mirror != nullptr && (fill & (ring_bytes - 1)) == 0) {  // warp-uniform: lane 0 filled ring byte 0
    if (lane == 0) mirror[0] = block.x;
  }
}

// One step of the staged decoder for this lane (value i of the chunk; Tail: lanes past the chunk's
// end take no word, field or store). wcur: byte of the next word in word space, rbit: bit of the
// next field in raw space (warp-uniform, both advanced here). +0.0 is the table's last symbol, so
// its slots are the top ones, [zero_start, 2^prob_bits): a lane has a raw field iff its slot is
// below zero_start (2^prob_bits without +0.0).
template <bool Tail>
__device__ __forceinline__ void staged_step(uint32_t& x, uint32_t& wcur, uint32_t& rbit, uint32_t i, uint32_t cn, const uint32_t* table, uint32_t slot_mask,
                                            uint32_t prob_bits, uint32_t zero_start, unsigned below,
                                            const uint8_t* wring, const uint32_t* rring,
                                            uint16_t* staged, uint32_t s, uint16_t* dst) {
  const bool valid = !Tail || i < cn;
  const uint32_t slot = x & slot_mask;
  const uint32_t entry = table[slot];
  const uint32_t q = x >> prob_bits;
  const uint32_t y = ((entry >> kProbBits) & (kProbScale - 1)) * q + q + (entry & (kProbScale - 1));
  const bool need = valid && y < kStateLow;
  const unsigned wmask = __ballot_sync(kFull, need);
  const uint32_t word =
      *reinterpret_cast<const uint16_t*>(wring + ((wcur + 2u * __popc(wmask & below)) & (kWordRingBytes - 1)));
  wcur += 2u * __popc(wmask);
  const bool has_raw = valid && slot < zero_start;
  const unsigned rmask = __ballot_sync(kFull, has_raw);
  const uint32_t bit = rbit + kRawBits * __popc(rmask & below);
  const uint32_t k = (bit >> 5) & (kRawRingBytes / 4 - 1);
  const uint32_t field = funnel_right(rring[k], rring[k + 1], bit);
  rbit += kRawBits * __popc(rmask);
  if (valid) x = need ? (y << 16) | word : y;  // (a lane past the chunk's end keeps its final state)
  // the symbol's top 10 bits (entry bits 22-31) over the field's 6: one bit select
  const uint32_t v = has_raw ? bit_select(entry >> 16, field, kRawMask) : 0u;
  if (!Tail) staged[kLanes * s] = static_cast<uint16_t>(v);
  else if (valid) dst[i] = static_cast<uint16_t>(v);
}

// A lane's 8 values of a staged group, values [first, first + 8) of the chunk as 4 pairs (q), in
// its part of the chunk's checksum (MixPairs: version 7's).
template <bool MixPairs>
__device__ __forceinline__ uint32_t staged_group_checksum(const uint4& q, uint32_t first) {
  const uint32_t u[4] = {q.x, q.y, q.z, q.w};
  uint32_t sum = 0;
  if constexpr (MixPairs) {
#pragma unroll
    for (uint32_t m = 0; m < 4; ++m) sum += pair_mix(u[m]) * (first + 2 * m + 1);  // pair (first / 2 + m)
  } else {
#pragma unroll
    for (uint32_t m = 0; m < 4; ++m)
      sum += (u[m] & 0xFFFFu) * (2 * (first + 2 * m) + 1) + (u[m] >> 16) * (2 * (first + 2 * m) + 3);
  }
  return sum;
}

// A rANS chunk on the staged decoder: the values, checks and statuses of decode_chunk. `payload`
// is at byte `payload_at` of the blob (size bytes, 16-byte aligned, as `dst`); OwnTable as in
// decode_rans_warp; MixPairs: version 7's checksum (each instantiation's group loop holds only its
// own checksum's instructions).
template <bool OwnTable, bool MixPairs>
__device__ __forceinline__ int decode_rans_warp_staged(const uint8_t* blob, uint64_t size, uint64_t payload_at,
                                                       const ChunkEntry& e, uint32_t cn, const DecodeTable& table,
                                                       uint16_t* dst, int lane, StagedRings& rings) {
  const uint8_t* payload = blob + payload_at;
  const unsigned below = (1u << lane) - 1u;
  uint32_t x = load_le<uint32_t>(payload + 4 * lane);
  if (__any_sync(kFull, x < kStateLow)) return kErrStream;  // load_states
  const uint32_t zero_start = table.zero_start;
  const uint32_t slot_mask = table.slot_mask, prob_bits = table.prob_bits;
  // the chunk's sizes and places as lane 0 has them: the compiler then knows they are the same in
  // every lane, so the loops below are warp-uniform and their ballots need no divergent fallback
  cn = __shfl_sync(kFull, cn, 0);
  const uint32_t num_words = __shfl_sync(kFull, e.num_words, 0);
  payload_at = (uint64_t(__shfl_sync(kFull, uint32_t(payload_at >> 32), 0)) << 32) |
               __shfl_sync(kFull, uint32_t(payload_at), 0);
  // word space: blob bytes from the 16-byte block holding the first word; raw space likewise
  const uint64_t words_at = payload_at + kStateBytes, raw_at = words_at + 2ull * num_words;
  const uint64_t wbase = words_at & ~uint64_t(15), rbase = raw_at & ~uint64_t(15);
  uint32_t wcur = static_cast<uint32_t>(words_at - wbase), rbit = 8u * static_cast<uint32_t>(raw_at - rbase);
  const uint32_t wcur0 = wcur, rbit0 = rbit;
  // the rings are filled up to these (bytes of word / raw space, multiples of the round)
  uint32_t wfill = 0, rfill = 0;
  const uint8_t* wring = reinterpret_cast<const uint8_t*>(rings.words);
  uint32_t* rring = rings.raw;
  uint16_t* staged = reinterpret_cast<uint16_t*>(rings.values) + lane;
  uint32_t checksum = 0;
  // The rings hold, before each group, word bytes [wcur, wcur + 512) and raw bytes [rbit / 8,
  // rbit / 8 + 200) (a group's 8 x 32 words, 8 x 24 bytes of fields and the 32-bit word after the
  // last field's): two rounds each to start, then at most one round each per group restores that
  // (a round adds 512 bytes, a group consumes at most 512 and 192). What a round overwrites is
  // more than a ring's size behind the fill, so behind the cursor: no live byte is lost.
  constexpr uint32_t kGroupWordBytes = kGroupSteps * 2 * kLanes;
  constexpr uint32_t kGroupRawBytes = kGroupSteps * kRawBits * kLanes / 8 + 8;
  uint4* raw_ring = reinterpret_cast<uint4*>(rring);
  uint32_t* mirror = rring + kRawRingBytes / 4;
  const uint64_t last_block = (size - 1) & ~uint64_t(15);  // size > 0: the blob holds this chunk
  const uint4* wspace = reinterpret_cast<const uint4*>(blob + wbase);
  const uint4* rspace = reinterpret_cast<const uint4*>(blob + rbase);
  // (through a shuffle: the compiler would recompute them, and the group count, from 64-bit
  // values in every group to save their registers)
  const uint32_t wlast = __shfl_sync(kFull, static_cast<uint32_t>(min(last_block - wbase, uint64_t(0xFFFFFFF0u))), 0);
  const uint32_t rlast = __shfl_sync(kFull, static_cast<uint32_t>(min(last_block - rbase, uint64_t(0xFFFFFFF0u))), 0);
  refill_round(wspace, wlast, 0, rings.words, kWordRingBytes, lane, nullptr);
  refill_round(wspace, wlast, kRoundBytes, rings.words, kWordRingBytes, lane, nullptr);
  refill_round(rspace, rlast, 0, raw_ring, kRawRingBytes, lane, mirror);
  refill_round(rspace, rlast, kRoundBytes, raw_ring, kRawRingBytes, lane, mirror);
  wfill = rfill = 2 * kRoundBytes;
  const uint32_t groups = __shfl_sync(kFull, cn / (kGroupSteps * kLanes), 0);
  uint4* out16 = reinterpret_cast<uint4*>(dst) + lane;  // lane l: values [8 l, 8 l + 8) of each group
  uint32_t i = uint32_t(lane);                          // this lane's value of the group's first step
  uint32_t first8 = 8u * uint32_t(lane);                // the first of this lane's 8 values of the group
#pragma unroll 1
  for (uint32_t left = groups; left > 0; --left) {
#pragma unroll
    for (uint32_t s = 0; s < kGroupSteps; ++s)
      staged_step<false>(x, wcur, rbit, i + s * kLanes, cn, table.entry, slot_mask, prob_bits, zero_start,
                         below, wring, rring, staged, s, dst);
    __syncwarp();
    const uint4 values = rings.values[lane];
    *out16 = values;
    checksum += staged_group_checksum<MixPairs>(values, first8);
    out16 += kGroupSteps * kLanes / 8;
    i += kGroupSteps * kLanes;
    first8 += kGroupSteps * kLanes;
    // (the rounds below write only the rings, which the staging buffer's reads above do not touch)
    if (wfill < wcur + kGroupWordBytes) {  // warp-uniform
      refill_round(wspace, wlast, wfill, rings.words, kWordRingBytes, lane, nullptr);
      wfill += kRoundBytes;
    }
    if (rfill < (rbit >> 3) + kGroupRawBytes) {
      refill_round(rspace, rlast, rfill, raw_ring, kRawRingBytes, lane, mirror);
      rfill += kRoundBytes;
    }
    __syncwarp();  // the rings' new bytes are read, and the staging buffer rewritten, from here on
  }
  // the last steps (fewer than a group), value by value, then their checksum from dst
  const uint32_t tail = groups * kGroupSteps * kLanes;
#pragma unroll 1
  for (uint32_t t = tail; t < cn; t += kLanes)  // (t: warp-uniform)
    staged_step<true>(x, wcur, rbit, t + uint32_t(lane), cn, table.entry, slot_mask, prob_bits, zero_start,
                      below, wring, rring, staged, 0, dst);
  __syncwarp();  // every lane's values stored
  checksum += lane_checksum(dst + tail, cn - tail, tail, MixPairs, lane);
  const uint32_t wpos = (wcur - wcur0) / 2, rpos = (rbit - rbit0) / kRawBits;
  return finish_rans_warp(payload, e, false, wpos, rpos, x, checksum);
}

// The decode kernel's body (Mode: kDecodeUnaligned, kDecodeAligned (2-byte word loads) or
// kDecodeStaged (decode_rans_warp_staged; blob and out 16-byte aligned)), with the block's shared
// `table`, `valid_blob` and, staged, one StagedRings per warp, which the kernels below declare:
// function-local statics of a template kernel are out of reach of the CUDA emulation's
// shared-memory poisoning (csrc/emulation/cuda_runtime.h). MixPairs: the blob's checksum is
// version 7's; each decode kernel is built once per checksum (the host picks by the blob's
// version: the staged decoders of both checksums in one kernel need more than its 48 registers).
constexpr int kDecodeUnaligned = 0, kDecodeAligned = 1, kDecodeStaged = 2;
template <int Mode, int Warps, bool MixPairs>
__device__ __forceinline__ void decode_block(const uint8_t* blob, uint64_t size, uint16_t* out, const DecWs& ws,
                                             const int* status, DecodeTable& table, int& valid_blob,
                                             StagedRings* rings) {
  constexpr bool Aligned = Mode != kDecodeUnaligned;
  if (threadIdx.x == 0) valid_blob = *status == kOk;  // one read, so the whole block agrees
  __syncthreads();
  if (!valid_blob) return;
  const Header h = *ws.header;
  if (h.num_table_entries > 0)  // else only raw chunks (or none), and no table was built
    for (int k = threadIdx.x; k < (1 << h.prob_bits); k += blockDim.x) table.entry[k] = ws.table->entry[k];
  if (threadIdx.x == 0) {
    table.zero_start = ws.table->zero_start;
    table.zero_freq = ws.table->zero_freq;
    table.prob_bits = ws.table->prob_bits;
    table.slot_mask = ws.table->slot_mask;
  }
  __syncthreads();
  // the warp index and each chunk's mode as lane 0 has them: values the compiler knows to be the
  // same in every lane of a warp, so it knows the decoders run converged and their ballots need no
  // divergent fallback (WARPSYNC.COLLECTIVE: 3 more instructions per ballot)
  const int lane = threadIdx.x & 31, warp = __shfl_sync(kFull, int(threadIdx.x / 32), 0);
  for (uint64_t c = blockIdx.x * uint64_t(Warps) + warp; c < h.num_chunks; c += uint64_t(gridDim.x) * Warps) {
    const uint32_t cn = chunk_count(h, c);
    ChunkEntry e = read_entry(blob, h, c);
    // version 5: the mode word is mode | table << 8 (validate_kernel checked it); own: the chunk's
    // table, 0 for the shared one (always in older versions)
    const uint32_t word = __shfl_sync(kFull, e.mode, 0), own = word >> 8;
    uint32_t mode = word & kModeMask;
    e.mode = mode;
    const uint8_t* payload = blob + ws.offsets[c];
    const uint64_t used = payload_bytes(e, cn), padded = ws.offsets[c + 1] - ws.offsets[c];
    uint16_t* dst = out + c * h.chunk_values;
    bool bad = false;
    for (uint64_t k = used + lane; k < padded; k += kLanes) bad |= payload[k] != 0;
    int st = kErrPadding;
    if (!__any_sync(kFull, bad)) {
      // what the staged decoder reads the chunk from: the blob, or (version 6) the rebuilt chunk
      const uint8_t* source = blob;
      uint64_t source_size = size, at = ws.offsets[c];
      st = kOk;
      if (mode == kModeCodedFields || mode == kModeOneStateFields) {  // version 6: fields_kernel rebuilt it
        const uint32_t slot = ws.field_slot[c];
        st = int(ws.field_result[2 * slot]);
        mode = mode == kModeOneStateFields ? kModeOneState : kModeRans;
        e = ChunkEntry{mode, ws.field_result[2 * slot + 1], e.num_raw, e.checksum};
        payload = source = field_slot(ws, slot).rebuilt;
        source_size = ws.field_rebuilt_bytes;
        at = 0;
      }
      if (st != kOk) {
        // the field stream's status, fields_kernel's
      } else if (mode == kModeRaw)
        st = decode_raw_warp(payload, e, cn, dst, MixPairs, lane);
      else if (mode == kModeZero)
        st = decode_zero_warp(cn, dst, lane);
      else if (mode == kModeOneState)
        st = __shfl_sync(kFull, lane == 0 ? decode_one_state_chunk(payload, e, cn, table, dst, MixPairs) : 0, 0);
      else if constexpr (Mode == kDecodeStaged)
        st = own == 0 ? decode_rans_warp_staged<false, MixPairs>(source, source_size, at, e, cn, table, dst, lane,
                                                                 rings[warp])
                      : decode_rans_warp_staged<true, MixPairs>(source, source_size, at, e, cn, ws.table[own], dst,
                                                                lane, rings[warp]);
      else if constexpr (EP_LOSSLESS_DEC_WINDOW)
        st = own == 0 ? decode_rans_warp_window<Aligned, false, MixPairs>(payload, e, cn, table, dst, lane)
                      : decode_rans_warp_window<Aligned, true, MixPairs>(payload, e, cn, ws.table[own], dst, lane);
      else
        st = own == 0 ? decode_rans_warp<Aligned, false, MixPairs>(payload, e, cn, table, dst, lane)
                      : decode_rans_warp<Aligned, true, MixPairs>(payload, e, cn, ws.table[own], dst, lane);
    }
    if (lane == 0 && st != kOk) atomicMin(ws.first_error, (static_cast<unsigned long long>(c) << 8) | unsigned(st));
  }
}

// The decode kernels, each for format 7's pair checksum and, as *_linear, for the older formats'
// checksum. (Plain kernels, not a template: the CUDA emulation poisons only the __shared__
// variables of plain kernels.)
#define EP_DECODE_KERNEL(NAME, MODE, WARPS, MIN_BLOCKS, MIX_PAIRS)                                         \
  __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)                                               \
      NAME(const uint8_t* blob, uint64_t size, uint16_t* out, DecWs ws, const int* status) {              \
    __shared__ DecodeTable table;                                                                         \
    __shared__ int valid_blob;                                                                            \
    __shared__ StagedRings rings[MODE == kDecodeStaged ? kStagedWarps : 1];                               \
    decode_block<MODE, WARPS, MIX_PAIRS>(blob, size, out, ws, status, table, valid_blob,                 \
                                         MODE == kDecodeStaged ? rings : nullptr);                        \
  }
EP_DECODE_KERNEL(decode_kernel_aligned, kDecodeAligned, kDecWarps, kDecMinBlocks, true)
EP_DECODE_KERNEL(decode_kernel_aligned_linear, kDecodeAligned, kDecWarps, kDecMinBlocks, false)
EP_DECODE_KERNEL(decode_kernel_unaligned, kDecodeUnaligned, kDecWarps, kDecMinBlocks, true)
EP_DECODE_KERNEL(decode_kernel_unaligned_linear, kDecodeUnaligned, kDecWarps, kDecMinBlocks, false)
EP_DECODE_KERNEL(decode_kernel_staged, kDecodeStaged, kStagedWarps, EP_LOSSLESS_DEC_STAGED_MIN_BLOCKS, true)
EP_DECODE_KERNEL(decode_kernel_staged_linear, kDecodeStaged, kStagedWarps, EP_LOSSLESS_DEC_STAGED_MIN_BLOCKS, false)
#undef EP_DECODE_KERNEL

// Version 6: each chunk with coded fields (modes 4 and 5), one warp a chunk (rebuild_fields_warp):
// its slot gets the chunk rebuilt as a mode 0 (2) payload, or the status of its field stream, for
// the decode kernel that follows (which reports it after the chunk's padding check, as the host).
template <bool Aligned>
__device__ __forceinline__ void fields_block(const uint8_t* blob, uint16_t* out, const DecWs& ws, int valid_blob) {
  if (!valid_blob) return;
  const Header h = *ws.header;
  const int lane = threadIdx.x & 31, warp = __shfl_sync(kFull, int(threadIdx.x / 32), 0);
  const bool mix_pairs = __shfl_sync(kFull, int(pair_checksum(h.version)), 0) != 0;  // (warp-uniform)
  for (uint64_t c = blockIdx.x * uint64_t(kDecWarps) + warp; c < h.num_chunks; c += uint64_t(gridDim.x) * kDecWarps) {
    ChunkEntry e = read_entry(blob, h, c);
    const uint32_t mode = __shfl_sync(kFull, e.mode, 0) & kModeMask;
    if (mode != kModeCodedFields && mode != kModeOneStateFields) continue;  // (warp-uniform)
    e.mode = mode;
    const uint32_t slot = ws.field_slot[c];
    uint32_t symbol_words = 0;
    const int st = rebuild_fields_warp<Aligned>(blob + ws.offsets[c], e, chunk_count(h, c), out + c * h.chunk_values,
                                                lane, ws, field_slot(ws, slot), mix_pairs, &symbol_words);
    if (lane == 0) {
      ws.field_result[2 * slot] = uint32_t(st);
      ws.field_result[2 * slot + 1] = symbol_words;
    }
  }
}
__global__ void __launch_bounds__(32 * kDecWarps) fields_kernel_aligned(const uint8_t* blob, uint16_t* out, DecWs ws,
                                                                       const int* status) {
  __shared__ int valid_blob;
  if (threadIdx.x == 0) valid_blob = *status == kOk;  // one read, so the whole block agrees
  __syncthreads();
  fields_block<true>(blob, out, ws, valid_blob);
}
__global__ void __launch_bounds__(32 * kDecWarps) fields_kernel_unaligned(const uint8_t* blob, uint16_t* out, DecWs ws,
                                                                         const int* status) {
  __shared__ int valid_blob;
  if (threadIdx.x == 0) valid_blob = *status == kOk;
  __syncthreads();
  fields_block<false>(blob, out, ws, valid_blob);
}

// One thread: the status of the lowest failing chunk, as the host decoder reports it.
__global__ void report_kernel(DecWs ws, int* status) {
  const unsigned long long first = *ws.first_error;
  if (*status == kOk && first != kNoError) *status = static_cast<int>(first & 0xFF);
}

}  // namespace

extern "C" {

size_t ep_lossless_encode_workspace_bytes(uint64_t num_values, uint32_t chunk_values, uint32_t version) {
  if (chunk_values == 0) return 0;
  return carve(num_values, chunk_values, version, nullptr, nullptr);
}

size_t ep_lossless_max_blob_bytes(uint64_t num_values, uint32_t ndim, uint32_t chunk_values, uint32_t version) {
  return max_blob_bytes_v(num_values, ndim, chunk_values, version);
}

size_t ep_lossless_encode_fields_wanted_offset() { return kFieldsWantedOffset; }

int ep_lossless_encode_cuda(const uint16_t* values, uint64_t num_values, const int64_t* host_shape,
                            uint32_t ndim, uint32_t chunk_values, uint32_t version, uint8_t* out, uint64_t* out_size,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (ndim > uint32_t(kMaxDims) || chunk_values < kMinChunkValues || chunk_values > kMaxChunkValues ||
      chunk_values % kLanes != 0 || num_values > kMaxValues || version < kVersion4 || version > kNewestVersion)
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
  if (workspace_bytes < ep_lossless_encode_workspace_bytes(num_values, chunk_values, version))
    return cudaErrorInvalidValue;
  EncWs ws;
  carve(num_values, chunk_values, version, static_cast<char*>(workspace), &ws);
  const uint32_t one_state_max = one_state_max_values(version, chunk_values);
  uint64_t table_at = kHeaderBytesV4;  // the header's and shape's bytes
  for (uint32_t d = 0; d < ndim; ++d) table_at += dim_bytes_v4(shape.dims[d]);
  // chunk starts are 64-byte multiples (chunk_values % 32 == 0): 16-byte loads when the base is aligned
  const bool aligned = (reinterpret_cast<uintptr_t>(values) & 15) == 0;
  const bool out_aligned = (reinterpret_cast<uintptr_t>(out) & 3) == 0;
  // one memset (the histogram, the tickets and the two flags), then three kernels (version 6: four,
  // one of which returns at once)
  cudaMemsetAsync(ws.counts, 0, kSyncBytes, stream);
  const bool version6 = version >= kVersion6, mix_pairs = pair_checksum(version);
  EP_LAUNCH(histogram_kernel, static_cast<int>(blocks_for(chunks, kMetaWarps, kGridMax)), kMetaThreads,
            stream)(values, num_values, chunk_values, chunks, aligned, one_state_max, version6, mix_pairs, ws);
  const int rans_grid = static_cast<int>(blocks_for(chunks, kWarpsPerBlock, kRansMaxBlocks));
  // version 6: both, one of which returns at once (ws.fields_wanted)
  if (chunks > 0)
    EP_LAUNCH(rans_kernel, rans_grid, kBlockThreads, stream)(values, num_values, chunk_values, chunks, aligned, ws,
                                                              table_at, out, out_aligned, one_state_max, version6);
  if (chunks > 0 && version6)
    EP_LAUNCH(rans_fields_kernel, rans_grid, kBlockThreads, stream)(values, num_values, chunk_values, chunks, aligned,
                                                                     ws, table_at, out, out_aligned, one_state_max,
                                                                     mix_pairs);
  const int layout_grid = static_cast<int>(chunks > 0 ? 1 + blocks_for(chunks, kMetaWarps, kGridMax - 1) : 1);
  EP_LAUNCH(layout_kernel, layout_grid, kMetaThreads, stream)(values, ws, num_values, shape, ndim, chunk_values, chunks,
                                                              table_at, out, out_size, out_aligned, version);
  return static_cast<int>(cudaGetLastError());
}

size_t ep_lossless_decode_workspace_bytes(uint64_t num_values, uint32_t chunk_values, uint64_t field_chunks) {
  if (chunk_values == 0) return 0;
  const uint64_t chunks = num_chunks_for(num_values, chunk_values);
  // (no more slots than chunks: a larger count would only overflow the size)
  return carve_dec(chunks, chunk_values, field_chunks < chunks ? field_chunks : chunks, nullptr, nullptr);
}

int ep_lossless_decode_cuda(const uint8_t* blob, uint64_t blob_bytes, uint16_t* out, uint64_t num_values,
                            uint32_t min_chunk_values, uint64_t field_chunks, uint32_t version, int* status,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (min_chunk_values < kMinChunkValues) return cudaErrorInvalidValue;
  // (a version the blob does not have, or none the decoder reads, fails validate_kernel's checks)
  const bool pairs = pair_checksum(version);
  const uint64_t max_chunks = num_chunks_for(num_values, min_chunk_values);
  if (field_chunks > max_chunks) return cudaErrorInvalidValue;  // more slots than chunks: a bad count
  if (workspace_bytes < ep_lossless_decode_workspace_bytes(num_values, min_chunk_values, field_chunks))
    return cudaErrorInvalidValue;
  DecWs ws;
  carve_dec(max_chunks, min_chunk_values, field_chunks, static_cast<char*>(workspace), &ws);
  EP_LAUNCH(validate_kernel, 1, kMetaThreads, stream)(blob, blob_bytes, num_values, max_chunks, version, ws, status);
  if (max_chunks > 0 && field_chunks > 0) {  // version 6: the chunks with coded fields rebuilt first
    const uint64_t blocks = (max_chunks + kDecWarps - 1) / kDecWarps;
    const int grid = static_cast<int>(blocks < 65535 ? blocks : 65535);
    if ((reinterpret_cast<uintptr_t>(blob) & 1) == 0)
      EP_LAUNCH(fields_kernel_aligned, grid, 32 * kDecWarps, stream)(blob, out, ws, status);
    else
      EP_LAUNCH(fields_kernel_unaligned, grid, 32 * kDecWarps, stream)(blob, out, ws, status);
  }
  // the staged decoder where blob and out are 16-byte aligned (EP_LOSSLESS_DEC_STAGED=0: never)
  const bool staged = EP_LOSSLESS_DEC_STAGED && ((reinterpret_cast<uintptr_t>(blob) | reinterpret_cast<uintptr_t>(out)) & 15) == 0;
  if (max_chunks > 0 && staged) {
    const uint64_t blocks = (max_chunks + kStagedWarps - 1) / kStagedWarps;
    const int grid = static_cast<int>(blocks < 65535 ? blocks : 65535);
    const auto staged_kernel = pairs ? decode_kernel_staged : decode_kernel_staged_linear;
    cudaFuncSetAttribute(staged_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    EP_LAUNCH(staged_kernel, grid, 32 * kStagedWarps, stream)(blob, blob_bytes, out, ws, status);
  } else if (max_chunks > 0) {
    const uint64_t blocks = (max_chunks + kDecWarps - 1) / kDecWarps;
    const int grid = static_cast<int>(blocks < 65535 ? blocks : 65535);
    // payload offsets are multiples of 4: 2-byte word loads when the blob is 2-byte aligned
    const auto aligned = pairs ? decode_kernel_aligned : decode_kernel_aligned_linear;
    const auto unaligned = pairs ? decode_kernel_unaligned : decode_kernel_unaligned_linear;
    if (EP_LOSSLESS_FULL_OCCUPANCY) {
      cudaFuncSetAttribute(aligned, cudaFuncAttributePreferredSharedMemoryCarveout, EP_LOSSLESS_DEC_CARVEOUT);
      cudaFuncSetAttribute(unaligned, cudaFuncAttributePreferredSharedMemoryCarveout, EP_LOSSLESS_DEC_CARVEOUT);
    }
    if ((reinterpret_cast<uintptr_t>(blob) & 1) == 0)
      EP_LAUNCH(aligned, grid, 32 * kDecWarps, stream)(blob, blob_bytes, out, ws, status);
    else
      EP_LAUNCH(unaligned, grid, 32 * kDecWarps, stream)(blob, blob_bytes, out, ws, status);
  }
  EP_LAUNCH(report_kernel, 1, 1, stream)(ws, status);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
