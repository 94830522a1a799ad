"""Row copies on the GPU: the gathers that pack a message's blocks and the scatters that unpack
received rows into their places (the normal mode's ``[M, W]`` fields, the low-latency mode's
``[L, R*T, H]`` slots), in one launch per field instead of one torch gather per (chunk, field).

One kernel, :func:`copy_rows_kernel`: ``dst[d(i) * dst_stride + c] = src[s(i) * src_stride + c]``
for every row ``i`` and column ``c < width``, where ``d(i)`` is ``dst_index[i]`` or ``i`` (and
``s`` likewise). Rows are moved as the widest integer unit their bytes allow (8, 4, 2 or 1 bytes),
so the same kernel copies any dtype; an index may also be a row's offset in units (stride 1),
which places rows at arbitrary offsets of a message.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_UNITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
BLOCK_BYTES = 8192
"""Bytes of a row one program moves at most."""

COMPILE_OPTIONS = {"num_warps": 4}
"""Launch options of :func:`copy_rows_kernel` (also what tests/test_triton_aot.py compiles with)."""


@triton.jit
def copy_rows_kernel(dst, dst_index, dst_stride, src, src_index, src_stride, width,
                     DST_INDEXED: tl.constexpr, SRC_INDEXED: tl.constexpr, ALIGN: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Program ``(i, j)`` copies columns ``[j * BLOCK, (j + 1) * BLOCK)`` of row ``i``; every row
    offset is a multiple of ``ALIGN`` elements."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    if SRC_INDEXED:
        s = tl.load(src_index + i).to(tl.int64)
    else:
        s = i.to(tl.int64)
    if DST_INDEXED:
        d = tl.load(dst_index + i).to(tl.int64)
    else:
        d = i.to(tl.int64)
    src_row = s * src_stride
    dst_row = d * dst_stride
    if ALIGN > 1:  # (a hint of 1 would hide what the compiler knows of 16-divisible strides)
        src_row = tl.multiple_of(src_row, ALIGN)
        dst_row = tl.multiple_of(dst_row, ALIGN)
    tl.store(dst + dst_row + cols, tl.load(src + src_row + cols, mask=mask), mask=mask)


def device_guard(t: torch.Tensor):
    """Launches and allocations on ``t``'s GPU (a no-op for CPU tensors, the interpreter's)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def unit_bytes(*values: int) -> int:
    """The widest unit (8, 4, 2 or 1 bytes) dividing every value (byte counts and addresses)."""
    for unit in (8, 4, 2):
        if all(v % unit == 0 for v in values):
            return unit
    return 1


def addresses(t: torch.Tensor) -> tuple[int, int]:
    """``t``'s first byte and its storage's: both must be unit-aligned for a unit view."""
    return t.data_ptr(), t.untyped_storage().data_ptr()


def as_units(t: torch.Tensor, unit: int) -> torch.Tensor:
    """A 2-D tensor whose rows' elements are adjacent, viewed as ``unit``-byte integers (its
    rows' bytes, its address and its storage's a multiple of ``unit``)."""
    if t.shape[1] == 1 and t.stride(1) != 1:
        t = t.as_strided(t.shape, (t.stride(0), 1))
    return t.view(torch.uint8).view(_UNITS[unit])


