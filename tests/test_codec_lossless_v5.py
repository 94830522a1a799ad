"""Lossless format version 5 (csrc/codec/lossless_core.h): version 4 where a 32-state chunk may carry
a frequency table of its own (the header's T, the extra tables after the shared one, the table index
in bits 8-15 of a directory entry's mode word). Every host path writes the same bytes and reads
them back exactly; messages joining values of different statistics take extra tables and shrink;
no tensor's blob is larger than version 4's; the tables read back by the format's definition (a
Python reader, independent of the C++ one); corrupted and forged blobs are rejected with the same
error on every path; the CUDA decoder's metadata checks read the format."""
from __future__ import annotations

import struct

import pytest
import torch
from support.codec_kernel_cases import blob_layout, mixed_rows, read_table_v4
from test_codec_lossless_v4 import _inputs, _same_error_everywhere, bits

from ep_comm import _host
from ep_comm.codecs import lossless, lossless_device

H = 7168


def _mixed_message(seed: int = 3, rows: int = 64) -> torch.Tensor:
    """A [rows, 7168] message whose groups of 8 rows have very different statistics
    (support/codec_kernel_cases.mixed_rows)."""
    return mixed_rows(rows, H, seed, group=8)


def _layout(blob: torch.Tensor) -> dict:
    """A version 5 blob read by the format's definition: header fields, the shared table's and each
    extra table's frequencies and prob_bits, the directory (mode, table, words, fields, checksum)."""
    b, layout = blob.numpy().tobytes(), blob_layout(blob)
    assert b[:4] == b"EPLB" and layout["version"] in (5, 6, 7)
    entries, prob_bits, extra_count = layout["entries"], layout["prob_bits"], b[17]
    table_at, table_bytes = layout["table_at"], layout["table_bytes"]
    end = table_at + table_bytes
    shared, used = read_table_v4(b, table_at, end, entries, prob_bits) if entries else ({}, 0)
    extra, at = [], table_at + used
    for _ in range(extra_count):
        pb, length = b[at], b[at + 1]
        at += 2
        if length & 0x80:
            length = (length & 0x7F) | b[at] << 7
            at += 1
        freqs, used = read_table_v4(b, at, at + length, None, pb)
        assert used == length and pb in (11, 12) and sum(freqs.values()) == 1 << pb
        extra.append({"prob_bits": pb, "freqs": freqs, "at": at - 1 - (1 if length < 128 else 2), "bytes": length})
        at += length
    assert at == end, (at, end)
    directory, chunks = layout["directory"], layout["chunks"]
    entries_out = []
    for c in range(chunks):
        mode, words, fields, checksum = struct.unpack_from("<4I", b, directory + 16 * c)
        entries_out.append({"mode": mode & 0xFF, "table": mode >> 8, "words": words, "fields": fields})
    return {"prob_bits": prob_bits, "shared": shared, "extra": extra, "table_at": table_at,
            "table_bytes": table_bytes, "directory": directory, "entries": entries_out, "chunks": chunks}


def _reseal(blob: bytearray) -> torch.Tensor:
    """The blob with its metadata checksum (at 12, over every byte before the directory) recomputed."""
    b = bytes(blob)
    end = (_table_end(b) + 3) // 4 * 4
    checksum = sum(b[i] * (2 * i + 1) for i in range(end) if not 12 <= i < 16) & 0xFFFFFFFF
    struct.pack_into("<I", blob, 12, checksum)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def _table_end(b: bytes) -> int:
    at = 20
    for _ in range(b[5]):
        while b[at] & 0x80:
            at += 1
        at += 1
    return at + struct.unpack_from("<H", b, 18)[0]


def _inputs_v5() -> list[tuple[str, torch.Tensor, int | None]]:
    g = torch.Generator().manual_seed(12)
    odd_tail = torch.cat([torch.randn(5 * 4096, generator=g) * 1e-4, torch.randn(4100, generator=g) * 50])
    return [*_inputs(),
            ("mixed_message", _mixed_message(), None),
            ("mixed_small_chunks", _mixed_message(4, 16), 8192),
            ("mixed_odd_tail", odd_tail.bfloat16(), 4096)]


