"""ep_comm.codecs.lossless: bit-exact round trips, compression of structured data, and a decoder
that rejects every truncated or corrupted blob with ValueError."""
from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.codec_kernel_cases import blob_layout

from ep_comm.codecs import lossless, lossless_device


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def from_bits(values, shape=None) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return t.reshape(shape) if shape is not None else t


def assert_round_trip(x: torch.Tensor, **kwargs) -> torch.Tensor:
    before = bits(x).clone()
    blob = lossless.encode(x, **kwargs)
    assert blob.dtype == torch.uint8 and blob.dim() == 1
    y = lossless.decode(blob)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(bits(y), bits(x))
    assert torch.equal(bits(x), before), "encode modified its input"
    # every host path (the portable core is what the GPU kernels run) writes the same bytes and
    # reads them back
    for path in lossless.simd_paths():
        assert torch.equal(lossless.encode(x, simd=path, **kwargs), blob), path
        assert torch.equal(bits(lossless.decode(blob, simd=path)), bits(x)), path
    return blob


ALL_PATTERNS = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("chunk_values", [32, 96, 4096, lossless.DEFAULT_CHUNK_VALUES])
def test_all_65536_patterns(chunk_values):
    assert_round_trip(ALL_PATTERNS, chunk_values=chunk_values)
    assert_round_trip(ALL_PATTERNS.reshape(256, 256), chunk_values=chunk_values)
    shuffled = ALL_PATTERNS[torch.randperm(65536, generator=torch.Generator().manual_seed(1))]
    assert_round_trip(shuffled, chunk_values=chunk_values)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(0, 65535), max_size=700),
       chunk_values=st.sampled_from([32, 64, 160, 65536]))
def test_hypothesis_bit_patterns(values, chunk_values):
    assert_round_trip(from_bits(values), chunk_values=chunk_values)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 9), cols=st.integers(0, 37), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e30]))
def test_hypothesis_shapes(rows, cols, seed, scale):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * scale).bfloat16()
    assert_round_trip(x, chunk_values=64)
    assert_round_trip(x.reshape(rows, cols, 1))


@pytest.mark.parametrize("shape", [(0,), (0, 7168), (3, 0, 5), (1,), (), (1, 1), (31,), (33,), (7, 13)])
def test_small_and_empty_shapes(shape):
    x = torch.randn(shape).bfloat16() if all(shape) else torch.empty(shape, dtype=torch.bfloat16)
    assert_round_trip(x)


def test_special_values():
    specials = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0xFFFF, 0xFF81,
                0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80]
    x = from_bits(specials * 50)
    assert_round_trip(x)
    assert_round_trip(x, chunk_values=32)


def test_all_equal_exponents_and_constants():
    for v in (0x3F80, 0xBF80, 0x0000, 0x8000, 0x7FC0, 0x0001):
        assert_round_trip(from_bits([v] * 5000))
    # one exponent, every mantissa: the table has a single symbol
    assert_round_trip(from_bits([0x3F00 | m for m in range(128)] * 40 + [0xBF00 | m for m in range(128)]))


def test_long_zero_runs_compress():
    zeros = torch.zeros(1 << 20, dtype=torch.bfloat16)
    blob = assert_round_trip(zeros)
    assert blob.numel() / (2 * zeros.numel()) < 0.005
    # gradient-like: 90% exact zeros, the rest normal
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4096, generator=g).bfloat16()
    x[torch.rand(256, 4096, generator=g) < 0.9] = 0
    blob = assert_round_trip(x)
    assert blob.numel() / (2 * x.numel()) < 0.12
    # zero rows between dense rows
    x = torch.randn(512, 384, generator=g).bfloat16()
    x[::3] = 0
    raw = lossless.encode(torch.randn(512, 384, generator=g).bfloat16()).numel()
    assert assert_round_trip(x).numel() < 0.80 * raw


def test_zero_runs_of_every_length_and_alignment():
    """Runs of +0.0 from 1 to 20,000 values (long enough that states renormalise inside a run) at
    every alignment to the 32-value SIMD step, between dense stretches: the decoder's all-zero step
    and its general step hand over in both directions; same bytes and values as the portable core."""
    g = torch.Generator().manual_seed(5)
    parts = []
    for k in range(120):
        run = int(torch.randint(1, 20_000 if k % 3 == 0 else 100, (1,), generator=g))
        dense = torch.randn(int(torch.randint(1, 70, (1,), generator=g)), generator=g).bfloat16()
        dense[dense.view(torch.int16) == 0] = 1.0
        parts += [torch.zeros(run, dtype=torch.bfloat16), dense]
    x = torch.cat(parts)
    assert (x.view(torch.int16) == 0).float().mean() > 0.9
    for chunk_values in (4096, 65536):
        assert_round_trip(x, chunk_values=chunk_values)
        assert_round_trip(x[7:], chunk_values=chunk_values)  # every run shifted against the steps


