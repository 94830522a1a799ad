"""Routing -> dispatch layout: token counts per rank and expert, and which ranks get each token.

This is the reference definition; kernels may fuse it but never redefine it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .placement import ExpertPlacement

NUM_MAX_NVL_PEERS = 8
"""Ranks per node assumed when counting tokens per RDMA rank (node)."""


@dataclass(frozen=True)
class DispatchLayout:
    """What ``Buffer.get_dispatch_layout`` returns, as a typed record.

    Attributes:
        num_tokens_per_rank: ``[R]`` int32, tokens this rank sends to each rank (once per rank).
        num_tokens_per_rdma_rank: ``[R / ranks_per_node]`` int32, tokens sent to each node, or
            ``None`` when the group fits in one node.
        num_tokens_per_expert: ``[E]`` int32, top-k entries that select each expert.
        is_token_in_rank: ``[N, R]`` bool, whether token ``i`` goes to rank ``r``.
    """

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_rdma_rank: torch.Tensor | None
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor


def token_rank_mask(topk_idx: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """``[N, R]`` bool: token ``i`` has at least one expert on rank ``r``.

    Args:
        topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none.
    """
    num_tokens = topk_idx.shape[0]
    valid = topk_idx >= 0
    owner = placement.expert_to_rank.to(topk_idx.device)[topk_idx.clamp(min=0)]
    mask = torch.zeros(num_tokens, placement.num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    # invalid entries are parked in an extra column that is dropped afterwards
    owner = torch.where(valid, owner, torch.full_like(owner, placement.num_ranks))
    mask.scatter_(1, owner, True)
    return mask[:, : placement.num_ranks].contiguous()


def compute_dispatch_layout(topk_idx: torch.Tensor, placement: ExpertPlacement,
                            ranks_per_node: int = NUM_MAX_NVL_PEERS) -> DispatchLayout:
    """Computes the layout of one rank's tokens.

    Args:
        topk_idx: ``[N, K]`` int64 global expert ids in ``[-1, E)``.
        placement: the expert -> rank map.
        ranks_per_node: ranks sharing a node; ``num_tokens_per_rdma_rank`` is ``None`` when the
            whole group fits in one node.
    """
    is_token_in_rank = token_rank_mask(topk_idx, placement)
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    valid = topk_idx[topk_idx >= 0]
    num_tokens_per_expert = torch.bincount(valid, minlength=placement.num_experts).to(torch.int32)
    num_ranks = placement.num_ranks
    num_tokens_per_rdma_rank = None
    if num_ranks > ranks_per_node and num_ranks % ranks_per_node == 0:
        num_tokens_per_rdma_rank = token_node_mask(is_token_in_rank, ranks_per_node).sum(0, dtype=torch.int32)
    return DispatchLayout(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                          is_token_in_rank)


def token_node_mask(is_token_in_rank: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """``[N, R / ranks_per_node]`` bool: token ``i`` goes to at least one rank of node ``g``.

    Nodes are blocks of ``ranks_per_node`` consecutive ranks.

    Args:
        is_token_in_rank: ``[N, R]`` bool; ``R`` must be a multiple of ``ranks_per_node``.
    """
    num_tokens, num_ranks = is_token_in_rank.shape
    return is_token_in_rank.reshape(num_tokens, num_ranks // ranks_per_node, ranks_per_node).any(2)


def localize_rows(topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, row_rank: torch.Tensor,
                  placement: ExpertPlacement) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`localize_topk` with a destination rank per row (rows bound for several ranks).

    Args:
        topk_idx: ``[S, K]`` int64 global ids. topk_weights: ``[S, K]`` float or None.
        row_rank: ``[S]`` int64, the rank each row goes to.
    Returns:
        ``([S, K]`` int64 local ids on the row's rank, ``-1`` elsewhere; ``[S, K]`` weights with
        ``0`` elsewhere, or None).
    """
    safe = topk_idx.clamp(min=0)
    owner = placement.expert_to_rank.to(safe.device)[safe]
    here = (topk_idx >= 0) & (owner == row_rank.unsqueeze(1))
    local = placement.expert_to_local.to(safe.device)[safe]
    local_idx = torch.where(here, local, torch.full_like(local, -1))
    local_w = None
    if topk_weights is not None:
        local_w = torch.where(here, topk_weights, torch.zeros_like(topk_weights))
    return local_idx, local_w


def localize_topk(topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, rank: int,
                  placement: ExpertPlacement) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Renumbers global expert ids to ``rank``'s local ids; ``-1`` (and weight 0) elsewhere.

    Args:
        topk_idx: ``[M, K]`` int64 global ids. topk_weights: ``[M, K]`` float32 or None.
    Returns:
        ``([M, K]`` int64 local ids, ``[M, K]`` float32 weights or None).
    """
    owner_map = placement.expert_to_rank.to(topk_idx.device)
    local_map = placement.expert_to_local.to(topk_idx.device)
    safe = topk_idx.clamp(min=0)
    here = (topk_idx >= 0) & (owner_map[safe] == rank)
    local_idx = torch.where(here, local_map[safe], torch.full_like(topk_idx, -1))
    local_w = None
    if topk_weights is not None:
        local_w = torch.where(here, topk_weights, torch.zeros_like(topk_weights))
    return local_idx, local_w


def count_per_local_expert(local_topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """``[num_local_experts]`` int64: received tokens per local expert (entries ``>= 0``)."""
    valid = local_topk_idx[local_topk_idx >= 0]
    return torch.bincount(valid, minlength=num_local_experts)[:num_local_experts]


def align_up(values: list[int], alignment: int) -> list[int]:
    """Rounds every count up to a multiple of ``alignment``."""
    return [(v + alignment - 1) // alignment * alignment for v in values]


def drop_entries_of_ranks(topk_idx: torch.Tensor, placement: ExpertPlacement,
                          ranks: frozenset[int] | set[int]) -> tuple[torch.Tensor, int]:
    """``topk_idx`` with every entry whose expert lives on one of ``ranks`` set to ``-1`` (the
    input itself when ``ranks`` is empty), and how many entries were dropped."""
    if not ranks:
        return topk_idx, 0
    dead = torch.zeros(placement.num_ranks, dtype=torch.bool)
    dead[list(ranks)] = True
    owner = placement.expert_to_rank.to(topk_idx.device)[topk_idx.clamp(min=0)]
    drop = (topk_idx >= 0) & dead.to(topk_idx.device)[owner]
    return torch.where(drop, torch.full_like(topk_idx, -1), topk_idx), int(drop.sum())
