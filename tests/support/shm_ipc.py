"""A host-memory stand-in for CUDA IPC (ep_comm/engines/cuda_ipc.py's ``IpcApi``) for tests whose
ranks are processes on the CPU, the kernels built through the CUDA emulation: an "allocation" is a
file in ``directory`` (tmpfs, e.g. under /dev/shm) mapped shared, its handle the file's name
(padded to 64 bytes), and opening a handle maps the file again in the importing process, at
whatever address mmap gives, as ``cudaIpcOpenMemHandle`` maps at an address of its own.

``empty`` carves tensors out of segments of ``segment_bytes`` (a bump allocator, as torch's caching
allocator serves tensors from a few large allocations): tensors of one segment share a handle at
different offsets, and a later call's tensors mostly come from segments a peer already mapped.
Memory is released by ``close`` (the test's), not tensor by tensor. Only tensors from ``empty`` (and
buffers from ``malloc_zeroed``) can be exported: ``export`` of anything else raises ``RuntimeError``
as ``cudaIpcGetMemHandle`` does for memory it cannot export.
"""
from __future__ import annotations

import itertools
import math
import os

import torch

from ep_comm.engines.cuda_ipc import IPC_HANDLE_BYTES

_ALIGN = 256  # bytes: every tensor of a segment starts at a multiple (the kernels' 16-byte vectors)


class ShmIpc:
    """``IpcApi`` over shared files in ``directory``, which the caller creates and removes.

    Attributes:
        opens / closes: handles opened and closed in this process so far.
    """

    def __init__(self, directory: str, segment_bytes: int = 1 << 20) -> None:
        self.directory, self.segment_bytes = directory, segment_bytes
        self._names = itertools.count()
        self._own: dict[int, tuple[str, int, torch.Tensor]] = {}  # base -> (file name, bytes, mapping)
        self._opened: dict[int, torch.Tensor] = {}  # base of an import -> its mapping
        self._segment: tuple[int, int, int] | None = None  # base, bytes, bytes used
        self.opens = self.closes = 0

    def _map(self, name: str, nbytes: int) -> torch.Tensor:
        return torch.from_file(os.path.join(self.directory, name), shared=True, size=nbytes, dtype=torch.uint8)

    def _create(self, nbytes: int) -> int:
        name = f"ep{os.getpid()}_{next(self._names)}"
        mapping = self._map(name, nbytes)  # a new file: zero-filled
        base = int(mapping.data_ptr())
        self._own[base] = (name, nbytes, mapping)
        return base

    def malloc_zeroed(self, nbytes: int) -> int:
        return self._create(nbytes)

    def free(self, ptr: int) -> None:
        if ptr not in self._own:
            raise RuntimeError(f"cudaFree failed: {ptr:#x} is not an allocation")
        name, _, _ = self._own.pop(ptr)
        os.unlink(os.path.join(self.directory, name))
        if self._segment is not None and self._segment[0] == ptr:
            self._segment = None

    def get_handle(self, ptr: int) -> bytes:
        if ptr not in self._own:
            raise RuntimeError(f"cudaIpcGetMemHandle failed: {ptr:#x} is not the base of an allocation")
        return self._own[ptr][0].encode().ljust(IPC_HANDLE_BYTES, b"\0")

    def export(self, ptr: int) -> tuple[bytes, int]:
        for base, (_, nbytes, _) in self._own.items():
            if base <= ptr < base + nbytes:
                return self.get_handle(base), ptr - base
        raise RuntimeError(f"cudaIpcGetMemHandle failed: {ptr:#x} is in no exportable allocation")

    def open_handle(self, handle: bytes) -> int:
        name = handle.rstrip(b"\0").decode()
        path = os.path.join(self.directory, name)
        if not os.path.exists(path):
            raise RuntimeError(f"cudaIpcOpenMemHandle failed: no allocation {name}")
        mapping = self._map(name, os.path.getsize(path))
        base = int(mapping.data_ptr())
        self._opened[base] = mapping
        self.opens += 1
        return base

    def close_handle(self, ptr: int) -> None:
        if self._opened.pop(ptr, None) is None:
            raise RuntimeError(f"cudaIpcCloseMemHandle failed: {ptr:#x} is not open")
        self.closes += 1

    def device_uuid(self) -> str:
        return "host-shm"

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        need = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        if self._segment is None or self._segment[2] + need > self._segment[1]:
            size = max(self.segment_bytes, need)
            self._segment = (self._create(size), size, 0)
        base, size, used = self._segment
        self._segment = (base, size, used + need)
        mapping = self._own[base][2]
        return mapping[used: used + nbytes].view(dtype).view(shape)

    @property
    def open_count(self) -> int:
        """Handles open now."""
        return len(self._opened)

    def close(self) -> None:
        """Drops every mapping and removes this process's files."""
        self._opened.clear()
        for base in list(self._own):
            self.free(base)
