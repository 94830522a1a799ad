// Dispatch layout (ep_comm/layout.py's compute_dispatch_layout on the GPU): one thread per token
// builds its is_token_in_rank row; per-rank / per-node / per-expert counts are reduced in shared
// memory and added to the (zeroed) outputs with one atomic per block and counter.
#include <cuda_runtime.h>

#include <string>

#include "../common/routing.h"
#include "../cuda_bindings/launchers.h"
#include "launch.h"

namespace ep_comm::cuda {
namespace {

constexpr int kThreads = 256;

// Dynamic shared memory: int32 rank_count[R] | node_count[R / rpn] | expert_count[E].
__global__ void __launch_bounds__(kThreads) dispatch_layout_kernel(LayoutArgs a) {
  EP_DYNAMIC_SHARED(int32_t, shared_counts);
  const int num_nodes = a.num_tokens_per_rdma_rank ? a.num_ranks / a.ranks_per_node : 0;
  int32_t* rank_count = shared_counts;
  int32_t* node_count = rank_count + a.num_ranks;
  int32_t* expert_count = node_count + num_nodes;
  const int total = a.num_ranks + num_nodes + a.num_experts;
  for (int i = threadIdx.x; i < total; i += blockDim.x) shared_counts[i] = 0;
  __syncthreads();

  const int token = blockIdx.x * blockDim.x + threadIdx.x;
  if (token < a.num_tokens) {
    const int64_t* row = a.topk_idx + static_cast<int64_t>(token) * a.num_topk;
    bool* mask = a.is_token_in_rank + static_cast<int64_t>(token) * a.num_ranks;
    for (int r = 0; r < a.num_ranks; ++r) mask[r] = false;
    for (int k = 0; k < a.num_topk; ++k) {
      const int64_t expert = row[k];
      if (expert < 0) continue;
      atomicAdd(&expert_count[expert], 1);
      const int owner = a.expert_to_rank[expert];
      if (is_first_hit(row, k, a.expert_to_rank)) {
        mask[owner] = true;
        atomicAdd(&rank_count[owner], 1);
      }
      if (num_nodes > 0 && is_first_hit(row, k, a.expert_to_rank, a.ranks_per_node))
        atomicAdd(&node_count[owner / a.ranks_per_node], 1);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int32_t v = shared_counts[i];
    if (v == 0) continue;
    if (i < a.num_ranks) atomicAdd(&a.num_tokens_per_rank[i], v);
    else if (i < a.num_ranks + num_nodes) atomicAdd(&a.num_tokens_per_rdma_rank[i - a.num_ranks], v);
    else atomicAdd(&a.num_tokens_per_expert[i - a.num_ranks - num_nodes], v);
  }
}

}  // namespace

namespace {
thread_local std::string refusal;  // the reason of this thread's last refused launch
thread_local std::string reported;
}  // namespace

void refuse_launch(const std::string& reason) { refusal = reason; }

const char* take_launch_error() {
  if (!refusal.empty()) {
    reported.swap(refusal);
    refusal.clear();
    return reported.c_str();
  }
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

void launch_dispatch_layout(const LayoutArgs& a, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const int num_nodes = a.num_tokens_per_rdma_rank ? a.num_ranks / a.ranks_per_node : 0;
  cudaMemsetAsync(a.num_tokens_per_rank, 0, sizeof(int32_t) * a.num_ranks, s);
  if (num_nodes) cudaMemsetAsync(a.num_tokens_per_rdma_rank, 0, sizeof(int32_t) * num_nodes, s);
  cudaMemsetAsync(a.num_tokens_per_expert, 0, sizeof(int32_t) * a.num_experts, s);
  if (a.num_tokens == 0) return;
  const size_t shared = sizeof(int32_t) * (a.num_ranks + num_nodes + a.num_experts);
  const int blocks = (a.num_tokens + kThreads - 1) / kThreads;
  EP_LAUNCH_SMEM(dispatch_layout_kernel, blocks, kThreads, shared, s)(a);
}

}  // namespace ep_comm::cuda
