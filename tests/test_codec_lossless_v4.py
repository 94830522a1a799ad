"""Lossless format version 4 (csrc/codec/lossless_core.h): the bit-coded frequency table, one-state
chunks (mode 2: a blob's only chunk, at most 4,096 values), all-+0.0 chunks (mode 3: no payload).
Every host path writes the same bytes and reads them back exactly; the table reads back by the
format's definition (a Python reader, independent of the C++ one); versions 2 and 3 still decode;
forged and corrupted blobs are rejected with the same error on every path."""
from __future__ import annotations

import struct

import pytest
import torch
from support.codec_kernel_cases import blob_layout, read_table_v4

from ep_comm.codecs import lossless


def _encode(x: torch.Tensor, version: int = 4, **kwargs) -> torch.Tensor:
    """lossless.encode writing version 4 unless told otherwise (the default is 6)."""
    return lossless.encode(x, version=version, **kwargs)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.int16)


def _inputs() -> list[tuple[str, torch.Tensor, int | None]]:
    g = torch.Generator().manual_seed(41)
    sparse = torch.relu(torch.randn(64, 7168, generator=g)).bfloat16()
    sparse[:, ::3] = 0
    half_zero = torch.randn(8, 7168, generator=g).bfloat16()
    half_zero[:4] = 0  # whole chunks of +0.0 beside coded ones
    return [
        ("message", torch.randn(64, 7168, generator=g).bfloat16(), None),
        ("small_chunks", torch.randn(64, 1024, generator=g).bfloat16(), 1024),
        ("sparse", sparse, None),
        ("half_zero", half_zero, 7168),
        ("zeros", torch.zeros(64, 7168, dtype=torch.bfloat16), None),
        ("bias", (torch.randn(384, generator=g) * 0.01).bfloat16(), None),
        ("one_state_largest", (torch.randn(4096, generator=g) * 0.02).bfloat16(), None),
        ("just_above", (torch.randn(4097, generator=g) * 0.02).bfloat16(), None),
        ("tiny", torch.randn(10, generator=g).bfloat16(), None),
        ("ones", torch.ones(384, dtype=torch.bfloat16), None),
        ("two_symbols", torch.tensor([0.0, 1e30] * 1000).bfloat16(), None),  # a gap above 127
        ("random_bits", torch.randint(-32768, 32768, (3000,), generator=g, dtype=torch.int32).to(torch.int16)
         .view(torch.bfloat16), None),
        ("scalar", torch.tensor(2.5).bfloat16(), None),
        ("empty", torch.zeros(0, 5, dtype=torch.bfloat16), None),
    ]


def _directory(blob: torch.Tensor) -> list[tuple[int, int, int, int]]:
    b, layout = blob.numpy().tobytes(), blob_layout(blob)
    return [struct.unpack_from("<4I", b, layout["directory"] + 16 * c) for c in range(layout["chunks"])]


def _read_table_v4(blob: torch.Tensor) -> tuple[int, dict[int, int], int]:
    """(prob_bits, symbol -> frequency, table bytes) of a version 4 blob by the format's definition:
    a byte kg | kf << 4, then per entry the gap in order-kg and freq - 1 in order-kf Exp-Golomb
    codes (m zero bits, a one, m bits, k bits; stream bits low first), zero bits to the end."""
    b, layout = blob.numpy().tobytes(), blob_layout(blob)
    assert layout["version"] == 4
    entries, prob_bits, size = layout["entries"], layout["prob_bits"], layout["table_bytes"]
    if entries == 0:
        assert size == 0
        return prob_bits, {}, 0
    freqs, used = read_table_v4(b, layout["table_at"], layout["table_at"] + size, entries, prob_bits)
    assert used == size
    return prob_bits, freqs, size


