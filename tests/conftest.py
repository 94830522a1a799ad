"""Fixtures for multi-rank tests: persistent gloo rank pools of 1, 2 and 4 processes; and the
native test modules, built once per session. The tests' helpers are the package ``support``
(tests/support/), importable from every test directory: this file puts tests/ on ``sys.path``.

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
from support.mp_pool import RankPool  # noqa: E402


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
    emulation (tests/support/emulated_cuda.py), built once per session: the extension module's path."""
    from support.emulated_cuda import build_codec_module
    from support.native import compiler

    if compiler() is None:
        pytest.skip("no host C++ compiler for the CUDA emulation")
    return build_codec_module(tmp_path_factory.mktemp("emulated_codecs"))


@pytest.fixture(scope="session")
def host_test_module(request, tmp_path_factory):
    """The test-only bindings of the C++ cores (tests/native/host_test_bindings.cpp, module
    ``ep_host_test``), built once per session, or reused from pytest's cache while its sources and
    the csrc/ headers are unchanged (tests/support/native.py)."""
    from support.native import cached_host_test_module, compiler

    if compiler() is None:
        pytest.skip("no host C++ compiler for the test bindings")
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    return cached_host_test_module(cache.mkdir("ep_host_test") if cache is not None
                                   else tmp_path_factory.mktemp("ep_host_test"))


@pytest.fixture(scope="session")
def cubins(request, tmp_path_factory):
    """``get(source)``: the SASS functions and resource usage of a ``csrc/cuda`` file compiled for
    sm_90 as ``ep_comm._cuda`` compiles it (``support.sass``), built once per session and cached
    across runs in pytest's cache."""
    from support import sass

    cache = getattr(request.config, "cache", None)
    cache_dir = cache.mkdir("ep_sass") if cache is not None else tmp_path_factory.mktemp("sass")
    built: dict[str, dict] = {}

    def get(source: str) -> dict:
        if source not in built:
            cubin = sass.cached_cubin(source, cache_dir)
            built[source] = {"functions": sass.disassemble(cubin), "resources": sass.resource_usage(cubin)}
        return built[source]
    return get


@pytest.fixture(scope="session")
def emulated_encoder(tmp_path_factory):
    """The CUDA lossless kernels built once per session on the CUDA emulation for the encoder
    tests (support.emulated_cuda.codec_library); the emulated device back to its defaults after."""
    from support.emulated_cuda import build, codec_library, default_device

    lib = codec_library(build("csrc/cuda/lossless_kernels.cu",
                              tmp_path_factory.mktemp("emulated_encoder") / "lossless.so"))
    yield lib
    default_device(lib)
