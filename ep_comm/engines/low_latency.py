"""``LowLatencyEngine``: the low-latency kernels of ``csrc/cuda/low_latency.cu`` over NVSHMEM
symmetric memory (one PE per process) or virtual ranks of one PE.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError
from ..placement import ExpertPlacement
from .intranode import PeerBuffers, _group_size
from .runtime import (
    NvshmemSettings,
    TimeoutRecord,
    aligned_ptr,
    cuda_module,
    host_module,
    ptr_or_none,
    stream_handle,
)


@dataclass(frozen=True)
class LowLatencyResult:
    """One rank's low-latency dispatch output (shapes as in ``Buffer.low_latency_dispatch``)."""

    recv_x: torch.Tensor
    recv_scales: torch.Tensor | None
    recv_count: torch.Tensor
    recv_src_info: torch.Tensor
    recv_topk_slot: torch.Tensor
    layout_range: torch.Tensor


@dataclass
class LowLatencyLaunch:
    """A low-latency call whose send kernel is queued; ``finish_*`` launches its receive.

    Attributes:
        ranks: the per-rank kernel arguments. flags: ``(use_fp8, round_scale, use_ue8m0)``.
        keep: tensors the kernels read, kept alive until the receive ran.
    """

    ranks: list[dict]
    flags: tuple[bool, bool, bool]
    keep: list[torch.Tensor | None]


