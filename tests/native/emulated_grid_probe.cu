// Kernels whose blocks wait for each other, for tests/test_emulated_grid.py: they probe the CUDA
// emulation's grid of co-resident blocks (csrc/emulation/grid.h) through the waits of
// csrc/common/device_sync.h. Each grid_* entry point launches one kernel on host memory and returns
// cudaGetLastError(); grid_failure() is the text of the last failure.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_sync.h"
#include "launch.h"

namespace {

// Block b (b > 0) waits for block b - 1's flag, then sets its own, so the blocks finish from the
// last one down only if all are resident at once; each block keeps its index in shared memory
// across the wait and writes what it finds there afterwards: out[3 b .. 3 b + 2] = (blockIdx.x,
// blockIdx.y, the shared copy).
__global__ void chain_kernel(int* flags, int32_t* record, int* out) {
  __shared__ int mine;
  const int b = blockIdx.y * gridDim.x + blockIdx.x;
  const ep_comm::WaitCtx w{record, 1000000000ULL, b};
  if (threadIdx.x == 0) mine = 1000 + b;
  __syncthreads();
  if (threadIdx.x == 0 && b + 1 < int(gridDim.x * gridDim.y))
    ep_comm::wait_geq(w, flags + b + 1, 1, b + 1, ep_comm::kIntranodeBarrier, 0);
  __syncthreads();
  if (threadIdx.x == 0) {
    out[3 * b] = blockIdx.x;
    out[3 * b + 1] = blockIdx.y;
    out[3 * b + 2] = mine;
    ep_comm::st_release_sys(flags + b, 1);
  }
}

// Block 0's warp stores a row (every lane 16 bytes), lane 0 publishes it (after a __syncwarp when
// `sync`); block 1's lane 0 waits for the flag, then the warp copies the row out.
__global__ void publish_kernel(int* flag, int4* row, int4* copy, int sync, int32_t* record) {
  const int lane = threadIdx.x & 31;
  if (blockIdx.x == 0) {
    row[lane] = make_int4(lane, lane + 1, lane + 2, lane + 3);
    if (sync) __syncwarp();
    if (lane == 0) ep_comm::st_release_sys(flag, 1);
    return;
  }
  const ep_comm::WaitCtx w{record, 1000000000ULL, 1};
  int ok = 0;
  if (lane == 0) ok = ep_comm::wait_geq(w, flag, 1, 0, ep_comm::kIntranodeDispatchRecv, 0);
  ok = __shfl_sync(0xffffffffu, ok, 0);
  if (ok) copy[lane] = ep_comm::ld_volatile_int4(row + lane);
}

}  // namespace

extern "C" int grid_chain(int gx, int gy, int threads, int* flags, int32_t* record, int* out) {
  EP_LAUNCH(chain_kernel, dim3(gx, gy), threads, nullptr)(flags, record, out);
  return cudaGetLastError();
}

extern "C" int grid_publish(int* flag, void* row, void* copy, int sync, int32_t* record) {
  EP_LAUNCH(publish_kernel, 2, 32, nullptr)(flag, static_cast<int4*>(row), static_cast<int4*>(copy), sync, record);
  return cudaGetLastError();
}

extern "C" int grid_occupancy(int threads) {
  int device = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chain_kernel, threads, 0);
  return sms * per_sm;
}

extern "C" const char* grid_failure() { return cudaGetErrorString(cudaErrorLaunchFailure); }
