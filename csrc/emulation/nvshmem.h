// NVSHMEM for the CUDA emulation (csrc/emulation/cuda_runtime.h): the subset the kernels of
// csrc/cuda/ use (internode.cu, internode_two_hop*.cu), found first on the include path by
// `#include <nvshmem.h>` when built with -DEP_CUDA_EMULATION -DEP_COMM_WITH_NVSHMEM.
// The emulated job is one PE (my_pe 0 of 1) in the calling process, as the virtual-rank mode of
// the two-hop path runs on one GPU: the symmetric heap is host memory (each nvshmem_malloc a
// zeroed host allocation), nvshmem_ptr(p, 0) is p itself, and a put or signal to PE 0 stores into
// that memory at once. A put or signal addressed to a PE outside the job is not delivered: whoever
// waits for it stalls, and the emulation reports the stall. Signals are release stores that let
// the other blocks (and virtual ranks) run before the signalling thread goes on, as device_sync.h's
// st_release_sys does; waits yield in every spin iteration.
#pragma once
#ifndef EP_CUDA_EMULATION
#error "csrc/emulation/nvshmem.h is the CUDA emulation: build with -DEP_CUDA_EMULATION"
#endif

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda_runtime.h"

enum { NVSHMEM_SIGNAL_SET = 0, NVSHMEM_SIGNAL_ADD = 5 };
enum { NVSHMEM_CMP_EQ = 0, NVSHMEM_CMP_NE = 1, NVSHMEM_CMP_GT = 2, NVSHMEM_CMP_LE = 3, NVSHMEM_CMP_LT = 4,
       NVSHMEM_CMP_GE = 5 };

namespace ep_emu {
constexpr int kNvshmemPes = 1;  // the emulated job: this process, PE 0
inline bool nvshmem_delivers(int pe) { return pe >= 0 && pe < kNvshmemPes; }
// The symmetric address of `p` on `pe` (one PE: p itself), or nullptr outside the job.
template <typename T>
T* nvshmem_address(T* p, int pe) {
  return nvshmem_delivers(pe) ? p : nullptr;
}
inline void nvshmem_signal_store(uint64_t* sig, uint64_t value, int op) {
  if (op == NVSHMEM_SIGNAL_ADD) __atomic_fetch_add(sig, value, __ATOMIC_RELEASE);
  else __atomic_store_n(sig, value, __ATOMIC_RELEASE);
  release_yield();
}
}  // namespace ep_emu

// ---- host: the job and the symmetric heap ----
inline int nvshmem_my_pe() { return 0; }
inline int nvshmem_n_pes() { return ep_emu::kNvshmemPes; }
inline void* nvshmem_malloc(size_t bytes) {
  const size_t rounded = (bytes + 127) / 128 * 128;
  void* p = std::aligned_alloc(128, rounded ? rounded : 128);
  if (p) std::memset(p, 0, rounded ? rounded : 128);
  return p;
}
inline void nvshmem_free(void* p) { std::free(p); }
inline void* nvshmem_ptr(const void* p, int pe) { return ep_emu::nvshmem_address(const_cast<void*>(p), pe); }
inline void nvshmem_barrier_all() {}  // one PE: every PE has arrived
inline void nvshmem_finalize() {}

// ---- device: puts, signals, ordering ----
// Every store is visible at once in the emulation, so quiet and fence only order the compiler.
inline void nvshmem_quiet() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void nvshmem_fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline void nvshmem_putmem(void* dst, const void* src, size_t bytes, int pe) {
  if (void* d = ep_emu::nvshmem_address(dst, pe)) std::memcpy(d, src, bytes);
}
inline void nvshmem_int_p(int* dst, int value, int pe) {
  if (int* d = ep_emu::nvshmem_address(dst, pe)) {
    __atomic_store_n(d, value, __ATOMIC_RELEASE);
    ep_emu::release_yield();
  }
}
inline void nvshmemx_signal_op(uint64_t* sig, uint64_t value, int op, int pe) {
  if (uint64_t* s = ep_emu::nvshmem_address(sig, pe)) ep_emu::nvshmem_signal_store(s, value, op);
}
inline void nvshmem_putmem_signal_nbi(void* dst, const void* src, size_t bytes, uint64_t* sig, uint64_t value,
                                      int op, int pe) {
  nvshmem_putmem(dst, src, bytes, pe);
  nvshmemx_signal_op(sig, value, op, pe);
}
// Spins (yielding) until *sig compares true with `value`; returns the value seen.
inline uint64_t nvshmem_signal_wait_until(uint64_t* sig, int cmp, uint64_t value) {
  for (;;) {
    const uint64_t v = __atomic_load_n(sig, __ATOMIC_RELAXED);
    const bool done = cmp == NVSHMEM_CMP_EQ ? v == value : cmp == NVSHMEM_CMP_NE ? v != value
                      : cmp == NVSHMEM_CMP_GT ? v > value : cmp == NVSHMEM_CMP_LE ? v <= value
                      : cmp == NVSHMEM_CMP_LT ? v < value : v >= value;
    if (done) {
      ep_emu::note_acquire();
      return __atomic_load_n(sig, __ATOMIC_ACQUIRE);
    }
    ep_emu::spin_yield();
  }
}
