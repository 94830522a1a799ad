"""``IntranodeEngine``: normal-mode layout/dispatch/combine through peer buffers (NVLink peers
mapped with CUDA IPC, ``cuda_ipc.py``, or ``R`` virtual ranks of one process on one GPU for
tests), fused into the kernels of ``csrc/cuda/layout.cu`` and ``intranode.cu``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..placement import ExpertPlacement
from .cuda_ipc import IpcApi, IpcPeerBuffers, IpcTensorExchange
from .runtime import (
    KernelTimer,
    NvshmemSettings,
    TimeoutRecord,
    aligned_ptr,
    cuda_module,
    host_module,
    init_nvshmem,
    ptr_or_none,
    stream_handle,
)


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
        self.cuda = cuda_module()
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


class HostTimer:
    """Wall-clock time of launches that run on the host (the CUDA emulation): ``ms`` after the block."""

    def __enter__(self) -> "HostTimer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ms = (time.perf_counter() - self.start) * 1e3


# ---- normal mode through peer buffers -----------------------------------------------------------
_DISPATCH, _COMBINE = 1, 2  # the kinds of IpcTensorExchange.exchange's calls


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

    ``copy``: ``"direct"`` (the default for virtual ranks, which address each other's outputs) has
    each sender write every row at its final place in the receiver's outputs and the combine read
    each returned row from its sender's tensor: no ring, no waits, a row crosses memory once each
    way. ``"ring"`` streams rows through the peer buffers' rings; it is the default with a group
    until a GPU run has compared the two there (docs/gpu.md). With a group, ``"direct"`` maps the
    tensors of each call into the peers' processes (``cuda_ipc.IpcTensorExchange``: an all-gather of
    IPC handles over the group before the kernel and a barrier after it); when a rank cannot export
    one of its tensors (e.g. torch's expandable segments), every rank runs that call through the
    rings. ``last_copy`` says which copy the last dispatch or combine used.

    ``warps_per_peer`` (1, 2 or 3; ring copy): warps of a ring kernel's block per peer, each with a
    sub-ring of its own (rows i = m mod W of the ring go to its warp m): more rows in flight per
    peer, blocks of 32 * ranks * warps_per_peer threads (at most 512), and ring_slots of at least
    ``warps_per_peer * ceil(8 / warps_per_peer)``.

    ``kernels``: the bindings to launch instead of ``ep_comm._cuda``'s (the same functions); with
    the kernels built through the CUDA emulation (tests/support/emulated_cuda.py) ``device`` may be
    the CPU, the virtual ranks' buffers then in host memory. ``ipc_api``: with a group, the CUDA IPC
    calls (``cuda_ipc.IpcApi``; ``CudaRuntimeIpc`` when None) and the allocator of the tensors the
    peers address (outputs, meta); a host-memory stand-in lets a CPU ``device`` run a group.
    """

    def __init__(self, num_ranks: int, placement: ExpertPlacement, device: torch.device,
                 num_topk: int, max_hidden_bytes: int, num_channels: int = 4, ring_slots: int = 64,
                 timeout_s: float = 60.0, max_scales: int = 0,
                 group: dist.ProcessGroup | None = None, kernels=None, copy: str | None = None,
                 warps_per_peer: int = 1, ipc_api: IpcApi | None = None) -> None:
        num_ranks = _group_size(group, num_ranks)
        copy = copy or ("direct" if group is None else "ring")
        if copy not in ("ring", "direct"):
            raise ValueError(f"copy must be 'ring' or 'direct', got {copy!r}")
        if ipc_api is not None and group is None:
            raise ValueError("ipc_api maps buffers between the processes of a group: pass group= too")
        self.copy = copy
        self.last_copy: str | None = None
        if not 1 <= num_ranks <= 8:
            raise ValueError(f"the intranode engine runs 1..8 ranks, got {num_ranks}")
        if ring_slots < 8:
            raise ValueError("ring_slots must be >= 8")
        if warps_per_peer not in (1, 2, 3):
            raise ValueError(f"warps_per_peer must be 1, 2 or 3, got {warps_per_peer!r}")
        if 32 * num_ranks * warps_per_peer > 512:
            raise ValueError(f"warps_per_peer={warps_per_peer} with {num_ranks} ranks needs "
                             f"{32 * num_ranks * warps_per_peer} threads per block; at most 512")
        if ring_slots < warps_per_peer * -(-8 // warps_per_peer):
            raise ValueError(f"ring_slots must be >= {warps_per_peer * -(-8 // warps_per_peer)} with "
                             f"warps_per_peer={warps_per_peer}, got {ring_slots}")
        self.warps_per_peer = warps_per_peer
        if not 1 <= num_topk <= 32:
            raise ValueError(f"num_topk must be in [1, 32], got {num_topk}")
        self.device = torch.device(device)
        if self.device.type != "cuda" and (kernels is None or (group is not None and ipc_api is None)):
            raise ValueError(f"device must be a CUDA device, got {self.device} (a CPU device runs the kernels "
                             "built through the CUDA emulation: pass them as kernels=, and with a group an "
                             "ipc_api mapping host memory between the processes)")
        self.cuda, host = (cuda_module() if kernels is None else kernels), host_module()
        self.num_ranks, self.placement = num_ranks, placement
        self.num_topk, self.num_channels, self.timeout_ns = num_topk, num_channels, int(timeout_s * 1e9)
        self.max_local = int(placement.num_local_experts.max())
        dispatch_row = host.routing_row_layout(max_hidden_bytes, max_scales, num_topk, True, True, True)
        combine_row = host.routing_row_layout(max_hidden_bytes, 0, num_topk, False, True, False)
        self.row_bytes = max(dispatch_row["row_bytes"], combine_row["row_bytes"])
        self.max_hidden_bytes, self.max_scales = max_hidden_bytes, max_scales
        self.ring_slots = ring_slots
        lay = host.routing_intranode_layout(num_ranks, num_channels, self.max_local, ring_slots,
                                            self.row_bytes)
        self.exchange: IpcTensorExchange | None = None
        if group is not None:  # a rank on the rings and a rank on direct writes would never meet
            chosen: list[object] = [None] * num_ranks
            dist.all_gather_object(chosen, copy, group=group)
            if len(set(chosen)) > 1:
                raise ValueError("copy must be the same on every rank: "
                                 + ", ".join(f"rank {r} {c!r}" for r, c in enumerate(chosen)))
        if group is None:
            self.buffers: PeerBuffers | IpcPeerBuffers = PeerBuffers(lay["total_bytes"], num_ranks,
                                                                     self.device, None, None)
            self._empty = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=self.device)
        else:
            self.buffers = IpcPeerBuffers(int(lay["total_bytes"]), group, self.device, api=ipc_api)
            self._empty = self.buffers.api.empty
            if copy == "direct":
                self.exchange = IpcTensorExchange(group, self.buffers.api, self.device)
        self.local_ranks = self.buffers.local_ranks
        self.e2r = placement.expert_to_rank.to(self.device, torch.int32)
        self.e2l = placement.expert_to_local.to(self.device, torch.int32)
        self.records = [TimeoutRecord() for _ in self.local_ranks]
        self.barrier_value = 0
        self.last_kernel_ms = 0.0  # the last dispatch / combine kernel launch (CUDA events)

    def _common(self) -> dict:
        self.barrier_value += 1
        return {"peers": self.buffers.peers, "expert_to_rank": ptr_or_none(self.e2r),
                "expert_to_local": ptr_or_none(self.e2l), "num_ranks": self.num_ranks,
                "num_channels": self.num_channels, "max_local_experts": self.max_local,
                "num_experts": self.placement.num_experts, "num_topk": self.num_topk,
                "ring_slots": self.ring_slots, "row_bytes": self.row_bytes,
                "timeout_ns": self.timeout_ns, "barrier_value": self.barrier_value,
                "warps_per_peer": self.warps_per_peer}

    def _stream(self) -> int:
        return stream_handle(self.device) if self.device.type == "cuda" else 0

    def _timer(self):
        return KernelTimer(self.device) if self.device.type == "cuda" else HostTimer()

    def _finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for record in self.records:
            record.check()

    def close(self) -> None:
        """Releases the peer buffers and the mappings of the peers' tensors (collective with a
        group: see ``IpcPeerBuffers.close``)."""
        if self.exchange is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.exchange.close()
            self.exchange = None
        self.buffers.close()

    def _owned(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t`` as a contiguous ``dtype`` tensor: itself when it is one, else a copy the engine's
        allocator holds (which a peer can map)."""
        if t.dtype == dtype and t.is_contiguous():
            return t
        out = self._empty(tuple(t.shape), dtype)
        out.copy_(t)
        return out

    def _launch_direct(self, launch, entries: list[dict], peer_keys: tuple[str, ...],
                       local_tensors: list[torch.Tensor | None], kind: int, *args) -> bool:
        """Runs a direct kernel: ``entries`` are the local ranks' (every rank for virtual ranks). With
        a group the peers' entries come from the per-call exchange of ``local_tensors`` (the tensors
        named by ``peer_keys``, in order); returns False, having launched nothing, when a rank could
        not export them (every rank then takes the rings for this call)."""
        if self.exchange is None:
            with self._timer() as timer:
                launch(self._common(), entries, *args, self._stream(), 0, len(entries))
            self._finish()
            self.last_kernel_ms = timer.ms
            return True
        (local,) = entries
        me = local["rank"]
        # the peers address these tensors from the exchange on: each is complete (the caller
        # synchronised this rank's stream), and the peers' ones are too once the exchange returns
        failure = ""
        try:
            peers = self.exchange.exchange(kind, local_tensors)
        except RuntimeError as error:  # an import failed here: the peers learn it at the barrier
            peers, failure = [], f"mapping the peers' tensors: {error}"
        if peers is None:
            return False
        common = self._common()
        if not failure:
            try:
                full = [local if r == me else {"rank": r, **dict(zip(peer_keys, addresses))}
                        for r, addresses in enumerate(peers)]
                with self._timer() as timer:
                    launch(common, full, *args, self._stream(), me, 1)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                self.last_kernel_ms = timer.ms
            except RuntimeError as error:
                failure = str(error)
        # every rank joins this barrier after its kernel finished: once it returns, no peer writes
        # this rank's outputs (dispatch) or reads its x, weights or meta (combine) any more, so the
        # caller may read, free or reuse them
        self.exchange.finish(failure)
        self._finish()
        return True

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
        self.cuda.dispatch_layout({"topk_idx": ptr_or_none(topk), "expert_to_rank": ptr_or_none(self.e2r),
                                   "num_tokens": n, "num_topk": topk.shape[1], "num_experts": e,
                                   "num_ranks": r, "ranks_per_node": ranks_per_node,
                                   "num_tokens_per_rank": ptr_or_none(per_rank),
                                   "num_tokens_per_rdma_rank": ptr_or_none(per_node),
                                   "num_tokens_per_expert": ptr_or_none(per_expert),
                                   "is_token_in_rank": ptr_or_none(mask)}, self._stream())
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
        metas = [self._empty((self.cuda.intranode_meta_words(r, c, self.max_local),), torch.int32)
                 for _ in self.local_ranks]
        for rec in self.records:
            rec.reset()
        common = self._common()
        self.cuda.intranode_notify(common, [
            {"rank": rank, "num_tokens": topk_idx[i].shape[0], "is_token_in_rank": ptr_or_none(layouts[i][3]),
             "num_tokens_per_expert": ptr_or_none(layouts[i][2]), "meta": ptr_or_none(metas[i]),
             "record": self.records[i].ptr} for i, rank in enumerate(self.local_ranks)],
            self._stream())
        # stream synchronised: the outputs allocated below are memory no kernel of this rank still
        # uses, so peers (direct copy) may write them as soon as they have their addresses
        self._finish()
        metas_cpu = [m.cpu() for m in metas]
        outs, ranks = [], []
        for i, rank in enumerate(self.local_ranks):
            m = int(metas_cpu[i][-1])
            x = xs[i].contiguous()
            out = {"recv_x": self._empty((m, *x.shape[1:]), x.dtype),
                   "recv_scales": self._empty((m, num_scales), torch.float32) if num_scales else None,
                   "recv_topk_idx": self._empty((m, k), torch.int64),
                   "recv_topk_weights": (self._empty((m, k), torch.float32)
                                         if topk_weights[i] is not None else None),
                   "recv_src_idx": self._empty((m,), torch.int32)}
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
            ranks.append({"rank": rank, "num_tokens": x.shape[0], "x": aligned_ptr(keep[0], f"x of rank {rank}"),
                          "x_scales": ptr_or_none(keep[3]),
                          "topk_idx": ptr_or_none(keep[1]), "topk_weights": ptr_or_none(keep[2]),
                          "is_token_in_rank": ptr_or_none(layouts[i][3]), "meta": ptr_or_none(metas[i]),
                          "recv_x": ptr_or_none(out["recv_x"]), "recv_scales": ptr_or_none(out["recv_scales"]),
                          "recv_topk_idx": ptr_or_none(out["recv_topk_idx"]),
                          "recv_topk_weights": ptr_or_none(out["recv_topk_weights"]),
                          "recv_src_idx": ptr_or_none(out["recv_src_idx"]), "record": self.records[i].ptr})
        self.last_copy = "ring"
        if self.copy == "direct":
            keys = ("meta", "recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights", "recv_src_idx")
            mine = [metas[0]] + [outs[0][key] for key in keys[1:]]
            if self._launch_direct(self.cuda.intranode_dispatch_direct, ranks, keys, mine, _DISPATCH,
                                   hidden_bytes, num_scales, threads):
                self.last_copy = "direct"
        if self.last_copy == "ring":
            with self._timer() as timer:
                self.cuda.intranode_dispatch(self._common(), ranks, hidden_bytes, num_scales, threads, self._stream())
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
            x = self._owned(xs[i], xs[i].dtype)
            w = None if weights[i] is None else self._owned(weights[i], torch.float32)
            cx = torch.empty(h.num_tokens, hidden, dtype=dtype, device=self.device)
            cw = None if w is None else torch.empty(h.num_tokens, self.num_topk, dtype=torch.float32,
                                                    device=self.device)
            keep.append((x, w))
            outs.append((cx, cw))
            ranks.append({"rank": rank, "num_tokens": h.num_tokens, "x": aligned_ptr(x, f"x of rank {rank}"),
                          "topk_weights": ptr_or_none(w),
                          "is_token_in_rank": ptr_or_none(h.is_token_in_rank), "meta": ptr_or_none(h.meta),
                          "combined_x": ptr_or_none(cx), "combined_topk_weights": ptr_or_none(cw),
                          "record": self.records[i].ptr})
        for rec in self.records:
            rec.reset()
        code = 0 if dtype == torch.bfloat16 else 1
        self.last_copy = "ring"
        if self.copy == "direct":
            if self.exchange is not None and self.device.type == "cuda":
                # x and the weights are complete before their addresses go to the peers
                torch.cuda.current_stream(self.device).synchronize()
            mine = [keep[0][0], keep[0][1], handles[0].meta]
            if self._launch_direct(self.cuda.intranode_combine_direct, ranks, ("x", "topk_weights", "meta"),
                                   mine, _COMBINE, hidden, code):
                self.last_copy = "direct"
        if self.last_copy == "ring":
            with self._timer() as timer:
                self.cuda.intranode_combine(self._common(), ranks, hidden, code, self._stream())
            self._finish()
            self.last_kernel_ms = timer.ms
        return outs


# ---- low-latency mode ---------------------------------------------------------------------------
