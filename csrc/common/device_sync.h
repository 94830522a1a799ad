// Device-only memory-ordering and bounded-wait primitives for peer-to-peer signalling
// (NVLink peers, virtual ranks on one GPU, and host-mapped timeout records).
#pragma once
#if defined(__CUDACC__)
#include "timeout.h"

namespace ep_comm {

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long ld_acquire_sys_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Bounded wait state: the deadline and where to report. Copyable into kernel parameters.
struct WaitCtx {
  int32_t* record;          // timeout record (host-mapped), kRecordWords int32
  unsigned long long timeout_ns;
  int rank;
};

// Records a failure once (first writer wins) and makes every other waiter give up.
__device__ __forceinline__ void record_failure(const WaitCtx& w, int status, int peer, int phase,
                                               unsigned long long waited_ns, int detail) {
  if (atomicCAS_system(reinterpret_cast<int*>(w.record) + kStatus, kOk, -1) == kOk) {
    w.record[kRank] = w.rank;
    w.record[kPeer] = peer;
    w.record[kPhase] = phase;
    w.record[kWaitedMs] = static_cast<int>(waited_ns / 1000000ULL);
    w.record[kDetail] = detail;
    __threadfence_system();
    atomicExch_system(reinterpret_cast<int*>(w.record) + kStatus, status);
  }
}

__device__ __forceinline__ bool failed(const WaitCtx& w) {
  return *reinterpret_cast<volatile int*>(w.record + kStatus) != kOk;
}

// Spins until *flag >= target, compared modulo 2^32 (flag - target as a signed difference), so
// monotonic round counters keep working after they wrap past INT_MAX; valid while the two are
// within 2^31 of each other. Returns false (after recording who and what it waited for) when
// timeout_ns passes or another waiter already failed.
__device__ __forceinline__ bool wait_geq(const WaitCtx& w, const int* flag, int target, int peer,
                                         int phase, int detail) {
  unsigned long long start = 0;
  for (unsigned iter = 0;; ++iter) {
    if (static_cast<int>(static_cast<unsigned>(ld_acquire_sys(flag)) - static_cast<unsigned>(target)) >= 0) return true;
    if ((iter & 255u) == 0) {
      unsigned long long now = global_timer_ns();
      if (start == 0) start = now;
      if (failed(w)) return false;
      if (now - start > w.timeout_ns) {
        record_failure(w, kTimedOut, peer, phase, now - start, detail);
        return false;
      }
    }
  }
}

// Spins until the 64-bit signal reaches `value`; false (recorded) on timeout or failure elsewhere.
__device__ __forceinline__ bool wait_signal(const WaitCtx& w, const unsigned long long* signal,
                                            unsigned long long value, int peer, int phase,
                                            int detail) {
  unsigned long long start = 0;
  for (unsigned iter = 0;; ++iter) {
    if (ld_acquire_sys_u64(signal) >= value) return true;
    if ((iter & 255u) == 0) {
      const unsigned long long now = global_timer_ns();
      if (start == 0) start = now;
      if (failed(w)) return false;
      if (now - start > w.timeout_ns) {
        record_failure(w, kTimedOut, peer, phase, now - start, detail);
        return false;
      }
    }
  }
}

// Spins until *flag != 0 and returns it, or 0 on timeout / failure elsewhere.
__device__ __forceinline__ int wait_nonzero(const WaitCtx& w, const int* flag, int peer, int phase,
                                            int detail) {
  unsigned long long start = 0;
  for (unsigned iter = 0;; ++iter) {
    int v = ld_acquire_sys(flag);
    if (v != 0) return v;
    if ((iter & 255u) == 0) {
      unsigned long long now = global_timer_ns();
      if (start == 0) start = now;
      if (failed(w)) return 0;
      if (now - start > w.timeout_ns) {
        record_failure(w, kTimedOut, peer, phase, now - start, detail);
        return 0;
      }
    }
  }
}

// Warp-cooperative copy of `bytes` (a multiple of 16; both ends 16-byte aligned) from a read-only
// input tensor (non-coherent cached loads are safe there).
__device__ __forceinline__ void warp_copy16_ro(void* dst, const void* src, int64_t bytes, int lane) {
  auto* d = reinterpret_cast<int4*>(dst);
  const auto* s = reinterpret_cast<const int4*>(src);
  for (int64_t i = lane; i < bytes / 16; i += 32) d[i] = __ldg(s + i);
}

__device__ __forceinline__ int4 ld_volatile_int4(const int4* p) {
  int4 v;
  asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// The same copy from a communication buffer that peers rewrite during the kernel (ring slots are
// reused): volatile loads, never a stale cached line.
__device__ __forceinline__ void warp_copy16_comm(void* dst, const void* src, int64_t bytes, int lane) {
  auto* d = reinterpret_cast<int4*>(dst);
  const auto* s = reinterpret_cast<const int4*>(src);
  for (int64_t i = lane; i < bytes / 16; i += 32) d[i] = ld_volatile_int4(s + i);
}

}  // namespace ep_comm
#endif  // __CUDACC__
