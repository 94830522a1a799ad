// Device helpers shared by the two-hop dispatch and combine kernels (internode_two_hop*.cu):
// where a rank's buffer is (one PE per rank, or virtual ranks of one PE: see two_hop_launch.h),
// row copies and the bounded wait on a 64-bit NVSHMEM signal.
#pragma once
#if defined(__CUDACC__)
#include "../common/device_sync.h"
#include "../common/hierarchy.h"
#include "../cuda_bindings/two_hop_launch.h"

#if defined(EP_COMM_WITH_NVSHMEM)
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace ep_comm::cuda {

template <class T>
struct TwoHopRankSet {
  T r[kMaxRanks];
};

template <class T>
TwoHopRankSet<T> two_hop_set(const T* ranks, int n) {
  TwoHopRankSet<T> set{};
  for (int i = 0; i < n; ++i) set.r[i] = ranks[i];
  return set;
}

__device__ __forceinline__ NodeShape shape_of(const TwoHopCommon& c) {
  return NodeShape{c.num_ranks, c.ranks_per_node};
}
__device__ __forceinline__ TwoHopLayout layout_of(const TwoHopCommon& c) {
  return make_two_hop_layout(shape_of(c), c.rail_rows, c.node_rows, c.row_bytes);
}
// Symmetric address of `rank`'s buffer, valid as a put destination on pe_of(rank).
__device__ __forceinline__ uint8_t* rank_buffer(const TwoHopCommon& c, int rank) {
  return c.symmetric_base + (c.rank_stride > 0 ? static_cast<int64_t>(rank) * c.rank_stride : 0);
}
__device__ __forceinline__ int pe_of(const TwoHopCommon& c, int rank) {
  return c.rank_stride > 0 ? c.my_pe : rank;
}

#if defined(EP_COMM_WITH_NVSHMEM)
// The rail hop of both kernels, by one block: puts `rows` rows of `pb` bytes from `src` into
// stage `dst` on `rank`'s PE and sets `signal` there to the call's round value; with no rows the
// signal alone (a receiver waits on every rail peer's signal, rows or not).
__device__ __forceinline__ void put_rows_with_signal(const TwoHopCommon& c, uint8_t* dst, const uint8_t* src,
                                                     int64_t rows, int64_t pb, uint64_t* signal, int rank) {
  if (rows > 0) {
    nvshmemx_putmem_signal_nbi_block(dst, src, static_cast<size_t>(rows * pb), signal, c.round_value,
                                     NVSHMEM_SIGNAL_SET, pe_of(c, rank));
  } else if (threadIdx.x == 0) {
    nvshmemx_signal_op(signal, c.round_value, NVSHMEM_SIGNAL_SET, pe_of(c, rank));
  }
}
#endif

// Cooperative copy of a 16-byte-multiple row by `width` threads starting at `lane`.
__device__ __forceinline__ void copy_row(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane,
                                         int width) {
  auto* d = reinterpret_cast<int4*>(dst);
  const auto* s = reinterpret_cast<const int4*>(src);
  for (int64_t i = lane; i < bytes / 16; i += width) d[i] = s[i];
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

}  // namespace ep_comm::cuda
#endif  // __CUDACC__
