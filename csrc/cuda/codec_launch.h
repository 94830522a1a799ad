// C-callable launchers of the codec kernels (csrc/cuda/lossless_kernels.cu, fp8_kernels.cu).
// Pointers are device pointers unless named host_*; every launch is asynchronous on `stream`.
// No torch headers: the Python layer owns the tensors and binds these.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

extern "C" {

// Bytes of device workspace ep_lossless_encode_cuda needs for num_values values in format
// `version` (version 5 keeps each chunk's symbol counts, about 4 KiB a chunk, when its chunks may
// take tables of their own; version 6's coding slots take a field area each, 2 bytes a value of a
// chunk and 28 KiB).
size_t ep_lossless_encode_workspace_bytes(uint64_t num_values, uint32_t chunk_values, uint32_t version);
// Largest blob the encoder can produce in format `version` (size `out` for this; version 5 adds
// room for the extra tables).
size_t ep_lossless_max_blob_bytes(uint64_t num_values, uint32_t ndim, uint32_t chunk_values, uint32_t version);

// values [num_values] bf16 bits -> blob in format `version` (4 to 7) in out (capacity
// ep_lossless_max_blob_bytes); the blob's size is written to *out_size (device). The blob is
// byte-identical to the host encoder's of the same version. Returns a cudaError_t of the launches
// (cudaErrorInvalidValue for bad arguments, another version among them).
int ep_lossless_encode_cuda(const uint16_t* values, uint64_t num_values, const int64_t* host_shape,
                            uint32_t ndim, uint32_t chunk_values, uint32_t version, uint8_t* out, uint64_t* out_size,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Version 6: the byte offset in the encoder's workspace of a u64 that is non-zero after a call when
// some chunk's fields may code smaller (the encoder then ran its field-coding pass,
// rans_fields_kernel; else rans_kernel). For tests.
size_t ep_lossless_encode_fields_wanted_offset();

// Bytes of device workspace ep_lossless_decode_cuda needs for a blob of num_values values in chunks
// of at least chunk_values. Sized for format 5's worst case whatever the blob: room for
// min(255, chunks) extra decoder tables of about 16 KiB each and 8 KiB of scratch for each of the
// first 32 (validate_kernel reads 32 tables at a time), beside the shared table and the chunk
// offsets.
// With field_chunks > 0, room for that many format 6 chunks with coded fields (modes 4 and 5): a
// decoder table, two symbol arrays and the packed fields each (about 25 KiB and 0.75 bytes a value).
size_t ep_lossless_decode_workspace_bytes(uint64_t num_values, uint32_t chunk_values, uint64_t field_chunks);

// blob [blob_bytes] (format `version`, 2 to 7: its header's byte 4 as the caller read it, which
// picks the decode kernels built for its checksum; field_chunks: its chunks of modes 4 and 5, as
// the workspace was sized for) -> out [num_values] bf16 bits. *status (device int) is set to 0 on
// success or a lossless::Status code (the blob is corrupted, does not hold num_values values, or
// its header's version is not `version`: kErrHeader): for a blob whose version is `version`, the
// one the host decoder reports for the same blob (that of the first failing chunk); out is
// undefined then. Reads stay inside the blob. min_chunk_values bounds the
// blob's chunk size from below, which sizes the workspace (use the encoder's chunk_values).
int ep_lossless_decode_cuda(const uint8_t* blob, uint64_t blob_bytes, uint16_t* out, uint64_t num_values,
                            uint32_t min_chunk_values, uint64_t field_chunks, uint32_t version, int* status,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream);

// x [rows, hidden] bf16 bits -> q [rows, hidden] e4m3 bytes and scales: [rows, hidden/128] float32,
// or with use_ue8m0 [rows, hidden/512] int32 (viewed here as bytes). hidden % 128 == 0
// (% 512 with use_ue8m0). Bit-identical to the host build and to ep_comm/codecs/fp8.py.
int ep_fp8_quantize_cuda(const uint16_t* x, int64_t rows, int64_t hidden, int round_scale, int use_ue8m0,
                         uint8_t* q, void* scales, cudaStream_t stream);

}  // extern "C"
