// Device helpers shared by the two-hop dispatch and combine kernels (internode_two_hop*.cu):
// where a rank's buffer is (one PE per rank, or virtual ranks of one PE: see two_hop_launch.h),
// row copies and the rail put (the bounded wait on a 64-bit signal is device_sync.h's wait_signal).
#pragma once
#if defined(__CUDACC__) || defined(EP_CUDA_EMULATION)
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

// Host: the bounded barrier that ends a two-hop call (stage reuse), over every rank's PE (one PE
// per rank) or this PE alone (virtual ranks: a job of one PE, checked by the binding), on the
// layout's barrier words of the first rank buffer (launch_bounded_barrier, internode.cu). A PE
// that never comes makes it record kInternodeBarrier in `record` instead of hanging the stream.
inline void two_hop_end_barrier(const TwoHopCommon& c, int32_t* record, cudaStream_t s) {
  const TwoHopLayout l = make_two_hop_layout(NodeShape{c.num_ranks, c.ranks_per_node}, c.rail_rows,
                                             c.node_rows, c.row_bytes);
  launch_bounded_barrier(reinterpret_cast<uint64_t*>(c.symmetric_base + l.barrier),
                         c.rank_stride > 0 ? 1 : c.num_ranks, c.my_pe, c.round_value, c.timeout_ns, record, s);
}
#endif

// Cooperative copy of a 16-byte-multiple row by `width` threads starting at `lane`.
__device__ __forceinline__ void copy_row(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane,
                                         int width) {
  auto* d = reinterpret_cast<int4*>(dst);
  const auto* s = reinterpret_cast<const int4*>(src);
  for (int64_t i = lane; i < bytes / 16; i += width) d[i] = s[i];
}

}  // namespace ep_comm::cuda
#endif  // __CUDACC__ || EP_CUDA_EMULATION
