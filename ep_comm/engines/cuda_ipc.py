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

Per call, the intranode engine's direct copy also maps the peers' tensors of that call: each rank
``export``s the allocations holding them (handle and offset), the records are all-gathered, and
``IpcImportCache`` maps each handle once and keeps the most recent mappings for later calls (torch's
caching allocator hands out tensors from the same few allocations, so later calls mostly hit).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from collections import OrderedDict
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
    def export(self, ptr: int) -> tuple[bytes, int]: ...
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


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

    def export(self, ptr: int) -> tuple[bytes, int]:
        """The IPC handle of the allocation holding device address ``ptr`` (e.g. a segment of torch's
        caching allocator) and ``ptr``'s offset in it. ``RuntimeError`` naming the call when the
        driver cannot say or export it (e.g. memory of torch's expandable segments, which
        ``cudaIpcGetMemHandle`` refuses)."""
        try:
            from cuda.bindings import driver
        except ImportError as error:
            raise RuntimeError(f"exporting a tensor needs cuda-python's driver bindings: {error}") from error
        self._use_device()
        base, _size = check_cuda(driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        base = int(base)
        return self.get_handle(base), int(ptr) - base

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor on this device (torch's allocator; ``export`` finds its allocation)."""
        return torch.empty(shape, dtype=dtype, device=torch.device("cuda", self.index))


class IpcImportCache:
    """Peers' allocations mapped into this process, by handle: ``address(handle, offset)`` opens a
    handle once (``api.open_handle``) and keeps the ``capacity`` most recently used mappings,
    closing (``api.close_handle``) the least recent one beyond that. A handle names one allocation
    (a new allocation at a reused address has a new handle), so a cached mapping never aliases
    another allocation. ``opens`` counts the handles opened so far.

    One call's mappings must all stay open while its kernels run: ``capacity`` is at least the
    tensors a call imports (6 per peer for a dispatch, 8 ranks)."""

    MIN_CAPACITY = 6 * 8

    def __init__(self, api: IpcApi, capacity: int = 64) -> None:
        if capacity < self.MIN_CAPACITY:
            raise ValueError(f"capacity must be >= {self.MIN_CAPACITY} (one call's imports), got {capacity}")
        self.api, self.capacity = api, capacity
        self._mapped: OrderedDict[bytes, int] = OrderedDict()
        self.opens = 0

    def __len__(self) -> int:
        return len(self._mapped)

    def address(self, handle: bytes, offset: int) -> int:
        """This process's address of byte ``offset`` of the allocation ``handle`` names."""
        base = self._mapped.get(handle)
        if base is None:
            base = self.api.open_handle(handle)
            self.opens += 1
            self._mapped[handle] = base
            while len(self._mapped) > self.capacity:
                _, evicted = self._mapped.popitem(last=False)
                self.api.close_handle(evicted)
        else:
            self._mapped.move_to_end(handle)
        return base + offset

    def close(self) -> None:
        """Closes every mapping (``RuntimeError`` listing the failures, after trying them all)."""
        errors = []
        while self._mapped:
            _, base = self._mapped.popitem(last=False)
            try:
                self.api.close_handle(base)
            except RuntimeError as error:
                errors.append(str(error))
        if errors:
            raise RuntimeError("; ".join(errors))


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
        """``api``: the CUDA calls (``CudaRuntimeIpc`` on ``device`` when None; tests pass stand-ins)."""
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


# ---- per-call exchange of tensors ------------------------------------------------------------------
EXCHANGE_SLOTS = 6
"""Tensors one rank names per exchange (the dispatch's meta and five outputs; the combine uses 3)."""
_SLOT_BYTES = 1 + IPC_HANDLE_BYTES + 8  # present flag, handle, little-endian int64 offset
_RECORD_BYTES = 2 + EXCHANGE_SLOTS * _SLOT_BYTES  # kind, exported, slots


class IpcTensorExchange:
    """Maps the tensors of one call of every rank of ``group`` into this process.

    ``exchange(kind, tensors)`` exports each tensor's allocation (``api.export``), all-gathers one
    fixed-size record per rank (a uint8 tensor, on the CPU for gloo, on ``device`` for NCCL) and
    imports every peer's (``IpcImportCache``): per rank, the address of each of its tensors as this
    process addresses them (0 for None or an empty tensor). When any rank could not export, it
    returns None on every rank (the decision is taken from the gathered records, the same on each).
    ``finish(failure)`` is the closing barrier of the call: every rank joins it once its kernel has
    finished, and all raise together when any failed. Collective: every rank makes the same calls.
    ``last_refusal`` says why this rank's last export failed ("" when it did not).
    """

    def __init__(self, group: dist.ProcessGroup, api: IpcApi, device: torch.device, capacity: int = 64) -> None:
        self.group, self.api = group, api
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.wire = torch.device(device) if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self.imports = IpcImportCache(api, capacity)
        self.last_refusal = ""

    def _gather(self, payload: bytes) -> list[bytes]:
        mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.wire)
        out = torch.empty(self.num_ranks * len(payload), dtype=torch.uint8, device=self.wire)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, mine, group=self.group)
        raw = out.cpu().numpy().tobytes()
        return [raw[r * len(payload): (r + 1) * len(payload)] for r in range(self.num_ranks)]

    def _record(self, kind: int, tensors: list[torch.Tensor | None]) -> bytes:
        record = bytearray(_RECORD_BYTES)
        record[0] = kind
        try:
            for i, t in enumerate(tensors):
                if t is None or t.numel() == 0:
                    continue
                handle, offset = self.api.export(int(t.data_ptr()))
                at = 2 + i * _SLOT_BYTES
                record[at] = 1
                record[at + 1: at + 1 + IPC_HANDLE_BYTES] = handle
                record[at + 1 + IPC_HANDLE_BYTES: at + _SLOT_BYTES] = int(offset).to_bytes(8, "little", signed=True)
        except RuntimeError as error:
            self.last_refusal = str(error)
            return bytes([kind, 0]) + bytes(_RECORD_BYTES - 2)
        self.last_refusal = ""
        record[1] = 1
        return bytes(record)

    def exchange(self, kind: int, tensors: list[torch.Tensor | None]) -> list[list[int]] | None:
        """Every rank's ``tensors`` (at most ``EXCHANGE_SLOTS``; ``kind`` 1..255 names the call, the same
        on every rank) as addresses here: ``[R][len(tensors)]``, this rank's own pointers at its index.
        None on every rank when a rank could not export. ``ValueError`` naming the ranks when they
        disagree on ``kind``; ``RuntimeError`` when an import fails here (the caller still joins
        ``finish``, so that the peers raise too instead of waiting)."""
        if len(tensors) > EXCHANGE_SLOTS or not 1 <= kind <= 255:
            raise ValueError(f"an exchange names 1..255 as its kind and at most {EXCHANGE_SLOTS} tensors")
        records = self._gather(self._record(kind, tensors))
        kinds = [rec[0] for rec in records]
        if len(set(kinds)) > 1:
            raise ValueError(f"ranks disagree on the call: rank {self.rank} made call kind {kind}, the kinds by "
                             f"rank are {kinds}; every rank must make the same sequence of calls")
        if not all(rec[1] for rec in records):
            return None
        out = []
        for r, rec in enumerate(records):
            if r == self.rank:
                out.append([0 if t is None or t.numel() == 0 else int(t.data_ptr()) for t in tensors])
                continue
            row = []
            for i in range(len(tensors)):
                at = 2 + i * _SLOT_BYTES
                if not rec[at]:
                    row.append(0)
                    continue
                handle = rec[at + 1: at + 1 + IPC_HANDLE_BYTES]
                offset = int.from_bytes(rec[at + 1 + IPC_HANDLE_BYTES: at + _SLOT_BYTES], "little", signed=True)
                row.append(self.imports.address(handle, offset))
            out.append(row)
        return out

    def finish(self, failure: str = "") -> None:
        """The barrier that ends a call: returns once every rank has joined it (each after its kernel
        finished and its stream was synchronised); ``RuntimeError`` on every rank naming the ranks
        whose ``failure`` was not empty."""
        flags = self._gather(b"\x01" if failure else b"\x00")
        failed = [r for r, flag in enumerate(flags) if flag[0]]
        if failed:
            mine = f"; rank {self.rank}: {failure}" if failure else ""
            raise RuntimeError(f"the direct copy failed on rank(s) {failed}{mine}")

    def close(self) -> None:
        """Closes this process's mappings of the peers' tensors."""
        self.imports.close()
