"""Starting the ranks: ``local`` starts CPU processes over gloo; ``torchrun`` joins torchrun's job.

Either way rank 0 returns the raw results (see ``runner.run_rank``); the local launcher hands them
to the parent process through a pipe.
"""
from __future__ import annotations

import os
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from .config import BenchConfig
from .progress import ProgressBar
from .runner import run_rank


class LaunchError(RuntimeError):
    """A rank failed; the message carries its traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_timeout(cfg: BenchConfig) -> timedelta:
    return timedelta(seconds=max(120.0, 2 * cfg.timeout_s))


def _local_worker(rank: int, cfg: BenchConfig, port: int, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cfg.ranks, timeout=_pg_timeout(cfg))
    try:
        with ProgressBar(rank == 0 and not cfg.quiet) as bar:
            raw = run_rank(cfg, dist.group.WORLD, torch.device("cpu"), bar if rank == 0 else None)
        if rank == 0:
            results.put(("ok", raw))
    except BaseException:
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise
    finally:
        dist.destroy_process_group()
    # the results are sent: skip the interpreter's teardown, which takes seconds per process
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local(cfg: BenchConfig) -> dict:
    """Starts ``cfg.ranks`` CPU ranks; returns rank 0's raw results or raises ``LaunchError``.

    The ranks are forked from a forkserver that imported torch once (so N ranks do not each pay
    for ``import torch``), which is reused by later runs in the same process.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ep_comm.cli.runner"])
    results = ctx.SimpleQueue()
    procs = mp.start_processes(_local_worker, args=(cfg, _free_port(), results), nprocs=cfg.ranks,
                               join=False, start_method="forkserver")
    raw: dict | None = None
    errors: list[str] = []
    try:
        while True:
            while not results.empty():
                status, value = results.get()
                if status == "ok":
                    raw = value
                else:
                    errors.append(value)
            if procs.join(timeout=0.2):
                break
    except ProcessException as error:
        while not results.empty():
            status, value = results.get()
            if status == "error":
                errors.append(value)
        raise LaunchError("\n".join(errors) or str(error)) from None
    while not results.empty():
        status, value = results.get()
        raw = value if status == "ok" else raw
    if raw is None:
        raise LaunchError("\n".join(errors) or "rank 0 returned no results")
    return raw


def run_torchrun(cfg: BenchConfig) -> dict | None:
    """Runs inside a torchrun job (NCCL on GPUs, gloo otherwise); rank 0 returns the results."""
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(backend, timeout=_pg_timeout(cfg))
    try:
        rank = dist.get_rank()
        with ProgressBar(rank == 0 and not cfg.quiet) as bar:
            return run_rank(cfg, dist.group.WORLD, device, bar if rank == 0 else None)
    finally:
        dist.destroy_process_group()
