"""The fused-kernel path on NVIDIA: one process per rank, all ranks on one host.

The CUDA kernels do layout, packing and sending together: ``engines.intranode.IntranodeEngine``
over CUDA IPC peer buffers for normal mode, ``engines.low_latency.LowLatencyEngine`` over NVSHMEM
symmetric memory for low-latency mode. :meth:`FusedKernelPath.decide` says at ``Buffer``
construction whether each mode may run here at all; the ``*_reason`` methods decide per call.
Codecs (``fp8``/``lossless``), cached dispatches, biases, float64 weights, masked ranks and sizes
the kernels cannot take go to the flat path. A dispatch handle made here is a complete
``DispatchState``, so its combine or cached dispatch may also run flat.
"""
from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..handle import DispatchState, LowLatencyReceiveState
from ..low_latency import LowLatencyDispatchOutput, pack_layout_range
from ..normal import DispatchOutput
from ..placement import ExpertPlacement
from ..plan import build_send_plan
from ..stats import CommStats
from .base import (
    CombineCall,
    DispatchCall,
    LowLatencyCombineCall,
    LowLatencyDispatchCall,
    Path,
)

MAX_FUSED_RANKS = 8
"""Ranks one intranode / low-latency launch addresses (``kMaxRanks`` in launchers.h)."""
MAX_FUSED_TOPK = 32


@dataclass(frozen=True)
class KernelCapabilities:
    """What ``plan_kernels`` decides from.

    Attributes:
        transport: the transport the Buffer built (``"nvshmem"`` or ``"torch"``).
        cuda_built: ``ep_comm._cuda`` imports. nvshmem_built: it was built with NVSHMEM.
        device_type: the Buffer's device type. hostnames: every rank's host, in rank order.
    """

    transport: str
    cuda_built: bool
    nvshmem_built: bool
    device_type: str
    hostnames: tuple[str, ...]


def gather_hostnames(group: dist.ProcessGroup) -> tuple[str, ...]:
    """Every rank's hostname, in rank order (collective)."""
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, socket.gethostname(), group=group)
    return tuple(str(h) for h in out)


@dataclass(frozen=True)
class FusedNormalHandle:
    """Rides in ``DispatchState.kernel``: the engine state a fused combine needs.

    Attributes:
        generation: the engine that made it. inner: ``IntranodeHandle`` (meta ``[R*C + L + 1]``
        int32, ``is_token_in_rank [N, R]`` bool on the device). num_topk: ``K``.
    """

    generation: int
    inner: object
    num_topk: int


@dataclass
class FusedLowLatencyHandle:
    """Rides in ``LowLatencyHandle.kernel``: the dispatch's ``LowLatencyResult`` and pair counts.

    Attributes:
        pairs_to: ``[R]`` int64 on the device, (token, expert) pairs this rank sent to each rank
            (set on receive).
        pairs_from: ``[R]`` int64 on the device, pairs received from each rank (set on receive).
    """

    generation: int
    result: object
    pairs_to: torch.Tensor | None = None
    pairs_from: torch.Tensor | None = None


def _nonnull(t: torch.Tensor | None) -> torch.Tensor | None:
    """A one-row zero stand-in for an empty tensor (torch gives empty tensors a null address).
    The kernels read 'no weights' from a null pointer, and every rank must agree on the row
    format even when it has no rows; they take row counts from elsewhere and never read it."""
    if t is None or t.numel() > 0:
        return t
    return torch.zeros((1, *t.shape[1:]), dtype=t.dtype, device=t.device)


