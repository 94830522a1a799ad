// Memory-safety and agreement check of the host lossless decoders and rANS encoding passes, built
// with AddressSanitizer and UBSan by tests/test_codec_native_fuzz.py.
//
// Decoding: every blob <dir>/<i>.blob (with <dir>/<i>.raw, its values) is decoded clean and after
// `mutations` random mutations each (byte flips, random bytes, truncations), from an exact-size
// heap copy (so a read past the blob is an ASan error), by the portable core (decode_chunk, the
// reference), the host's portable decoder (lossless_scalar.h), the AVX2 decoder and the AVX-512
// decoder (two chunks at a time), each where the CPU has it. Every path must give the
// same status (the first failing chunk's, in chunk order, as ep_comm._host reports) and, when it
// succeeds, the same values; clean blobs must give their values.
// Encoding: random chunks (random bits, narrow exponents, +0.0 runs and scatter) coded by the
// portable, AVX2 (also with staged entries, for chunks without +0.0) and AVX-512 rANS passes into
// exact-size word buffers must give the same words
// and states; the host's portable first pass (histogram, checksum, +0.0 count) and raw-field
// split must agree with split_chunk; format version 6's AVX-512 field stream (values, counts,
// checksum) must agree with a plain loop. choose_prob_bits over a list of the present symbols
// must agree with the same over every symbol.
// Usage: lossless_fuzz <dir> <num_blobs> <mutations> <encoder_trials> <seed>; exit code 0 when
// everything agrees (a sanitizer error aborts with another code).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "codec/lossless_avx2.h"
#include "codec/lossless_avx512.h"
#include "codec/lossless_core.h"
#include "codec/lossless_fields.h"
#include "codec/lossless_scalar.h"
#include "codec/lossless_tables.h"

using namespace ep_comm::lossless;

namespace {

enum Path { kPortable, kScalar, kAvx2, kAvx512 };

std::vector<uint8_t> read_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return {};
  std::fseek(f, 0, SEEK_END);
  const long size = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  if (std::fread(bytes.data(), 1, bytes.size(), f) != bytes.size()) bytes.clear();
  std::fclose(f);
  return bytes;
}

// A chunk's checksum written out from lossless_core.h's definition: versions 2-6, sum_i v_i (2 i +
// 1); version 7 (pairs), sum_j mix(v_2j + 2^16 v_2j+1) (2 j + 1) with mix(u) = m XOR m >> 16, m =
// u * 0x9E3779B1 (all mod 2^32; v_n = 0 for odd n).
uint32_t plain_checksum(const uint16_t* v, uint32_t n, bool pairs) {
  uint32_t sum = 0;
  if (!pairs) {
    for (uint32_t i = 0; i < n; ++i) sum += uint32_t(v[i]) * (2 * i + 1);
    return sum;
  }
  for (uint32_t j = 0; 2 * j < n; ++j) {
    const uint64_t u = uint64_t(v[2 * j]) + (2 * j + 1 < n ? uint64_t(v[2 * j + 1]) << 16 : 0);
    const uint32_t m = static_cast<uint32_t>(u * 0x9E3779B1ull);
    sum += (m ^ (m >> 16)) * (2 * j + 1);
  }
  return sum;
}

