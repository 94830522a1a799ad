"""Lossless codec: bit-exact BF16 compression for EP payloads.

Each BF16 value is split into a 10-bit symbol (sign, 8-bit exponent and the first mantissa bit;
+0.0 is a symbol of its own, so zero runs cost almost nothing), entropy-coded with rANS from a
frequency table shared by the blob's chunks (bit-coded, 11- or 12-bit probabilities, whichever
codes the blob smaller), and its 6 low mantissa bits, stored raw (packed) or, where they carry
little information (gradients), entropy-coded as a second rANS stream. Values are coded in
independent chunks (one CPU task, one GPU warp each). Format version 7, the default on the host
and the GPU: a chunk may carry a table of its own where that pays (messages that join values of
different statistics) and code its low mantissa bits where that pays; a blob's only chunk of up
to a quarter of ``chunk_values`` (4,096 to 16,384 values) is coded with one rANS state (and 6 to
12 probability bits); a chunk of +0.0 only takes no payload; each chunk's checksum mixes its
values in pairs. Versions 2 to 6 still decode and are written on request. The blob is
self-describing: magic, version, shape, tables, per-chunk sizes and checksums; ``decode``
validates every field before use and raises ``ValueError`` on a truncated or corrupted blob. The
format is documented in ``csrc/codec/lossless_core.h``.

Why this split, rANS and one table per blob (measured by bench/codec_bench.py on real
activations, weights and gradients): the sign and the first mantissa bit depend on the exponent
in activations, so coding them with it takes about 6% off activations (the exponent-only split is
2.9% worse than zipnn there, this one 3% better) and costs nothing elsewhere; rANS lands within
0.2% of the symbols' order-0 entropy, while a fixed-rate code with escapes costs 4-13% more;
one table per blob (per destination message on the dispatch path) amortises the table over
>= 64 tokens, a chunk takes its own only where that saves more than the table costs, and a blob
whose chunks are all stored raw carries no table.
"""
from __future__ import annotations

import bisect
import itertools
import operator

import torch

from . import lossless_device

try:
    from ep_comm import _host
except ImportError:  # pragma: no cover - the host build is part of every install
    _host = None

# The most values per chunk that default_chunk_values gives (encode's chunking when none is asked).
DEFAULT_CHUNK_VALUES = 65536
# Chunk size for messages coded on a GPU (the dispatch/combine path, codec="auto"'s measurement).
# One warp codes a chunk, sequentially, so a message with fewer chunks than one wave of warps
# takes as long to decode as a full wave of chunks of that size, whatever the message's size;
# smaller chunks should shorten that time in proportion (not yet measured), for a few more bytes
# per blob. docs/gpu.md has the measured wave time and byte cost; bench/codec_device_api.py sweeps
# the chunk size.
DEVICE_MESSAGE_CHUNK_VALUES = 8192
MIN_CHUNK_VALUES = 32
MAX_CHUNK_VALUES = 1 << 24
MAX_DIMENSION = 1 << 48
MAX_DIMS = 8
# The blob format encode writes, and the ones decode reads (csrc/codec/lossless_core.h): version 7
# (a chunk may carry its own frequency table, its raw fields, the 6 low mantissa bits, are
# entropy-coded where that pays: gradients'; each chunk's checksum mixes its values in pairs before
# a weighted sum, so no fixed pattern of changes cancels in it, as (-d, +d, +d, -d) on values 2
# apart does in version 6's weighted sum of the values), written by the host and the CUDA encoders
# alike; versions 2 to 6 are written on
# request, and the host and CUDA decoders read 2 to 7. A version 7 blob has version 6's size and
# layout; a version 6 blob is never larger than version 5's.
FORMAT_VERSION = 7
FORMAT_VERSIONS = (2, 3, 4, 5, 6, 7)


def _is_shape(shape: object) -> bool:
    """A tuple/list/Size of ints in [0, MAX_DIMENSION] (what a blob header can hold)."""
    return isinstance(shape, (tuple, list, torch.Size)) and all(
        isinstance(d, int) and 0 <= d <= MAX_DIMENSION for d in shape)


def _lib():
    if _host is None:
        raise RuntimeError("ep_comm._host is not built: run `python setup.py build_ext --inplace`")
    return _host


