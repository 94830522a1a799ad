// Format version 5's choice of tables (which chunks take a table of their own, and the shared
// table the others keep), shared by the host encoder (csrc/host/lossless.cpp) and the CUDA encoder
// (csrc/cuda/lossless_kernels.cu) so that both make it with the same integer arithmetic in the
// same order: their blobs are byte-identical. The format allows any table on any rANS chunk
// (csrc/codec/lossless_core.h); this is the encoders' policy.
//
// A chunk of at least kMinOwnTableValues values takes a table of its own when its estimated size
// with it (the symbols' cross-entropy under the table's frequencies, in integer 1/1024 bits as
// prefer_12_bits computes it, plus the table's bytes and framing) is smaller than with version 4's
// table (the blob's first) by more than the margin, and its payload would not be stored raw. The
// own table's frequencies are choose_prob_bits' (normalize_counts with prefer_12_bits' choice), as
// a blob's. The margin: kOwnTableMarginBytes (a rANS lane's bytes are its symbols' information
// plus 2 to 4 bytes, so two tables' chunks differ from their estimates' difference by under 2
// bytes a lane, 64 bytes a chunk) plus one 1/1024 bit per value (each estimate rounds log2 down by
// less than that): a chunk that takes its own table is then smaller than with version 4's, table
// included. The takers: the largest savings first (ties: the lower chunk index, own_table_before),
// as many as kMaxExtraTables and kMaxExtraTableSectionBytes allow (a taker whose table does not
// fit in the bytes left is passed over, the next considered), never every chunk that codes
// symbols (the lowest taker then keeps the shared table). Likewise the chunks that keep the shared
// table get one refitted to their symbols (all-+0.0 chunks left out) only when it is estimated to
// save more than that margin per chunk, table included (refit_pays); else version 4's: no version
// 5 blob is larger than version 4's.
#pragma once
#include <cmath>
#include <cstdint>

#include "codec/lossless_core.h"

