"""Which transport and device a Buffer uses, from its group and the ``backend`` it was given."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Transport


def pick_device(group: dist.ProcessGroup, backend: str = "auto") -> torch.device:
    """This rank's current CUDA device for ``backend="nvshmem"`` or an NCCL/RCCL group (when CUDA
    is available), else the CPU."""
    if backend == "nvshmem" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if str(dist.get_backend(group)) in ("nccl", "rccl") and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_transport(group: dist.ProcessGroup, backend: str, device: torch.device, timeout_s: float,
                   num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, num_qps_per_rank: int = 24) -> Transport:
    """The NVSHMEM transport for ``backend="nvshmem"`` (a ValueError when it is not built), or for
    ``"auto"`` on a CUDA device when every rank can use it; the ``torch.distributed`` transport
    otherwise. Collective over ``group``."""
    from .torch_dist import TorchDistTransport

    want_nvshmem = backend == "nvshmem" or (backend == "auto" and device.type == "cuda")
    if want_nvshmem:
        try:
            from .nvshmem import NvshmemTransport
        except (ImportError, AttributeError) as error:
            if backend == "nvshmem":
                raise ValueError(f"backend='nvshmem' is not available: {error}") from error
        else:
            if backend == "nvshmem" or NvshmemTransport.usable(group):
                return NvshmemTransport(group, timeout_s, device, num_nvl_bytes=num_nvl_bytes,
                                        num_rdma_bytes=num_rdma_bytes, num_qps_per_rank=num_qps_per_rank)
    instance_id = TorchDistTransport.agree_instance_id(group)
    return TorchDistTransport(group, timeout_s, device, instance_id)
