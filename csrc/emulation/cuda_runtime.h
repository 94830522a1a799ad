// CUDA emulation on the CPU: the parts of the CUDA runtime and device language that the kernels
// of csrc/cuda/ use (codec, layout, intranode, low-latency; internode and two-hop with the emulated
// NVSHMEM of nvshmem.h), so that the same source compiles as
// C++ and runs without a GPU. Found first on the include path (-I csrc/emulation) by
// `#include <cuda_runtime.h>`; built with -DEP_CUDA_EMULATION (tests/support/emulated_cuda.py builds the
// libraries). "Device" memory is host memory, launches run to completion before they return
// (streams ignored) unless queued between ep_emu_begin_streams and ep_emu_run_streams, which runs
// them together, streams at once and each stream's launches in order. A launch's blocks run as interleaved fibers (csrc/emulation/grid.h), as many
// at once as the emulated device holds (ep_emu_set_device; one at a time unless set), each block's
// threads as fibers (csrc/emulation/fibers.h) that switch at barriers, warp collectives, spin-wait
// iterations and release stores; so kernels whose blocks (or virtual ranks) wait for each other's
// flags run here too.
// What the emulation checks that the hardware would not: warp collectives with a full mask reached
// by every live lane (a divergent barrier is a launch failure, reported by cudaGetLastError), shared
// memory read before another thread's write without a barrier gives the old value, a flag published
// before the publishing warp's other threads stored what it announces is seen early, and a grid
// whose blocks spin forever (a flag never released, a grid that cannot be co-resident) is a launch
// failure whose cudaGetErrorString says which blocks spun.
// What it does not model: weak memory ordering (every store is visible at once: a relaxed store
// where a release is needed goes unseen), partial warp masks (every collective here is over the
// warp's live lanes), timing.
// __shared__ variables are function-local statics in one section, which holds the running block's
// copy; so a process runs one emulated launch (or set of queued launches) at a time (two OS threads launching at once would
// share it). A template kernel's statics escape the section (GCC places them elsewhere): keep
// kernels plain functions (a test checks it).
#pragma once
#ifndef EP_CUDA_EMULATION
#error "csrc/emulation/cuda_runtime.h is the CUDA emulation: build with -DEP_CUDA_EMULATION"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>


// ---- language: qualifiers ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Every __shared__ variable lives in one section (csrc/emulation/grid.h gives each resident block
// its own copy of it, poisoned when the block starts: shared memory is undefined then on a GPU).
#define __shared__ static __attribute__((section("ep_emu_shared")))

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
struct alignas(8) float2 {
  float x, y;
};
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }
using cudaStream_t = struct CUstream_emulated*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorLaunchFailure = 719 };
enum cudaFuncAttribute { cudaFuncAttributePreferredSharedMemoryCarveout = 9 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };

#include "grid.h"

