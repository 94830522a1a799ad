// The nvshmemx_* (NVIDIA extension) part of the emulated NVSHMEM (csrc/emulation/nvshmem.h): the
// warp- and block-collective puts, the on-stream barrier and the unique-id bootstrap, for the one-PE
// job that header describes. A collective put is made by the whole warp or block, as on the GPU:
// every thread calls it, the first thread copies and signals after all have arrived, and none
// returns before the copy is done.
#pragma once
#include <cstring>

#include "nvshmem.h"

// ---- host: bootstrap of the one-PE job ----
struct nvshmemx_uniqueid_t {
  char bytes[128];
};
struct nvshmemx_init_attr_t {
  int rank, nranks;
};
#define NVSHMEMX_INIT_ATTR_INITIALIZER nvshmemx_init_attr_t{0, 1}
enum { NVSHMEMX_INIT_WITH_UNIQUEID = 1 << 4 };
inline int nvshmemx_get_uniqueid(nvshmemx_uniqueid_t* id) {
  std::memset(id, 0, sizeof(*id));
  return 0;
}
inline int nvshmemx_set_attr_uniqueid_args(int rank, int nranks, const nvshmemx_uniqueid_t*, nvshmemx_init_attr_t* attr) {
  attr->rank = rank;
  attr->nranks = nranks;
  return 0;
}
// A job of more than the emulated PEs cannot start: -1, as NVSHMEM's failed initialisation.
inline int nvshmemx_init_attr(unsigned, nvshmemx_init_attr_t* attr) {
  return attr->rank == 0 && attr->nranks == ep_emu::kNvshmemPes ? 0 : -1;
}
inline void nvshmemx_barrier_all_on_stream(cudaStream_t) {}  // one PE: every PE has arrived

// ---- device: collective puts ----
inline void nvshmemx_putmem_warp(void* dst, const void* src, size_t bytes, int pe) {
  __syncwarp();
  if (ep_emu::block().lane() == 0) nvshmem_putmem(dst, src, bytes, pe);
  __syncwarp();
}
inline void nvshmemx_putmem_block(void* dst, const void* src, size_t bytes, int pe) {
  __syncthreads();
  if (threadIdx.x == 0) nvshmem_putmem(dst, src, bytes, pe);
  __syncthreads();
}
inline void nvshmemx_putmem_signal_nbi_block(void* dst, const void* src, size_t bytes, uint64_t* sig,
                                             uint64_t value, int op, int pe) {
  __syncthreads();
  if (threadIdx.x == 0) nvshmem_putmem_signal_nbi(dst, src, bytes, sig, value, op, pe);
  __syncthreads();
}
