"""The CUDA lossless encoder (csrc/cuda/lossless_kernels.cu, ``ep_lossless_encode_cuda``) run on
the CPU through the CUDA emulation (csrc/emulation/): its kernel count, and its blobs
byte-identical to the host encoder's where its chunks meet across blocks (the rANS kernel's
decoupled look-back over more chunks than one block or one wave holds), on emulated devices of
several sizes, with bounded residency and in both schedule orders. The byte-identity cases of
tests/support/codec_kernel_cases.py run in tests/test_codec_kernels_emulated.py."""
from __future__ import annotations

import ctypes

import pytest
import torch
from support.codec_kernel_cases import (
    CASES,
    ENCODER_MAX_KERNELS,
    VERSION_6_GATED_LAUNCHES,
    blob_layout,
    check_blob_is_byte_identical_and_decodes_tensor,
    device_encode,
    field_chunks,
    gradient_like,
    many_chunks,
)
from support.emulated_cuda import default_device
from support.native import compiler

from ep_comm.codecs import lossless

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler")

MANY_CHUNK_VALUES = 96


@pytest.fixture
def lib(emulated_encoder) -> ctypes.CDLL:
    return emulated_encoder


@pytest.mark.parametrize("version", [4, 6, 7])
@pytest.mark.parametrize("case,chunk_values", [("n0", 4096), ("scalar", 4096), ("one_state", 4096),
                                               ("random_bits", 4096), ("zeros", 64), ("mixed", 96),
                                               ("normal", 65536)])
def test_encoder_makes_three_kernel_launches_and_format_6_one_more(lib, case: str, chunk_values: int,
                                                                   version: int) -> None:
    """Counted by the emulated runtime: every EP_LAUNCH of one ep_lossless_encode_cuda call (the
    cudaMemsetAsync that zeroes the histogram and the tickets is no kernel, counted apart: one);
    versions 6 and 7 (the default) launch one more, which returns at once. Fails on the five-kernel
    encoder of commit 954bcf7 (5 launches)."""
    x = CASES[case]()
    launches, memsets = lib.ep_emu_launch_count(), lib.ep_emu_memset_count()
    blob = device_encode(lib, x, chunk_values, "cpu", version=version)
    launches, memsets = lib.ep_emu_launch_count() - launches, lib.ep_emu_memset_count() - memsets
    assert torch.equal(blob, lossless.encode(x, chunk_values=chunk_values, version=version))
    assert 1 <= launches <= ENCODER_MAX_KERNELS + (VERSION_6_GATED_LAUNCHES if version >= 6 else 0), launches
    assert memsets <= 1, memsets


