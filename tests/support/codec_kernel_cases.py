"""Cases and checks of the lossless codec's kernels (csrc/cuda/lossless_kernels.cu) against the
host build of the same core, shared by the GPU tests (tests/gpu/test_codec_lossless_gpu.py: the
kernels built by nvcc, on a CUDA device) and the emulated ones (tests/test_codec_kernels_emulated.py:
the same source built for the CPU through csrc/emulation/). ``lib`` is the kernels' library loaded
with ctypes and its argument types set (bench/codec_gpu.py's gpu_library); ``device`` is where its
pointers point: "cuda" for the GPU build, "cpu" for the emulated one."""
from __future__ import annotations

import ctypes
import struct

import torch

from ep_comm.codecs import lossless

# the encoder's launches (one memset aside): histogram_kernel, rans_kernel, layout_kernel
ENCODER_MAX_KERNELS = 3
# version 6 launches rans_fields_kernel as well, and of the two, the one the histogram pass did not
# pick (its workspace flag) returns at once
VERSION_6_GATED_LAUNCHES = 1

# error_message() of csrc/codec/lossless_core.h, in the order of lossless::Status (0 = ok)
MESSAGES = ["ok", "blob is truncated", "not a lossless bf16 blob (bad magic)", "unsupported lossless blob version",
            "corrupted header", "shape does not match the number of values", "corrupted frequency table",
            "corrupted chunk directory", "chunk sizes do not add up to the blob size",
            "corrupted entropy-coded stream", "checksum mismatch (corrupted payload)",
            "non-zero padding (corrupted blob)"]


def _stream(device: str) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream if device == "cuda" else None)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_encode(lib: ctypes.CDLL, x: torch.Tensor, cv: int, device: str,
                  version: int = lossless.FORMAT_VERSION) -> torch.Tensor:
    """The kernels' blob of ``x`` (any shape, bf16) at ``cv`` values per chunk in format ``version``
    (4 to 7), as a CPU uint8 tensor."""
    return device_encode_and_workspace(lib, x, cv, device, version)[0]


def device_fields_wanted(lib: ctypes.CDLL, x: torch.Tensor, cv: int, device: str,
                         version: int = lossless.FORMAT_VERSION) -> tuple[torch.Tensor, bool]:
    """(blob, whether the encoder's histogram pass found a chunk whose fields may code smaller: its
    workspace's flag, which runs the field-coding pass instead of the plain one)."""
    blob, ws = device_encode_and_workspace(lib, x, cv, device, version)
    at = lib.ep_lossless_encode_fields_wanted_offset()
    return blob, bool(ws[at:at + 8].cpu().any())


def device_encode_and_workspace(lib: ctypes.CDLL, x: torch.Tensor, cv: int, device: str,
                                version: int) -> tuple[torch.Tensor, torch.Tensor]:
    """device_encode's blob, and the workspace the encoder ran with."""
    flat = x.contiguous().view(torch.int16).reshape(-1).to(device)
    n = flat.numel()
    shape = (ctypes.c_int64 * max(x.dim(), 1))(*x.shape)
    # stale bytes in the workspace and the output must not reach the blob
    ws = torch.full((lib.ep_lossless_encode_workspace_bytes(n, cv, version),), 0xA5, dtype=torch.uint8,
                    device=device)
    out = torch.full((lib.ep_lossless_max_blob_bytes(n, x.dim(), cv, version),), 0x5A, dtype=torch.uint8,
                     device=device)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    rc = lib.ep_lossless_encode_cuda(flat.data_ptr(), n, shape, x.dim(), cv, version, out.data_ptr(),
                                     size.data_ptr(), ws.data_ptr(), ws.numel(), _stream(device))
    assert rc == 0
    _sync(device)
    return out[:int(size.item())].cpu(), ws