namespace ep_emu {

// This OS thread's launches: the schedule order, the emulated device, the last error and why.
struct LaunchState {
  cudaError_t last_error = cudaSuccess;
  std::string failure;            // why the last failed launch failed (cudaGetErrorString)
  bool reverse_schedule = false;  // threads and blocks from the highest index down (ep_emu_set_schedule)
  bool stall_fails = false;       // a stalled grid fails the launch (ep_emu_set_stall_failure)
  DeviceModel device;             // ep_emu_set_device / ep_emu_set_resident_limit
  bool defer_streams = false;     // launches on a non-null stream are queued (ep_emu_begin_streams)
  std::vector<GridLaunch> queued;
  unsigned long long launches = 0;  // kernel launches made (run or queued; ep_emu_launch_count)
  unsigned long long memsets = 0;   // cudaMemset(Async) calls made (ep_emu_memset_count)
};
inline thread_local LaunchState tls_launch;
// The grid runner of this OS thread's launches (one at a time: kernels launch no kernels).
inline thread_local GridRunner tls_runner;

inline FiberBlock& block() { return tls_resident->fibers; }

// %globaltimer of the emulation: a virtual clock of this OS thread that advances 1 microsecond per
// read, so a bounded wait (csrc/common/device_sync.h) that nothing releases runs out after a number
// of spins set by its timeout instead of hanging; timeouts in emulated tests are virtual time.
inline thread_local unsigned long long tls_virtual_ns = 0;
inline unsigned long long global_timer_ns() { return tls_virtual_ns += 1000; }
// One iteration of a spin-wait: every other runnable thread of the launch runs before the spinner
// resumes.
inline void spin_yield() { tls_resident->fibers.spin_yield(); }
// After a release store to memory other blocks (or virtual ranks) read: they run first.
inline void release_yield() { tls_resident->fibers.release_yield(); }
// An acquire load: the spin-wait that made it has succeeded.
inline void note_acquire() { tls_resident->fibers.note_acquire(); }

// The current block's dynamic shared memory (EP_DYNAMIC_SHARED): poisoned when the block starts,
// as the static kind is.
inline void* dynamic_shared_memory() { return tls_resident->dynamic.data(); }

// Runs kernel(args...) on a grid of `grid` blocks of `threads` threads, as many blocks resident at
// once as the emulated device holds (grid.h); a deadlock stops the launch with
// cudaErrorLaunchFailure and cudaGetErrorString says why. Each thread gets its own copy of the
// arguments. Between ep_emu_begin_streams and ep_emu_run_streams a launch on a non-null stream is
// queued instead, its arguments kept, and runs with the others queued (run_queued_launches).
template <typename... Params>
class Launch {
 public:
  Launch(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t shared_bytes = 0,
         const void* stream = nullptr)
      : kernel_(kernel), grid_(grid), threads_(threads), shared_bytes_(shared_bytes), stream_(stream) {}
  template <typename... Args>
  void operator()(Args&&... args) const {
    auto params = std::make_shared<const std::tuple<std::decay_t<Params>...>>(std::forward<Args>(args)...);
    LaunchState& s = tls_launch;
    ++s.launches;
    if (grid_.x == 0 || grid_.y == 0 || grid_.z == 0 || threads_ == 0 || threads_ > 1024) {
      s.last_error = cudaErrorInvalidValue;
      return;
    }
    void (*kernel)(Params...) = kernel_;
    GridLaunch l{grid_, threads_, shared_bytes_, resident_blocks(s.device, threads_), stream_,
                 [kernel, params] { std::apply(kernel, *params); }};
    if (s.defer_streams && stream_ != nullptr) {
      s.queued.push_back(std::move(l));
      return;
    }
    std::string failure;
    if (!tls_runner.run({std::move(l)}, s.reverse_schedule, s.stall_fails, tls_virtual_ns, failure)) {
      s.last_error = cudaErrorLaunchFailure;
      s.failure = "unspecified launch failure (CUDA emulation: " + failure + ")";
    }
  }