@pytest.mark.parametrize("reverse", [0, 1], ids=["forward", "reverse"])
@pytest.mark.parametrize("sms,blocks_per_sm,resident_limit", [(1, 1, 0), (2, 2, 3), (8, 4, 0), (64, 32, 5)])
def test_many_chunks_across_blocks_give_the_host_blob(lib, reverse: int, sms: int, blocks_per_sm: int,
                                                      resident_limit: int) -> None:
    """More chunks than one rANS block (8) and one histogram block (32) take, on devices holding
    one block at a time, a few, or every block at once; blocks admitted in index order or the
    reverse. A look-back waiting on chunks by block index would stall where later blocks are
    resident first (the stall report fails the launch instead of letting a timeout end it)."""
    x = many_chunks(1100, MANY_CHUNK_VALUES)
    assert -(-x.numel() // MANY_CHUNK_VALUES) > 1024
    lib.ep_emu_set_device(sms, blocks_per_sm)
    lib.ep_emu_set_resident_limit(resident_limit)
    lib.ep_emu_set_schedule(reverse)
    lib.ep_emu_set_stall_failure(1)
    try:
        blob = check_blob_is_byte_identical_and_decodes_tensor(lib, "cpu", x, MANY_CHUNK_VALUES)
    finally:
        default_device(lib)
    modes = _directory_modes(blob, x.numel(), MANY_CHUNK_VALUES)
    assert {0, 1, 3} <= set(modes), sorted(set(modes))  # rANS-coded, raw and +0.0 chunks


def test_more_chunks_than_the_rans_grid_has_warps(lib) -> None:
    """16,400 chunks: more than the rANS kernel's largest grid has warps (2,048 blocks of 8, the
    workspace's scratch slots); on a device holding 4 blocks at a time, the warps resident first
    code most chunks, each through its one scratch slot, and the others find none left."""
    x = many_chunks(16400, MANY_CHUNK_VALUES)
    lib.ep_emu_set_device(2, 2)
    lib.ep_emu_set_stall_failure(1)
    try:
        blob = check_blob_is_byte_identical_and_decodes_tensor(lib, "cpu", x, MANY_CHUNK_VALUES)
    finally:
        default_device(lib)
    assert {0, 1, 3} <= set(_directory_modes(blob, x.numel(), MANY_CHUNK_VALUES))


def _directory_modes(blob: torch.Tensor, n: int, chunk_values: int) -> list[int]:
    """The mode of each chunk in a blob's directory."""
    layout = blob_layout(blob)
    raw = blob.numpy().tobytes()
    chunks = -(-n // chunk_values)
    return [int.from_bytes(raw[layout["directory"] + 16 * c:layout["directory"] + 16 * c + 4], "little")
            for c in range(chunks)]


@pytest.mark.parametrize("version,case", [(4, "mixed"), (5, "mixed"), (6, "mixed"), (6, "gradients")])
@pytest.mark.parametrize("offset", [2, 6])
def test_unaligned_input_and_output_give_the_host_blob(lib, offset: int, version: int, case: str) -> None:
    """Values that start 2 or 6 bytes past a 16-byte boundary (no 16-byte loads) coded into an
    output that is not 4-byte aligned: the host's blob, raw and rANS-coded chunks alike (format 6:
    gradients with chunks of coded fields, mode 4)."""
    x = gradient_like(4, seed=6).reshape(-1) if case == "gradients" else CASES[case]()
    n, cv = x.numel(), 4096
    host = lossless.encode(x, chunk_values=cv, version=version)
    assert case != "gradients" or field_chunks(host) > 0
    space = torch.zeros(n + 16, dtype=torch.int16)
    first = ((-space.data_ptr()) % 16 + offset) // 2
    space[first:first + n] = x.view(torch.int16)
    ws = torch.full((lib.ep_lossless_encode_workspace_bytes(n, cv, version),), 0xA5, dtype=torch.uint8)
    out = torch.full((lib.ep_lossless_max_blob_bytes(n, 1, cv, version) + 8,), 0x5A, dtype=torch.uint8)
    at = (-out.data_ptr()) % 4 + 1
    size = torch.zeros(1, dtype=torch.int64)
    shape = (ctypes.c_int64 * 1)(n)
    rc = lib.ep_lossless_encode_cuda(space.data_ptr() + 2 * first, n, shape, 1, cv, version, out.data_ptr() + at,
                                     size.data_ptr(), ws.data_ptr(), ws.numel(), ctypes.c_void_p(None))
    assert rc == 0
    assert torch.equal(out[at:at + int(size)], host)


@pytest.mark.parametrize("n,zero_share", [(100, 1.0), (4096, 0.3), (4097, 0.3), (2, 0.0)])
def test_blobs_of_one_chunk_around_the_one_state_limit(lib, n: int, zero_share: float) -> None:
    """A version 4 blob's only chunk: one state (mode 2) up to 4,096 values, raw when that does not
    pay (2 values), +0.0 only (mode 3) through the one-state path; 32 states from 4,097 values
    (version 5's limits: tests/test_codec_encoder_v5_emulated.py)."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 0.02).bfloat16()
    x = torch.where(torch.rand(n, generator=g) < zero_share, torch.zeros_like(x), x)
    blob = check_blob_is_byte_identical_and_decodes_tensor(lib, "cpu", x, lossless.DEFAULT_CHUNK_VALUES, version=4)
    (mode,) = _directory_modes(blob, n, lossless.DEFAULT_CHUNK_VALUES)
    assert mode == {100: 3, 4096: 2, 4097: 0, 2: 1}[n], mode
