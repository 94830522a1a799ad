// CUDA emulation on the CPU: the parts of the CUDA runtime and device language that the codec
// kernels (csrc/cuda/lossless_kernels.cu, fp8_kernels.cu) use, so that the same source compiles as
// C++ and runs without a GPU. Found first on the include path (-I csrc/emulation) by
// `#include <cuda_runtime.h>`; built with -DEP_CUDA_EMULATION (tests/support/emulated_cuda.py builds the
// libraries). "Device" memory is host memory, launches run to completion before they return
// (grid blocks one after another, each block's threads as fibers: csrc/emulation/fibers.h),
// streams are ignored.
// What the emulation checks that the hardware would not: warp collectives with a full mask reached
// by every live lane (a divergent barrier is a launch failure, reported by cudaGetLastError), and
// shared memory read before another thread's write without a barrier gives the old value.
// What it does not model: memory ordering between concurrently running blocks (blocks run one at a
// time), partial warp masks (every collective here is over the warp's live lanes), timing.
// __shared__ variables are function-local statics: one copy per kernel, reused by each block and
// poisoned before it starts; so a process runs one emulated launch at a time (two OS threads
// launching at once would share those copies). A template kernel's statics escape the poisoning
// (GCC places them outside the section): keep kernels plain functions (a test checks it).
#pragma once
#ifndef EP_CUDA_EMULATION
#error "csrc/emulation/cuda_runtime.h is the CUDA emulation: build with -DEP_CUDA_EMULATION"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fibers.h"

// ---- language: qualifiers ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Every __shared__ variable lives in one section, which each block starts with poisoned (shared
// memory is undefined when a block starts on a GPU; here it would otherwise keep the previous
// block's values, hiding reads of unwritten shared memory).
#define __shared__ static __attribute__((section("ep_emu_shared")))
extern "C" char __start_ep_emu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_ep_emu_shared[] __attribute__((weak, visibility("hidden")));

// ---- runtime types and calls ----
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
using cudaStream_t = struct CUstream_emulated*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorLaunchFailure = 719 };
enum cudaFuncAttribute { cudaFuncAttributePreferredSharedMemoryCarveout = 9 };

namespace ep_emu {

// What the current launch's threads see as blockIdx / blockDim / gridDim; the last error.
struct LaunchState {
  dim3 block_idx, block_dim, grid_dim;
  cudaError_t last_error = cudaSuccess;
  bool reverse_schedule = false;  // FiberBlock::run's order (ep_emu_set_schedule)
  uint64_t blocks_run = 0;        // picks the poison of the next block's shared memory
  std::vector<uint64_t> dynamic_shared;  // the launch's dynamic shared memory (8-byte aligned)
};
inline thread_local LaunchState tls_launch;
// The block runner of this OS thread's launches (one at a time: kernels launch no kernels).
inline thread_local FiberBlock tls_runner;

// Fills all shared memory with 0x00 or 0xA5 bytes, alternating from block to block (a zero and a
// non-zero pattern: a flag or count read before it is written is wrong one way or the other).
EP_EMU_NO_TSAN inline void poison_shared_memory(uint64_t block_number) {
  char* const begin = __start_ep_emu_shared;  // null when no kernel declares shared memory
  char* const end = __stop_ep_emu_shared;
  if (begin != nullptr && end > begin) std::memset(begin, block_number % 2 ? 0xA5 : 0x00, size_t(end - begin));
}

inline FiberBlock& block() { return *tls_block; }

// %globaltimer of the emulation: a virtual clock of this OS thread that advances 1 microsecond per
// read, so a bounded wait (csrc/common/device_sync.h) that nothing releases runs out after a number
// of spins set by its timeout instead of hanging; timeouts in emulated tests are virtual time.
inline thread_local unsigned long long tls_virtual_ns = 0;
inline unsigned long long global_timer_ns() { return tls_virtual_ns += 1000; }
// One iteration of a spin-wait: the other threads of the block run before the spinner resumes.
inline void spin_yield() { tls_block->spin_yield(); }

// Runs kernel(args...) on a grid of `grid` blocks of `threads` threads; a deadlocked block stops
// the launch with cudaErrorLaunchFailure. Each thread gets its own copy of the arguments.
// The current launch's dynamic shared memory (EP_DYNAMIC_SHARED): poisoned before each block, as
// the static kind is.
inline void* dynamic_shared_memory() { return tls_launch.dynamic_shared.data(); }

template <typename... Params>
class Launch {
 public:
  Launch(void (*kernel)(Params...), unsigned grid, unsigned threads, size_t shared_bytes = 0)
      : kernel_(kernel), grid_(grid), threads_(threads), shared_bytes_(shared_bytes) {}
  template <typename... Args>
  void operator()(Args&&... args) const {
    const std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
    if (grid_ == 0 || threads_ == 0 || threads_ > 1024) {
      tls_launch.last_error = cudaErrorInvalidValue;
      return;
    }
    LaunchState& s = tls_launch;
    s.grid_dim = dim3(grid_);
    s.block_dim = dim3(threads_);
    s.dynamic_shared.assign((shared_bytes_ + 7) / 8, 0);
    FiberBlock& runner = tls_runner;  // its fiber stacks are kept from launch to launch
    const std::function<void()> body = [&] { std::apply(kernel_, params); };
    for (unsigned b = 0; b < grid_; ++b) {
      s.block_idx = dim3(b);
      if (!s.dynamic_shared.empty())
        std::memset(s.dynamic_shared.data(), s.blocks_run % 2 ? 0xA5 : 0x00, 8 * s.dynamic_shared.size());
      poison_shared_memory(s.blocks_run++);
      if (!runner.run(threads_, body, s.reverse_schedule)) {
        s.last_error = cudaErrorLaunchFailure;
        return;
      }
    }
  }

