"""Fixtures for multi-rank tests: persistent gloo rank pools of 1, 2 and 4 processes.

Usage in a test::

    def _case(rank, world_size, group, seed):   # module level, so the rank processes import it
        ...
        return something_picklable

    def test_x(ranks):
        results = ranks(4, _case, 123)           # one result per rank
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mp_pool import RankPool  # noqa: E402


@pytest.fixture(scope="session")
def ranks():
    pools: dict[int, RankPool] = {}

    def run(world_size: int, fn, *args, timeout: float = 180.0):
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size].run(fn, *args, timeout=timeout)

    yield run
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="session")
def emulated_codec_module_path(tmp_path_factory):
    """ep_comm._cuda's codec bindings over the codec kernels built for the CPU through the CUDA
    emulation (tests/emulated_cuda.py), built once per session: the extension module's path."""
    from emulated_cuda import build_codec_module, compiler

    if compiler() is None:
        pytest.skip("no host C++ compiler for the CUDA emulation")
    return build_codec_module(tmp_path_factory.mktemp("emulated_codecs"))
