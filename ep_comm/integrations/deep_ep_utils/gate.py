"""``deep_ep.utils.gate``: synthetic router scores with a chosen load imbalance, for DeepEP's tests.

The scores are ``[num_tokens, num_experts]`` float32 on the default device; a test takes their
top-k. Rank 0 (experts ``[0, num_experts / num_ranks)``) is the "hot" rank: it is chosen by about
``ratio`` times as many tokens as an average other rank. ``ratio = 1`` gives uniform random scores.

* :func:`get_random_unbalanced_scores` (``precise=False``): rank 0's experts draw their scores from
  ``U[0, factor)`` and the others from ``U[0, 1)``, with ``factor`` found by bisection so that the
  measured token ratio is ``ratio`` (approximately: it is a random draw).
* :func:`get_precise_unbalanced_scores` (``precise=True``): builds each token's set of destination
  ranks explicitly so that the ratio holds by construction, then gives the chosen experts scores in
  ``(0.9, 1]`` and all others scores in ``[0, 0.9)``. The distribution is artificial.
"""
from __future__ import annotations

import torch

__all__ = ["get_precise_unbalanced_scores", "get_random_unbalanced_scores", "get_scores_by_factor",
           "get_unbalanced_scores", "map_unbalanced_ratio_to_factor"]

_HIGH_SCORE_THRESHOLD = 0.9
_NUM_BISECTION_STEPS = 20


def _check(num_experts: int, num_ranks: int, num_topk: int, ratio: float) -> int:
    if num_ranks <= 0 or num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of num_ranks ({num_ranks})")
    if not 0 < num_topk <= num_experts:
        raise ValueError(f"num_topk must be in [1, {num_experts}], got {num_topk}")
    if ratio < 1.0:
        raise ValueError(f"ratio must be at least 1.0, got {ratio}")
    return num_experts // num_ranks


def get_scores_by_factor(num_tokens: int, num_experts: int, num_ranks: int, factor: float) -> torch.Tensor:
    """``[num_tokens, num_experts]`` float32: rank 0's experts ``U[0, factor)``, the others ``U[0, 1)``."""
    per_rank = num_experts // num_ranks
    scores = torch.rand(num_tokens, num_experts, dtype=torch.float32)
    scores[:, :per_rank] *= factor
    return scores


def _token_ratio(topk_idx: torch.Tensor, num_ranks: int, per_rank: int) -> float:
    """Tokens choosing rank 0 divided by the mean tokens choosing each other rank."""
    hits = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool, device=topk_idx.device)
    hits.scatter_(1, topk_idx // per_rank, True)
    counts = hits.sum(0).float()
    return float(counts[0]) / max(float(counts[1:].mean()), 1e-9)


def map_unbalanced_ratio_to_factor(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int,
                                   ratio: float) -> float:
    """The score factor (in ``[1, 100]``) for rank 0 that makes its token count ``ratio`` times the
    others' mean, by bisection on random draws (:func:`get_scores_by_factor`)."""
    per_rank = _check(num_experts, num_ranks, num_topk, ratio)
    low, high = 1.0, 100.0
    for _ in range(_NUM_BISECTION_STEPS):
        mid = (low + high) / 2
        topk_idx = get_scores_by_factor(num_tokens, num_experts, num_ranks, mid).topk(num_topk, dim=-1).indices
        if num_ranks > 1 and _token_ratio(topk_idx, num_ranks, per_rank) > ratio:
            high = mid
        else:
            low = mid
    return low


def get_random_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int,
                                 ratio: float) -> torch.Tensor:
    """Random scores whose top-k sends about ``ratio`` times the average traffic to rank 0."""
    _check(num_experts, num_ranks, num_topk, ratio)
    factor = 1.0 if ratio == 1.0 else map_unbalanced_ratio_to_factor(num_tokens, num_experts, num_ranks,
                                                                     num_topk, ratio)
    return get_scores_by_factor(num_tokens, num_experts, num_ranks, factor)


