"""Lossless format version 6 (csrc/codec/lossless_fields.h): version 5 where a 32-state chunk may
code its raw fields with a second rANS stream (mode 4), and a one-state chunk with a second state
(mode 5). Every host path writes the same bytes and
reads them back exactly; chunks whose low mantissa bits carry little information take mode 4 and
shrink, the others are version 5's bytes; the field header and table read back by the format's
definition (a Python reader); corrupted and forged blobs are rejected with the same error on every
path; the metadata checks before the CUDA decoder count the chunks with coded fields (the
emulated kernels' tests are in test_codec_kernels_emulated.py)."""
from __future__ import annotations

import math
import re
import struct

import pytest
import torch
from support.codec_kernel_cases import gradient_like, read_table_v4
from test_codec_lossless_v4 import _inputs, _same_error_everywhere, bits
from test_codec_lossless_v5 import _inputs_v5, _layout, _reseal

from ep_comm import _host
from ep_comm.codecs import lossless, lossless_device

H = 7168


def _payloads(blob: torch.Tensor) -> list[dict]:
    """Each chunk's directory entry and payload offset (by the format's payload sizes)."""
    layout = _layout(blob)
    b = blob.numpy().tobytes()
    cv, n_total = struct.unpack_from("<I", b, 8)[0], math.prod(_host.lossless_shape(blob.data_ptr(), blob.numel()))
    at = layout["directory"] + 16 * layout["chunks"]
    out = []
    for c, e in enumerate(layout["entries"]):
        n = min(cv, n_total - c * cv)
        mode, words, fields = e["mode"], e["words"], e["fields"]
        size = {0: 128 + 2 * words + (6 * fields + 7) // 8, 1: 2 * n, 2: 4 + 2 * words + (6 * fields + 7) // 8,
                3: 0, 4: 256 + 2 * words, 5: 8 + 2 * words}[mode]
        out.append({**e, "n": n, "at": at, "size": size})
        at += (size + 3) // 4 * 4
    assert at == len(b)
    return out