// Decodes blob b[0, size) (format 2 to 7) on `path` as ep_comm._host's decode_parsed does (the binding's own
// function is internal to the Python module): the status of the first failing chunk in chunk
// order, values to `out`.
int decode(const uint8_t* b, uint64_t size, Path path, std::vector<uint16_t>& out) {
  Header h;
  int st = parse_header(b, size, h, kNewestVersion);
  if (st != kOk) return st;
  const bool pairs = pair_checksum(h.version);
  std::unique_ptr<uint32_t[]> freq(new uint32_t[kNumSymbols]), start(new uint32_t[kNumSymbols]);
  uint64_t shared_bytes = 0;
  st = read_table(b, h, freq.get(), start.get(), &shared_bytes);
  if (st != kOk) return st;
  // format version 5's extra tables (table k >= 1 of a chunk is extra table k - 1)
  std::vector<ExtraTable> refs(h.num_extra_tables);
  std::vector<uint32_t> extra_freq(kNumSymbols * refs.size()), extra_start(kNumSymbols * refs.size());
  if (!refs.empty()) {
    st = read_extra_table_refs(b, h, shared_bytes, refs.data());
    for (size_t k = 0; k < refs.size() && st == kOk; ++k)
      st = read_extra_table(b, refs[k], &extra_freq[k * kNumSymbols], &extra_start[k * kNumSymbols]);
    if (st != kOk) return st;
  }
  std::vector<ChunkEntry> entries(h.num_chunks);
  std::vector<uint64_t> offsets(uint64_t(h.num_chunks) + 1);
  std::vector<uint32_t> chunk_table(h.num_chunks);
  st = read_directory(b, size, h, entries.data(), offsets.data(), chunk_table.data());
  if (st != kOk) return st;
  if (h.num_values > (1u << 24)) return -1;  // a mutation declaring a huge tensor: skipped
  out.assign(h.num_values, 0);
  std::unique_ptr<DecodeTable[]> tables(new DecodeTable[1 + refs.size()]);
  if (h.num_values > 0) build_decode_table(freq.get(), start.get(), tables[0], int(h.prob_bits));
  for (size_t k = 0; k < refs.size(); ++k)
    build_decode_table(&extra_freq[k * kNumSymbols], &extra_start[k * kNumSymbols], tables[1 + k],
                       int(refs[k].prob_bits));
  std::vector<int> status(h.num_chunks, kOk);
  // format version 6's mode 4: the field stream and then the chunk decoded as mode 0 on this path
  std::unique_ptr<FieldDecodeScratch> fields(new FieldDecodeScratch(std::min<uint64_t>(h.chunk_values, h.num_values)));
  const auto build = [path](const uint32_t* f, const uint32_t* s, DecodeTable& t, int bits) {
    if (path == kAvx512) build_decode_table_avx512(f, s, t, bits);
    else build_decode_table(f, s, t, bits);
  };
  const auto decode_mode0 = [path, pairs](const uint8_t* p, const ChunkEntry& e, uint32_t n, const DecodeTable& t,
                                          uint16_t* o) {
    if (path == kPortable) return decode_chunk(p, e, n, t, o, pairs);
    if (path == kScalar) return decode_chunk_scalar(p, e, n, t, o, pairs);
    if (path == kAvx2) return decode_chunk_avx2(p, e, n, t, o, pairs);
    return decode_chunk_avx512(p, e, n, t, o, pairs);
  };
  for (uint64_t c = 0; c < h.num_chunks; c += 2) {
    const uint8_t* payloads[2];
    const ChunkEntry* rans[2];
    uint32_t counts[2];
    uint16_t* dsts[2];
    uint64_t index[2];
    int pending = 0;
    for (uint64_t q = c; q < std::min<uint64_t>(c + 2, h.num_chunks); ++q) {
      const uint32_t n = chunk_count(h, q);
      const uint8_t* payload = b + offsets[q];
      uint16_t* dst = out.data() + q * h.chunk_values;
      bool padding_ok = true;
      for (uint64_t z = offsets[q] + payload_bytes(entries[q], n); z < offsets[q + 1]; ++z) padding_ok = padding_ok && b[z] == 0;
      if (!padding_ok) status[q] = kErrPadding;
      else if (entries[q].mode == kModeRaw) status[q] = decode_raw_chunk(payload, entries[q], n, dst, pairs);
      else if (entries[q].mode == kModeZero) decode_zero_chunk(n, dst);
      else if (entries[q].mode == kModeOneState) status[q] = decode_one_state_chunk(payload, entries[q], n, tables[0], dst, pairs);
      else if (entries[q].mode == kModeCodedFields || entries[q].mode == kModeOneStateFields)
        status[q] = decode_coded_fields_chunk(payload, entries[q], n, tables[chunk_table[q]], dst, *fields, pairs,
                                              build, decode_mode0);
      else if (path == kPortable) status[q] = decode_chunk(payload, entries[q], n, tables[chunk_table[q]], dst, pairs);
      else if (path == kScalar) status[q] = decode_chunk_scalar(payload, entries[q], n, tables[chunk_table[q]], dst, pairs);
      else if (path == kAvx2) status[q] = decode_chunk_avx2(payload, entries[q], n, tables[chunk_table[q]], dst, pairs);
      else {
        payloads[pending] = payload;
        rans[pending] = &entries[q];
        counts[pending] = n;
        dsts[pending] = dst;
        index[pending++] = q;
      }
    }
    // a pair with each chunk's table, as the host pairs them
    if (pending > 0) {
      int st2[2];
      const DecodeTable* pair_tables[2] = {&tables[chunk_table[index[0]]],
                                           &tables[chunk_table[index[pending - 1]]]};
      decode_chunks_avx512(pending, payloads, rans, counts, pair_tables, dsts, st2, pairs);
      for (int k = 0; k < pending; ++k) status[index[k]] = st2[k];
    }
  }
  for (const int s : status)
    if (s != kOk) return s;
  return kOk;
}