 private:
  void (*kernel_)(Params...);
  dim3 grid_;
  unsigned threads_;
  size_t shared_bytes_;
  const void* stream_;
};

template <typename... Params>
Launch<Params...> launch(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t shared_bytes = 0,
                         const void* stream = nullptr) {
  return Launch<Params...>(kernel, grid, threads, shared_bytes, stream);
}

// Runs the launches queued since ep_emu_begin_streams together (grid.h: streams at once, each
// stream's launches in order) and stops queueing: false, with the failure set, on a deadlock.
inline bool run_queued_launches() {
  LaunchState& s = tls_launch;
  std::vector<GridLaunch> launches;
  launches.swap(s.queued);
  s.defer_streams = false;
  std::string failure;
  if (!tls_runner.run(launches, s.reverse_schedule, s.stall_fails, tls_virtual_ns, failure)) {
    s.last_error = cudaErrorLaunchFailure;
    s.failure = "unspecified launch failure (CUDA emulation: " + failure + ")";
    return false;
  }
  return true;
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
#define blockIdx (::ep_emu::tls_resident->index)
#define blockDim (::ep_emu::tls_resident->block_dim)
#define gridDim (::ep_emu::tls_resident->grid_dim)

// The order in which this OS thread's later launches resume their threads: 0 from thread 0 up,
// 1 from the highest down (tests run kernels both ways). Exported from every emulated library.
extern "C" __attribute__((used, visibility("default"))) inline void ep_emu_set_schedule(int reverse) {
  ep_emu::tls_launch.reverse_schedule = reverse != 0;
}
// The emulated device of this OS thread's later launches: `sms` multiprocessors of at most
// `blocks_per_sm` blocks each (grid.h's DeviceModel; 1 x 1 unless set: blocks one at a time).
extern "C" __attribute__((used, visibility("default"))) inline void ep_emu_set_device(int sms, int blocks_per_sm) {
  ep_emu::tls_launch.device.sms = sms > 0 ? unsigned(sms) : 1u;
  ep_emu::tls_launch.device.blocks_per_sm = blocks_per_sm > 0 ? unsigned(blocks_per_sm) : 1u;
}
// 1: a later launch whose resident blocks stall (grid.h) fails with a description of the stall,
// even when the bounded waits' timeouts end it; 0 (the default): the timeouts end it, as on a GPU.
extern "C" __attribute__((used, visibility("default"))) inline void ep_emu_set_stall_failure(int fail) {
  ep_emu::tls_launch.stall_fails = fail != 0;
}
// At most `blocks` blocks of a later launch resident at once, whatever the occupancy reports (0:
// no cap): a grid the launch check accepts but the device cannot hold.
extern "C" __attribute__((used, visibility("default"))) inline void ep_emu_set_resident_limit(int blocks) {
  ep_emu::tls_launch.device.resident_limit = blocks > 0 ? unsigned(blocks) : 0u;
}

// The kernel launches (every EP_LAUNCH, valid or not) and the cudaMemset / cudaMemsetAsync calls
// this OS thread has made, since the library was loaded: a test counts a call's launches as the
// difference of two readings.
extern "C" __attribute__((used, visibility("default"))) inline unsigned long long ep_emu_launch_count() {
  return ep_emu::tls_launch.launches;
}
extern "C" __attribute__((used, visibility("default"))) inline unsigned long long ep_emu_memset_count() {
  return ep_emu::tls_launch.memsets;
}

// From here on, this OS thread's launches on a non-null stream are queued, not run, until
// ep_emu_run_streams: then they all run at once, each stream's launches in order and each stream on
// an emulated device of its own (as ranks' streams on their GPUs in a job of several processes),
// so that a kernel waiting for another stream's flags runs while the other stream sets them.
extern "C" __attribute__((used, visibility("default"))) inline void ep_emu_begin_streams() {
  ep_emu::tls_launch.defer_streams = true;
}
// Runs what ep_emu_begin_streams queued and stops queueing: 0, or -1 when the launches failed
// (cudaGetLastError then reports it, cudaGetErrorString says why).
extern "C" __attribute__((used, visibility("default"))) inline int ep_emu_run_streams() {
  return ep_emu::run_queued_launches() ? 0 : -1;
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = ep_emu::tls_launch.last_error;
  ep_emu::tls_launch.last_error = cudaSuccess;
  return e;
}
inline const char* cudaGetErrorString(cudaError_t e) {
  if (e == cudaErrorLaunchFailure && !ep_emu::tls_launch.failure.empty()) return ep_emu::tls_launch.failure.c_str();
  return e == cudaSuccess ? "no error" : e == cudaErrorInvalidValue ? "invalid argument" : "unspecified launch failure";
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = static_cast<int>(ep_emu::tls_launch.device.sms);
  return cudaSuccess;
}
// The emulated device's blocks per SM for `threads`-thread blocks (grid.h's occupancy_per_sm).
template <typename F>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, F, int threads, size_t) {
  *blocks = static_cast<int>(ep_emu::occupancy_per_sm(ep_emu::tls_launch.device, static_cast<unsigned>(threads)));
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  ++ep_emu::tls_launch.memsets;
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* p, int value, size_t bytes) { return cudaMemsetAsync(p, value, bytes); }
// Launches outside ep_emu_begin_streams ... ep_emu_run_streams have finished when they return.
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
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
inline float __int_as_float(int v) { return ep_emu::from_bits<float>(static_cast<unsigned>(v)); }
inline int __float_as_int(float v) { return static_cast<int>(ep_emu::to_bits(v)); }
// Round-to-nearest float add and multiply, never contracted into an FMA (as nvcc's intrinsics)
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
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
