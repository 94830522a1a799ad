"""The dispatch layout kernel (csrc/cuda/layout.cu) run on the CPU through the CUDA emulation
(tests/support/emulated_cuda.py) against ep_comm/layout.py's compute_dispatch_layout: per-rank, per-node
and per-expert counts and is_token_in_rank, for routings with dropped (-1) entries, repeated
ranks, uneven expert placement and several blocks of tokens."""
from __future__ import annotations

import ctypes

import pytest
import torch
from support.emulated_cuda import build, load
from support.native import compiler

from ep_comm.layout import compute_dispatch_layout
from ep_comm.placement import ExpertPlacement

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler")


@pytest.fixture(scope="module")
def layout_lib(tmp_path_factory) -> ctypes.CDLL:
    lib = load(build(["csrc/cuda/layout.cu", "tests/native/emulated_layout.cpp"],
                     tmp_path_factory.mktemp("emulated_layout") / "layout.so"))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.emu_dispatch_layout.argtypes = [p, i, i, i, i, i, p, p, p, p, p]
    return lib


def _kernel_layout(lib, topk_idx: torch.Tensor, placement: ExpertPlacement, ranks_per_node: int):
    n, k = topk_idx.shape
    r, e = placement.num_ranks, placement.num_experts
    nodes = r // ranks_per_node if r > ranks_per_node and r % ranks_per_node == 0 else 0
    expert_to_rank = placement.expert_to_rank.to(torch.int32).contiguous()
    per_rank = torch.full((r,), -7, dtype=torch.int32)  # stale values the launcher must clear
    per_node = torch.full((max(nodes, 1),), -7, dtype=torch.int32)
    per_expert = torch.full((e,), -7, dtype=torch.int32)
    in_rank = torch.ones(n, r, dtype=torch.bool)
    topk = topk_idx.contiguous()
    rc = lib.emu_dispatch_layout(topk.data_ptr(), n, k, e, r, ranks_per_node if nodes else r,
                                 expert_to_rank.data_ptr(), per_rank.data_ptr(),
                                 per_node.data_ptr() if nodes else None, per_expert.data_ptr(), in_rank.data_ptr())
    assert rc == 0
    return per_rank, (per_node if nodes else None), per_expert, in_rank


@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("num_tokens,num_ranks,experts_per_rank,topk,ranks_per_node",
                         [(0, 4, 2, 2, 8), (1, 2, 1, 1, 8), (700, 8, 4, 6, 8), (333, 16, 2, 8, 4), (97, 4, 8, 3, 2)])
def test_layout_kernel_matches_the_reference(layout_lib, reverse, num_tokens, num_ranks, experts_per_rank, topk,
                                             ranks_per_node):
    gen = torch.Generator().manual_seed(num_tokens + num_ranks)
    e = num_ranks * experts_per_rank
    placements = [ExpertPlacement.contiguous(e, num_ranks),
                  ExpertPlacement.from_expert_to_rank(torch.randint(0, num_ranks, (e,), generator=gen), num_ranks)]
    layout_lib.ep_emu_set_schedule(reverse)
    try:
        for placement in placements:
            topk_idx = torch.randint(-1, e, (num_tokens, topk), generator=gen)  # -1: a dropped entry
            got = _kernel_layout(layout_lib, topk_idx, placement, ranks_per_node)
            want = compute_dispatch_layout(topk_idx, placement, ranks_per_node)
            assert torch.equal(got[0], want.num_tokens_per_rank)
            if want.num_tokens_per_rdma_rank is None:
                assert got[1] is None
            else:
                assert torch.equal(got[1], want.num_tokens_per_rdma_rank)
            assert torch.equal(got[2], want.num_tokens_per_expert)
            assert torch.equal(got[3], want.is_token_in_rank)
    finally:
        layout_lib.ep_emu_set_schedule(0)