@pytest.mark.parametrize("name,x,chunk_values", _inputs(), ids=[c[0] for c in _inputs()])
def test_version_4_round_trips_on_every_path_and_is_never_larger_than_3(name, x, chunk_values):
    """Every path writes the same version 4 bytes; every path decodes them (and versions 2 and 3 of
    the same tensor) to the input; version 4 is at most version 3's size; its table reads back as
    frequencies of the table's symbols summing to 2^prob_bits."""
    paths = lossless.simd_paths()
    blobs = {p: _encode(x, chunk_values=chunk_values, simd=p) for p in paths}
    assert len({bytes(b.numpy()) for b in blobs.values()}) == 1
    blob = blobs["portable"]
    assert int(blob[4]) == 4
    older = {v: _encode(x, chunk_values=chunk_values, version=v) for v in (2, 3)}
    assert blob.numel() <= older[3].numel(), (blob.numel(), older[3].numel())
    for b in (blob, *older.values()):
        for path in paths:
            out = lossless.decode(b, simd=path)
            assert out.shape == x.shape and torch.equal(bits(out), bits(x)), (path, int(b[4]))
    prob_bits, freqs, _ = _read_table_v4(blob)
    assert len(freqs) == (int(blob[6]) | int(blob[7]) << 8)
    if freqs:
        assert 6 <= prob_bits <= 12 and sum(freqs.values()) == 1 << prob_bits and max(freqs) <= 1024
        assert prob_bits in (11, 12) or [e[0] for e in _directory(blob)] == [2]  # fewer: one state only


def test_modes_where_they_pay():
    """A small tensor is one one-state chunk (4 state bytes, not 128), a message of +0.0 is chunks
    of no payload and no table, a 10-value tensor stays raw (coding it would cost more than its
    values), and above 4,096 values chunks keep 32 states."""
    g = torch.Generator().manual_seed(5)
    bias = (torch.randn(384, generator=g) * 0.01).bfloat16()
    blob = _encode(bias)
    assert [e[0] for e in _directory(blob)] == [2]
    assert blob.numel() + 100 < _encode(bias, version=3).numel()
    zeros = _encode(torch.zeros(64, 7168, dtype=torch.bfloat16))
    assert {e for e in _directory(zeros)} == {(3, 0, 0, 0)} and int(zeros[6]) == 0
    assert zeros.numel() == 20 + 2 + 2 + 16 * len(_directory(zeros))  # header, shape 64 and 7168, directory
    assert [e[0] for e in _directory(_encode(torch.randn(10, generator=g).bfloat16()))] == [1]
    assert {e[0] for e in _directory(_encode(torch.randn(4097, generator=g).bfloat16()))} == {0}


def _reseal(blob: bytearray) -> torch.Tensor:
    """The blob with its metadata checksum recomputed (so a forged directory entry gets past it)."""
    b = bytes(blob)
    end = blob_layout(torch.frombuffer(bytearray(b), dtype=torch.uint8))["directory"]
    at = 12 if b[4] == 4 else 24
    checksum = sum(b[i] * (2 * i + 1) for i in range(end) if not at <= i < at + 4) & 0xFFFFFFFF
    struct.pack_into("<I", blob, at, checksum)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _same_error_everywhere(blob: torch.Tensor) -> str:
    messages = set()
    for path in lossless.simd_paths():
        with pytest.raises(ValueError) as error:
            lossless.decode(blob, simd=path)
        messages.add(str(error.value))
    assert len(messages) == 1, messages
    return messages.pop()


def test_forged_modes_are_rejected():
    """Mode 3 with a field or checksum set, mode 2 in a version 3 blob or on more than 4,096 values,
    an unknown mode: a corrupted directory on every path."""
    g = torch.Generator().manual_seed(8)
    zeros = _encode(torch.zeros(2, 7168, dtype=torch.bfloat16), chunk_values=7168)
    raw = bytearray(zeros.numpy().tobytes())
    at = blob_layout(zeros)["directory"]
    for field in (4, 8, 12):
        bad = bytearray(raw)
        struct.pack_into("<I", bad, at + field, 1)
        assert "directory" in _same_error_everywhere(torch.frombuffer(bad, dtype=torch.uint8))
    v3 = _encode((torch.randn(384, generator=g) * 0.01).bfloat16(), version=3)
    bad = bytearray(v3.numpy().tobytes())
    struct.pack_into("<I", bad, blob_layout(v3)["directory"], 2)
    assert "directory" in _same_error_everywhere(_reseal(bad))
    big = _encode(torch.randn(8192, generator=g).bfloat16(), chunk_values=8192)
    for mode in (2, 4):
        bad = bytearray(big.numpy().tobytes())
        struct.pack_into("<I", bad, blob_layout(big)["directory"], mode)
        assert "directory" in _same_error_everywhere(_reseal(bad))