def storage_units(t: torch.Tensor, unit: int) -> torch.Tensor:
    """The whole storage of ``t`` as 1-D ``unit``-byte integers (a kernel's base pointer for
    offsets counted from the storage's start)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=_UNITS[unit], device=t.device).set_(storage, 0, (storage.nbytes() // unit,), (1,))


def row_offsets(starts: Sequence[int], counts: Sequence[int], strides: Sequence[int],
                device: torch.device) -> torch.Tensor:
    """``[sum(counts)]`` int64 on ``device``: row ``j`` of part ``p`` at ``starts[p] + j *
    strides[p]``, the parts' rows one after another (built on the device from three values per
    part)."""
    total = sum(counts)
    if total == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    before, base = 0, []
    for start, count, stride in zip(starts, counts, strides):
        base.append(start - before * stride)
        before += count
    table = torch.tensor([base, list(counts), list(strides)], dtype=torch.int64).to(device)
    repeated = torch.repeat_interleave(table[[0, 2]], table[1], dim=1, output_size=total)
    return repeated[0] + torch.arange(total, dtype=torch.int64, device=device) * repeated[1]


def launch(dst: torch.Tensor, dst_index: torch.Tensor | None, dst_stride: int, src: torch.Tensor,
           src_index: torch.Tensor | None, src_stride: int, rows: int, width: int, align: int) -> None:
    """Runs :func:`copy_rows_kernel` on unit-typed ``dst`` / ``src`` (their first elements the
    bases of the offsets); ``align``: every row offset is a multiple of it (elements)."""
    if rows == 0 or width == 0:
        return
    unit = dst.element_size()
    block = min(triton.next_power_of_2(width), max(16, BLOCK_BYTES // unit))
    grid = (rows, triton.cdiv(width, block))
    with device_guard(dst):
        copy_rows_kernel[grid](dst, dst if dst_index is None else dst_index, dst_stride,
                               src, src if src_index is None else src_index, src_stride, width,
                               DST_INDEXED=dst_index is not None, SRC_INDEXED=src_index is not None,
                               ALIGN=align, BLOCK=block, **COMPILE_OPTIONS)


def align_elements(element_bytes: int, *byte_values: int) -> int:
    """The alignment hint of row offsets that are sums of multiples of ``byte_values``: the
    widest access (up to 16 bytes) they all allow, in elements of ``element_bytes``."""
    for alignment in (16, 8, 4, 2):
        if all(v % alignment == 0 for v in byte_values):
            return max(1, alignment // element_bytes)
    return 1


def copy_rows(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor) -> None:
    """``dst[dst_index[i]] = src[src_index[i]]`` (``ep_comm.rows.copy_rows``'s contract): 2-D
    tensors whose rows hold the same bytes and whose elements within a row are adjacent."""
    row_bytes = dst.shape[1] * dst.element_size()
    dst_stride, src_stride = dst.stride(0) * dst.element_size(), src.stride(0) * src.element_size()
    where = (*addresses(dst), *addresses(src))
    unit = unit_bytes(row_bytes, dst_stride, src_stride, *where)
    align = align_elements(unit, dst_stride, src_stride, dst.data_ptr(), src.data_ptr())
    launch(as_units(dst, unit), dst_index.to(torch.int64), dst_stride // unit, as_units(src, unit),
           src_index.to(torch.int64), src_stride // unit, dst_index.numel(), row_bytes // unit, align)


def pack_blocks(data: torch.Tensor, blocks: Sequence[tuple[int, int, int]], source: torch.Tensor,
                index: torch.Tensor | None) -> None:
    """Writes one field's blocks into a message ``data`` (1-D uint8): ``blocks`` lists the
    ``(byte position, first row, rows)`` of each chunk's block, in row order; the field's rows are
    ``source [S', W]`` gathered by ``index [S]`` (``source`` itself, in order, without ``index``)."""
    if source.shape[1] > 1 and source.stride(1) != 1:
        source = source.contiguous()
    rows = 0
    for _, first, n in blocks:
        if first != rows:
            raise ValueError(f"blocks must cover the field's rows in order: row {first} follows {rows} rows")
        rows += n
    row_bytes = source.shape[1] * source.element_size()
    src_stride = source.stride(0) * source.element_size()
    positions = [p for p, _, _ in blocks]
    unit = unit_bytes(row_bytes, src_stride, data.numel(), *addresses(source), *addresses(data), *positions)
    align = align_elements(unit, row_bytes, src_stride, source.data_ptr(), data.data_ptr(), *positions)
    offsets = row_offsets([p // unit for p in positions], [n for _, _, n in blocks],
                          [row_bytes // unit] * len(blocks), data.device)
    launch(data.view(_UNITS[unit]), offsets, 1, as_units(source, unit),
           None if index is None else index.to(torch.int64), src_stride // unit, rows, row_bytes // unit, align)


def zero_ranges(data: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> None:
    """Zeros the ``(start, end)`` byte ranges of 1-D uint8 ``data`` in one operation."""
    positions = [p for start, end in ranges for p in range(start, end)]
    if positions:
        data.index_fill_(0, torch.tensor(positions, dtype=torch.int64).to(data.device), 0)


def concat_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(parts)`` of 2-D row blocks that are views of one buffer (a received message's
    blocks), in one launch; None when they are not."""
    first = parts[0]
    parts = [p for p in parts if p.shape[0]]
    if not parts:
        return torch.empty(0, first.shape[1], dtype=first.dtype, device=first.device)
    storage = first.untyped_storage().data_ptr()
    if any(p.untyped_storage().data_ptr() != storage or p.dtype != first.dtype or p.shape[1] != first.shape[1]
           or (p.shape[1] > 1 and p.stride(1) != 1) for p in parts):
        return None
    total = sum(p.shape[0] for p in parts)
    out = torch.empty(total, first.shape[1], dtype=first.dtype, device=first.device)
    row_bytes = first.shape[1] * first.element_size()
    starts = [p.data_ptr() - storage for p in parts]
    strides = [p.stride(0) * p.element_size() for p in parts]
    unit = unit_bytes(row_bytes, storage, *addresses(out), *starts, *strides)
    align = align_elements(unit, row_bytes, storage, out.data_ptr(), *starts, *strides)
    offsets = row_offsets([s // unit for s in starts], [p.shape[0] for p in parts],
                          [s // unit for s in strides], first.device)
    launch(as_units(out, unit), None, row_bytes // unit, storage_units(first, unit), offsets, 1,
           total, row_bytes // unit, align)
    return out