def device_decode(lib: ctypes.CDLL, blob: torch.Tensor, n: int, cv: int, device: str,
                  field_chunks: int = 0) -> tuple[int, torch.Tensor]:
    """(status, values [n] int16 on the CPU) of the kernels decoding ``blob`` (CPU uint8), with
    workspace for ``field_chunks`` chunks of format 6's modes 4 and 5."""
    b = blob.to(device) if blob.numel() else torch.zeros(1, dtype=torch.uint8, device=device)
    ws = torch.full((lib.ep_lossless_decode_workspace_bytes(n, cv, field_chunks),), 0xA5, dtype=torch.uint8,
                    device=device)
    # a value the decoder does not write keeps this pattern, not an earlier call's right answer
    y = torch.full((max(n, 1),), 0x5A5A, dtype=torch.int16, device=device)
    status = torch.full((1,), -1, dtype=torch.int32, device=device)
    # the version the caller reads from the header (byte 4; a blob too short to hold it: the newest)
    version = int(blob[4]) if blob.numel() > 4 else lossless.FORMAT_VERSION
    rc = lib.ep_lossless_decode_cuda(b.data_ptr(), blob.numel(), y.data_ptr(), n, cv, field_chunks, version,
                                     status.data_ptr(), ws.data_ptr(), ws.numel(), _stream(device))
    assert rc == 0
    _sync(device)
    return int(status.item()), y[:n].cpu()


def gradient_like(rows: int = 64, seed: int = 5, zero_share: float = 0.5, kept_bits: int = 2,
                  hidden: int = 7168) -> torch.Tensor:
    """[rows, hidden] values like a backward pass's: about `zero_share` of them +0.0, the others of
    float32 products rounded to `kept_bits` + 1 mantissa bits before the bf16 conversion, so that
    most of their 6 low mantissa bits are zero (a gradient summed from few low-precision terms):
    format 6 codes their fields."""
    g = _gen(seed)
    x = torch.randn(rows, hidden, generator=g) * torch.randn(rows, hidden, generator=g) * 1e-3
    m, e = torch.frexp(x)
    scale = float(1 << (kept_bits + 1))
    x = torch.ldexp(torch.round(m * scale) / scale, e)
    x[torch.rand(rows, hidden, generator=g) < zero_share] = 0
    return x.bfloat16()


def chunk_modes(blob: torch.Tensor) -> list[int]:
    """Each chunk's mode, from the blob's directory."""
    layout = blob_layout(blob)
    b = blob.numpy().tobytes()
    return [struct.unpack_from("<I", b, layout["directory"] + 16 * c)[0] & 0xFF for c in range(layout["chunks"])]


def silent_flips(x: torch.Tensor, version: int, chunk_values: int | None = None) -> tuple[int, int, list[int]]:
    """Every bit of x's blob (format ``version``) flipped in turn and the blob decoded on the
    portable path: (the flips that decode to other values without an error, the flips, the blob's
    chunk modes)."""
    blob = lossless.encode(x, version=version, chunk_values=chunk_values)
    b = bytearray(blob.numpy().tobytes())
    want = x.reshape(-1).view(torch.int16)
    silent = 0
    for byte in range(len(b)):
        for bit in range(8):
            b[byte] ^= 1 << bit
            try:
                y = lossless.decode(torch.frombuffer(bytearray(b), dtype=torch.uint8), simd=False)
            except ValueError:  # the flip is caught
                y = None
            silent += y is not None and not torch.equal(y.reshape(-1).view(torch.int16), want)
            b[byte] ^= 1 << bit
    return silent, 8 * len(b), chunk_modes(blob)


def field_chunks(blob: torch.Tensor) -> int:
    """A format 6 blob's chunks with coded fields (modes 4 and 5), which the decoder's workspace
    takes a slot for."""
    return sum(m in (4, 5) for m in chunk_modes(blob))


# format 6 cases: (name, values, chunk_values, the least chunks with coded fields)
V6_CASES = [
    ("message", lambda: gradient_like(16), 65536, 2),
    ("small_chunks", lambda: gradient_like(4, seed=6), 4096, 5),
    ("no_zeros", lambda: gradient_like(2, seed=7, zero_share=0.0), 8192, 2),
    ("tail", lambda: gradient_like(3, seed=8).reshape(-1)[:3 * 7168 - 5], 16384, 1),
    ("one_state", lambda: gradient_like(1, seed=2).reshape(-1)[:5000], 65536, 1),
    ("one_state_small", lambda: gradient_like(1, seed=1).reshape(-1)[:96], 65536, 1),
]


def host_status(blob: torch.Tensor) -> int:
    """The host decoder's status for ``blob`` (0 when it decodes)."""
    try:
        lossless.decode(blob)
    except ValueError as error:
        return MESSAGES.index(str(error).split(": ", 1)[1])
    return 0


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16).reshape(-1)


