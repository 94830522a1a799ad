// Launch API of the codec kernels (csrc/cuda/lossless_kernels.cu, fp8_kernels.cu) for the
// pybind11 binding (g++, no CUDA headers): codec_launch.h's functions with the stream as void*,
// forwarded by csrc/cuda/codec_launchers.cu. Pointers are device pointers unless named host_*;
// every launch is asynchronous on `stream`; the int results are cudaError_t values.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ep_comm::cuda {

// Bytes of device workspace the lossless encoder (in format `version`, 4 or 5) / decoder needs for
// num_values values coded in chunks of chunk_values (for the decoder: the smallest chunk size a
// blob may declare).
size_t lossless_encode_workspace_bytes(uint64_t num_values, uint32_t chunk_values, uint32_t version);
size_t lossless_decode_workspace_bytes(uint64_t num_values, uint32_t chunk_values, uint64_t field_chunks);
// The largest blob num_values values of an ndim-dimensional tensor can code to in format `version`.
size_t lossless_max_blob_bytes(uint64_t num_values, uint32_t ndim, uint32_t chunk_values, uint32_t version);

// values [num_values] bf16 bits -> blob in format `version` (4 or 5) in out
// (lossless_max_blob_bytes capacity), its byte count in *out_size (device u64); byte-identical to
// the host encoder's blob of that version.
int launch_lossless_encode(const uint16_t* values, uint64_t num_values, const int64_t* host_shape, uint32_t ndim,
                           uint32_t chunk_values, uint32_t version, uint8_t* out, uint64_t* out_size, void* workspace,
                           size_t workspace_bytes, void* stream);

// blob [blob_bytes] (format `version`) -> out [num_values] bf16 bits; *status (device int32) = 0
// or the lossless::Status the host decoder reports for the same blob.
int launch_lossless_decode(const uint8_t* blob, uint64_t blob_bytes, uint16_t* out, uint64_t num_values,
                           uint32_t min_chunk_values, uint64_t field_chunks, uint32_t version, int32_t* status,
                           void* workspace, size_t workspace_bytes, void* stream);

// x [rows, hidden] bf16 bits -> q [rows, hidden] e4m3 bytes and scales ([rows, hidden / 128]
// float32, or with use_ue8m0 [rows, hidden / 512] int32); bit-identical to the host build.
int launch_fp8_quantize(const uint16_t* x, int64_t rows, int64_t hidden, bool round_scale, bool use_ue8m0,
                        uint8_t* q, void* scales, void* stream);

}  // namespace ep_comm::cuda
