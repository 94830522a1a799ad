"""A persistent pool of rank processes (torch.multiprocessing spawn, gloo), one pool per world
size, started once per test session.

A task is a module-level function ``fn(rank, world_size, group, *args)``; the pool runs it on every
rank and returns the per-rank results (or raises the first rank's exception, with its traceback).
A task that does not finish within its timeout kills the pool, which restarts on the next task.
"""
from __future__ import annotations

import contextlib
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp


class RankTaskError(AssertionError):
    """A rank raised: the message holds the rank and its traceback."""


@dataclass
class _Task:
    fn: Callable[..., Any]
    args: tuple


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    group = dist.group.WORLD
    while True:
        task = tasks.get()
        if task is None:
            break
        try:
            results.put((rank, True, task.fn(rank, world_size, group, *task.args)))
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            results.put((rank, False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


class RankPool:
    """``world_size`` rank processes that run tasks until closed."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r],
                                                          self._results), daemon=True)
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
            may_die: frozenset[int] = frozenset()) -> list[Any]:
        """Runs ``fn(rank, world_size, group, *args)`` on every rank; returns results by rank.

        Ranks in ``may_die`` may exit without a result (their entry is then None).
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put(_Task(fn, args))
        out: dict[int, Any] = {}
        errors: list[str] = []
        needed = self.world_size - len(may_die)
        while len([r for r in out if r not in may_die]) + len(errors) < needed:
            try:
                rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise RankTaskError(f"{fn.__name__} did not finish on all {self.world_size} ranks "
                                    f"within {timeout}s (pool restarted)\n" + "\n".join(errors)) from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
                if len(errors) == 1:
                    # the other ranks may be stuck in a collective: give them a short while
                    timeout = min(timeout, 30.0)
        if errors:
            if len(out) + len(errors) < self.world_size:
                self.close()
            raise RankTaskError("\n".join(errors))
        return [out.get(r) for r in range(self.world_size)]

    def close(self) -> None:
        for q in getattr(self, "_tasks", []):
            with contextlib.suppress(Exception):  # the queue may already be broken
                q.put(None)
        deadline = time.monotonic() + 3.0
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.01))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []


def spawn_once(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
               may_die: frozenset[int] = frozenset()) -> list[Any]:
    """Runs ``fn`` on a fresh, throw-away group (for tests that break their group, e.g. a rank
    that dies). Every process is joined or killed before this returns."""
    pool = RankPool(world_size)
    try:
        return pool.run(fn, *args, timeout=timeout, may_die=may_die)
    finally:
        pool.close()


