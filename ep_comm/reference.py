"""A plain single-process simulation of every rank: the reference the tests and ``ep-bench
--check`` compare against. Written for clarity with explicit loops, not for speed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .placement_map import ExpertPlacement


@dataclass
class RankReceive:
    """What one rank receives in a normal dispatch.

    Attributes:
        x: ``[M, H]``; topk_idx: ``[M, K]`` int64 local ids; topk_weights: ``[M, K]``;
        sources: ``M`` pairs ``(source rank, source token)``; counts_per_expert: ``[L]`` ints.
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    sources: list[tuple[int, int]]
    counts_per_expert: list[int]


def dispatch(xs: list[torch.Tensor], topk_idxs: list[torch.Tensor], topk_weights: list[torch.Tensor],
             placement: ExpertPlacement) -> list[RankReceive]:
    """Normal dispatch of every rank's ``x [N_r, H]`` / ``topk_idx [N_r, K]`` / weights."""
    num_ranks = placement.num_ranks
    owner = placement.expert_to_rank.tolist()
    local = placement.expert_to_local.tolist()
    out = []
    for dst in range(num_ranks):
        rows, idx_rows, w_rows, sources = [], [], [], []
        num_local = int(placement.num_local_experts[dst])
        counts = [0] * num_local
        for src in range(num_ranks):
            for t in range(xs[src].shape[0]):
                experts = topk_idxs[src][t].tolist()
                if not any(e >= 0 and owner[e] == dst for e in experts):
                    continue
                ids = [local[e] if e >= 0 and owner[e] == dst else -1 for e in experts]
                ws = [float(topk_weights[src][t, k]) if ids[k] >= 0 else 0.0 for k in range(len(ids))]
                for i in ids:
                    if i >= 0:
                        counts[i] += 1
                rows.append(xs[src][t])
                idx_rows.append(ids)
                w_rows.append(ws)
                sources.append((src, t))
        hidden, k = xs[0].shape[1], topk_idxs[0].shape[1]
        x = torch.stack(rows) if rows else torch.empty(0, hidden, dtype=xs[0].dtype)
        out.append(RankReceive(x, torch.tensor(idx_rows, dtype=torch.int64).reshape(-1, k),
                               torch.tensor(w_rows, dtype=torch.float32).reshape(-1, k), sources, counts))
    return out


def combine(expert_outputs: list[torch.Tensor], receives: list[RankReceive],
            num_tokens: list[int]) -> list[torch.Tensor]:
    """Sums each rank's returned rows per source token, ranks in ascending order, in float32."""
    hidden = expert_outputs[0].shape[1]
    acc = [torch.zeros(n, hidden, dtype=torch.float32) for n in num_tokens]
    for dst, receive in enumerate(receives):
        for row, (src, t) in enumerate(receive.sources):
            acc[src][t] += expert_outputs[dst][row].float()
    return [a.to(expert_outputs[0].dtype) for a in acc]


@dataclass
class RankLowLatencyReceive:
    """One rank's low-latency receive: ``x [L, R*T, H]``, ``count [L]``, and for each expert the
    ``(source rank, source token)`` of each filled slot."""

    x: torch.Tensor
    count: list[int]
    slots: list[list[tuple[int, int]]]


def low_latency_dispatch(xs: list[torch.Tensor], topk_idxs: list[torch.Tensor], max_tokens: int,
                         placement: ExpertPlacement) -> list[RankLowLatencyReceive]:
    """Low-latency dispatch (bf16 payload): slots grouped by source rank, tokens ascending."""
    num_ranks = placement.num_ranks
    owner = placement.expert_to_rank.tolist()
    local = placement.expert_to_local.tolist()
    hidden = xs[0].shape[1]
    out = []
    for dst in range(num_ranks):
        num_local = int(placement.num_local_experts[dst])
        x = torch.zeros(num_local, num_ranks * max_tokens, hidden, dtype=xs[0].dtype)
        slots: list[list[tuple[int, int]]] = [[] for _ in range(num_local)]
        for src in range(num_ranks):
            for t in range(xs[src].shape[0]):
                for e in topk_idxs[src][t].tolist():
                    if e >= 0 and owner[e] == dst:
                        j = local[e]
                        x[j, len(slots[j])] = xs[src][t]
                        slots[j].append((src, t))
        out.append(RankLowLatencyReceive(x, [len(s) for s in slots], slots))
    return out


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
