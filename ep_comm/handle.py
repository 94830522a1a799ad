"""Handles that tie a combine (or a cached dispatch) to the dispatch that made it.

A handle is DeepEP's handle tuple, entry for entry (so code written for DeepEP may index it),
with names for the entries and ep_comm's own state (``handle.state``) on top:

- :class:`IntranodeDispatchHandle`, a flat dispatch: DeepEP's 6 intranode entries;
- :class:`InternodeDispatchHandle`, a node-aware dispatch (``ranks_per_node``): DeepEP's 10;
- :class:`LowLatencyHandle`: DeepEP's 5 low-latency entries.

ep_comm moves tokens without DeepEP's channels; the channel entries hold the values DeepEP's
kernels would write for the same routing with ``C = num_sms // 2`` channels, each channel taking a
contiguous range of ``ceil(N / C)`` token indices (``channel_token_ranges``). How every entry is
derived is in ``ep_comm.handle_entries``. A tuple that DeepEP code builds or slices itself is not
a handle here: the Buffer rejects it with a ValueError.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .plan import NodePlan, SendPlan


@dataclass(frozen=True)
class DispatchState:
    """What a normal-mode combine or cached dispatch needs from the dispatch (ep_comm's side of
    a :class:`DispatchHandle`).

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
        count_matrix: ``[R, R]`` int64, tokens every rank sent every rank (row = source), and
            tokens_per_rank: ``[R]`` int64, every rank's ``N``, when the path learnt them (the
            Buffer exchanges them otherwise; they define DeepEP's prefix entries).
        rail_src_index / rail_targets: node-aware, as a forwarder: the source token index
            ``[S1]`` int64 and the target ranks on this node ``[S1, P]`` bool of every row
            received over the rail hop, in arrival order.
        recv_targets: node-aware, as a receiver: ``[M, P]`` bool, the ranks of this node that
            received each received row.
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
    count_matrix: torch.Tensor | None = None
    tokens_per_rank: torch.Tensor | None = None
    rail_src_index: torch.Tensor | None = None
    rail_targets: torch.Tensor | None = None
    recv_targets: torch.Tensor | None = None
    group_key: tuple = ()
    """The making Buffer's group (global ranks), placement and node size: another Buffer with the
    same key takes the handle, as DeepEP's handles work with any Buffer of the group."""
    grad_link: torch.Tensor | None = None
    """``ep_comm.dispatch``'s (autograd) ``[1]`` float32 output that ``ep_comm.combine`` takes, so
    that the combine's backward always reaches the dispatch's, which makes collective calls, also on
    a rank whose combine input does not depend on the received rows. None for a handle of
    ``Buffer.dispatch``; detached where the dispatch's backward does not run."""

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


class _EntryTuple(tuple):
    """A tuple of DeepEP's entries (``FIELDS`` names them) carrying ep_comm's ``state``, whose
    attributes read through the handle."""

    FIELDS: tuple[str, ...] = ()

    def __new__(cls, entries: tuple, state: object):
        if len(entries) != len(cls.FIELDS):
            raise ValueError(f"{cls.__name__} has {len(cls.FIELDS)} entries, got {len(entries)}")
        handle = super().__new__(cls, entries)
        handle.state = state
        return handle

    def __getattr__(self, name: str):
        if name in type(self).FIELDS:
            return self[type(self).FIELDS.index(name)]
        if name == "state":
            raise AttributeError(name)
        return getattr(self.state, name)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}={tuple(v.shape) if isinstance(v, torch.Tensor) else v}"
                           for n, v in zip(type(self).FIELDS, self))
        return f"{type(self).__name__}({shapes})"

    def __reduce__(self):
        return (type(self), (tuple(self), self.state))


class DispatchHandle(_EntryTuple):
    """A normal-mode dispatch's handle: DeepEP's tuple (:class:`IntranodeDispatchHandle` or
    :class:`InternodeDispatchHandle`) with ``state`` (:class:`DispatchState`); the state's fields
    read as attributes (``handle.num_recv_tokens``)."""

    def with_state(self, **changes: object) -> DispatchHandle:
        """The same entries with ``state`` fields replaced."""
        return type(self)(tuple(self), replace(self.state, **changes))


