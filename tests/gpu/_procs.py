"""Spawning GPU test processes that may hang (e.g. inside NVSHMEM's initialisation)."""
from __future__ import annotations

import socket
import time

import torch.multiprocessing as mp


def free_port() -> int:
    """A free localhost TCP port for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_with_deadline(fn, args: tuple, nprocs: int, timeout_s: float) -> str | None:
    """Runs ``fn(rank, *args)`` on ``nprocs`` spawned processes and joins them; processes still
    alive after ``timeout_s`` are killed. Returns None when all finished, else why not
    (``"killed after N s"`` or ``"process error: ..."``)."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                return f"killed after {timeout_s:.0f} s"
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
        return f"process error: {str(error).splitlines()[-1]}"
    return None
