// Device-only memory-ordering and bounded-wait primitives for peer-to-peer signalling
// (NVLink peers, virtual ranks on one GPU, and host-mapped timeout records).
#pragma once
#if defined(__CUDACC__) || defined(EP_CUDA_EMULATION)
#include "timeout.h"

namespace ep_comm {

#if defined(EP_CUDA_EMULATION)
// The CUDA emulation (csrc/emulation/cuda_runtime.h) runs the resident blocks of a launch as fibers
// of one OS thread: these are the same operations on host memory; every spin iteration yields so
// the block (or virtual rank) that sets the flag gets to run, a release store lets the other blocks
// run before the publishing warp's other threads, and an acquire tells the scheduler that a wait
// succeeded (a grid whose threads only spin has stalled).
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  ::ep_emu::note_acquire();
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
__device__ __forceinline__ int ld_relaxed_sys(const int* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
__device__ __forceinline__ void st_release_sys(int* p, int v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
  ::ep_emu::release_yield();
}
__device__ __forceinline__ unsigned long long ld_acquire_sys_u64(const unsigned long long* p) {
  ::ep_emu::note_acquire();
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
__device__ __forceinline__ unsigned long long ld_relaxed_sys_u64(const unsigned long long* p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
__device__ __forceinline__ unsigned long long global_timer_ns() { return ::ep_emu::global_timer_ns(); }
__device__ __forceinline__ void spin_pause() { ::ep_emu::spin_yield(); }
__device__ __forceinline__ int4 ld_volatile_int4(const int4* p) {
  const volatile int* q = reinterpret_cast<const volatile int*>(p);
  return int4{q[0], q[1], q[2], q[3]};
}
__device__ __forceinline__ int4 ld_nc_na_int4(const int4* p) { return *p; }
__device__ __forceinline__ void st_int4(int4* p, int4 v) { *p = v; }
#else
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Relaxed system-scope load: no L1 invalidation (ld.acquire.sys emits CCTL.IVALL), so spins use
// it and acquire once after success.
__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
  int v;
  asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
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
__device__ __forceinline__ unsigned long long ld_relaxed_sys_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void spin_pause() {}
__device__ __forceinline__ int4 ld_volatile_int4(const int4* p) {
  int4 v;
  asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// Non-coherent load that does not allocate in L1, for inputs no one writes during the kernel.
__device__ __forceinline__ int4 ld_nc_na_int4(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
// A plain 16-byte store, kept after the loads before it (the compiler does not move volatile asm).
__device__ __forceinline__ void st_int4(int4* p, int4 v) {
  asm volatile("st.global.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
#endif

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

// Every wait spins on relaxed loads (no L1 invalidation per iteration) and acquires once after
// success, so what the waiter reads next is ordered after what the peer wrote before its release.
// Spins until *flag >= target, compared modulo 2^32 (flag - target as a signed difference), so
// monotonic round counters keep working after they wrap past INT_MAX; valid while the two are
// within 2^31 of each other. Returns false (after recording who and what it waited for) when
// timeout_ns passes or another waiter already failed.
__device__ __forceinline__ bool wait_geq(const WaitCtx& w, const int* flag, int target, int peer,
                                         int phase, int detail) {
  unsigned long long start = 0;
  for (unsigned iter = 0;; ++iter) {
    if (static_cast<int>(static_cast<unsigned>(ld_relaxed_sys(flag)) - static_cast<unsigned>(target)) >= 0) {
      ld_acquire_sys(flag);  // orders what follows after the release that stored the value seen
      return true;
    }
    spin_pause();
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
    if (ld_relaxed_sys_u64(signal) >= value) {
      ld_acquire_sys_u64(signal);
      return true;
    }
    spin_pause();
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
    if (ld_relaxed_sys(flag) != 0) return ld_acquire_sys(flag);
    spin_pause();
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

// Warp-cooperative row copies of `bytes` (a multiple of 16; both ends 16-byte aligned): each lane
// issues kCopyUnroll independent 16-byte loads before the first of their stores, so a warp keeps
// 32 * kCopyUnroll * 16 bytes (4 KiB) in flight.
constexpr int kCopyUnroll = 8;

// A warp's copy of `bytes` (a multiple of 16) with `load` reading each 16-byte vector: whole
// batches of kCopyUnroll vectors per lane, every load issued before the first store, then one
// predicated partial batch.
template <typename Load>
__device__ __forceinline__ void warp_copy16(void* dst, const void* src, int64_t bytes, int lane, Load load) {
  auto* d = reinterpret_cast<int4*>(dst);
  const auto* s = reinterpret_cast<const int4*>(src);
  s += lane;
  d += lane;
  int left = static_cast<int>(bytes / 16) - lane;
#pragma unroll 1
  for (; left >= 32 * kCopyUnroll; left -= 32 * kCopyUnroll, s += 32 * kCopyUnroll, d += 32 * kCopyUnroll) {
    int4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) v[u] = load(s + 32 * u);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) st_int4(d + 32 * u, v[u]);
  }
  if (left > 0) {
    int4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (32 * u < left) v[u] = load(s + 32 * u);
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
      if (32 * u < left) st_int4(d + 32 * u, v[u]);
  }
}

struct NonCoherentLoad {  // a read-only input tensor: no L1 allocation
  __device__ __forceinline__ int4 operator()(const int4* p) const { return ld_nc_na_int4(p); }
};
struct VolatileLoad {  // a communication buffer peers rewrite during the kernel: never a stale line
  __device__ __forceinline__ int4 operator()(const int4* p) const { return ld_volatile_int4(p); }
};

__device__ __forceinline__ void warp_copy16_ro(void* dst, const void* src, int64_t bytes, int lane) {
  warp_copy16(dst, src, bytes, lane, NonCoherentLoad{});
}

__device__ __forceinline__ void warp_copy16_comm(void* dst, const void* src, int64_t bytes, int lane) {
  warp_copy16(dst, src, bytes, lane, VolatileLoad{});
}

}  // namespace ep_comm
#endif  // __CUDACC__ || EP_CUDA_EMULATION