// Mismatches between the paths on the blobs and their mutations.
long check_decoders(const std::string& dir, int num_blobs, int mutations, const std::vector<Path>& paths,
                    std::mt19937_64& rng) {
  long mismatches = 0, trials = 0, rejected = 0;
  for (int i = 0; i < num_blobs; ++i) {
    const std::vector<uint8_t> blob = read_file(dir + "/" + std::to_string(i) + ".blob");
    const std::vector<uint8_t> raw = read_file(dir + "/" + std::to_string(i) + ".raw");
    if (blob.empty()) {
      std::printf("missing blob %d\n", i);
      return 1;
    }
    for (int m = 0; m <= mutations; ++m) {
      std::vector<uint8_t> bad = blob;
      const int kind = m == 0 ? -1 : static_cast<int>(rng() % 3);
      if (kind == 0) bad[rng() % bad.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
      if (kind == 1)
        for (int r = 0; r < 4; ++r) bad[rng() % bad.size()] = static_cast<uint8_t>(rng());
      if (kind == 2) bad.resize(rng() % bad.size());
      uint8_t* copy = static_cast<uint8_t*>(std::malloc(bad.empty() ? 1 : bad.size()));
      if (!bad.empty()) std::memcpy(copy, bad.data(), bad.size());
      std::vector<uint16_t> first_values;
      int first_status = 0;
      for (size_t p = 0; p < paths.size(); ++p) {
        std::vector<uint16_t> values;
        const int status = decode(copy, bad.size(), paths[p], values);
        if (p == 0) {
          first_status = status;
          first_values = values;
        } else if (status != first_status || (status == kOk && values != first_values)) {
          if (++mismatches <= 5) std::printf("blob %d mutation %d: path %d status %d, portable %d\n", i, m, int(paths[p]), status, first_status);
        }
      }
      std::free(copy);
      ++trials;
      rejected += first_status != kOk;
      if (m == 0 && (first_status != kOk || first_values.size() * 2 != raw.size() ||
                     std::memcmp(first_values.data(), raw.data(), raw.size()) != 0)) {
        std::printf("blob %d does not decode to its values (status %d)\n", i, first_status);
        ++mismatches;
      }
    }
  }
  std::printf("decoders: %ld trials, %ld rejected, %ld mismatches\n", trials, rejected, mismatches);
  return mismatches;
}

// Mismatches between the rANS passes on random chunks.
long check_encoders(int trials, bool avx2, bool avx512, std::mt19937_64& rng) {
  long mismatches = 0, staged_trials = 0, lockstep_trials = 0, wide_trials = 0, fused_trials = 0;
  for (int trial = 0; trial < trials; ++trial) {
    const bool pairs = trial % 2 == 0;  // version 7's checksum on even trials
    const uint32_t n = 1 + static_cast<uint32_t>(rng() % 5000);
    const int pattern = static_cast<int>(rng() % 5);
    std::vector<uint16_t> v(n);
    for (uint16_t& x : v) {
      const uint32_t exponent = 110 + static_cast<uint32_t>(rng() % 20);
      x = pattern == 0 ? static_cast<uint16_t>(rng()) : static_cast<uint16_t>(((rng() & 1) << 15) | (exponent << 7) | (rng() & 127));
      if (pattern == 1 || (pattern == 3 && rng() % 4 == 0)) x = 0;
    }
    if (pattern == 4) {
      const uint32_t a = static_cast<uint32_t>(rng() % n), b = a + static_cast<uint32_t>(rng() % (n - a + 1));
      std::fill(v.begin() + a, v.begin() + b, uint16_t(0));
    }
    uint64_t counts[kNumSymbols] = {};
    for (const uint16_t x : v) ++counts[symbol_of(x)];
    // 11-bit frequencies on even trials, else 12-bit ones where they fit (as format version 3 may)
    uint32_t freq[kNumSymbols], freq12[kNumSymbols], start[kNumSymbols];
    int prob_bits = kProbBits;
    normalize_counts(counts, n, freq, kProbBits);
    normalize_counts(counts, n, freq12, kMaxProbBits);
    bool fits = true;
    for (int s = 0; s < kNumSymbols; ++s) fits = fits && freq12[s] <= kProbScale;
    if (trial % 2 == 1 && fits) {
      std::memcpy(freq, freq12, sizeof(freq));
      prob_bits = kMaxProbBits;
      ++wide_trials;
    }
    cumulative(freq, start, prob_bits);
    std::vector<EncSym> syms(kNumSymbols);
    for (int s = 0; s < kNumSymbols; ++s) syms[s] = make_enc_sym(start[s], freq[s], prob_bits);
    std::unique_ptr<SimdEncTables> tables(new SimdEncTables());
    make_simd_enc_tables(syms.data(), *tables);
    // exact-size word buffers (the AVX2 pass stores 8 words at a time: 8 words of slack below)
    std::vector<uint16_t> ref(n), a2(n + 8), a5(n);
    uint32_t ref_states[kLanes], states[kLanes];
    const uint32_t words = rans_encode_chunk(v.data(), n, syms.data(), ref_states, ref.data() + n);
    const auto same = [&](uint32_t got_words, const uint16_t* got_end) {
      return got_words == words && std::memcmp(states, ref_states, sizeof(states)) == 0 &&
             std::memcmp(got_end - words, ref.data() + n - words, 2ull * words) == 0;
    };
    // the AVX2 pass with its zero handling, and (for chunks without +0.0) with staged entries
    if (avx2 && !same(rans_encode_chunk_avx2(v.data(), n, syms.data(), *tables, states, a2.data() + 8 + n), a2.data() + 8 + n))
      ++mismatches;
    if (avx2 && counts[kZeroSymbol] == 0) {
      ++staged_trials;
      if (!same(rans_encode_chunk_avx2(v.data(), n, syms.data(), *tables, states, a2.data() + 8 + n, false),
                a2.data() + 8 + n))
        ++mismatches;
    }
    if (avx512 && !same(rans_encode_chunk_avx512(v.data(), n, syms.data(), *tables, states, a5.data() + n), a5.data() + n))
      ++mismatches;
    // the AVX-512 pass packing a chunk's raw fields while coding (chunks without +0.0), into an
    // exact-size buffer of n + 16 bytes, against split_chunk's fields
    if (avx512 && counts[kZeroSymbol] == 0) {
      ++fused_trials;
      std::vector<uint8_t> ref_fields(n + 8), fused(n + 16, 0xA5);
      uint32_t ref_fields_count = 0;
      split_chunk(v.data(), n, ref_fields.data(), ref_fields_count, pairs);
      const uint16_t* one_v[1] = {v.data()};
      uint16_t* one_end[1] = {a5.data() + n};
      uint32_t* one_states[1] = {states};
      uint8_t* one_fields[1] = {fused.data()};
      uint32_t one_words = 0;
      rans_encode_chunks_avx512(1, one_v, &n, syms.data(), *tables, one_states, one_end, &one_words, one_fields);
      const uint64_t field_bytes = (uint64_t(n) * kRawBits + 7) / 8;
      if (!same(one_words, a5.data() + n) || ref_fields_count != n ||
          std::memcmp(fused.data(), ref_fields.data(), field_bytes) != 0)
        ++mismatches;
    }
    // two chunks in lockstep: this one and its last m values (fewer, as many or, as the first of
    // the two, more steps than the other), each against its own portable pass
    if (avx512) {
      ++lockstep_trials;
      const uint32_t m = 1 + static_cast<uint32_t>(rng() % n);
      const uint16_t* tail = v.data() + (n - m);
      std::vector<uint16_t> ref_tail(m), b5(n), c5(m);
      uint32_t ref_tail_states[kLanes], tail_states[kLanes];
      const uint32_t tail_words = rans_encode_chunk(tail, m, syms.data(), ref_tail_states, ref_tail.data() + m);
      const bool tail_first = rng() % 2 == 0;
      const uint16_t* pair_v[2] = {v.data(), tail};
      uint32_t pair_n[2] = {n, m};
      uint32_t* pair_states[2] = {states, tail_states};
      uint16_t* pair_end[2] = {b5.data() + n, c5.data() + m};
      uint32_t pair_words[2];
      if (tail_first) {
        std::swap(pair_v[0], pair_v[1]);
        std::swap(pair_n[0], pair_n[1]);
        std::swap(pair_states[0], pair_states[1]);
        std::swap(pair_end[0], pair_end[1]);
      }
      // without +0.0, both chunks' raw fields packed while coding
      const bool pack = counts[kZeroSymbol] == 0;
      std::vector<uint8_t> b_fields(n + 16), c_fields(m + 16);
      uint8_t* pair_fields[2] = {b_fields.data(), c_fields.data()};
      if (tail_first) std::swap(pair_fields[0], pair_fields[1]);
      rans_encode_chunks_avx512(2, pair_v, pair_n, syms.data(), *tables, pair_states, pair_end, pair_words,
                                pack ? pair_fields : nullptr);
      if (tail_first) std::swap(pair_words[0], pair_words[1]);
      if (pack) {
        std::vector<uint8_t> ref_b(n + 8), ref_c(m + 8);
        uint32_t count_b = 0, count_c = 0;
        split_chunk(v.data(), n, ref_b.data(), count_b, pairs);
        split_chunk(tail, m, ref_c.data(), count_c, pairs);
        if (std::memcmp(b_fields.data(), ref_b.data(), (uint64_t(n) * kRawBits + 7) / 8) != 0 ||
            std::memcmp(c_fields.data(), ref_c.data(), (uint64_t(m) * kRawBits + 7) / 8) != 0)
          ++mismatches;
      }
      if (!same(pair_words[0], b5.data() + n)) ++mismatches;
      if (pair_words[1] != tail_words || std::memcmp(tail_states, ref_tail_states, sizeof(tail_states)) != 0 ||
          std::memcmp(c5.data() + m - tail_words, ref_tail.data() + m - tail_words, 2ull * tail_words) != 0)
        ++mismatches;
    }
    // the first passes (portable, AVX2 with 4 and 8 tables; from a random piece start) and the
    // raw-field split, into an exact-size buffer of n + 16 bytes (what the host's scratch gives
    // them), against split_chunk, whose checksum is checked against plain_checksum's
    std::vector<uint8_t> ref_raw(n + 8), raw(n + 16);
    uint32_t ref_num_raw = 0;
    const uint32_t ref_checksum = split_chunk(v.data(), n, ref_raw.data(), ref_num_raw, pairs);
    bool ok = ref_checksum == plain_checksum(v.data(), n, pairs);
    if (avx2) ok = ok && chunk_checksum_avx2(v.data(), n, pairs) == ref_checksum;
    const uint32_t cut = static_cast<uint32_t>(rng() % (n + 1)) / 16 * 16;
    for (int pass = 0; pass < (avx2 ? 3 : 1); ++pass) {
      std::unique_ptr<SymbolHistogram> local(new SymbolHistogram());
      std::vector<uint64_t> hist(kNumSymbols, 0);
      const auto survey = [&](const uint16_t* x, uint32_t count, uint32_t first) {
        if (pass == 1) return survey_chunk_avx2<4>(x, count, first, *local, hist.data(), pairs);
        if (pass == 2) return survey_chunk_avx2<8>(x, count, first, *local, hist.data(), pairs);
        return survey_chunk_scalar(x, count, first, *local, hist.data(), pairs);
      };
      const ChunkSurvey a = survey(v.data(), cut, 0);
      const ChunkSurvey b = survey(v.data() + cut, n - cut, cut);
      local->fold_into(hist.data());
      ok = ok && a.checksum + b.checksum == ref_checksum && a.zeros + b.zeros == n - ref_num_raw;
      for (int s = 0; s < kNumSymbols; ++s) ok = ok && hist[s] == counts[s];
    }
    ok = ok && split_fields_scalar(v.data(), n, n - ref_num_raw, raw.data()) == ref_num_raw &&
         std::memcmp(raw.data(), ref_raw.data(), raw_bytes(ref_num_raw)) == 0;
    if (!ok) ++mismatches;
  }
  std::printf("encoders: %d trials (%ld without +0.0, %ld in lockstep pairs, %ld with 12-bit frequencies, %ld with "
              "fields packed by the AVX-512 pass), %ld mismatches\n",
              trials, staged_trials, lockstep_trials, wide_trials, fused_trials, mismatches);
  return mismatches;
}

// divide_by_freq_avx2 on 8 dividends y (all divided by f, with reciprocal rcp: the pass doubles
// it), through memory, in the rounding mode the rANS pass gives it.
__attribute__((target("avx2"))) void divide_by_freq_avx2_lanes(const uint32_t* y, uint32_t f, float rcp, uint32_t* q,
                                                              uint32_t* r) {
  const RoundTowardZero round_toward_zero;
  const __m256 rcp1 = _mm256_set1_ps(rcp);
  __m256i vq, vr;
  divide_by_freq_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y)), _mm256_set1_epi32(int(f)),
                      _mm256_add_ps(rcp1, rcp1), vq, vr);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), vq);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(r), vr);
}

