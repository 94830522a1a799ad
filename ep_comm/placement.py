"""Expert placement planner: which rank should own each expert, given unequal ranks.

Model: rank ``r`` processes its experts' tokens at relative speed ``capacity[r]``, so its
expected time is ``sum(load of its experts) / capacity[r]``. The planner minimises the largest
expected time (the step time of a synchronous MoE layer) with the longest-processing-time greedy
rule: experts in decreasing load order, each to the rank whose time after taking it is smallest,
among ranks with room left (``max_experts_per_rank``). Ties go to the lower rank, so the result
is deterministic. Feed it token counts per expert from recent steps (``num_tokens_per_expert``
summed over ranks) and pass the result as ``Buffer(..., expert_placement=...)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PlacementPlan:
    """A planned placement.

    Attributes:
        expert_to_rank: ``[E]`` int64, the owner of each expert.
        expected_time: ``[R]`` float64, each rank's load divided by its capacity.
        load_per_rank: ``[R]`` float64, tokens each rank is expected to process.
    """

    expert_to_rank: torch.Tensor
    expected_time: torch.Tensor
    load_per_rank: torch.Tensor

    @property
    def imbalance(self) -> float:
        """max / mean expected time (1.0 = perfectly balanced)."""
        mean = float(self.expected_time.mean())
        return float(self.expected_time.max()) / mean if mean > 0 else 1.0


def plan_placement(expert_load: torch.Tensor, rank_capacity: torch.Tensor,
                   max_experts_per_rank: torch.Tensor | int | None = None) -> PlacementPlan:
    """Plans a placement.

    Args:
        expert_load: ``[E]`` non-negative (token counts or rates) per expert.
        rank_capacity: ``[R]`` positive relative throughput per rank (0 = takes no experts).
        max_experts_per_rank: an int or ``[R]`` ints, the experts each rank has memory for
            (default: no limit).
    """
    load = _vector("expert_load", expert_load).double()
    capacity = _vector("rank_capacity", rank_capacity).double()
    if bool((load < 0).any()) or not bool(torch.isfinite(load).all()):
        raise ValueError("expert_load must be finite and non-negative")
    if bool((capacity < 0).any()) or not bool((capacity > 0).any()):
        raise ValueError("rank_capacity must be non-negative with at least one positive entry")
    num_ranks, num_experts = capacity.numel(), load.numel()
    if max_experts_per_rank is None:
        room = torch.full((num_ranks,), num_experts, dtype=torch.int64)
    elif isinstance(max_experts_per_rank, int):
        room = torch.full((num_ranks,), max_experts_per_rank, dtype=torch.int64)
    else:
        room = _vector("max_experts_per_rank", max_experts_per_rank).to(torch.int64).clone()
        if room.numel() != num_ranks:
            raise ValueError(f"max_experts_per_rank has {room.numel()} entries, rank_capacity {num_ranks}")
    room = torch.where(capacity > 0, room, torch.zeros_like(room))
    if int(room.sum()) < num_experts:
        raise ValueError(f"max_experts_per_rank leaves room for {int(room.sum())} experts, need {num_experts}")
    owner = torch.empty(num_experts, dtype=torch.int64)
    rank_load = torch.zeros(num_ranks, dtype=torch.float64)
    order = sorted(range(num_experts), key=lambda e: (-float(load[e]), e))
    for e in order:
        finish = torch.where((room > 0) & (capacity > 0), (rank_load + load[e]) / capacity.clamp(min=1e-30),
                             torch.full_like(rank_load, float("inf")))
        # equal finish times: prefer the rank with more capacity left, then the lower rank
        best = min(range(num_ranks), key=lambda r: (float(finish[r]), -float(capacity[r]), r))
        owner[e] = best
        rank_load[best] += load[e]
        room[best] -= 1
    expected = torch.where(capacity > 0, rank_load / capacity.clamp(min=1e-30), torch.zeros_like(rank_load))
    return PlacementPlan(owner, expected, rank_load)


def _vector(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if value.dim() != 1 or value.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(value.shape)}")
    return value
