"""The wire format of one message: typed per-row fields packed into byte rows
(:class:`FieldSpec`, :class:`RowFormat`), and the rows for every destination rank packed into one
byte buffer.

The chunk for rank ``r`` holds ``n_r`` rows as one block per field, in the format's field order:
``[field 0 of all n_r rows][field 1 of all n_r rows]...``. With several fields, each block is
padded to a multiple of 8 bytes so that every block starts aligned for its dtype; a single-field
message is just the rows, so it is sent and received without any copy. Blocks let the sender
gather straight from the source tensor into the send buffer (``index_select(..., out=)``) and the
receiver concatenate each field's blocks once.

With the lossless codec the payload field's block is an 8-byte length followed by a
self-describing lossless blob instead of raw rows, placed last in the chunk, and the chunk is
padded to 8 bytes (its size varies, so the receiver learns each chunk's byte count from the
sender). A chunk of 0 bytes (from a masked rank) carries no rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import row_kernels
from .rows import wide_pair, widest_view

Payload = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A payload: rows ``[N, H]``, or DeepEP's FP8 pair ``(e4m3 [N, H], scales [N, G])``."""


@dataclass(frozen=True)
class FieldSpec:
    """One per-row field: ``width`` elements of ``dtype``, stored as bytes."""

    name: str
    dtype: torch.dtype
    width: int

    @property
    def nbytes(self) -> int:
        return self.width * torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class RowFormat:
    """The byte layout of a row made of several fields, in order."""

    fields: tuple[FieldSpec, ...]

    @property
    def row_bytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    def pack(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """``{name: [S, width] tensor}`` -> ``[S, row_bytes]`` uint8."""
        parts = []
        for f in self.fields:
            v = values[f.name]
            if v.dtype != f.dtype:
                raise ValueError(f"field {f.name}: expected {f.dtype}, got {v.dtype}")
            parts.append(v.reshape(v.shape[0], f.width).contiguous().view(torch.uint8))
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts, dim=1)

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[..., row_bytes]`` uint8 -> ``{name: [..., width]}`` views into ``rows`` (no copy).

        Each field's byte offset must be a multiple of its element size (true when fields are
        ordered from the widest element type down, or all widths keep that alignment).
        """
        out = {}
        start = 0
        for f in self.fields:
            size = torch.empty(0, dtype=f.dtype).element_size()
            if start % size:
                raise ValueError(f"field {f.name} starts at byte {start}, not a multiple of {size}")
            out[f.name] = rows[..., start:start + f.nbytes].view(f.dtype)
            start += f.nbytes
        return out

    def unpack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[S, row_bytes]`` uint8 -> ``{name: [S, width] tensor}`` (fresh, contiguous)."""
        if rows.dim() != 2 or rows.shape[1] != self.row_bytes:
            raise ValueError(f"rows must be [S, {self.row_bytes}] uint8, got {tuple(rows.shape)}")
        out = {}
        start = 0
        for f in self.fields:
            if f.nbytes == 0 or rows.shape[0] == 0:
                out[f.name] = torch.empty(rows.shape[0], f.width, dtype=f.dtype, device=rows.device)
                continue
            chunk = rows[:, start:start + f.nbytes].contiguous()
            out[f.name] = chunk.view(f.dtype).reshape(rows.shape[0], f.width)
            start += f.nbytes
        return out


BLOCK_ALIGN = 8
BLOB_LENGTH_BYTES = 8


@dataclass(frozen=True)
class RowSource:
    """Rows of one field: ``tensor[index]`` (``index`` None: ``tensor`` already holds the rows
    in send order)."""

    tensor: torch.Tensor
    index: torch.Tensor | None = None


@dataclass(frozen=True)
class Outbox:
    """A packed message set: ``data`` 1-D uint8 and the byte count for each destination."""

    data: torch.Tensor
    byte_splits: list[int]
    raw_byte_splits: list[int]