namespace ep_comm::lossless {

constexpr uint32_t kMinOwnTableValues = 4096;
constexpr uint64_t kOwnTableMarginBytes = 64;
// Bytes the extra tables may take: the table section's u16 size less the largest shared table.
constexpr uint64_t kMaxExtraTableSectionBytes = 0xFFFF - kMaxTableBytes;
// Scratch (u32 words) own_table_saving_q10 takes.
constexpr uint32_t kOwnTableScratchWords = 4 * kNumSymbols;

// Whether a blob of `num_chunks` chunks of `chunk_values` values in format `version` lets its
// chunks take tables of their own (all but maybe the last have chunk_values values).
EP_HD bool own_tables_allowed(uint32_t version, uint64_t num_chunks, uint32_t chunk_values) {
  return extra_tables_format(version) && num_chunks >= 2 && chunk_values >= kMinOwnTableValues;
}

// The largest blob of `num_values` values in `ndim` dims in format `version` (max_blob_bytes, and
// version 5's extra tables).
EP_HD uint64_t max_blob_bytes_v(uint64_t num_values, uint32_t ndim, uint32_t chunk_values, uint32_t version) {
  return max_blob_bytes(num_values, ndim, chunk_values) + (extra_tables_format(version) ? kMaxExtraTableSectionBytes : 0);
}

// The cost of one symbol of frequency `freq` (> 0) out of 2^prob_bits, in 1/1024 bits (rounded up).
EP_HD uint64_t symbol_cost_q10(uint32_t freq, uint32_t prob_bits) {
  return (uint64_t(prob_bits) << 10) - log2_q10(freq);
}

// The frequencies of a table for `chunks` 32-state chunks with symbol counts[1025] (total > 0
// values), version 3's to 5's: normalize_counts with 11 bits, or with 12 where prefer_12_bits says
// so. freq[1025] gets them, freq12[1025] is scratch; returns the probability bits. Over a
// SymbolList (every symbol with a count), only the listed symbols' frequencies are written (the
// caller zeroes freq's others).
template <class Symbols>
EP_HD int choose_prob_bits_over(const Symbols& syms, const uint64_t* counts, uint64_t total, uint64_t chunks,
                                uint32_t* freq, uint32_t* freq12) {
  normalize_counts_over(syms, counts, total, freq, kProbBits);
  normalize_counts_over(syms, counts, total, freq12, kMaxProbBits);
  if (!prefer_12_bits_over(syms, counts, freq, freq12, chunks)) return kProbBits;
  for (uint32_t i = 0; i < syms.size(); ++i) freq[syms[i]] = freq12[syms[i]];
  return kMaxProbBits;
}
EP_HD int choose_prob_bits(const uint64_t* counts, uint64_t total, uint64_t chunks, uint32_t* freq, uint32_t* freq12) {
  return choose_prob_bits_over(AllSymbols{}, counts, total, chunks, freq, freq12);
}

// The own table own_table_saving_q10 priced: its probability bits, its version 4 encoding's
// Exp-Golomb orders and bytes (without the extra table's framing).
struct OwnTableShape {
  uint32_t prob_bits, gap_order, freq_order, bytes;
};

// The estimate of a chunk's saving from a table of its own (0 when it does not pay), in 1/1024
// bits: counts[1025] of its n values (`zeros` of them +0.0), shared_cost[s] the cost of symbol s
// under the blob's first table in 1/1024 bits (symbol_cost_q10); `section` gets the own table's
// bytes with framing. scratch: kOwnTableScratchWords words. Where the own table was priced
// (section > 0), scratch[0, kNumSymbols) holds its frequencies on return and *shape (if given)
// the rest, so that an encoder need not choose them again for a chunk that takes it.
//
// First a bound that decides most chunks without normalising: any frequencies summing to
// 2^prob_bits cost the symbols at least their empirical entropy n H (Gibbs' inequality; the cost
// rounds log2 down, so up), so when n H, less 1 bit and a 1e-9 share for the floating-point sums,
// plus the fixed bytes and the margin already reach the shared table's size, the own table cannot
// pay and the exact estimate below would return 0 as well: the choice is the same, made cheaper
// (chunks of the blob's statistics skip both normalisations); then the same with the own table's
// least bytes.
EP_HD uint64_t own_table_saving_q10(const uint64_t* counts, uint32_t n, uint32_t zeros, const uint64_t* shared_cost,
                                    uint32_t& section, uint32_t* scratch, OwnTableShape* shape = nullptr) {
  constexpr uint64_t kByte = 8 << 10;
  const uint64_t fixed = kByte * (kStateBytes + raw_bytes(n - zeros)), raw = kByte * 2ull * n;
  const uint64_t margin = kByte * kOwnTableMarginBytes + n;
  uint16_t sym[kNumSymbols];  // the symbols with a count: every loop below visits only these
  const SymbolList present{sym, present_symbols(counts, sym)};
  uint64_t shared_q10 = 0;
  double sum_c_log_c = 0.0;
  for (uint32_t i = 0; i < present.size(); ++i) {
    const uint64_t c = counts[present[i]];
    shared_q10 += c * shared_cost[present[i]];
    sum_c_log_c += double(c) * log2(double(c));
  }
  const uint64_t shared_size = shared_q10 + fixed < raw ? shared_q10 + fixed : raw;
  const double entropy_q10 = 1024.0 * (double(n) * log2(double(n)) - sum_c_log_c);
  const double floor_q10 = entropy_q10 * (1.0 - 1e-9) - 1024.0;
  section = 0;
  if (floor_q10 > 0.0 && double(fixed + margin) + floor_q10 >= double(shared_size)) return 0;
  // the same bound with the own table's least bytes: its gaps' (the symbols present fix them) at
  // their cheapest order, one bit a frequency at least, its framing
  for (uint32_t i = 0, previous = ~0u; i < present.size(); ++i) {
    scratch[i] = uint32_t(present[i]) - previous - 1;
    previous = uint32_t(present[i]);
  }
  uint64_t gap_bits = 0;
  const uint32_t kg = eg_cheapest_order(scratch, present.size(), kMaxGapOrder, gap_bits);
  const uint32_t least_table = uint32_t(1 + (gap_bits + present.size() + 7) / 8);
  const uint64_t least_section = extra_table_bytes(least_table);
  if (floor_q10 > 0.0 && double(fixed + margin + kByte * least_section) + floor_q10 >= double(shared_size)) return 0;
  uint32_t* f = scratch;
  for (int s = 0; s < kNumSymbols; ++s) f[s] = 0;
  const uint64_t pb = uint64_t(choose_prob_bits_over(present, counts, n, 1, f, scratch + kNumSymbols));
  uint64_t own_q10 = 0;
  for (uint32_t i = 0; i < present.size(); ++i)
    own_q10 += counts[present[i]] * symbol_cost_q10(f[present[i]], uint32_t(pb));
  // the table's orders (table_orders_v4): the gaps' is the bound's; its bytes (table_bytes_v4)
  uint32_t* f1 = scratch + 2 * kNumSymbols;
  for (uint32_t i = 0; i < present.size(); ++i) f1[i] = f[present[i]] - 1;
  uint64_t freq_bits = 0;
  const uint32_t kf = eg_cheapest_order(f1, present.size(), kMaxFreqOrder, freq_bits);
  const uint32_t bytes = uint32_t(1 + (gap_bits + freq_bits + 7) / 8);
  section = extra_table_bytes(bytes);
  if (shape != nullptr) *shape = OwnTableShape{uint32_t(pb), kg, kf, bytes};
  const uint64_t own_payload = own_q10 + fixed;
  if (own_payload + margin >= raw) return 0;  // it would be stored raw
  const uint64_t own_size = own_payload + kByte * section;
  return own_size + margin < shared_size ? shared_size - own_size : 0;
}

// The order in which chunks are offered a table of their own: chunk a (saving sa) before chunk b
// (saving sb) when its saving is larger, or equal and its index lower.
EP_HD bool own_table_before(uint64_t sa, uint64_t a, uint64_t sb, uint64_t b) { return sa != sb ? sa > sb : a < b; }

// Whether a taker (its table's bytes with framing `section`) fits beside the `used` bytes of the
// extra tables taken before it.
EP_HD bool own_table_fits(uint64_t used, uint32_t section) { return used + section <= kMaxExtraTableSectionBytes; }

// The shared table's refit: whether frequencies `fitted` (2^fitted_bits, its version 4 table
// `fitted_bytes` bytes) code the symbols counts[1025] (total > 0) of the `keepers` chunks that keep
// the shared table smaller than the blob's first table (shared_cost[s]: its symbols' costs, its
// table `first_bytes` bytes) by more than kOwnTableMarginBytes a chunk and a 1/1024 bit a value.
// refit_pays_sums decides from the two sums over the symbols with a count (first_q10: counts[s]
// shared_cost[s]; fitted_q10: counts[s] symbol_cost_q10(fitted[s], fitted_bits)), which a GPU warp
// adds up over its lanes.
EP_HD bool refit_pays_sums(uint64_t first_q10, uint64_t fitted_q10, uint64_t total, uint64_t keepers,
                           uint32_t first_bytes, uint32_t fitted_bytes) {
  constexpr uint64_t kByte = 8 << 10;
  return fitted_q10 + kByte * fitted_bytes + kByte * kOwnTableMarginBytes * keepers + total <
         first_q10 + kByte * first_bytes;
}
EP_HD bool refit_pays(const uint64_t* counts, uint64_t total, uint64_t keepers, const uint64_t* shared_cost,
                      uint32_t first_bytes, const uint32_t* fitted, uint32_t fitted_bits, uint32_t fitted_bytes) {
  uint64_t first_q10 = 0, fitted_q10 = 0;
  for (int s = 0; s < kNumSymbols; ++s) {
    if (counts[s] == 0) continue;
    first_q10 += counts[s] * shared_cost[s];
    fitted_q10 += counts[s] * symbol_cost_q10(fitted[s], fitted_bits);
  }
  return refit_pays_sums(first_q10, fitted_q10, total, keepers, first_bytes, fitted_bytes);
}

}  // namespace ep_comm::lossless