// divide_by_freq_avx512 on 16 dividends y (all divided by f, with reciprocal rcp), through memory.
EP_COMM_AVX512 void divide_by_freq_avx512_lanes(const uint32_t* y, uint32_t f, float rcp, uint32_t* q, uint32_t* r) {
  __m512i vq, vr;
  divide_by_freq_avx512(_mm512_loadu_si512(y), _mm512_set1_epi32(int(f)), _mm512_set1_ps(rcp), vq, vr);
  _mm512_storeu_si512(q, vq);
  _mm512_storeu_si512(r, vr);
}

// Mismatches of the SIMD quotients (divide_by_freq_avx2 / _avx512, with the encoder's table of
// reciprocals) against y / freq, for every frequency 1..2048: every dividend y < freq 2^21 for
// frequencies 1-4, and for the others the dividends k freq + d (d = 0, 1, freq - 1) at
// k = 0..63, 2^m - 1, 2^m, 2^m + 1 and 64 random k below 2^21, plus y = freq 2^21 - 1, the
// largest a state can be after renormalisation.
long check_division(bool avx2, bool avx512, std::mt19937_64& rng) {
  // the reciprocals as the encoder's table holds them: symbol s at frequency base + s, for the
  // bases 0 and 1024 in turn
  std::vector<EncSym> syms(kNumSymbols);
  std::unique_ptr<SimdEncTables> tables(new SimdEncTables());
  long mismatches = 0, checked = 0;
  for (uint32_t f = 1; f <= kProbScale; ++f) {
    const uint32_t base = f <= 1024 ? 0 : 1024;
    if (f == base + 1) {
      for (uint32_t sym = 1; sym <= 1024; ++sym) syms[sym] = make_enc_sym(0, base + sym);
      make_simd_enc_tables(syms.data(), *tables);
    }
    float rcp_value;
    const uint32_t rcp_bits = static_cast<uint32_t>(tables->entry[f - base] >> 32);
    std::memcpy(&rcp_value, &rcp_bits, 4);
    std::vector<uint64_t> ks;
    for (uint64_t k = 0; k < 64; ++k) ks.push_back(k);
    for (int m = 6; m <= 21; ++m)
      for (uint64_t k : {(1ull << m) - 1, 1ull << m, (1ull << m) + 1}) ks.push_back(k);
    for (int r = 0; r < 64; ++r) ks.push_back(rng() % (1ull << 21));
    std::vector<uint32_t> ys;
    if (f <= 4) {  // every dividend: the AVX2 error bound covers freq >= 4 only (divide_by_freq_avx2)
      for (uint32_t y = 0; y < (f << 21); ++y) ys.push_back(y);
    } else {
      for (uint64_t k : ks)
        for (uint64_t d : {uint64_t(0), uint64_t(1), uint64_t(f - 1)})
          if (k * f + d < (uint64_t(f) << 21)) ys.push_back(static_cast<uint32_t>(k * f + d));
      ys.push_back(static_cast<uint32_t>((uint64_t(f) << 21) - 1));
    }
    while (ys.size() % 16 != 0) ys.push_back(ys.back());
    uint32_t q[16], r[16];
    const auto compare = [&](const uint32_t* y, int lanes) {
      for (int l = 0; l < lanes; ++l)
        if (q[l] != y[l] / f || r[l] != y[l] % f) {
          if (++mismatches <= 5) std::printf("division: %u / %u gave %u rem %u\n", y[l], f, q[l], r[l]);
        }
      checked += lanes;
    };
    for (size_t i = 0; i < ys.size(); i += 16) {
      if (avx2)
        for (int half = 0; half < 2; ++half) {
          divide_by_freq_avx2_lanes(&ys[i + 8 * half], f, rcp_value, q, r);
          compare(&ys[i + 8 * half], 8);
        }
      if (avx512) {
        divide_by_freq_avx512_lanes(&ys[i], f, rcp_value, q, r);
        compare(&ys[i], 16);
      }
    }
  }
  std::printf("division: %ld quotients, %ld mismatches\n", checked, mismatches);
  return mismatches;
}

