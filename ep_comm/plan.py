"""Layout -> send/receive plan: which rows go where, in which order. Shared by every backend.

Ordering contract: a rank sends its rows grouped by destination rank, and within a destination by
source token index; so every receiver sees its rows ordered by source rank, then source token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .placement_map import ExpertPlacement


@dataclass(frozen=True)
class SendPlan:
    """The rows one rank sends in a normal-mode dispatch.

    Attributes:
        token_index: ``[S]`` int64, the source token of each sent row, grouped by destination rank
            and ascending within each group. ``S = send_counts.sum()``.
        send_counts: ``[R]`` int64, rows sent to each rank.
    """

    token_index: torch.Tensor
    send_counts: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.token_index.numel())

    def splits(self) -> list[int]:
        return [int(c) for c in self.send_counts.tolist()]


def build_send_plan(is_token_in_rank: torch.Tensor) -> SendPlan:
    """Builds the send plan from ``is_token_in_rank`` (``[N, R]`` bool)."""
    rank_then_token = torch.nonzero(is_token_in_rank.t())  # rows sorted by (rank, token)
    token_index = rank_then_token[:, 1].contiguous()
    send_counts = is_token_in_rank.sum(0, dtype=torch.int64)
    return SendPlan(token_index, send_counts)


@dataclass(frozen=True)
class ExpertSlotPlan:
    """Low-latency mode: where each received (row, local expert) pair lands.

    Received rows are the tokens that every source rank sent here, ordered by source rank then
    token; each row is copied into the slot of every local expert it selected.

    Attributes:
        row: ``[P]`` int64, received row of each pair.
        local_expert: ``[P]`` int64, local expert of each pair.
        slot: ``[P]`` int64, row of the pair inside ``recv_x[local_expert]``.
        recv_count: ``[L]`` int64, pairs per local expert.
        layout_range: ``[L, R, 2]`` int64, (first slot, count) of each source rank's rows in each
            local expert's block.
    Pairs are ordered by (source row, k), the order the combine returns them in.
    """

    row: torch.Tensor
    local_expert: torch.Tensor
    slot: torch.Tensor
    recv_count: torch.Tensor
    layout_range: torch.Tensor


def build_expert_slot_plan(recv_local_topk: torch.Tensor, recv_rows_per_rank: torch.Tensor,
                           num_local_experts: int) -> ExpertSlotPlan:
    """Packs received rows into per-expert slots, grouped by source rank.

    Args:
        recv_local_topk: ``[M, K]`` int64 local expert ids of the received rows, ``-1`` elsewhere.
        recv_rows_per_rank: ``[R]`` int64, received rows from each source rank.
        num_local_experts: ``L``.
    """
    num_rows, _ = recv_local_topk.shape
    num_ranks = recv_rows_per_rank.numel()
    device = recv_local_topk.device
    pair_row, pair_k = torch.nonzero(recv_local_topk >= 0, as_tuple=True)
    pair_expert = recv_local_topk[pair_row, pair_k]
    row_rank = torch.repeat_interleave(torch.arange(num_ranks, device=device), recv_rows_per_rank,
                                       output_size=num_rows)
    pair_rank = row_rank[pair_row]
    # slot = rank of the pair among pairs of the same expert, ordered by (row, k) -> grouped by
    # source rank since rows are grouped by source rank
    key = pair_expert * max(len(pair_row), 1) + torch.arange(len(pair_row), device=device)
    order = torch.argsort(key, stable=True)
    recv_count = torch.bincount(pair_expert, minlength=num_local_experts)[:num_local_experts]
    starts = torch.cumsum(recv_count, 0) - recv_count
    slot = torch.empty_like(pair_row)
    slot[order] = torch.arange(len(pair_row), device=device) - starts[pair_expert[order]]
    per_expert_rank = torch.zeros(num_local_experts * num_ranks, dtype=torch.int64, device=device)
    per_expert_rank.index_add_(0, pair_expert * num_ranks + pair_rank,
                               torch.ones_like(pair_expert))
    per_expert_rank = per_expert_rank.view(num_local_experts, num_ranks)
    first = torch.cumsum(per_expert_rank, 1) - per_expert_rank
    layout_range = torch.stack([first, per_expert_rank], dim=2)
    return ExpertSlotPlan(pair_row, pair_expert, slot, recv_count, layout_range)


def combine_pair_order(topk_idx: torch.Tensor, token_index: torch.Tensor, send_counts: torch.Tensor,
                       placement: ExpertPlacement) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Low-latency combine, source side: the (token, k) pairs each destination returns, in order.

    The owner of the experts returns one row per (sent row, k) with the expert on that owner,
    ordered by (row, k). This lists those pairs on the source, in the same order.

    Args:
        topk_idx: ``[N, K]`` int64 global ids of the source's tokens.
        token_index, send_counts: the source's ``SendPlan`` fields.
    Returns:
        ``(token [P]`` int64, ``k [P]`` int64, ``pairs_per_rank [R]`` int64).
    """
    num_ranks = send_counts.numel()
    device = topk_idx.device
    row_rank = torch.repeat_interleave(torch.arange(num_ranks, device=device), send_counts,
                                       output_size=token_index.numel())
    sent_topk = topk_idx[token_index]  # [S, K]
    owner = placement.expert_to_rank.to(device)[sent_topk.clamp(min=0)]
    hit = (sent_topk >= 0) & (owner == row_rank[:, None])
    pair_row, pair_k = torch.nonzero(hit, as_tuple=True)
    pairs_per_rank = torch.bincount(row_rank[pair_row], minlength=num_ranks)
    return token_index[pair_row], pair_k, pairs_per_rank


