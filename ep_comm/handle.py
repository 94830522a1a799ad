"""Typed handles that tie a combine (or a cached dispatch) to the dispatch that made it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import NodePlan, SendPlan


@dataclass(frozen=True)
class DispatchHandle:
    """What a normal-mode combine or cached dispatch needs from the dispatch.

    Attributes:
        buffer_id: identity of the ``Buffer`` that made it (a handle is only valid there).
        send_plan: this rank as a source: ``token_index [S]`` int64 and ``send_counts [R]``.
        recv_counts: ``[R]`` int64, rows received from each source rank (``M = sum``).
        is_token_in_rank: ``[N, R]`` bool, the layout the dispatch used.
        num_tokens: ``N``, tokens this rank dispatched (rows of the combine's output).
        num_recv_tokens: ``M``, rows received.
        num_worst_tokens: padded row count of the received tensors (0 = not padded).
        hidden: ``H`` of the dispatched tensor.
        num_experts: ``E``.
        recv_src_token_index: ``[M]`` int64, the source token index of every received row
            (the rows are ordered by source rank, then this index).
        mask_epoch: the Buffer's rank-mask generation when it was made (a handle from before
            ``mask_ranks``/``unmask_ranks`` is rejected).
        kernel: engine state of a dispatch that ran on the fused NVIDIA kernels
            (``ep_comm.paths.fused.FusedNormalHandle``), else None.
        node_plan: the two-hop routing when the dispatch ran node-aware (``Buffer(...,
            ranks_per_node=P)``); ``None`` for the flat single-level exchange. A combine or cached
            dispatch follows the same path as its dispatch.
    """

    buffer_id: int
    send_plan: SendPlan
    recv_counts: torch.Tensor
    is_token_in_rank: torch.Tensor
    num_tokens: int
    num_recv_tokens: int
    num_worst_tokens: int
    hidden: int
    num_experts: int
    recv_src_token_index: torch.Tensor
    mask_epoch: int = 0
    kernel: object | None = None
    node_plan: NodePlan | None = None

    @property
    def num_recv_rows(self) -> int:
        """Rows of the received tensors: ``num_worst_tokens`` when padded, else ``M``."""
        return self.num_worst_tokens if self.num_worst_tokens > 0 else self.num_recv_tokens


@dataclass
class LowLatencyReceiveState:
    """Routing facts of a low-latency dispatch, filled in when its receive completes.

    Over the ``P`` received (row, local expert) pairs, ordered by (source rank, row, k):
        pair_rank / pair_slot / pair_expert: ``[P]`` int64 source rank, slot in
            ``recv_x[pair_expert]`` and local expert of each pair.
        pairs_from_rank: ``[R]`` int64, pairs per source rank.
        layout_range: ``[L, R, 2]`` int64, (first slot, count) of every source rank's tokens in
            each local expert's block.
    """

    pair_rank: torch.Tensor | None = None
    pair_slot: torch.Tensor | None = None
    pair_expert: torch.Tensor | None = None
    pairs_from_rank: torch.Tensor | None = None
    layout_range: torch.Tensor | None = None
    done: bool = False


@dataclass
class LowLatencyHandle:
    """What ``low_latency_combine`` needs from ``low_latency_dispatch``.

    Attributes:
        buffer_id: identity of the ``Buffer`` that made it.
        num_max_dispatch_tokens_per_rank: ``T``. hidden: ``H``. num_experts: ``E``.
        num_local_experts: ``L`` of this rank.
        topk_idx: ``[N, K]`` int64, the routing this rank dispatched.
        state: the receive side's routing facts (complete once the receive hook ran).
        recv_count: ``[L]`` int32 tokens per local expert.
        stats_added: whether ``cumulative_local_expert_recv_stats`` was already updated.
        kernel: engine state of a dispatch that ran on the fused NVIDIA kernels
            (``ep_comm.paths.fused.FusedLowLatencyHandle``), else None.
    """

    buffer_id: int
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_local_experts: int
    topk_idx: torch.Tensor
    state: LowLatencyReceiveState
    recv_count: torch.Tensor
    stats_added: bool = False
    mask_epoch: int = 0
    kernel: object | None = None

    @property
    def layout_range(self) -> torch.Tensor | None:
        """``[L, R, 2]`` int64 (first slot, count) per local expert and source rank."""
        return self.state.layout_range
