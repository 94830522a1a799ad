// Kernels that probe the CUDA emulation (csrc/emulation/) against the CUDA semantics it stands
// in for: warp votes and shuffles, block votes, blocks whose size is not a multiple of 32,
// threads that exit early, a divergent barrier (a launch failure), and the two schedule orders.
// Built by tests/test_cuda_emulation.py through tests/support/emulated_cuda.py; each probe_* entry point
// launches one kernel on host memory and returns cudaGetLastError().
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"

namespace {

// Per thread t (lane l, warp w): out[8 t + k] for k = 0..7 as written below.
__global__ void warp_kernel(uint32_t* out) {
  const unsigned t = threadIdx.x, lane = t & 31;
  const uint32_t v = 1000 * blockIdx.x + t;
  uint32_t* o = out + 8 * (blockIdx.x * blockDim.x + t);
  o[0] = __ballot_sync(0xFFFFFFFFu, lane % 3 == 0);
  o[1] = __any_sync(0xFFFFFFFFu, lane == 31);
  o[2] = __all_sync(0xFFFFFFFFu, lane < 31);
  o[3] = __shfl_sync(0xFFFFFFFFu, v, (lane * 7) % 32);
  o[4] = __shfl_xor_sync(0xFFFFFFFFu, v, 5);
  o[5] = __shfl_up_sync(0xFFFFFFFFu, v, 3);
  o[6] = __shfl_down_sync(0xFFFFFFFFu, v, 4);
  const uint64_t wide = (uint64_t(v) << 32) | 0xABCDu;
  o[7] = static_cast<uint32_t>(__shfl_sync(0xFFFFFFFFu, wide, 0) >> 32);
}

// Block votes over blockDim.x threads: out[4 t + k].
__global__ void block_kernel(int* out) {
  const unsigned t = threadIdx.x;
  int* o = out + 4 * t;
  o[0] = __syncthreads_or(t == blockDim.x - 1);
  o[1] = __syncthreads_and(t != 5);
  o[2] = __syncthreads_count(t % 2 == 0);
  __shared__ int total;
  if (t == 0) total = 0;
  __syncthreads();
  atomicAdd(&total, int(t));
  __syncthreads();
  o[3] = total;
}

// Threads t >= live exit at once; the rest run a ballot and a barrier: out[t] = the ballot.
__global__ void early_exit_kernel(unsigned live, uint32_t* out) {
  const unsigned t = threadIdx.x;
  if (t >= live) return;
  const uint32_t b = __ballot_sync(0xFFFFFFFFu, 1);
  __syncthreads();
  out[t] = b;
}

// Half of warp 0 waits at a warp barrier that its other half never reaches (they wait at the
// block barrier with the other warps): no thread can go on (a hang on a GPU; a launch failure
// here).
__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x < 16) __syncwarp();
  else __syncthreads();
  out[threadIdx.x] = 1;
}

// Thread 0 writes a shared flag that the others read with no barrier in between (a race): what
// they read depends on the order threads run in.
__global__ void racy_kernel(int* out) {
  __shared__ int flag;
  if (threadIdx.x == 0) flag = 0;
  __syncthreads();
  if (threadIdx.x == 0) flag = 1;
  else out[threadIdx.x] = flag;
  __syncthreads();
}

}  // namespace

extern "C" {
int probe_warp(unsigned blocks, unsigned threads, uint32_t* out) {
  EP_LAUNCH(warp_kernel, blocks, threads, nullptr)(out);
  return cudaGetLastError();
}
int probe_block(unsigned threads, int* out) {
  EP_LAUNCH(block_kernel, 1, threads, nullptr)(out);
  return cudaGetLastError();
}
int probe_early_exit(unsigned threads, unsigned live, uint32_t* out) {
  EP_LAUNCH(early_exit_kernel, 1, threads, nullptr)(live, out);
  return cudaGetLastError();
}
int probe_divergent_barrier(int* out) {
  EP_LAUNCH(divergent_barrier_kernel, 1, 128, nullptr)(out);
  return cudaGetLastError();
}
int probe_racy(unsigned threads, int* out) {
  EP_LAUNCH(racy_kernel, 1, threads, nullptr)(out);
  return cudaGetLastError();
}
}
