"""The CUDA lossless encoder (csrc/cuda/lossless_kernels.cu) writing format version 5, run on the
CPU through the CUDA emulation (csrc/emulation/): its blobs byte-identical to the host encoder's
version 5 (``lossless.encode(x, version=5)``) and decoded back by the kernels, on messages whose
chunks take tables of their own (more than the format's 255 among them, a tail chunk), with the
shared table refitted and not, a blob of +0.0 only in several chunks, one-state chunks past
version 4's 4,096 values, no values; on emulated devices holding one block, a few or all at once,
blocks admitted in either order (phase A's last survey, the final tables and phase B's wait for
them); at most three kernel launches. Version 4's blobs are checked by
tests/test_codec_encoder_emulated.py and tests/test_codec_kernels_emulated.py."""
from __future__ import annotations

import ctypes
import struct

import pytest
import torch
from support.codec_kernel_cases import (
    CASES,
    ENCODER_MAX_KERNELS,
    bits,
    blob_layout,
    device_decode,
    device_encode,
    from_bits,
    many_tables,
    mixed_rows,
    read_table_v4,
)
from support.emulated_cuda import default_device
from support.native import compiler

from ep_comm.codecs import lossless

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler")

CUDA_ERROR_INVALID_VALUE = 1


@pytest.fixture
def lib(emulated_encoder) -> ctypes.CDLL:
    return emulated_encoder


def _outliers(chunks: int, at: tuple[int, ...], seed: int = 9) -> torch.Tensor:
    """``chunks`` chunks of 4,096 normal values, those at ``at`` scaled by 1e4 and 1e-4 in turn: each
    outlier takes a table of its own; the keepers' statistics are the blob's, so refitting the shared
    table to them does not pay."""
    x = torch.randn(chunks * 4096, generator=torch.Generator().manual_seed(seed))
    for k, c in enumerate(at):
        x[c * 4096:(c + 1) * 4096] *= 1e4 if k % 2 == 0 else 1e-4
    return x.bfloat16()


def _wide_windows(chunks: int, chunk_values: int, width: int = 150) -> torch.Tensor:
    """``chunks`` chunks of random bf16 values whose exponents are uniform over a window of ``width``
    values, the window moving from chunk to chunk: every chunk gains from a table of its own of
    about 300 bytes, so the extra tables' bytes (kMaxExtraTableSectionBytes) stop the takers
    before the format's 255."""
    g = torch.Generator().manual_seed(43)
    n = chunks * chunk_values
    start = torch.tensor([(37 * k) % (250 - width) for k in range(chunks)]).repeat_interleave(chunk_values)
    exponent = start + 1 + torch.randint(0, width, (n,), generator=g)
    sign = torch.randint(0, 2, (n,), generator=g) << 15
    return from_bits(sign | exponent << 7 | torch.randint(0, 128, (n,), generator=g))


def _wide_taker(chunks: int = 4, chunk_values: int = 65536) -> torch.Tensor:
    """``chunks`` chunks of normal values, the last one instead 1.0 and -1.0 (45% each) and 10%
    random bits (about 1,000 rare symbols): its table of its own takes 12-bit frequencies (with 11
    bits the rare symbols' least frequencies would take half the probability from the two; with
    one symbol over half, 12 bits would not fit: at most 2,048)."""
    g = torch.Generator().manual_seed(47)
    x = torch.randn(chunks * chunk_values, generator=g).bfloat16()
    last = torch.where(torch.rand(chunk_values, generator=g) < 0.5, 1.0, -1.0).bfloat16()
    rare = torch.rand(chunk_values, generator=g) < 0.1
    last[rare] = from_bits(torch.randint(0, 1 << 16, (chunk_values,), generator=g)[rare])
    x[-chunk_values:] = last
    return x


def _extra_prob_bits(blob: torch.Tensor) -> list[int]:
    """The probability bits of each extra table of a version 5 blob (the framing byte before it)."""
    b, layout = blob.numpy().tobytes(), blob_layout(blob)
    end = layout["table_at"] + layout["table_bytes"]
    _, at = read_table_v4(b, layout["table_at"], end, layout["entries"], layout["prob_bits"])
    at += layout["table_at"]
    out = []
    for _ in range(int(blob[17])):
        out.append(b[at])
        length, shift, at = 0, 0, at + 1
        while True:
            length |= (b[at] & 0x7F) << shift
            shift, at = shift + 7, at + 1
            if not b[at - 1] & 0x80:
                break
        at += length
    assert at == end
    return out