@pytest.mark.parametrize("name,x,chunk_values", _inputs_v5(), ids=[c[0] for c in _inputs_v5()])
def test_version_5_round_trips_on_every_path_and_is_never_larger_than_4(name, x, chunk_values):
    """Every path writes the same version 5 bytes and decodes them to the input; the blob is at
    most version 4's size; its tables read back by the format's definition, every extra table used
    by exactly one mode 0 chunk; without an extra table, an all-+0.0 chunk or a one-state chunk
    above version 4's limit it is version 4's blob but for the version byte and the checksum."""
    paths = lossless.simd_paths()
    blobs = {p: lossless.encode(x, chunk_values=chunk_values, simd=p, version=5) for p in paths}
    assert len({bytes(b.numpy()) for b in blobs.values()}) == 1
    blob = blobs["portable"]
    for path in paths:
        out = lossless.decode(blob, simd=path)
        assert out.shape == x.shape and torch.equal(bits(out), bits(x)), path
    v4 = lossless.encode(x, chunk_values=chunk_values, version=4)
    assert blob.numel() <= v4.numel(), (blob.numel(), v4.numel())
    layout = _layout(blob)
    used = [e["table"] for e in layout["entries"] if e["table"]]
    assert sorted(used) == list(range(1, len(layout["extra"]) + 1))
    assert all(e["mode"] == 0 for e in layout["entries"] if e["table"])
    if layout["shared"]:
        assert sum(layout["shared"].values()) == 1 << layout["prob_bits"]
    zero_chunks = any(e["mode"] == 3 for e in layout["entries"])
    # a blob's only chunk of 4,097 to 16,384 values takes one state in version 5 only
    one_state_5 = layout["entries"] and layout["entries"][0]["mode"] == 2 and x.numel() > 4096
    if not layout["extra"] and not zero_chunks and not one_state_5:
        a, b = bytearray(blob.numpy().tobytes()), bytearray(v4.numpy().tobytes())
        a[4], a[12:16] = 4, b[12:16]
        assert a == b


def test_mixed_message_takes_extra_tables_and_shrinks():
    """A 64x7168 message of rows of very different statistics: most of its 8 chunks take a table
    of their own, one keeps the shared table, and the blob is several percent smaller than version
    4's; encode_rows takes the version too."""
    x = _mixed_message()
    blob = lossless.encode_rows(x, version=5)
    v4 = lossless.encode(x, version=4)
    layout = _layout(blob)
    assert len(layout["entries"]) == 8 and len(layout["extra"]) >= 4, layout["entries"]
    assert any(e["table"] == 0 and e["mode"] == 0 for e in layout["entries"])
    assert blob.numel() < 0.95 * v4.numel(), (blob.numel(), v4.numel())
    assert torch.equal(bits(lossless.decode(blob, expected_shape=(64, H))), bits(x))
    with pytest.raises(ValueError, match=r"expected \(64, 7167\)"):
        lossless.decode(blob, expected_shape=(64, 7167))
    out = torch.empty(64, H, dtype=torch.bfloat16)
    assert torch.equal(bits(lossless.decode_into(blob, out)), bits(x))


