// Internode transport: NVSHMEM bootstrap and a GPU-initiated byte all-to-all (one-sided puts with
// signals; IBGDA where the NIC supports it, NVSHMEM's other transports otherwise). It backs
// NvshmemTransport.exchange_bytes / exchange_counts in ep_comm/backends/nvshmem.py.
//
// Buffer: ExchangeLayout (csrc/common/buffer_layout.h): uint64 signal[R] | stage[R][slot_bytes] |
// uint64 barrier[R].
// One round: block r puts this rank's chunk for r into stage[me] of PE r and sets signal[me]
// there to the round value; block s then waits for signal[s] == round value here and copies
// stage[s] out. Rounds are separated by a barrier on the stream (stage reuse). Bounded waits,
// the barrier included (bounded_barrier_kernel: a PE that never comes is an error, not a hang).
#include <cuda_runtime.h>

#include "../common/buffer_layout.h"
#include "../common/device_sync.h"
#include "../cuda_bindings/launchers.h"
#include "launch.h"

#if defined(EP_COMM_WITH_NVSHMEM)
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace ep_comm::cuda {

#if defined(EP_COMM_WITH_NVSHMEM)
// Device-side NVSHMEM entry points used by low_latency.cu (declared there).
__device__ void nvshmem_put_warp(uint8_t* symmetric_dst, const uint8_t* src, int64_t bytes, int pe) {
  nvshmemx_putmem_warp(symmetric_dst, src, static_cast<size_t>(bytes), pe);
}
__device__ void nvshmem_fenced_int_put(int* symmetric_flag, int value, int pe) {
  nvshmem_fence();
  nvshmem_int_p(symmetric_flag, value, pe);
}

namespace {

__global__ void exchange_put_kernel(uint8_t* symmetric, int64_t slot_bytes, const uint8_t* send,
                                    const int64_t* send_offsets, const int64_t* send_bytes,
                                    int my_pe, unsigned long long round_value) {
  const int peer = blockIdx.x;
  const ExchangeLayout l = make_exchange_layout(gridDim.x, slot_bytes);
  auto* signal = reinterpret_cast<uint64_t*>(symmetric + l.signal) + my_pe;
  uint8_t* dst = symmetric + l.stage + my_pe * l.slot_bytes;
  nvshmemx_putmem_signal_nbi_block(dst, send + send_offsets[peer], send_bytes[peer], signal,
                                   round_value, NVSHMEM_SIGNAL_SET, peer);
}

__global__ void exchange_wait_kernel(uint8_t* symmetric, int64_t slot_bytes, uint8_t* recv,
                                     const int64_t* recv_offsets, const int64_t* recv_bytes,
                                     int my_pe, unsigned long long round_value,
                                     unsigned long long timeout_ns, int32_t* record) {
  const int src = blockIdx.x;
  const ExchangeLayout l = make_exchange_layout(gridDim.x, slot_bytes);
  __shared__ int ok;
  if (threadIdx.x == 0) {
    const auto* signal = reinterpret_cast<const unsigned long long*>(symmetric + l.signal) + src;
    const WaitCtx w{record, timeout_ns, my_pe};
    ok = 1;
    unsigned long long start = global_timer_ns();
    while (ld_acquire_sys_u64(signal) != round_value) {
      const unsigned long long now = global_timer_ns();
      if (failed(w)) { ok = 0; break; }
      if (now - start > timeout_ns) {
        record_failure(w, kTimedOut, src, kInternodeExchange, now - start, 0);
        ok = 0;
        break;
      }
    }
  }
  __syncthreads();
  if (!ok) return;
  const uint8_t* in = symmetric + l.stage + src * l.slot_bytes;
  uint8_t* out = recv + recv_offsets[src];
  const int64_t n = recv_bytes[src];
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = reinterpret_cast<const volatile uint8_t*>(in)[i];
}

// One block, after thread 0's nvshmem_quiet and a __syncthreads: tell every PE this one arrived
// (words[my_pe] there = value), then wait (bounded) until every PE said so here. Thread p signals
// and waits for PE p.
__device__ void barrier_arrive_and_wait(uint64_t* words, int num_pes, int my_pe, unsigned long long value,
                                        unsigned long long timeout_ns, int32_t* record) {
  for (int pe = threadIdx.x; pe < num_pes; pe += blockDim.x)
    nvshmemx_signal_op(words + my_pe, value, NVSHMEM_SIGNAL_SET, pe);
  const WaitCtx w{record, timeout_ns, my_pe};
  for (int pe = threadIdx.x; pe < num_pes; pe += blockDim.x) {
    if (!wait_signal(w, reinterpret_cast<const unsigned long long*>(words) + pe, value, pe,
                     kInternodeBarrier, static_cast<int>(value)))
      break;
  }
}

__global__ void bounded_barrier_kernel(uint64_t* words, int num_pes, int my_pe, unsigned long long value,
                                       unsigned long long timeout_ns, int32_t* record) {
  if (threadIdx.x == 0) nvshmem_quiet();
  __syncthreads();
  barrier_arrive_and_wait(words, num_pes, my_pe, value, timeout_ns, record);
}

// The barrier's number is this PE's count of its barriers on `words` (*round, device memory):
// every PE runs the same sequence of them, so the counts agree, and a CUDA graph replay advances
// the count as a fresh launch does.
__global__ void counted_barrier_kernel(uint64_t* words, unsigned long long* round, int num_pes, int my_pe,
                                       unsigned long long timeout_ns, int32_t* record) {
  const unsigned long long value = *round + 1;
  __syncthreads();  // every thread has read the count before thread 0 advances it
  if (threadIdx.x == 0) {
    *round = value;
    nvshmem_quiet();
  }
  __syncthreads();
  barrier_arrive_and_wait(words, num_pes, my_pe, value, timeout_ns, record);
}

}  // namespace

void launch_bounded_barrier(uint64_t* words, int num_pes, int my_pe, unsigned long long value,
                            unsigned long long timeout_ns, int32_t* record, void* stream) {
  EP_LAUNCH(bounded_barrier_kernel, 1, 128, static_cast<cudaStream_t>(stream))(words, num_pes, my_pe, value,
                                                                               timeout_ns, record);
}

void launch_counted_barrier(uint64_t* words, unsigned long long* round, int num_pes, int my_pe,
                            unsigned long long timeout_ns, int32_t* record, void* stream) {
  EP_LAUNCH(counted_barrier_kernel, 1, 128, static_cast<cudaStream_t>(stream))(words, round, num_pes, my_pe,
                                                                               timeout_ns, record);
}

bool nvshmem_built() { return true; }
int nvshmem_unique_id_size() { return static_cast<int>(sizeof(nvshmemx_uniqueid_t)); }
void nvshmem_get_unique_id(uint8_t* out) {
  nvshmemx_uniqueid_t id;
  nvshmemx_get_uniqueid(&id);
  memcpy(out, &id, sizeof(id));
}
void nvshmem_init_with_unique_id(const uint8_t* id_bytes, int rank, int num_ranks) {
  nvshmemx_uniqueid_t id;
  memcpy(&id, id_bytes, sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  nvshmemx_set_attr_uniqueid_args(rank, num_ranks, &id, &attr);
  nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
}
void nvshmem_finalize_pe() { nvshmem_finalize(); }
int nvshmem_my_pe_id() { return nvshmem_my_pe(); }
int nvshmem_num_pes() { return nvshmem_n_pes(); }
void* nvshmem_alloc(int64_t bytes) {
  void* p = nvshmem_malloc(static_cast<size_t>(bytes));
  if (p) {
    cudaMemset(p, 0, static_cast<size_t>(bytes));
    // the zeros must land before the barrier lets a peer put into this buffer (the memset runs
    // on the default stream, which NVSHMEM's barrier does not wait for)
    cudaStreamSynchronize(0);
  }
  nvshmem_barrier_all();
  return p;
}
void nvshmem_release(void* ptr) { nvshmem_free(ptr); }
void* nvshmem_peer_ptr(void* ptr, int pe) { return nvshmem_ptr(ptr, pe); }
void nvshmem_barrier_on_stream(void* stream) {
  nvshmemx_barrier_all_on_stream(static_cast<cudaStream_t>(stream));
}

void launch_exchange_round(uint8_t* symmetric, int64_t slot_bytes, const uint8_t* send,
                           const int64_t* send_offsets, const int64_t* send_bytes, uint8_t* recv,
                           const int64_t* recv_offsets, const int64_t* recv_bytes, int num_ranks,
                           int my_pe, unsigned long long round_value,
                           unsigned long long timeout_ns, int32_t* record, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  EP_LAUNCH(exchange_put_kernel, num_ranks, 128, s)(symmetric, slot_bytes, send, send_offsets, send_bytes, my_pe,
                                                    round_value);
  EP_LAUNCH(exchange_wait_kernel, num_ranks, 256, s)(symmetric, slot_bytes, recv, recv_offsets, recv_bytes, my_pe,
                                                     round_value, timeout_ns, record);
  // every PE copied its stage out before the next round; bounded, so that a PE that never came
  // (its wait above timed out) leaves this PE with a CommTimeoutError instead of a hang
  const ExchangeLayout l = make_exchange_layout(num_ranks, slot_bytes);
  launch_bounded_barrier(reinterpret_cast<uint64_t*>(symmetric + l.barrier), num_ranks, my_pe, round_value,
                         timeout_ns, record, stream);
}

#else  // built without NVSHMEM headers/libraries: the transport reports itself unavailable

bool nvshmem_built() { return false; }
int nvshmem_unique_id_size() { return 0; }
void nvshmem_get_unique_id(uint8_t*) {}
void nvshmem_init_with_unique_id(const uint8_t*, int, int) {}
void nvshmem_finalize_pe() {}
int nvshmem_my_pe_id() { return -1; }
int nvshmem_num_pes() { return 0; }
void* nvshmem_alloc(int64_t) { return nullptr; }
void nvshmem_release(void*) {}
void* nvshmem_peer_ptr(void*, int) { return nullptr; }
void nvshmem_barrier_on_stream(void*) {}
void launch_bounded_barrier(uint64_t*, int, int, unsigned long long, unsigned long long, int32_t*, void*) {}
void launch_counted_barrier(uint64_t*, unsigned long long*, int, int, unsigned long long, int32_t*, void*) {}
void launch_exchange_round(uint8_t*, int64_t, const uint8_t*, const int64_t*, const int64_t*,
                           uint8_t*, const int64_t*, const int64_t*, int, int, unsigned long long,
                           unsigned long long, int32_t*, void*) {}

#endif

}  // namespace ep_comm::cuda
