"""Combine's per-token sums on the GPU, in the CPU reference's order and float operations (see
``ep_comm.rows``): token ``t``'s sum is ``((0 + r_a) + r_b) + ...`` in float32 over its rows in
order (low-latency mode: each row times its top-k weight first, the product rounded to float32),
then each bias added, then one rounding to the output dtype. Every (token, column block) is one
program that walks the token's rows in order: no atomics, so the result is deterministic and
equal, bit for bit, to the CPU's (NaN payloads aside, which no two float units agree on).

The kernel is compiled without floating-point contraction (``enable_fp_fusion=False``): a fused
multiply-add would skip the product's rounding.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .bits import BF16, F16, F32, from_f32, to_f32
from .rowcopy import align_elements, device_guard, row_offsets

_KINDS = {torch.bfloat16: BF16, torch.float16: F16, torch.float32: F32}
COMPILE_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}
"""Launch options of :func:`sum_rows_kernel` (also what tests/test_triton_aot.py compiles with)."""
BLOCK_ELEMENTS = {"cuda": 1024, "hip": 2048}
"""Columns one program sums at most, per backend: 16 bytes of bf16 per thread with 4 warps of 32
(NVIDIA) or of 64 lanes (AMD)."""


@triton.jit
def sum_rows_kernel(out, out_stride, rows, row_index, row_stride, starts, weights,
                    bias0, bias0_stride, bias1, bias1_stride, width,
                    ROW_KIND: tl.constexpr, OUT_KIND: tl.constexpr, WEIGHTED: tl.constexpr,
                    NUM_BIAS: tl.constexpr, BIAS0_KIND: tl.constexpr, BIAS1_KIND: tl.constexpr,
                    ROW_ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(t, j)``: columns ``[j * BLOCK, (j + 1) * BLOCK)`` of token ``t``'s sum over the
    rows ``row_index[k] * row_stride`` for ``k`` in ``[starts[t], starts[t + 1])`` (each a
    multiple of ``ROW_ALIGN`` elements), each times ``weights[k]`` when ``WEIGHTED``, plus
    ``NUM_BIAS`` bias rows, stored as ``OUT_KIND``."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    begin = tl.load(starts + t)
    end = tl.load(starts + t + 1)
    acc = tl.zeros([BLOCK], tl.float32)
    for k in range(begin, end):
        row = tl.load(row_index + k).to(tl.int64) * row_stride
        if ROW_ALIGN > 1:
            row = tl.multiple_of(row, ROW_ALIGN)
        value = to_f32(tl.load(rows + row + cols, mask=mask, other=0), ROW_KIND)
        if WEIGHTED:
            value = value * tl.load(weights + k)
        acc = acc + value
    if NUM_BIAS >= 1:
        acc = acc + to_f32(tl.load(bias0 + t * bias0_stride + cols, mask=mask, other=0), BIAS0_KIND)
    if NUM_BIAS >= 2:
        acc = acc + to_f32(tl.load(bias1 + t * bias1_stride + cols, mask=mask, other=0), BIAS1_KIND)
    tl.store(out + t * out_stride + cols, from_f32(acc, OUT_KIND), mask=mask)


def _kernel_view(t: torch.Tensor) -> torch.Tensor:
    """bf16 tensors are passed as their int16 bits (``bits.py``)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def supports(dtype: torch.dtype) -> bool:
    return dtype in _KINDS


def _launch(out: torch.Tensor, rows: torch.Tensor, row_index: torch.Tensor, row_stride: int, starts: torch.Tensor,
            weights: torch.Tensor | None, bias: Sequence[torch.Tensor], row_align: int) -> None:
    """``row_align``: every row's offset (``row_index[k] * row_stride`` elements) is a multiple of it."""
    num_tokens, width = out.shape
    if num_tokens == 0 or width == 0:
        return
    bias = [b if b.shape[1] <= 1 or b.stride(1) == 1 else b.contiguous() for b in bias]
    padded = [*bias, out, out][:2]
    block = min(triton.next_power_of_2(width), BLOCK_ELEMENTS["hip" if torch.version.hip else "cuda"])
    grid = (num_tokens, triton.cdiv(width, block))
    with device_guard(out):
        sum_rows_kernel[grid](
            _kernel_view(out), out.stride(0), _kernel_view(rows), row_index, row_stride, starts,
            out if weights is None else weights, _kernel_view(padded[0]), padded[0].stride(0),
            _kernel_view(padded[1]), padded[1].stride(0), width,
            ROW_KIND=_KINDS[rows.dtype], OUT_KIND=_KINDS[out.dtype], WEIGHTED=weights is not None,
            NUM_BIAS=len(bias), BIAS0_KIND=_KINDS[padded[0].dtype], BIAS1_KIND=_KINDS[padded[1].dtype],
            ROW_ALIGN=row_align, BLOCK=block, **COMPILE_OPTIONS)


