"""NVIDIA backend: the compiled kernels of ``ep_comm._cuda`` behind small Python engines.

- ``NvshmemTransport``: a ``Transport`` (byte all-to-all with GPU-initiated NVSHMEM puts and
  signals), bootstrapped from the user's ``torch.distributed`` group by broadcasting the NVSHMEM
  unique id over it. NVSHMEM settings are passed explicitly (``NvshmemSettings``).
- ``IntranodeEngine``: normal-mode layout/dispatch/combine through peer buffers (NVLink peers
  mapped with CUDA IPC, ``cuda_ipc.py``, or ``R`` virtual ranks of one process on one GPU for
  tests), fused into the kernels of ``csrc/cuda/layout.cu`` and ``intranode.cu``.
- ``LowLatencyEngine``: the low-latency kernels of ``csrc/cuda/low_latency.cu`` over NVSHMEM
  symmetric memory (or virtual ranks).
- ``TwoHopEngine``: node-aware (two-hop) normal dispatch/combine (``csrc/cuda/internode_two_hop*.cu``)
  over NVSHMEM symmetric memory, one PE per process (``ep_comm/two_hop.py`` drives it for
  ``Buffer(ranks_per_node=P)``) or virtual ranks of one PE.

Buffer byte layouts are defined once in ``csrc/common/buffer_layout.h``; sizes are read through
``ep_comm._host`` so Python and the kernels agree. Every kernel wait is bounded: a timeout is
recorded in a pinned host record and raised here as ``CommTimeoutError`` naming peer and phase.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError
from ..handle import NodePlan
from ..placement_map import ExpertPlacement
from .base import PendingExchange, Transport
from .cuda_ipc import IpcPeerBuffers

_TIMED_OUT, _OVERFLOW = 1, 2


def _cuda():
    try:
        from .. import _cuda
    except ImportError as error:
        raise RuntimeError(f"the nvshmem backend needs ep_comm._cuda, which is not built "
                           f"({error})") from error
    return _cuda


def _host():
    from .. import _host
    return _host


def available() -> bool:
    """True when the kernels are built and a CUDA device is visible."""
    try:
        _cuda()
    except RuntimeError:
        return False
    return torch.cuda.is_available()


def _stream(device: torch.device) -> int:
    return int(torch.cuda.current_stream(device).cuda_stream)


class _KernelTimer:
    """CUDA events around the data-moving launches; ``ms`` after the stream synchronised."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = self.end = None

    def __enter__(self) -> "_KernelTimer":
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.start.record(torch.cuda.current_stream(self.device))
        return self

    def __exit__(self, *exc: object) -> None:
        self.end.record(torch.cuda.current_stream(self.device))

    @property
    def ms(self) -> float:
        return float(self.start.elapsed_time(self.end))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else int(t.data_ptr())


class TimeoutRecord:
    """The kernels' timeout record (``csrc/common/timeout.h``) in pinned, device-mapped memory."""

    def __init__(self) -> None:
        fields = _host().timeout_record_fields
        self.fields = dict(fields)
        self.phases = {int(k): str(v) for k, v in _host().timeout_phase_names.items()}
        self.words = torch.zeros(int(fields["words"]), dtype=torch.int32,
                                 pin_memory=torch.cuda.is_available())

    @property
    def ptr(self) -> int:
        return int(self.words.data_ptr())

    def reset(self) -> None:
        self.words.zero_()

    def check(self, rank_names: list[int] | None = None) -> None:
        """Raises if a kernel recorded a failure. Call after the stream has synchronised."""
        status = int(self.words[self.fields["status"]])
        if status == 0:
            return
        f = self.fields
        rank, peer, phase = (int(self.words[f["rank"]]), int(self.words[f["peer"]]),
                             int(self.words[f["phase"]]))
        waited, detail = int(self.words[f["waited_ms"]]), int(self.words[f["detail"]])
        name = self.phases.get(phase, f"phase {phase}")
        if rank_names is not None and 0 <= peer < len(rank_names):
            peer = rank_names[peer]
        self.reset()
        if status == _OVERFLOW:
            raise ValueError(f"num_max_dispatch_tokens_per_rank too small: rank {rank} overflowed the "
                             f"slots of expert {detail} on rank {peer}")
        raise CommTimeoutError(f"ep_comm {name}: rank {rank} waited {waited} ms for rank {peer} "
                               f"(detail {detail}) and gave up", peers=[peer] if peer >= 0 else [],
                               phase=name)


