"""The lossless codec on the GPU: the CUDA kernels of ``csrc/cuda/lossless_kernels.cu`` (in
``ep_comm._cuda``) behind :mod:`ep_comm.codecs.lossless` for CUDA tensors, so that a payload on
the GPU is coded there and its blob stays there.

The kernels compile the same core as the host build, so a device blob is byte-identical to the
host encoder's of the same format version (4 to 7; the decoder reads 2 to 7) and either side
decodes the other's blobs. Each call synchronises its stream once:
an encode to learn the blob's size, a decode to read the kernels' status (a corrupted blob raises
the ``ValueError`` the host decoder raises for it). Workspaces come from torch's caching
allocator, on the current stream of the tensor's device.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import device_kernels


def _host():
    from ep_comm import _host

    return _host


def available(device: torch.device) -> bool:
    """True when tensors on ``device`` are coded by the CUDA kernels (a CUDA device, and
    ``ep_comm._cuda`` built with them); otherwise :mod:`lossless` codes on the CPU."""
    return device_kernels.codec_kernels(device) is not None


_BLOB_ALIGN = 16  # blobs coded into one buffer start 16-byte aligned (the encoder's aligned stores)


ENCODE_VERSIONS = (4, 5, 6, 7)  # the formats the kernels write


def encode(x: torch.Tensor, chunk_values: int, version: int) -> torch.Tensor:
    """``x`` (bf16 CUDA tensor, any shape) -> 1-D uint8 blob in format ``version`` (4 to 7) on
    ``x``'s device.

    ``chunk_values`` and ``version`` are checked by the caller (a multiple of 32 in [32, 2**24];
    one of ENCODE_VERSIONS)."""
    # an exact-size copy: the capacity-sized buffer goes back to the allocator
    return encode_many([x], chunk_values, version)[0].clone()


def encode_many(xs: list[torch.Tensor], chunk_values: int, version: int) -> list[torch.Tensor]:
    """Blobs of several bf16 CUDA tensors on one device (e.g. one message per destination) in
    format ``version`` (4 to 7), coded one after another on the current stream with one
    synchronisation for all.

    Returns:
        1-D uint8 blobs, in order: views into one buffer of their capacities (a blob keeps that
        buffer alive; copy it to keep it alone).
    """
    if not xs:
        return []
    device = xs[0].device
    kernels = device_kernels.codec_kernels(device)
    # resolve_neg: a lazily negated view (negative bit set, e.g. torch._neg_view) cannot be viewed as int16
    flats = [x.detach().resolve_neg().contiguous().view(torch.int16).reshape(-1) for x in xs]
    shapes = [[int(d) for d in x.shape] for x in xs]
    starts = [0]
    for flat, shape in zip(flats, shapes):
        capacity = kernels.lossless_max_blob_bytes(flat.numel(), len(shape), chunk_values, version)
        starts.append(starts[-1] + (capacity + _BLOB_ALIGN - 1) // _BLOB_ALIGN * _BLOB_ALIGN)
    with device_kernels.launch_context(device):
        # one workspace for all: the launches run in stream order, each done before the next starts
        workspace = torch.empty(max(kernels.lossless_encode_workspace_bytes(f.numel(), chunk_values, version)
                                    for f in flats), dtype=torch.uint8, device=device)
        out = torch.empty(starts[-1], dtype=torch.uint8, device=device)
        sizes = torch.zeros(len(xs), dtype=torch.int64, device=device)
        stream = device_kernels.current_stream(device)
        for i, (flat, shape) in enumerate(zip(flats, shapes)):
            kernels.lossless_encode(flat.data_ptr(), flat.numel(), shape, chunk_values, version,
                                    out.data_ptr() + starts[i], sizes.data_ptr() + 8 * i, workspace.data_ptr(),
                                    workspace.numel(), stream)
        blob_bytes = sizes.tolist()  # the one synchronisation
    return [out[start:start + size] for start, size in zip(starts, blob_bytes)]


def header(blob: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """``(shape, chunk_values)`` that a blob (1-D uint8, any device) declares, after every check
    the host decoder makes before it allocates (header, table, metadata checksum, chunk
    directory, sizes; format versions 2 to 7). ``ValueError`` if it is bad. See :func:`headers`."""
    return headers([blob])[0]


def headers(blobs: list[torch.Tensor]) -> list[tuple[tuple[int, ...], int]]:
    """:func:`header` of several blobs on one device: their metadata comes to the host in two
    copies for all (the fixed headers, then header, table and directory: about 16 bytes per
    chunk). Raises the ValueError of the first bad blob."""
    return [(layout.shape, layout.chunk_values) for layout in layouts(blobs)]


class BlobLayout(NamedTuple):
    """What the decoder's launch needs of a blob, read from its metadata on the host."""
    shape: tuple[int, ...]
    chunk_values: int
    field_chunks: int  # chunks with coded fields (modes 4 and 5, formats 6 and 7): workspace slots
    version: int  # the format version, which picks the decode kernels (their checksum)