def _precise_rank_count(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int,
                        ratio: float) -> torch.Tensor:
    """``[num_tokens, num_ranks]`` int: how many of each token's top-k experts live on each rank.

    Every row sums to ``num_topk`` and no entry exceeds the experts per rank. The number of distinct
    ranks per token follows a uniform random top-k (capped so the target ratio is reachable); rank 0
    is then placed in ``ratio / (num_ranks - 1 + ratio)`` of all (token, rank) hits, the other hits
    going round-robin over a random order of the other ranks.
    """
    per_rank = num_experts // num_ranks
    if num_ranks == 1:
        return torch.full((num_tokens, 1), num_topk, dtype=torch.int32)
    num_normal = num_ranks - 1
    uniform = torch.rand(num_tokens, num_experts).topk(num_topk, dim=-1).indices // per_rank
    hits = torch.zeros(num_tokens, num_ranks, dtype=torch.bool)
    hits.scatter_(1, uniform, True)
    min_ranks = -(-num_topk // per_rank)  # enough ranks to hold num_topk distinct experts
    num_ranks_per_token = hits.sum(1).clamp(min=min_ranks, max=max(min_ranks, int(num_normal / ratio) + 1))
    num_ranks_per_token = num_ranks_per_token.clamp(max=num_ranks)

    total = int(num_ranks_per_token.sum())
    normal_share = int(total / (num_normal + ratio))
    num_special = min(total - normal_share * num_normal, int(normal_share * ratio) + 1)
    must = num_ranks_per_token == num_ranks  # tokens on every rank include rank 0
    may = num_ranks_per_token < num_ranks
    num_special = min(max(num_special, int(must.sum())), num_tokens)
    candidates = may.nonzero().flatten()
    candidates = candidates[torch.randperm(candidates.numel())][:num_special - int(must.sum())]
    special = must.clone()
    special[candidates] = True

    cycle = (torch.randperm(num_normal) + 1).tolist()
    counts = torch.zeros(num_tokens, num_ranks, dtype=torch.int32)
    cursor = 0
    for token in range(num_tokens):
        n = int(num_ranks_per_token[token])
        ranks = [0] if special[token] else []
        while len(ranks) < n:
            ranks.append(cycle[cursor % num_normal])
            cursor += 1
        for slot in range(num_topk):
            counts[token, ranks[slot % n]] += 1
    return counts[torch.randperm(num_tokens)]


def get_precise_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int,
                                  ratio: float) -> torch.Tensor:
    """Scores whose top-k sends exactly (up to rounding) ``ratio`` times the average traffic to rank 0.

    The chosen experts score in ``(0.9, 1]`` and all others in ``[0, 0.9)``, so ``topk`` recovers
    the constructed choice.
    """
    per_rank = _check(num_experts, num_ranks, num_topk, ratio)
    counts = _precise_rank_count(num_tokens, num_experts, num_ranks, num_topk, ratio)
    scores = torch.rand(num_tokens, num_experts, dtype=torch.float32) * _HIGH_SCORE_THRESHOLD
    # Within each rank take the `count` experts with the highest random key: a random subset.
    keys = torch.rand(num_tokens, num_ranks, per_rank)
    order = keys.argsort(dim=-1, descending=True).argsort(dim=-1)  # rank of each expert's key
    chosen = (order < counts.unsqueeze(-1)).view(num_tokens, num_experts)
    high = _HIGH_SCORE_THRESHOLD + 1e-6 + torch.rand(num_tokens, num_experts) * (1 - _HIGH_SCORE_THRESHOLD - 1e-6)
    return torch.where(chosen, high.float(), scores)


def get_unbalanced_scores(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float,
                          precise: bool) -> torch.Tensor:
    """:func:`get_precise_unbalanced_scores` if ``precise`` else :func:`get_random_unbalanced_scores`."""
    if precise:
        return get_precise_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio)
    return get_random_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio)