// Mismatches of field_values_avx512 (format version 6's field stream: values, counts, checksum;
// version 7's checksum on even trials)
// against a plain loop, on chunks of up to 80,000 values (so that the pair counts fold once or
// twice and end with a partial step), with random, few or one field value and +0.0 shares, into
// exact-size buffers (n + 32 values, as documented).
long check_field_values(int trials, std::mt19937_64& rng) {
  long mismatches = 0;
  for (int trial = 0; trial < trials; ++trial) {
    const uint32_t n = 1 + static_cast<uint32_t>(rng() % (trial % 4 == 0 ? 80000 : 9000));
    const int pattern = static_cast<int>(rng() % 3);  // fields: random, 4 values, one value
    const uint32_t zero_share = static_cast<uint32_t>(rng() % 4);  // of 8: none to 3/8
    const uint16_t one = static_cast<uint16_t>(rng() & kRawMask);
    std::vector<uint16_t> v(n);
    for (uint16_t& x : v) {
      const uint16_t field = pattern == 0 ? uint16_t(rng() & kRawMask) : pattern == 1 ? uint16_t(rng() & 3) : one;
      x = rng() % 8 < zero_share ? uint16_t(0) : static_cast<uint16_t>(((110 + rng() % 20) << 7 | (rng() & 1) << 6) | field);
    }
    std::vector<uint16_t> ref;
    uint64_t ref_counts[1 << kRawBits] = {};
    for (const uint16_t x : v) {
      if (x == 0) continue;
      ++ref_counts[x & kRawMask];
      ref.push_back(static_cast<uint16_t>((x & kRawMask) << kRawBits));
    }
    const bool pairs = trial % 2 == 0;
    const uint32_t ref_checksum = plain_checksum(ref.data(), static_cast<uint32_t>(ref.size()), pairs);
    std::vector<uint16_t> w(n + 32);
    uint64_t counts[1 << kRawBits] = {};
    uint32_t checksum = 0;
    const uint32_t k = field_values_avx512(v.data(), n, w.data(), counts, checksum, pairs);
    if (k != ref.size() || checksum != ref_checksum || std::memcmp(counts, ref_counts, sizeof(counts)) != 0 ||
        std::memcmp(w.data(), ref.data(), 2ull * k) != 0)
      ++mismatches;
  }
  std::printf("field values: %d trials, %ld mismatches\n", trials, mismatches);
  return mismatches;
}