class IntranodeDispatchHandle(DispatchHandle):
    """DeepEP's intranode handle:

    - ``rank_prefix_matrix [R, R]`` int32: ``[i, j]`` = tokens ranks ``0..i`` sent to rank ``j``;
    - ``channel_prefix_matrix [R, C]`` int32: as a sender, ``[j, c]`` = this rank's tokens in
      channels ``0..c`` sent to rank ``j``;
    - ``recv_channel_prefix_matrix [R, C]`` int32: as a receiver, ``[i, c]`` = rows from rank
      ``i`` that came from its channels before ``c`` (where channel ``c`` starts among them);
    - ``recv_src_idx [M]`` int32: each received row's token index on its source;
    - ``is_token_in_rank [N, R]`` bool;
    - ``send_head [N, R]`` int32: token ``t``'s position among the tokens of its channel sent to
      rank ``j``, ``-1`` where ``t`` is not sent there.
    """

    FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
              "is_token_in_rank", "send_head")


class InternodeDispatchHandle(DispatchHandle):
    """DeepEP's internode handle, nodes of ``P`` ranks (``G = R / P`` nodes), ``S1`` rows received
    over the rail hop as a forwarder:

    - ``is_token_in_rank [N, R]`` bool;
    - ``rdma_channel_prefix_matrix [G, C]`` int32: as a sender, tokens in channels ``0..c`` sent
      to node ``g``;
    - ``gbl_channel_prefix_matrix [R, C]`` int32: as a sender, tokens in channels ``0..c`` sent
      to rank ``j``;
    - ``recv_rdma_channel_prefix_matrix [G, C]`` int32: as a forwarder, rows from node ``g``'s
      rail peer that came from its channels ``0..c``;
    - ``recv_rdma_rank_prefix_sum [G]`` int32: rows received over the rail from nodes ``0..g``;
    - ``recv_gbl_channel_prefix_matrix [R, C]`` int32: as a receiver, rows from rank ``i`` that
      came from its channels before ``c``;
    - ``recv_gbl_rank_prefix_sum [R]`` int32: rows received from ranks ``0..i``;
    - ``recv_src_meta [M, 8]`` uint8: per received row, DeepEP's source meta: int32 source node,
      int32 bit ``l`` set when local rank ``l`` of this node received the token;
    - ``send_rdma_head [N, G]`` int32: token ``t``'s position among its channel's tokens sent to
      node ``g``, ``-1`` where not sent;
    - ``send_nvl_head [S1, P]`` int32: as a forwarder, rail row ``q``'s position among the rows of
      its source node and channel forwarded to local rank ``l``, ``-1`` where not forwarded.
    """

    FIELDS = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
              "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
              "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")


class OwnDispatchHandle(DispatchHandle):
    """A handle of ``ep_comm.dispatch`` (autograd), whose ops carry the plan but not the
    layout DeepEP's entries are derived from: no entries, only ``state``."""

    FIELDS = ()


@dataclass
class LowLatencyState:
    """What ``low_latency_combine`` needs from ``low_latency_dispatch`` (ep_comm's side of a
    :class:`LowLatencyHandle`).

    Attributes:
        buffer_id: identity of the ``Buffer`` that made it.
        num_max_dispatch_tokens_per_rank: ``T``. hidden: ``H``. num_experts: ``E``.
        num_local_experts: ``L`` of this rank.
        topk_idx: ``[N, K]`` int64, the routing this rank dispatched.
        receive: the receive side's routing facts (complete once the receive hook ran).
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
    receive: LowLatencyReceiveState
    recv_count: torch.Tensor
    stats_added: bool = False
    mask_epoch: int = 0
    kernel: object | None = None
    group_key: tuple = ()


class LowLatencyHandle(_EntryTuple):
    """DeepEP's low-latency handle, with ``state`` (:class:`LowLatencyState`) on top:

    - ``recv_src_info [L, R*T]`` int32: each filled slot's token index on its source rank;
    - ``layout_range [L, R]`` int64: ``begin << 32 | count``, the slots of each source rank's
      tokens in each local expert's block;
    - ``num_max_dispatch_tokens_per_rank``, ``hidden``, ``num_experts``.

    The two tensors are filled when the dispatch's receive completes (the hook, when one is
    returned), as DeepEP's are.
    """

    FIELDS = ("recv_src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts")

