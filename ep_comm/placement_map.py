"""Expert -> rank maps: which rank owns each global expert, and its local id there."""
from __future__ import annotations

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
        return ExpertPlacement(owners, local, num_ranks, num_local)

    def local_experts(self, rank: int) -> torch.Tensor:
        """``[num_local_experts[rank]]`` int64: the global ids that ``rank`` owns, ascending."""
        return torch.nonzero(self.expert_to_rank == rank).flatten()

    def to(self, device: torch.device | str) -> "ExpertPlacement":
        return ExpertPlacement(self.expert_to_rank.to(device), self.expert_to_local.to(device),
                               self.num_ranks, self.num_local_experts.to(device))
