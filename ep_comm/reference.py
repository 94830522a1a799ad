"""What every rank should receive and combine, computed in one process from the definitions of
docs/design.md §1: the reference the tests (CPU and GPU) and ``ep-bench --check`` compare against.

It reads only the expert placement, never ep_comm's layout/plan code (which it checks), and it is
written for clarity: whole-tensor selections per (source, destination) pair, no fused tricks.
Every function takes every rank's inputs (``xs[r]``, ``topk_idxs[r]``, ... for rank ``r``) on the
CPU; the ``*_to(rank, ...)`` forms compute a single receiver's share.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .placement import ExpertPlacement


def owned_by(topk_idx: torch.Tensor, rank: int, placement: ExpertPlacement) -> torch.Tensor:
    """``[N, K]`` bool: entry ``(i, k)`` names an expert of ``rank`` (``-1`` names none)."""
    return (topk_idx >= 0) & (placement.expert_to_rank[topk_idx.clamp(min=0)] == rank)


def receiving_ranks(topk_idx: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """``[N, R]`` bool: the ranks token ``i`` is dispatched to (each once, however many of its
    experts a rank holds)."""
    return torch.stack([owned_by(topk_idx, r, placement).any(1) for r in range(placement.num_ranks)], dim=1)


@dataclass
class RankReceive:
    """What one rank receives in a normal dispatch.

    Attributes:
        x: ``[M, H]``; topk_idx: ``[M, K]`` int64 local ids; topk_weights: ``[M, K]`` float32;
        sources: ``M`` pairs ``(source rank, source token)``; counts_per_expert: ``[L]`` ints.
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    sources: list[tuple[int, int]]
    counts_per_expert: list[int]

    @property
    def src_idx(self) -> torch.Tensor:
        """``[M]`` int64: each row's token index on its source rank (DeepEP's ``recv_src_idx``)."""
        return torch.tensor([t for _, t in self.sources], dtype=torch.int64)

    @property
    def src_rank(self) -> torch.Tensor:
        """``[M]`` int64: each row's source rank."""
        return torch.tensor([s for s, _ in self.sources], dtype=torch.int64)


def dispatch_to(rank: int, xs: list[torch.Tensor], topk_idxs: list[torch.Tensor],
                topk_weights: list[torch.Tensor], placement: ExpertPlacement) -> RankReceive:
    """Normal dispatch seen by ``rank``: every token with an expert on ``rank``, once, by source
    rank then source token; its top-k ids renumbered to ``rank``'s local ids (``-1`` and weight 0
    for experts elsewhere)."""
    rows, idx_rows, w_rows, sources = [], [], [], []
    for src, (x, idx, w) in enumerate(zip(xs, topk_idxs, topk_weights)):
        here = owned_by(idx, rank, placement)
        tokens = here.any(1).nonzero().flatten()
        here = here[tokens]
        local = placement.expert_to_local[idx[tokens].clamp(min=0)]
        rows.append(x[tokens])
        idx_rows.append(torch.where(here, local, torch.full_like(local, -1)))
        w_rows.append(torch.where(here, w[tokens].float(), torch.zeros(())))
        sources += [(src, int(t)) for t in tokens]
    recv_idx = torch.cat(idx_rows).to(torch.int64)
    counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=int(placement.num_local_experts[rank]))
    return RankReceive(torch.cat(rows), recv_idx, torch.cat(w_rows), sources, counts.tolist())


def dispatch(xs: list[torch.Tensor], topk_idxs: list[torch.Tensor], topk_weights: list[torch.Tensor],
             placement: ExpertPlacement) -> list[RankReceive]:
    """Normal dispatch of every rank's ``x [N_r, H]`` / ``topk_idx [N_r, K]`` / weights: what each
    rank receives (:func:`dispatch_to`)."""
    return [dispatch_to(r, xs, topk_idxs, topk_weights, placement) for r in range(placement.num_ranks)]


