"""Shared pieces of the NVIDIA backend: access to the compiled modules, CUDA stream and event
helpers, and the pinned timeout record every kernel wait reports into.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError

_TIMED_OUT, _OVERFLOW = 1, 2


def cuda_module():
    """``ep_comm._cuda``, its NVSHMEM host library loaded first (``_build.load_cuda``)."""
    from .._build import load_cuda

    try:
        _cuda = load_cuda()
    except ImportError as error:
        raise RuntimeError(f"the nvshmem backend needs ep_comm._cuda, which is not built "
                           f"({error})") from error
    return _cuda


def host_module():
    from .. import _host
    return _host


def available() -> bool:
    """True when the kernels are built and a CUDA device is visible."""
    try:
        cuda_module()
    except RuntimeError:
        return False
    return torch.cuda.is_available()


def stream_handle(device: torch.device) -> int:
    return int(torch.cuda.current_stream(device).cuda_stream)


class KernelTimer:
    """CUDA events around the data-moving launches; ``ms`` after the stream synchronised."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = self.end = None

    def __enter__(self) -> "KernelTimer":
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.start.record(torch.cuda.current_stream(self.device))
        return self

    def __exit__(self, *exc: object) -> None:
        self.end.record(torch.cuda.current_stream(self.device))

    @property
    def ms(self) -> float:
        return float(self.start.elapsed_time(self.end))


def ptr_or_none(t: torch.Tensor | None) -> int | None:
    return None if t is None else int(t.data_ptr())


def aligned_ptr(t: torch.Tensor, name: str, alignment: int = 16) -> int:
    """``t.data_ptr()`` of a tensor the kernels read or write in 16-byte vectors; a ``ValueError``
    naming ``name`` when it is not ``alignment``-aligned (e.g. a view at an odd element offset),
    which on the GPU would be a misaligned-address fault that poisons the CUDA context."""
    address = int(t.data_ptr())
    if address % alignment:
        raise ValueError(f"{name} must start at a {alignment}-byte aligned address (the kernels copy it in "
                         f"{alignment}-byte vectors); got a tensor at offset {address % alignment} mod {alignment}: "
                         "pass a copy (tensor.clone()) instead of this view")
    return address


class TimeoutRecord:
    """The kernels' timeout record (``csrc/common/timeout.h``) in pinned, device-mapped memory."""

    def __init__(self) -> None:
        fields = host_module().timeout_record_fields
        self.fields = dict(fields)
        self.phases = {int(k): str(v) for k, v in host_module().timeout_phase_names.items()}
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
    cuda = cuda_module()
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
