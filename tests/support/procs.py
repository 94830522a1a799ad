"""Spawning GPU test processes that may hang (e.g. inside NVSHMEM's initialisation or a kernel
waiting for a peer), and finding out where they hung.

Every child runs under :func:`traced_entry`: faulthandler writes all its threads' Python stacks
to ``{trace_dir}/rank{r}.txt`` when the parent sends SIGUSR1 (just before killing it) and, as a
backstop, once after ``dump_after_s``. :func:`stop_processes` always ends the children (SIGUSR1,
a short pause for the dump, SIGKILL, join) and :func:`stack_summary` condenses the dumps for a
failure message. Callers wrap their wait loop in ``try/finally`` so the children also end when
pytest-timeout interrupts the test (otherwise the leftover children keep pytest from exiting).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Sequence

import torch.multiprocessing as mp

DUMP_SIGNAL = signal.SIGUSR1
DUMP_PAUSE_S = 2.0  # how long the parent waits for the children's stack dumps before killing
MAX_FRAMES_PER_THREAD = 14
MAX_STACK_CHARS = 3000
_IDLE_FILES = ("threading.py", "selectors.py", "connection.py", "queue.py")


def free_port() -> int:
    """A free localhost TCP port for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trace_path(trace_dir: str, rank: int) -> str:
    """Where rank ``rank`` writes its stack dumps."""
    return os.path.join(trace_dir, f"rank{rank}.txt")


def arm_stack_dumps(rank: int, trace_dir: str, dump_after_s: float):
    """In a child: dump every thread's stack to :func:`trace_path` on SIGUSR1 and once after
    ``dump_after_s`` seconds. Returns the open file (keep it open while the child runs)."""
    out = open(trace_path(trace_dir, rank), "a")  # noqa: SIM115 - open for the process's life
    faulthandler.register(DUMP_SIGNAL, file=out, all_threads=True, chain=False)
    faulthandler.dump_traceback_later(dump_after_s, exit=False, file=out)
    return out


def disarm_stack_dumps(out) -> None:
    """Undoes :func:`arm_stack_dumps` (the child finished in time)."""
    faulthandler.cancel_dump_traceback_later()
    faulthandler.unregister(DUMP_SIGNAL)
    out.close()


def traced_entry(rank: int, fn: Callable, trace_dir: str, dump_after_s: float, *args) -> None:
    """Child entry of :func:`run_with_deadline`: ``fn(rank, *args)`` with stack dumps armed."""
    out = arm_stack_dumps(rank, trace_dir, dump_after_s)
    try:
        fn(rank, *args)
    finally:
        disarm_stack_dumps(out)


def stop_processes(processes: Sequence, trace_dir: str | None) -> dict[int, int]:
    """Ends every child still alive: SIGUSR1 (stack dump, when ``trace_dir`` is set), a pause of
    up to ``DUMP_PAUSE_S`` for the dumps, SIGKILL, join. Returns ``{index: size of its trace file
    before the signal}`` for the children that were alive (where their last dump starts)."""
    alive = [i for i, p in enumerate(processes) if p.is_alive()]
    sizes = {i: _size(trace_path(trace_dir, i)) if trace_dir is not None else 0 for i in alive}
    if trace_dir is not None and alive:
        for i in alive:
            _signal(processes[i], DUMP_SIGNAL)
        deadline = time.monotonic() + DUMP_PAUSE_S
        while time.monotonic() < deadline and any(_size(trace_path(trace_dir, i)) == sizes[i] for i in alive):
            time.sleep(0.1)
        time.sleep(0.2)  # let a dump that started finish
    for i in alive:
        processes[i].kill()
    for p in processes:
        p.join(timeout=5.0)
    return sizes


def stack_summary(trace_dir: str, rank: int, start: int = 0) -> str:
    """Rank ``rank``'s stack dump written after byte ``start`` of its trace file (the SIGUSR1 dump
    of :func:`stop_processes`; the whole file when nothing came after ``start``), condensed: each
    thread's innermost ``MAX_FRAMES_PER_THREAD`` frames, threads idle in ``threading`` /
    ``selectors`` left out, at most ``MAX_STACK_CHARS`` characters. Empty when it wrote none."""
    try:
        with open(trace_path(trace_dir, rank)) as f:
            text = f.read()
    except OSError:
        return ""
    if text[start:].strip():
        text = text[start:]
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x", "Timeout (")) or not blocks:
            blocks.append([line])
        elif line.strip():
            blocks[-1].append(line)
    kept = []
    for block in blocks:
        frames = block[1:]
        if frames and all(any(idle in f for idle in _IDLE_FILES) for f in frames):
            continue
        more = len(frames) - MAX_FRAMES_PER_THREAD
        kept.append("\n".join([block[0], *frames[:MAX_FRAMES_PER_THREAD]]
                              + ([f"  ... {more} outer frames"] if more > 0 else [])))
    out = "\n".join(kept)
    return out if len(out) <= MAX_STACK_CHARS else out[:MAX_STACK_CHARS] + "\n  ... (truncated)"


def run_with_deadline(fn, args: tuple, nprocs: int, timeout_s: float) -> str | None:
    """Runs ``fn(rank, *args)`` on ``nprocs`` spawned processes and joins them; processes still
    alive after ``timeout_s`` (or when the caller is interrupted, e.g. by pytest-timeout) are
    killed. Returns None when all finished, else why not (``"killed after N s"`` with the stacks
    of the killed ranks, or ``"process error: ..."``)."""
    with tempfile.TemporaryDirectory(prefix="ep_comm_stacks_") as trace_dir:
        context = mp.start_processes(traced_entry, args=(fn, trace_dir, max(timeout_s - 5.0, 1.0), *args),
                                     nprocs=nprocs, start_method="spawn", join=False)
        deadline = time.monotonic() + timeout_s
        why = None
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    why = f"killed after {timeout_s:.0f} s"
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            why = f"process error: {str(error).splitlines()[-1]}"
        finally:
            killed = stop_processes(context.processes, trace_dir)
        for rank, start in killed.items():
            stacks = stack_summary(trace_dir, rank, start)
            if stacks:
                why = f"{why}\n--- rank {rank} stacks (innermost first) ---\n{stacks}"
        return why


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _signal(process, signum: int) -> None:
    """Sends ``signum`` to ``process``; one that already exited (or never started) is left alone."""
    try:
        os.kill(process.pid, signum)
    except (ProcessLookupError, TypeError):
        return
