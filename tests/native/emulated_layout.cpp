// C entry point for the dispatch layout kernel (csrc/cuda/layout.cu) built through the CUDA
// emulation, for tests/test_layout_kernel_emulated.py: host pointers in, the launcher's error out.
#include "cuda_bindings/launchers.h"

extern "C" int emu_dispatch_layout(const int64_t* topk_idx, int num_tokens, int num_topk, int num_experts,
                                   int num_ranks, int ranks_per_node, const int32_t* expert_to_rank,
                                   int32_t* per_rank, int32_t* per_node, int32_t* per_expert, bool* in_rank) {
  ep_comm::cuda::LayoutArgs a{topk_idx, expert_to_rank, num_tokens, num_topk, num_experts, num_ranks,
                              ranks_per_node, per_rank, per_node, per_expert, in_rank};
  ep_comm::cuda::launch_dispatch_layout(a, nullptr);
  return ep_comm::cuda::take_launch_error() == nullptr ? 0 : 1;
}
