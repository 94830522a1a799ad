"""Reference results for the GPU tests, from the routing maths in ep_comm.layout / ep_comm.plan."""
from __future__ import annotations

import torch

from ep_comm.layout import compute_dispatch_layout, count_per_local_expert, localize_topk
from ep_comm.placement_map import ExpertPlacement
from ep_comm.plan import build_expert_slot_plan, build_send_plan


def random_routing(gen: torch.Generator, num_tokens: int, num_topk: int, num_experts: int
                   ) -> torch.Tensor:
    """``[N, K]`` distinct experts per row, about 10% of entries ``-1``."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    topk = scores.topk(num_topk, dim=1).indices
    topk[torch.rand(num_tokens, num_topk, generator=gen) < 0.1] = -1
    return topk


def normal_dispatch(xs: list[torch.Tensor], topks: list[torch.Tensor], weights: list[torch.Tensor],
                    placement: ExpertPlacement) -> list[dict]:
    """What every receiver gets: rows by source rank, then source token."""
    num_ranks = len(xs)
    plans = [build_send_plan(compute_dispatch_layout(t, placement).is_token_in_rank) for t in topks]
    out = []
    for r in range(num_ranks):
        rows_x, rows_t, rows_w, rows_src = [], [], [], []
        for s in range(num_ranks):
            start = int(plans[s].send_counts[:r].sum())
            tokens = plans[s].token_index[start:start + int(plans[s].send_counts[r])]
            rows_x.append(xs[s][tokens])
            rows_t.append(topks[s][tokens])
            rows_w.append(weights[s][tokens])
            rows_src.append(tokens)
        local, local_w = localize_topk(torch.cat(rows_t), torch.cat(rows_w), r, placement)
        counts = count_per_local_expert(local, int(placement.num_local_experts[r]))
        out.append({"recv_x": torch.cat(rows_x), "recv_topk_idx": local, "recv_topk_weights": local_w,
                    "recv_src_idx": torch.cat(rows_src), "counts": counts.tolist()})
    return out


def normal_combine(ys: list[torch.Tensor], topks: list[torch.Tensor], placement: ExpertPlacement
                   ) -> list[torch.Tensor]:
    """combined_s[i] = sum over ranks r that received token i of ys[r][row of i] (float32)."""
    num_ranks = len(ys)
    masks = [compute_dispatch_layout(t, placement).is_token_in_rank for t in topks]
    plans = [build_send_plan(m) for m in masks]
    offsets = [0] * num_ranks
    out = [torch.zeros(t.shape[0], ys[0].shape[1], dtype=torch.float32) for t in topks]
    for r in range(num_ranks):
        at = 0
        for s in range(num_ranks):
            start = int(plans[s].send_counts[:r].sum())
            tokens = plans[s].token_index[start:start + int(plans[s].send_counts[r])]
            out[s].index_add_(0, tokens, ys[r][at:at + len(tokens)].float())
            at += len(tokens)
        offsets[r] = at
    return out


def low_latency_slots(topks: list[torch.Tensor], placement: ExpertPlacement, receiver: int):
    """``(slot plan, row -> (src, token))`` for ``receiver`` (plan.build_expert_slot_plan)."""
    rows, src_token, per_rank = [], [], []
    for s, topk in enumerate(topks):
        mask = compute_dispatch_layout(topk, placement).is_token_in_rank[:, receiver]
        tokens = torch.nonzero(mask).flatten()
        rows.append(localize_topk(topk[tokens], None, receiver, placement)[0])
        src_token += [(s, int(t)) for t in tokens]
        per_rank.append(len(tokens))
    plan = build_expert_slot_plan(torch.cat(rows), torch.tensor(per_rank),
                                  int(placement.num_local_experts[receiver]))
    return plan, src_token
