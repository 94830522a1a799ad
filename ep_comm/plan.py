"""Layout -> send/receive plan: which rows go where, in which order. Shared by every backend.

Ordering contract: a rank sends its rows grouped by destination rank, and within a destination by
source token index; so every receiver sees its rows ordered by source rank, then source token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import token_node_mask
from .placement import ExpertPlacement


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


@dataclass(frozen=True)
class NodePlan:
    """The two-hop routing of one dispatch, from this rank's three points of view.

    Attributes:
        ranks_per_node: ``P``; ``G = R / P`` nodes.
        rail_plan: as a source: rows sent to each node's forwarding peer; ``token_index [S1]``
            int64 grouped by destination node, ``send_counts [G]`` int64.
        rail_recv_counts: as a forwarder: ``[G]`` int64 rows received from each source node (the
            rank with this rank's local index there).
        forward_plan: as a forwarder: ``token_index [S2]`` int64 indices of rail-received rows,
            grouped by the local rank they are forwarded to, ``send_counts [P]`` int64.
        node_recv_counts: as a receiver: ``[P, G]`` int64 rows forwarded by local rank ``l`` that
            came from node ``g`` (i.e. from source rank ``g * P + l``).
        recv_order: as a receiver: ``[M]`` int64 arrival index of every row in contract order.
    """

    ranks_per_node: int
    rail_plan: SendPlan
    rail_recv_counts: torch.Tensor
    forward_plan: SendPlan
    node_recv_counts: torch.Tensor
    recv_order: torch.Tensor


def virtual_node_plans(is_token_in_rank: list[torch.Tensor], ranks_per_node: int) -> list[NodePlan]:
    """Every rank's ``NodePlan`` when one process knows every rank's layout (virtual ranks on one
    GPU, ``engines.two_hop.TwoHopEngine``): the plans :func:`dispatch` builds through its count
    exchanges, from the same routing maths (``plan.build_send_plan``, ``forward_counts``,
    ``node_receive_order``).

    Args:
        is_token_in_rank: ``R`` tensors, rank ``r``'s ``[N_r, R]`` bool layout.
        ranks_per_node: ``P``; ``R`` must be a multiple of it.
    Returns:
        ``R`` plans, rank order.
    """
    num_ranks = len(is_token_in_rank)
    if ranks_per_node <= 0 or num_ranks % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the {num_ranks} ranks")
    per_node, nodes = ranks_per_node, num_ranks // ranks_per_node
    rail_plans = [build_send_plan(token_node_mask(m, per_node)) for m in is_token_in_rank]
    forward_plans, rail_recv, tables = [], [], []
    for rank in range(num_ranks):
        node, local = divmod(rank, per_node)
        counts, masks = [], []
        for g in range(nodes):  # rail peer on node g, in node order (the arrival order)
            src_plan = rail_plans[g * per_node + local]
            start = int(src_plan.send_counts[:node].sum())
            tokens = src_plan.token_index[start:start + int(src_plan.send_counts[node])]
            masks.append(is_token_in_rank[g * per_node + local][tokens][:, node * per_node:(node + 1) * per_node])
            counts.append(int(tokens.numel()))
        target_mask = torch.cat(masks) if masks else torch.zeros(0, per_node, dtype=torch.bool)
        counts_t = torch.tensor(counts, dtype=torch.int64)
        forward_plans.append(build_send_plan(target_mask))
        rail_recv.append(counts_t)
        tables.append(forward_counts(target_mask, counts_t))
    plans = []
    for rank in range(num_ranks):
        node, local = divmod(rank, per_node)
        node_table = torch.stack([tables[node * per_node + j][local] for j in range(per_node)])
        plans.append(NodePlan(per_node, rail_plans[rank], rail_recv[rank], forward_plans[rank], node_table,
                              node_receive_order(node_table).order))
    return plans
