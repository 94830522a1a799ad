// csrc/cuda_bindings/codec_launchers.h: the codec launchers of codec_launch.h, with the stream
// passed as void* for the g++-compiled binding.
#include "cuda/codec_launch.h"
#include "cuda_bindings/codec_launchers.h"

namespace ep_comm::cuda {

size_t lossless_encode_workspace_bytes(uint64_t num_values, uint32_t chunk_values, uint32_t version) {
  return ep_lossless_encode_workspace_bytes(num_values, chunk_values, version);
}

size_t lossless_decode_workspace_bytes(uint64_t num_values, uint32_t chunk_values, uint64_t field_chunks) {
  return ep_lossless_decode_workspace_bytes(num_values, chunk_values, field_chunks);
}

size_t lossless_max_blob_bytes(uint64_t num_values, uint32_t ndim, uint32_t chunk_values, uint32_t version) {
  return ep_lossless_max_blob_bytes(num_values, ndim, chunk_values, version);
}

int launch_lossless_encode(const uint16_t* values, uint64_t num_values, const int64_t* host_shape, uint32_t ndim,
                           uint32_t chunk_values, uint32_t version, uint8_t* out, uint64_t* out_size, void* workspace,
                           size_t workspace_bytes, void* stream) {
  return ep_lossless_encode_cuda(values, num_values, host_shape, ndim, chunk_values, version, out, out_size, workspace,
                                 workspace_bytes, static_cast<cudaStream_t>(stream));
}

int launch_lossless_decode(const uint8_t* blob, uint64_t blob_bytes, uint16_t* out, uint64_t num_values,
                           uint32_t min_chunk_values, uint64_t field_chunks, uint32_t version, int32_t* status,
                           void* workspace, size_t workspace_bytes, void* stream) {
  return ep_lossless_decode_cuda(blob, blob_bytes, out, num_values, min_chunk_values, field_chunks, version, status,
                                 workspace, workspace_bytes, static_cast<cudaStream_t>(stream));
}

int launch_fp8_quantize(const uint16_t* x, int64_t rows, int64_t hidden, bool round_scale, bool use_ue8m0,
                        uint8_t* q, void* scales, void* stream) {
  return ep_fp8_quantize_cuda(x, rows, hidden, round_scale ? 1 : 0, use_ue8m0 ? 1 : 0, q, scales,
                              static_cast<cudaStream_t>(stream));
}

}  // namespace ep_comm::cuda
