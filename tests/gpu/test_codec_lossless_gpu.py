"""The lossless codec's CUDA kernels (csrc/cuda/lossless_kernels.cu, built as a small library by
bench/codec_gpu.py) against the host build of the same core: device blobs are byte-identical to
the host encoder's, device decoding is exact, and the device rejects corrupted blobs with the
status the host decoder reports. The cases and checks are tests/support/codec_kernel_cases.py's, which
tests/test_codec_kernels_emulated.py also runs on the CPU through the CUDA emulation."""
from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch
from support.codec_kernel_cases import (
    CASES,
    CHUNK_VALUES,
    CORRUPTION_CASES,
    V5_CASES,
    V5_DECODE_CASES,
    bits,
    check_blob_is_byte_identical_and_decodes,
    check_rejects_corrupted_blobs_like_the_host,
    device_decode,
    many_tables,
)

from ep_comm.codecs import lossless

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from codec_gpu import gpu_library
    # a library prebuilt for this device (bench/gpu_check.sh carries one) saves the nvcc run
    return gpu_library(os.environ.get("EP_COMM_CODEC_GPU_LIB"))


@pytest.mark.parametrize("chunk_values", CHUNK_VALUES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_device_blob_is_byte_identical_and_decodes(lib: ctypes.CDLL, case: str, chunk_values: int) -> None:
    check_blob_is_byte_identical_and_decodes(lib, "cuda", case, chunk_values)


@pytest.mark.parametrize("case,chunk_values", CORRUPTION_CASES)
def test_device_rejects_corrupted_blobs_like_the_host(lib: ctypes.CDLL, case: str, chunk_values: int) -> None:
    check_rejects_corrupted_blobs_like_the_host(lib, "cuda", case, chunk_values)


@pytest.mark.parametrize("case,chunk_values,tables", V5_DECODE_CASES)
def test_device_decodes_format_version_5(lib: ctypes.CDLL, case: str, chunk_values: int, tables: int) -> None:
    """Host-encoded format 5 blobs (chunks with tables of their own, read from the workspace in
    global memory, beside chunks of the shared table) decode exactly on the GPU."""
    x = {**CASES, **V5_CASES}[case]()
    blob = lossless.encode(x, chunk_values=chunk_values, version=5)
    assert int(blob[17]) >= tables if tables else int(blob[17]) == 0
    status, y = device_decode(lib, blob, x.numel(), chunk_values, "cuda")
    assert status == 0 and torch.equal(y.cpu(), bits(x))


def test_device_decodes_format_version_5_with_255_extra_tables(lib: ctypes.CDLL) -> None:
    x = many_tables()
    blob = lossless.encode(x, chunk_values=4096, version=5)
    assert int(blob[17]) == 255
    status, y = device_decode(lib, blob, x.numel(), 4096, "cuda")
    assert status == 0 and torch.equal(y.cpu(), bits(x))


@pytest.mark.parametrize("case,chunk_values", [("mixed_rows", 4096), ("mixed", 4096)])
def test_device_rejects_corrupted_format_version_5_blobs_like_the_host(lib: ctypes.CDLL, case: str,
                                                                       chunk_values: int) -> None:
    check_rejects_corrupted_blobs_like_the_host(lib, "cuda", case, chunk_values, trials=60, version=5)
