"""Lossless format version 7 (csrc/codec/lossless_core.h), the default: version 6 whose chunk and
field-stream checksums mix each pair of values before the weighted sum (``pair_mix``: m ^ (m >>
16) with m = u * 0x9E3779B1 mod 2^32, u = v_2j | v_2j+1 << 16), so that no fixed pattern of
changes cancels in them. Version 6's checksum, sum_i v_i (2 i + 1), is blind to any changes whose
sum and index-weighted sum are both 0 ((-d, +d, +d, -d) on values 2 apart, (+d, -d) and (-d, +d)
on two pairs of neighbouring values), which a flipped bit of a coded field stream produces in about 1e-5 of
flips.

Checked here: the blob is version 6's but for the version byte and the checksums; every checksum
reads back by the definition (a Python reader); every host path writes the same bytes and reads
them back; a bit flip that version 6 decodes to wrong values is rejected; and of every single-bit
flip of small gradient blobs, none decodes to wrong values in version 7, while some do in version
6 (so the sweep can fail). The CUDA kernels' version 7 blobs are checked in
test_codec_kernels_emulated.py (the default version there)."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from support.codec_kernel_cases import gradient_like, silent_flips
from test_codec_lossless_v4 import bits
from test_codec_lossless_v6 import CASES, _payloads

from ep_comm import _host
from ep_comm.codecs import lossless

PAIR_MIX = 0x9E3779B1
MASK32 = 0xFFFFFFFF


def pair_checksum(values: np.ndarray) -> int:
    """Version 7's checksum of a chunk's values (uint16), by the definition."""
    v = values.astype(np.uint64)
    if v.size % 2:
        v = np.append(v, np.uint64(0))
    u = v[0::2] | (v[1::2] << np.uint64(16))
    m = (u * np.uint64(PAIR_MIX)) & np.uint64(MASK32)  # (the product < 2^64: both factors < 2^32)
    mix = m ^ (m >> np.uint64(16))
    weights = 2 * np.arange(u.size, dtype=np.uint64) + np.uint64(1)
    return int(((mix * weights) & np.uint64(MASK32)).sum()) & MASK32


def linear_checksum(values: np.ndarray) -> int:
    """Versions 2 to 6's: sum_i v_i (2 i + 1) mod 2^32."""
    weights = 2 * np.arange(values.size, dtype=np.uint64) + np.uint64(1)
    return int((values.astype(np.uint64) * weights).sum()) & MASK32


def _values(x: torch.Tensor) -> np.ndarray:
    return bits(x).numpy().view(np.uint16)


def _checksums(blob: torch.Tensor) -> list[tuple[int, int | None]]:
    """Each chunk's directory checksum, and its field stream's (modes 4 and 5; else None)."""
    b = blob.numpy().tobytes()
    chunks = _payloads(blob)
    directory = chunks[0]["at"] - 16 * len(chunks) if chunks else 0  # (the payloads follow it)
    out = []
    for c, chunk in enumerate(chunks):
        checksum = struct.unpack_from("<I", b, directory + 16 * c + 12)[0]
        field = None
        if chunk["mode"] in (4, 5):
            field = struct.unpack_from("<I", b, chunk["at"] + (8 if chunk["mode"] == 5 else 256) + 8)[0]
        out.append((checksum, field))
    return out


def test_version_7_is_the_default():
    x = gradient_like(8)
    blob = lossless.encode(x)
    assert lossless.FORMAT_VERSION == 7 and _host.LOSSLESS_FORMAT_VERSION == 7 and 7 in lossless.FORMAT_VERSIONS
    assert int(blob[4]) == 7 and torch.equal(blob, lossless.encode(x, version=7))


