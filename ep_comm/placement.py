"""Expert placement: which rank owns each global expert (:class:`ExpertPlacement`, the map every
path routes by), and a planner that chooses a placement for ranks of unequal speed
(:func:`plan_placement`).

The planner's model: rank ``r`` processes its experts' tokens at relative speed ``capacity[r]``, so its
expected time is ``sum(load of its experts) / capacity[r]``. The planner minimises the largest
expected time (the step time of a synchronous MoE layer) with the longest-processing-time greedy
rule: experts in decreasing load order, each to the rank whose time after taking it is smallest,
among ranks with room left (``max_experts_per_rank``). Ties go to the lower rank, so the result
is deterministic. Feed it token counts per expert from recent steps (``num_tokens_per_expert``
summed over ranks) and pass the result as ``Buffer(..., expert_placement=...)``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """Where every global expert lives.

    Attributes:
        expert_to_rank: ``[E]`` int64, the owning rank of each global expert.
        expert_to_local: ``[E]`` int64, the expert's local id on its owner: its position among the
            owner's experts in ascending global order.
        num_ranks: ``R``.
        num_local_experts: ``[R]`` int64, how many experts each rank owns (zero allowed).
    """

    expert_to_rank: torch.Tensor
    expert_to_local: torch.Tensor
    num_ranks: int
    num_local_experts: torch.Tensor

    @functools.cached_property
    def local_expert_counts(self) -> tuple[int, ...]:
        """``num_local_experts`` as Python ints, one per rank (``num_ranks``; cached)."""
        return tuple(int(n) for n in self.num_local_experts.tolist())

    @property
    def num_experts(self) -> int:
        return int(self.expert_to_rank.numel())

    @staticmethod
    def contiguous(num_experts: int, num_ranks: int) -> "ExpertPlacement":
        """DeepEP's layout: rank ``r`` owns experts ``[r * E/R, (r + 1) * E/R)``."""
        if num_ranks <= 0:
            raise ValueError(f"num_ranks must be positive, got {num_ranks}")
        if num_experts <= 0 or num_experts % num_ranks != 0:
            raise ValueError(
                f"num_experts ({num_experts}) must be a positive multiple of the number of "
                f"ranks ({num_ranks})")
        per_rank = num_experts // num_ranks
        return ExpertPlacement.from_expert_to_rank(
            torch.arange(num_experts, dtype=torch.int64) // per_rank, num_ranks)

    @staticmethod
    def from_expert_to_rank(expert_to_rank: torch.Tensor, num_ranks: int) -> "ExpertPlacement":
        """Builds the placement from an ``[E]`` integer tensor of owning ranks."""
        if not isinstance(expert_to_rank, torch.Tensor) or expert_to_rank.dim() != 1:
            raise ValueError("expert_placement must be a 1-D integer tensor [num_experts] giving each expert "
                             "exactly one rank (replicated experts are not supported)")
        if expert_to_rank.dtype.is_floating_point or expert_to_rank.dtype == torch.bool:
            raise ValueError(f"expert_placement must be an integer tensor, got {expert_to_rank.dtype}")
        owners = expert_to_rank.detach().to("cpu", torch.int64)
        if owners.numel() == 0:
            raise ValueError("expert_placement must name at least one expert")
        if int(owners.min()) < 0 or int(owners.max()) >= num_ranks:
            raise ValueError(
                f"expert_placement entries must be ranks in [0, {num_ranks}), got range "
                f"[{int(owners.min())}, {int(owners.max())}]")
        num_local = torch.bincount(owners, minlength=num_ranks)
        # local id = number of earlier experts with the same owner
        order = torch.argsort(owners * owners.numel() + torch.arange(owners.numel()), stable=True)
        starts = torch.cumsum(num_local, 0) - num_local
        local = torch.empty_like(owners)
        local[order] = torch.arange(owners.numel()) - starts[owners[order]]
        placement = ExpertPlacement(owners, local, num_ranks, num_local)
        # computed here, on the CPU tensors: torch.compile's fake kernels read it and cannot read tensors
        _ = placement.local_expert_counts
        return placement

    def local_experts(self, rank: int) -> torch.Tensor:
        """``[num_local_experts[rank]]`` int64: the global ids that ``rank`` owns, ascending."""
        return torch.nonzero(self.expert_to_rank == rank).flatten()

    def to(self, device: torch.device | str) -> "ExpertPlacement":
        return ExpertPlacement(self.expert_to_rank.to(device), self.expert_to_local.to(device),
                               self.num_ranks, self.num_local_experts.to(device))


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
