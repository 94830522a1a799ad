// The bounded waits of csrc/common/device_sync.h under the CUDA emulation, for
// tests/test_device_waits_emulated.py: warp 1 of a block stores a flag with a release after writing
// a payload, warp 0 waits for it (relaxed spin, one acquire) and copies the payload with the batched
// row copy; a second wait on a flag no one sets must run out and fill the timeout record.
#include <cuda_runtime.h>

#include "common/device_sync.h"
#include "launch.h"

namespace {

__global__ void handoff_kernel(int* flag, int4* payload, int payload_vectors, int4* copy, int* never, int32_t* record,
                               unsigned long long timeout_ns, int* results) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const ep_comm::WaitCtx w{record, timeout_ns, 0};
  if (warp == 1) {
    for (int i = lane; i < payload_vectors; i += 32) payload[i] = make_int4(i, 2 * i, 3 * i, 4 * i);
    __syncwarp();
    if (lane == 0) ep_comm::st_release_sys(flag, 7);
    return;
  }
  int ok = 0;
  if (lane == 0) ok = ep_comm::wait_geq(w, flag, 7, 1, ep_comm::kIntranodeDispatchRecv, 3);
  ok = __shfl_sync(0xffffffffu, ok, 0);
  __syncwarp();
  if (ok) ep_comm::warp_copy16_comm(copy, payload, 16LL * payload_vectors, lane);
  if (lane == 0) {
    results[0] = ok;
    results[1] = ep_comm::wait_geq(w, never, 1, 5, ep_comm::kIntranodeCombineRecv, 9);
  }
}

}  // namespace

extern "C" int emu_handoff(int* flag, void* payload, int payload_vectors, void* copy, int* never, int32_t* record,
                           unsigned long long timeout_ns, int* results) {
  EP_LAUNCH(handoff_kernel, 1, 64, nullptr)(flag, static_cast<int4*>(payload), payload_vectors,
                                            static_cast<int4*>(copy), never, record, timeout_ns, results);
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