# -- two-hop (node-aware) plans ------------------------------------------------------------------
@dataclass(frozen=True)
class NodeTopology:
    """Ranks grouped into nodes of ``ranks_per_node`` consecutive ranks.

    Rank ``r`` is local rank ``r % ranks_per_node`` of node ``r // ranks_per_node``. The "rail" of
    local index ``l`` is the ranks with that local index on every node; two-hop traffic crosses
    nodes only along rails.
    """

    num_ranks: int
    ranks_per_node: int

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def forwarding_peer(self, src_rank: int, dst_node: int) -> int:
        """The rank on ``dst_node`` that receives ``src_rank``'s tokens and forwards them inside
        the node: the one with the same local index as the source."""
        return dst_node * self.ranks_per_node + self.local_of(src_rank)

    def rail_ranks(self, local: int) -> list[int]:
        """Ranks with local index ``local``, by node: rail rank ``g`` is on node ``g``."""
        return [g * self.ranks_per_node + local for g in range(self.num_nodes)]

    def node_ranks(self, node: int) -> list[int]:
        """Ranks of ``node``, by local index."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))


def forward_counts(target_mask: torch.Tensor, rail_recv_counts: torch.Tensor) -> torch.Tensor:
    """Forwarder side: rows it forwards to each local rank of its node, per source node.

    Args:
        target_mask: ``[S, P]`` bool, whether rail-received row ``s`` goes to local rank ``j``.
            Rows are grouped by source node (``rail_recv_counts`` rows from node 0 first).
        rail_recv_counts: ``[G]`` int64, rows received from each source node.
    Returns:
        ``[P, G]`` int64: ``out[j, g]`` rows of source node ``g`` forwarded to local rank ``j``.
    """
    num_nodes = rail_recv_counts.numel()
    row_node = torch.repeat_interleave(torch.arange(num_nodes, device=target_mask.device),
                                       rail_recv_counts.to(target_mask.device),
                                       output_size=target_mask.shape[0])
    out = torch.zeros(target_mask.shape[1], num_nodes, dtype=torch.int64, device=target_mask.device)
    out.index_add_(1, row_node, target_mask.t().to(torch.int64))
    return out


@dataclass(frozen=True)
class NodeReceiveOrder:
    """Receiver side of a two-hop dispatch.

    Rows arrive from the ``P`` forwarders of the node in ``(forwarder l, source node g, token)``
    order; the source rank of a row is ``g * P + l``. The contract orders received rows by source
    rank, then token.

    Attributes:
        recv_counts: ``[R]`` int64, rows from each source rank (as a flat dispatch counts them).
        order: ``[M]`` int64, arrival index of every row in contract order
            (``final[i] = arrived[order[i]]``).
    """

    recv_counts: torch.Tensor
    order: torch.Tensor


def node_receive_order(node_recv_counts: torch.Tensor) -> NodeReceiveOrder:
    """Builds the receive order from ``node_recv_counts`` (``[P, G]`` int64: rows from forwarder
    ``l`` that came from source node ``g``)."""
    counts = node_recv_counts.to(torch.int64)
    arrival_start = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view_as(counts)
    by_source = counts.t().reshape(-1)            # source rank g * P + l
    start_by_source = arrival_start.t().reshape(-1)
    total = int(by_source.sum())
    block = torch.repeat_interleave(torch.arange(by_source.numel(), device=counts.device), by_source,
                                    output_size=total)
    block_first = torch.cumsum(by_source, 0) - by_source
    within = torch.arange(total, device=counts.device) - block_first[block]
    return NodeReceiveOrder(by_source, start_by_source[block] + within)
