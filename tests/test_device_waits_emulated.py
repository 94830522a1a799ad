"""The bounded waits and the batched row copy of csrc/common/device_sync.h run on the CPU through the
CUDA emulation (tests/native/emulated_waits.cu): a wait spins on relaxed loads until another warp's
release, acquires, and the copy then reads what was written before the release (whole batches of 8
vectors per lane and a partial one); a wait that nothing releases runs out of its (virtual) time and
fills the timeout record with the rank, the peer, the phase and the detail, in both schedule orders."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from support.emulated_cuda import build, load
from support.native import compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler")

K_TIMED_OUT, K_DISPATCH_RECV, K_COMBINE_RECV = 1, 3, 5  # csrc/common/timeout.h


@pytest.fixture(scope="module")
def waits(tmp_path_factory) -> ctypes.CDLL:
    lib = load(build("tests/native/emulated_waits.cu", tmp_path_factory.mktemp("waits") / "waits.so"))
    p = ctypes.c_void_p
    lib.emu_handoff.argtypes = [p, p, ctypes.c_int, p, p, p, ctypes.c_ulonglong, p]
    return lib


@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("vectors", [1, 255, 256, 300, 1000])
def test_wait_then_copy_and_timeout(waits, reverse, vectors):
    flag, never = np.zeros(1, np.int32), np.zeros(1, np.int32)
    payload = np.zeros((vectors, 4), np.int32)
    copy = np.full((vectors, 4), -1, np.int32)
    record = np.zeros(8, np.int32)
    results = np.full(2, -1, np.int32)
    waits.ep_emu_set_schedule(reverse)
    try:
        assert waits.emu_handoff(flag.ctypes.data, payload.ctypes.data, vectors, copy.ctypes.data, never.ctypes.data,
                                 record.ctypes.data, 5_000_000, results.ctypes.data) == 0
    finally:
        waits.ep_emu_set_schedule(0)
    assert results[0] == 1 and flag[0] == 7
    i = np.arange(vectors)
    np.testing.assert_array_equal(copy, np.stack([i, 2 * i, 3 * i, 4 * i], 1))
    assert results[1] == 0
    # status, rank, peer, phase, waited ms, detail
    assert list(record[[0, 1, 2, 3, 5]]) == [K_TIMED_OUT, 0, 5, K_COMBINE_RECV, 9]
    assert record[4] >= 5  # virtual milliseconds waited, past the 5 ms timeout