def _field_header(b: bytes, chunk: dict) -> dict:
    """A mode 4 or 5 payload's field header and table, read by the format's definition."""
    h = chunk["at"] + (8 if chunk["mode"] == 5 else 256)
    symbol_words, nonzero, checksum = struct.unpack_from("<3I", b, h)
    prob_bits, reserved, table_bytes = b[h + 12], b[h + 13], struct.unpack_from("<H", b, h + 14)[0]
    freqs, used = read_table_v4(b, h + 16, h + 16 + table_bytes, None, prob_bits)
    prefix = 16 + (table_bytes + 3) // 4 * 4
    return {"symbol_words": symbol_words, "nonzero": nonzero, "checksum": checksum, "prob_bits": prob_bits,
            "reserved": reserved, "table_bytes": table_bytes, "used": used, "freqs": freqs,
            "field_words": chunk["words"] - prefix // 2 - symbol_words, "padding": b[h + 16 + table_bytes:h + prefix]}


CASES = [*_inputs_v5(),
         ("gradient_message", gradient_like(), None),
         ("gradient_small_chunks", gradient_like(16, seed=6), 8192),
         ("gradient_no_zeros", gradient_like(8, seed=7, zero_share=0.0, kept_bits=3), None),
         ("gradient_odd_tail", gradient_like(3, seed=8).reshape(-1)[:3 * H - 5], 16384),
         # every field of a 2^18-value chunk the same: the AVX-512 pair counts' folding and its
         # 16-bit counters at their fullest
         ("gradient_one_field_large_chunk", gradient_like(40, seed=9, zero_share=0.0, kept_bits=0), 1 << 18)]


@pytest.mark.parametrize("name,x,chunk_values", CASES, ids=[c[0] for c in CASES])
def test_version_6_round_trips_on_every_path_and_is_never_larger_than_5(name, x, chunk_values):
    """Every path writes the same version 6 bytes and decodes them to the input; the blob is at
    most version 5's size; without a mode 4 chunk it is version 5's blob but for the version byte
    and the metadata checksum."""
    paths = lossless.simd_paths()
    blobs = {p: lossless.encode(x, chunk_values=chunk_values, simd=p, version=6) for p in paths}
    assert len({bytes(b.numpy()) for b in blobs.values()}) == 1
    blob = blobs["portable"]
    assert int(blob[4]) == 6
    for path in paths:
        out = lossless.decode(blob, simd=path)
        assert out.shape == x.shape and torch.equal(bits(out), bits(x)), path
    for threads in (1, 2, 3):
        assert torch.equal(bits(lossless.decode(blob, threads=threads)), bits(x))
    v5 = lossless.encode(x, chunk_values=chunk_values, version=5)
    assert blob.numel() <= v5.numel(), (blob.numel(), v5.numel())
    coded = [e for e in _layout(blob)["entries"] if e["mode"] in (4, 5)]
    if name.startswith("gradient"):
        assert coded and blob.numel() < 0.9 * v5.numel(), (len(coded), blob.numel(), v5.numel())
    if not coded:
        a, b = bytearray(blob.numpy().tobytes()), bytearray(v5.numpy().tobytes())
        a[4], a[12:16] = 5, b[12:16]
        assert a == b


def test_mode_4_layout_reads_by_the_definition():
    """Each mode 4 chunk: its field header's counts add up to the entry's words, the reserved byte
    and the table's padding are zero, the table (11 or 12 bits) holds exactly the fields that occur
    (symbol f for f in [1, 64), 1024 for f = 0) and no other symbol, the nonzero count and the
    field checksum are the fields'; its symbols' words are mode 0's (the same chunk in version 5)."""
    x = gradient_like()
    blob = lossless.encode(x, version=6)
    v5 = lossless.encode(x, version=5)
    b, b5 = blob.numpy().tobytes(), v5.numpy().tobytes()
    values = bits(x).to(torch.int32) & 0xFFFF
    cv = struct.unpack_from("<I", b, 8)[0]
    chunks5 = _payloads(v5)
    coded = 0
    for c, chunk in enumerate(_payloads(blob)):
        if chunk["mode"] != 4:
            continue
        coded += 1
        f = _field_header(b, chunk)
        assert f["reserved"] == 0 and f["used"] == f["table_bytes"] and set(f["padding"]) <= {0}
        assert f["prob_bits"] in (11, 12) and sum(f["freqs"].values()) == 1 << f["prob_bits"]
        assert f["field_words"] >= 0
        v = values[c * cv:(c + 1) * cv]
        fields = (v[v != 0] & 0x3F).tolist()
        assert chunk["fields"] == len(fields)
        assert set(f["freqs"]) == {1024 if q == 0 else q for q in set(fields)}
        assert f["nonzero"] == sum(q != 0 for q in fields)
        assert f["checksum"] == sum((q << 6) * (2 * k + 1) for k, q in enumerate(fields)) & 0xFFFFFFFF
        c5 = chunks5[c]
        assert c5["mode"] == 0 and c5["words"] == f["symbol_words"]
        prefix = 256 + 16 + (f["table_bytes"] + 3) // 4 * 4
        assert b[chunk["at"]:chunk["at"] + 128] == b5[c5["at"]:c5["at"] + 128]  # the symbols' states
        assert (b[chunk["at"] + prefix:chunk["at"] + prefix + 2 * f["symbol_words"]]
                == b5[c5["at"] + 128:c5["at"] + 128 + 2 * f["symbol_words"]])
        assert chunk["size"] < c5["size"]
    assert coded >= 6


def _forge_field(blob: torch.Tensor, edit) -> torch.Tensor:
    b = bytearray(blob.numpy().tobytes())
    chunk = next(c for c in _payloads(blob) if c["mode"] == 4)
    edit(b, chunk, _field_header(bytes(b), chunk))
    return torch.frombuffer(b, dtype=torch.uint8)


def _set(offset: int, fmt: str, value_of):
    def edit(b, chunk, f):
        struct.pack_into(fmt, b, chunk["at"] + 256 + offset, value_of(f))
    return edit


FIELD_FORGERIES = [
    ("symbol_words_more", _set(0, "<I", lambda f: f["symbol_words"] + 1), "stream"),
    ("symbol_words_past_all", _set(0, "<I", lambda f: 1 << 30), "stream"),
    ("nonzero_more", _set(4, "<I", lambda f: f["nonzero"] + 1), "stream"),
    ("checksum", _set(8, "<I", lambda f: f["checksum"] ^ 1), "checksum"),
    ("prob_bits_10", _set(12, "<B", lambda f: 10), "stream"),
    ("prob_bits_other", _set(12, "<B", lambda f: 23 - f["prob_bits"]), "table"),
    ("reserved", _set(13, "<B", lambda f: 1), "stream"),
    ("table_bytes_zero", _set(14, "<H", lambda f: 0), "stream"),
    # the table's last byte then reads as padding, or, in the same word, as the table's end
    ("table_bytes_less", _set(14, "<H", lambda f: f["table_bytes"] - 1), "padding|table"),
    ("table_bytes_large", _set(14, "<H", lambda f: 513), "stream"),
    ("field_symbol_64", 64, "table"),
    ("field_symbol_0", 0, "table"),  # field 0 is the +0.0 symbol's, never symbol 0
]


def _field_symbol_moved(b, chunk, f, target):
    """The table re-coded with one field's frequency moved to symbol `target` (not a field symbol:
    64, or 0, whose field is the +0.0 symbol's)."""
    freqs = dict(f["freqs"])
    moved = max(s for s in freqs if 0 < s < 64 and s != target)
    freqs[target] = freqs.pop(moved)
    stream, bits_used = 0, 0

    def put(v, k):
        nonlocal stream, bits_used
        q = (v >> k) + 1
        m = q.bit_length() - 1
        code = (q - (1 << m)) << (m + 1) | 1 << m  # m zeros, a one, r in m bits
        stream |= code << bits_used
        bits_used += 2 * m + 1
        stream |= (v & ((1 << k) - 1)) << bits_used
        bits_used += k

    previous = -1
    for s in sorted(freqs):
        put(s - previous - 1, 10)
        put(freqs[s] - 1, 11)
        previous = s
    table = bytes([10 | 11 << 4]) + stream.to_bytes((bits_used + 7) // 8, "little")
    h = chunk["at"] + 256
    prefix_old = 16 + (f["table_bytes"] + 3) // 4 * 4
    prefix_new = 16 + (len(table) + 3) // 4 * 4
    body = bytes(b[h + prefix_old:h + chunk["size"] - 256])
    struct.pack_into("<H", b, h + 14, len(table))
    new = bytes(b[h:h + 16]) + table + bytes(prefix_new - 16 - len(table)) + body
    old_end = h + ((chunk["size"] - 256) + 3) // 4 * 4
    new_size = 256 + len(new)
    b[h:old_end] = new + bytes((new_size + 3) // 4 * 4 - new_size)
    entry = chunk["directory_at"]
    struct.pack_into("<I", b, entry + 4, chunk["words"] + (prefix_new - prefix_old) // 2)


@pytest.mark.parametrize("forgery,edit,message", FIELD_FORGERIES, ids=[f[0] for f in FIELD_FORGERIES])
def test_forged_field_headers_are_rejected(forgery, edit, message):
    """A mode 4 chunk's field header or table forged: the named error, the same on every path."""
    blob = lossless.encode(gradient_like(8), version=6)
    if forgery.startswith("field_symbol"):
        layout = _layout(blob)
        b = bytearray(blob.numpy().tobytes())
        index, chunk = next((i, c) for i, c in enumerate(_payloads(blob)) if c["mode"] == 4)
        chunk["directory_at"] = layout["directory"] + 16 * index
        _field_symbol_moved(b, chunk, _field_header(bytes(b), chunk), edit)
        bad = torch.frombuffer(b, dtype=torch.uint8)
    else:
        bad = _forge_field(blob, edit)
    assert re.search(message, _same_error_everywhere(bad))


def test_forged_mode_4_entries_are_rejected():
    """Mode 4 in a version 5 blob, with no fields, or with fewer words than its field header: a
    corrupted directory on every path."""
    blob = lossless.encode(gradient_like(8), version=6)
    layout = _layout(blob)
    index = next(i for i, e in enumerate(layout["entries"]) if e["mode"] == 4)
    at = layout["directory"] + 16 * index
    as_5 = bytearray(blob.numpy().tobytes())
    as_5[4] = 5
    assert "directory" in _same_error_everywhere(_reseal(as_5))
    for field, value in ((8, 0), (4, 7)):
        b = bytearray(blob.numpy().tobytes())
        struct.pack_into("<I", b, at + field, value)
        assert "directory" in _same_error_everywhere(torch.frombuffer(b, dtype=torch.uint8))


def test_every_field_header_byte_and_sampled_payload_bytes_corrupted_are_rejected():
    """Every byte of the first mode 4 chunk's states, field header and table, and every 11th byte
    of its words, flipped: a ValueError, the same on every path (never a wrong tensor, a crash or a
    hang)."""
    blob = lossless.encode(gradient_like(1, seed=9, zero_share=0.0), chunk_values=4096, version=6)
    chunk = next(c for c in _payloads(blob) if c["mode"] == 4)
    f = _field_header(blob.numpy().tobytes(), chunk)
    prefix_end = chunk["at"] + 256 + 16 + (f["table_bytes"] + 3) // 4 * 4
    for pos in [*range(chunk["at"], prefix_end), *range(prefix_end, chunk["at"] + chunk["size"], 11)]:
        bad = blob.clone()
        bad[pos] ^= 0x5A
        _same_error_everywhere(bad)


def test_small_and_six_bit_fields_keep_mode_0():
    """Fields that carry about 6 bits (random activations) and chunks of fewer than 1,024 fields
    stay mode 0."""
    g = torch.Generator().manual_seed(3)
    for x, cv in ((torch.randn(64, H, generator=g).bfloat16(), None), (gradient_like(1), 1024)):
        blob = lossless.encode(x, chunk_values=cv, version=6)
        assert all(e["mode"] != 4 for e in _layout(blob)["entries"])


def test_version_6_metadata_counts_the_chunks_with_coded_fields():
    """The metadata checks before the CUDA decoder read version 6 and count its chunks with coded
    fields, which size the decoder's workspace."""
    x = gradient_like(8)
    blob = lossless.encode(x, version=6)
    assert int(blob[4]) == 6
    metadata = _host.lossless_metadata_bytes(blob[:_host.LOSSLESS_HEADER_PREFIX_BYTES].numpy(), blob.numel())
    shape, cv, field_chunks, version = _host.lossless_parse_metadata(blob[:metadata].numpy(), blob.numel())
    assert (tuple(shape), cv, version) == (tuple(x.shape), 65536, 6)
    assert field_chunks == sum(e["mode"] in (4, 5) for e in _layout(blob)["entries"]) > 0
    assert lossless_device.layouts([blob])[0].field_chunks == field_chunks
    with pytest.raises(ValueError, match="version must be one of"):
        lossless.encode(x, version=8)


def test_same_bytes_on_any_thread_count():
    x = gradient_like(16, seed=11)
    blobs = {t: bytes(lossless.encode(x, threads=t, version=6).numpy()) for t in (1, 2, 3, 8)}
    assert len(set(blobs.values())) == 1


def test_inputs_of_version_4_tests_round_trip_in_version_6():
    for name, x, cv in _inputs():
        blob = lossless.encode(x, chunk_values=cv, version=6)
        assert torch.equal(bits(lossless.decode(blob)), bits(x)), name


def test_one_state_chunks_code_their_fields_as_mode_5():
    """A blob's only chunk coded with one state (up to a quarter of chunk_values) whose fields carry
    little information takes mode 5: smaller than version 5's mode 2, the same bytes on every path,
    its field header read by the definition (field table of 6 to 12 bits); a 96-value gradient
    of 13 distinct fields included (the tensor of MTCNN's where version 5 was a byte above zipnn)."""
    g = torch.Generator().manual_seed(21)
    cases = [gradient_like(1, seed=s).reshape(-1)[:n] for s, n in ((1, 96), (2, 1000), (3, 4096), (4, 16384))]
    small = torch.ldexp(torch.round(torch.frexp(torch.randn(96, generator=g))[0] * 4) / 4,
                        torch.randint(-8, -4, (96,), generator=g)).bfloat16()
    for x in [*cases, small]:
        blobs = {p: lossless.encode(x, simd=p, version=6) for p in lossless.simd_paths()}
        assert len({bytes(b.numpy()) for b in blobs.values()}) == 1
        blob = blobs["portable"]
        chunks = _payloads(blob)
        assert len(chunks) == 1 and chunks[0]["mode"] == 5, [c["mode"] for c in chunks]
        f = _field_header(blob.numpy().tobytes(), chunks[0])
        assert 6 <= f["prob_bits"] <= 12 and sum(f["freqs"].values()) == 1 << f["prob_bits"]
        assert f["reserved"] == 0 and f["used"] == f["table_bytes"] and f["field_words"] >= 0
        assert blob.numel() < lossless.encode(x, version=5).numel()
        for path in lossless.simd_paths():
            assert torch.equal(bits(lossless.decode(blob, simd=path)), bits(x)), path


def test_forged_mode_5_entries_are_rejected():
    """Mode 5 in a blob of two chunks, with a table index, in a version 5 blob, or on more values
    than a one-state chunk may hold: a corrupted directory on every path; its field header's bytes
    flipped: an error on every path."""
    x = gradient_like(1, seed=4).reshape(-1)[:2000]
    blob = lossless.encode(x, version=6)
    layout = _layout(blob)
    assert layout["entries"][0]["mode"] == 5
    at = layout["directory"]
    b = bytearray(blob.numpy().tobytes())
    struct.pack_into("<I", b, at, 5 | 1 << 8)
    assert "directory" in _same_error_everywhere(torch.frombuffer(b, dtype=torch.uint8))
    as_5 = bytearray(blob.numpy().tobytes())
    as_5[4] = 5
    assert "directory" in _same_error_everywhere(_reseal(as_5))
    # two chunks: the same values with a chunk size below their count, the first chunk forged to mode 5
    two = lossless.encode(x, chunk_values=1024, version=6)
    lay2 = _layout(two)
    b2 = bytearray(two.numpy().tobytes())
    struct.pack_into("<I", b2, lay2["directory"], 5)
    assert "directory" in _same_error_everywhere(torch.frombuffer(b2, dtype=torch.uint8))
    chunk = _payloads(blob)[0]
    for pos in range(chunk["at"], chunk["at"] + 8 + 16 + 8):
        bad = blob.clone()
        bad[pos] ^= 0x5A
        _same_error_everywhere(bad)