class LowLatencyEngine:
    """Low-latency dispatch/combine among up to 8 ranks: virtual ranks on one GPU
    (``group=None``), or one rank per process over NVSHMEM (loads/stores to NVLink peers, puts to
    the others). Lists passed to the calls hold one entry per rank in ``local_ranks``.

    Each call is a send (``start_*``) and a receive (``finish_*``). With a group, every send is
    preceded by a barrier over the PEs on the stream: a rank's next send must not overwrite a
    peer's staging rows or re-arm its flags while that peer still receives the previous call (two
    dispatches, or two combines, in a row). The barrier is bounded (a peer that never calls is a
    ``CommTimeoutError`` naming it, and the stream moves on). Virtual ranks run in stream order
    and need none.

    ``finish_*(wait=False)`` only queues the receive: nothing waits for the stream, so the calls
    can be captured in a CUDA graph. What the kernels record (a timeout naming the peer, a
    capacity overflow) stays in the pinned timeout records until :meth:`check_records` reads
    them, which the next send does first (without waiting) and :meth:`synchronize` does after
    waiting. A record is cleared only once reported; meanwhile the kernels that see it give up.
    The barrier counts its rounds on the device (``launch_counted_barrier``), so a graph replay
    is a barrier as a fresh launch is.
    """

    def __init__(self, num_ranks: int, placement: ExpertPlacement, device: torch.device,
                 max_tokens: int, hidden: int, num_topk: int, timeout_s: float = 60.0,
                 group: dist.ProcessGroup | None = None, settings: NvshmemSettings | None = None) -> None:
        num_ranks = _group_size(group, num_ranks)
        if not 1 <= num_ranks <= 8:
            raise ValueError(f"the low-latency engine runs 1..8 ranks per process, got {num_ranks}")
        if hidden % 128:
            raise ValueError(f"hidden must be a multiple of 128, got {hidden}")
        self.cuda, host = cuda_module(), host_module()
        self.num_ranks, self.placement, self.device = num_ranks, placement, torch.device(device)
        self.max_tokens, self.hidden, self.num_topk = max_tokens, hidden, num_topk
        self.max_local = int(placement.num_local_experts.max())
        lay = host.routing_low_latency_layout(num_ranks, self.max_local, placement.num_experts,
                                              max_tokens, num_topk, hidden)
        self.buffers = PeerBuffers(lay["total_bytes"], num_ranks, self.device, group, settings)
        self.barrier_offset = int(lay["barrier"])
        # this PE's count of its barriers (the same on every PE: one per send), on the device
        self.barrier_round = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.local_ranks = self.buffers.local_ranks
        self.multi_process = group is not None
        self.e2r = placement.expert_to_rank.to(self.device, torch.int32)
        self.e2l = placement.expert_to_local.to(self.device, torch.int32)
        self.records = [TimeoutRecord() for _ in self.local_ranks]
        self.timeout_ns = int(timeout_s * 1e9)

    def _common(self) -> dict:
        return {"peers": self.buffers.peers, "symmetric_base": self.buffers.symmetric or None,
                "expert_to_rank": ptr_or_none(self.e2r), "expert_to_local": ptr_or_none(self.e2l),
                "num_ranks": self.num_ranks, "num_experts": self.placement.num_experts,
                "max_local_experts": self.max_local, "num_topk": self.num_topk,
                "max_tokens": self.max_tokens, "hidden": self.hidden, "timeout_ns": self.timeout_ns}

    def _check(self) -> None:
        if self.multi_process:
            self._wait_bounded()
        else:
            torch.cuda.current_stream(self.device).synchronize()
        for record in self.records:
            record.check()

    def _wait_bounded(self) -> None:
        """Waits for the stream, but not forever: the kernels and the barrier before a send
        record a peer that never comes and return; should the stream still not finish within
        their timeout plus a grace period, this raises ``CommTimeoutError`` (naming the peer
        when a kernel recorded one)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        started = time.monotonic()
        deadline = started + self.timeout_ns / 1e9 + 5.0
        while not event.query():
            if time.monotonic() > deadline:
                for record in self.records:
                    record.check()
                raise CommTimeoutError(
                    f"ep_comm low_latency/stream: rank {self.local_ranks[0]} waited "
                    f"{time.monotonic() - started:.1f}s for its stream past the kernels' timeout "
                    "(could not tell which peer)", peers=[], phase="low_latency/stream")
            time.sleep(0)

    def check_records(self) -> None:
        """Raises what a kernel recorded (``CommTimeoutError`` naming the peer, or a ValueError for
        a capacity overflow) and clears it; reads host memory only, so a record a running kernel
        has not written yet shows at a later check."""
        for record in self.records:
            record.check()

    def synchronize(self) -> None:
        """Waits for the stream (bounded with a group), then :meth:`check_records`."""
        self._check()

    def _before_send(self) -> None:
        self.check_records()
        if self.multi_process:
            self.cuda.launch_counted_barrier(self.buffers.symmetric + self.barrier_offset,
                                             ptr_or_none(self.barrier_round), self.num_ranks, self.local_ranks[0],
                                             self.timeout_ns, self.records[0].ptr, stream_handle(self.device))

    def close(self) -> None:
        """Frees the buffers (collective over the PEs with a group)."""
        self.buffers.close()

    def result_tensors(self, rank: int, use_fp8: bool, use_ue8m0: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fresh ``recv_x`` (``[L, R*T, H]`` bf16 or e4m3) and scales (``[L, R*T, H/128]``
        float32, ``[L, R*T, H/512]`` int32 with UE8M0, or None) for ``rank``."""
        r, t, h = self.num_ranks, self.max_tokens, self.hidden
        local, dev = int(self.placement.num_local_experts[rank]), self.device
        recv_x = torch.empty(local, r * t, h, dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16,
                             device=dev)
        scales = None
        if use_fp8:
            scales = (torch.empty(local, r * t, h // 512, dtype=torch.int32, device=dev) if use_ue8m0
                      else torch.empty(local, r * t, h // 128, dtype=torch.float32, device=dev))
        return recv_x, scales

    def start_dispatch(self, xs: list[torch.Tensor], topk_idx: list[torch.Tensor], use_fp8: bool = False,
                       round_scale: bool = False, use_ue8m0: bool = False,
                       outputs: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
                       ) -> tuple[list[LowLatencyResult], LowLatencyLaunch]:
        """Queues the send phase; ``xs[i]`` is ``[N_i, H]`` bf16, ``topk_idx[i]`` ``[N_i, K]``.
        ``outputs[i]``: ``(recv_x, scales)`` to receive into (``result_tensors``' shapes)."""
        r, t, h = self.num_ranks, self.max_tokens, self.hidden
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0=True needs use_fp8=True and round_scale=True")
        if use_ue8m0 and h % 512:
            raise ValueError(f"use_ue8m0 packs 4 scales per int32: hidden must be a multiple of 512, got {h}")
        results, ranks, keep = [], [], []
        for i, rank in enumerate(self.local_ranks):
            x, topk = xs[i].contiguous(), topk_idx[i].to(torch.int64).contiguous()
            if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != h:
                raise ValueError(f"x must be [N, {h}] bfloat16")
            if topk.dim() != 2 or topk.shape != (x.shape[0], self.num_topk):
                raise ValueError(f"topk_idx must be [N, {self.num_topk}] for x of {x.shape[0]} rows")
            if x.shape[0] > t:
                raise ValueError(f"x has {x.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank={t}")
            local, dev = int(self.placement.num_local_experts[rank]), self.device
            recv_x, scales = outputs[i] if outputs is not None else self.result_tensors(rank, use_fp8, use_ue8m0)
            res = LowLatencyResult(recv_x, scales, torch.empty(local, dtype=torch.int32, device=dev),
                                   torch.empty(local, r * t, dtype=torch.int32, device=dev),
                                   torch.empty(local, r * t, dtype=torch.int32, device=dev),
                                   torch.empty(local, r, 2, dtype=torch.int64, device=dev))
            results.append(res)
            keep += [x, topk]
            ranks.append(self._rank(i, rank, x, topk, None, res, None))
        launch = LowLatencyLaunch(ranks, (use_fp8, round_scale, use_ue8m0), keep)
        self._before_send()
        self.cuda.low_latency_dispatch_send(self._common(), ranks, *launch.flags, stream_handle(self.device))
        return results, launch

    def finish_dispatch(self, launch: LowLatencyLaunch, wait: bool = True) -> None:
        """Launches the receive phase; with ``wait``, waits for it and raises what the kernels
        recorded (without, a later send or :meth:`synchronize` reports it)."""
        self.cuda.low_latency_dispatch_recv(self._common(), launch.ranks, *launch.flags, stream_handle(self.device))
        if wait:
            self._check()

    def dispatch(self, xs: list[torch.Tensor], topk_idx: list[torch.Tensor], use_fp8: bool = False,
                 round_scale: bool = False, use_ue8m0: bool = False) -> list[LowLatencyResult]:
        """Send and receive phases for every local rank; ``xs[i]`` is ``[N_i, H]`` bf16."""
        results, launch = self.start_dispatch(xs, topk_idx, use_fp8, round_scale, use_ue8m0)
        self.finish_dispatch(launch)
        return results

    def _rank(self, i: int, rank: int, x: torch.Tensor, topk: torch.Tensor,
              weights: torch.Tensor | None, res: LowLatencyResult, combined: torch.Tensor | None) -> dict:
        return {"rank": rank, "num_tokens": topk.shape[0],
                "num_local_experts": int(self.placement.num_local_experts[rank]),
                "x": aligned_ptr(x, f"x of rank {rank}"),
                "topk_idx": ptr_or_none(topk), "topk_weights": ptr_or_none(weights), "recv_x": ptr_or_none(res.recv_x),
                "recv_scales": ptr_or_none(res.recv_scales), "recv_count": ptr_or_none(res.recv_count),
                "recv_src_info": ptr_or_none(res.recv_src_info), "recv_topk_slot": ptr_or_none(res.recv_topk_slot),
                "layout_range": ptr_or_none(res.layout_range),
                "combined_x": None if combined is None else aligned_ptr(combined, f"out of rank {rank}"),
                "record": self.records[i].ptr}

    def start_combine(self, xs: list[torch.Tensor], topk_idx: list[torch.Tensor],
                      topk_weights: list[torch.Tensor], handles: list[LowLatencyResult],
                      outs: list[torch.Tensor] | None = None
                      ) -> tuple[list[torch.Tensor], LowLatencyLaunch]:
        """Queues the send phase: ``xs[i]`` is rank i's ``[L_i, R*T, H]`` bf16 expert output,
        ``handles[i]`` its dispatch's result. Returns the ``[N, H]`` bf16 outputs (``outs`` when
        given), filled by ``finish_combine``."""
        ranks, keep, results = [], [], []
        for i, rank in enumerate(self.local_ranks):
            x = xs[i].to(torch.bfloat16).contiguous()
            topk = topk_idx[i].to(torch.int64).contiguous()
            w = topk_weights[i].to(torch.float32).contiguous()
            out = outs[i] if outs is not None else torch.empty(topk.shape[0], self.hidden,
                                                              dtype=torch.bfloat16, device=self.device)
            if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.shape != (topk.shape[0], self.hidden):
                raise ValueError(f"out must be a contiguous [{topk.shape[0]}, {self.hidden}] bfloat16 tensor")
            keep += [x, topk, w]
            results.append(out)
            ranks.append(self._rank(i, rank, x, topk, w, handles[i], out))
        launch = LowLatencyLaunch(ranks, (False, False, False), keep)
        self._before_send()
        self.cuda.low_latency_combine_send(self._common(), ranks, stream_handle(self.device))
        return results, launch

    def finish_combine(self, launch: LowLatencyLaunch, wait: bool = True) -> None:
        """Launches the receive (weighted sum); ``wait`` as in :meth:`finish_dispatch`."""
        self.cuda.low_latency_combine_recv(self._common(), launch.ranks, stream_handle(self.device))
        if wait:
            self._check()

    def combine(self, xs: list[torch.Tensor], topk_idx: list[torch.Tensor],
                topk_weights: list[torch.Tensor], handles: list[LowLatencyResult]) -> list[torch.Tensor]:
        """``xs[i]`` is rank i's ``[L_i, R*T, H]`` bf16 expert output; returns ``[N, H]`` bf16 each."""
        outs, launch = self.start_combine(xs, topk_idx, topk_weights, handles)
        self.finish_combine(launch)
        return outs


# ---- two-hop (node-aware) normal mode over NVSHMEM ----------------------------------------------
