"""The host codecs' threads: the worker pool (csrc/codec/worker_pool.h), threads kept between calls, and
the bindings' GIL release (csrc/host/gil.h). A forked
child gets a pool of its own, concurrent calls from Python threads each finish with the
single-thread bytes, and a call asking for more threads than the pool holds still runs."""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ep_comm.codecs import fp8, lossless

ROOT = Path(__file__).resolve().parents[1]


def message(seed: int, rows: int = 64, hidden: int = 4096) -> torch.Tensor:
    """[rows, hidden] bf16 with a run of +0.0 rows: several chunks, so that 2 threads both work."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 0.05).bfloat16()
    x[rows // 4: rows // 3] = 0
    return x


def fp8_bytes(x: torch.Tensor) -> bytes:
    """FP8 codes and scales of x (from 2^19 values, the host quantizer uses every hardware thread)."""
    q, scales = fp8.quantize(x)
    return q.view(torch.uint8).numpy().tobytes() + scales.numpy().tobytes()


def code_in_child(queue, x: torch.Tensor, wide: torch.Tensor) -> None:
    """Runs in a forked child: codes with 2 threads and reports the blob, the decoded bits and the
    FP8 bytes. (No torch op that runs OpenMP threads here: the parent's OpenMP runtime does not
    survive a fork, which is why its inputs are made before it.)"""
    blob = lossless.encode(x, threads=2)
    out = lossless.decode(blob, threads=2)
    queue.put((blob.numpy().tobytes(), out.view(torch.int16).numpy().tobytes(), fp8_bytes(wide)))


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs fork")
def test_forked_child_gets_its_own_pool():
    x = message(1)
    expected = lossless.encode(x, threads=2)  # the parent's pool now has a thread
    assert torch.equal(lossless.decode(expected, threads=2).view(torch.int16), x.view(torch.int16))
    wide = message(2, rows=256)
    expected_fp8 = fp8_bytes(wide)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=code_in_child, args=(queue, x, wide))
    child.start()
    try:  # read before joining: the child exits only once its results are through the pipe
        blob, out, fp8_out = queue.get(timeout=60)
    except Exception:  # waiting for the parent's pool threads, which the child does not have
        child.kill()
        pytest.fail("a forked child hung coding with 2 threads")
    child.join(timeout=60)
    assert child.exitcode == 0
    assert blob == expected.numpy().tobytes()
    assert out == x.view(torch.int16).numpy().tobytes()
    assert fp8_out == expected_fp8


def test_concurrent_calls_from_python_threads():
    """Four Python threads code with 2 threads each at once (one holds the pool, the others start
    their own threads): every blob and decode equals the single-thread one."""
    inputs = [message(seed) for seed in range(4)]
    expected = [lossless.encode(x, threads=1) for x in inputs]
    failures: list[str] = []

    def work(k: int) -> None:
        for _ in range(20):
            blob = lossless.encode(inputs[k], threads=2)
            if not torch.equal(blob, expected[k]):
                failures.append(f"encode {k}")
            if not torch.equal(lossless.decode(blob, threads=2).view(torch.int16), inputs[k].view(torch.int16)):
                failures.append(f"decode {k}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a coding thread hung"
    assert failures == []


def test_more_threads_than_the_pool_holds():
    """threads=300 (the pool holds 255) in a fresh process: the same bytes as 1 thread, and the
    pool's threads are reused by the next call."""
    script = """
import torch
from ep_comm.codecs import lossless
g = torch.Generator().manual_seed(3)
x = (torch.randn(40000, generator=g) * 0.05).bfloat16()
single = lossless.encode(x, chunk_values=32, threads=1)
for _ in range(2):
    assert torch.equal(lossless.encode(x, chunk_values=32, threads=300), single)
    assert torch.equal(lossless.decode(single, threads=300).view(torch.int16), x.view(torch.int16))
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


@pytest.mark.skipif(not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK), reason="needs to set the next pid")
def test_grandchild_with_a_reused_pid_gets_its_own_pool():
    """A process that used the pool forks a child and exits; the child forks a grandchild that is
    given the first process's pid (ns_last_pid). The grandchild codes with 2 threads: it must not
    take the first process's pool, which has threads in no process (a pid check did, and hung).
    (The forked processes run no torch op: the parent's OpenMP runtime does not survive a fork.)"""
    script = """
import os, signal, time
import torch
from ep_comm.codecs import lossless
x = (torch.randn(300000, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16()
expected = lossless.encode(x, threads=1).numpy().tobytes()
read, write = os.pipe()
first = os.fork()
if first == 0:  # the first process: uses the pool, forks the child, exits
    lossless.encode(x, threads=2)
    parent = os.getpid()  # taken before the fork: the first process may be gone before the child runs
    if os.fork() != 0:
        os._exit(0)
    signal.alarm(60)  # the child: a hang ends it too
    while os.getppid() == parent:
        time.sleep(0.01)
    time.sleep(0.2)  # the script reaps the first process: its pid is free
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(parent - 1))
    if os.fork() == 0:  # the grandchild
        signal.alarm(20)  # a hang ends it
        if os.getpid() != parent:
            os.write(write, b"reuse")
        else:
            os.write(write, b"ok" if lossless.encode(x, threads=2).numpy().tobytes() == expected else b"bad")
    os._exit(0)
os.close(write)
os.waitpid(first, 0)
print(os.read(read, 16).decode() or "hung")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    out = run.stdout.strip()
    if out == "reuse":
        pytest.skip("the pid was not reused (another process took it)")
    assert out == "ok", run.stdout + run.stderr


def test_daemon_threads_coding_at_exit_do_not_abort():
    """Daemon threads still inside the host codecs when the interpreter exits: Python ends them
    when they take the GIL back (pthread_exit). Taking it back in a destructor
    (py::gil_scoped_release) aborted the process every time ("terminate called without an active
    exception"); the bindings take it back in plain code (csrc/host/gil.h). NumPy arrays only:
    torch's own tensor deallocation has the same abort, which is not this library's."""
    script = """
import threading, time
import numpy as np
from ep_comm import _host
x = (np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
q = np.empty(x.size, dtype=np.uint8)
scales = np.empty(x.size // 128, dtype=np.float32)
def work(threads):
    while True:
        blob = _host.lossless_encode(x.ctypes.data, x.size, [x.size], 65536, threads, 2)
        _host.lossless_decode(blob.ctypes.data, blob.size, threads, 2, None)
        _host.fp8_quantize(x.view(np.int16), x.size // 4096, 4096, False, False, q, scales, threads)
workers = [threading.Thread(target=work, args=(threads,), daemon=True) for threads in (1, 2, 1)]
for worker in workers:
    worker.start()
time.sleep(0.3)
print(sum(worker.is_alive() for worker in workers))  # still coding (an error would have ended one)
"""
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 0 and run.stdout.strip() == "3", run.stdout + run.stderr[-2000:]
