"""The CUDA emulation's grid of co-resident blocks (csrc/emulation/grid.h) through the probe kernels of
tests/native/emulated_grid_probe.cu: blocks that wait for each other's flags run interleaved when the
emulated device holds them all (2-D grids, each block with its own shared memory, in both schedule
orders); a grid it cannot hold stalls and fails with a report that names the blocks never resident
(or, without the report, ends by the waits' timeouts); a flag published before the publishing warp's
other lanes stored the row is seen early, as it may be on a GPU, and a __syncwarp before the publish
orders it; the occupancy API reports the emulated device."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from support.emulated_cuda import build, load
from support.native import compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler")

LAUNCH_FAILURE = 719  # cudaErrorLaunchFailure
K_TIMED_OUT = 1


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> ctypes.CDLL:
    lib = load(build("tests/native/emulated_grid_probe.cu", tmp_path_factory.mktemp("grid") / "grid.so"))
    i, p = ctypes.c_int, ctypes.c_void_p
    lib.grid_chain.argtypes = [i, i, i, p, p, p]
    lib.grid_publish.argtypes = [p, p, p, i, p]
    lib.grid_occupancy.argtypes = [i]
    lib.grid_failure.restype = ctypes.c_char_p
    for name, args in (("ep_emu_set_device", [i, i]), ("ep_emu_set_resident_limit", [i]),
                       ("ep_emu_set_stall_failure", [i])):
        getattr(lib, name).argtypes = args
    yield lib
    lib.ep_emu_set_device(1, 1)
    lib.ep_emu_set_resident_limit(0)
    lib.ep_emu_set_stall_failure(0)
    lib.ep_emu_set_schedule(0)


def _setup(lib, sms: int, per_sm: int, limit: int, reverse: int, stall_fails: int) -> None:
    lib.ep_emu_set_device(sms, per_sm)
    lib.ep_emu_set_resident_limit(limit)
    lib.ep_emu_set_schedule(reverse)
    lib.ep_emu_set_stall_failure(stall_fails)


def _chain(lib, gx: int, gy: int):
    n = gx * gy
    flags, record, out = np.zeros(n, np.int32), np.zeros(8, np.int32), np.full(3 * n, -1, np.int32)
    rc = lib.grid_chain(gx, gy, 64, flags.ctypes.data, record.ctypes.data, out.ctypes.data)
    return rc, flags, record, out.reshape(n, 3)


@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("gx,gy", [(6, 1), (3, 4)])
def test_blocks_that_wait_for_each_other_run_when_all_are_resident(probe, reverse, gx, gy):
    _setup(probe, (gx * gy + 1) // 2, 2, 0, reverse, 1)
    rc, flags, record, out = _chain(probe, gx, gy)
    assert rc == 0, probe.grid_failure()
    assert (flags == 1).all() and record[0] == 0
    b = np.arange(gx * gy)
    np.testing.assert_array_equal(out, np.stack([b % gx, b // gx, 1000 + b], 1))  # own shared memory


def test_a_grid_the_device_cannot_hold_stalls_with_a_report(probe):
    """Forward order admits blocks 0..3 first: block 0 waits for block 1 ... block 3 for block 4,
    which can only start once one of them finishes."""
    _setup(probe, 2, 2, 0, 0, 1)
    rc, flags, record, _ = _chain(probe, 6, 1)
    assert rc == LAUNCH_FAILURE
    report = probe.grid_failure().decode()
    assert "stall" in report and "2 of the grid's 6 blocks were never resident (at most 4 at once)" in report, report
    assert "(0, 0, 0)" in report
    # the reverse order admits the last blocks first: each one's flag is set before its waiter starts
    _setup(probe, 2, 2, 0, 1, 1)
    rc, flags, record, _ = _chain(probe, 6, 1)
    assert rc == 0 and (flags == 1).all()


def test_without_the_report_a_stall_ends_by_the_waits_timeouts(probe):
    _setup(probe, 1, 1, 0, 0, 0)
    rc, flags, record, _ = _chain(probe, 3, 1)
    assert rc == 0  # as on a GPU: the launch ends, the timeout record says who waited for whom
    assert record[0] == K_TIMED_OUT and record[2] == 1  # block 0 waited for block 1


def test_the_resident_limit_holds_back_what_the_occupancy_allows(probe):
    _setup(probe, 4, 2, 3, 0, 1)
    assert probe.grid_occupancy(64) == 8  # the launch check sees room for 8
    rc, *_ = _chain(probe, 4, 1)
    assert rc == LAUNCH_FAILURE and "at most 3 at once" in probe.grid_failure().decode()
    probe.ep_emu_set_resident_limit(0)
    assert _chain(probe, 4, 1)[0] == 0


def test_occupancy_follows_block_size(probe):
    _setup(probe, 10, 16, 0, 0, 0)
    assert probe.grid_occupancy(1024) == 10 * 2  # 2,048 threads per SM
    assert probe.grid_occupancy(256) == 10 * 8
    assert probe.grid_occupancy(32) == 10 * 16  # the device's blocks per SM


@pytest.mark.parametrize("reverse", [0, 1])
def test_a_publish_before_the_warp_stored_the_row_is_seen_early(probe, reverse):
    """From lane 0 up, the publishing lane runs first and the reader runs right after its publish;
    from the top down, the other lanes store before lane 0 runs (so both orders are tested)."""
    _setup(probe, 1, 2, 0, reverse, 1)
    for sync in (1, 0):
        flag, record = np.zeros(1, np.int32), np.zeros(8, np.int32)
        row, copy = np.zeros((32, 4), np.int32), np.full((32, 4), -1, np.int32)
        assert probe.grid_publish(flag.ctypes.data, row.ctypes.data, copy.ctypes.data, sync, record.ctypes.data) == 0
        lanes = np.arange(32)
        want = np.stack([lanes, lanes + 1, lanes + 2, lanes + 3], 1)
        if sync or reverse:
            np.testing.assert_array_equal(copy, want)
        else:  # the reader ran between lane 0's publish and the other lanes' stores
            np.testing.assert_array_equal(copy[0], want[0])
            assert (copy[1:] == 0).all()