def _token_starts(sorted_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[N + 1]`` int64: token ``t``'s entries are ``[starts[t], starts[t + 1])`` of the sorted list."""
    bounds = torch.arange(num_tokens + 1, dtype=sorted_tokens.dtype, device=sorted_tokens.device)
    return torch.searchsorted(sorted_tokens, bounds).to(torch.int64)


def _block_rows(blocks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """``(base, row_index [S], row_stride, row_align)`` locating the blocks' rows: for one
    tensor, its rows; for several, element offsets from the start of their common storage
    (stride 1). None when the blocks are views of different buffers or not row-contiguous."""
    first = blocks[0]
    size = first.element_size()
    if any(b.shape[1] > 1 and b.stride(1) != 1 for b in blocks):
        return None
    if len(blocks) == 1:
        index = torch.arange(first.shape[0], dtype=torch.int64, device=first.device)
        return first, index, first.stride(0), align_elements(size, first.data_ptr(), first.stride(0) * size)
    storage = first.untyped_storage()
    starts = [b.data_ptr() - storage.data_ptr() for b in blocks]
    if any(b.untyped_storage().data_ptr() != storage.data_ptr() or b.dtype != first.dtype
           or b.shape[1] != first.shape[1] for b in blocks) or any(s % size for s in starts):
        return None
    base = torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, 0, (storage.nbytes() // size,), (1,))
    offsets = row_offsets([s // size for s in starts], [b.shape[0] for b in blocks], [b.stride(0) for b in blocks],
                          first.device)
    align = align_elements(size, storage.data_ptr(), *starts, *(b.stride(0) * size for b in blocks))
    return base, offsets, 1, align


def reduce_by_source(blocks: Sequence[torch.Tensor], token_index: torch.Tensor, num_tokens: int,
                     bias: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``ep_comm.rows.reduce_by_source`` for GPU row blocks of bf16/fp16/fp32 (the blocks, in
    order, the rows of ``token_index [S]``), with bf16/fp16/fp32 biases; None when it does not
    take them (other dtypes, blocks it cannot address)."""
    first = blocks[0]
    if not supports(first.dtype) or any(not supports(b.dtype) for b in bias):
        return None
    located = _block_rows(blocks)
    if located is None:
        return None
    base, row_index, row_stride, row_align = located
    sorted_tokens, order = torch.sort(token_index, stable=True)
    out = torch.empty(num_tokens, first.shape[1], dtype=first.dtype, device=first.device)
    _launch(out, base, row_index[order], row_stride, _token_starts(sorted_tokens, num_tokens), None, bias, row_align)
    return out


def weighted_sum_by_token(rows: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor,
                          num_tokens: int) -> torch.Tensor:
    """``ep_comm.rows.weighted_sum_by_token`` for GPU rows ``[P, H]`` of bf16/fp16/fp32: ``[N,
    H]`` float32 with ``acc[tokens[i]] += rows[order[i]] * weights[i]`` for ``i`` ascending."""
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    sorted_tokens, by_token = torch.sort(tokens, stable=True)  # each token's entries keep their order
    out = torch.empty(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    size = rows.element_size()
    _launch(out, rows, order[by_token].to(torch.int64), rows.stride(0), _token_starts(sorted_tokens, num_tokens),
            weights.to(torch.float32)[by_token].contiguous(), (),
            align_elements(size, rows.data_ptr(), rows.stride(0) * size))
    return out
