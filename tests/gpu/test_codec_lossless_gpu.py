"""The lossless codec's CUDA kernels (csrc/cuda/lossless_kernels.cu, built as a small library by
bench/codec_gpu.py) against the host build of the same core: device blobs are byte-identical to
the host encoder's (format versions 4 to 7), device decoding is exact, and the
device rejects corrupted blobs with the status the host decoder reports. The cases and checks are
tests/support/codec_kernel_cases.py's, which tests/test_codec_kernels_emulated.py also runs on the
CPU through the CUDA emulation."""
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
    V6_CASES,
    bits,
    check_blob_is_byte_identical_and_decodes,
    check_blob_is_byte_identical_and_decodes_tensor,
    check_rejects_corrupted_blobs_like_the_host,
    device_decode,
    device_encode,
    field_chunks,
    host_status,
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


# (case, chunk values, extra tables: 0 for none, else at least this many) of the version 5 encodes
V5_ENCODE_CASES = [("mixed_rows", 4096, 4), ("mixed_rows", 14336, 4), ("mixed_rows_tail", 7168, 4),
                   ("many_tables", 4096, 255), ("mixed", 4096, 1), ("normal", 4096, 0), ("one_state", 65536, 0),
                   ("zeros", 64, 0), ("random_bits", 4096, 0), ("n0", 4096, 0), ("many_chunks", 96, 0)]


@pytest.mark.parametrize("case,chunk_values,tables", V5_ENCODE_CASES)
def test_device_encodes_format_version_5_like_the_host(lib: ctypes.CDLL, case: str, chunk_values: int,
                                                       tables: int) -> None:
    """The kernels' version 5 blob (chunks with tables of their own, 255 of them, a tail chunk, +0.0
    only in several chunks as the fewest chunks, no table, one-state chunks) is the host
    encoder's, byte for byte, and decodes exactly on the GPU: phase A's surveys and final tables
    across the whole grid, phase B waiting for them on a real schedule."""
    x = {**CASES, **V5_CASES, "many_tables": many_tables}[case]()
    host = lossless.encode(x, chunk_values=chunk_values, version=5)
    assert int(host[17]) >= tables if tables else int(host[17]) == 0
    dev = device_encode(lib, x, chunk_values, "cuda", version=5)
    assert dev.numel() == host.numel() and torch.equal(dev, host)
    status, y = device_decode(lib, dev, x.numel(), chunk_values, "cuda")
    assert status == 0 and torch.equal(y.cpu(), bits(x))


@pytest.mark.parametrize("version", [6, 7])
@pytest.mark.parametrize("case,make,chunk_values,coded", V6_CASES, ids=[c[0] for c in V6_CASES])
def test_device_decodes_format_version_6(lib: ctypes.CDLL, case: str, make, chunk_values: int, coded: int,
                                         version: int) -> None:
    """Host-encoded format 6 and 7 blobs (chunks whose raw fields are rANS-coded, rebuilt by
    fields_kernel in workspace slots; 7: the pair checksum) decode exactly on the GPU; a corrupted
    field stream gets the host's status."""
    x = make()
    blob = lossless.encode(x, chunk_values=chunk_values, version=version)
    slots = field_chunks(blob)
    assert slots >= coded
    status, y = device_decode(lib, blob, x.numel(), chunk_values, "cuda", slots)
    assert status == 0 and torch.equal(y, bits(x))
    bad = blob.clone()
    bad[-5] ^= 0x24
    assert device_decode(lib, bad, x.numel(), chunk_values, "cuda", slots)[0] == host_status(bad)


@pytest.mark.parametrize("version", [6, 7])
@pytest.mark.parametrize("case,make,chunk_values,coded", V6_CASES, ids=[c[0] for c in V6_CASES])
def test_device_encodes_format_version_6_like_the_host(lib: ctypes.CDLL, case: str, make, chunk_values: int,
                                                       coded: int, version: int) -> None:
    """The kernels' format 6 and 7 blobs (field streams coded by rans_fields_kernel) are the host
    encoder's, byte for byte, and decode exactly on the GPU."""
    x = make()
    blob = check_blob_is_byte_identical_and_decodes_tensor(lib, "cuda", x, chunk_values, version=version)
    assert field_chunks(blob) >= coded


@pytest.mark.parametrize("case,chunk_values", [("mixed_rows", 14336), ("normal", 4096), ("one_state", 4096)])
@pytest.mark.parametrize("version", [6, 7])
def test_device_encodes_format_version_6_of_other_tensors_like_the_host(lib: ctypes.CDLL, case: str,
                                                                         chunk_values: int, version: int) -> None:
    x = {**CASES, **V5_CASES}[case]()
    check_blob_is_byte_identical_and_decodes_tensor(lib, "cuda", x, chunk_values, version=version)
