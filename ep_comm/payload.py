"""Messages: rows for every destination rank packed into one byte buffer, optionally compressed.

A message to rank ``r`` carries ``rows[r]`` rows. Fixed-size rows (no codec, or FP8) interleave
the payload and metadata fields of a row, so a received buffer is one ``[M, row_bytes]`` view.
With the lossless codec, each destination's chunk is ``[lossless blob of the payload rows]
[metadata rows]``, and the receiver needs each chunk's byte size too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .wire import RowFormat


@dataclass(frozen=True)
class Outbox:
    """A packed message set: ``data`` 1-D uint8 and the byte count for each destination."""

    data: torch.Tensor
    byte_splits: list[int]
    raw_byte_splits: list[int]


def _lossless():
    from .codecs import lossless

    return lossless


def pack(fmt: RowFormat, values: dict[str, torch.Tensor], row_splits: list[int], codec: str,
         payload_field: str = "x") -> Outbox:
    """Packs ``values`` (each ``[S, width]``, rows grouped by destination per ``row_splits``).

    With ``codec == "lossless"``, the ``payload_field`` (bf16) is entropy-coded per destination.
    """
    raw = [n * fmt.row_bytes for n in row_splits]
    if codec != "lossless":
        return Outbox(fmt.pack(values).reshape(-1), raw, raw)
    lossless = _lossless()
    meta_fmt = RowFormat(tuple(f for f in fmt.fields if f.name != payload_field))
    payload = values[payload_field]
    meta_rows = meta_fmt.pack({f.name: values[f.name] for f in meta_fmt.fields}) \
        if meta_fmt.fields else None
    pieces: list[torch.Tensor] = []
    splits: list[int] = []
    start = 0
    for n in row_splits:
        blob = lossless.encode(payload[start:start + n])
        chunk = [blob]
        if meta_rows is not None:
            chunk.append(meta_rows[start:start + n].reshape(-1))
        pieces.extend(chunk)
        splits.append(sum(int(c.numel()) for c in chunk))
        start += n
    data = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    return Outbox(data, splits, raw)


def unpack(fmt: RowFormat, received: torch.Tensor, rows_from: list[int], bytes_from: list[int],
           codec: str, payload_field: str = "x") -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack` on the receiver: ``{name: [M, width]}`` ordered by source rank."""
    if codec != "lossless":
        return fmt.unpack(received.reshape(sum(rows_from), fmt.row_bytes))
    lossless = _lossless()
    meta_fmt = RowFormat(tuple(f for f in fmt.fields if f.name != payload_field))
    payload_spec = next(f for f in fmt.fields if f.name == payload_field)
    payloads: list[torch.Tensor] = []
    metas: list[torch.Tensor] = []
    start = 0
    for n, nbytes in zip(rows_from, bytes_from):
        meta_bytes = n * meta_fmt.row_bytes
        blob = received[start:start + nbytes - meta_bytes]
        rows = lossless.decode(blob)
        if tuple(rows.shape) != (n, payload_spec.width):
            raise ValueError(f"lossless chunk decoded to shape {tuple(rows.shape)}, expected "
                             f"{(n, payload_spec.width)}")
        payloads.append(rows)
        metas.append(received[start + nbytes - meta_bytes:start + nbytes])
        start += nbytes
    out = {payload_field: torch.cat(payloads) if payloads else
           torch.empty(0, payload_spec.width, dtype=payload_spec.dtype)}
    if meta_fmt.fields:
        meta = torch.cat(metas) if metas else torch.empty(0, dtype=torch.uint8)
        out.update(meta_fmt.unpack(meta.reshape(sum(rows_from), meta_fmt.row_bytes)))
    return out