def _shared_table(blob: torch.Tensor) -> tuple[int, tuple]:
    """(prob_bits, the (symbol, frequency) pairs) of a version 4 or 5 blob's shared table."""
    b, layout = blob.numpy().tobytes(), blob_layout(blob)
    table, _ = read_table_v4(b, layout["table_at"], layout["table_at"] + layout["table_bytes"], layout["entries"],
                             layout["prob_bits"])
    return layout["prob_bits"], tuple(sorted(table.items()))


def _modes(blob: torch.Tensor) -> list[tuple[int, int]]:
    """(mode, table) of each directory entry of a version 4 or 5 blob."""
    b, layout = blob.numpy().tobytes(), blob_layout(blob)
    words = [struct.unpack_from("<I", b, layout["directory"] + 16 * c)[0] for c in range(layout["chunks"])]
    return [(w & 0xFF, w >> 8) for w in words]


def check_v5(lib: ctypes.CDLL, x: torch.Tensor, chunk_values: int) -> torch.Tensor:
    """The kernels' version 5 blob of ``x`` is the host's, and the kernels decode it exactly;
    returns the blob."""
    host = lossless.encode(x, chunk_values=chunk_values, version=5)
    dev = device_encode(lib, x, chunk_values, "cpu", version=5)
    assert dev.numel() == host.numel() and torch.equal(dev, host), (dev.numel(), host.numel())
    assert host[4] == 5
    status, y = device_decode(lib, dev, x.numel(), chunk_values, "cpu")
    assert status == 0 and torch.equal(y, bits(x))
    return host


# (name, tensor, chunk values, extra tables T (None: at least 1), the shared table refitted)
TAKER_CASES = [
    ("mixed_rows", lambda: mixed_rows(16, 7168, 3, 2), 4096, None, True),
    ("mixed_rows_wide_chunks", lambda: mixed_rows(16, 7168, 3, 2), 14336, None, True),
    ("mixed_rows_tail", lambda: mixed_rows(15, 7000, 5), 7168, None, True),  # the last chunk 1,568 values short
    ("one_outlier", lambda: _outliers(31, (5,)), 4096, 1, False),
    ("two_outliers", lambda: _outliers(40, (5, 31)), 4096, 2, False),
    ("more_takers_than_255", lambda: many_tables(320, 4096), 4096, 255, True),
    ("extra_table_bytes_limit", lambda: _wide_windows(230, 8192), 8192, None, True),
    ("taker_with_12_bits", _wide_taker, 65536, None, True),
]


@pytest.mark.parametrize("name,make,chunk_values,tables,refit", TAKER_CASES, ids=[c[0] for c in TAKER_CASES])
def test_chunks_with_tables_of_their_own_give_the_host_blob(lib, name, make, chunk_values, tables, refit) -> None:
    """Chunks take extra tables (T > 0 in the host's blob, so the case exercises them: the takers,
    their tables in chunk order, the entries' table indices), the shared table refitted to the
    keepers or version 4's first table kept, as the case means."""
    x = make()
    blob = check_v5(lib, x, chunk_values)
    extra = int(blob[17])
    assert extra > 0 and (tables is None or extra == tables), extra
    if name == "extra_table_bytes_limit":  # stopped by the bytes, not by the count or the last keeper
        assert extra < 200 and blob_layout(blob)["table_bytes"] > 0xFFFF - 4 * 1025, blob_layout(blob)["table_bytes"]
    assert {t for mode, t in _modes(blob) if t != 0} == set(range(1, extra + 1))
    assert (12 in _extra_prob_bits(blob)) == (name == "taker_with_12_bits"), _extra_prob_bits(blob)
    assert (_shared_table(blob) != _shared_table(lossless.encode(x, chunk_values=chunk_values, version=4))) == refit


@pytest.mark.parametrize("name,make,chunk_values", [
    ("zeros_many_chunks", lambda: torch.zeros(5000, dtype=torch.bfloat16), 64),
    ("zeros_2d", lambda: torch.zeros(64, 7168, dtype=torch.bfloat16), 4096),
    ("n0", CASES["n0"], 4096),
    ("n0_2d", CASES["n0_2d"], 4096),
    ("scalar", CASES["scalar"], 4096),
    ("random_bits", CASES["random_bits"], 4096),  # every chunk raw: no table
    ("mixed", CASES["mixed"], 4096),  # raw, +0.0 and coded chunks
    ("normal_small_chunks", CASES["normal"], 1024),  # under 4,096 values a chunk: no own tables
    ("many_chunks", CASES["many_chunks"], 96),
])
def test_other_version_5_blobs_give_the_host_blob(lib, name, make, chunk_values) -> None:
    """Blobs without extra tables: +0.0 only in several chunks (written as the fewest chunks), no
    values, every chunk raw (no table at all), chunks too small for tables of their own."""
    x = make()
    blob = check_v5(lib, x, chunk_values)
    if name.startswith("zeros"):
        layout = blob_layout(blob)
        assert layout["chunks"] == 1 and layout["chunk_values"] > chunk_values
    if name == "random_bits":
        assert blob[6] == 0 and blob[7] == 0 and blob_layout(blob)["table_bytes"] == 0


