"""Inputs shared by multi-rank tests: deterministic per-rank random routings and payloads."""
from __future__ import annotations

import torch


def random_routing(gen: torch.Generator, num_tokens: int, num_topk: int, num_experts: int,
                   drop_prob: float = 0.1) -> torch.Tensor:
    """``topk_idx [N, K]`` int64 from ``gen``: distinct experts per token, each entry ``-1`` with
    probability ``drop_prob``."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    topk_idx = scores.topk(num_topk, dim=1).indices
    return topk_idx.masked_fill(torch.rand(topk_idx.shape, generator=gen) < drop_prob, -1)


def make_routing(rank: int, seed: int, num_tokens: int, num_experts: int, topk: int,
                 drop_prob: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_idx [N, K]`` int64 (distinct experts per token, some ``-1``) and ``weights [N, K]``
    float32 for ``rank``; the same (rank, seed) always gives the same tensors."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    topk_idx = random_routing(g, num_tokens, min(topk, num_experts), num_experts, drop_prob)
    weights = torch.rand(topk_idx.shape, generator=g).to(torch.float32)
    return topk_idx, weights


def make_x(rank: int, seed: int, num_tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    return torch.randn(num_tokens, hidden, generator=g).to(dtype)
