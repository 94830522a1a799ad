"""The CUDA emulation (csrc/emulation/) against the CUDA semantics it stands in for, through the
probe kernels of tests/native/emulation_probe.cu: warp votes and shuffles (also in blocks whose
size is not a multiple of 32), block votes, threads that exit early, a divergent barrier reported
as a launch failure instead of a hang, and the two schedule orders."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from support.emulated_cuda import build, load
from support.native import compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler")

LAUNCH_FAILURE = 719  # cudaErrorLaunchFailure


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> ctypes.CDLL:
    lib = load(build("tests/native/emulation_probe.cu", tmp_path_factory.mktemp("emu") / "probe.so"))
    u, p = ctypes.c_uint, ctypes.c_void_p
    lib.probe_warp.argtypes = [u, u, p]
    lib.probe_block.argtypes = [u, p]
    lib.probe_early_exit.argtypes = [u, u, p]
    lib.probe_divergent_barrier.argtypes = [p]
    lib.probe_racy.argtypes = [u, p]
    return lib


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _warp_probe_expected(b: int, t: int, threads: int) -> list[int]:
    """What warp_kernel writes for thread t of block b (blocks of `threads` threads): lanes past the
    block's end do not exist, pass 0 to shuffles and do not vote."""
    warp0, lane = t - t % 32, t % 32
    live = min(32, threads - warp0)

    def value(src_lane: int) -> int:
        return 1000 * b + warp0 + src_lane if src_lane < live else 0

    return [sum(1 << k for k in range(live) if k % 3 == 0),  # ballot
            int(live == 32),  # any: lane 31 exists
            int(live < 32),  # all lanes < 31: false exactly when lane 31 exists
            value(lane * 7 % 32), value(lane ^ 5),
            value(lane - 3) if lane >= 3 else value(lane),  # shfl_up keeps its own below delta
            value(lane + 4) if lane + 4 < 32 else value(lane),  # shfl_down likewise at the top
            value(0)]  # a 64-bit shuffle's high word


@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("blocks,threads", [(1, 32), (3, 256), (2, 40), (1, 1)])
def test_warp_votes_and_shuffles(probe, reverse: int, blocks: int, threads: int) -> None:
    probe.ep_emu_set_schedule(reverse)
    try:
        out = np.full(8 * blocks * threads, 0xDEADBEEF, dtype=np.uint32)
        assert probe.probe_warp(blocks, threads, _ptr(out)) == 0
    finally:
        probe.ep_emu_set_schedule(0)
    out = out.reshape(blocks, threads, 8)
    for b in range(blocks):
        for t in range(threads):
            assert list(out[b, t]) == _warp_probe_expected(b, t, threads), (b, t)


@pytest.mark.parametrize("threads", [1, 7, 64, 1000, 1024])
def test_block_votes(probe, threads: int) -> None:
    out = np.zeros(4 * threads, dtype=np.int32)
    assert probe.probe_block(threads, _ptr(out)) == 0
    out = out.reshape(threads, 4)
    assert (out[:, 0] == 1).all()
    assert (out[:, 1] == int(threads <= 5)).all()
    assert (out[:, 2] == (threads + 1) // 2).all()
    assert (out[:, 3] == threads * (threads - 1) // 2).all()


@pytest.mark.parametrize("threads,live", [(64, 40), (64, 32), (96, 1)])
def test_threads_that_exit_leave_collectives_to_the_rest(probe, threads: int, live: int) -> None:
    out = np.zeros(threads, dtype=np.uint32)
    assert probe.probe_early_exit(threads, live, _ptr(out)) == 0
    for t in range(live):
        lanes = min(32, live - (t - t % 32))  # live lanes of t's warp
        assert out[t] == (1 << lanes) - 1, t
    assert (out[live:] == 0).all()


def test_divergent_barrier_is_a_launch_failure_not_a_hang(probe) -> None:
    out = np.zeros(128, dtype=np.int32)
    assert probe.probe_divergent_barrier(_ptr(out)) == LAUNCH_FAILURE
    assert (out == 0).all()  # no thread got past its barrier


def test_schedule_order_exposes_a_race(probe) -> None:
    """Thread 0 writes a flag the others read without a barrier: from thread 0 up, every reader
    sees the write; from the top down, none does."""
    out = np.full(64, -1, dtype=np.int32)
    probe.ep_emu_set_schedule(0)
    assert probe.probe_racy(64, _ptr(out)) == 0
    assert (out[1:] == 1).all()
    probe.ep_emu_set_schedule(1)
    try:
        assert probe.probe_racy(64, _ptr(out)) == 0
    finally:
        probe.ep_emu_set_schedule(0)
    assert (out[1:] == 0).all()