def layouts(blobs: list[torch.Tensor]) -> list[BlobLayout]:
    """:func:`headers` with each blob's count of chunks with coded fields, which sizes the
    decoder's workspace (:func:`decode_many`)."""
    host = _host()
    sizes = [b.numel() for b in blobs]
    prefixes = _to_host([b[: min(n, host.LOSSLESS_HEADER_PREFIX_BYTES)] for b, n in zip(blobs, sizes)])
    metadata_bytes = [host.lossless_metadata_bytes(p.numpy(), n) for p, n in zip(prefixes, sizes)]
    metadata = _to_host([b[:m] for b, m in zip(blobs, metadata_bytes)])
    result = []
    for m, n in zip(metadata, sizes):
        shape, chunk_values, field_chunks, version = host.lossless_parse_metadata(m.numpy(), n)
        result.append(BlobLayout(tuple(shape), int(chunk_values), int(field_chunks), int(version)))
    return result


def _to_host(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """1-D uint8 slices (one device) -> their CPU copies, in one device-to-host copy."""
    if not parts:
        return []
    joined = torch.cat([p.reshape(-1) for p in parts]).to("cpu")
    return list(joined.split([p.numel() for p in parts]))


def decode_into(blob: torch.Tensor, out: torch.Tensor, layout: BlobLayout) -> None:
    """Decodes ``blob`` (1-D uint8, on ``out``'s device) into ``out`` (contiguous bf16 CUDA
    tensor of the blob's shape), ``layout`` the blob's as :func:`layouts` read it.

    Raises:
        ValueError: the blob is corrupted (the host decoder's message); ``out`` is then
            unspecified.
    """
    decode_many([blob], [out], [layout])


def decode_many(blobs: list[torch.Tensor], outs: list[torch.Tensor], found: list[BlobLayout]) -> None:
    """:func:`decode_into` of several blobs into their outputs (all on one device), decoded one
    after another on the current stream with one synchronisation for all; ``found``: each blob's
    :func:`layouts`.

    Raises:
        ValueError: a blob is corrupted (the host decoder's message for the first such blob);
            the outputs are then unspecified.
    """
    if not blobs:
        return
    device = outs[0].device
    kernels = device_kernels.codec_kernels(device)
    flats = [out.view(torch.int16).reshape(-1) for out in outs]
    with device_kernels.launch_context(device):
        # one workspace for all: the launches run in stream order, each done before the next starts
        workspace = torch.empty(max(kernels.lossless_decode_workspace_bytes(f.numel(), b.chunk_values, b.field_chunks)
                                    for f, b in zip(flats, found)), dtype=torch.uint8, device=device)
        status = torch.zeros(len(blobs), dtype=torch.int32, device=device)
        stream = device_kernels.current_stream(device)
        for i, (blob, flat, b) in enumerate(zip(blobs, flats, found)):
            kernels.lossless_decode(blob.data_ptr(), blob.numel(), flat.data_ptr(), flat.numel(), b.chunk_values,
                                    b.field_chunks, b.version, status.data_ptr() + 4 * i, workspace.data_ptr(),
                                    workspace.numel(), stream)
        codes = status.tolist()  # the one synchronisation
    for code in codes:
        if code != 0:
            raise ValueError(f"lossless blob: {_host().lossless_error_message(code)}")
