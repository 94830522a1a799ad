"""CUDA IPC peer buffers: one device buffer per rank, mapped into every other rank's process.

Each rank ``cudaMalloc``s its buffer, exports it with ``cudaIpcGetMemHandle``, all-gathers the
64-byte handles over the user's ``torch.distributed`` group (gloo or NCCL, as picklable
``IpcRecord`` objects), and opens every peer's handle with ``cudaIpcOpenMemHandle`` (lazy peer
access). ``peers[r]`` is then rank ``r``'s buffer as this process addresses it: the table the
intranode kernels take (``csrc/cuda/intranode.cu``). Calls go through cuda-python
(``cuda.bindings.runtime``); every return code is checked and a failure raises ``RuntimeError``
naming the call. Whether every rank opened every handle is agreed over the group, so all ranks
raise together instead of some of them hanging in a kernel later.

Same-process peers (virtual ranks of one GPU test) do not come here: they use plain tensors
(``ep_comm.engines.intranode.PeerBuffers`` with ``group=None``).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

IPC_HANDLE_BYTES = 64
"""Size of a ``cudaIpcMemHandle_t`` (``CUDA_IPC_HANDLE_SIZE``)."""


def check_cuda(result: object, call: str) -> object:
    """Returns the value of a cuda-python call, raising ``RuntimeError`` naming ``call`` on error.

    cuda-python returns ``(error,)`` or ``(error, value, ...)``; ``error`` is a ``cudaError_t``.
    """
    parts = result if isinstance(result, tuple) else (result,)
    if not parts:
        raise RuntimeError(f"{call} returned nothing")
    error = parts[0]
    code = int(getattr(error, "value", error))
    if code != 0:
        name = getattr(error, "name", None) or f"error {code}"
        raise RuntimeError(f"{call} failed: {name} ({code})")
    if len(parts) == 1:
        return None
    return parts[1] if len(parts) == 2 else parts[1:]


class IpcApi(Protocol):
    """The CUDA calls an ``IpcPeerBuffers`` makes (the real one is ``CudaRuntimeIpc``)."""

    def malloc_zeroed(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def get_handle(self, ptr: int) -> bytes: ...
    def open_handle(self, handle: bytes) -> int: ...
    def close_handle(self, ptr: int) -> None: ...
    def device_uuid(self) -> str: ...


class CudaRuntimeIpc:
    """``IpcApi`` over cuda-python's runtime bindings on device ``index`` (made current before
    every call: cuda-python keeps its own runtime state, apart from torch's)."""

    def __init__(self, index: int) -> None:
        try:
            from cuda.bindings import runtime
        except ImportError as error:
            raise RuntimeError("CUDA IPC needs cuda-python (pip install cuda-python): "
                               f"{error}") from error
        self.rt = runtime
        self.index = int(index)

    def _use_device(self) -> None:
        check_cuda(self.rt.cudaSetDevice(self.index), "cudaSetDevice")

    def malloc_zeroed(self, nbytes: int) -> int:
        self._use_device()
        ptr = int(check_cuda(self.rt.cudaMalloc(nbytes), "cudaMalloc"))
        try:
            check_cuda(self.rt.cudaMemset(ptr, 0, nbytes), "cudaMemset")
            # peers write flags into this buffer as soon as they have its handle: zero it first
            check_cuda(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        except RuntimeError:
            self.rt.cudaFree(ptr)
            raise
        return ptr

    def free(self, ptr: int) -> None:
        self._use_device()
        check_cuda(self.rt.cudaFree(ptr), "cudaFree")

    def handle_to_bytes(self, handle: object) -> bytes:
        """The 64 bytes of a ``cudaIpcMemHandle_t``."""
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)  # type: ignore[attr-defined]

    def handle_from_bytes(self, raw: bytes) -> tuple[object, object]:
        """A ``cudaIpcMemHandle_t`` viewing a copy of ``raw``, and the buffer that keeps it alive."""
        if len(raw) != IPC_HANDLE_BYTES:
            raise ValueError(f"handle must be {IPC_HANDLE_BYTES} bytes, got {len(raw)}")
        buf = ctypes.create_string_buffer(bytes(raw), IPC_HANDLE_BYTES)
        return self.rt.cudaIpcMemHandle_t(_ptr=ctypes.addressof(buf)), buf

    def get_handle(self, ptr: int) -> bytes:
        self._use_device()
        handle = check_cuda(self.rt.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
        return self.handle_to_bytes(handle)

    def open_handle(self, handle: bytes) -> int:
        self._use_device()
        wrapped, _keep = self.handle_from_bytes(handle)
        ptr = check_cuda(self.rt.cudaIpcOpenMemHandle(wrapped, self.rt.cudaIpcMemLazyEnablePeerAccess),
                         "cudaIpcOpenMemHandle")
        return int(ptr)

    def close_handle(self, ptr: int) -> None:
        self._use_device()
        check_cuda(self.rt.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")

    def device_uuid(self) -> str:
        return str(torch.cuda.get_device_properties(self.index).uuid)


@dataclass(frozen=True)
class IpcRecord:
    """What one rank publishes to the others.

    Attributes:
        rank: its rank in the group. hostname / pid: where it runs (IPC needs one host; a handle
        cannot be opened by the process that exported it). device_uuid: its GPU.
        nbytes: its buffer size. handle: the 64-byte ``cudaIpcMemHandle_t``.
    """

    rank: int
    hostname: str
    pid: int
    device_uuid: str
    nbytes: int
    handle: bytes


def validate_records(records: list[object], num_ranks: int, nbytes: int) -> list[IpcRecord]:
    """Checks the all-gathered records (one per rank, in rank order, same host and size, distinct
    processes, 64-byte handles); raises ``ValueError`` naming the offending rank."""
    if len(records) != num_ranks:
        raise ValueError(f"expected {num_ranks} IPC records, got {len(records)}")
    out: list[IpcRecord] = []
    for index, rec in enumerate(records):
        if not isinstance(rec, IpcRecord):
            raise ValueError(f"IPC record of rank {index} is a {type(rec).__name__}, not an IpcRecord")
        if rec.rank != index:
            raise ValueError(f"IPC record at position {index} claims rank {rec.rank}")
        if not isinstance(rec.handle, bytes) or len(rec.handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"IPC handle of rank {index} must be {IPC_HANDLE_BYTES} bytes, got "
                             f"{len(rec.handle) if isinstance(rec.handle, bytes) else type(rec.handle).__name__}")
        if rec.nbytes != nbytes:
            raise ValueError(f"rank {index} allocated {rec.nbytes} bytes, this rank {nbytes}: every rank "
                             "must size its buffer the same")
        out.append(rec)
    hosts = {r.hostname for r in out}
    if len(hosts) > 1:
        raise ValueError(f"CUDA IPC needs every rank on one host, the group spans {sorted(hosts)}")
    pids = [(r.hostname, r.pid) for r in out]
    if len(set(pids)) != len(pids):
        raise ValueError("two ranks of the group run in one process: CUDA IPC cannot open a handle "
                         "in the process that exported it (use virtual ranks with group=None)")
    return out


class IpcPeerBuffers:
    """This rank's zeroed ``nbytes`` device buffer plus every peer's, mapped through CUDA IPC.

    Construction and ``close()`` are collective over ``group``.

    Attributes:
        peers: ``[R]`` device addresses (this rank's own buffer at ``peers[rank]``).
        local_ranks: ``[rank]``, the one rank this process runs.
        records: the validated ``IpcRecord`` of every rank.
    """

    def __init__(self, nbytes: int, group: dist.ProcessGroup, device: torch.device,
                 api: IpcApi | None = None) -> None:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        self.group, self.device, self.nbytes = group, torch.device(device), nbytes
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.local_ranks = [self.rank]
        self._opened: list[int] = []
        self.own = 0
        with self._on_device():
            if api is None:
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                api = CudaRuntimeIpc(index)
            self.api = api
            self.own = self.api.malloc_zeroed(nbytes)
            try:
                mine = IpcRecord(self.rank, socket.gethostname(), os.getpid(), self.api.device_uuid(),
                                 nbytes, self.api.get_handle(self.own))
            except RuntimeError:
                self.api.free(self.own)
                raise
        records = _all_gather(mine, group, self.num_ranks)
        failure = ""
        try:
            self.records = validate_records(records, self.num_ranks, nbytes)
            self.peers = self._open(self.records)
        except (RuntimeError, ValueError) as error:
            failure = f"rank {self.rank}: {error}"
        failures = [f for f in _all_gather(failure, group, self.num_ranks) if f]
        if failures:
            # unmap the peers' buffers everywhere before anyone frees its own (freeing memory a
            # peer still maps is undefined), as close() does
            self._release(free_own=False)
            dist.barrier(group=self.group)
            self._release(free_own=True)
            raise RuntimeError("CUDA IPC peer buffers could not be set up: " + "; ".join(failures))

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _open(self, records: list[IpcRecord]) -> list[int]:
        peers = []
        with self._on_device():
            for rec in records:
                if rec.rank == self.rank:
                    peers.append(self.own)
                    continue
                ptr = self.api.open_handle(rec.handle)
                self._opened.append(ptr)
                peers.append(ptr)
        return peers

    def _release(self, free_own: bool) -> None:
        errors = []
        with self._on_device():
            for ptr in self._opened:
                try:
                    self.api.close_handle(ptr)
                except RuntimeError as error:
                    errors.append(str(error))
            self._opened = []
            if free_own and self.own:
                try:
                    self.api.free(self.own)
                except RuntimeError as error:
                    errors.append(str(error))
                self.own = 0
        if errors:
            raise RuntimeError("; ".join(errors))

    def close(self) -> None:
        """Unmaps the peers' buffers, waits until every rank has unmapped this one (a barrier over
        the group: freeing memory another process still maps is undefined), then frees it."""
        if not self.own and not self._opened:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._release(free_own=False)
        dist.barrier(group=self.group)
        self._release(free_own=True)
        self.peers = []


def _all_gather(obj: object, group: dist.ProcessGroup, size: int) -> list[object]:
    out: list[object] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out