 private:
  void (*kernel_)(Params...);
  unsigned grid_, threads_;
  size_t shared_bytes_;
};

template <typename... Params>
Launch<Params...> launch(void (*kernel)(Params...), unsigned grid, unsigned threads, size_t shared_bytes = 0) {
  return Launch<Params...>(kernel, grid, threads, shared_bytes);
}

template <typename T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "8-byte values at most");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}
template <typename T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

}  // namespace ep_emu

#define threadIdx (::dim3(::ep_emu::block().thread_index()))
#define blockIdx (::ep_emu::tls_launch.block_idx)
#define blockDim (::ep_emu::tls_launch.block_dim)
#define gridDim (::ep_emu::tls_launch.grid_dim)

// The order in which this OS thread's later launches resume their threads: 0 from thread 0 up,
// 1 from the highest down (tests run kernels both ways). Exported from every emulated library.
extern "C" __attribute__((used, visibility("default"))) inline void ep_emu_set_schedule(int reverse) {
  ep_emu::tls_launch.reverse_schedule = reverse != 0;
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = ep_emu::tls_launch.last_error;
  ep_emu::tls_launch.last_error = cudaSuccess;
  return e;
}
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument" : "unspecified launch failure";
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
template <typename F>
cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) {
  return cudaSuccess;
}

// ---- device functions ----
inline void __syncthreads() { ep_emu::block().sync_block(0); }
inline int __syncthreads_or(int p) { return ep_emu::block().sync_block(p).any; }
inline int __syncthreads_and(int p) { return ep_emu::block().sync_block(p).all; }
inline int __syncthreads_count(int p) { return ep_emu::block().sync_block(p).count; }
inline void __syncwarp(unsigned = 0xFFFFFFFFu) { ep_emu::block().sync_warp(); }

inline unsigned __ballot_sync(unsigned, int predicate) {
  const ep_emu::FiberBlock::WarpView view = ep_emu::block().warp_exchange(predicate != 0);
  unsigned mask = 0;
  for (unsigned l = 0; l < ep_emu::kWarpSize; ++l) mask |= unsigned(view.values[l] != 0) << l;
  return mask;
}
inline int __any_sync(unsigned m, int predicate) { return __ballot_sync(m, predicate) != 0; }
inline int __all_sync(unsigned, int predicate) {
  const ep_emu::FiberBlock::WarpView view = ep_emu::block().warp_exchange(predicate != 0);
  for (unsigned l = 0; l < ep_emu::kWarpSize; ++l)
    if ((view.live >> l & 1) && view.values[l] == 0) return 0;
  return 1;
}

// Shuffles over the whole warp (width 32): lane `src` of the exchanged values.
template <typename T>
T __shfl_sync(unsigned, T var, int src, int = 32) {
  const auto view = ep_emu::block().warp_exchange(ep_emu::to_bits(var));
  return ep_emu::from_bits<T>(view.values[unsigned(src) % ep_emu::kWarpSize]);
}
template <typename T>
T __shfl_xor_sync(unsigned, T var, int lane_mask, int = 32) {
  const auto view = ep_emu::block().warp_exchange(ep_emu::to_bits(var));
  return ep_emu::from_bits<T>(view.values[(ep_emu::block().lane() ^ unsigned(lane_mask)) % ep_emu::kWarpSize]);
}
template <typename T>
T __shfl_up_sync(unsigned, T var, unsigned delta, int = 32) {
  const auto view = ep_emu::block().warp_exchange(ep_emu::to_bits(var));
  const unsigned lane = ep_emu::block().lane();
  return lane >= delta ? ep_emu::from_bits<T>(view.values[lane - delta]) : var;
}
template <typename T>
T __shfl_down_sync(unsigned, T var, unsigned delta, int = 32) {
  const auto view = ep_emu::block().warp_exchange(ep_emu::to_bits(var));
  const unsigned lane = ep_emu::block().lane();
  return lane + delta < ep_emu::kWarpSize ? ep_emu::from_bits<T>(view.values[lane + delta]) : var;
}

inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((uint64_t(a) * b) >> 32); }
inline float __uint_as_float(unsigned v) { return ep_emu::from_bits<float>(v); }
inline unsigned __float_as_uint(float v) { return static_cast<unsigned>(ep_emu::to_bits(v)); }
template <typename T>
T __ldg(const T* p) {
  return *p;
}
template <typename T>
T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
T max(T a, T b) {
  return a < b ? b : a;
}

// System-scope atomics and fences (device_sync.h's timeout record): the same on host memory.
inline int atomicCAS_system(int* p, int expected, int desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}
inline int atomicExch_system(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// Atomics (relaxed, as CUDA's): fibers switch only at synchronisation points, so a plain
// read-modify-write would do; the atomic builtins also tell ThreadSanitizer builds that these
// accesses are atomic.
template <typename T>
T atomicAdd(T* p, T v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
template <typename T>
T atomicMin(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
T atomicMax(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