SIMD_PATHS = ("portable", "avx2", "avx512")
"""The host coder's paths, by level: the portable C++ core, AVX2 (encoder and decoder), AVX-512
(F, BW, VL, VBMI, VBMI2: the decoder, two chunks at a time, and the encoder's rANS pass; its
histogram and raw-field passes are the AVX2 ones). Every path gives the same bytes."""


def simd_paths() -> list[str]:
    """The host coder's paths this CPU runs, lowest first (e.g. ``["portable", "avx2"]``)."""
    return list(SIMD_PATHS[: _lib().lossless_simd_available() + 1])


def _check_simd(simd: object) -> None:
    """ValueError naming ``simd`` unless it is a truth value (bool, NumPy bool, 0 or 1) or a name
    from ``SIMD_PATHS``; checked on every device (the GPU path ignores it)."""
    numpy_bool = type(simd).__module__ == "numpy" and type(simd).__name__ in ("bool", "bool_")
    truth = (isinstance(simd, int) or numpy_bool) and simd in (0, 1)
    if not truth and not (isinstance(simd, str) and simd in SIMD_PATHS):
        raise ValueError(f"simd must be True, False or one of {SIMD_PATHS}, got {simd!r}")


def _check_threads(threads: object) -> None:
    """ValueError naming ``threads`` unless it is an int in [0, 2**31) (0 = every hardware
    thread); checked on every device (the GPU path ignores it)."""
    try:
        value = operator.index(threads)  # type: ignore[arg-type]
    except TypeError:
        value = -1
    if isinstance(threads, bool) or not 0 <= value < 1 << 31:
        raise ValueError(f"threads must be an int in [0, 2**31) (0 = every hardware thread), got {threads!r}")


def _check_version(version: object) -> int:
    """``version`` as an int, or ValueError naming it unless it is one of FORMAT_VERSIONS (an int:
    5.0 is refused)."""
    try:
        value = operator.index(version)  # type: ignore[arg-type]
    except TypeError:
        value = -1
    if isinstance(version, bool) or value not in FORMAT_VERSIONS:
        raise ValueError(f"version must be one of {FORMAT_VERSIONS}, got {version!r}")
    return value


def _simd_level(simd: bool | str) -> int:
    """``simd`` argument -> the host coder's C++ level: true = the best the CPU has, false = the
    portable core, a name from ``SIMD_PATHS`` = that path (ValueError if this CPU lacks it)."""
    _check_simd(simd)
    if not isinstance(simd, str):
        return len(SIMD_PATHS) - 1 if simd else 0
    if simd not in simd_paths():
        raise ValueError(f"simd={simd!r}: this CPU runs only {simd_paths()}")
    return SIMD_PATHS.index(simd)


def encode(x: torch.Tensor, *, chunk_values: int | None = None, threads: int = 0,
           simd: bool | str = True, version: int = FORMAT_VERSION) -> torch.Tensor:
    """Compresses ``x`` (bfloat16, any shape, any device) into a blob.

    Args:
        x: bf16 tensor of any shape; not modified.
        chunk_values: values per independently coded chunk (multiple of 32 in [32, 2**24]);
            None: :func:`default_chunk_values` of ``x.numel()``.
        threads: CPU threads (0 = every hardware thread); ignored on the GPU.
        simd: True: the fastest path this CPU has; False: the portable core; or a path of
            :func:`simd_paths` by name. The bytes are the same on every path.
        version: the blob format, ``FORMAT_VERSION`` (7: version 6 with a checksum that mixes
            each pair of values, in which no fixed pattern of changes cancels); 6 (version 5
            where a chunk's 6 low mantissa bits are entropy-coded too where that pays:
            gradients); 5 (a chunk may carry a frequency table of its own, which shrinks
            messages that join values of different statistics); or 4, 3 or 2 (the older
            formats, for comparisons). Versions 4 to 7 are coded by the CUDA kernels on a GPU; 3
            and 2 always on the CPU, the blob then moved to ``x``'s device (every version
            decodes on either).

    Returns:
        1-D uint8 tensor, self-describing (``decode`` needs nothing else): on ``x``'s GPU when
        ``x`` is a CUDA tensor and ``ep_comm._cuda`` is built (coded there by the CUDA kernels),
        else on the CPU. The bytes are the same either way.
    """
    _check_input(x, "x")
    chunk_values = _chunk_values(chunk_values, x.numel())
    _check_simd(simd)
    _check_threads(threads)
    version = _check_version(version)
    if version in lossless_device.ENCODE_VERSIONS and lossless_device.available(x.device):
        return lossless_device.encode(x, chunk_values, version)
    blob = _encode_host(x, chunk_values, threads, _simd_level(simd), version)
    return blob if x.is_cpu else blob.to(x.device)


