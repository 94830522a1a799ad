"""Packing typed per-row fields into byte rows and back (the wire format of one message)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


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


def as_byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``[S, ...]`` any dtype -> ``[S, bytes per row]`` uint8 view of a contiguous copy."""
    return t.contiguous().reshape(t.shape[0], -1).view(torch.uint8)


_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def widest_view(t: torch.Tensor) -> torch.Tensor:
    """The same bytes viewed with the widest integer element the last dimension allows.

    Row gathers and scatters (``index_select``, ``index_copy_``) move whole rows; on the CPU they
    run several times faster on 8-byte elements than on 2-byte ones, and the bytes are identical.
    """
    if t.dim() == 0 or t.shape[-1] == 0:
        return t
    for dtype in _WIDE_DTYPES:
        if dtype.itemsize < t.element_size():
            break
        try:
            return t.view(dtype)
        except RuntimeError:
            continue
    return t


def wide_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`widest_view` of two tensors with rows of equal bytes, in a dtype both allow."""
    wa, wb = widest_view(a), widest_view(b)
    if wa.dtype == wb.dtype:
        return wa, wb
    narrow = wa.dtype if wa.element_size() < wb.element_size() else wb.dtype
    return a.view(narrow), b.view(narrow)