def _lossless():
    from .codecs import lossless

    return lossless


def _align(fmt: RowFormat) -> int:
    return BLOCK_ALIGN if len(fmt.fields) > 1 else 1


def _round(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def chunk_bytes(fmt: RowFormat, rows: int) -> int:
    """Bytes of a fixed-size (uncompressed) chunk of ``rows`` rows."""
    align = _align(fmt)
    return sum(_round(rows * f.nbytes, align) for f in fmt.fields)


def pack(fmt: RowFormat, values: dict[str, RowSource], row_splits: list[int], codec: str,
         payload_field: str = "x", raw_row_delta: int = 0) -> Outbox:
    """Packs ``values`` (each field's rows, grouped by destination per ``row_splits``).

    With ``codec == "lossless"`` the ``payload_field`` (bf16) is entropy-coded per destination.
    ``raw_row_delta``: bytes per row that the rows' uncompressed form has beyond ``fmt``'s (rows
    quantized to FP8 before packing: see :func:`fp8_raw_row_delta`), for ``raw_byte_splits``.
    """
    raw = [n * (fmt.row_bytes + raw_row_delta) for n in row_splits]
    if len(fmt.fields) == 1 and codec != "lossless":
        (spec,) = fmt.fields
        source = values[spec.name]
        tensor = source.tensor.detach()
        rows = tensor if source.index is None else widest_view(tensor).index_select(0, source.index)
        return Outbox(rows.contiguous().view(torch.uint8).reshape(-1), raw, raw)
    align = _align(fmt)
    order = _layout_order(fmt, codec, payload_field)
    blobs: list[torch.Tensor | None] = [None] * len(row_splits)
    if codec == "lossless":  # one blob per destination, coded together (one sync on a GPU)
        starts = [sum(row_splits[:i]) for i in range(len(row_splits))]
        rows = [_rows(values[payload_field], start, n) for start, n in zip(starts, row_splits)]
        chunk_values = _lossless().message_chunk_values(values[payload_field].tensor.device)
        blobs = list(_lossless().encode_many(rows, chunk_values=chunk_values, threads=_lossless().message_threads()))
    sizes = [sum(_round(BLOB_LENGTH_BYTES + blob.numel(), align)
                 if (blob is not None and f.name == payload_field)
                 else _round(n * f.nbytes, align) for f in fmt.fields)
             for n, blob in zip(row_splits, blobs)]
    # every byte is written: blocks and blobs, and zeros in the padding after them (it goes on
    # the wire too: no stale memory sent); not zero-filled first (a second pass over the message)
    data = torch.empty(sum(sizes), dtype=torch.uint8, device=_device(values))
    # on a GPU, each field's blocks (all chunks) are one kernel launch and the padding one more
    kernels = row_kernels.usable(data, *(t for v in values.values() for t in (v.tensor, v.index) if t is not None))
    field_blocks: dict[str, list[tuple[int, int, int]]] = {f.name: [] for f in order}
    pads: list[tuple[int, int]] = []
    offset = start = 0
    for n, blob, size in zip(row_splits, blobs, sizes):
        position = offset
        for f in order:
            if blob is not None and f.name == payload_field:  # last in the chunk
                length = torch.tensor([blob.numel()], dtype=torch.int64).view(torch.uint8)
                data[position:position + BLOB_LENGTH_BYTES] = length.to(data.device)
                data[position + BLOB_LENGTH_BYTES:position + BLOB_LENGTH_BYTES + blob.numel()] = \
                    blob.to(data.device)
                used = BLOB_LENGTH_BYTES + blob.numel()
            elif kernels:
                field_blocks[f.name].append((position, start, n))
                used = n * f.nbytes
            else:
                block = data[position:position + n * f.nbytes].view(f.dtype).view(n, f.width)
                source = values[f.name]
                tensor = source.tensor.detach()  # Buffer calls are not differentiable; autograd.py is
                if source.index is None:
                    block.copy_(tensor[start:start + n].reshape(n, f.width))
                else:
                    out, rows = wide_pair(block, tensor.reshape(-1, f.width))
                    torch.index_select(rows, 0, source.index[start:start + n], out=out)
                used = n * f.nbytes
            padded = _round(used, align)
            if padded > used:
                pads.append((position + used, position + padded))
                if not kernels:
                    data[position + used:position + padded] = 0
            position += padded
        offset += size
        start += n
    if kernels:
        for f in order:
            if field_blocks[f.name]:
                source = values[f.name]
                row_kernels.pack_blocks(data, field_blocks[f.name], source.tensor.detach().reshape(-1, f.width),
                                        source.index)
        row_kernels.zero_ranges(data, pads)
    return Outbox(data, sizes, raw)


def fp8_raw_row_delta(original: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes per row that ``original [N, H]`` takes beyond its FP8 form ``(e4m3 [N, H], scales
    [N, G])``: what codec="fp8" saves per row, added back to report raw (uncompressed) bytes."""
    q, scales = quantized
    return original.shape[1] * original.element_size() - (q.shape[1] * q.element_size()
                                                          + scales.shape[1] * scales.element_size())


def _layout_order(fmt: RowFormat, codec: str, payload_field: str):
    """Field order inside a chunk: a variable-size lossless blob goes last."""
    if codec != "lossless":
        return fmt.fields
    return tuple(f for f in fmt.fields if f.name != payload_field) + tuple(
        f for f in fmt.fields if f.name == payload_field)


def _rows(source: RowSource, start: int, n: int) -> torch.Tensor:
    tensor = source.tensor.detach()
    if source.index is None:
        return tensor[start:start + n]
    return tensor.index_select(0, source.index[start:start + n])


def _device(values: dict[str, RowSource]) -> torch.device:
    return next(iter(values.values())).tensor.device


def unpack(fmt: RowFormat, received: torch.Tensor, rows_from: list[int], bytes_from: list[int],
           codec: str, payload_field: str = "x",
           as_blocks: tuple[str, ...] = ()) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Inverse of :func:`pack` on the receiver: ``{name: [M, width]}`` ordered by source rank.

    Fields named in ``as_blocks`` come as a list of consecutive row blocks instead (``[m_i,
    width]`` views of ``received`` or of the decoded rows, in source order, concatenated the
    ``[M, width]`` rows; one ``[0, width]`` block when no rows came), for a caller that reads
    them without concatenating them (combine's reduction)."""
    total = sum(rows_from)
    if len(rows_from) != len(bytes_from) or any(n < 0 for n in rows_from) or any(b < 0 for b in bytes_from):
        raise ValueError(f"rows_from {rows_from} and bytes_from {bytes_from} must be non-negative, one per source")
    if sum(bytes_from) > received.numel():
        raise ValueError(f"the chunks' {sum(bytes_from)} bytes exceed the {received.numel()} bytes received")
    if len(fmt.fields) == 1 and codec != "lossless":
        (spec,) = fmt.fields
        if total == 0:
            empty = torch.empty(0, spec.width, dtype=spec.dtype, device=received.device)
            return {spec.name: [empty] if spec.name in as_blocks else empty}
        rows = received.view(spec.dtype).view(total, spec.width)
        return {spec.name: [rows] if spec.name in as_blocks else rows}
    align = _align(fmt)
    order = _layout_order(fmt, codec, payload_field)
    blocks: dict[str, list[torch.Tensor]] = {f.name: [] for f in fmt.fields}
    # lossless payload rows are decoded straight into their place: on the GPU that received them
    # when the CUDA codec kernels are built, else on the CPU (then moved once)
    decoded = None
    if codec == "lossless":
        spec = next(f for f in fmt.fields if f.name == payload_field)
        if _lossless().lossless_device.available(received.device):
            decoded = torch.empty((total, spec.width), dtype=torch.bfloat16, device=received.device)
        else:
            decoded = _lossless().empty((total, spec.width))
    coded: list[_CodedChunk] = []  # lossless: each chunk's blob, checked once all lengths are read
    offset = row = 0
    for n, nbytes in zip(rows_from, bytes_from):
        if nbytes == 0 and n == 0:  # a masked rank sends nothing at all
            continue
        position = offset
        for f in order:
            if codec == "lossless" and f.name == payload_field:  # last in the chunk
                if offset + nbytes - position < BLOB_LENGTH_BYTES:
                    raise ValueError("a lossless chunk is too short to hold its blob length")
                coded.append(_CodedChunk(position, offset + nbytes, row, n))
                position = offset + nbytes
                continue
            if n:
                blocks[f.name].append(received[position:position + n * f.nbytes].view(f.dtype).view(n, f.width))
            position += _round(n * f.nbytes, align)
        if position - offset != nbytes:
            raise ValueError(f"a chunk of {nbytes} bytes does not match its {n} rows")
        offset += nbytes
        row += n
    if coded:
        blobs = []
        for chunk, length in zip(coded, _blob_lengths(received, coded)):
            room = chunk.end - chunk.length_at - BLOB_LENGTH_BYTES
            if not 0 <= length <= room:
                raise ValueError(f"a lossless chunk names a blob of {length} bytes that it does not hold")
            if _round(BLOB_LENGTH_BYTES + length, align) != room + BLOB_LENGTH_BYTES:
                raise ValueError(f"a lossless chunk's blob of {length} bytes does not fill its {room} bytes")
            blobs.append(received[chunk.length_at + BLOB_LENGTH_BYTES:chunk.length_at + BLOB_LENGTH_BYTES + length])
        # each blob must hold exactly its rows (checked before anything is written)
        _lossless().decode_into_many(blobs, [decoded[c.first_row:c.first_row + c.rows] for c in coded],
                                     threads=_lossless().message_threads())
    out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for f in fmt.fields:
        parts = blocks[f.name]
        if decoded is not None and f.name == payload_field:
            out[f.name] = decoded.to(received.device)
            if f.name in as_blocks:
                out[f.name] = [out[f.name]]
        elif f.name in as_blocks:
            out[f.name] = parts or [torch.empty(0, f.width, dtype=f.dtype, device=received.device)]
        elif not parts:
            out[f.name] = torch.empty(0, f.width, dtype=f.dtype, device=received.device)
        elif len(parts) == 1:
            out[f.name] = parts[0].clone()
        else:
            out[f.name] = _cat_rows(parts)
    return out


@dataclass(frozen=True)
class _CodedChunk:
    """Where a received chunk's lossless blob lies: its 8-byte length at ``length_at``, the blob
    after it up to at most ``end``; its rows are ``first_row .. first_row + rows`` of the output."""

    length_at: int
    end: int
    first_row: int
    rows: int


def _blob_lengths(received: torch.Tensor, coded: list[_CodedChunk]) -> list[int]:
    """The 8-byte blob lengths of ``coded`` chunks in ``received`` (1-D uint8), in one copy."""
    at = torch.tensor([c.length_at for c in coded], dtype=torch.int64, device=received.device)
    fields = received[at[:, None] + torch.arange(BLOB_LENGTH_BYTES, device=received.device)]
    return fields.to("cpu").contiguous().view(torch.int64).reshape(-1).tolist()


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` of row blocks, done on their widest common integer view (same bytes)."""
    if row_kernels.usable(*parts):  # one launch for all blocks (views of the received message)
        out = row_kernels.concat_rows(parts)
        if out is not None:
            return out
    wide = [widest_view(p) for p in parts]
    narrow = min((w.dtype for w in wide), key=lambda d: d.itemsize)
    return torch.cat([p.view(narrow) for p in parts]).view(parts[0].dtype)
