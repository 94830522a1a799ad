"""Which transport and device a Buffer uses: one decision for the whole job.

Every rank describes what it can run (:class:`RankCapabilities`: vendor, GPU architecture, the
architectures ``ep_comm._cuda`` was built for, whether NVSHMEM is built in); the ranks all-gather
their descriptions and apply the same rule to the same list, so they cannot pick different
transports (a job mixing GPU generations or vendors would otherwise fail or hang in its first
call).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .base import Transport


@dataclass(frozen=True)
class RankCapabilities:
    """What one rank can run.

    Attributes:
        vendor: ``"nvidia"``, ``"amd"`` (a ROCm build of torch: ``torch.version.hip``) or ``"cpu"``.
        arch: the GPU architecture (``"90"`` for sm_90, ``"gfx942"``), ``""`` without a GPU.
        built_archs: architectures ``ep_comm._cuda`` was compiled for (empty when not built).
        nvshmem: ``ep_comm._cuda`` was built with NVSHMEM.
        backend: the group's ``torch.distributed`` backend as this rank reports it.
    """

    vendor: str
    arch: str
    built_archs: tuple[str, ...]
    nvshmem: bool
    backend: str

    @property
    def collective_backend(self) -> str:
        """``"rccl"`` for an NCCL-named group on a ROCm build (ROCm's torch reports RCCL as
        ``"nccl"``), the reported backend otherwise."""
        return "rccl" if self.vendor == "amd" and self.backend == "nccl" else self.backend


def local_capabilities(group: dist.ProcessGroup) -> RankCapabilities:
    """This rank's :class:`RankCapabilities`."""
    backend = str(dist.get_backend(group))
    if not torch.cuda.is_available():
        return RankCapabilities("cpu", "", _built_archs(), _nvshmem_built(), backend)
    if torch.version.hip:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return RankCapabilities("amd", str(getattr(props, "gcnArchName", "")).split(":")[0], (), False, backend)
    major, minor = torch.cuda.get_device_capability()
    return RankCapabilities("nvidia", f"{major}{minor}", _built_archs(), _nvshmem_built(), backend)


def _built_archs() -> tuple[str, ...]:
    from .._build import build_info

    return tuple(str(a) for a in build_info().get("archs", []))


def _nvshmem_built() -> bool:
    from .._build import build_info

    return bool(build_info().get("nvshmem"))


def gather_capabilities(group: dist.ProcessGroup, mine: RankCapabilities) -> list[RankCapabilities]:
    """Every rank's capabilities, in rank order (collective over ``group``)."""
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return [c for c in out]  # type: ignore[misc]


def decide_transport(backend: str, ranks: list[RankCapabilities]) -> tuple[str, str]:
    """``(transport, why)`` from every rank's capabilities, the same on every rank:
    ``"nvshmem"`` when asked for (``backend="nvshmem"``) or, with ``"auto"``, when every rank is an
    NVIDIA GPU whose architecture ``ep_comm._cuda`` was built for, with NVSHMEM; else ``"torch"``.

    Raises:
        ValueError: ``backend="nvshmem"`` on a job where some rank cannot run it.
    """
    def unable(c: RankCapabilities) -> str | None:
        if c.vendor == "cpu":
            return "no CUDA GPU"
        if c.vendor != "nvidia":
            return f"an {c.vendor.upper()} GPU ({c.arch})"
        if c.arch not in c.built_archs:
            return f"sm_{c.arch}, not among ep_comm._cuda's archs {list(c.built_archs)}"
        if not c.nvshmem:
            return "ep_comm._cuda built without NVSHMEM"
        return None

    reasons = {r: why for r, c in enumerate(ranks) if (why := unable(c)) is not None}
    if not reasons:
        return "nvshmem", "every rank is an NVIDIA GPU the kernels were built for, with NVSHMEM"
    listed = "; ".join(f"rank {r}: {why}" for r, why in sorted(reasons.items()))
    if backend == "nvshmem":
        raise ValueError(f"backend='nvshmem': not every rank can run it ({listed})")
    vendors = sorted({c.vendor for c in ranks})
    mixed = f" (a mixed job: {', '.join(vendors)})" if len(vendors) > 1 else ""
    return "torch", f"the portable transport{mixed}: {listed}"


def pick_device(group: dist.ProcessGroup, backend: str = "auto") -> torch.device:
    """The device this rank's tensors and exchanges live on: the current CUDA (or ROCm) device for
    ``backend="nvshmem"`` or an NCCL/RCCL group (when a GPU is visible); for any other group, the
    CPU when one of its backends serves the CPU (gloo), else the current device of the one device
    type its backends serve (a group that, like NCCL's, takes no CPU tensors)."""
    if backend == "nvshmem" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    name = str(dist.get_backend(group))
    if name in ("nccl", "rccl") and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    served = {torch.device(d).type for d in getattr(group, "_device_types", [])}
    if not served or "cpu" in served or name == "gloo":
        return torch.device("cpu")
    kind = sorted(served)[0]
    module = getattr(torch, kind, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(kind, index)


def make_transport(group: dist.ProcessGroup, backend: str, device: torch.device, timeout_s: float,
                   num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, num_qps_per_rank: int = 24,
                   capabilities: RankCapabilities | None = None) -> tuple[Transport, str]:
    """The transport every rank of ``group`` agreed on, and why (collective over ``group``).
    ``backend="torch"`` skips the agreement; ``capabilities`` overrides this rank's own
    description (tests simulate mixed jobs with it)."""
    from .torch_dist import TorchDistTransport

    if backend == "torch":
        why = "backend='torch'"
    else:
        ranks = gather_capabilities(group, capabilities or local_capabilities(group))
        choice, why = decide_transport(backend, ranks)
        if choice == "nvshmem":
            from .nvshmem import NvshmemTransport

            return NvshmemTransport(group, timeout_s, device, num_nvl_bytes=num_nvl_bytes,
                                    num_rdma_bytes=num_rdma_bytes, num_qps_per_rank=num_qps_per_rank), why
    instance_id = TorchDistTransport.agree_instance_id(group)
    return TorchDistTransport(group, timeout_s, device, instance_id), why
