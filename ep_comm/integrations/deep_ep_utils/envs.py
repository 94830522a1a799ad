"""``deep_ep.utils.envs``: process-group setup, seeds and domain sizes, as DeepEP's scripts use them.

Differences from DeepEP's module, all because ep_comm also runs without a GPU:

* :func:`init_dist` picks the NCCL backend when CUDA is available and gloo otherwise, and sets the
  default device to ``cuda`` (with ``torch.cuda.set_device(local_rank)``) or ``cpu`` accordingly.
* :func:`get_physical_domain_size` / :func:`get_logical_domain_size` derive the NVLink domain from
  which ranks of the group share a host (DeepEP asks its NCCL communicator); they are collective
  over the group.

DeepEP's hardware probes (NVLink/RDMA bandwidth, NIC atomics, PCIe NVLink checks) are not provided.
"""
from __future__ import annotations

import inspect
import os
import random
import socket

import torch
import torch.distributed as dist

__all__ = ["dist_print", "get_global_seed", "get_local_seed", "get_logical_domain_size",
           "get_physical_domain_size", "init_dist", "init_seed"]

_local_rank: int | None = None
_local_seed = 0
_global_seed = 0


def init_seed(global_seed: int) -> None:
    """Seeds ``torch`` and ``random`` with ``global_seed + rank`` (the process group must exist)."""
    global _local_seed, _global_seed
    _global_seed = global_seed
    _local_seed = global_seed + dist.get_rank()
    torch.manual_seed(_local_seed)
    random.seed(_local_seed)


def get_local_seed() -> int:
    """This rank's seed (``global_seed + rank``), as set by :func:`init_seed`."""
    return _local_seed


def get_global_seed() -> int:
    """The seed shared by all ranks, as given to :func:`init_seed`."""
    return _global_seed


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    """Prints ``s`` on every rank (or only on local rank 0 of each node), then a barrier.

    Needs :func:`init_dist` to have run (it records the local rank).
    """
    if _local_rank is None:
        raise ValueError("dist_print needs init_dist() first (it records the local rank)")
    if not once_in_node or _local_rank == 0:
        print(s, flush=True)
    dist.barrier()


def init_dist(local_rank: int, num_local_ranks: int,
              seed: int = 0) -> tuple[int, int, dist.ProcessGroup]:
    """Joins the job's default process group and returns ``(rank, world_size, group)``.

    As in DeepEP, the job is ``WORLD_SIZE`` nodes of ``num_local_ranks`` processes each, and this
    process is rank ``RANK * num_local_ranks + local_rank``, reaching the others through
    ``tcp://MASTER_ADDR:MASTER_PORT``. Note that ``WORLD_SIZE`` and ``RANK`` count *nodes* here
    (defaults: 1 and 0), not processes as under ``torchrun``; ``MASTER_ADDR`` defaults to
    ``127.0.0.1`` and ``MASTER_PORT`` to 8361.

    With CUDA available: the NCCL backend, ``torch.cuda.set_device(local_rank)`` and default
    device ``cuda``. Without: the gloo backend and default device ``cpu``. Either way the default
    dtype becomes bfloat16 (as DeepEP's scripts expect) and the seeds are set (:func:`init_seed`).

    Args:
        local_rank: this process's index on its node, ``[0, num_local_ranks)``.
        num_local_ranks: processes per node.
        seed: the global seed.
    Returns:
        ``(rank, world_size, group)``; ``group`` is a new group of all ranks.
    """
    if not 0 <= local_rank < num_local_ranks:
        raise ValueError(f"local_rank must be in [0, {num_local_ranks}), got {local_rank}")
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    num_nodes = int(os.getenv("WORLD_SIZE", "1"))
    node_rank = int(os.getenv("RANK", "0"))

    global _local_rank
    _local_rank = local_rank

    use_cuda = torch.cuda.is_available()
    params: dict = {
        "backend": "nccl" if use_cuda else "gloo",
        "init_method": f"tcp://{ip}:{port}",
        "world_size": num_nodes * num_local_ranks,
        "rank": node_rank * num_local_ranks + local_rank,
    }
    if use_cuda:
        torch.cuda.set_device(local_rank)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            params["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(**params)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda" if use_cuda else "cpu")

    init_seed(seed)
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_nodes * num_local_ranks)))


def _ranks_per_node(group: dist.ProcessGroup) -> int:
    """How many consecutive ranks of ``group`` share each host (collective over ``group``).

    Raises ``ValueError`` unless every host holds the same number of the group's ranks, numbered
    consecutively (the layout DeepEP's two-level algorithms assume).
    """
    hosts: list[str | None] = [None] * group.size()
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    per_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        per_host.setdefault(host, []).append(rank)
    sizes = {len(ranks) for ranks in per_host.values()}
    contiguous = all(ranks == list(range(ranks[0], ranks[0] + len(ranks))) for ranks in per_host.values())
    if len(sizes) != 1 or not contiguous:
        raise ValueError(f"the group's ranks are not laid out as equal blocks of consecutive ranks per "
                         f"host: {per_host}")
    return sizes.pop()


def get_physical_domain_size(group: dist.ProcessGroup) -> tuple[int, int]:
    """``(num_rdma_ranks, num_nvlink_ranks)``: the group's nodes and its ranks per node.

    The NVLink domain is taken to be one host: ``num_nvlink_ranks`` is the number of the group's
    ranks on each host and ``num_rdma_ranks = group.size() // num_nvlink_ranks``. Collective over
    ``group``.
    """
    per_node = _ranks_per_node(group)
    return group.size() // per_node, per_node


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """``(num_scaleout_ranks, num_scaleup_ranks)``: how DeepEP's two-level algorithms split the group.

    Within one NVLink domain everything is scale-up: ``(1, group.size())``. Across several, with
    ``allow_hybrid_mode`` the NVLink domain is the scale-up level (``(num_rdma_ranks,
    num_nvlink_ranks)``); without it every rank is its own scale-out peer (``(group.size(), 1)``).
    Collective over ``group``.
    """
    num_rdma_ranks, num_nvlink_ranks = get_physical_domain_size(group)
    if num_rdma_ranks == 1:
        return 1, group.size()
    if allow_hybrid_mode:
        return num_rdma_ranks, num_nvlink_ranks
    return group.size(), 1