@pytest.mark.parametrize("name", ["one_state", "zeros"])
def test_every_byte_corruption_is_rejected(name):
    """Every byte of a one-state blob and of a blob with +0.0 chunks, flipped: a ValueError, the same
    on every path (never a wrong tensor, a crash or a hang)."""
    g = torch.Generator().manual_seed(9)
    if name == "one_state":
        x = (torch.randn(300, generator=g) * 0.01).bfloat16()
        x[::7] = 0
    else:
        x = torch.randn(3, 1024, generator=g).bfloat16()
        x[1] = 0
    blob = _encode(x, chunk_values=1024)
    assert {2, 3} & {e[0] for e in _directory(blob)}
    for pos in range(blob.numel()):
        bad = blob.clone()
        bad[pos] ^= 0x5A
        _same_error_everywhere(bad)


@pytest.mark.parametrize("table,message", [
    # valid (symbol 0 at frequency 2048: gap 0 in order 0, 2047 in order 11): the table passes, the
    # forged directory's missing payload fails later
    (bytes([0xB0, 0xFF, 0x1F]), "add up"),
    (bytes([0xBB, 0x01, 0xF0, 0xFF]), "frequency table"),  # the same entry with gap order 11 (at most 10)
    (bytes([0xC0, 0xFF, 0x1F]), "frequency table"),  # ... with frequency order 12 (at most 11)
    (bytes([0xB0, 0xFF, 0x1F, 0x00]), "frequency table"),  # a byte left over
    (bytes([0xB0, 0xFF, 0x3F]), "frequency table"),  # a non-zero bit after the last entry
    (bytes([0x00]), "frequency table"),         # no entry where one is declared
    (bytes([0xB0, 0x01 | 0x02, 0x04]), "frequency table"),  # freq - 1 = 2047 + 2^11: above 2048
])
def test_version_4_table_is_validated(table, message):
    """Tables with a valid metadata checksum but an order out of range, a stream cut short or a
    frequency above 2048 are rejected."""
    header = bytearray(struct.pack("<IBBHIII", 0x424C5045, 4, 1, 1, 32, 0, 11 | len(table) << 16))
    header += bytes([64]) + table  # shape (64,): two chunks of 32
    header += bytes(-len(header) % 4) + bytes(32)
    assert message in _same_error_everywhere(_reseal(header))


def test_version_4_header_and_shape():
    """A 20-byte header, then each dimension in LEB128 (300 -> 0xAC 0x02); a dimension in a longer
    form than its shortest, or of more than 7 bytes, is a bad shape; a blob cut inside the shape is
    truncated."""
    blob = _encode(torch.randn(300, 7).bfloat16())
    assert list(blob[20:23]) == [0xAC, 0x02, 0x07] and blob_layout(blob)["table_at"] == 23
    scalar = _encode(torch.tensor(1.5).bfloat16())
    assert scalar.numel() == 20 + 16 + 4  # header, one directory entry, the raw value padded
    for shape_bytes in (bytes([0x87, 0x00]), bytes([0x80] * 7 + [0x01])):
        header = bytearray(struct.pack("<IBBHIII", 0x424C5045, 4, 1, 0, 32, 0, 11)) + shape_bytes
        header += bytes(-len(header) % 4)
        assert "shape" in _same_error_everywhere(_reseal(header))
    assert "truncated" in _same_error_everywhere(blob[:21].clone())
