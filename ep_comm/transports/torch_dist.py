"""Portable transport: ``torch.distributed.all_to_all_single`` with split sizes.

The same code runs on gloo (CPU), NCCL (NVIDIA) and RCCL (AMD). A gloo group with GPU tensors
(mixed-vendor jobs) is host-staged: payloads go through CPU memory.
"""
from __future__ import annotations

import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError
from .base import PendingExchange, Transport
from .host_staged import DEFAULT_CHUNK_BYTES, PinnedPool, staged_all_to_all
from .job_store import store_lost


class TorchDistTransport(Transport):
    """All-to-all over a ``torch.distributed`` process group with a bounded wait.

    Every wait is bounded by ``timeout_s``. When it runs out, the surviving ranks find who is
    missing through the job's key-value store (each survivor writes a marker; a rank that writes
    none within a short grace period is named) and raise ``CommTimeoutError``.
    """

    name = "torch"
    staging_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Chunk size of the host-staged pipeline (GPU payloads over gloo)."""
    _pinned: PinnedPool | None = None
    store: dist.Store | None = None
    """The store that names missing peers (the Buffer sets its job store; None: the default
    process group's)."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, device: torch.device,
                 instance_id: str) -> None:
        super().__init__(dist.get_rank(group), dist.get_world_size(group), device)
        self.group: dist.ProcessGroup | None = group
        self.gloo: object | None = None  # a bare gloo backend (see with_gloo_backend)
        self.timeout_s = float(timeout_s)
        self.backend_name = str(dist.get_backend(group))
        self.host_staged = self.backend_name == "gloo"
        self.instance_id = instance_id
        self._incidents = 0

    @classmethod
    def with_gloo_backend(cls, store: dist.Store, rank: int, size: int, timeout_s: float,
                          instance_id: str) -> "TorchDistTransport":
        """A transport over a gloo backend that rendezvouses under ``store`` (a prefix store whose
        name the members agree on), independent of ``torch.distributed``'s group registry."""
        from datetime import timedelta

        self = cls.__new__(cls)
        Transport.__init__(self, rank, size, torch.device("cpu"))
        self.group = None
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
        self.timeout_s = float(timeout_s)
        self.backend_name = "gloo"
        self.host_staged = True
        self.instance_id = instance_id
        self._incidents = 0
        return self

    def _all_to_all(self, recv: torch.Tensor, send: torch.Tensor, recv_splits: list[int] | None,
                    send_splits: list[int] | None):
        if self.gloo is not None:
            return self.gloo.alltoall_base(recv, send, recv_splits or [], send_splits or [],  # type: ignore[attr-defined]
                                           dist.AllToAllOptions())
        return dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group, async_op=True)

    @staticmethod
    def agree_instance_id(group: dist.ProcessGroup) -> str:
        """A name all ranks of ``group`` share, for this Buffer's keys in the store."""
        box = [uuid.uuid4().hex if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return str(box[0])

    # -- exchanges -------------------------------------------------------------------------
    def exchange_bytes(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                       phase: str, out: torch.Tensor | None = None) -> PendingExchange:
        if send.dtype != torch.uint8 or send.dim() != 1:
            raise ValueError("transport payloads are 1-D uint8 tensors")
        if self.host_staged and send.device.type != "cpu":
            return self._exchange_staged(send, send_splits, recv_splits, phase)
        # gloo stages through host memory; NCCL/RCCL take tensors on the group's device only, so
        # every message (count tables built on the CPU included) moves there first
        comm_device = torch.device("cpu") if self.host_staged else self.device
        result_device = send.device
        send_c = send.to(comm_device).contiguous()
        total = sum(recv_splits)
        if (out is not None and out.device == comm_device == result_device and out.dtype == torch.uint8
                and out.dim() == 1 and out.numel() == total and out.is_contiguous()):
            recv = out
        else:
            recv = torch.empty(total, dtype=torch.uint8, device=comm_device)
        self.num_collectives += 1
        started = time.monotonic()
        try:
            work = self._all_to_all(recv, send_c, list(recv_splits), list(send_splits))
        except RuntimeError as error:
            self._raise_launch_error(phase, error, started)

        def finish() -> torch.Tensor:
            self._wait(work, phase, started)
            return recv.to(result_device) if result_device != comm_device else recv

        return PendingExchange(finish)

    def _exchange_staged(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                         phase: str) -> PendingExchange:
        """GPU payloads over gloo: chunked through pinned host memory, the copies overlapped with
        the wire (``transports.host_staged``)."""
        if self._pinned is None:
            self._pinned = PinnedPool()
        if self.gloo is not None:
            gloo = self.gloo

            def post_send(t, peer, tag):
                return gloo.send([t], peer, tag)  # type: ignore[attr-defined]

            def post_recv(t, peer, tag):
                return gloo.recv([t], peer, tag)  # type: ignore[attr-defined]
        else:
            def post_send(t, peer, tag):
                return dist.isend(t, group=self.group, group_dst=peer, tag=tag)

            def post_recv(t, peer, tag):
                return dist.irecv(t, group=self.group, group_src=peer, tag=tag)
        self.num_collectives += 1
        started = time.monotonic()
        try:
            finish = staged_all_to_all(send.contiguous(), list(send_splits), list(recv_splits), self.rank,
                                       post_send, post_recv, lambda work: self._wait(work, phase, started),
                                       self._pinned, self.staging_chunk_bytes)
        except RuntimeError as error:
            self._raise_launch_error(phase, error, started)
        return PendingExchange(finish)

    def exchange_counts(self, counts: torch.Tensor, phase: str) -> torch.Tensor:
        if counts.dim() != 2 or counts.shape[0] != self.num_ranks:
            raise ValueError(f"counts must be [num_ranks, C], got {tuple(counts.shape)}")
        comm_device = (self.device if self.backend_name != "gloo" else torch.device("cpu"))
        send = counts.to(comm_device, torch.int64).contiguous()
        recv = torch.empty_like(send)
        self.num_collectives += 1
        started = time.monotonic()
        try:
            work = self._all_to_all(recv, send, None, None)
        except RuntimeError as error:
            self._raise_launch_error(phase, error, started)
        self._wait(work, phase, started)
        return recv.cpu()

    # -- timeouts --------------------------------------------------------------------------
    def _grace_s(self) -> float:
        return min(3.0, 0.25 * self.timeout_s)

    def _wait(self, work: dist.Work, phase: str, started: float) -> None:
        budget = max(self.timeout_s - self._grace_s() - (time.monotonic() - started), 0.001)
        try:
            finished = work.wait(timeout=timedelta(seconds=budget))
        except RuntimeError as error:
            self._raise_timeout(phase, error, started)
        if finished is False:
            self._raise_timeout(phase, None, started)

    def _raise_launch_error(self, phase: str, error: RuntimeError, started: float) -> None:
        """A collective that failed to start: the backend refusing the tensors (a device it does
        not serve) is reported as what it is; anything else is a peer that is gone."""
        text = str(error)
        if "No backend type associated with device type" in text or "Tensors must be" in text:
            raise RuntimeError(f"ep_comm {phase}: the {self.backend_name} backend refused the exchange "
                               f"(tensors on {self.device}): {text.splitlines()[0][:200]}") from error
        self._raise_timeout(phase, error, started)

    def _raise_timeout(self, phase: str, cause: BaseException | None, started: float) -> None:
        missing = self._find_missing_peers()
        if missing is None:
            raise store_lost(phase, cause) from cause
        waited = time.monotonic() - started
        who = (f"rank(s) {missing}" if missing else "a peer (could not tell which)")
        reason = f" ({type(cause).__name__}: {str(cause).splitlines()[0][:200]})" if cause else ""
        raise CommTimeoutError(
            f"ep_comm {phase}: rank {self.rank} waited {waited:.1f}s; {who} did not take part "
            f"within timeout_s={self.timeout_s:g}{reason}", peers=missing, phase=phase) from cause

    def _find_missing_peers(self) -> list[int] | None:
        """Survivors each write a marker to the store; whoever writes none is missing. None when
        the store itself is gone."""
        self._incidents += 1
        try:
            store = self.store if self.store is not None else dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store: cannot name the peer
            return []
        prefix = f"ep_comm/{self.instance_id}/incident{self._incidents}/"
        try:
            store.set(prefix + str(self.rank), "alive")
            keys = [prefix + str(r) for r in range(self.num_ranks)]
            deadline = time.monotonic() + self._grace_s()
            present: set[int] = set()
            while time.monotonic() < deadline:
                present = {r for r in range(self.num_ranks) if store.check([keys[r]])}
                if len(present) == self.num_ranks:
                    break
                time.sleep(0.05)
            return [r for r in range(self.num_ranks) if r not in present]
        except Exception:  # noqa: BLE001 - the store itself is gone (its host rank died)
            return None