def encode_many(xs: list[torch.Tensor], *, chunk_values: int | None = None, threads: int = 0,
                simd: bool | str = True, version: int = FORMAT_VERSION) -> list[torch.Tensor]:
    """Blobs of several tensors (e.g. one message per destination rank), each as :func:`encode`
    would code it. Tensors on one GPU are coded there one after another with one
    synchronisation for all (their blobs are views into one buffer; with ``chunk_values=None``,
    one synchronisation per distinct default chunk size); others one by one.

    Args:
        xs: bf16 tensors of any shapes; not modified.
        chunk_values, threads, simd, version: as in :func:`encode` (None: each tensor's default).

    Returns:
        One 1-D uint8 blob per tensor, in order.
    """
    if not isinstance(xs, (list, tuple)):
        raise ValueError(f"xs must be a list of tensors, got {type(xs).__name__}")
    for i, x in enumerate(xs):
        _check_input(x, f"xs[{i}]")
    sizes = [_chunk_values(chunk_values, x.numel()) for x in xs]
    _check_simd(simd)
    _check_threads(threads)
    version = _check_version(version)
    if (xs and len({x.device for x in xs}) == 1 and version in lossless_device.ENCODE_VERSIONS
            and lossless_device.available(xs[0].device)):
        blobs: list[torch.Tensor | None] = [None] * len(xs)
        for size in dict.fromkeys(sizes):  # one device call per distinct chunk size
            picked = [i for i, s in enumerate(sizes) if s == size]
            for i, blob in zip(picked, lossless_device.encode_many([xs[i] for i in picked], size, version)):
                blobs[i] = blob
        return blobs  # type: ignore[return-value]
    return [encode(x, chunk_values=size, threads=threads, simd=simd, version=version) for x, size in zip(xs, sizes)]


def _check_input(x: object, name: str) -> None:
    """ValueError naming ``name`` unless ``x`` is a bf16 tensor a blob can describe."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a bfloat16 tensor, got {got}")
    _check_has_data(x, name)
    if x.dim() > MAX_DIMS:
        raise ValueError(f"{name} has {x.dim()} dimensions; blobs hold at most {MAX_DIMS}")
    if any(d > MAX_DIMENSION for d in x.shape):
        raise ValueError(f"{name} has a dimension above 2**48 (shape {tuple(x.shape)}), which blobs cannot describe")


def _check_has_data(x: torch.Tensor, name: str) -> None:
    """ValueError naming ``name`` unless ``x`` is a dense (strided) tensor with memory (not on the
    meta device)."""
    if x.layout != torch.strided or x.device.type == "meta":
        raise ValueError(f"{name} must be a dense tensor with data, got layout {x.layout} on {x.device}")


def _host_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as a contiguous, aligned CPU tensor whose memory holds them as they read
    (``x`` itself when it is one; a copy of a negative view, of a tensor at an address that is not
    a multiple of its item size, e.g. from ``torch.frombuffer`` at an odd offset, or of a
    non-contiguous one). The host coder reads and writes tensors through their data pointers
    (``data_ptr()``, ``numel()``): a NumPy view of each cost 3-5 us per call. Callers keep the
    returned tensor alive until the call returns."""
    if not x.is_cpu:
        x = x.cpu()
    if x.is_neg():
        x = x.resolve_neg()
    if not x.is_contiguous():
        x = x.contiguous()
    return x.clone() if x.data_ptr() % x.element_size() else x


def _encode_host(x: torch.Tensor, chunk_values: int, threads: int, simd: int,
                 version: int = FORMAT_VERSION) -> torch.Tensor:
    x = _host_contiguous(x)
    return torch.from_numpy(_lib().lossless_encode(x.data_ptr(), x.numel(), list(x.shape), chunk_values, threads, simd,
                                                   version))