@pytest.mark.parametrize("name,x,chunk_values", CASES, ids=[c[0] for c in CASES])
def test_version_7_is_version_6_but_for_its_checksums(name, x, chunk_values):
    """Same size, modes, counts and payload bytes: only the version byte, the metadata checksum,
    the directory's checksums and the field headers' checksums differ; each checksum is the
    definition's over the chunk's values (version 7: pairs; version 6: linear), the field streams'
    over the values w_k = f_k << 6 of the chunk's fields."""
    b7 = lossless.encode(x, chunk_values=chunk_values)
    b6 = lossless.encode(x, chunk_values=chunk_values, version=6)
    assert b7.numel() == b6.numel() and int(b7[4]) == 7 and int(b6[4]) == 6
    p7, p6 = _payloads(b7), _payloads(b6)
    assert [{k: c[k] for k in ("mode", "words", "fields", "at")} for c in p7] == \
           [{k: c[k] for k in ("mode", "words", "fields", "at")} for c in p6]
    differing = set(np.flatnonzero(b7.numpy() != b6.numpy()).tolist())
    allowed = {4, 12, 13, 14, 15}
    if p7:
        directory = p7[0]["at"] - 16 * len(p7)
        for c, chunk in enumerate(p7):
            allowed |= set(range(directory + 16 * c + 12, directory + 16 * c + 16))
            if chunk["mode"] in (4, 5):
                at = chunk["at"] + (8 if chunk["mode"] == 5 else 256) + 8
                allowed |= set(range(at, at + 4))
    assert differing <= allowed, sorted(differing - allowed)[:10]
    values = _values(x)
    cv = struct.unpack_from("<I", b7.numpy().tobytes(), 8)[0]
    for c, ((s7, f7), (s6, f6)) in enumerate(zip(_checksums(b7), _checksums(b6))):
        v = values[c * cv:(c + 1) * cv]
        assert s7 == pair_checksum(v) and s6 == linear_checksum(v), c
        if f7 is not None:
            w = ((v[v != 0] & 0x3F).astype(np.uint16) << 6).astype(np.uint16)
            assert f7 == pair_checksum(w) and f6 == linear_checksum(w), c


@pytest.mark.parametrize("name,x,chunk_values", CASES[:6] + CASES[-4:], ids=[c[0] for c in CASES[:6] + CASES[-4:]])
def test_every_path_writes_and_reads_version_7_alike(name, x, chunk_values):
    blobs = {p: lossless.encode(x, chunk_values=chunk_values, simd=p) for p in lossless.simd_paths()}
    blob = blobs["portable"]
    assert all(torch.equal(b, blob) for b in blobs.values()), name
    for p in lossless.simd_paths():
        y = lossless.decode(blob, simd=p)
        assert torch.equal(bits(y), bits(x)), (name, p)


def _flipped(blob: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    b = bytearray(blob.numpy().tobytes())
    b[byte] ^= 1 << bit
    return torch.frombuffer(b, dtype=torch.uint8)


def test_a_flip_version_6_decodes_wrong_is_rejected():
    """A 96-value gradient blob (one chunk, mode 5: its fields coded by a second state) whose
    field stream, with bit 7 of byte 128 flipped, decodes to 4 values changed by (+32, -32) at
    42, 43 and (-32, +32) at 48, 49: changes whose sum and index-weighted sum are both 0, so
    version 6's checksum is unchanged and every path returns the wrong values; version 7's blob
    (the same layout) with the same flip is rejected on every path."""
    x = gradient_like(1, seed=9, hidden=96)
    b6, b7 = lossless.encode(x, version=6), lossless.encode(x)
    assert _payloads(b6)[0]["mode"] == 5 and b6.numel() == b7.numel()
    want = _values(x).astype(np.int64)
    for p in lossless.simd_paths():
        delta = _values(lossless.decode(_flipped(b6, 128, 7), simd=p)).astype(np.int64) - want
        changed = np.flatnonzero(delta)
        assert changed.tolist() == [42, 43, 48, 49] and delta.sum() == 0 and (delta * np.arange(96)).sum() == 0, p
        with pytest.raises(ValueError, match="checksum mismatch"):
            lossless.decode(_flipped(b7, 128, 7), simd=p)


def test_no_single_bit_flip_of_gradient_blobs_decodes_wrong():
    """Every single-bit flip of 120 small one-chunk gradient blobs (modes 2 and 5) and of two
    blobs of 2,048-value chunks with coded fields (mode 4), about 160,000 flips: none decodes to
    wrong values in version 7. The same sweep finds such flips in version 6 (the blind spot)."""
    inputs = [(gradient_like(1, seed=s, hidden=96), None) for s in range(120)]
    inputs += [(gradient_like(1, seed=s, hidden=4096, zero_share=0.3), 2048) for s in range(2)]
    silent6 = silent7 = tried = 0
    for x, cv in inputs:
        s7, n, _ = silent_flips(x, 7, cv)
        silent7 += s7
        tried += n
        silent6 += silent_flips(x, 6, cv)[0]
    assert tried > 150_000
    assert silent7 == 0 and silent6 >= 1, (silent7, silent6, tried)
