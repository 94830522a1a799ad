"""DeepEP's handle entries, derived from ep_comm's routing of one dispatch.

DeepEP's kernels split a rank's ``N`` tokens into ``C`` channels of ``ceil(N / C)`` consecutive
token indices (the last ones shorter or empty) and keep per-channel prefix counts and queue
positions. ep_comm moves tokens without channels, so these functions compute, for the same
routing, the values DeepEP's definitions give (see the entry lists of
``handle.IntranodeDispatchHandle`` / ``InternodeDispatchHandle``). Counts are exact; queue
positions (``send_head`` and friends) are positions in the per-channel order DeepEP's senders
use, without its ring-buffer wrap-around.
"""
from __future__ import annotations

import torch

from .handle import DispatchState
from .layout import token_node_mask


def channel_of_tokens(num_tokens: int, num_channels: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[N]`` int64: the channel of each token index (``t // ceil(N / C)``)."""
    per = max(1, -(-num_tokens // num_channels))
    return torch.arange(num_tokens, device=device, dtype=torch.int64) // per


def channel_prefix(mask: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``[D, C]`` int32: for each column ``d`` of ``mask [N, D]`` bool, the tokens of channels
    ``0..c`` whose ``mask[t, d]`` is set (inclusive prefix over channels)."""
    counts = torch.zeros(mask.shape[1], num_channels, dtype=torch.int64)
    channel = channel_of_tokens(mask.shape[0], num_channels)
    counts.index_add_(1, channel, mask.cpu().to(torch.int64).t())
    return counts.cumsum(1).to(torch.int32)


def head_positions(mask: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """``[n, D]`` int32: row ``q``'s position among the rows of its group with ``mask[., d]`` set
    (``-1`` where ``mask[q, d]`` is not set). ``group [n]`` must be non-decreasing (each group a
    run of consecutive rows)."""
    mask = mask.cpu()
    n = mask.shape[0]
    taken = mask.to(torch.int64)
    running = taken.cumsum(0)
    if n == 0:
        return torch.zeros(0, mask.shape[1], dtype=torch.int32)
    group = group.cpu()
    first = torch.ones(n, dtype=torch.bool)
    first[1:] = group[1:] != group[:-1]
    start = torch.nonzero(first).squeeze(1)
    before = torch.zeros(start.numel(), mask.shape[1], dtype=torch.int64)
    nonzero = start > 0
    before[nonzero] = running[start[nonzero] - 1]
    run = first.to(torch.int64).cumsum(0) - 1  # which run each row is in
    position = running - before[run] - 1
    return torch.where(mask, position, torch.full_like(position, -1)).to(torch.int32)


def received_channel_starts(recv_counts: torch.Tensor, src_index: torch.Tensor, tokens_per_source: torch.Tensor,
                            num_channels: int) -> torch.Tensor:
    """``[S, C]`` int32: for rows received from ``S`` sources (``recv_counts [S]`` rows each, in
    source order, ``src_index [M]`` their token indices there, ``tokens_per_source [S]`` each
    source's ``N``), how many of source ``s``'s rows came from its channels before ``c`` (where
    channel ``c`` starts among them)."""
    num_sources = recv_counts.numel()
    counts = torch.zeros(num_sources, num_channels, dtype=torch.int64)
    if src_index.numel():
        source = torch.repeat_interleave(torch.arange(num_sources), recv_counts.cpu().to(torch.int64))
        per = (tokens_per_source.cpu().to(torch.int64) + num_channels - 1) // num_channels
        channel = src_index.cpu().to(torch.int64) // per.clamp(min=1)[source]
        counts.index_put_((source, channel), torch.ones_like(channel), accumulate=True)
    return (counts.cumsum(1) - counts).to(torch.int32)


def _inclusive(counts: torch.Tensor) -> torch.Tensor:
    return counts.cpu().to(torch.int64).cumsum(0).to(torch.int32)


def intranode_entries(state: DispatchState, num_channels: int) -> tuple[torch.Tensor, ...]:
    """DeepEP's 6 intranode entries (``IntranodeDispatchHandle``) of a flat dispatch.
    ``state.count_matrix`` and ``state.tokens_per_rank`` must be set."""
    mask = state.is_token_in_rank
    matrix = state.count_matrix
    assert matrix is not None and state.tokens_per_rank is not None
    rank_prefix = matrix.cpu().to(torch.int64).cumsum(0).to(torch.int32)
    send_head = head_positions(mask, channel_of_tokens(mask.shape[0], num_channels))
    recv_starts = received_channel_starts(state.recv_counts, state.recv_src_token_index, state.tokens_per_rank,
                                          num_channels)
    return (rank_prefix, channel_prefix(mask, num_channels), recv_starts,
            state.recv_src_token_index.to(torch.int32), mask, send_head.to(mask.device))


def internode_entries(state: DispatchState, num_channels: int, rank: int) -> tuple[torch.Tensor, ...]:
    """DeepEP's 10 internode entries (``InternodeDispatchHandle``) of a node-aware dispatch.
    ``state.node_plan``, ``tokens_per_rank``, ``rail_src_index``, ``rail_targets`` and
    ``recv_targets`` must be set."""
    plan = state.node_plan
    assert plan is not None and state.tokens_per_rank is not None
    assert state.rail_src_index is not None and state.rail_targets is not None and state.recv_targets is not None
    per_node = plan.ranks_per_node
    mask = state.is_token_in_rank
    node_mask = token_node_mask(mask.cpu(), per_node)
    channel = channel_of_tokens(mask.shape[0], num_channels)
    local = rank % per_node
    rail_sources = torch.arange(plan.rail_recv_counts.numel()) * per_node + local
    rail_tokens = state.tokens_per_rank.cpu()[rail_sources]
    recv_rdma = received_channel_starts(plan.rail_recv_counts, state.rail_src_index, rail_tokens, num_channels)
    rail_counts = plan.rail_recv_counts.cpu().to(torch.int64)
    recv_rdma_inclusive = recv_rdma.to(torch.int64)
    if rail_counts.numel():  # starts -> inclusive prefixes: shift by one channel, last = the total
        recv_rdma_inclusive = torch.cat([recv_rdma_inclusive[:, 1:], rail_counts.unsqueeze(1)], dim=1)
    recv_gbl = received_channel_starts(state.recv_counts, state.recv_src_token_index, state.tokens_per_rank,
                                       num_channels)
    num_ranks = state.recv_counts.numel()
    src_rank = torch.repeat_interleave(torch.arange(num_ranks), state.recv_counts.cpu().to(torch.int64))
    bits = (state.recv_targets.cpu().to(torch.int64) << torch.arange(per_node)).sum(1)
    meta = torch.stack([src_rank // per_node, bits], dim=1).to(torch.int32).contiguous().view(torch.uint8)
    # a rail row's DeepEP queue: its source node, then its channel on the source
    rail_node = torch.repeat_interleave(torch.arange(rail_counts.numel()), rail_counts)
    per = ((rail_tokens + num_channels - 1) // num_channels).clamp(min=1)
    rail_channel = state.rail_src_index.cpu().to(torch.int64) // per[rail_node] if rail_node.numel() else rail_node
    send_nvl_head = head_positions(state.rail_targets.cpu(), rail_node * num_channels + rail_channel)
    return (mask, channel_prefix(node_mask, num_channels), channel_prefix(mask, num_channels),
            recv_rdma_inclusive.to(torch.int32), _inclusive(rail_counts), recv_gbl, _inclusive(state.recv_counts),
            meta.reshape(-1, 8), head_positions(node_mask, channel), send_nvl_head)
