"""Synthetic router outputs: which K experts each token picks, and with what weight.

- ``uniform``: every set of K distinct experts is equally likely (DeepEP's benchmark).
- ``zipf``: expert ``e`` has popularity ``1 / (rank(e) + 1) ** s`` (its rank in a random order
  shared by all ranks); K distinct experts are drawn by that popularity (Gumbel top-k), so a few
  experts, and their owner ranks, receive far more tokens.
- ``group-limited``: DeepSeek-V3's router. Scores ``sigmoid(logit)``; the experts form
  ``num_groups`` contiguous groups, a group scores the sum of its two best experts, each token keeps
  its ``topk_groups`` best groups and takes its top K experts inside them. With contiguous expert
  placement a group lives on one rank (or one node), so this bounds the ranks a token reaches.

Weights are the chosen experts' scores normalised to sum to 1 (float32). Everything is a function
of ``(seed, rank)``, so every rank can regenerate any other rank's inputs.
"""
from __future__ import annotations

import torch

from .config import BenchConfig


def _generator(seed: int, rank: int, stream: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + rank) * 7 + stream)
    return g


def uniform_routing(num_tokens: int, num_experts: int, topk: int,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, K]`` int64 distinct experts, ``[N, K]`` float32 weights), experts uniform."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    vals, idx = scores.topk(topk, dim=1)
    return idx, _normalise(vals)


def zipf_routing(num_tokens: int, num_experts: int, topk: int, s: float, gen: torch.Generator,
                 popularity_gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K distinct experts per token drawn by Zipf popularity (Gumbel top-k sampling).

    ``popularity_gen`` must be seeded identically on every rank: it fixes which experts are hot.
    """
    order = torch.randperm(num_experts, generator=popularity_gen)
    log_p = torch.empty(num_experts)
    log_p[order] = -s * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float32))
    u = torch.rand(num_tokens, num_experts, generator=gen).clamp_(1e-12, 1 - 1e-7)
    gumbel = -torch.log(-torch.log(u))
    _, idx = (log_p + gumbel).topk(topk, dim=1)
    weights = torch.rand(num_tokens, topk, generator=gen) + 0.1
    return idx, _normalise(weights)


def group_limited_routing(num_tokens: int, num_experts: int, topk: int, num_groups: int,
                          topk_groups: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's node-limited top-k: top K experts within each token's best ``topk_groups``."""
    scores = torch.sigmoid(torch.randn(num_tokens, num_experts, generator=gen))
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    best = min(2, grouped.shape[2])
    group_score = grouped.topk(best, dim=2).values.sum(2)  # [N, G]
    keep_groups = group_score.topk(topk_groups, dim=1).indices
    mask = torch.zeros(num_tokens, num_groups, dtype=torch.bool)
    mask.scatter_(1, keep_groups, True)
    expert_mask = mask.repeat_interleave(num_experts // num_groups, dim=1)
    masked = scores.masked_fill(~expert_mask, -1.0)
    vals, idx = masked.topk(topk, dim=1)
    return idx, _normalise(vals)


def _normalise(vals: torch.Tensor) -> torch.Tensor:
    vals = vals.to(torch.float32)
    return (vals / vals.sum(1, keepdim=True)).contiguous()


def make_routing(cfg: BenchConfig, rank: int, num_tokens: int | None = None,
                 num_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(topk_idx [N, K] int64, topk_weights [N, K] float32)`` under ``cfg``."""
    n = cfg.tokens if num_tokens is None else num_tokens
    e = cfg.experts if num_experts is None else num_experts
    gen = _generator(cfg.seed, rank, 1)
    if cfg.routing == "uniform":
        return uniform_routing(n, e, cfg.topk, gen)
    if cfg.routing == "zipf":
        return zipf_routing(n, e, cfg.topk, cfg.zipf_s, gen, _generator(cfg.seed, -1, 2))
    if cfg.routing == "group-limited":
        return group_limited_routing(n, e, cfg.topk, cfg.num_groups, cfg.topk_groups, gen)
    raise ValueError(f"unknown routing {cfg.routing!r}")


def make_tokens(cfg: BenchConfig, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``[N, H]`` bf16 activations, standard normal."""
    gen = _generator(cfg.seed, rank, 0)
    return torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(torch.bfloat16)
