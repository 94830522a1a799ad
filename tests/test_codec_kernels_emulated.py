"""The codec kernels' CUDA source (csrc/cuda/lossless_kernels.cu, fp8_kernels.cu) run on the CPU
through the CUDA emulation (csrc/emulation/, built by tests/emulated_cuda.py): the checks the GPU
tests make (tests/codec_kernel_cases.py: blobs byte-identical to the host encoder's, exact
decoding, the host's status for corrupted blobs; FP8 equal to the reference), on every build
variant of the decoder (default, register windows, L1 prefetch, early loads, 8 warps per block) and in both
schedule orders. This tests the kernels' logic and their warp/block synchronisation, not their
speed or the GPU's memory model (see csrc/emulation/cuda_runtime.h)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch
from codec_kernel_cases import (
    CASES,
    CHUNK_VALUES,
    CORRUPTION_CASES,
    check_blob_is_byte_identical_and_decodes,
    check_rejects_corrupted_blobs_like_the_host,
)
from emulated_cuda import ROOT, build, compiler, load

from ep_comm.codecs import fp8

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler")

sys.path.insert(0, os.path.join(ROOT, "bench"))
from codec_gpu import gpu_library  # noqa: E402  (the kernels' ctypes signatures)

# the decoder's build options whose logic differs (bench/gpu_prepare.sh builds them for the GPU)
VARIANTS = {
    "default": (),
    "window": ("EP_LOSSLESS_DEC_WINDOW=1",),
    "prefetch": ("EP_LOSSLESS_DEC_PREFETCH=256",),
    "early_loads": ("EP_LOSSLESS_DEC_EARLY_LOADS=1",),
    "warps8": ("EP_LOSSLESS_DEC_WARPS=8",),
}


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    out = tmp_path_factory.mktemp("emulated_kernels")
    built = {}
    for name, defines in VARIANTS.items():
        path = build("csrc/cuda/lossless_kernels.cu", out / f"lossless_{name}.so", defines)
        built[name] = gpu_library(path)
        built[name].ep_emu_set_schedule.argtypes = [ctypes.c_int]
    return built


@pytest.fixture(params=[0, 1], ids=["forward", "reverse"])
def schedule(request, libs):
    """Every library's launches resume threads in this order during the test."""
    for lib in libs.values():
        lib.ep_emu_set_schedule(request.param)
    yield request.param
    for lib in libs.values():
        lib.ep_emu_set_schedule(0)


@pytest.mark.parametrize("chunk_values", CHUNK_VALUES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_blob_is_byte_identical_and_decodes(libs, schedule, case: str, chunk_values: int) -> None:
    check_blob_is_byte_identical_and_decodes(libs["default"], "cpu", case, chunk_values)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "default"])
@pytest.mark.parametrize("case", ["normal", "sparse", "wide_exponents", "mixed", "zeros", "n33"])
@pytest.mark.parametrize("chunk_values", [32, 4096, 65536])
def test_decoder_variants_decode_exactly(libs, schedule, variant: str, case: str, chunk_values: int) -> None:
    check_blob_is_byte_identical_and_decodes(libs[variant], "cpu", case, chunk_values)


@pytest.mark.parametrize("variant", ["default", "window", "early_loads"])
@pytest.mark.parametrize("case,chunk_values", CORRUPTION_CASES)
def test_rejects_corrupted_blobs_like_the_host(libs, variant: str, case: str, chunk_values: int) -> None:
    check_rejects_corrupted_blobs_like_the_host(libs[variant], "cpu", case, chunk_values, trials=60)


@pytest.fixture(scope="module")
def fp8_lib(tmp_path_factory) -> ctypes.CDLL:
    lib = load(build("csrc/cuda/fp8_kernels.cu", tmp_path_factory.mktemp("emulated_fp8") / "fp8.so"))
    vp, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ep_fp8_quantize_cuda.argtypes = [vp, i64, i64, i, i, vp, vp, vp]
    return lib


@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_fp8_kernel_is_the_reference(fp8_lib, reverse: int, round_scale: bool, use_ue8m0: bool) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 1024, generator=g) * torch.logspace(-4, 2, 1024)).to(torch.bfloat16)
    x[3] = 0
    x[5, 7] = float("nan")
    x[6, 300] = float("inf")
    q_ref, s_ref = fp8.quantize_reference(x, round_scale, use_ue8m0)
    q = torch.full(x.shape, 0x5A, dtype=torch.uint8)
    s = torch.full((s_ref.numel() * s_ref.element_size(),), 0x5A, dtype=torch.uint8)
    fp8_lib.ep_emu_set_schedule(reverse)
    try:
        rc = fp8_lib.ep_fp8_quantize_cuda(x.view(torch.int16).data_ptr(), x.shape[0], x.shape[1], int(round_scale),
                                          int(use_ue8m0), q.data_ptr(), s.data_ptr(), None)
    finally:
        fp8_lib.ep_emu_set_schedule(0)
    assert rc == 0
    assert torch.equal(q, q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref.contiguous().view(torch.uint8).reshape(-1))


def _local_statics_outside_shared_section(path) -> list[str]:
    """Function-local statics of an emulated kernel library (its kernels' __shared__ variables)
    that lie outside the section the emulation poisons before each block."""
    lines = subprocess.run(["nm", "-C", str(path)], capture_output=True, text=True, check=True).stdout.splitlines()
    symbols = [(int(line[:16], 16), line[19:]) for line in lines if len(line) > 19 and line[17] in "bBdD"]
    bounds = {name: a for a, name in symbols if name in ("__start_ep_emu_shared", "__stop_ep_emu_shared")}
    start, stop = bounds.get("__start_ep_emu_shared", 0), bounds.get("__stop_ep_emu_shared", 0)
    generated = ("guard variable", "typeinfo", "vtable")  # the compiler's, not the kernels'
    return [name for a, name in symbols
            if ")::" in name and not name.startswith(generated) and not start <= a < stop]


def test_every_shared_variable_is_poisoned(tmp_path) -> None:
    """__shared__ variables are statics the emulation poisons before each block (as shared memory
    is undefined when a block starts); a template kernel's would escape it (GCC places them
    outside the section), so none of the kernels may be a template."""
    for source in ("csrc/cuda/lossless_kernels.cu", "csrc/cuda/fp8_kernels.cu"):
        lib = build(source, tmp_path / "check.so", ("EP_LOSSLESS_DEC_WINDOW=1",))
        assert _local_statics_outside_shared_section(lib) == [], source