def from_bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sparse_activations() -> torch.Tensor:
    x = torch.randn(96, 384, generator=_gen(2)).bfloat16()
    return torch.where(torch.rand(96, 384, generator=_gen(3)) < 0.4, torch.zeros_like(x), torch.relu(x))


def _wide_exponents() -> torch.Tensor:
    """Random signs and mantissas, exponents uniform over 128 values: about 9 coded bits per
    value, so a 32-lane step consumes about 18 words (real tensors: about 5), the stress case of
    the decoder's stream windows; still compressible, so its chunks are rANS-coded."""
    n = 40000
    sign = torch.randint(0, 2, (n,), generator=_gen(12)) << 15
    exponent = torch.randint(64, 192, (n,), generator=_gen(13)) << 7
    mantissa = torch.randint(0, 128, (n,), generator=_gen(14))
    return from_bits(sign | exponent | mantissa)


def _heavy_tails() -> torch.Tensor:
    """Normal values scaled by log-normal factors: a wide spread of exponents with many rare
    symbols, where format version 3 takes 12-bit frequencies for large chunks."""
    return (torch.randn(60000, generator=_gen(15)) * torch.exp(torch.randn(60000, generator=_gen(16)) * 1.5)).bfloat16()


def many_chunks(chunks: int = 1100, chunk_values: int = 96) -> torch.Tensor:
    """``chunks`` chunks of ``chunk_values`` values (the last one 7 values short): rANS-coded
    (sparse small values), raw (random bits) and +0.0 chunks in random order, so the encoder's
    look-back over the chunks crosses blocks on chunks of every payload size."""
    g = _gen(21)
    n = chunks * chunk_values - 7
    x = (torch.randn(n, generator=g) * 0.05).bfloat16()
    x = torch.where(torch.rand(n, generator=g) < 0.8, torch.zeros_like(x), x)
    kind = torch.randint(0, 4, (n // chunk_values + 1,), generator=g).repeat_interleave(chunk_values)[:n]
    x = torch.where(kind == 1, from_bits(torch.randint(0, 65536, (n,), generator=g)), x)
    return torch.where(kind == 2, torch.zeros_like(x), x)


CASES = {
    "normal": lambda: torch.randn(70, 1000, generator=_gen(1)).bfloat16(),
    "heavy_tails": _heavy_tails,
    "sparse": _sparse_activations,
    "wide_exponents": _wide_exponents,
    "all_patterns": lambda: from_bits(torch.arange(65536)).reshape(256, 256),
    "shuffled_patterns": lambda: from_bits(torch.randperm(65536, generator=_gen(4))),
    "zeros": lambda: torch.zeros(5000, dtype=torch.bfloat16),
    "random_bits": lambda: from_bits(torch.randint(0, 65536, (20000,), generator=_gen(5))),
    "mixed": lambda: torch.cat([from_bits(torch.randint(0, 65536, (4096,), generator=_gen(6))),
                                torch.zeros(4096, dtype=torch.bfloat16),
                                torch.randn(8192, generator=_gen(7)).bfloat16()]),
    "n0": lambda: torch.empty(0, dtype=torch.bfloat16),
    "n0_2d": lambda: torch.empty(0, 7168, dtype=torch.bfloat16),
    "scalar": lambda: torch.tensor(1.5).bfloat16(),
    "n1": lambda: torch.randn(1, generator=_gen(8)).bfloat16(),
    "n31": lambda: torch.randn(31, generator=_gen(9)).bfloat16(),
    "n33": lambda: torch.randn(33, generator=_gen(10)).bfloat16(),
    # one chunk of at most 4,096 values: one rANS state (format version 4) when it is the only chunk
    "one_state": lambda: torch.where(torch.rand(3000, generator=_gen(17)) < 0.2, torch.zeros(()),
                                     torch.randn(3000, generator=_gen(18)) * 0.02).bfloat16(),
    "bias": lambda: (torch.randn(384, generator=_gen(19)) * 0.01).bfloat16(),
    # 1,100 chunks of 96 values (3,300 of 32): the encoder's look-back across many blocks
    "many_chunks": many_chunks,
}
CHUNK_VALUES = [32, 96, 4096, lossless.DEFAULT_CHUNK_VALUES]


def mixed_rows(rows: int = 16, width: int = 7168, seed: int = 3, group: int = 2) -> torch.Tensor:
    """A [rows, width] message whose groups of ``group`` rows have very different statistics (scales
    from 1e-6 to 1e4, ReLU outputs, sparse rows; what an EP message gathering tokens of different
    layers or experts looks like at its worst): in format version 5 most of its chunks take a
    frequency table of their own."""
    g = _gen(seed)
    groups = []
    for k in range(rows // group):
        x = torch.randn(group, width, generator=g) * [1e-3, 1.0, 100.0, 1e-6, 1.0, 1e4, 3.0, 1e-2][k % 8]
        if k % 4 == 1:
            x = torch.relu(x)
        if k % 4 == 2:
            x[torch.rand(group, width, generator=g) < 0.7] = 0
        groups.append(x)
    return torch.cat(groups).bfloat16()


def many_tables(chunks: int = 320, chunk_values: int = 4096) -> torch.Tensor:
    """``chunks`` chunks of ``chunk_values`` values at 16 scales from 1e-8 to 1e7: in format version 5
    every chunk gains from a table of its own, so 255 take one (the format's limit)."""
    scales = torch.tensor([10.0 ** (k % 16 - 8) for k in range(chunks)]).repeat_interleave(chunk_values)
    return (torch.randn(chunks * chunk_values, generator=_gen(31)) * scales).bfloat16()


# format version 5's cases beside CASES (messages whose chunks mostly take their own tables)
V5_CASES = {"mixed_rows": mixed_rows, "mixed_rows_tail": lambda: mixed_rows(15, 7000, 5)}
# (case, chunk values, extra tables: 0 for none, else at least this many) of the version 5 decodes
V5_DECODE_CASES = [("mixed_rows", 14336, 4), ("mixed_rows", 4096, 4), ("mixed_rows_tail", 7168, 4),
                   ("normal", 4096, 0), ("sparse", 1024, 0), ("mixed", 4096, 1), ("one_state", 4096, 0),
                   ("zeros", 64, 0), ("n33", 32, 0), ("random_bits", 4096, 0)]
# (case, chunk values) of the corruption checks
CORRUPTION_CASES = [("sparse", 1024), ("mixed", 4096), ("normal", 4096), ("zeros", 64), ("n33", 32),
                    ("wide_exponents", 4096), ("heavy_tails", 65536), ("one_state", 4096), ("bias", 4096)]


def check_blob_is_byte_identical_and_decodes_tensor(lib: ctypes.CDLL, device: str, x: torch.Tensor,
                                                    chunk_values: int,
                                                    version: int = lossless.FORMAT_VERSION) -> torch.Tensor:
    """The kernels' blob of ``x`` (bf16) in format ``version`` is the host encoder's, and they
    decode it exactly; returns the blob."""
    host = lossless.encode(x, chunk_values=chunk_values, version=version)
    dev = device_encode(lib, x, chunk_values, device, version=version)
    assert dev.numel() == host.numel() and torch.equal(dev, host)
    status, y = device_decode(lib, dev, x.numel(), chunk_values, device, field_chunks(dev) if version >= 6 else 0)
    assert status == 0 and torch.equal(y, bits(x))
    return host


def check_blob_is_byte_identical_and_decodes(lib: ctypes.CDLL, device: str, case: str, chunk_values: int) -> None:
    """The kernels' blob of CASES[case] is the host encoder's, and they decode it exactly."""
    x = CASES[case]()
    host = check_blob_is_byte_identical_and_decodes_tensor(lib, device, x, chunk_values)
    if case == "random_bits":  # every chunk raw: no table, as on the host
        assert host[6] == 0 and host[7] == 0
    if case == "wide_exponents" and chunk_values >= 4096:  # rANS-coded chunks, as the case means
        assert host.numel() < 2 * x.numel()
    # format version 3 and 4's two table widths are both exercised: 12-bit frequencies where they pay
    # (many rare symbols in few chunks), 11-bit ones where the margin per chunk exceeds the gain
    if (case == "heavy_tails" and chunk_values >= 65536) or (case == "mixed" and chunk_values >= 4096):
        assert prob_bits(host) == 12
    if case in ("heavy_tails", "normal") and chunk_values == 32:
        assert prob_bits(host) == 11


def blob_layout(blob: torch.Tensor) -> dict[str, int]:
    """A blob's header fields, read by the format's definition (csrc/codec/lossless_core.h):
    version, ndim, entries, chunk_values, chunks, num_values, prob_bits, table_at (the table's
    offset), table_bytes (before padding), directory (the directory's offset). Versions 2 and 3:
    a 32-byte header and u64 dimensions; version 4: 20 bytes and LEB128 dimensions, the value and
    chunk counts derived from the shape."""
    b = blob.numpy().tobytes()
    version, ndim = b[4], b[5]
    out = {"version": version, "ndim": ndim, "entries": struct.unpack_from("<H", b, 6)[0],
           "chunk_values": struct.unpack_from("<I", b, 8)[0]}
    if version >= 4:  # (version 5: table_bytes covers the extra tables too)
        at, count = 20, 1
        for _ in range(ndim):
            dim, shift = 0, 0
            while True:
                byte = b[at]
                at += 1
                dim |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            count *= dim
        last = 16
        out["num_values"], out["chunks"] = count, -(-count // out["chunk_values"])
    else:
        at, last = 32 + 8 * ndim, 28
        out["chunks"], out["num_values"] = struct.unpack_from("<IQ", b, 12)
    out["prob_bits"] = b[last] if version >= 3 else 11
    out["table_bytes"] = struct.unpack_from("<H", b, last + 2)[0] if version >= 3 else 4 * out["entries"]
    out["table_at"] = at
    out["directory"] = (at + out["table_bytes"] + 3) // 4 * 4
    return out


def read_table_v4(b: bytes, start: int, limit: int, entries: int | None, prob_bits: int) -> tuple[dict[int, int], int]:
    """(symbol -> frequency, bytes used) of a table in version 4's encoding at ``b[start:limit]``,
    read by the format's definition: a byte kg | kf << 4, then per entry the gap in order-kg and
    freq - 1 in order-kf Exp-Golomb codes (m zero bits, a one, m bits, k bits; stream bits low
    first), zero bits to the end of its last byte. ``entries`` entries, or (None, version 5's
    extra tables) entries until the frequencies sum to 2^prob_bits."""
    kg, kf = b[start] & 15, b[start] >> 4
    stream = int.from_bytes(b[start + 1:limit], "little")
    pos = 0

    def take(n: int) -> int:
        nonlocal pos
        v = (stream >> pos) & ((1 << n) - 1)
        pos += n
        return v

    def code(k: int) -> int:
        m = 0
        while take(1) == 0:
            m += 1
        return (((1 << m) | take(m)) - 1 << k) | take(k)

    symbol, freqs = -1, {}
    while (len(freqs) < entries) if entries is not None else (sum(freqs.values()) < 1 << prob_bits):
        symbol += code(kg) + 1
        freqs[symbol] = code(kf) + 1
    used = 1 + (pos + 7) // 8
    assert (stream >> pos) & ((1 << (8 * (used - 1) - pos)) - 1) == 0  # zero bits to the byte's end
    return freqs, used


def prob_bits(blob: torch.Tensor) -> int:
    """The probability bits of a blob's table (11 for version 2)."""
    return blob_layout(blob)["prob_bits"]


def table_bytes(blob: torch.Tensor) -> int:
    """Bytes of a blob's frequency table before its padding (any format version)."""
    return blob_layout(blob)["table_bytes"]


def _chunk_layout(blob: torch.Tensor, num_values: int) -> tuple[int, list[tuple[int, ...]], list[int]]:
    """Directory offset, entries (mode, num_words, num_raw, checksum) and payload offsets."""
    b = blob.numpy().tobytes()
    layout = blob_layout(blob)
    cv, chunks, directory = layout["chunk_values"], layout["chunks"], layout["directory"]
    # (version 5: bits 8-15 of the mode word are the chunk's table)
    ents = [(mode & 0xFF, *rest) for mode, *rest in (struct.unpack_from("<4I", b, directory + 16 * c)
                                                   for c in range(chunks))]
    offsets = [directory + 16 * chunks]
    for c, (mode, nw, nr, _) in enumerate(ents):
        n = min(cv, num_values - c * cv)
        if mode in FIELD_STATE_BYTES:  # two state blocks, then num_words words (the field header's on)
            used = 2 * FIELD_STATE_BYTES[mode] + 2 * nw
        else:
            used = 2 * n if mode == 1 else 0 if mode == 3 else STATE_BYTES[mode] + 2 * nw + (6 * nr + 7) // 8
        offsets.append(offsets[-1] + (used + 3) // 4 * 4)
    return directory, ents, offsets


STATE_BYTES = {0: 128, 2: 4}  # a chunk's final states by mode (32 states, or one in format version 4)
FIELD_STATE_BYTES = {4: 128, 5: 4}  # format 6's coded-field modes: each of their two state blocks


def _corrupt(blob: torch.Tensor, num_values: int, gen: torch.Generator, chunks: int) -> torch.Tensor:
    b = blob.clone()
    directory, ents, offsets = _chunk_layout(blob, num_values)

    def rand(hi: int) -> int:
        return int(torch.randint(0, max(hi, 1), (1,), generator=gen))

    for c in sorted({rand(len(ents)) for _ in range(chunks)}):
        mode, nw, nr, _ = ents[c]
        kind = rand(5) if offsets[c + 1] > offsets[c] else 4  # a +0.0 chunk has no payload
        if kind == 0:  # a payload bit
            b[offsets[c] + rand(offsets[c + 1] - offsets[c])] ^= 1 << rand(8)
        elif kind == 1 and mode in STATE_BYTES and nr * 6 % 8:  # an unused bit of the last raw byte
            b[offsets[c] + STATE_BYTES[mode] + 2 * nw + nr * 6 // 8] |= 0x80
        elif kind == 2:  # the padding (or the last payload byte)
            b[offsets[c + 1] - 1] ^= 0x01
        elif kind == 3 and mode in STATE_BYTES:  # a rANS state
            b[offsets[c] + 4 * rand(STATE_BYTES[mode] // 4) + rand(4)] ^= 1 << rand(8)
        elif kind == 3 and mode in FIELD_STATE_BYTES:  # a state of either stream
            b[offsets[c] + 4 * rand(2 * FIELD_STATE_BYTES[mode] // 4) + rand(4)] ^= 1 << rand(8)
        else:  # a directory field
            b[directory + 16 * c + rand(16)] ^= 1 << rand(3)
    return b


def _field_slots(blob: torch.Tensor, n: int, chunk_values: int) -> int:
    """The decoder workspace's slots for a (maybe corrupted) blob: one for each directory entry of
    mode 4 or 5 (coded fields), at most one a chunk; none where the directory cannot be read. So
    the kernels check what the host checks, not a missing slot."""
    try:
        count = field_chunks(blob)
    except (struct.error, IndexError, ValueError, RuntimeError, ZeroDivisionError):
        return 0
    return min(count, -(-n // chunk_values))


def check_rejects_corrupted_blobs_like_the_host(lib: ctypes.CDLL, device: str, case: str, chunk_values: int,
                                                trials: int = 120, version: int = lossless.FORMAT_VERSION) -> None:
    """Corrupted and truncated blobs of CASES[case] (or V5_CASES[case]) in format ``version``: the
    kernels report the host decoder's status (and decode exactly the blobs the host accepts)."""
    x = {**CASES, **V5_CASES, **{name: make for name, make, _, _ in V6_CASES}}[case]()
    n = x.numel()
    blob = lossless.encode(x, chunk_values=chunk_values, version=version)
    gen = _gen(11)
    seen = set()
    table_at, table_size = blob_layout(blob)["table_at"], table_bytes(blob)
    for trial in range(trials):
        if trial % 10 == 9:
            bad = blob[:int(torch.randint(0, blob.numel(), (1,), generator=gen))].clone()  # truncated
        elif trial % 10 == 8:
            bad = blob.clone()
            bad[int(torch.randint(0, min(blob.numel(), 64), (1,), generator=gen))] ^= 0x10  # metadata
        elif trial % 10 == 7 and table_size:
            bad = blob.clone()  # a bit of the frequency table
            bad[table_at + int(torch.randint(0, table_size, (1,), generator=gen))] ^= 1 << int(
                torch.randint(0, 8, (1,), generator=gen))
        else:
            bad = _corrupt(blob, n, gen, chunks=1 + trial % 2)  # one or two chunks
        want = host_status(bad)
        status, y = device_decode(lib, bad, n, chunk_values, device, _field_slots(bad, n, chunk_values))
        assert status == want, f"trial {trial}: device {MESSAGES[status]!r}, host {MESSAGES[want]!r}"
        if want == 0:
            assert torch.equal(y, bits(x))
        seen.add(want)
    assert len(seen - {0}) >= 3, seen