def _many_tensors():
    """Tensors of varied statistics and layouts: activations, ReLU outputs, sparse gradients,
    weights with per-row scales, halves of +0.0, messages of mixed rows, short chunks."""
    g = torch.Generator().manual_seed(77)
    for i in range(48):
        rows = [64, 16, 40, 3][i % 4]
        width = [7168, 4096, 2048, 1024][(i // 4) % 4]
        scale = torch.exp(torch.randn(rows, 1, generator=g) * [0.05, 1.0, 4.0][i % 3])
        x = torch.randn(rows, width, generator=g) * scale
        if i % 5 == 1:
            x = torch.relu(x)
        elif i % 5 == 2:
            x[torch.rand(rows, width, generator=g) < 0.6] = 0
        elif i % 5 == 3:
            x[: rows // 2] = 0
        yield x.bfloat16(), [None, 4096, 8192][i % 3]


def test_never_larger_than_version_4_over_many_tensors():
    """Over 48 tensors of varied statistics and chunk sizes no version 5 blob is larger than version
    4's: a chunk takes its own table only when its estimate saves more than 16 bytes, and the shared
    table then fits the chunks that keep it. Some do take extra tables (the test is not vacuous)."""
    took = 0
    for x, cv in _many_tensors():
        b5 = lossless.encode(x, chunk_values=cv, version=5)
        b4 = lossless.encode(x, chunk_values=cv, version=4)
        assert b5.numel() <= b4.numel(), (tuple(x.shape), cv, b5.numel(), b4.numel())
        took += int(b5[17]) > 0
        assert torch.equal(bits(lossless.decode(b5)), bits(x))
    assert took >= 5, took


def _forge(blob: torch.Tensor, edit) -> torch.Tensor:
    b = bytearray(blob.numpy().tobytes())
    edit(b, _layout(blob))
    return _reseal(b)


def _set_entry_mode(c: int, word: int):
    def edit(b: bytearray, layout: dict) -> None:
        struct.pack_into("<I", b, layout["directory"] + 16 * c, word)
    return edit


@pytest.fixture(scope="module")
def mixed_blob() -> torch.Tensor:
    blob = lossless.encode(_mixed_message(), version=5)
    assert len(_layout(blob)["extra"]) >= 2
    return blob


def _first(layout: dict, table: bool) -> int:
    return next(c for c, e in enumerate(layout["entries"]) if (e["table"] != 0) == table and e["mode"] == 0)


# forgeries of a version 5 blob with a valid metadata checksum, and the error each gets (forge)
FORGERIES = [
    ("table_above_T", "directory"),
    ("high_bits", "directory"),
    ("raw_with_table", "directory"),
    ("unused_table", "frequency table"),
    ("T_above_chunks", "frequency table"),
    ("T_one_more", "frequency table"),
    ("T_one_less", "frequency table"),
    ("prob_bits_10", "frequency table"),
    ("length_zero", "frequency table"),
    ("length_past_section", "frequency table"),
    ("length_long_form", "frequency table"),
    ("table_byte_dropped", "frequency table"),
    ("table_sum_short", "frequency table"),
    ("table_bit_after_end", "frequency table"),
]


def forge(blob: torch.Tensor, forgery: str) -> torch.Tensor:
    """``blob`` (version 5, with extra tables and a mode 0 chunk of its own table) with the forgery
    of FORGERIES named ``forgery``, its metadata checksum recomputed (tests/test_codec_kernels_emulated.py
    decodes them on the kernels too)."""
    layout = _layout(blob)
    extra = layout["extra"]
    t = _first(layout, True)
    word = 0 | layout["entries"][t]["table"] << 8

    def edit(b: bytearray, lay: dict) -> None:
        if forgery == "table_above_T":
            _set_entry_mode(t, (len(extra) + 1) << 8)(b, lay)
        elif forgery == "high_bits":
            _set_entry_mode(t, word | 1 << 16)(b, lay)
        elif forgery == "raw_with_table":
            _set_entry_mode(t, 1 | word)(b, lay)
        elif forgery == "unused_table":
            _set_entry_mode(t, 0)(b, lay)
        elif forgery == "T_above_chunks":
            b[17] = lay["chunks"] + 1
        elif forgery == "T_one_more":
            b[17] += 1
        elif forgery == "T_one_less":
            b[17] -= 1
        elif forgery == "prob_bits_10":
            b[extra[0]["at"]] = 10
        elif forgery == "length_zero":
            b[extra[0]["at"] + 1] = 0
        elif forgery == "length_past_section":
            b[extra[-1]["at"] + 1] = 0x7F
        elif forgery == "length_long_form":  # L as two bytes (0x80 | L, 0): the section then ends one byte late
            b[extra[0]["at"] + 1] |= 0x80
            b.insert(extra[0]["at"] + 2, 0)
            struct.pack_into("<H", b, 18, lay["table_bytes"] + 1)
        elif forgery == "table_byte_dropped":  # the length and the section one byte shorter
            del b[extra[0]["at"] + 2 + extra[0]["bytes"] - 1]
            b[extra[0]["at"] + 1] -= 1
            struct.pack_into("<H", b, 18, lay["table_bytes"] - 1)
        elif forgery == "table_sum_short":  # prob_bits 12 where the table sums to 2^11, or 11 where 2^12
            b[extra[0]["at"]] = 23 - extra[0]["prob_bits"]
        elif forgery == "table_bit_after_end":
            b[extra[0]["at"] + 2 + extra[0]["bytes"] - 1] |= 0x80
        # the section's size may have changed: the directory stays 4-byte aligned
        end = _table_end(bytes(b))
        old_dir = lay["directory"] + (len(b) - len(blob.numpy().tobytes()))
        pad = (end + 3) // 4 * 4 - end
        rest = b[old_dir:]
        del b[end:]
        b.extend(bytes(pad) + rest)

    return _forge(blob, edit)


@pytest.mark.parametrize("forgery,message", FORGERIES)
def test_forged_tables_and_entries_are_rejected(mixed_blob, forgery, message):
    """Forgeries with a valid metadata checksum: a table index above T, bits 16-31 set in the mode
    word, an extra table on a raw chunk, an extra table no chunk uses, T above the chunk count or
    not matching the section, an extra table's prob_bits out of {11, 12}, a length of 0, past the
    section or in a longer LEB128 form than its shortest, a table cut by a byte, a table whose
    frequencies stop short of 2^prob_bits, a set bit after a table's last entry: the same error on
    every path."""
    error = _same_error_everywhere(forge(mixed_blob, forgery))
    assert message in error, error


def test_metadata_checksum_covers_the_extra_tables(mixed_blob):
    """A changed byte of an extra table without a new metadata checksum: a corrupted header."""
    bad = mixed_blob.clone()
    at = _layout(mixed_blob)["extra"][-1]["at"] + 3
    bad[at] ^= 0x10
    assert "corrupted header" in _same_error_everywhere(bad)


def _metadata_case() -> torch.Tensor:
    """Three 4,096-value chunks of different statistics (one with a run of +0.0): a small blob
    with extra tables (also corrupted byte by byte on the kernels, tests/test_codec_kernels_emulated.py)."""
    g = torch.Generator().manual_seed(21)
    x = torch.cat([torch.randn(4096, generator=g) * 1e-4, torch.relu(torch.randn(4096, generator=g)) * 30,
                   torch.randn(4096, generator=g)]).bfloat16()
    x[4096:4200] = 0
    return x


def test_every_metadata_byte_and_sampled_payload_bytes_corrupted_are_rejected():
    """Every byte of the header, tables and directory of a small blob with extra tables, and every
    13th payload byte, flipped: a ValueError, the same on every path (never a wrong tensor, a crash
    or a hang)."""
    blob = lossless.encode(_metadata_case(), chunk_values=4096, version=5)
    layout = _layout(blob)
    assert len(layout["extra"]) >= 1
    data = layout["directory"] + 16 * layout["chunks"]
    for pos in [*range(data), *range(data, blob.numel(), 13)]:
        bad = blob.clone()
        bad[pos] ^= 0x5A
        _same_error_everywhere(bad)
    for cut in (1, 5, data - 1, data, blob.numel() - 1):
        _same_error_everywhere(blob[:cut].clone())


def test_cuda_decoder_metadata_reads_version_5(mixed_blob):
    """The metadata checks that precede the CUDA decoder's kernels (the host functions
    lossless_device.header calls) read a version 5 blob as decode does: its shape, chunk size and
    metadata bytes, and decode's error for a forged one."""
    layout = _layout(mixed_blob)
    prefix = mixed_blob[:_host.LOSSLESS_HEADER_PREFIX_BYTES].numpy()
    assert _host.lossless_metadata_bytes(prefix, mixed_blob.numel()) == layout["directory"] + 16 * layout["chunks"]
    cv = struct.unpack_from("<I", mixed_blob.numpy().tobytes(), 8)[0]
    assert lossless_device.header(mixed_blob) == ((64, H), cv)
    with pytest.raises(ValueError, match="frequency table"):
        lossless_device.header(forge(mixed_blob, "unused_table"))


def test_an_extra_table_shared_by_many_chunks_decodes_on_every_path_and_thread_count():
    """The format lets any mode 0 chunk take any extra table; the encoder gives each its own, the
    decoders build an extra table where a chunk first needs it. A blob of 16 chunks of two kinds
    in turn (each chunk but the first takes a table of its own, equal to those of its kind)
    rewritten so that the chunks of a kind take one table (the others dropped, the metadata
    checksum recomputed) decodes exactly on every path with 1 to 8 threads, workers meeting on a
    table."""
    g = torch.Generator().manual_seed(5)
    kinds = [torch.randn(4096, generator=g) * 1e-4, torch.relu(torch.randn(4096, generator=g)) * 30]
    x = torch.cat([kinds[c % 2] for c in range(16)]).bfloat16()
    blob = lossless.encode(x, chunk_values=4096, version=5)
    layout = _layout(blob)
    entries, extra = layout["entries"], layout["extra"]
    assert [e["table"] for e in entries] == list(range(16)), entries
    key = [(t["prob_bits"], tuple(sorted(t["freqs"].items()))) for t in extra]
    kept = [k for k in range(len(extra)) if key.index(key[k]) == k]  # each kind's first table
    assert len(kept) == 2
    b = bytearray(blob.numpy().tobytes())
    directory = b[layout["directory"]:]
    for c, e in enumerate(entries):
        table = kept.index(key.index(key[e["table"] - 1])) + 1 if e["table"] else 0
        struct.pack_into("<I", directory, 16 * c, e["mode"] | table << 8)
    section = b[layout["table_at"]:extra[0]["at"]]
    for k in kept:
        size = 2 + (extra[k]["bytes"] >= 128) + extra[k]["bytes"]
        section += b[extra[k]["at"]:extra[k]["at"] + size]
    del b[layout["table_at"]:]
    b[17] = len(kept)
    struct.pack_into("<H", b, 18, len(section))
    b += section + bytes(-(layout["table_at"] + len(section)) % 4) + directory
    shared = _reseal(b)
    assert [e["table"] for e in _layout(shared)["entries"]] == [0] + [2 - c % 2 for c in range(1, 16)]
    for path in lossless.simd_paths():
        for threads in (1, 2, 3, 8):
            out = lossless.decode(shared, simd=path, threads=threads)
            assert torch.equal(bits(out), bits(x)), (path, threads)


def test_version_5_is_accepted_and_others_rejected_by_encode():
    x = torch.randn(100).bfloat16()
    assert int(lossless.encode(x, version=5)[4]) == 5
    for version in (1, 8):
        with pytest.raises(ValueError, match="version must be one of"):
            lossless.encode(x, version=version)
    assert lossless.FORMAT_VERSION == 7 and int(lossless.encode(x)[4]) == 7


def test_same_bytes_on_any_thread_count():
    """The per-piece symbol counts that pick the chunks' tables add up alike whatever the threads
    (a 64x7168 message is cut in more pieces for more threads)."""
    x = _mixed_message(8)
    blobs = {t: bytes(lossless.encode(x, threads=t, version=5).numpy()) for t in (1, 2, 3, 8)}
    assert len(set(blobs.values())) == 1
    assert blobs[1][17] >= 4


def test_at_most_255_extra_tables():
    """320 chunks that each gain from a table of their own: 255 take one (the directory's table
    index is 8 bits), the others keep the shared table; the blob still decodes exactly and is
    smaller than version 4's."""
    g = torch.Generator().manual_seed(31)
    scales = torch.tensor([10.0 ** (k % 16 - 8) for k in range(320)]).repeat_interleave(4096)
    x = (torch.randn(320 * 4096, generator=g) * scales).bfloat16()
    blob = lossless.encode(x, chunk_values=4096, version=5)
    layout = _layout(blob)
    assert len(layout["extra"]) == 255
    assert sum(1 for e in layout["entries"] if e["table"] == 0) == 65
    assert blob.numel() < lossless.encode(x, chunk_values=4096, version=4).numel()
    for path in lossless.simd_paths():
        assert torch.equal(bits(lossless.decode(blob, simd=path)), bits(x)), path


@pytest.mark.parametrize("shape", [(64, H), (5, 1000, 33), (2**24 + 96,)])
def test_all_zero_blob_is_the_fewest_chunks(shape):
    """A version 5 blob of +0.0 only takes the largest chunk size its values allow (one chunk per
    2^24 values): header, shape and one 16-byte directory entry per chunk; every path decodes it.
    -0.0 is not +0.0: such a tensor keeps its chunks."""
    x = torch.zeros(shape, dtype=torch.bfloat16)
    blob = lossless.encode(x, version=5)
    layout = _layout(blob)
    n = x.numel()
    chunks = -(-n // 2**24)
    assert struct.unpack_from("<I", blob.numpy().tobytes(), 8)[0] == min(-(-n // 32) * 32, 2**24)
    assert layout["chunks"] == chunks and [e["mode"] for e in layout["entries"]] == [3] * chunks
    assert layout["table_bytes"] == 0 and blob.numel() == layout["directory"] + 16 * chunks
    v4 = lossless.encode(x, version=4)
    assert _chunks_of(v4) > chunks and blob.numel() < v4.numel()
    default = lossless.encode(x)  # version 7: the same chunks, its version in the header
    assert int(default[4]) == 7 and default.numel() == blob.numel() and _layout(default)["entries"] == layout["entries"]
    for simd in lossless.simd_paths():
        y = lossless.decode(blob, simd=simd, expected_shape=shape)
        assert torch.equal(y.view(torch.int16), x.view(torch.int16))
    negative = x.clone()
    negative.view(-1)[n // 2] = -0.0
    assert _layout(lossless.encode(negative, version=5))["chunks"] == _chunks_of(lossless.encode(negative, version=4))


def _chunks_of(blob: torch.Tensor) -> int:
    """Chunks of a version 4 or 5 blob: its values over its chunk_values."""
    b = blob.numpy().tobytes()
    n = 1
    for d in lossless.shape_of(blob):
        n *= d
    return -(-n // struct.unpack_from("<I", b, 8)[0])


# (values, chunk_values, the mode of the blob's only chunk): version 5 codes it with one state up
# to a quarter of chunk_values, clamped to [4096, 16384] values
ONE_STATE_CASES = [(4097, 65536, 2), (12288, 65536, 2), (16384, 65536, 2), (16385, 65536, 0),
                   (16385, 1 << 17, 0), (8192, 32768, 2), (8193, 32768, 0), (4096, 8192, 2), (4097, 8192, 0)]


@pytest.mark.parametrize("n,cv,mode", ONE_STATE_CASES)
def test_one_chunk_blob_takes_one_state_up_to_the_version_5_limit(n, cv, mode):
    """A blob of one chunk takes one state (mode 2) up to one_state_max_values(5, chunk_values);
    every path writes the same bytes and decodes them; where version 4 needs 32 states, the one
    state saves at least 64 of their 128 bytes."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 0.02).bfloat16()
    blobs = {p: lossless.encode(x, chunk_values=cv, simd=p, version=5) for p in lossless.simd_paths()}
    assert len({bytes(b.numpy()) for b in blobs.values()}) == 1
    blob = blobs["portable"]
    assert _layout(blob)["entries"][0]["mode"] == mode
    for path in lossless.simd_paths():
        assert torch.equal(bits(lossless.decode(blob, simd=path)), bits(x)), path
    v4 = lossless.encode(x, chunk_values=cv, version=4)
    assert blob.numel() <= (v4.numel() - 64 if mode == 2 and n > 4096 else v4.numel()), (blob.numel(), v4.numel())


def one_state_blob(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [n] bf16, its version 5 blob at the default chunk size, whose only chunk has one state)."""
    x = (torch.randn(n, generator=torch.Generator().manual_seed(5)) * 0.02).bfloat16()
    blob = lossless.encode(x, version=5)
    assert _layout(blob)["entries"][0]["mode"] == 2
    return x, blob


def with_chunk_values(blob: torch.Tensor, chunk_values: int) -> torch.Tensor:
    """``blob`` claiming ``chunk_values`` in its header, its metadata checksum recomputed."""
    bad = bytearray(blob.numpy().tobytes())
    struct.pack_into("<I", bad, 8, chunk_values)
    return _reseal(bad)


def test_one_state_chunk_above_the_limit_of_its_chunk_values_is_rejected():
    """A version 5 one-state chunk of 5,000 values is valid at chunk_values 65536 and a corrupted
    directory at 8192 (limit 4096) on every path; at 32768 (limit 8192) it still decodes."""
    x, blob = one_state_blob(5000)
    assert "directory" in _same_error_everywhere(with_chunk_values(blob, 8192))
    for path in lossless.simd_paths():
        assert torch.equal(bits(lossless.decode(with_chunk_values(blob, 32768), simd=path)), bits(x)), path