@pytest.mark.parametrize("n,chunk_values,mode", [(12288, 65536, 2), (16384, 65536, 2), (16385, 65536, 0),
                                                 (8192, 32768, 2), (8193, 32768, 0), (4097, 8192, 0)])
def test_one_chunk_blobs_take_one_state_to_the_version_5_limit(lib, n, chunk_values, mode) -> None:
    """A blob's only chunk takes one state (mode 2) up to one_state_max_values(5, chunk_values): a
    quarter of chunk_values in [4096, 16384] (version 4: 4,096), its probability bits chosen from 6
    to 12 as the host chooses them."""
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).bfloat16()
    blob = check_v5(lib, x, chunk_values)
    assert _modes(blob) == [(mode, 0)]


@pytest.mark.parametrize("reverse", [0, 1], ids=["forward", "reverse"])
@pytest.mark.parametrize("sms,blocks_per_sm,resident_limit", [(1, 1, 0), (2, 2, 3), (64, 32, 5)])
def test_tables_across_blocks_on_any_schedule(lib, reverse: int, sms: int, blocks_per_sm: int,
                                              resident_limit: int) -> None:
    """64 chunks (8 rANS blocks) that mostly take tables of their own, on devices holding one block
    at a time, a few, or every block; blocks admitted in index order or the reverse. A block waiting
    for the final tables before every survey was handed out, or the tables built by a block that
    is not running, would stall (the stall report fails the launch)."""
    x = mixed_rows(64, 4096, 7, 2)
    lib.ep_emu_set_device(sms, blocks_per_sm)
    lib.ep_emu_set_resident_limit(resident_limit)
    lib.ep_emu_set_schedule(reverse)
    lib.ep_emu_set_stall_failure(1)
    try:
        blob = check_v5(lib, x, 4096)
    finally:
        default_device(lib)
    assert int(blob[17]) > 8


@pytest.mark.parametrize("case,chunk_values", [("mixed_rows", 4096), ("zeros", 64), ("n0", 4096),
                                               ("one_state", 65536)])
def test_version_5_encoder_makes_at_most_three_kernel_launches(lib, case: str, chunk_values: int) -> None:
    """Every EP_LAUNCH of one version 5 encode, counted by the emulated runtime (the one memset of
    the histogram, tickets and flag counted apart)."""
    x = mixed_rows(16, 7168, 3, 2) if case == "mixed_rows" else CASES[case]()
    launches, memsets = lib.ep_emu_launch_count(), lib.ep_emu_memset_count()
    blob = device_encode(lib, x, chunk_values, "cpu", version=5)
    launches, memsets = lib.ep_emu_launch_count() - launches, lib.ep_emu_memset_count() - memsets
    assert torch.equal(blob, lossless.encode(x, chunk_values=chunk_values, version=5))
    assert 1 <= launches <= ENCODER_MAX_KERNELS, launches
    assert memsets <= 1, memsets


@pytest.mark.parametrize("version", [2, 3, 8])
def test_other_versions_are_invalid_arguments(lib, version: int) -> None:
    """The device encoder writes versions 4 to 7 only."""
    x = CASES["normal"]()
    n = x.numel()
    # room for the largest format (7: its slots' field areas), so only the version can be refused
    ws = torch.zeros(lib.ep_lossless_encode_workspace_bytes(n, 4096, 7), dtype=torch.uint8)
    out = torch.zeros(lib.ep_lossless_max_blob_bytes(n, 1, 4096, 7), dtype=torch.uint8)
    size = torch.zeros(1, dtype=torch.int64)
    rc = lib.ep_lossless_encode_cuda(x.view(torch.int16).data_ptr(), n, (ctypes.c_int64 * 1)(n), 1, 4096, version,
                                     out.data_ptr(), size.data_ptr(), ws.data_ptr(), ws.numel(), None)
    assert rc == CUDA_ERROR_INVALID_VALUE