class FusedKernelPath(Path):
    """The fused engines of one Buffer, made on first use and remade (collectively) when a call
    needs other sizes. The generations count remakes; handles of an older engine combine on the
    flat path (normal mode) or are rejected (low-latency mode).

    Args:
        unavailable: why normal mode cannot run here (None: it can).
        low_latency_unavailable: why low-latency mode cannot run here (None: it can).
    """

    name = "fused kernels"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, timeout_s: float, buffer_id: int,
                 unavailable: str | None = None, low_latency_unavailable: str | None = None,
                 intranode_copy: str = "ring") -> None:
        super().__init__(unavailable if unavailable is not None and low_latency_unavailable is not None else None)
        self.normal_unavailable, self.low_latency_unavailable = unavailable, low_latency_unavailable
        self.group, self.device, self.timeout_s, self.buffer_id = group, device, timeout_s, buffer_id
        self.intranode_copy = intranode_copy  # IntranodeEngine's copy=: "ring" or "direct"
        self.rank = dist.get_rank(group) if group is not None else 0
        self.num_ranks = dist.get_world_size(group) if group is not None else 1
        self.intranode = None
        self.intranode_key: tuple = ()
        self.intranode_generation = 0
        self.intranode_row_bytes = 0
        self.low_latency = None
        self.low_latency_key: tuple = ()
        self.low_latency_generation = 0

    def mode_unavailable(self, mode: str) -> str | None:
        return self.low_latency_unavailable if mode.startswith("low_latency") else self.normal_unavailable

    @staticmethod
    def decide(caps: KernelCapabilities) -> tuple[str | None, str | None]:
        """``(why normal mode cannot run, why low-latency mode cannot run)``, None where it can:
        both need the NVSHMEM transport, the kernels built, a CUDA device, and 1..8 ranks on one
        host; low-latency mode also needs NVSHMEM built in."""
        if caps.transport != "nvshmem":
            no = f"the {caps.transport} transport moves bytes only"
        elif not caps.cuda_built:
            no = "ep_comm._cuda is not built"
        elif caps.device_type != "cuda":
            no = f"the Buffer's device is {caps.device_type}, not cuda"
        elif not 1 <= len(caps.hostnames) <= MAX_FUSED_RANKS:
            no = f"{len(caps.hostnames)} ranks: the fused kernels address at most {MAX_FUSED_RANKS}"
        elif len(set(caps.hostnames)) > 1:
            hosts = sorted(set(caps.hostnames))
            no = f"the ranks span {len(hosts)} hosts ({', '.join(hosts)}); the fused kernels need one"
        else:
            no = None
        if no is not None:
            return no, no
        return None, (None if caps.nvshmem_built else "low-latency kernels need NVSHMEM, which is not built")

    @classmethod
    def build(cls, group: dist.ProcessGroup, device: torch.device, transport: str, timeout_s: float,
              buffer_id: int, intranode_copy: str = "ring") -> FusedKernelPath:
        """Decides what may run here (collective: all-gathers the hostnames on the NVSHMEM
        transport) and returns the path; no engine is made yet."""
        if transport != "nvshmem":
            caps = KernelCapabilities(transport, False, False, device.type, ())
        else:
            from ..engines.runtime import cuda_module

            caps = KernelCapabilities(transport, True, bool(cuda_module().nvshmem_built()), device.type,
                                      gather_hostnames(group))
        normal_no, low_latency_no = cls.decide(caps)
        return cls(group, device, timeout_s, buffer_id, normal_no, low_latency_no, intranode_copy)

    # -- engines ---------------------------------------------------------------------------------
    def _retire(self, engine: object) -> None:
        if engine is not None:
            engine.close()  # type: ignore[attr-defined]

    def _intranode_engine(self, placement: ExpertPlacement, num_topk: int, row_bytes: int,
                          num_scales: int, num_channels: int):
        from ..engines import IntranodeEngine

        key = (tuple(placement.expert_to_rank.tolist()), num_topk, num_scales, num_channels)
        if self.intranode is not None and self.intranode_key == key and self.intranode_row_bytes >= row_bytes:
            return self.intranode
        self._retire(self.intranode)
        self.intranode = None
        self.intranode_row_bytes = 0
        self.intranode = IntranodeEngine(self.num_ranks, placement, self.device, num_topk, row_bytes,
                                         num_channels=num_channels, timeout_s=self.timeout_s,
                                         max_scales=num_scales, group=self.group, copy=self.intranode_copy)
        self.intranode_key, self.intranode_row_bytes = key, row_bytes
        self.intranode_generation += 1
        return self.intranode

    def _low_latency_engine(self, placement: ExpertPlacement, max_tokens: int, hidden: int, num_topk: int):
        from ..engines import LowLatencyEngine

        key = (tuple(placement.expert_to_rank.tolist()), max_tokens, hidden, num_topk)
        if self.low_latency is not None and self.low_latency_key == key:
            return self.low_latency
        self._retire(self.low_latency)
        self.low_latency = None
        self.low_latency = LowLatencyEngine(self.num_ranks, placement, self.device, max_tokens, hidden,
                                            num_topk, timeout_s=self.timeout_s, group=self.group)
        self.low_latency_key = key
        self.low_latency_generation += 1
        return self.low_latency

    def low_latency_status(self, wait: bool) -> None:
        """Raises what the low-latency kernels recorded (a timeout naming the peer, a capacity
        overflow); with ``wait``, after waiting for the stream."""
        if self.low_latency is not None:
            if wait:
                self.low_latency.synchronize()
            else:
                self.low_latency.check_records()

    def close(self) -> None:
        """Releases the engines' buffers (collective)."""
        self._retire(self.intranode)
        self._retire(self.low_latency)
        self.intranode = self.low_latency = None
        self.intranode_row_bytes = 0

    # -- per-call choice -------------------------------------------------------------------------
    def dispatch_reason(self, call: DispatchCall) -> str | None:
        if self.normal_unavailable is not None:
            return self.normal_unavailable
        if call.masked:
            return "ranks are masked"
        if call.codec != "none":
            return f"codec {call.codec!r} runs on the flat path"
        topk_idx, topk_weights = call.topk_idx, call.topk_weights
        if topk_idx is None:
            return "no topk_idx"
        if topk_idx.shape[1] > MAX_FUSED_TOPK or topk_idx.shape[1] < 1:
            return f"num_topk {topk_idx.shape[1]} outside [1, {MAX_FUSED_TOPK}]"
        if topk_weights is not None and topk_weights.dtype != torch.float32:
            return f"topk_weights is {topk_weights.dtype}; the kernels carry float32"
        q = call.x[0] if isinstance(call.x, tuple) else call.x
        if (q.shape[1] * q.element_size()) % 16:
            return "rows are not a multiple of 16 bytes"
        return None

    def combine_reason(self, call: CombineCall) -> str | None:
        if self.normal_unavailable is not None:
            return self.normal_unavailable
        kernel, x, topk_weights = call.handle.kernel, call.x, call.topk_weights
        if call.masked:
            return "ranks are masked"
        if (not isinstance(kernel, FusedNormalHandle) or kernel.generation != self.intranode_generation
                or self.intranode_row_bytes == 0):
            return "the dispatch did not run on the current fused engine"
        if call.codec != "none":
            return f"codec {call.codec!r} runs on the flat path"
        if call.biases:
            return "bias is added on the flat path (one rounding, as there)"
        if x.dtype not in (torch.bfloat16, torch.float32):
            return f"the combine kernel sums bfloat16 or float32, x is {x.dtype}"
        row = x.shape[1] * x.element_size()
        if row % 16 or row > self.intranode_row_bytes:
            return f"rows of {row} bytes do not fit the engine ({self.intranode_row_bytes})"
        if topk_weights is not None and (topk_weights.dtype != torch.float32
                                         or topk_weights.shape[1] != kernel.num_topk):
            return "topk_weights must be float32 [M, K] of the dispatch's K"
        return None

    def low_latency_dispatch_reason(self, call: LowLatencyDispatchCall) -> str | None:
        if self.low_latency_unavailable is not None:
            return self.low_latency_unavailable
        if call.masked:
            return "ranks are masked"
        if call.nvfp4:
            return ("compact NVFP4 rows are narrower than the combine's bf16 rows, and one engine "
                    "(sized by the dispatch's row) serves both")
        if call.x.shape[1] % 128:
            return f"hidden {call.x.shape[1]} is not a multiple of 128"
        return None

    def low_latency_combine_reason(self, call: LowLatencyCombineCall) -> str | None:
        if self.low_latency_unavailable is not None:
            return self.low_latency_unavailable
        if not isinstance(call.handle.kernel, FusedLowLatencyHandle):
            return "the dispatch did not run on the fused kernels"
        return None

    # -- normal mode -----------------------------------------------------------------------------
    def dispatch(self, call: DispatchCall) -> DispatchOutput:
        """A normal dispatch through the intranode kernels (see ``normal.dispatch`` for shapes)."""
        from ..engines.runtime import host_module

        x, topk_idx, topk_weights, placement = call.x, call.topk_idx, call.topk_weights, call.placement
        num_channels = max(1, call.num_sms // 2)
        dev = self.device
        scales = scales_f32 = None
        if isinstance(x, tuple):
            q, s = x
            payload = q.to(dev).contiguous().view(torch.uint8)
            scales = s.to(dev).contiguous()
            scales_f32 = scales.view(torch.float32)  # int32 UE8M0 scales travel as their bits
        else:
            payload = x.to(dev).contiguous()
        hidden_bytes = payload.shape[1] * payload.element_size()
        hidden = int(payload.shape[1])
        num_scales = 0 if scales is None else int(scales.shape[1])
        topk = topk_idx.to(dev, torch.int64).contiguous()
        weights = None if topk_weights is None else _nonnull(topk_weights.to(dev).contiguous())
        engine = self._intranode_engine(placement, int(topk.shape[1]), max(hidden_bytes, 2 * hidden),
                                        num_scales, num_channels)
        out = engine.dispatch([payload], [topk], [weights],
                              x_scales=None if scales is None else [scales_f32])[0]
        recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = out["recv_x"]
        if scales is not None:
            recv_x = (out["recv_x"].view(torch.float8_e4m3fn), out["recv_scales"].view(scales.dtype))
        per_rank, _, _, mask = out["layout"]
        num_local = int(placement.num_local_experts[self.rank])
        counts = torch.tensor(out["num_recv_tokens_per_expert"][:num_local], dtype=torch.int64)
        recv_counts = out["recv_counts"]
        handle = DispatchState(
            buffer_id=self.buffer_id, send_plan=build_send_plan(mask), recv_counts=recv_counts,
            is_token_in_rank=mask, num_tokens=int(payload.shape[0]), num_recv_tokens=int(recv_counts.sum()),
            num_worst_tokens=0, hidden=hidden, num_experts=placement.num_experts,
            recv_src_token_index=out["recv_src_idx"].to(torch.int64),
            kernel=FusedNormalHandle(self.intranode_generation, out["handle"], int(topk.shape[1])))
        row = int(host_module().routing_row_layout(hidden_bytes, num_scales, int(topk.shape[1]), True,
                                             weights is not None, True)["row_bytes"])
        sent = [int(n) * row for n in per_rank.tolist()]
        recv = [int(n) * row for n in recv_counts.tolist()]
        stats = CommStats("dispatch", "none", sent, sent, recv, recv, rank=self.rank,
                          extra={"fused_kernels": 1.0, "kernel_ms": engine.last_kernel_ms})
        return DispatchOutput(recv_x, out["recv_topk_idx"], out["recv_topk_weights"], counts, handle, stats)

    def combine(self, call: CombineCall) -> tuple[torch.Tensor, torch.Tensor | None, CommStats]:
        """A normal combine through the intranode kernels (``combine_reason`` said yes)."""
        from ..engines.runtime import host_module

        handle, x, topk_weights = call.handle, call.x, call.topk_weights
        kernel = handle.kernel
        assert isinstance(kernel, FusedNormalHandle) and self.intranode is not None
        m = handle.num_recv_tokens
        rows = x[:m].to(self.device).contiguous()
        weights = None if topk_weights is None else _nonnull(topk_weights[:m].to(self.device).contiguous())
        combined, combined_w = self.intranode.combine([rows], [kernel.inner], [weights])[0]
        row = int(host_module().routing_row_layout(rows.shape[1] * rows.element_size(), 0, kernel.num_topk,
                                             False, weights is not None, False)["row_bytes"])
        sent = [int(n) * row for n in handle.recv_counts.tolist()]
        recv = [int(n) * row for n in handle.send_plan.splits()]
        stats = CommStats("combine", "none", sent, sent, recv, recv, rank=self.rank,
                          extra={"fused_kernels": 1.0, "kernel_ms": self.intranode.last_kernel_ms})
        return combined, combined_w, stats

    # -- low-latency mode ------------------------------------------------------------------------
    def low_latency_dispatch(self, call: LowLatencyDispatchCall) -> LowLatencyDispatchOutput:
        """Queues the send kernel; the output's ``receive()`` runs the receive kernel (see
        ``low_latency.dispatch`` for shapes). Its ``kernel`` goes into the ``LowLatencyHandle``."""
        from ..engines.runtime import host_module

        use_fp8, round_scale, use_ue8m0 = call.use_fp8, call.round_scale, call.use_ue8m0
        receive_area, placement, max_tokens = call.receive_area, call.placement, call.max_tokens
        x = call.x.to(self.device).contiguous()
        topk = call.topk_idx.to(self.device, torch.int64).contiguous()
        hidden = int(x.shape[1])
        engine = self._low_latency_engine(placement, max_tokens, hidden, int(topk.shape[1]))
        if receive_area[0].device != self.device:
            receive_area = tuple(torch.empty_like(t, device=self.device) for t in receive_area)
        # the kernels write row-major scales; the caller gets DeepEP's column-major ones (the
        # receive area's strides), copied over when the receive completes
        kernel_scales = torch.empty(receive_area[1].shape, dtype=receive_area[1].dtype,
                                    device=self.device) if use_fp8 else None
        area = (receive_area[0], kernel_scales)
        results, launch = engine.start_dispatch([x], [topk], use_fp8, round_scale, use_ue8m0, outputs=[area])
        res = results[0]
        kernel = FusedLowLatencyHandle(self.low_latency_generation, res)
        recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (
            (receive_area[0], receive_area[1]) if use_fp8 else receive_area[0])
        state = LowLatencyReceiveState()
        wire_row = int(host_module().routing_ll_row(hidden, use_fp8)[2])
        r = self.num_ranks
        stats = CommStats("low_latency_dispatch", "fp8" if use_fp8 else "none", [0] * r, [0] * r,
                          [0] * r, [0] * r, rank=self.rank, extra={"fused_kernels": 1.0})
        e2r = engine.e2r.long()

        def fill_stats() -> None:  # reads the device counts: only when last_stats is read
            to, back = kernel.pairs_to.tolist(), kernel.pairs_from.tolist()
            stats.bytes_sent_raw = [n * 2 * hidden for n in to]
            stats.bytes_sent_wire = [n * wire_row for n in to]
            stats.bytes_recv_raw = [n * 2 * hidden for n in back]
            stats.bytes_recv_wire = [n * wire_row for n in back]

        def receive() -> None:  # queues the receive kernel; no host round trip (graph capturable)
            if state.done:
                return
            engine.finish_dispatch(launch, wait=False)
            if kernel_scales is not None:
                receive_area[1].copy_(kernel_scales)
            valid = (topk >= 0).to(torch.int64)
            kernel.pairs_to = torch.zeros(r, dtype=torch.int64, device=self.device).index_add_(
                0, e2r[topk.clamp(min=0)].reshape(-1), valid.reshape(-1))
            kernel.pairs_from = res.layout_range[:, :, 1].sum(0)
            stats.pending = fill_stats
            state.layout_range = res.layout_range
            layout_range.copy_(pack_layout_range(res.layout_range))
            state.done = True

        layout_range = torch.zeros(res.layout_range.shape[:2], dtype=torch.int64, device=self.device)
        return LowLatencyDispatchOutput(recv_x, res.recv_count, state, receive, stats, res.recv_src_info,
                                        layout_range, kernel=kernel)

    def low_latency_combine(self, call: LowLatencyCombineCall) -> tuple[Callable[[], torch.Tensor], CommStats]:
        """Queues the combine's send kernel; the callable runs the receive and gives ``[N, H]``
        bf16 (``out`` when given)."""
        x, topk_idx, topk_weights, kernel, out = call.x, call.topk_idx, call.topk_weights, call.handle.kernel, call.out
        if not isinstance(kernel, FusedLowLatencyHandle) or kernel.generation != self.low_latency_generation \
                or self.low_latency is None:
            raise ValueError("handle: its low-latency buffer was replaced by a later dispatch with other "
                             "sizes; dispatch again")
        engine = self.low_latency
        hidden = int(x.shape[2])
        target = out if out is not None and out.is_contiguous() and out.device == self.device else None
        outs, launch = engine.start_combine([x.to(self.device)], [topk_idx.to(self.device)],
                                            [topk_weights.to(self.device)], [kernel.result],
                                            outs=None if target is None else [target])
        stats = CommStats("low_latency_combine", "none", [], [], [], [], rank=self.rank,
                          extra={"fused_kernels": 1.0})

        def fill_stats() -> None:  # reads the device counts: only when last_stats is read
            stats.bytes_sent_raw = stats.bytes_sent_wire = [n * 2 * hidden for n in kernel.pairs_from.tolist()]
            stats.bytes_recv_raw = stats.bytes_recv_wire = [n * 2 * hidden for n in kernel.pairs_to.tolist()]

        stats.pending = fill_stats

        def finish() -> torch.Tensor:  # queues the receive kernel; no host round trip
            engine.finish_combine(launch, wait=False)
            return outs[0]

        return finish, stats
