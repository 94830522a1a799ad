"""The two baselines every ep-bench run measures next to ep_comm.

1. ``NaiveAllToAll``: the per-expert all-to-all of Megatron-LM's ``MoEAlltoAllTokenDispatcher``.
   Dispatch copies every token once per selected expert, sorted by expert (so grouped by owner
   rank), exchanges the per-expert counts, moves the rows with one ``all_to_all_single``, and
   sorts the received rows from (source rank, local expert) order into (local expert, source rank)
   order. Combine undoes the sort, sends the rows back with one ``all_to_all_single``, and sums
   each token's rows weighted by its top-k weights in the payload dtype (Megatron's ``unpermute``
   with bf16 probabilities: its cheapest setting). Payloads are bf16, no codec.
2. ``TransportFloor``: one bare ``all_to_all_single`` of exactly the bytes ep_comm put on the wire,
   peer by peer (from ``CommStats.bytes_sent_wire`` / ``bytes_recv_wire``): what the transport
   alone costs for that traffic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class NaiveState:
    """What the naive combine needs from its dispatch.

    Attributes:
        pair_token: ``[P]`` int64, source token of each sent (token, expert) row, in send order.
        pair_k: ``[P]`` int64, its top-k slot.
        send_splits / recv_splits: rows sent to / received from each rank.
        sort_index: ``[M]`` int64, received row of each expert-major output row.
        unsort_index: ``[M]`` int64, its inverse (expert-major row of each received row).
        tokens_per_expert: ``[L]`` int64, output rows per local expert.
        recv_counts: ``[R, L]`` int64, rows from source rank ``r`` for local expert ``j``.
        num_tokens: ``N``.
    """

    pair_token: torch.Tensor
    pair_k: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    sort_index: torch.Tensor
    unsort_index: torch.Tensor
    tokens_per_expert: torch.Tensor
    recv_counts: torch.Tensor
    num_tokens: int


class NaiveAllToAll:
    """Megatron-style per-expert all-to-all over ``group`` with contiguous expert placement."""

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, device: torch.device) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local = num_experts // self.num_ranks
        self.device = device
        self.count_device = device if str(dist.get_backend(group)) != "gloo" else torch.device("cpu")

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, NaiveState]:
        """Returns ``([M, H]`` rows sorted by local expert then source rank, state)."""
        flat = topk_idx.reshape(-1)
        valid = torch.nonzero(flat >= 0).flatten()
        order = valid[torch.argsort(flat[valid], stable=True)]
        topk = topk_idx.shape[1]
        pair_token, pair_k = order // topk, order % topk
        permuted = x.index_select(0, pair_token)
        per_expert = torch.bincount(flat[valid], minlength=self.num_experts)
        recv_counts = torch.empty(self.num_experts, dtype=torch.int64, device=self.count_device)
        dist.all_to_all_single(recv_counts, per_expert.to(self.count_device), group=self.group)
        recv_counts = recv_counts.view(self.num_ranks, self.num_local).cpu()
        send_splits = per_expert.view(self.num_ranks, self.num_local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = torch.empty(sum(recv_splits), x.shape[1], dtype=x.dtype, device=x.device)
        dist.all_to_all_single(received, permuted, recv_splits, send_splits, group=self.group)
        sort_index = self._expert_major_index(recv_counts)
        unsort_index = torch.empty_like(sort_index)
        unsort_index[sort_index] = torch.arange(sort_index.numel())
        state = NaiveState(pair_token, pair_k, send_splits, recv_splits, sort_index.to(x.device),
                           unsort_index.to(x.device), recv_counts.sum(0), recv_counts, x.shape[0])
        return received.index_select(0, sort_index), state

    @staticmethod
    def _expert_major_index(recv_counts: torch.Tensor) -> torch.Tensor:
        """Received rows come as blocks (rank r, expert j) in r-major order; this lists them
        j-major (Megatron's ``sort_chunks_by_idxs``)."""
        counts = recv_counts.reshape(-1)
        src_start = (torch.cumsum(counts, 0) - counts).view_as(recv_counts)
        counts_t = recv_counts.t().reshape(-1)
        src_t = src_start.t().reshape(-1)
        dst_t = torch.cumsum(counts_t, 0) - counts_t
        total = int(counts.sum())
        shift = torch.repeat_interleave(src_t - dst_t, counts_t, output_size=total)
        return shift + torch.arange(total)

    def combine(self, y: torch.Tensor, state: NaiveState, topk_weights: torch.Tensor) -> torch.Tensor:
        """``y``: ``[M, H]`` expert outputs in dispatch output order -> ``[N, H]`` weighted sums."""
        unsorted = y.index_select(0, state.unsort_index)
        back = torch.empty(sum(state.send_splits), y.shape[1], dtype=y.dtype, device=y.device)
        dist.all_to_all_single(back, unsorted, state.send_splits, state.recv_splits, group=self.group)
        weights = topk_weights[state.pair_token, state.pair_k].unsqueeze(1).to(y.dtype)
        out = torch.zeros(state.num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        out.index_add_(0, state.pair_token, back * weights)
        return out

    def wire_bytes(self, state: NaiveState, row_bytes: int) -> tuple[list[int], list[int]]:
        """Bytes sent to each peer by ``(dispatch, combine)``: payload rows plus the count exchange."""
        count_bytes = self.num_local * 8
        dispatch = [n * row_bytes + count_bytes for n in state.send_splits]
        combine = [n * row_bytes for n in state.recv_splits]
        return dispatch, combine


class TransportFloor:
    """One bare ``all_to_all_single`` of fixed per-peer byte counts, buffers allocated once."""

    def __init__(self, group: dist.ProcessGroup | None, send_bytes: list[int], recv_bytes: list[int],
                 device: torch.device) -> None:
        self.group = group
        self.send_bytes = [int(b) for b in send_bytes]
        self.recv_bytes = [int(b) for b in recv_bytes]
        self.send = torch.randint(0, 256, (sum(self.send_bytes),), dtype=torch.uint8, device=device)
        self.recv = torch.empty(sum(self.recv_bytes), dtype=torch.uint8, device=device)

    def run(self) -> torch.Tensor:
        dist.all_to_all_single(self.recv, self.send, self.recv_bytes, self.send_bytes, group=self.group)
        return self.recv