def combine(expert_outputs: list[torch.Tensor], receives: list[RankReceive],
            num_tokens: list[int]) -> list[torch.Tensor]:
    """Sums each rank's returned rows (``expert_outputs[r]``, one per row of ``receives[r]``) per
    source token, ranks in ascending order, in float32; the result in the outputs' dtype. A token
    that went nowhere combines to zeros."""
    hidden = expert_outputs[0].shape[1]
    acc = [torch.zeros(n, hidden, dtype=torch.float32) for n in num_tokens]
    for y, receive in zip(expert_outputs, receives):
        src_rank, src_idx = receive.src_rank, receive.src_idx
        for src, out in enumerate(acc):
            rows = (src_rank == src).nonzero().flatten()
            out.index_add_(0, src_idx[rows], y[rows].float())
    return [a.to(expert_outputs[0].dtype) for a in acc]


@dataclass
class RankLowLatencyReceive:
    """One rank's low-latency receive: ``x [L, R*T, H]``, ``count [L]``, and for each expert the
    ``(source rank, source token)`` of each filled slot."""

    x: torch.Tensor
    count: list[int]
    slots: list[list[tuple[int, int]]]

    def layout_range(self, num_ranks: int) -> torch.Tensor:
        """``[L, R, 2]`` int64: for each local expert and source rank, the first slot of that
        source's rows and their number (the kernels' ``layout_range``)."""
        out = torch.zeros(len(self.slots), num_ranks, 2, dtype=torch.int64)
        for j, slots in enumerate(self.slots):
            for src, _ in slots:
                out[j, src, 1] += 1
            out[j, 1:, 0] = torch.cumsum(out[j, :, 1], 0)[:-1]
        return out


def expert_slots(expert: int, topk_idxs: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The ``(source rank, source token)`` in each low-latency slot of global expert ``expert``:
    one slot per top-k entry naming it, by source rank, then token."""
    return [(src, int(t)) for src, idx in enumerate(topk_idxs) for t, _ in (idx == expert).nonzero().tolist()]


def expert_slots_to(rank: int, topk_idxs: list[torch.Tensor], placement: ExpertPlacement
                    ) -> list[list[tuple[int, int]]]:
    """:func:`expert_slots` of each local expert of ``rank``, by local id."""
    return [expert_slots(e, topk_idxs) for e in placement.local_experts(rank).tolist()]


def low_latency_dispatch_to(rank: int, xs: list[torch.Tensor], topk_idxs: list[torch.Tensor], max_tokens: int,
                            placement: ExpertPlacement) -> RankLowLatencyReceive:
    """Low-latency dispatch (bf16 payload) seen by ``rank`` (:func:`expert_slots_to`); slots past
    each expert's count hold zeros."""
    slots = expert_slots_to(rank, topk_idxs, placement)
    x = torch.zeros(len(slots), placement.num_ranks * max_tokens, xs[0].shape[1], dtype=xs[0].dtype)
    for j, expert_slots in enumerate(slots):
        for slot, (src, t) in enumerate(expert_slots):
            x[j, slot] = xs[src][t]
    return RankLowLatencyReceive(x, [len(s) for s in slots], slots)


def low_latency_dispatch(xs: list[torch.Tensor], topk_idxs: list[torch.Tensor], max_tokens: int,
                         placement: ExpertPlacement) -> list[RankLowLatencyReceive]:
    """Low-latency dispatch (bf16 payload) of every rank (:func:`low_latency_dispatch_to`)."""
    return [low_latency_dispatch_to(r, xs, topk_idxs, max_tokens, placement) for r in range(placement.num_ranks)]


def low_latency_combine(expert_outputs: list[torch.Tensor], receives: list[RankLowLatencyReceive],
                        topk_idxs: list[torch.Tensor], topk_weights: list[torch.Tensor],
                        placement: ExpertPlacement) -> list[torch.Tensor]:
    """``out[i] = sum_k w[i, k] * y[expert k][slot of i]`` in float32, k ascending."""
    owner = placement.expert_to_rank.tolist()
    local = placement.expert_to_local.tolist()
    hidden = expert_outputs[0].shape[2]
    results = []
    for src in range(placement.num_ranks):
        n, k_max = topk_idxs[src].shape
        acc = torch.zeros(n, hidden, dtype=torch.float32)
        for t in range(n):
            for k in range(k_max):
                e = int(topk_idxs[src][t, k])
                if e < 0:
                    continue
                dst, j = owner[e], local[e]
                slot = receives[dst].slots[j].index((src, t))
                acc[t] += float(topk_weights[src][t, k]) * expert_outputs[dst][j, slot].float()
        results.append(acc.to(expert_outputs[0].dtype))
    return results