# ---- NVSHMEM bootstrap and transport ------------------------------------------------------------
@dataclass(frozen=True)
class NvshmemSettings:
    """NVSHMEM settings, applied explicitly while NVSHMEM initialises and restored afterwards.

    NVSHMEM reads its configuration from environment variables at init; these are set only for the
    duration of ``nvshmem_init`` and the previous values are put back, so the user's environment
    is unchanged after the call. ``extra`` holds further ``NVSHMEM_*`` variables by name.
    """

    symmetric_size: int = 1 << 30
    enable_ibgda: bool | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def as_env(self) -> dict[str, str]:
        env = {"NVSHMEM_SYMMETRIC_SIZE": str(int(self.symmetric_size))}
        if self.enable_ibgda is not None:
            env["NVSHMEM_IB_ENABLE_IBGDA"] = "1" if self.enable_ibgda else "0"
        env.update({k: str(v) for k, v in self.extra.items()})
        return env


_NVSHMEM_STATE: dict[str, int] = {}


def init_nvshmem(group: dist.ProcessGroup, settings: NvshmemSettings | None = None) -> tuple[int, int]:
    """Initialises NVSHMEM once per process over ``group``; returns ``(my_pe, n_pes)``."""
    cuda = _cuda()
    if not cuda.nvshmem_built():
        raise RuntimeError(f"ep_comm._cuda was built without NVSHMEM ({cuda.nvshmem_reason})")
    if _NVSHMEM_STATE:
        return _NVSHMEM_STATE["pe"], _NVSHMEM_STATE["n"]
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    box = [cuda.nvshmem_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    env = (settings or NvshmemSettings()).as_env()
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        cuda.nvshmem_init(box[0], rank, size)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _NVSHMEM_STATE.update(pe=cuda.nvshmem_my_pe(), n=cuda.nvshmem_n_pes())
    return _NVSHMEM_STATE["pe"], _NVSHMEM_STATE["n"]


class NvshmemTransport(Transport):
    """All-to-all of bytes through an NVSHMEM symmetric buffer (rounds of ``slot_bytes`` per peer).

    Large exchanges run as several rounds; each round is one put kernel, one bounded-wait kernel
    and a barrier on the stream (``csrc/cuda/internode.cu``).
    """

    name = "nvshmem"

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, device: torch.device,
                 num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, num_qps_per_rank: int = 24, *,
                 slot_bytes: int | None = None, settings: NvshmemSettings | None = None) -> None:
        """``num_rdma_bytes`` (DeepEP's meaning: the symmetric buffer), when given, sizes the
        per-peer round; ``num_qps_per_rank`` becomes NVSHMEM's IBGDA RC count per PE unless
        ``settings`` says otherwise. ``num_nvl_bytes`` is unused by this transport."""
        if not torch.cuda.is_available() or torch.device(device).type != "cuda":
            raise ValueError(f"backend='nvshmem' needs a CUDA device, got device={device} "
                             f"(CUDA available: {torch.cuda.is_available()})")
        super().__init__(dist.get_rank(group), dist.get_world_size(group), device)
        self.cuda = _cuda()
        if slot_bytes is None:
            slot_bytes = max(num_rdma_bytes // max(self.num_ranks, 1), 1 << 20) if num_rdma_bytes else 16 << 20
        if settings is None:
            total = _host().routing_exchange_layout(self.num_ranks, slot_bytes)[3]
            extra = {"NVSHMEM_IBGDA_NUM_RC_PER_PE": str(num_qps_per_rank)} if num_qps_per_rank > 0 else {}
            settings = NvshmemSettings(symmetric_size=max(1 << 30, 2 * total), extra=extra)
        pe, n = init_nvshmem(group, settings)
        if n != self.num_ranks:
            raise ValueError(f"NVSHMEM has {n} PEs but the group has {self.num_ranks} ranks")
        self.pe = pe
        _, _, self.slot_bytes, total = _host().routing_exchange_layout(self.num_ranks, slot_bytes)
        self.symmetric = self.cuda.nvshmem_malloc(total)
        self.timeout_ns = int(timeout_s * 1e9)
        self.record = TimeoutRecord()
        self.round_value = 0

    @staticmethod
    def usable(group: dist.ProcessGroup) -> bool:
        """Whether ``backend="auto"`` may pick this transport for ``group``: the kernels were
        built with NVSHMEM and this process sees a CUDA device."""
        try:
            cuda = _cuda()
        except RuntimeError:
            return False
        return bool(cuda.nvshmem_built()) and torch.cuda.is_available() and group is not None

    def close(self) -> None:
        if self.symmetric:
            self.cuda.nvshmem_free(self.symmetric)
            self.symmetric = 0

    def exchange_bytes(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                       phase: str) -> PendingExchange:
        if send.dtype != torch.uint8 or send.dim() != 1:
            raise ValueError("transport payloads are 1-D uint8 tensors")
        send = send.to(self.device).contiguous()
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        self.num_collectives += 1
        rounds = max(1, -(-max([*send_splits, *recv_splits, 1]) // self.slot_bytes))
        send_start = torch.tensor([0, *send_splits], dtype=torch.int64).cumsum(0)[:-1]
        recv_start = torch.tensor([0, *recv_splits], dtype=torch.int64).cumsum(0)[:-1]
        s_len = torch.tensor(send_splits, dtype=torch.int64)
        r_len = torch.tensor(recv_splits, dtype=torch.int64)
        for i in range(rounds):
            lo = i * self.slot_bytes
            args = torch.stack([send_start + lo, (s_len - lo).clamp(0, self.slot_bytes),
                                recv_start + lo, (r_len - lo).clamp(0, self.slot_bytes)]).to(self.device)
            self.round_value += 1
            self.cuda.exchange_round({
                "symmetric": self.symmetric, "slot_bytes": self.slot_bytes, "send": _ptr(send),
                "send_offsets": _ptr(args[0]), "send_bytes": _ptr(args[1]), "recv": _ptr(recv),
                "recv_offsets": _ptr(args[2]), "recv_bytes": _ptr(args[3]),
                "num_ranks": self.num_ranks, "my_pe": self.pe, "round_value": self.round_value,
                "timeout_ns": self.timeout_ns, "record": self.record.ptr}, _stream(self.device))
            torch.cuda.current_stream(self.device).synchronize()
            self._check(phase)
        return PendingExchange(lambda: recv)

    def exchange_counts(self, counts: torch.Tensor, phase: str) -> torch.Tensor:
        if counts.dim() != 2 or counts.shape[0] != self.num_ranks:
            raise ValueError(f"counts must be [num_ranks, C], got {tuple(counts.shape)}")
        row = counts.shape[1] * 8
        send = counts.to(torch.int64).contiguous().view(torch.uint8).flatten()
        recv = self.exchange_bytes(send, [row] * self.num_ranks, [row] * self.num_ranks, phase).wait()
        return recv.view(torch.int64).view(self.num_ranks, -1).cpu()

    def _check(self, phase: str) -> None:
        try:
            self.record.check()
        except CommTimeoutError as error:
            raise CommTimeoutError(f"{error} during {phase}", peers=error.peers, phase=phase) from None


# ---- peer buffers: virtual ranks, or NVSHMEM symmetric memory ----------------------------------
class PeerBuffers:
    """One communication buffer per rank, as this process addresses them (low-latency engine).

    ``group=None``: ``num_ranks`` virtual ranks, every buffer allocated here (tests, one GPU).
    Otherwise one NVSHMEM symmetric buffer per PE of ``group``; ``peers[r]`` is ``nvshmem_ptr``
    (0 where PE ``r`` is not load/store reachable, e.g. on another node).

    Attributes:
        peers: ``[R]`` device addresses. local_ranks: the ranks this process runs.
        symmetric: this PE's symmetric buffer address (0 for virtual ranks).
    """

    def __init__(self, nbytes: int, num_ranks: int, device: torch.device,
                 group: dist.ProcessGroup | None, settings: NvshmemSettings | None) -> None:
        self.cuda = _cuda()
        self.symmetric = 0
        self._tensors: list[torch.Tensor] = []
        if group is None:
            self._tensors = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(num_ranks)]
            self.peers = [int(t.data_ptr()) for t in self._tensors]
            self.local_ranks = list(range(num_ranks))
            return
        pe, n = init_nvshmem(group, settings)
        if n != num_ranks:
            raise ValueError(f"NVSHMEM has {n} PEs, expected {num_ranks}")
        self.symmetric = self.cuda.nvshmem_malloc(nbytes)
        self.peers = [int(self.cuda.nvshmem_ptr(self.symmetric, r)) for r in range(num_ranks)]
        self.local_ranks = [pe]

    def close(self) -> None:
        """Frees the buffers (``nvshmem_free`` is collective over the PEs)."""
        if self.symmetric:
            torch.cuda.synchronize()
            self.cuda.nvshmem_free(self.symmetric)
            self.symmetric = 0
        self._tensors = []


def _group_size(group: dist.ProcessGroup | None, num_ranks: int) -> int:
    return num_ranks if group is None else dist.get_world_size(group)


# ---- normal mode through peer buffers -----------------------------------------------------------
@dataclass(frozen=True)
class IntranodeHandle:
    """What the combine needs from a dispatch, per rank: its meta, mask and token count."""

    meta: torch.Tensor
    is_token_in_rank: torch.Tensor
    num_tokens: int
    num_recv: int


class IntranodeEngine:
    """Layout, dispatch and combine among up to 8 ranks whose buffers this process can address.

    With ``group=None`` it allocates ``num_ranks`` buffers on this process's GPU and runs every
    rank here (virtual ranks: one launch covers all ranks, each rank gets ``2 * num_channels``
    blocks, so keep ``num_ranks * 2 * num_channels`` below the SM count). With a group, each
    process runs its own rank over buffers mapped with CUDA IPC (``cuda_ipc.IpcPeerBuffers``;
    NVLink peers or processes sharing one GPU); construction and ``close()`` are then collective,
    and every rank must make the same sequence of calls. No extra barrier is needed between
    calls: the notify and the combine start with a barrier across the ranks that every rank joins
    only after its previous kernels finished (stream order), and a rank resets only its own rings.
    Lists passed to the calls hold one entry per rank in ``local_ranks``.
    """

    def __init__(self, num_ranks: int, placement: ExpertPlacement, device: torch.device,
                 num_topk: int, max_hidden_bytes: int, num_channels: int = 4, ring_slots: int = 64,
                 timeout_s: float = 60.0, max_scales: int = 0,
                 group: dist.ProcessGroup | None = None) -> None:
        num_ranks = _group_size(group, num_ranks)
        if not 1 <= num_ranks <= 8:
            raise ValueError(f"the intranode engine runs 1..8 ranks, got {num_ranks}")
        if ring_slots < 8:
            raise ValueError("ring_slots must be >= 8")
        if not 1 <= num_topk <= 32:
            raise ValueError(f"num_topk must be in [1, 32], got {num_topk}")
        self.cuda, host = _cuda(), _host()
        self.num_ranks, self.placement, self.device = num_ranks, placement, torch.device(device)
        self.num_topk, self.num_channels, self.timeout_ns = num_topk, num_channels, int(timeout_s * 1e9)
        self.max_local = int(placement.num_local_experts.max())
        dispatch_row = host.routing_row_layout(max_hidden_bytes, max_scales, num_topk, True, True, True)
        combine_row = host.routing_row_layout(max_hidden_bytes, 0, num_topk, False, True, False)
        self.row_bytes = max(dispatch_row["row_bytes"], combine_row["row_bytes"])
        self.max_hidden_bytes, self.max_scales = max_hidden_bytes, max_scales
        self.ring_slots = ring_slots
        lay = host.routing_intranode_layout(num_ranks, num_channels, self.max_local, ring_slots,
                                            self.row_bytes)
        if group is None:
            self.buffers: PeerBuffers | IpcPeerBuffers = PeerBuffers(lay["total_bytes"], num_ranks,
                                                                     self.device, None, None)
        else:
            self.buffers = IpcPeerBuffers(int(lay["total_bytes"]), group, self.device)
        self.local_ranks = self.buffers.local_ranks
        self.e2r = placement.expert_to_rank.to(self.device, torch.int32)
        self.e2l = placement.expert_to_local.to(self.device, torch.int32)
        self.records = [TimeoutRecord() for _ in self.local_ranks]
        self.barrier_value = 0
        self.last_kernel_ms = 0.0  # the last dispatch / combine kernel launch (CUDA events)

    def _common(self) -> dict:
        self.barrier_value += 1
        return {"peers": self.buffers.peers, "expert_to_rank": _ptr(self.e2r),
                "expert_to_local": _ptr(self.e2l), "num_ranks": self.num_ranks,
                "num_channels": self.num_channels, "max_local_experts": self.max_local,
                "num_experts": self.placement.num_experts, "num_topk": self.num_topk,
                "ring_slots": self.ring_slots, "row_bytes": self.row_bytes,
                "timeout_ns": self.timeout_ns, "barrier_value": self.barrier_value}

    def _finish(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()
        for record in self.records:
            record.check()

    def close(self) -> None:
        """Releases the peer buffers (collective with a group: see ``IpcPeerBuffers.close``)."""
        self.buffers.close()

    def get_dispatch_layout(self, topk_idx: torch.Tensor, ranks_per_node: int = 8
                            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``layout.compute_dispatch_layout`` on the GPU for one rank's ``[N, K]`` int64 routing."""
        topk = topk_idx.to(self.device, torch.int64).contiguous()
        n, r, e = topk.shape[0], self.num_ranks, self.placement.num_experts
        per_rank = torch.empty(r, dtype=torch.int32, device=self.device)
        nodes = r // ranks_per_node if r > ranks_per_node and r % ranks_per_node == 0 else 0
        per_node = torch.empty(nodes, dtype=torch.int32, device=self.device) if nodes else None
        per_expert = torch.empty(e, dtype=torch.int32, device=self.device)
        mask = torch.empty(n, r, dtype=torch.bool, device=self.device)
        self.cuda.dispatch_layout({"topk_idx": _ptr(topk), "expert_to_rank": _ptr(self.e2r),
                                   "num_tokens": n, "num_topk": topk.shape[1], "num_experts": e,
                                   "num_ranks": r, "ranks_per_node": ranks_per_node,
                                   "num_tokens_per_rank": _ptr(per_rank),
                                   "num_tokens_per_rdma_rank": _ptr(per_node),
                                   "num_tokens_per_expert": _ptr(per_expert),
                                   "is_token_in_rank": _ptr(mask)}, _stream(self.device))
        return per_rank, per_node, per_expert, mask

    def dispatch(self, xs: list[torch.Tensor], topk_idx: list[torch.Tensor],
                 topk_weights: list[torch.Tensor | None], x_scales: list[torch.Tensor] | None = None,
                 threads: int = 256) -> list[dict]:
        """Dispatches every virtual rank's tokens; returns per rank ``{"recv_x", "recv_scales",
        "recv_topk_idx", "recv_topk_weights", "recv_src_idx", "num_recv_tokens_per_expert",
        "recv_counts", "layout", "handle"}`` with rows ordered by source rank, then source token.
        ``recv_counts`` is ``[R]`` int64 (CPU), rows from each source rank; ``layout`` is this
        rank's ``(num_tokens_per_rank [R], None, num_tokens_per_expert [E], is_token_in_rank
        [N, R])``."""
        r, c, k = self.num_ranks, self.num_channels, self.num_topk
        hidden_bytes = xs[0].shape[1] * xs[0].element_size()
        if hidden_bytes % 16 or hidden_bytes > self.max_hidden_bytes:
            raise ValueError(f"x rows must be a multiple of 16 bytes and <= {self.max_hidden_bytes}")
        num_scales = 0 if x_scales is None else x_scales[0].shape[1]
        if num_scales > self.max_scales:
            raise ValueError(f"x_scales has {num_scales} columns, the engine was sized for {self.max_scales}")
        layouts = [self.get_dispatch_layout(t) for t in topk_idx]
        metas = [torch.empty(self.cuda.intranode_meta_words(r, c, self.max_local), dtype=torch.int32,
                             device=self.device) for _ in self.local_ranks]
        for rec in self.records:
            rec.reset()
        common = self._common()
        self.cuda.intranode_notify(common, [
            {"rank": rank, "num_tokens": topk_idx[i].shape[0], "is_token_in_rank": _ptr(layouts[i][3]),
             "num_tokens_per_expert": _ptr(layouts[i][2]), "meta": _ptr(metas[i]),
             "record": self.records[i].ptr} for i, rank in enumerate(self.local_ranks)],
            _stream(self.device))
        self._finish()
        metas_cpu = [m.cpu() for m in metas]
        outs, ranks = [], []
        for i, rank in enumerate(self.local_ranks):
            m = int(metas_cpu[i][-1])
            x = xs[i].contiguous()
            out = {"recv_x": torch.empty(m, *x.shape[1:], dtype=x.dtype, device=self.device),
                   "recv_scales": (torch.empty(m, num_scales, dtype=torch.float32, device=self.device)
                                   if num_scales else None),
                   "recv_topk_idx": torch.empty(m, k, dtype=torch.int64, device=self.device),
                   "recv_topk_weights": (torch.empty(m, k, dtype=torch.float32, device=self.device)
                                         if topk_weights[i] is not None else None),
                   "recv_src_idx": torch.empty(m, dtype=torch.int32, device=self.device)}
            local = self.placement.num_local_experts[rank]
            out["num_recv_tokens_per_expert"] = metas_cpu[i][r * c: r * c + int(local)].tolist()
            out["recv_counts"] = metas_cpu[i][: r * c].view(r, c).sum(1, dtype=torch.int64)
            out["layout"] = layouts[i]
            out["handle"] = IntranodeHandle(metas[i], layouts[i][3], x.shape[0], m)
            w = topk_weights[i]
            out["_keep"] = (x, topk_idx[i].to(self.device, torch.int64).contiguous(),
                            None if w is None else w.to(torch.float32).contiguous(),
                            x_scales[i].to(torch.float32).contiguous() if x_scales else None)
            outs.append(out)
            keep = out["_keep"]
            ranks.append({"rank": rank, "num_tokens": x.shape[0], "x": _ptr(keep[0]),
                          "x_scales": _ptr(keep[3]),
                          "topk_idx": _ptr(keep[1]), "topk_weights": _ptr(keep[2]),
                          "is_token_in_rank": _ptr(layouts[i][3]), "meta": _ptr(metas[i]),
                          "recv_x": _ptr(out["recv_x"]), "recv_scales": _ptr(out["recv_scales"]),
                          "recv_topk_idx": _ptr(out["recv_topk_idx"]),
                          "recv_topk_weights": _ptr(out["recv_topk_weights"]),
                          "recv_src_idx": _ptr(out["recv_src_idx"]), "record": self.records[i].ptr})
        with _KernelTimer(self.device) as timer:
            self.cuda.intranode_dispatch(self._common(), ranks, hidden_bytes, num_scales, threads,
                                         _stream(self.device))
        self._finish()
        self.last_kernel_ms = timer.ms
        for out in outs:
            out.pop("_keep")
        return outs

    def combine(self, xs: list[torch.Tensor], handles: list[IntranodeHandle],
                topk_weights: list[torch.Tensor | None] | None = None
                ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Sums each token's returned rows on its source rank: per rank ``(combined_x [N, H],
        combined_topk_weights [N, K] or None)``."""
        dtype = xs[0].dtype
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"combine supports bfloat16 and float32, got {dtype}")
        hidden = xs[0].shape[1]
        if hidden * xs[0].element_size() > self.max_hidden_bytes or (hidden * xs[0].element_size()) % 16:
            raise ValueError("combine rows must be a multiple of 16 bytes within the engine's size")
        weights = topk_weights or [None] * len(self.local_ranks)
        outs, ranks, keep = [], [], []
        for i, (rank, h) in enumerate(zip(self.local_ranks, handles)):
            x = xs[i].contiguous()
            w = None if weights[i] is None else weights[i].to(torch.float32).contiguous()
            cx = torch.empty(h.num_tokens, hidden, dtype=dtype, device=self.device)
            cw = None if w is None else torch.empty(h.num_tokens, self.num_topk, dtype=torch.float32,
                                                    device=self.device)
            keep.append((x, w))
            outs.append((cx, cw))
            ranks.append({"rank": rank, "num_tokens": h.num_tokens, "x": _ptr(x), "topk_weights": _ptr(w),
                          "is_token_in_rank": _ptr(h.is_token_in_rank), "meta": _ptr(h.meta),
                          "combined_x": _ptr(cx), "combined_topk_weights": _ptr(cw),
                          "record": self.records[i].ptr})
        for rec in self.records:
            rec.reset()
        with _KernelTimer(self.device) as timer:
            self.cuda.intranode_combine(self._common(), ranks, hidden,
                                        0 if dtype == torch.bfloat16 else 1, _stream(self.device))
        self._finish()
        self.last_kernel_ms = timer.ms
        return outs


# ---- low-latency mode ---------------------------------------------------------------------------
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
    preceded by an NVSHMEM barrier on the stream: a rank's next send must not overwrite a peer's
    staging rows or re-arm its flags while that peer still receives the previous call (two
    dispatches, or two combines, in a row). Virtual ranks run in stream order and need none.
    """

    def __init__(self, num_ranks: int, placement: ExpertPlacement, device: torch.device,
                 max_tokens: int, hidden: int, num_topk: int, timeout_s: float = 60.0,
                 group: dist.ProcessGroup | None = None, settings: NvshmemSettings | None = None) -> None:
        num_ranks = _group_size(group, num_ranks)
        if not 1 <= num_ranks <= 8:
            raise ValueError(f"the low-latency engine runs 1..8 ranks per process, got {num_ranks}")
        if hidden % 128:
            raise ValueError(f"hidden must be a multiple of 128, got {hidden}")
        self.cuda, host = _cuda(), _host()
        self.num_ranks, self.placement, self.device = num_ranks, placement, torch.device(device)
        self.max_tokens, self.hidden, self.num_topk = max_tokens, hidden, num_topk
        self.max_local = int(placement.num_local_experts.max())
        lay = host.routing_low_latency_layout(num_ranks, self.max_local, placement.num_experts,
                                              max_tokens, num_topk, hidden)
        self.buffers = PeerBuffers(lay["total_bytes"], num_ranks, self.device, group, settings)
        self.local_ranks = self.buffers.local_ranks
        self.multi_process = group is not None
        self.e2r = placement.expert_to_rank.to(self.device, torch.int32)
        self.e2l = placement.expert_to_local.to(self.device, torch.int32)
        self.records = [TimeoutRecord() for _ in self.local_ranks]
        self.timeout_ns = int(timeout_s * 1e9)

    def _common(self) -> dict:
        return {"peers": self.buffers.peers, "symmetric_base": self.buffers.symmetric or None,
                "expert_to_rank": _ptr(self.e2r), "expert_to_local": _ptr(self.e2l),
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
        """Waits for the stream, but not forever: the NVSHMEM barrier before a send has no
        timeout of its own, so a peer that never calls would hang the stream. After the
        kernels' timeout (plus a grace period) this raises ``CommTimeoutError``, naming the peer
        when a kernel recorded one."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        started = time.monotonic()
        deadline = started + self.timeout_ns / 1e9 + 5.0
        while not event.query():
            if time.monotonic() > deadline:
                for record in self.records:
                    record.check()
                raise CommTimeoutError(
                    f"ep_comm low_latency/barrier: rank {self.local_ranks[0]} waited "
                    f"{time.monotonic() - started:.1f}s at the NVSHMEM barrier before a send; a peer "
                    "did not call (could not tell which; the GPU stream stays blocked)", peers=[],
                    phase="low_latency/barrier")
            time.sleep(0)

    def _before_send(self) -> None:
        for rec in self.records:
            rec.reset()
        if self.multi_process:
            self.cuda.nvshmem_barrier_on_stream(_stream(self.device))

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
        self.cuda.low_latency_dispatch_send(self._common(), ranks, *launch.flags, _stream(self.device))
        return results, launch

    def finish_dispatch(self, launch: LowLatencyLaunch) -> None:
        """Launches the receive phase, waits for it and raises what the kernels recorded."""
        self.cuda.low_latency_dispatch_recv(self._common(), launch.ranks, *launch.flags, _stream(self.device))
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
                "num_local_experts": int(self.placement.num_local_experts[rank]), "x": _ptr(x),
                "topk_idx": _ptr(topk), "topk_weights": _ptr(weights), "recv_x": _ptr(res.recv_x),
                "recv_scales": _ptr(res.recv_scales), "recv_count": _ptr(res.recv_count),
                "recv_src_info": _ptr(res.recv_src_info), "recv_topk_slot": _ptr(res.recv_topk_slot),
                "layout_range": _ptr(res.layout_range), "combined_x": _ptr(combined),
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
        self.cuda.low_latency_combine_send(self._common(), ranks, _stream(self.device))
        return results, launch

    def finish_combine(self, launch: LowLatencyLaunch) -> None:
        """Launches the receive (weighted sum), waits for it and raises what the kernels recorded."""
        self.cuda.low_latency_combine_recv(self._common(), launch.ranks, _stream(self.device))
        self._check()

    def combine(self, xs: list[torch.Tensor], topk_idx: list[torch.Tensor],
                topk_weights: list[torch.Tensor], handles: list[LowLatencyResult]) -> list[torch.Tensor]:
        """``xs[i]`` is rank i's ``[L_i, R*T, H]`` bf16 expert output; returns ``[N, H]`` bf16 each."""
        outs, launch = self.start_combine(xs, topk_idx, topk_weights, handles)
        self.finish_combine(launch)
        return outs


# ---- two-hop (node-aware) normal mode over NVSHMEM ----------------------------------------------
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
    """

    def __init__(self, num_ranks: int, ranks_per_node: int, placement: ExpertPlacement,
                 device: torch.device, group: dist.ProcessGroup, max_tokens: int, max_x_bytes: int,
                 num_topk: int, timeout_s: float = 60.0, settings: NvshmemSettings | None = None) -> None:
        if not 1 <= ranks_per_node <= MAX_NODE_RANKS or num_ranks <= 0 or num_ranks % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be in [1, {MAX_NODE_RANKS}] and divide "
                             f"num_ranks={num_ranks}")
        world = dist.get_world_size(group)
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
        self.cuda, host = _cuda(), _host()
        self.num_ranks, self.ranks_per_node = num_ranks, ranks_per_node
        self.num_nodes = num_ranks // ranks_per_node
        self.placement, self.device = placement, torch.device(device)
        self.max_tokens, self.num_topk = max_tokens, num_topk
        self.row_bytes = TwoHopRows(max_x_bytes, num_topk).payload_bytes
        self.layout = host.hier_two_hop_layout(num_ranks, ranks_per_node, max_tokens,
                                               self.num_nodes * max_tokens, self.row_bytes)
        self.pe, n_pes = init_nvshmem(group, settings)
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
        if self.symmetric or self.staging:
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

    def _finish(self) -> None:
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
        args = {"rank": rank, "node_peers": self._node_peers(rank), "send_rows": _ptr(send),
                **{k: _ptr(v) for k, v in arrays.items()}, "recv_rows": _ptr(recv),
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
        from ..hierarchical import virtual_node_plans
        from ..layout import compute_dispatch_layout

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
        self.cuda.two_hop_dispatch(self._common(fmt.payload_bytes), [e[0] for e in entries], _stream(self.device))
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
        self.cuda.two_hop_dispatch(self._common(fmt.payload_bytes), [args], _stream(self.device))
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
        args = {"rank": rank, "node_peers": self._node_peers(rank), "x": _ptr(rows),
                "ret_row": _ptr(h.ret_row), "ret_offsets": _ptr(h.ret_offsets),
                "rail_offsets": _ptr(h.rail_offsets), "red_offsets": _ptr(h.red_offsets),
                "red_stage_row": _ptr(h.red_stage_row), "partial": _ptr(partial),
                "src_offsets": _ptr(h.src_offsets), "src_stage_row": _ptr(h.src_stage_row),
                "num_tokens": h.num_tokens, "combined_x": _ptr(cx), "combined_weights": _ptr(cw),
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
        self.cuda.two_hop_combine(self._common(layout[2]), fmt, args, _stream(self.device))
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
