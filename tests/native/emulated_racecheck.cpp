// Race check of the codec kernels: csrc/cuda/lossless_kernels.cu and fp8_kernels.cu built for the
// CPU through the CUDA emulation with ThreadSanitizer (tests/test_codec_kernels_emulated.py builds
// and runs this), so that TSan reports any two CUDA threads of a block touching the same memory
// without a barrier between them (csrc/emulation/fibers.h). Each case is encoded, decoded and
// compared with its input, in both schedule orders; so is each blob given on the command line (a
// blob file, its values' file and its chunk size: blobs the kernels do not write, such as format
// 5's; a format 6 blob, of a 1-D tensor, is also encoded again from its values and compared);
// exit status 1 on a wrong result (TSan exits with its own status on a report).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "codec_launch.h"

extern "C" void ep_emu_set_schedule(int reverse);

namespace {

// n bf16 bit patterns: exponents centre +- spread, a share `zeros` of +0.0.
std::vector<uint16_t> make_values(size_t n, int centre, int spread, double zeros, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint16_t> v(n);
  for (auto& x : v) {
    const int e = std::min(255, std::max(0, centre + int(gen() % uint32_t(2 * spread + 1)) - spread));
    x = static_cast<uint16_t>(((gen() & 1) << 15) | (uint32_t(e) << 7) | (gen() & 127));
    if (double(gen() % 1000) < zeros * 1000) x = 0;
  }
  return v;
}

bool round_trip(const std::vector<uint16_t>& v, uint32_t cv, uint32_t version) {
  const uint64_t n = v.size();
  const int64_t shape[1] = {int64_t(n)};
  std::vector<uint8_t> ws(ep_lossless_encode_workspace_bytes(n, cv, version), 0xA5);
  std::vector<uint8_t> blob(ep_lossless_max_blob_bytes(n, 1, cv, version), 0x5A);
  uint64_t size = 0;
  if (ep_lossless_encode_cuda(v.data(), n, shape, 1, cv, version, blob.data(), &size, ws.data(), ws.size(),
                              nullptr) != 0)
    return false;
  std::vector<uint8_t> dws(ep_lossless_decode_workspace_bytes(n, cv, 0), 0xA5);
  std::vector<uint16_t> out(n + 1, 0x5A5A);
  int status = -1;
  if (ep_lossless_decode_cuda(blob.data(), size, out.data(), n, cv, 0, version, &status, dws.data(), dws.size(),
                              nullptr) != 0)
    return false;
  return status == 0 && std::memcmp(out.data(), v.data(), 2 * n) == 0;
}

// The bytes of file `path` (empty when it cannot be read).
std::vector<uint8_t> read_file(const char* path) {
  std::vector<uint8_t> bytes;
  if (FILE* f = std::fopen(path, "rb")) {
    uint8_t buffer[4096];
    for (size_t got; (got = std::fread(buffer, 1, sizeof buffer, f)) > 0;) bytes.insert(bytes.end(), buffer, buffer + got);
    std::fclose(f);
  }
  return bytes;
}

// A blob decoded at chunk size cv (with `field_chunks` chunks of coded fields, format 6) gives
// `values` (bf16 bits).
bool decodes(const std::vector<uint8_t>& blob, const std::vector<uint8_t>& values, uint32_t cv, uint64_t field_chunks) {
  const uint64_t n = values.size() / 2;
  std::vector<uint8_t> dws(ep_lossless_decode_workspace_bytes(n, cv, field_chunks), 0xA5);
  std::vector<uint16_t> out(n + 1, 0x5A5A);
  int status = -1;
  if (blob.empty() ||
      ep_lossless_decode_cuda(blob.data(), blob.size(), out.data(), n, cv, field_chunks, blob[4], &status, dws.data(),
                              dws.size(), nullptr) != 0)
    return false;
  return status == 0 && std::memcmp(out.data(), values.data(), 2 * n) == 0;
}

// The kernels' blob of `values` (bf16 bits) at chunk size cv, in blob's format version, is `blob`
// (format 6's from the host encoder: the field streams coded by rans_fields_kernel).
bool encodes_to(const std::vector<uint8_t>& blob, const std::vector<uint8_t>& values, uint32_t cv) {
  if (blob.size() < 5) return false;
  const uint32_t version = blob[4];
  const uint64_t n = values.size() / 2;
  std::vector<uint16_t> v(n);
  std::memcpy(v.data(), values.data(), 2 * n);
  const int64_t shape[1] = {int64_t(n)};
  std::vector<uint8_t> ws(ep_lossless_encode_workspace_bytes(n, cv, version), 0xA5);
  std::vector<uint8_t> out(ep_lossless_max_blob_bytes(n, 1, cv, version), 0x5A);
  uint64_t size = 0;
  if (ep_lossless_encode_cuda(v.data(), n, shape, 1, cv, version, out.data(), &size, ws.data(), ws.size(), nullptr) !=
      0)
    return false;
  return size == blob.size() && std::memcmp(out.data(), blob.data(), size) == 0;
}

bool fp8_runs(const std::vector<uint16_t>& v, int64_t hidden) {
  const int64_t rows = int64_t(v.size()) / hidden;
  std::vector<uint8_t> q(size_t(rows * hidden));
  std::vector<float> scales(size_t(rows * hidden / 128));
  return ep_fp8_quantize_cuda(v.data(), rows, hidden, 0, 0, q.data(), scales.data(), nullptr) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  struct Case {
    size_t n;
    int centre, spread;
    double zeros;
    uint32_t cv;
  };
  const Case cases[] = {{12000, 120, 3, 0.0, 4096}, {12000, 120, 3, 0.3, 1024}, {9000, 127, 60, 0.0, 4096},
                        {5000, 0, 0, 1.0, 64},     {777, 120, 8, 0.05, 32},     {0, 0, 0, 0.0, 32}};
  int failures = 0;
  for (int reverse = 0; reverse < 2; ++reverse) {
    ep_emu_set_schedule(reverse);
    for (const Case& c : cases) {
      const auto v = make_values(c.n, c.centre, c.spread, c.zeros, uint32_t(c.n + c.cv));
      for (uint32_t version = 4; version <= 5; ++version) {
        if (!round_trip(v, c.cv, version)) {
          std::printf("round trip failed: n=%zu cv=%u version=%u reverse=%d\n", c.n, c.cv, version, reverse);
          ++failures;
        }
      }
    }
    if (!fp8_runs(make_values(64 * 512, 120, 6, 0.0, 7), 512)) ++failures;
    for (int a = 1; a + 3 < argc; a += 4) {  // blob file, values file, chunk size, chunks with coded fields
      if (!decodes(read_file(argv[a]), read_file(argv[a + 1]), uint32_t(std::strtoul(argv[a + 2], nullptr, 10)),
                   std::strtoull(argv[a + 3], nullptr, 10))) {
        std::printf("decode failed: %s reverse=%d\n", argv[a], reverse);
        ++failures;
      }
      const std::vector<uint8_t> blob = read_file(argv[a]);
      if (blob.size() > 4 && blob[4] == 6 &&
          !encodes_to(blob, read_file(argv[a + 1]), uint32_t(std::strtoul(argv[a + 2], nullptr, 10)))) {
        std::printf("encode differs: %s reverse=%d\n", argv[a], reverse);
        ++failures;
      }
    }
  }
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