@pytest.mark.parametrize("chunk_values", [32, 96, 1024])
def test_chunks_with_and_without_zeros_at_every_offset(chunk_values):
    """The encoder's first pass counts each chunk's +0.0 values; chunks with none take the vector
    field packer (32 values per step, then a scalar tail), the others the compacting one. Lengths
    around multiples of 32 and one +0.0 at offsets across a chunk, on both sides of the paths:
    same bytes as the portable core, values back exactly."""
    g = torch.Generator().manual_seed(11)
    for n in (31, 32, 33, 63, 64, 65, 95, 97, 1000, 1023, 1025, 3 * 1024 + 7):
        x = torch.randn(n, generator=g).bfloat16()
        x[x.view(torch.int16) == 0] = 1.0  # no +0.0: every chunk takes the packing path
        assert_round_trip(x, chunk_values=chunk_values)
        for pos in sorted({0, 1, 31, 32, n // 2, n - 33, n - 1} & set(range(n))):
            y = x.clone()
            y[pos] = 0.0
            assert_round_trip(y, chunk_values=chunk_values)
            y[pos] = -0.0  # a raw field like any other value
            assert_round_trip(y, chunk_values=chunk_values)


def test_short_streams_near_chunk_ends():
    """Chunks whose word or raw-field streams end early (all +0.0, a few non-zero values, zeros
    only at the start or end) are decoded by the SIMD decoder from padded stream tails: same
    values as the portable core, and every corruption of such a blob is still rejected."""
    g = torch.Generator().manual_seed(3)
    cv = 1024
    dense = torch.randn(cv, generator=g).bfloat16()
    parts = [torch.zeros(cv), dense, torch.zeros(cv), torch.cat([dense[: cv // 2], torch.zeros(cv // 2)]),
             torch.cat([torch.zeros(cv - 40), dense[:40]]), torch.zeros(cv), dense.flip(0)]
    one = torch.zeros(cv)
    one[700] = 3.0
    parts.append(one)
    x = torch.cat([p.bfloat16() for p in parts])
    blob = assert_round_trip(x, chunk_values=cv)
    # a smaller blob of the same kinds of chunks: every single-byte flip raises in both decoders
    small = torch.cat([torch.zeros(64), dense[:64], torch.zeros(32), dense[:8], torch.zeros(56)]).bfloat16()
    blob = assert_round_trip(small, chunk_values=64)
    for pos in range(blob.numel()):
        bad = blob.clone()
        bad[pos] ^= 0x41
        for path in lossless.simd_paths():
            with pytest.raises(ValueError):
                lossless.decode(bad, simd=path)


def test_message_blob_view_stays_valid():
    """A 64x7168 message's blob is returned as a view of the encoder's output mapping (it fills
    about 2/3 of it): it must keep that mapping from being reused while it lives, through many
    later encodes and decodes, and still decode exactly."""
    g = torch.Generator().manual_seed(3)
    first = (torch.randn(64, 7168, generator=g) * 0.02).bfloat16()
    blob = lossless.encode(first)
    saved = blob.clone()
    for _ in range(20):
        other = (torch.randn(64, 7168, generator=g) * 0.02).bfloat16()
        assert torch.equal(bits(lossless.decode(lossless.encode(other))), bits(other))
    assert torch.equal(blob, saved)
    assert torch.equal(bits(lossless.decode(blob)), bits(first))


def test_large_output_owns_its_memory():
    """Outputs of 2 MiB and more live in their own mapping: they stay valid and writable after the
    blob is gone, and are released with the tensor."""
    import gc

    g = torch.Generator().manual_seed(5)
    x = torch.randn(1536, 1024, generator=g).bfloat16()  # 3 MiB
    y = lossless.decode(lossless.encode(x))
    gc.collect()
    assert torch.equal(bits(y), bits(x))
    y[0, 0] = 7.0
    assert float(y[0, 0]) == 7.0 and torch.equal(bits(y[1:]), bits(x[1:]))
    view = y[5:9]
    del y
    gc.collect()
    assert torch.equal(bits(view), bits(x[5:9])), "a view keeps the mapping alive"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the mapping cache is Linux-only")
def test_freed_large_outputs_are_reused_within_bounds():
    """A freed output of 256 KiB or more keeps its mapping for the next output of about its size
    (no page faults again): the next decode lands in the same memory and is still exact, over
    old contents; the cache stays within its bound and releases everything on request."""
    import gc

    g = torch.Generator().manual_seed(6)
    x = torch.randn(1536, 1024, generator=g).bfloat16()  # 3 MiB
    z = torch.randn(1500, 1024, generator=g).bfloat16()
    blob_x, blob_z = lossless.encode(x), lossless.encode(z)
    lossless.release_cached_outputs()
    assert lossless.cached_output_bytes() == 0
    y = lossless.decode(blob_x)
    address = y.data_ptr()
    del y
    gc.collect()
    assert lossless.cached_output_bytes() >= 3 << 20
    y = lossless.decode(blob_z)
    assert y.data_ptr() == address, "the freed mapping was not reused"
    assert torch.equal(bits(y), bits(z))
    del y
    gc.collect()
    # a mapping serves only requests it covers, and of at least half its size
    big = lossless.decode(lossless.encode(torch.randn(5 << 19, generator=g).bfloat16()))  # 5 MiB
    assert big.data_ptr() != address
    del big
    gc.collect()
    small = lossless.decode(lossless.encode(torch.randn(1 << 17, generator=g).bfloat16()))  # 256 KiB
    assert small.data_ptr() != address
    del small
    gc.collect()
    held = []  # 60 live 3 MiB outputs (6 MiB mappings), then all freed: at most 256 MiB are kept
    for _ in range(60):
        held.append(lossless.decode(blob_x))
    assert all(torch.equal(bits(h), bits(x)) for h in held[::29])
    del held
    gc.collect()
    assert 0 < lossless.cached_output_bytes() <= 256 << 20
    lossless.release_cached_outputs()
    held = [lossless.empty((150_000,)) for _ in range(300)]  # 300 KB each: at most 256 mappings kept
    del held
    gc.collect()
    assert 0 < lossless.cached_output_bytes() <= 256 * 300 * 1024
    lossless.release_cached_outputs()
    assert lossless.cached_output_bytes() == 0
    # from 256 KiB (e.g. a 64x7168 message, 917 KB) outputs and encoder scratch come from the
    # cache too, on 4 KiB pages
    message = torch.randn(64, 7168, generator=g).bfloat16()
    blob = lossless.encode(message)
    assert lossless.cached_output_bytes() > 0, "the encoder's scratch and work area were not kept"
    y = lossless.decode(blob)
    address = y.data_ptr()
    del y
    gc.collect()
    y = lossless.decode(blob)
    assert y.data_ptr() == address and torch.equal(bits(y), bits(message))
    lossless.release_cached_outputs()
    assert lossless.cached_output_bytes() == 0


def test_simd_and_portable_decoders_report_the_same_error():
    """Corrupted blobs get the same ValueError message from every host decoder (portable, AVX2,
    AVX-512 where the CPU has them; the GPU decoder mirrors the portable one, and the GPU tests
    compare its statuses with the host's): single-byte damage anywhere past the header of a blob
    whose table has +0.0 while most chunks have none (those take the AVX2 path without zero
    tests)."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(8 * 1024, generator=g).bfloat16()
    x[100:140] = 0  # zeros in the first chunk only: the table has the +0.0 symbol
    blob = lossless.encode(x, chunk_values=1024)
    header = _table_end(blob)
    seen = set()
    for trial in range(300):
        bad = blob.clone()
        pos = int(torch.randint(header, blob.numel(), (1,), generator=g))
        bad[pos] ^= int(torch.randint(1, 256, (1,), generator=g))
        messages = []
        for path in lossless.simd_paths():
            with pytest.raises(ValueError) as error:
                lossless.decode(bad, simd=path)
            messages.append(str(error.value))
        assert len(set(messages)) == 1, (trial, pos, messages)
        seen.add(messages[0])
    assert len(seen) >= 3, seen


def test_crafted_chunk_hiding_its_zeros_is_rejected():
    """A chunk whose directory claims no +0.0 (a raw field per value, zeros given the field 0)
    while its symbols include +0.0: every check but the raw-field count would pass on a decoder
    that took the directory's word for it; both host decoders (and the GPU's, which mirrors the
    portable one) report a corrupted stream."""
    import struct

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=g).bfloat16()
    x[::7] = 0
    blob = bytearray(lossless.encode(x, chunk_values=1024, version=3).numpy().tobytes())  # 32 states
    directory = (_table_end(torch.frombuffer(bytearray(blob), dtype=torch.uint8)) + 3) & ~3
    mode, num_words, num_raw, checksum = struct.unpack_from("<4I", blob, directory)
    values = bits(x).numpy().astype("uint16")
    assert mode == 0 and num_raw == int((values != 0).sum()) < 1024
    packed = 0
    for k, v in enumerate(values):
        packed |= (int(v) & 63) << (6 * k)
    start = directory + 16
    payload = bytes(blob[start:start + 128 + 2 * num_words]) + packed.to_bytes(6 * 1024 // 8, "little")
    payload += b"\0" * (-len(payload) % 4)
    crafted = bytes(blob[:directory]) + struct.pack("<4I", 0, num_words, 1024, checksum) + payload
    for path in lossless.simd_paths():
        with pytest.raises(ValueError, match="corrupted entropy-coded stream"):
            lossless.decode(torch.frombuffer(bytearray(crafted), dtype=torch.uint8), simd=path)


def test_simd_argument():
    """simd takes True, False or a path name; a path this CPU lacks or an unknown name is a
    ValueError naming the argument, raised before any work."""
    paths = lossless.simd_paths()
    assert paths[0] == "portable" and set(paths) <= set(lossless.SIMD_PATHS)
    x = torch.randn(100).bfloat16()
    blob = lossless.encode(x)
    for bad in ("sse", "AVX2", 2):
        with pytest.raises(ValueError, match="simd"):
            lossless.encode(x, simd=bad)
        with pytest.raises(ValueError, match="simd"):
            lossless.decode(blob, simd=bad)
    for missing in set(lossless.SIMD_PATHS) - set(paths):
        with pytest.raises(ValueError, match="simd"):
            lossless.decode(blob, simd=missing)
    # truth values of other types, as pybind11's bool accepted them
    import numpy as np
    for truth in (np.True_, np.False_, 1, 0):
        assert torch.equal(lossless.encode(x, simd=truth), blob)
        assert torch.equal(bits(lossless.decode(blob, simd=truth)), bits(x))
    # checked even where nothing is coded
    for bad in ("sse", 2, 0.5, None):
        with pytest.raises(ValueError, match="simd"):
            lossless.encode_many([], simd=bad)
        with pytest.raises(ValueError, match="simd"):
            lossless.decode_into_many([], [], simd=bad)


def mixed_chunks(cv: int, seed: int) -> torch.Tensor:
    """Chunks of every kind, in an odd count so that decoders taking chunks in pairs (AVX-512) see
    pairs of unlike chunks and a lone last one: dense, all +0.0, scattered +0.0, zero runs ending
    mid-step, random bit patterns (stored raw), and a short last chunk."""
    g = torch.Generator().manual_seed(seed)
    dense = (torch.randn(cv, generator=g) * 0.02).bfloat16()
    scattered = dense.clone()
    scattered[torch.randint(0, cv, (cv // 50,), generator=g)] = 0
    runs = dense.clone()
    runs[cv // 4: cv // 2 + 5] = 0
    noise = torch.randint(-32768, 32768, (cv,), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    zeros = torch.zeros(cv, dtype=torch.bfloat16)
    return torch.cat([dense, zeros, scattered, noise, runs, dense.flip(0), zeros[:cv // 2],
                      scattered.flip(0), dense[: cv // 3 + 7]])


@pytest.mark.parametrize("threads", [1, 2])
def test_paths_agree_on_mixed_chunks(threads):
    """Every host path decodes a blob of mixed chunks to the input, with 1 and 2 threads; a
    corrupted chunk fails the same way on every path whichever chunk it is paired with."""
    cv = 1024
    x = mixed_chunks(cv, seed=5)
    blob = assert_round_trip(x, chunk_values=cv, threads=threads)
    for path in lossless.simd_paths():
        assert torch.equal(bits(lossless.decode(blob, threads=threads, simd=path)), bits(x)), path
    header = _table_end(blob)
    g = torch.Generator().manual_seed(9)
    for trial in range(60):
        bad = blob.clone()
        pos = int(torch.randint(header, blob.numel(), (1,), generator=g))
        bad[pos] ^= int(torch.randint(1, 256, (1,), generator=g))
        messages = set()
        for path in lossless.simd_paths():
            with pytest.raises(ValueError) as error:
                lossless.decode(bad, threads=threads, simd=path)
            messages.add(str(error.value))
        assert len(messages) == 1, (trial, pos, messages)


@pytest.mark.parametrize("nonzero", [1, 8, 31, 32, 33, 63, 64, 65, 95, 96, 97, 255, 256, 257, 1000, 1023])
def test_raw_fields_of_chunks_with_zeros_on_every_path(nonzero):
    """A chunk with +0.0 stores the raw fields of its other values only, compacted and packed to 6
    bits (the AVX-512 path 32 values a step, then 32 fields a step, the rest 8 at a time): every
    count of fields around those group sizes, at scattered places, gives the same blob on every
    path and round-trips, in chunks of 1,024 and of 1,000 values (a partial last step)."""
    g = torch.Generator().manual_seed(nonzero)
    for n in (1024, 1000):
        if nonzero > n:
            continue
        x = torch.zeros(n, dtype=torch.bfloat16)
        where = torch.randperm(n, generator=g)[:nonzero]
        x[where] = (torch.randn(nonzero, generator=g) * 0.02).to(torch.bfloat16)
        x[where[x[where] == 0]] = 1.0  # every chosen value non-zero
        assert int((x != 0).sum()) == nonzero
        assert_round_trip(x, chunk_values=1024)
        assert_round_trip(torch.cat([x, x.flip(0), x]), chunk_values=1024, threads=2)


def test_encode_leaves_the_callers_rounding_mode():
    """The AVX2 rANS pass rounds toward zero while it runs (MXCSR) and must give the calling
    thread its rounding back: 1 + 1.5 ulp rounds to 1 + 2 ulp to nearest, 1 + 1 ulp toward zero."""
    one, step = np.float32(1.0), np.float32(1.5 * 2.0**-23)
    nearest = np.float32(1.0 + 2.0**-22)
    assert one + step == nearest
    x = torch.randn(4096, dtype=torch.bfloat16)
    for path in lossless.simd_paths():
        lossless.encode(x, threads=1, simd=path)
        assert one + step == nearest, path


def test_views_the_host_coder_cannot_read_in_place():
    """Tensors whose memory does not hold their values as they read, or not at an aligned
    address, are coded as their values: a negative view, a tensor at an odd byte address (from
    torch.frombuffer), the same as decode_into targets."""
    x = torch.randn(35, dtype=torch.bfloat16)
    expected = lossless.encode(x)
    negative = torch._neg_view(-x)
    assert negative.is_neg() and torch.equal(bits(negative.resolve_neg()), bits(x))
    assert torch.equal(lossless.encode(negative), expected)
    raw = bytearray(2 * 35 + 2)
    odd = torch.frombuffer(raw, dtype=torch.bfloat16, offset=1, count=35)
    assert odd.data_ptr() % 2 == 1
    odd.copy_(x)
    assert torch.equal(lossless.encode(odd), expected)
    odd.zero_()
    assert torch.equal(bits(lossless.decode_into(expected, odd)), bits(x))
    out = torch._neg_view(torch.zeros(35, dtype=torch.bfloat16))
    assert torch.equal(bits(lossless.decode_into(expected, out).resolve_neg()), bits(x))


def test_normal_data_compresses():
    x = (torch.randn(64, 7168, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    blob = assert_round_trip(x)
    assert blob.numel() / (2 * x.numel()) < 0.70


def test_random_bits_expand_little():
    x = torch.randint(-32768, 32768, (100_000,), dtype=torch.int16).view(torch.bfloat16)
    blob = assert_round_trip(x)
    assert blob.numel() <= 2 * x.numel() * 1.01 + 256
    # every chunk is stored raw, so the blob carries no frequency table
    assert int(blob[6]) | int(blob[7]) << 8 == 0


def test_sign_and_first_mantissa_bit_are_modelled():
    """Values whose sign and first mantissa bit are fixed per exponent (as in activations) must
    cost less than the exponent-only split's 8 raw bits per value: here only the 6 raw bits
    and a near-zero symbol cost remain."""
    g = torch.Generator().manual_seed(3)
    low = torch.randint(0, 64, (65536,), generator=g, dtype=torch.int32)
    values = (0x3F00 | 0x40 | low).to(torch.int16)          # +, exponent 126, mantissa bit 6 set
    blob = assert_round_trip(values.view(torch.bfloat16))
    assert blob.numel() < 2 * 65536 * (6.1 / 16)


def test_old_format_version_is_rejected():
    with pytest.raises(ValueError, match="version"):
        lossless.decode(_forge([64], 32, version=1))


def test_rans_chunk_without_table_is_rejected():
    blob = _forge([64], 32, entries=[])
    with pytest.raises(ValueError, match="directory"):
        lossless.decode(blob)
    with pytest.raises(ValueError, match="add up"):  # with a table, the same blob fails later
        lossless.decode(_forge([64], 32))


def test_noncontiguous_and_threads_deterministic():
    x = torch.randn(300, 200).bfloat16().t()
    assert not x.is_contiguous()
    assert_round_trip(x)
    a = lossless.encode(x, chunk_values=1024, threads=1)
    b = lossless.encode(x, chunk_values=1024, threads=2)
    assert torch.equal(a, b)
    assert torch.equal(bits(lossless.decode(a, threads=2)), bits(x))


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_threads_place_mixed_chunks_identically(threads):
    """Workers code chunks out of order and copy each payload after its predecessor's: chunks
    of +0.0 (tiny), random bits (stored raw) and normal values (rANS) in every order give the
    single-thread bytes, with more threads than cores too; an all-raw blob drops its table."""
    g = torch.Generator().manual_seed(11)
    cv = 4096  # 41 chunks: above the 2**17 values below which one thread codes everything
    kinds = [torch.zeros(cv, dtype=torch.bfloat16),
             torch.randint(-32768, 32768, (cv,), generator=g, dtype=torch.int16).view(torch.bfloat16),
             torch.randn(cv, generator=g).bfloat16()]
    order = torch.randint(0, 3, (40,), generator=g).tolist()
    x = torch.cat([kinds[k] for k in order] + [kinds[2][:777]])
    single = assert_round_trip(x, chunk_values=cv, threads=1)
    assert torch.equal(lossless.encode(x, chunk_values=cv, threads=threads), single)
    assert torch.equal(bits(lossless.decode(single, threads=threads)), bits(x))
    noise = torch.randint(-32768, 32768, (cv * 33 + 5,), generator=g, dtype=torch.int16).view(torch.bfloat16)
    raw_blob = assert_round_trip(noise, chunk_values=cv, threads=1)
    assert int(raw_blob[6]) | int(raw_blob[7]) << 8 == 0
    assert torch.equal(lossless.encode(noise, chunk_values=cv, threads=threads), raw_blob)


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_survey_chunks_in_pieces(threads):
    """With fewer chunks than a few per thread, the encoder's first pass cuts each chunk into
    pieces (checksum and +0.0 count summed over them): the blob is still the single-thread and
    portable-core bytes, for chunks with +0.0 runs, scattered +0.0 and a short last chunk."""
    g = torch.Generator().manual_seed(12)
    cv = 65536
    x = torch.randn(3 * cv + 1000, generator=g).bfloat16()
    x[5000:40000] = 0  # a run of +0.0 across piece boundaries
    x[cv + 7::97] = 0  # scattered +0.0
    x[2 * cv + 3] = float("nan")
    single = assert_round_trip(x, chunk_values=cv, threads=1)
    assert torch.equal(lossless.encode(x, chunk_values=cv, threads=threads), single)
    assert torch.equal(lossless.encode(x, chunk_values=cv, threads=threads, simd=False), single)
    assert torch.equal(bits(lossless.decode(single, threads=threads)), bits(x))
    # last chunks of 40 and 1 values: with 3 threads some of their pieces are empty, and a piece of
    # fewer than 16 values starts past the chunk's first value
    for tail in (40, 1):
        y = torch.randn(2 * cv + tail, generator=g).bfloat16()
        single = assert_round_trip(y, chunk_values=cv, threads=1)
        assert torch.equal(lossless.encode(y, chunk_values=cv, threads=threads), single)


def test_decode_into_rows_of_a_buffer():
    g = torch.Generator().manual_seed(8)
    parts = [torch.randn(n, 96, generator=g).bfloat16() for n in (5, 0, 17)]
    dest = torch.full((22, 96), float("nan"), dtype=torch.bfloat16)
    row = 0
    for p in parts:
        assert lossless.decode_into(lossless.encode(p), dest[row:row + p.shape[0]]) is not None
        row += p.shape[0]
    assert torch.equal(bits(dest), bits(torch.cat(parts)))
    blob = lossless.encode(parts[0])
    before = bits(dest).clone()
    with pytest.raises(ValueError, match="shape"):
        lossless.decode_into(blob, dest[:6])  # another shape: rejected before writing
    assert torch.equal(bits(dest), before)
    for bad in (torch.empty(5, 96), dest.t()[:, :5].t().contiguous().float(), torch.empty(96, 5).bfloat16().t(), "x"):
        with pytest.raises(ValueError, match="out"):
            lossless.decode_into(blob, bad)
    # lossless.empty: a destination of any size (huge-page backed from 2 MiB)
    for shape in ((0, 96), (3, 7), (1536, 1024)):
        out = lossless.empty(shape)
        assert out.shape == shape and out.dtype == torch.bfloat16 and out.is_contiguous()
        x = torch.randn(shape, generator=g).bfloat16()
        assert torch.equal(bits(lossless.decode_into(lossless.encode(x), out)), bits(x))
    for bad_shape in ((-1, 3), (2**64, 1), (2**49,), "3", (2.0,)):
        with pytest.raises(ValueError, match="shape"):
            lossless.empty(bad_shape)
        with pytest.raises(ValueError, match="expected_shape"):
            lossless.decode(blob, expected_shape=bad_shape)
    with pytest.raises(ValueError, match="requires_grad"):
        lossless.decode_into(blob, torch.zeros(5, 96, dtype=torch.bfloat16, requires_grad=True))


def test_encode_rows_and_shape_of():
    x = torch.randn(64, 512).bfloat16()
    blob = lossless.encode_rows(x)
    assert lossless.shape_of(blob) == (64, 512)
    assert torch.equal(bits(lossless.decode(blob)), bits(x))
    with pytest.raises(ValueError, match="x"):
        lossless.encode_rows(x.reshape(-1))


@pytest.mark.parametrize("bad", [torch.zeros(4, dtype=torch.float32), torch.zeros(4, dtype=torch.float16),
                                 torch.zeros(4, dtype=torch.int16), [1.0, 2.0]])
def test_wrong_dtype_names_x(bad):
    with pytest.raises(ValueError, match=r"\bx\b"):
        lossless.encode(bad)


def test_bad_chunk_size_rejected():
    with pytest.raises(ValueError):
        lossless.encode(torch.zeros(10, dtype=torch.bfloat16), chunk_values=33)


def small_blob() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 500, generator=g).bfloat16()
    x[1, 10:300] = 0
    x[2, 5] = float("nan")
    x[2, 400:] = torch.randint(-32768, 32768, (100,), generator=g, dtype=torch.int16).view(torch.bfloat16)
    blob = lossless.encode(x, chunk_values=448)
    return x, blob


def test_every_single_byte_corruption_is_detected():
    x, blob = small_blob()
    for pos in range(blob.numel()):
        for flip in (0x01, 0x80, 0xFF):
            bad = blob.clone()
            bad[pos] ^= flip
            with pytest.raises(ValueError):
                lossless.decode(bad)
    assert torch.equal(bits(lossless.decode(blob)), bits(x)), "decode must not modify the blob"


def test_every_truncation_and_extension_is_detected():
    _, blob = small_blob()
    for n in range(blob.numel()):
        with pytest.raises(ValueError):
            lossless.decode(blob[:n].clone())
    with pytest.raises(ValueError):
        lossless.decode(torch.cat([blob, torch.zeros(4, dtype=torch.uint8)]))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400), seed=st.integers(0, 2**31 - 1))
def test_garbage_and_random_damage_never_crash(data, seed):
    garbage = torch.tensor(list(data), dtype=torch.uint8)
    with contextlib.suppress(ValueError):  # garbage may be rejected, but must never crash
        lossless.decode(garbage)
    # random multi-byte damage of a valid blob: ValueError, or (never observed) a correct decode
    x, blob = small_blob()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, blob.numel(), (3,), generator=g)
    bad = blob.clone()
    bad[idx] ^= torch.randint(1, 256, (3,), generator=g, dtype=torch.int32).to(torch.uint8)
    with pytest.raises(ValueError):
        lossless.decode(bad)


def test_blob_type_checked():
    with pytest.raises(ValueError):
        lossless.decode(torch.zeros(10, dtype=torch.int32))
    with pytest.raises(ValueError):
        lossless.decode(torch.zeros(2, 10, dtype=torch.uint8))


def _table_end(blob: torch.Tensor) -> int:
    """The offset just past a blob's frequency table (format version 2, 3 or 4; before its padding)."""
    layout = blob_layout(blob)
    return layout["table_at"] + layout["table_bytes"]


def _read_table_v3(blob: torch.Tensor) -> tuple[int, dict[int, int], int]:
    """(prob_bits, symbol -> frequency, table bytes) of a format version 3 blob, read by the format's
    definition (csrc/codec/lossless_core.h), independently of the C++ reader."""
    import struct

    b = blob.numpy().tobytes()
    assert b[4] == 3
    entries, prob_bits, size = struct.unpack_from("<H", b, 6)[0], b[28], struct.unpack_from("<H", b, 30)[0]
    p, k, symbol, freqs = 32 + 8 * b[5], 0, -1, {}
    for _ in range(entries):
        gap = b[p + k]
        k += 1
        if gap & 0x80:
            gap = (gap & 0x7F) << 8 | b[p + k]
            k += 1
        f = b[p + k]
        k += 1
        if f & 0x80:
            f = (f & 0x7F) << 8 | b[p + k]
            k += 1
        symbol += gap + 1
        freqs[symbol] = f + 1
    assert k == size
    return prob_bits, freqs, size


def _forge(shape, chunk_values, num_values=None, entries=None, version=2, table=None, prob_bits=11):
    """A blob with a valid header, table (default: +0.0 only) and meta checksum whose chunk
    directory is all zeros (every chunk 'rANS' with no words): it declares ``shape`` but carries
    no payload. Version 3: ``table`` gives the table's bytes as they are (default: ``entries``
    coded in the shortest form), ``prob_bits`` the header's."""
    import struct

    count = num_values
    if count is None:
        count = 1
        for d in shape:
            count *= d
    count &= (1 << 64) - 1
    chunks = (count + chunk_values - 1) // chunk_values
    if entries is None:
        entries = [(1024, 1 << prob_bits)] if count else []
    if version == 3 and table is None:
        table, previous = b"", -1
        for symbol, freq in entries:
            gap = symbol - previous - 1
            table += bytes([gap]) if gap < 128 else bytes([0x80 | gap >> 8, gap & 0xFF])
            table += bytes([freq - 1]) if freq <= 128 else bytes([0x80 | (freq - 1) >> 8, (freq - 1) & 0xFF])
            previous = symbol
    last = 0 if version != 3 else prob_bits | len(table) << 16
    header = bytearray(struct.pack("<IBBHIIQII", 0x424C5045, version, len(shape), len(entries), chunk_values,
                                   chunks, count, 0, last))
    for d in shape:
        header += struct.pack("<Q", d)
    if version == 3:
        header += table
    else:
        for symbol, freq in entries:
            header += struct.pack("<HH", symbol, freq)
    while len(header) % 4:
        header += b"\0"
    checksum = 0
    for i in range(len(header)):
        if i < 24 or i >= 28:
            checksum = (checksum + header[i] * (2 * i + 1)) & 0xFFFFFFFF
    struct.pack_into("<I", header, 24, checksum)
    header += b"\0" * (16 * chunks)
    return torch.frombuffer(header, dtype=torch.uint8).clone()


@pytest.mark.parametrize("shape,chunk_values,num_values", [
    ([2**36], 2**24, None),          # 128 GiB declared by a 64 KiB blob
    ([2**31], 2**24, None),          # 4 GiB declared
    ([2**40, 2**24], 2**24, 0),      # shape product wraps around 2**64
])
def test_forged_headers_are_rejected_before_allocating(shape, chunk_values, num_values):
    blob = _forge(shape, chunk_values, num_values)
    with pytest.raises(ValueError):
        lossless.shape_of(blob)
    with pytest.raises(ValueError):
        lossless.decode(blob)


def test_dimensions_beyond_the_format_are_rejected_by_encode():
    with pytest.raises(ValueError, match="x"):
        lossless.encode(torch.empty(0, 2**49, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x has 9 dimensions; blobs hold at most 8"):
        lossless.encode(torch.zeros((1,) * 9, dtype=torch.bfloat16))
    assert_round_trip(torch.randn((2, 1, 3, 1, 1, 2, 1, 2)).to(torch.bfloat16))


def test_expected_shape_is_checked_before_allocating():
    """Zero runs compress ~100,000-fold, so receivers state the shape they expect."""
    blob = lossless.encode(torch.zeros(1 << 20, dtype=torch.bfloat16))
    assert blob.numel() < 4096
    assert lossless.decode(blob, expected_shape=(1 << 20,)).shape == (1 << 20,)
    with pytest.raises(ValueError, match="expected"):
        lossless.decode(blob, expected_shape=(16,))
    with pytest.raises(ValueError, match="expected_shape"):
        lossless.decode(blob, expected_shape=16)


def test_small_chunks_match_large_chunk_statistics():
    """Chunk size changes the blob layout, never the symbol statistics: the same values coded with
    1,024-value and 65,536-value chunks carry identical format version 2 tables (histograms are
    exact for any size), and version 3 tables of the same symbols (their probability bits may
    differ: more chunks ask a larger gain of 12-bit frequencies)."""
    x = (torch.randn(50_000, generator=torch.Generator().manual_seed(5)) * 0.1).bfloat16()
    small, large = (lossless.encode(x, chunk_values=cv, version=2) for cv in (1024, 65536))
    entries = int(large[6]) | int(large[7]) << 8
    assert (int(small[6]) | int(small[7]) << 8) == entries
    table = slice(40, 40 + 4 * entries)  # header 32 bytes + one u64 dimension
    assert torch.equal(small[table], large[table])
    small, large = (lossless.encode(x, chunk_values=cv, version=3) for cv in (1024, 65536))
    (bits_small, f_small, _), (bits_large, f_large, _) = _read_table_v3(small), _read_table_v3(large)
    assert set(f_small) == set(f_large) and len(f_small) == entries
    if bits_small == bits_large:
        assert f_small == f_large
    assert torch.equal(bits(lossless.decode(small)), bits(x))


# ---- format version 3: the compact table, 11 or 12 probability bits, never larger than version 2

def _v3_inputs() -> list[tuple[str, torch.Tensor, int | None]]:
    g = torch.Generator().manual_seed(31)
    sparse = torch.relu(torch.randn(64, 7168, generator=g)).bfloat16()
    sparse[:, ::3] = 0
    return [
        ("normal", torch.randn(64, 7168, generator=g).bfloat16(), None),
        ("normal_small_chunks", torch.randn(64, 7168, generator=g).bfloat16(), 1024),
        ("weights_like", (torch.randn(384, 1536, generator=g) * 0.02).bfloat16(), None),
        ("sparse", sparse, None),
        ("bias", (torch.randn(384, generator=g) * 0.01).bfloat16(), None),
        ("ones", torch.ones(384, dtype=torch.bfloat16), None),
        ("zeros", torch.zeros(100_000, dtype=torch.bfloat16), None),
        ("two_symbols", torch.tensor([0.0, 1e30] * 5000).bfloat16(), None),  # a gap above 127
        ("random_bits", torch.randint(-32768, 32768, (100_000,), generator=g, dtype=torch.int32).to(torch.int16)
         .view(torch.bfloat16), None),
        ("scalar", torch.tensor(2.5).bfloat16(), None),
    ]


@pytest.mark.parametrize("name,x,chunk_values", _v3_inputs(), ids=[c[0] for c in _v3_inputs()])
def test_format_3_is_never_larger_than_format_2(name, x, chunk_values):
    """The same tensor coded in both formats, on every host path: version 3 is at most version 2's
    size, both decode to the input everywhere, and version 3's table reads back (by the format's
    definition, in Python) as frequencies summing to 2^prob_bits, each at most 2048, in at most
    version 2's 4 bytes per entry."""
    new = {p: lossless.encode(x, chunk_values=chunk_values, simd=p, version=3) for p in lossless.simd_paths()}
    old = {p: lossless.encode(x, chunk_values=chunk_values, simd=p, version=2) for p in lossless.simd_paths()}
    assert len({bytes(b.numpy()) for b in new.values()}) == 1 and len({bytes(b.numpy()) for b in old.values()}) == 1
    new, old = new["portable"], old["portable"]
    assert int(new[4]) == 3 and int(old[4]) == 2
    assert new.numel() <= old.numel(), (new.numel(), old.numel())
    for blob in (new, old):
        for path in lossless.simd_paths():
            assert torch.equal(bits(lossless.decode(blob, simd=path)), bits(x)), path
    prob_bits, freqs, size = _read_table_v3(new)
    entries = int(new[6]) | int(new[7]) << 8
    assert prob_bits in (11, 12) and len(freqs) == entries and size <= 4 * entries
    if freqs:
        assert sum(freqs.values()) == 1 << prob_bits and max(freqs.values()) <= 2048 and max(freqs) <= 1024


def test_format_3_uses_12_bit_frequencies_where_they_pay():
    """Large chunks of many symbols take 12-bit frequencies (finer for rare symbols), and end up
    smaller than version 2; a symbol above half the values forces 11 bits (an entry holds at most
    2048); one small chunk keeps 11 (the gain is below the 64-byte margin per chunk)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 7168, generator=g).bfloat16()
    blob = lossless.encode(x, version=3)
    assert _read_table_v3(blob)[0] == 12 and blob.numel() < lossless.encode(x, version=2).numel()
    skewed = torch.where(torch.rand(64, 7168, generator=g) < 0.6, torch.ones(()), torch.randn(64, 7168, generator=g))
    assert _read_table_v3(lossless.encode(skewed.bfloat16(), version=3))[0] == 11
    assert _read_table_v3(lossless.encode(torch.randn(512, generator=g).bfloat16(), version=3))[0] == 11


@pytest.mark.parametrize("table,entries,prob_bits,message", [
    # valid (gap 127, freq 2048): the table passes, the forged directory's missing payload fails later
    (bytes([0x7F, 0x80 | 7, 0xFF]), [(127, 2048)], 11, "add up"),
    (bytes([0x80, 0x05, 0x0F]), [(5, 16)], 11, "frequency table"),  # gap 5 in the long form
    (bytes([0x00, 0x80, 0x05]), [(0, 6)], 11, "frequency table"),  # freq 6 in the long form
    (bytes([0x85, 0x00, 0x00]), [(1280, 1)], 11, "frequency table"),  # symbol past 1024
    (bytes([0x00, 0x88, 0x00]), [(0, 2049)], 12, "frequency table"),  # freq above 2048
    (bytes([0x00, 0x87, 0xFF]), [(0, 2048)], 12, "frequency table"),  # sums to 2048, not 4096
    (bytes([0x00, 0x87, 0xFF, 0x00]), [(0, 2048)], 11, "frequency table"),  # a byte left over
    (bytes([0x00, 0x87]), [(0, 2048)], 11, "frequency table"),  # cut inside an entry
])
def test_format_3_table_is_validated(table, entries, prob_bits, message):
    """Version 3 tables with a valid metadata checksum but a non-canonical, out-of-range or
    inconsistent entry are rejected (the same checks run on the GPU decoder); a valid one parses."""
    blob = _forge([64], 32, entries=entries, version=3, table=table, prob_bits=prob_bits)
    with pytest.raises(ValueError, match=message):
        lossless.shape_of(blob)


@pytest.mark.parametrize("last", [10, 13, 11 | 1 << 8])
def test_format_3_header_word_is_validated(last):
    """prob_bits other than 11 or 12, or a non-zero byte after it: a corrupted header."""
    import struct

    blob = bytearray(_forge([64], 32, version=3, prob_bits=11).numpy().tobytes())
    word = struct.unpack_from("<I", blob, 28)[0]
    struct.pack_into("<I", blob, 28, (word & 0xFFFF0000) | last)
    checksum = sum(blob[i] * (2 * i + 1) for i in range(len(blob) - 16 * 2) if not 24 <= i < 28) & 0xFFFFFFFF
    struct.pack_into("<I", blob, 24, checksum)
    with pytest.raises(ValueError, match="corrupted header"):
        lossless.shape_of(torch.frombuffer(blob, dtype=torch.uint8))


def test_encode_version_argument():
    with pytest.raises(ValueError, match="version"):
        lossless.encode(torch.zeros(4, dtype=torch.bfloat16), version=1)
    from ep_comm import _host

    assert lossless.FORMAT_VERSION == 7 and _host.LOSSLESS_FORMAT_VERSION == 7


# ---- what the device path reads on the host: the fixed header, and the error texts

@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 0, 2), (70, 3), (2, 3, 4, 5, 1, 1, 1, 2)])
def test_header_fields_give_shape_and_chunk_size(shape):
    from ep_comm.codecs import lossless_device

    x = torch.randn(shape).to(torch.bfloat16)
    blob = lossless.encode(x, chunk_values=64)
    assert lossless_device.header(blob) == (tuple(shape), 64)


def test_header_fields_reject_what_the_decoder_rejects():
    from ep_comm import _host
    from ep_comm.codecs import lossless_device

    blob = lossless.encode(torch.randn(300, 7).to(torch.bfloat16), chunk_values=64)
    with pytest.raises(ValueError, match="prefix must hold the blob's first 96 bytes, got 10"):
        _host.lossless_metadata_bytes(blob[:10].numpy(), blob.numel())
    with pytest.raises(ValueError, match="blob is truncated"):  # not even the header
        _host.lossless_parse_metadata(blob[:10].numpy(), blob.numel())
    with pytest.raises(ValueError, match="metadata must hold the blob's first [0-9]+ bytes, got 40"):
        _host.lossless_parse_metadata(blob[:40].numpy(), blob.numel())
    data_offset = _host.lossless_metadata_bytes(blob[:96].numpy(), blob.numel())
    with pytest.raises(ValueError, match=f"metadata must hold the blob's first {data_offset} bytes"):
        _host.lossless_parse_metadata(blob[:data_offset + 1].numpy(), blob.numel())

    def outcome(f, b):
        try:
            return f(b)
        except ValueError as error:
            return str(error)

    # what the device path checks before allocating = what the host decoder checks (parse), for
    # every 1-byte corruption of the metadata, a few of the payload, and every truncation
    positions = list(range(data_offset)) + [data_offset, blob.numel() // 2, blob.numel() - 1]
    for p in positions:
        bad = blob.clone()
        bad[p] ^= 0x41
        want = outcome(lambda b: (lossless.shape_of(b), 64), bad)
        assert outcome(lossless_device.header, bad) == want, f"byte {p}"
    for cut in list(range(0, data_offset + 2)) + [blob.numel() - 1]:
        want = outcome(lossless.shape_of, blob[:cut])
        assert isinstance(want, str) and outcome(lossless_device.header, blob[:cut]) == want, f"{cut} bytes"
    v3 = lossless.encode(torch.randn(300, 7).to(torch.bfloat16), chunk_values=64, version=3)
    for version, position, message in [
            (4, 0, "bad magic"), (4, 4, "version"), (4, 5, "corrupted header"), (4, 8, "corrupted header"),
            (4, 16, "corrupted header"), (4, 20, "corrupted header"),  # the shape: the metadata checksum
            (3, 16, "corrupted header"), (3, 33, "shape does not match")]:
        bad = (blob if version == 4 else v3).clone()
        bad[position] ^= 0x41
        with pytest.raises(ValueError, match=message):
            lossless_device.header(bad)


def test_error_messages_are_the_decoders():
    from ep_comm import _host

    texts = [_host.lossless_error_message(s) for s in range(12)]
    assert texts[0] == "ok" and len(set(texts)) == 12
    assert _host.lossless_error_message(99) == "unknown error"
    blob = lossless.encode(torch.randn(4096).to(torch.bfloat16))
    blob[-3] ^= 0x10  # the last chunk's payload
    with pytest.raises(ValueError) as error:
        lossless.decode(blob)
    assert str(error.value) in {f"lossless blob: {t}" for t in texts[1:]}


def test_chunk_values_is_checked_by_name():
    import numpy as np

    x = torch.randn(100).to(torch.bfloat16)
    for bad in (0, 16, 33, 1 << 25, 64.0, "64"):
        with pytest.raises(ValueError, match="chunk_values must be a multiple of 32"):
            lossless.encode(x, chunk_values=bad)
    assert torch.equal(lossless.encode(x, chunk_values=np.int64(64)), lossless.encode(x, chunk_values=64))
    assert torch.equal(lossless.encode(x, chunk_values=None), lossless.encode(x, chunk_values=65536))  # the default


def test_threads_version_and_tensors_without_data_are_checked_by_name():
    import numpy as np

    x = torch.randn(100).to(torch.bfloat16)
    blob = lossless.encode(x)
    for bad in (-1, 2.0, None, "2", 1 << 31, True):
        with pytest.raises(ValueError, match="threads must be an int"):
            lossless.encode(x, threads=bad)
        with pytest.raises(ValueError, match="threads must be an int"):
            lossless.decode(blob, threads=bad)
        with pytest.raises(ValueError, match="threads must be an int"):
            lossless.decode_into(blob, torch.empty(100, dtype=torch.bfloat16), threads=bad)
    assert torch.equal(lossless.encode(x, threads=np.int64(1)), blob)
    for bad in (5.0, "5", True, 8):
        with pytest.raises(ValueError, match="version must be one of"):
            lossless.encode(x, version=bad)
    assert torch.equal(lossless.encode(x, version=np.int64(7)), blob)
    with pytest.raises(ValueError, match="x must be a dense tensor with data"):
        lossless.encode(torch.empty(10, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="x must be a dense tensor with data"):
        lossless.encode(torch.eye(3).bfloat16().to_sparse())
    with pytest.raises(ValueError, match="out must be a dense tensor with data"):
        lossless.decode_into(blob, torch.empty(100, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(ValueError, match="blob must be a dense tensor with data"):
        lossless.decode(torch.empty(10, dtype=torch.uint8, device="meta"))


def test_decode_into_refuses_an_out_that_overlaps_the_blob():
    x = torch.randn(100).to(torch.bfloat16)
    blob = lossless.encode(x)
    memory = torch.zeros(4096, dtype=torch.uint8)
    memory[:blob.numel()] = blob
    held = memory[:blob.numel()]
    with pytest.raises(ValueError, match="out overlaps blob"):
        lossless.decode_into(held, memory[blob.numel() - 2:blob.numel() + 198].view(torch.bfloat16))
    assert torch.equal(held, blob)  # nothing written
    out = memory[2048:2248].view(torch.bfloat16)
    assert torch.equal(bits(lossless.decode_into(held, out)), bits(x))  # the same storage, apart
    # several: an out over another message's blob (written before that blob is read)
    memory[1024:1024 + blob.numel()] = blob
    second = memory[1024:1024 + blob.numel()]
    with pytest.raises(ValueError, match=r"outs\[0\] overlaps blobs\[1\]"):
        lossless.decode_into_many([held, second], [memory[1000:1200].view(torch.bfloat16), out])
    assert torch.equal(second, blob)
    outs = [memory[2048:2248].view(torch.bfloat16), memory[2400:2600].view(torch.bfloat16)]
    lossless.decode_into_many([held, second], outs)
    assert all(torch.equal(bits(o), bits(x)) for o in outs)


# ---- several blobs per call (one per message)

def test_encode_many_and_decode_into_many_match_single_calls():
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(shape, generator=g).to(torch.bfloat16) for shape in [(3, 7), (0, 5), (1,), (200, 33)]]
    blobs = lossless.encode_many(xs, chunk_values=256)
    assert len(blobs) == len(xs)
    for x, blob in zip(xs, blobs):
        assert torch.equal(blob, lossless.encode(x, chunk_values=256))
    outs = [torch.empty(x.shape, dtype=torch.bfloat16) for x in xs]
    lossless.decode_into_many(blobs, outs)
    for x, out in zip(xs, outs):
        assert torch.equal(bits(out), bits(x))
    assert lossless.encode_many([]) == []
    lossless.decode_into_many([], [])
    for version in (2, 5):  # an older format on request, as encode writes it
        older = lossless.encode_many(xs, chunk_values=256, version=version)
        assert all(torch.equal(b, lossless.encode(x, chunk_values=256, version=version)) and int(b[4]) == version
                   for x, b in zip(xs, older) if x.numel())


def test_many_calls_name_the_bad_argument():
    x = torch.randn(4, 4).to(torch.bfloat16)
    blob = lossless.encode(x)
    with pytest.raises(ValueError, match=r"xs\[1\] must be a bfloat16 tensor"):
        lossless.encode_many([x, x.float()])
    with pytest.raises(ValueError, match="xs must be a list"):
        lossless.encode_many(x)
    with pytest.raises(ValueError, match="version must be one of"):
        lossless.encode_many([x], version=8)
    with pytest.raises(ValueError, match="same length"):
        lossless.decode_into_many([blob, blob], [torch.empty(4, 4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match=r"outs\[1\] must be a contiguous bfloat16 tensor"):
        lossless.decode_into_many([blob, blob], [torch.empty(4, 4, dtype=torch.bfloat16), torch.empty(4, 4).t()])
    with pytest.raises(ValueError, match="expected"):
        lossless.decode_into_many([blob], [torch.empty(2, 8, dtype=torch.bfloat16)])


def test_message_chunk_values_by_device():
    assert lossless.message_chunk_values("cpu") is None  # each message's default_chunk_values
    assert lossless.message_chunk_values(torch.device("cpu")) is None
    if not torch.cuda.is_available():  # no driver: the CPU codes CUDA tensors' messages
        assert lossless.message_chunk_values("cuda") is None
    with pytest.raises(ValueError, match="device must be a torch.device"):
        lossless.message_chunk_values(3.5)


def test_default_chunking_is_even_for_large_inputs_too():
    """Rounding chunk sizes up to 32 can leave an odd count from about 2^27 values (first at
    134,283,201): the size then drops by 32 until the count is even. Sizes only, computed."""
    g = torch.Generator().manual_seed(5)
    sizes = [134_283_201] + torch.randint(1 << 17, 1 << 40, (20000,), generator=g).tolist()
    for n in sizes:
        cv = lossless.default_chunk_values(n)
        assert cv % 32 == 0 and 32 <= cv <= lossless.DEFAULT_CHUNK_VALUES and -(-n // cv) % 2 == 0, n
    assert lossless.default_chunk_values(134_283_201) == 65472
    for bad in (-1, 2.5, "7", None):
        with pytest.raises(ValueError, match="num_values must be a non-negative int"):
            lossless.default_chunk_values(bad)


@pytest.mark.parametrize("num_values,expected", [
    (0, 65536), (1, 65536), (33, 65536), (65536, 65536), (65537, 32800), (3 * 65536, 49152),
    (64 * 7168, 57344), (10 * 65536 + 5, 54624)])
def test_default_chunking_gives_an_even_number_of_equal_chunks(num_values, expected):
    """encode's default: one chunk of 65,536 values up to that many, else the fewest chunks of at
    most 65,536 values, an even number of them (the AVX-512 coders pair chunks), equal sizes
    rounded up to a multiple of 32."""
    cv = lossless.default_chunk_values(num_values)
    assert cv == expected
    chunks = -(-num_values // cv)
    assert cv % 32 == 0 and cv <= lossless.DEFAULT_CHUNK_VALUES and (chunks <= 1 or chunks % 2 == 0)
    x = (torch.randn(num_values, generator=torch.Generator().manual_seed(num_values)) * 0.1).bfloat16()
    blob = lossless.encode(x)
    assert torch.equal(blob, lossless.encode(x, chunk_values=cv))
    assert lossless_device.header(blob)[1] == cv
    assert torch.equal(bits(lossless.decode(blob)), bits(x))
    assert all(torch.equal(b, lossless.encode(t, chunk_values=lossless.default_chunk_values(t.numel())))
               for b, t in zip(lossless.encode_many([x, x[:100]]), [x, x[:100]]))
