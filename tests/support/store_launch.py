"""Launching gloo ranks whose key-value store lives outside the workers, as torchrun's elastic
agent hosts it: the launcher (the test's process) runs ``TCPStore(is_master=True)`` and every
worker connects as a client, so the store outlives any worker (rank 0's included).

A task is a module-level function ``fn(rank, world_size, group, *args)`` as in
:mod:`support.mp_pool`. A rank listed in ``restart`` that exits is started again (a new process,
the same rank) and runs ``restart[rank](rank, world_size, store, *args)`` instead: it has no
process group with the survivors, only a client of the same store, as a worker a launcher
restarts. Results travel pickled by value (a rank may exit before the parent reads them, so
tensors cannot travel as shared memory). Every process is joined or killed before
:func:`run_with_agent_store` returns.
"""
from __future__ import annotations

import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from .mp_pool import RankTaskError
from .procs import free_port


def _client(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", store=_client(port), rank=rank, world_size=world_size)
        results.put((rank, True, pickle.dumps(fn(rank, world_size, dist.group.WORLD, *args))))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def _newcomer(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, True, pickle.dumps(fn(rank, world_size, _client(port), *args))))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def run_with_agent_store(world_size: int, fn: Callable, *args: Any, timeout: float = 120.0,
                         may_die: frozenset[int] = frozenset(),
                         restart: dict[int, Callable] | None = None) -> list[Any]:
    """Runs ``fn`` on ``world_size`` fresh gloo ranks around a store this process hosts; returns
    the results by rank (None for a rank in ``may_die`` that exited without one; a restarted
    rank's entry is its newcomer's result). Raises :class:`RankTaskError` when a rank raised or
    the ranks did not finish within ``timeout`` seconds."""
    restart = dict(restart or {})
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = {r: ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)}
    for p in procs.values():
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            for r in list(restart):
                if not procs[r].is_alive():
                    procs[r].join()
                    procs[r] = ctx.Process(target=_newcomer, args=(r, world_size, port, restart.pop(r), args,
                                                                   results), daemon=True)
                    procs[r].start()
            if errors or all(r in out or (r in may_die and r not in restart and not procs[r].is_alive())
                             for r in range(world_size)):
                break
            if time.monotonic() > deadline:
                errors.append(f"the ranks did not finish within {timeout:.0f} s (done: {sorted(out)})")
                break
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}: {value}")
                deadline = min(deadline, time.monotonic() + 20.0)
    finally:
        for p in procs.values():
            p.join(timeout=max(deadline - time.monotonic(), 0.5) if not errors else 2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        del store
    if errors:
        raise RankTaskError("\n".join(errors))
    return [out.get(r) for r in range(world_size)]
