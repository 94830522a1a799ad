"""``TwoHopEngine``: node-aware (two-hop) normal dispatch/combine (``csrc/cuda/internode_two_hop*.cu``)
over NVSHMEM symmetric memory, one PE per process (``ep_comm/paths/two_hop.py`` drives it for
``Buffer(ranks_per_node=P)``) or virtual ranks of one PE.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..placement import ExpertPlacement
from ..plan import NodePlan
from .runtime import NvshmemSettings, TimeoutRecord, cuda_module, host_module, init_nvshmem, ptr_or_none, stream_handle


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64 counts -> ``[n + 1]`` int64 exclusive prefix sums."""
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts.to(torch.int64), 0)])


def _segment_of(counts: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` int64: the segment of each element when ``counts [n]`` split them in order."""
    return torch.repeat_interleave(torch.arange(counts.numel()), counts.to(torch.int64), output_size=total)


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class TwoHopRows:
    """Byte format of the rows a two-hop dispatch moves for ``[N, H]`` payloads and ``K`` top-k
    entries: x bytes at 0, int64 global top-k ids at ``topk_offset``, float32 weights after them,
    the int32 source token index after those; padded to ``payload_bytes`` (a multiple of 16)."""

    x_bytes: int
    num_topk: int

    @property
    def topk_offset(self) -> int:
        return _align16(self.x_bytes)

    @property
    def weights_offset(self) -> int:
        return self.topk_offset + 8 * self.num_topk

    @property
    def src_offset(self) -> int:
        return self.weights_offset + 4 * self.num_topk

    @property
    def payload_bytes(self) -> int:
        return _align16(self.src_offset + 4)


@dataclass(frozen=True)
class TwoHopHandle:
    """What the two-hop combine needs from one virtual rank's dispatch: the plan and its arrays.

    Attributes:
        plan: the rank's ``NodePlan`` (``ep_comm.plan`` routing maths).
        num_tokens: ``N``, tokens this rank dispatched. num_recv: ``M``, rows it received.
        ret_row: ``[M]`` int64 (device), contract row of each arrival row (forwarder, node, token).
        ret_offsets: ``[P * G + 1]`` int64 (device), arrival offsets per (forwarder, source node).
        rail_offsets: ``[G + 1]`` int64 (device), rail-received rows per source node.
        red_offsets: ``[S1' + 1]`` int64 (device), per rail-received row, its forward entries.
        red_stage_row: ``[S2]`` int64 (device), node_stage row of each entry, by (rail row, local
            rank ascending).
        src_offsets: ``[N + 1]`` int64 (device), per token, its rail-sent rows.
        src_stage_row: ``[S1]`` int64 (device), rail_stage row of each, by (token, node ascending).
    """

    plan: NodePlan
    num_tokens: int
    num_recv: int
    ret_row: torch.Tensor
    ret_offsets: torch.Tensor
    rail_offsets: torch.Tensor
    red_offsets: torch.Tensor
    red_stage_row: torch.Tensor
    src_offsets: torch.Tensor
    src_stage_row: torch.Tensor


@dataclass(frozen=True)
class TwoHopDispatchResult:
    """One virtual rank's two-hop dispatch output (contract order: source rank, then token).

    Attributes:
        recv_x: ``[M, H]``, x's dtype. recv_topk_idx: ``[M, K]`` int64 local expert ids, -1
        elsewhere. recv_topk_weights: ``[M, K]`` float32 (0 elsewhere) or None.
        recv_src_idx: ``[M]`` int64 source token index. num_recv_tokens_per_expert: ``L`` ints.
        handle: for :meth:`TwoHopEngine.combine`.
    """

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor | None
    recv_src_idx: torch.Tensor
    num_recv_tokens_per_expert: list[int]
    handle: TwoHopHandle





def two_hop_arrays(plan: NodePlan, num_tokens: int, rail_rows: int, node_rows: int,
                   device: torch.device) -> tuple[TwoHopHandle, dict[str, torch.Tensor]]:
    """The kernel arrays of one rank's two-hop ``plan``, for stages of ``rail_rows`` and
    ``node_rows`` rows: the combine's (a :class:`TwoHopHandle`) and the dispatch's
    (``rail_send_offsets [G + 1]``, ``fwd_offsets [G + 1]``, ``fwd_row [S2]``, ``fwd_target
    [S2]`` int32, ``fwd_slot [S2]``, ``recv_stage_row [M]``; int64 unless noted, on ``device``),
    with the meanings of ``csrc/cuda_bindings/two_hop_launch.h``. Pure index arithmetic on the
    plan, so the CPU tests can replay the kernels with it.
    """
    nodes, per_node = plan.rail_recv_counts.numel(), plan.ranks_per_node
    # forwarder: entry e forwards rail row s (grouped by source node g) to local rank j
    rail_off = _offsets(plan.rail_recv_counts)
    s1_in = int(plan.rail_recv_counts.sum())
    rail_row = plan.forward_plan.token_index
    entries = rail_row.numel()
    target = _segment_of(plan.forward_plan.send_counts, entries)
    slot = torch.arange(entries) - _offsets(plan.forward_plan.send_counts)[target]
    src_node = _segment_of(plan.rail_recv_counts, s1_in)[rail_row]
    by_node = torch.argsort(src_node, stable=True)
    # receiver: arrival row a came from forwarder l at slot a - start(l)
    m = int(plan.recv_order.numel())
    per_fwd = plan.node_recv_counts.sum(1)
    fwd_of = _segment_of(per_fwd, m)
    arrival_slot = torch.arange(m) - _offsets(per_fwd)[fwd_of]
    recv_stage_row = (fwd_of * node_rows + arrival_slot)[plan.recv_order]
    ret_row = torch.empty(m, dtype=torch.int64)
    ret_row[plan.recv_order] = torch.arange(m)
    # forwarder reduce: per rail row, local ranks ascending
    red = torch.argsort(rail_row * per_node + target, stable=True)
    # source reduce: per token, nodes ascending
    s1_out = plan.rail_plan.num_rows
    dst_node = _segment_of(plan.rail_plan.send_counts, s1_out)
    position = torch.arange(s1_out) - _offsets(plan.rail_plan.send_counts)[dst_node]
    src = torch.argsort(plan.rail_plan.token_index * nodes + dst_node, stable=True)
    dev = device
    handle = TwoHopHandle(
        plan, num_tokens, m, ret_row.to(dev), _offsets(plan.node_recv_counts.reshape(-1)).to(dev),
        rail_off.to(dev), _offsets(torch.bincount(rail_row, minlength=s1_in)[:s1_in]).to(dev),
        (target * node_rows + slot)[red].to(dev),
        _offsets(torch.bincount(plan.rail_plan.token_index, minlength=num_tokens)[:num_tokens]).to(dev),
        (dst_node * rail_rows + position)[src].to(dev))
    dispatch = {"rail_send_offsets": _offsets(plan.rail_plan.send_counts),
                "fwd_offsets": _offsets(torch.bincount(src_node, minlength=nodes)[:nodes]),
                "fwd_row": (rail_row - rail_off[src_node])[by_node], "fwd_target": target[by_node].to(torch.int32),
                "fwd_slot": slot[by_node], "recv_stage_row": recv_stage_row}
    return handle, {k: v.to(dev).contiguous() for k, v in dispatch.items()}


MAX_NODE_RANKS = 8
"""Ranks per node a two-hop launch addresses over NVLink (``kMaxNodeRanks`` in two_hop_launch.h)."""


class _DeviceBytes:
    """``__cuda_array_interface__`` of ``nbytes`` bytes at a device address, so ``torch.as_tensor``
    gives a uint8 view of NVSHMEM symmetric memory (no copy; the owner frees it)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 3}


def _symmetric_view(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """``[nbytes]`` uint8 tensor over device memory at ``address``."""
    return torch.as_tensor(_DeviceBytes(address, nbytes), device=device)


class TwoHopEngine:
    """Two-hop (node-aware) normal dispatch and combine through the kernels of
    ``csrc/cuda/internode_two_hop.cu`` and ``internode_two_hop_combine.cu``, in one of two modes:

    - *virtual ranks* (``group`` holds this one process): ``num_ranks`` ranks (``G = R / P`` nodes
      of ``ranks_per_node``) run by this process on one GPU, NVSHMEM with one PE. The ``R`` rank
      buffers (``TwoHopLayout``) are carved from one ``nvshmem_malloc`` at a fixed stride: the
      network hop is a real NVSHMEM put-with-signal to this PE at the target rank's offset, the
      node hop stores through the other buffers' addresses. Plans come from
      :func:`ep_comm.hierarchical.virtual_node_plans` (:meth:`dispatch` / :meth:`combine`).
    - *one PE per process* (``group`` holds the ``num_ranks`` processes, PE ``r`` = rank ``r``,
      ``rank_stride == 0`` in the kernels): each process drives its own rank
      (:meth:`dispatch_rank` / :meth:`combine_rank`) with the ``NodePlan`` the caller learnt from
      :func:`ep_comm.hierarchical.exchange_node_plan`. The node ranks' buffers must be load/store
      reachable (``nvshmem_ptr`` non-null: NVLink peers or processes sharing a GPU). The put
      sources live in symmetric memory, as InfiniBand transports need: a second
      ``nvshmem_malloc`` (``staging``, ``G * max_tokens`` rows) holds the dispatch's rail send rows
      and the combine's per-node partial sums. Construction and ``close()`` are collective.

    Top-k ids are renumbered with ``layout.localize_rows`` on the receiver. Every wait in the
    kernels is bounded (``timeout_s``); a timeout raises ``CommTimeoutError`` naming the peer and
    the phase (``TimeoutRecord``).

    Capacity: every rank dispatches at most ``max_tokens`` tokens of at most ``max_x_bytes`` bytes
    with ``num_topk`` ids, so a rail stage holds ``max_tokens`` rows and a node stage
    ``G * max_tokens``.

    ``kernels``: the bindings to launch instead of ``ep_comm._cuda``'s (the same functions, with
    ``nvshmem_malloc`` / ``nvshmem_free``); with the kernels built through the CUDA emulation over
    its one-PE NVSHMEM (tests/support/emulated_cuda.py) ``device`` may be the CPU and ``group``
    None: virtual ranks in host memory.
    """

    def __init__(self, num_ranks: int, ranks_per_node: int, placement: ExpertPlacement,
                 device: torch.device, group: dist.ProcessGroup | None, max_tokens: int, max_x_bytes: int,
                 num_topk: int, timeout_s: float = 60.0, settings: NvshmemSettings | None = None,
                 kernels=None) -> None:
        if not 1 <= ranks_per_node <= MAX_NODE_RANKS or num_ranks <= 0 or num_ranks % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be in [1, {MAX_NODE_RANKS}] and divide "
                             f"num_ranks={num_ranks}")
        world = 1 if group is None and kernels is not None else dist.get_world_size(group)
        self.per_process = world > 1
        if not self.per_process and num_ranks > 8:
            raise ValueError(f"num_ranks={num_ranks}: one launch runs at most 8 virtual ranks")
        if self.per_process and world != num_ranks:
            raise ValueError(f"group has {world} processes: TwoHopEngine runs either one process "
                             f"(virtual ranks) or one process per rank ({num_ranks})")
        if placement.num_ranks != num_ranks:
            raise ValueError(f"placement is for {placement.num_ranks} ranks, not {num_ranks}")
        if max_tokens <= 0 or max_x_bytes <= 0 or num_topk <= 0:
            raise ValueError(f"max_tokens ({max_tokens}), max_x_bytes ({max_x_bytes}) and num_topk "
                             f"({num_topk}) must be positive")
        if torch.device(device).type != "cuda" and (kernels is None or group is not None):
            raise ValueError(f"device must be a CUDA device, got {device} (a CPU device runs the kernels "
                             "built through the CUDA emulation: pass them as kernels=, group=None)")
        self.cuda, host = (cuda_module() if kernels is None else kernels), host_module()
        self.num_ranks, self.ranks_per_node = num_ranks, ranks_per_node
        self.num_nodes = num_ranks // ranks_per_node
        self.placement, self.device = placement, torch.device(device)
        self.max_tokens, self.num_topk = max_tokens, num_topk
        self.row_bytes = TwoHopRows(max_x_bytes, num_topk).payload_bytes
        self.layout = host.hier_two_hop_layout(num_ranks, ranks_per_node, max_tokens,
                                               self.num_nodes * max_tokens, self.row_bytes)
        self.pe, n_pes = init_nvshmem(group, settings) if kernels is None else (0, 1)
        self.stride = int(self.layout["total_bytes"])
        self.timeout_ns = int(timeout_s * 1e9)
        self.round_value = 0
        self.symmetric = self.staging = 0
        if not self.per_process:
            self.rank = 0
            self.symmetric = self.cuda.nvshmem_malloc(self.stride * num_ranks)
            self.buffers = [self.symmetric + r * self.stride for r in range(num_ranks)]
            self.records = [TimeoutRecord() for _ in range(num_ranks)]
            return
        self.rank = dist.get_rank(group)
        if n_pes != num_ranks or self.pe != self.rank:
            raise ValueError(f"NVSHMEM PE {self.pe} of {n_pes} does not match rank {self.rank} of {num_ranks}")
        self.symmetric = self.cuda.nvshmem_malloc(self.stride)
        self.staging_bytes = self.num_nodes * max_tokens * self.row_bytes
        self.staging = self.cuda.nvshmem_malloc(self.staging_bytes)
        first = self.rank // ranks_per_node * ranks_per_node
        self.peers = [int(self.cuda.nvshmem_ptr(self.symmetric, pe)) for pe in range(first, first + ranks_per_node)]
        self.records = [TimeoutRecord()]
        if not all(self.peers):
            missing = [first + j for j, p in enumerate(self.peers) if not p]
            self.close()
            raise ValueError(f"rank {self.rank}: node ranks {missing} are not load/store reachable "
                             f"(nvshmem_ptr is null); the two-hop kernels need NVLink or a shared GPU "
                             f"inside a node")

    def close(self) -> None:
        """Frees the symmetric buffers (collective with one PE per process)."""
        if (self.symmetric or self.staging) and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for name in ("staging", "symmetric"):
            if getattr(self, name):
                self.cuda.nvshmem_free(getattr(self, name))
                setattr(self, name, 0)

    def _node_peers(self, rank: int) -> list[int]:
        if self.per_process:
            return self.peers
        first = rank // self.ranks_per_node * self.ranks_per_node
        return self.buffers[first:first + self.ranks_per_node]

    def _common(self, payload_bytes: int) -> dict:
        self.round_value += 1
        return {"symmetric_base": self.symmetric, "rank_stride": self.stride if not self.per_process else 0,
                "my_pe": self.pe, "num_ranks": self.num_ranks, "ranks_per_node": self.ranks_per_node,
                "rail_rows": self.layout["rail_rows"], "node_rows": self.layout["node_rows"],
                "row_bytes": self.row_bytes, "payload_bytes": payload_bytes,
                "round_value": self.round_value, "timeout_ns": self.timeout_ns}

    def _stream(self) -> int:
        return stream_handle(self.device) if self.device.type == "cuda" else 0

    def _finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for record in self.records:
            record.check()

    def _staging_rows(self, rows: int, payload_bytes: int) -> torch.Tensor:
        """``[rows, payload_bytes]`` uint8 view of the symmetric staging buffer."""
        if rows * payload_bytes > self.staging_bytes:
            raise ValueError(f"{rows} rows of {payload_bytes} bytes exceed the staging buffer "
                             f"({self.staging_bytes} bytes)")
        view = _symmetric_view(self.staging, self.staging_bytes, self.device)
        return view[:rows * payload_bytes].view(rows, payload_bytes)

    def _check_rows(self, x: torch.Tensor, topk: torch.Tensor, fmt: TwoHopRows) -> None:
        if fmt.payload_bytes > self.row_bytes:
            raise ValueError(f"rows of {fmt.x_bytes} bytes exceed the engine's max_x_bytes")
        if x.dim() != 2:
            raise ValueError(f"x must be [N, H], got {tuple(x.shape)}")
        if tuple(topk.shape) != (x.shape[0], self.num_topk):
            raise ValueError(f"topk_idx must be [N, {self.num_topk}] for x of {x.shape[0]} rows")
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"x has {x.shape[0]} tokens, more than max_tokens={self.max_tokens}")

    def _check_plan(self, plan: NodePlan) -> None:
        rail_rows, node_rows = int(self.layout["rail_rows"]), int(self.layout["node_rows"])
        if plan.ranks_per_node != self.ranks_per_node or plan.rail_recv_counts.numel() != self.num_nodes:
            raise ValueError(f"plan is for {plan.rail_recv_counts.numel()} nodes of {plan.ranks_per_node}, "
                             f"the engine for {self.num_nodes} of {self.ranks_per_node}")
        if max([*plan.rail_plan.send_counts.tolist(), *plan.rail_recv_counts.tolist(), 0]) > rail_rows:
            raise ValueError(f"plan sends more than rail_rows={rail_rows} rows to one node")
        if max([*plan.forward_plan.send_counts.tolist(), *plan.node_recv_counts.sum(1).tolist(), 0]) > node_rows:
            raise ValueError(f"plan forwards more than node_rows={node_rows} rows to one rank")

    def _dispatch_entry(self, rank: int, plan: NodePlan, x: torch.Tensor, topk: torch.Tensor,
                        weights: torch.Tensor | None, fmt: TwoHopRows, send: torch.Tensor | None
                        ) -> tuple[dict, TwoHopHandle, tuple]:
        """One rank's launch arguments: packs its rail rows into ``send`` (``[S1, payload]`` uint8;
        a fresh tensor when None), allocates its receive rows. Returns (args, handle, keep-alive)."""
        handle, arrays = two_hop_arrays(plan, x.shape[0], int(self.layout["rail_rows"]),
                                        int(self.layout["node_rows"]), self.device)
        tokens = plan.rail_plan.token_index.to(self.device)
        if send is None:
            send = torch.zeros(tokens.numel(), fmt.payload_bytes, dtype=torch.uint8, device=self.device)
        else:
            send.zero_()
        send[:, :fmt.x_bytes] = x.to(self.device)[tokens].contiguous().view(torch.uint8)
        send[:, fmt.topk_offset:fmt.weights_offset] = \
            topk.to(self.device, torch.int64)[tokens].contiguous().view(torch.uint8)
        if weights is not None:
            w = weights.to(self.device, torch.float32)[tokens].contiguous()
            send[:, fmt.weights_offset:fmt.src_offset] = w.view(torch.uint8)
        send[:, fmt.src_offset:fmt.src_offset + 4] = tokens.to(torch.int32).unsqueeze(1).view(torch.uint8)
        recv = torch.empty(handle.num_recv, fmt.payload_bytes, dtype=torch.uint8, device=self.device)
        args = {"rank": rank, "node_peers": self._node_peers(rank), "send_rows": ptr_or_none(send),
                **{k: ptr_or_none(v) for k, v in arrays.items()}, "recv_rows": ptr_or_none(recv),
                "num_recv_rows": handle.num_recv, "record": self.records[rank if not self.per_process else 0].ptr}
        return args, handle, (send, recv, arrays)

    def _unpack(self, rank: int, recv: torch.Tensor, fmt: TwoHopRows, handle: TwoHopHandle,
                dtype: torch.dtype, hidden: int, with_weights: bool) -> TwoHopDispatchResult:
        from ..layout import count_per_local_expert, localize_rows

        m = handle.num_recv
        recv_x = recv[:, :fmt.x_bytes].contiguous().view(dtype).view(m, hidden)
        glob = recv[:, fmt.topk_offset:fmt.weights_offset].contiguous().view(torch.int64)
        weights = recv[:, fmt.weights_offset:fmt.src_offset].contiguous().view(torch.float32) if with_weights else None
        src = recv[:, fmt.src_offset:fmt.src_offset + 4].contiguous().view(torch.int32).reshape(m)
        local, local_w = localize_rows(glob, weights, torch.full((m,), rank, dtype=torch.int64, device=self.device),
                                       self.placement)
        counts = count_per_local_expert(local, int(self.placement.num_local_experts[rank]))
        return TwoHopDispatchResult(recv_x, local, local_w, src.to(torch.int64),
                                    [int(c) for c in counts.tolist()], handle)

    def dispatch(self, xs: list[torch.Tensor], topk_idx: list[torch.Tensor],
                 topk_weights: list[torch.Tensor | None]) -> list[TwoHopDispatchResult]:
        """Dispatches every virtual rank's tokens along the two-hop plan (virtual-rank mode).

        Args:
            xs: per rank ``[N_r, H]`` (any dtype; rows move as bytes), ``N_r <= max_tokens``.
            topk_idx: per rank ``[N_r, K]`` int64 global expert ids, -1 for none.
            topk_weights: per rank ``[N_r, K]`` float32 or None.
        Returns:
            per rank a :class:`TwoHopDispatchResult`, bit-identical to a flat dispatch.
        """
        from ..layout import compute_dispatch_layout
        from ..plan import virtual_node_plans

        if self.per_process:
            raise ValueError("this engine runs one rank per process: call dispatch_rank")
        if len(xs) != self.num_ranks or len(topk_idx) != self.num_ranks or len(topk_weights) != self.num_ranks:
            raise ValueError(f"xs, topk_idx and topk_weights need one entry per rank ({self.num_ranks})")
        hidden, dtype = xs[0].shape[1], xs[0].dtype
        fmt = TwoHopRows(hidden * xs[0].element_size(), self.num_topk)
        for x, t in zip(xs, topk_idx):
            self._check_rows(x, t, fmt)
            if x.shape[1] != hidden or x.dtype != dtype:
                raise ValueError(f"every x must be [N, {hidden}] {dtype}")
        masks = [compute_dispatch_layout(t.cpu().to(torch.int64), self.placement).is_token_in_rank
                 for t in topk_idx]
        plans = virtual_node_plans(masks, self.ranks_per_node)
        entries = [self._dispatch_entry(r, plans[r], xs[r], topk_idx[r], topk_weights[r], fmt, None)
                   for r in range(self.num_ranks)]
        for record in self.records:
            record.reset()
        self.cuda.two_hop_dispatch(self._common(fmt.payload_bytes), [e[0] for e in entries], self._stream())
        self._finish()
        return [self._unpack(r, keep[1], fmt, handle, dtype, hidden, topk_weights[r] is not None)
                for r, (_, handle, keep) in enumerate(entries)]

    def dispatch_rank(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None,
                      plan: NodePlan) -> TwoHopDispatchResult:
        """This process's rank's two-hop dispatch (one-PE-per-process mode). Every rank calls it
        together, with the plan from ``hierarchical.exchange_node_plan``.

        Args:
            x: ``[N, H]`` (any dtype; rows move as bytes), ``N <= max_tokens``.
            topk_idx: ``[N, K]`` int64 global expert ids, -1 for none.
            topk_weights: ``[N, K]`` float32 or None.
            plan: this rank's ``NodePlan`` for the layout of ``topk_idx``.
        Returns:
            a :class:`TwoHopDispatchResult` in contract order.
        """
        if not self.per_process:
            raise ValueError("this engine runs virtual ranks: call dispatch")
        fmt = TwoHopRows(x.shape[1] * x.element_size(), self.num_topk)
        self._check_rows(x, topk_idx, fmt)
        self._check_plan(plan)
        if plan.rail_plan.token_index.numel() and int(plan.rail_plan.token_index.max()) >= x.shape[0]:
            raise ValueError("plan refers to tokens beyond x's rows")
        send = self._staging_rows(int(plan.rail_plan.token_index.numel()), fmt.payload_bytes)
        args, handle, keep = self._dispatch_entry(self.rank, plan, x, topk_idx, topk_weights, fmt, send)
        self.records[0].reset()
        self.cuda.two_hop_dispatch(self._common(fmt.payload_bytes), [args], self._stream())
        self._finish()
        return self._unpack(self.rank, keep[1], fmt, handle, x.dtype, x.shape[1], topk_weights is not None)

    def _combine_entry(self, rank: int, h: TwoHopHandle, x: torch.Tensor, weights: torch.Tensor | None,
                       layout: tuple[int, int, int], partial: torch.Tensor | None) -> tuple[dict, tuple]:
        """One rank's combine arguments (``layout`` = x bytes, weights offset, payload bytes)."""
        x_bytes, w_off, payload = layout
        dtype, hidden = x.dtype, x.shape[1]
        rows = torch.zeros(h.num_recv, payload, dtype=torch.uint8, device=self.device)
        rows[:, :x_bytes] = x[:h.num_recv].to(self.device).contiguous().view(torch.uint8)
        num_w = 0 if weights is None else weights.shape[1]
        if weights is not None:
            w = weights[:h.num_recv].to(self.device, torch.float32).contiguous()
            rows[:, w_off:w_off + 4 * num_w] = w.view(torch.uint8)
        if partial is None:
            partial = torch.empty(int(h.plan.rail_recv_counts.sum()), payload, dtype=torch.uint8,
                                  device=self.device)
        cx = torch.empty(h.num_tokens, hidden, dtype=dtype, device=self.device)
        cw = torch.empty(h.num_tokens, num_w, dtype=torch.float32, device=self.device) if weights is not None else None
        args = {"rank": rank, "node_peers": self._node_peers(rank), "x": ptr_or_none(rows),
                "ret_row": ptr_or_none(h.ret_row), "ret_offsets": ptr_or_none(h.ret_offsets),
                "rail_offsets": ptr_or_none(h.rail_offsets), "red_offsets": ptr_or_none(h.red_offsets),
                "red_stage_row": ptr_or_none(h.red_stage_row), "partial": ptr_or_none(partial),
                "src_offsets": ptr_or_none(h.src_offsets), "src_stage_row": ptr_or_none(h.src_stage_row),
                "num_tokens": h.num_tokens, "combined_x": ptr_or_none(cx), "combined_weights": ptr_or_none(cw),
                "record": self.records[rank if not self.per_process else 0].ptr}
        return args, (rows, partial, cx, cw)

    def _combine_layout(self, x: torch.Tensor, num_w: int) -> tuple[int, int, int]:
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"combine supports bfloat16 and float32, got {x.dtype}")
        if x.dim() != 2:
            raise ValueError(f"x must be [M, H], got {tuple(x.shape)}")
        x_bytes = x.shape[1] * x.element_size()
        w_off = _align16(x_bytes)
        payload = _align16(w_off + 4 * num_w)
        if payload > self.row_bytes:
            raise ValueError(f"combine rows of {payload} bytes exceed the engine's row capacity "
                             f"({self.row_bytes})")
        return x_bytes, w_off, payload

    def _launch_combine(self, args: list[dict], x: torch.Tensor, layout: tuple[int, int, int], num_w: int) -> None:
        for record in self.records:
            record.reset()
        fmt = {"hidden": x.shape[1], "dtype": 0 if x.dtype == torch.bfloat16 else 1, "num_weights": num_w,
               "weights_offset": layout[1]}
        self.cuda.two_hop_combine(self._common(layout[2]), fmt, args, self._stream())
        self._finish()

    def combine(self, xs: list[torch.Tensor], handles: list[TwoHopHandle],
                topk_weights: list[torch.Tensor | None] | None = None
                ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Sums every token's returned rows on its source (virtual-rank mode): per node on the
        forwarder (local rank ascending), then over nodes (ascending), float32, as
        ``hierarchical.combine`` does.

        Args:
            xs: per rank ``[M_r, H]`` bfloat16 or float32 rows in the dispatch's received order.
            handles: per rank, the dispatch result's ``handle``.
            topk_weights: per rank ``[M_r, K]`` float32 rows summed the same way, or None.
        Returns:
            per rank ``(combined_x [N_r, H]`` xs' dtype, ``combined_weights [N_r, K]`` float32
            or None).
        """
        if self.per_process:
            raise ValueError("this engine runs one rank per process: call combine_rank")
        dtype, hidden = xs[0].dtype, xs[0].shape[1]
        weights = topk_weights or [None] * self.num_ranks
        with_w = weights[0] is not None
        if any((w is not None) != with_w for w in weights):
            raise ValueError("topk_weights must be given for every rank or for none")
        num_w = weights[0].shape[1] if with_w else 0
        layout = self._combine_layout(xs[0], num_w)
        args, keep = [], []
        for r, h in enumerate(handles):
            x = xs[r]
            if x.dtype != dtype or x.dim() != 2 or x.shape[1] != hidden or x.shape[0] < h.num_recv:
                raise ValueError(f"xs[{r}] must be [>= {h.num_recv}, {hidden}] {dtype}")
            a, k = self._combine_entry(r, h, x, weights[r], layout, None)
            args.append(a)
            keep.append(k)
        self._launch_combine(args, xs[0], layout, num_w)
        return [(k[2], k[3]) for k in keep]

    def combine_rank(self, x: torch.Tensor, handle: TwoHopHandle, topk_weights: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This process's rank's two-hop combine (one-PE-per-process mode; every rank together).

        Args:
            x: ``[M', H]`` bfloat16 or float32 rows in the dispatch's received order, ``M' >= M``.
            handle: the :meth:`dispatch_rank` result's ``handle``.
            topk_weights: ``[M', K]`` float32 summed the same way, or None.
        Returns:
            ``(combined_x [N, H]`` x's dtype, ``combined_weights [N, K]`` float32 or None).
        """
        if not self.per_process:
            raise ValueError("this engine runs virtual ranks: call combine")
        num_w = 0 if topk_weights is None else int(topk_weights.shape[1])
        layout = self._combine_layout(x, num_w)
        if x.shape[0] < handle.num_recv or (topk_weights is not None and topk_weights.shape[0] < handle.num_recv):
            raise ValueError(f"x and topk_weights need at least {handle.num_recv} rows")
        partial = self._staging_rows(int(handle.plan.rail_recv_counts.sum()), layout[2])
        args, keep = self._combine_entry(self.rank, handle, x, topk_weights, layout, partial)
        self._launch_combine([args], x, layout, num_w)
        return keep[2], keep[3]