def message_threads() -> int:
    """CPU threads the transport codes its messages with on the host: ``torch.get_num_threads()``,
    the intra-op thread budget of this process (torchrun and ep-bench set it per rank), not every
    hardware thread, so that ranks sharing a host do not oversubscribe it (2 ranks on 2 cores,
    ep-bench's normal lossless dispatch+combine, 5 alternating pairs of runs: 25.9-28.5 ms with 1
    codec thread per rank, 28.5-34.0 ms with 2)."""
    return max(1, torch.get_num_threads())


def message_chunk_values(device: torch.device | str) -> int | None:
    """Chunk size the transport codes a message on ``device`` with: DEVICE_MESSAGE_CHUNK_VALUES
    where the CUDA kernels code it, else None (:func:`default_chunk_values` of each message's
    size: on the CPU, a chunk is a task)."""
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as error:
        raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from error
    return DEVICE_MESSAGE_CHUNK_VALUES if lossless_device.available(device) else None


def default_chunk_values(num_values: int) -> int:
    """The chunk size :func:`encode` uses for ``num_values`` values when none is given:
    DEFAULT_CHUNK_VALUES up to that many values (one chunk; from format 5 on, a chunk of up to 16,384
    values then takes one rANS state, the smallest blob, decoded serially); above it the fewest
    chunks of at most DEFAULT_CHUNK_VALUES, an even number (the AVX-512 coders take chunks two at a
    time, in lockstep: a 64x7168 message as 8 chunks instead of 7 decoded in 0.91-0.96x the time on
    1 thread, for 144 more bytes), of equal sizes rounded up to a multiple of 32 (above about 2^27
    values, 32 values less per chunk, as many times as keeps the count even)."""
    try:
        count = operator.index(num_values)
    except TypeError:
        count = -1
    if count < 0:
        raise ValueError(f"num_values must be a non-negative int, got {num_values!r}")
    num_values = count
    chunks = max(1, -(-num_values // DEFAULT_CHUNK_VALUES))
    if chunks == 1:
        return DEFAULT_CHUNK_VALUES
    if chunks % 2:
        chunks += 1
    per_chunk = -(-num_values // chunks)
    size = min(DEFAULT_CHUNK_VALUES, max(MIN_CHUNK_VALUES, -(-per_chunk // 32) * 32))
    # rounding up to 32 can leave an odd count (first from about 2^27 values): 32 fewer values per
    # chunk until it is even (bounded: an odd count costs speed, never correctness)
    for _ in range(64):
        made = -(-num_values // size)
        if made <= 1 or made % 2 == 0 or size == MIN_CHUNK_VALUES:
            break
        size -= 32
    return size


def _chunk_values(chunk_values: object, num_values: int) -> int:
    """``chunk_values`` as an int (default_chunk_values(num_values) for None), or ValueError unless
    it is a multiple of 32 in [32, 2**24]."""
    if chunk_values is None:
        return default_chunk_values(num_values)
    try:
        value = operator.index(chunk_values)  # type: ignore[arg-type]
    except TypeError:
        value = -1
    if not MIN_CHUNK_VALUES <= value <= MAX_CHUNK_VALUES or value % 32:
        raise ValueError(f"chunk_values must be a multiple of 32 in [32, 2^24], got {chunk_values!r}")
    return value


def encode_rows(x: torch.Tensor, **kwargs: int) -> torch.Tensor:
    """``x [n, H]`` bf16 (the rows of one message) -> 1-D uint8 blob; same as ``encode``."""
    if isinstance(x, torch.Tensor) and x.dim() != 2:
        raise ValueError(f"x must be [n, H], got shape {tuple(x.shape)}")
    return encode(x, **kwargs)


def _check_blob(blob: torch.Tensor) -> None:
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
        raise ValueError("blob must be a 1-D uint8 tensor")
    _check_has_data(blob, "blob")


def _host_blob(blob: torch.Tensor) -> torch.Tensor:
    """``blob`` (checked) as a contiguous CPU tensor, for the host decoder's data pointer."""
    _check_blob(blob)
    return _host_contiguous(blob)


def _check_out(out: object, name: str) -> None:
    """ValueError naming ``name`` unless ``out`` is a contiguous bf16 tensor without grad."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 \
            or not out.is_contiguous() or out.requires_grad:
        got = (f"{out.dtype} on {out.device}, contiguous={out.is_contiguous()}, requires_grad={out.requires_grad}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"{name} must be a contiguous bfloat16 tensor that does not require grad, got {got}")
    _check_has_data(out, name)


def _check_apart(blobs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """ValueError unless every ``out`` (contiguous bf16) shares no memory with any blob (decoding
    into one would overwrite a blob before it is read): the blobs' byte ranges sorted by start,
    each out's range against the largest end among the blobs starting before it ends."""
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel(), i, b.device) for i, b in enumerate(blobs) if b.numel())
    if not spans:
        return
    starts = [start for start, _, _, _ in spans]
    reach = list(itertools.accumulate((end for _, end, _, _ in spans), max))
    for k, out in enumerate(outs):
        if out.numel() == 0:
            continue
        first, last = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        before = bisect.bisect_left(starts, last)  # blobs starting before this out ends
        if before and reach[before - 1] > first:
            hit = next((i for _, end, i, device in spans[:before] if end > first and device == out.device), None)
            if hit is not None:
                name = "out" if len(outs) == 1 else f"outs[{k}]"
                blob = "blob" if len(blobs) == 1 else f"blobs[{hit}]"
                raise ValueError(f"{name} overlaps {blob} in memory: decode into a tensor that shares no "
                                 f"memory with the blobs")


def _check_shape(shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    """The ValueError of the host decoder for a blob of another shape than expected."""
    if tuple(shape) != tuple(expected):
        raise ValueError(f"blob holds a tensor of shape {tuple(shape)}, expected {tuple(expected)}")


def shape_of(blob: torch.Tensor) -> tuple[int, ...]:
    """The shape of the tensor a blob (1-D uint8) holds; ``ValueError`` if its header is bad."""
    blob = _host_blob(blob)
    return tuple(_lib().lossless_shape(blob.data_ptr(), blob.numel()))


def decode(blob: torch.Tensor, *, threads: int = 0, simd: bool | str = True,
           expected_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """Decompresses a blob from ``encode``.

    Args:
        blob: 1-D uint8 tensor; not modified.
        threads: CPU threads (0 = every hardware thread); ignored on the GPU.
        simd: True: the fastest path this CPU has; False: the portable core; or a path of
            :func:`simd_paths` by name. The result is the same on every path.
        expected_shape: when given, a blob declaring another shape is rejected before anything is
            allocated. Receivers should pass it: runs of +0.0 legitimately compress about
            100,000-fold, so a small valid blob can declare a very large tensor.

    Returns:
        bf16 tensor of the encoded shape, bit-identical to the encoded tensor: on the blob's GPU
        when the blob is a CUDA tensor and ``ep_comm._cuda`` is built, else on the CPU.

    Raises:
        ValueError: the blob is truncated, corrupted or not a lossless blob.
    """
    _check_blob(blob)
    _check_simd(simd)
    _check_threads(threads)
    if expected_shape is not None:
        if not _is_shape(expected_shape):
            raise ValueError(f"expected_shape must be a tuple of ints in [0, 2**48], got {expected_shape!r}")
        expected_shape = list(expected_shape)
    if lossless_device.available(blob.device):
        blob = blob.detach().contiguous()
        layout = lossless_device.layouts([blob])[0]
        if expected_shape is not None:
            _check_shape(layout.shape, tuple(expected_shape))
        out = torch.empty(layout.shape, dtype=torch.bfloat16, device=blob.device)
        lossless_device.decode_into(blob, out, layout)
        return out
    blob = _host_blob(blob)
    # one C++ call: parse, check the shape, allocate, decode; int16 bit patterns in the blob's shape
    values = _lib().lossless_decode(blob.data_ptr(), blob.numel(), threads, _simd_level(simd), expected_shape)
    return torch.from_numpy(values).view(torch.bfloat16)


def empty(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised bfloat16 CPU tensor of ``shape`` for :func:`decode_into`, in the memory
    ``decode`` uses: from 256 KiB its own mapping (reused after it is freed, see
    :func:`cached_output_bytes`), from 2 MiB with transparent huge pages requested (first-touch
    faults of 4 KiB pages cost about as much as decoding them). Uninitialised means it may hold
    the old contents of a freed codec array of this process."""
    if not _is_shape(shape):
        raise ValueError(f"shape must be a tuple of ints in [0, 2**48], got {shape!r}")
    count = 1
    for d in shape:
        count *= d
    values = _lib().lossless_empty_u16(count)
    return torch.from_numpy(values.view("int16")).view(torch.bfloat16).reshape(tuple(shape))


def decode_into(blob: torch.Tensor, out: torch.Tensor, *, threads: int = 0,
                simd: bool | str = True) -> torch.Tensor:
    """Decompresses a blob from ``encode`` into ``out`` (no allocation, no copy).

    Args:
        blob: 1-D uint8 tensor; not modified.
        out: contiguous bfloat16 tensor of the blob's shape (a blob of another shape is rejected
            before anything is written); e.g. a slice of rows of a receive buffer. A CUDA ``out``
            is decoded on its GPU when ``ep_comm._cuda`` is built (the blob moved there if it is
            elsewhere), else on the CPU and copied.
        threads, simd: as in :func:`decode`.

    Returns:
        ``out``, bit-identical to the encoded tensor.

    Raises:
        ValueError: ``out`` is not a contiguous bf16 tensor; the blob holds another shape, is
            truncated, corrupted or not a lossless blob (``out``'s contents are then unspecified).
    """
    _check_out(out, "out")
    _check_blob(blob)
    _check_simd(simd)
    _check_threads(threads)
    _check_apart([blob], [out])
    if lossless_device.available(out.device):
        blob = blob.detach().to(out.device).contiguous()
        layout = lossless_device.layouts([blob])[0]
        _check_shape(layout.shape, tuple(out.shape))
        lossless_device.decode_into(blob, out, layout)
        return out
    if out.device.type != "cpu" or out.is_neg() or out.data_ptr() % out.element_size():
        # not writable in place through its data pointer (another device, a negative view, an
        # address that is not 2-byte aligned): decoded, then copied
        return out.copy_(decode(blob, threads=threads, simd=simd, expected_shape=tuple(out.shape)))
    blob = _host_blob(blob)
    # out: a contiguous CPU bf16 tensor (_check_out), written through its data pointer
    _lib().lossless_decode_into(blob.data_ptr(), blob.numel(), out.data_ptr(), out.numel(), threads,
                                _simd_level(simd), list(out.shape))
    return out


def decode_into_many(blobs: list[torch.Tensor], outs: list[torch.Tensor], *, threads: int = 0,
                     simd: bool | str = True) -> None:
    """:func:`decode_into` of several blobs (e.g. one message per source rank) into their
    outputs. Outputs on one GPU are decoded there one after another, with their metadata checks
    and the decoders' statuses each read back once for all; others one by one.

    Raises:
        ValueError: ``blobs`` and ``outs`` differ in length, an ``out`` is not a contiguous bf16
            tensor, or a blob holds another shape than its ``out`` or is corrupted (checked for
            every blob before anything is written on the GPU path).
    """
    if not isinstance(blobs, (list, tuple)) or not isinstance(outs, (list, tuple)) or len(blobs) != len(outs):
        raise ValueError("blobs and outs must be lists of the same length")
    for i, (blob, out) in enumerate(zip(blobs, outs)):
        _check_out(out, f"outs[{i}]")
        _check_blob(blob)
    _check_simd(simd)
    _check_threads(threads)
    _check_apart(list(blobs), list(outs))
    if outs and len({out.device for out in outs}) == 1 and lossless_device.available(outs[0].device):
        device = outs[0].device
        blobs = [blob.detach().to(device).contiguous() for blob in blobs]
        found = lossless_device.layouts(blobs)
        for layout, out in zip(found, outs):
            _check_shape(layout.shape, tuple(out.shape))
        lossless_device.decode_many(blobs, list(outs), found)
        return
    for blob, out in zip(blobs, outs):
        decode_into(blob, out, threads=threads, simd=simd)


def cached_output_bytes() -> int:
    """Bytes of freed codec memory (blobs, decoded tensors and encoder scratch of 256 KiB or more,
    each in its own mapping) that this process keeps for the next calls, as glibc keeps freed heap
    memory: memory that is unmapped and mapped again is faulted in again on every call, which
    costs about as much as decoding it. At most 256 MiB in 256 mappings, the oldest dropped
    first."""
    return int(_lib().lossless_cached_output_bytes())


def release_cached_outputs() -> None:
    """Returns the memory counted by :func:`cached_output_bytes` to the system."""
    _lib().lossless_release_cached_outputs()


def wire_bytes(blob: torch.Tensor) -> int:
    """Bytes a blob (1-D uint8) occupies on the wire."""
    return int(blob.numel())