// Mismatches of choose_prob_bits over the present symbols (a SymbolList, as own_table_saving_q10
// takes it) against the same over every symbol: the frequencies and bits, on random counts (one
// symbol, a few, a window of exponents, every symbol; counts up to 2^30 each; a symbol over half
// the values).
long check_symbol_lists(int trials, std::mt19937_64& rng) {
  long mismatches = 0, wide = 0;
  for (int trial = 0; trial < trials; ++trial) {
    uint64_t counts[kNumSymbols] = {};
    const int kind = static_cast<int>(rng() % 4);
    const int present = kind == 0 ? 1 : kind == 1 ? 1 + static_cast<int>(rng() % 8) : kind == 2 ? 40 + static_cast<int>(rng() % 120) : kNumSymbols;
    const int first = static_cast<int>(rng() % static_cast<uint64_t>(kNumSymbols - (kind == 3 ? kNumSymbols - 1 : present)));
    const uint64_t scale = uint64_t(1) << (rng() % 31);
    for (int k = 0; k < present; ++k) {
      const int s = kind == 1 ? static_cast<int>(rng() % kNumSymbols) : kind == 3 ? k : first + k;
      counts[s] += 1 + rng() % scale;
    }
    if (rng() % 4 == 0) counts[static_cast<int>(rng() % kNumSymbols)] += scale << 10;  // one symbol over half
    uint64_t total = 0;
    for (const uint64_t c : counts) total += c;
    const uint64_t chunks = 1 + rng() % 8;
    uint32_t dense[kNumSymbols], dense12[kNumSymbols], listed[kNumSymbols], listed12[kNumSymbols];
    uint16_t sym[kNumSymbols];
    const SymbolList list{sym, present_symbols(counts, sym)};
    std::fill(listed, listed + kNumSymbols, 0u);
    const int bits = choose_prob_bits(counts, total, chunks, dense, dense12);
    const int listed_bits = choose_prob_bits_over(list, counts, total, chunks, listed, listed12);
    wide += bits == kMaxProbBits;
    if (bits != listed_bits || std::memcmp(dense, listed, sizeof(dense)) != 0) ++mismatches;
  }
  std::printf("symbol lists: %d trials (%ld with 12-bit frequencies), %ld mismatches\n", trials, wide, mismatches);
  return mismatches;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::printf("usage: lossless_fuzz <dir> <num_blobs> <mutations> <encoder_trials> <seed>\n");
    return 2;
  }
  std::mt19937_64 rng(std::strtoull(argv[5], nullptr, 10));
  std::vector<Path> paths = {kPortable, kScalar};
  if (have_avx2()) paths.push_back(kAvx2);
  if (have_avx512()) paths.push_back(kAvx512);
  std::printf("paths:%s%s%s\n", " portable scalar", have_avx2() ? " avx2" : "", have_avx512() ? " avx512" : "");
  long bad = check_decoders(argv[1], std::atoi(argv[2]), std::atoi(argv[3]), paths, rng);
  bad += check_encoders(std::atoi(argv[4]), have_avx2(), have_avx512(), rng);
  bad += check_division(have_avx2(), have_avx512(), rng);
  bad += check_symbol_lists(std::atoi(argv[4]), rng);
  if (have_avx512()) bad += check_field_values(std::atoi(argv[4]) / 10, rng);
  return bad == 0 ? 0 : 1;
}
