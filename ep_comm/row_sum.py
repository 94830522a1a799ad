"""Combines' reductions: the rows returned to a rank, summed per source token in a fixed order.

One result on every device. Normal mode (:func:`reduce_by_source`): token ``t``'s sum is
``((0 + r_a) + r_b) + ...`` in float32 (float64 for float64 rows) over its returned rows
``a < b < ...`` in row order (destination rank ascending), then each bias added, then cast to the
rows' dtype. Low-latency mode (:func:`weighted_sum_by_token`): the same over each token's rows in
top-k order, each row times its top-k weight first (the product rounded to float32). On the GPU
(and for float16 / float64 rows) these are ``index_add_`` calls; for bf16 / float32 rows on the
CPU ``ep_comm._host.sum_rows_by_token`` makes the same float operations in the same order straight
from the received buffer (no gathered or float32 copies of the rows), so the results are the same
bits, but for NaNs: where a NaN is added to a NaN, which one's sign and payload survive depends
on the order of the add's operands, which neither torch nor the compiler fixes.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .plan import SendPlan
from .wire import widest_view

try:  # the C++ host module; without it the torch path does the same sums
    from ep_comm import _host
except ImportError:  # pragma: no cover - only an unbuilt checkout
    _host = None

_HOST_DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1}


def reduce_by_source(rows: torch.Tensor | Sequence[torch.Tensor], plan: SendPlan, num_tokens: int,
                     bias: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Sums returned rows per source token (deterministic: see the module docstring).

    Args:
        rows: ``[S, W]`` returned rows in ``plan.token_index`` order, or consecutive blocks of
            them (``[s_i, W]`` each, e.g. one per source rank as received; concatenated they are
            the ``[S, W]`` rows; at least one block, possibly ``[0, W]``), all of one dtype and
            device.
        plan: the send plan whose ``token_index [S]`` int64 names each row's token.
        num_tokens: ``N``, rows of the result.
        bias: up to two ``[N, W]`` tensors added to the sums.
    Returns:
        ``[N, W]`` in the rows' dtype, accumulated in float32 (float64 for float64 rows).
    """
    blocks = [rows] if isinstance(rows, torch.Tensor) else list(rows)
    if not blocks:
        raise ValueError("rows must be a tensor or a non-empty list of row blocks")
    dtype, device, width = blocks[0].dtype, blocks[0].device, blocks[0].shape[1]
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if _host_can_sum(blocks, plan):
        acc = torch.empty(num_tokens, width, dtype=torch.float32)
        index = plan.token_index
        _host.sum_rows_by_token(acc.data_ptr(), num_tokens, width, [b.data_ptr() for b in blocks],
                                [b.shape[0] for b in blocks], index.data_ptr(), index.numel(),
                                _HOST_DTYPE_CODES[dtype], max(1, torch.get_num_threads()))
    else:
        flat = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        acc = torch.zeros(num_tokens, width, dtype=acc_dtype, device=device)
        start = 0
        for count in plan.splits():
            segment = slice(start, start + count)
            acc.index_add_(0, plan.token_index[segment], flat[segment].to(acc_dtype))
            start += count
    for b in bias:
        acc += b.to(acc_dtype)
    return acc.to(dtype)


def _host_can_sum(blocks: list[torch.Tensor], plan: SendPlan) -> bool:
    """Whether the C++ host sum takes these blocks: CPU, bf16 or float32, 2-D, contiguous and
    aligned, one dtype and width, with a CPU int64 contiguous token index of their rows."""
    if _host is None or not hasattr(_host, "sum_rows_by_token"):
        return False
    first = blocks[0]
    if first.dtype not in _HOST_DTYPE_CODES:
        return False
    index = plan.token_index
    if not (index.is_cpu and index.dtype == torch.int64 and index.is_contiguous()):
        return False
    if index.numel() != sum(b.shape[0] for b in blocks):
        return False
    return all(b.is_cpu and b.dim() == 2 and b.dtype == first.dtype and b.shape[1] == first.shape[1]
               and b.is_contiguous() and b.data_ptr() % b.element_size() == 0 and not b.is_neg()
               and not b.is_conj() for b in blocks)


def weighted_sum_by_token(rows: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor,
                          weights: torch.Tensor, num_tokens: int, block_rows: int) -> torch.Tensor:
    """Low-latency combine's sum: ``acc[tokens[i]] += rows[order[i]].float() * weights[i]`` for
    ``i`` ascending, into float32 zeros.

    Args:
        rows: ``[P, H]`` bf16 returned rows, as received.
        order: ``[P]`` int64, the rows in summation order (each token's rows in top-k order).
        tokens: ``[P]`` int64, the token of each row of ``order``; weights: ``[P]`` float32, its
            top-k weight.
        block_rows: rows gathered and converted at a time on the torch path (bounds its float32
            temporaries).
    Returns:
        ``[num_tokens, H]`` float32.
    """
    hidden = rows.shape[1]
    if (_host is not None and hasattr(_host, "sum_rows_by_token") and rows.dtype in _HOST_DTYPE_CODES
            and rows.is_cpu and rows.is_contiguous() and not rows.is_neg()
            and rows.data_ptr() % rows.element_size() == 0):
        acc = torch.empty(num_tokens, hidden, dtype=torch.float32)
        order = order.to(torch.int64).contiguous()
        tokens = tokens.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        _host.sum_rows_by_token(acc.data_ptr(), num_tokens, hidden, [rows.data_ptr()], [rows.shape[0]],
                                tokens.data_ptr(), tokens.numel(), _HOST_DTYPE_CODES[rows.dtype],
                                max(1, torch.get_num_threads()), order.data_ptr(), weights.data_ptr())
        return acc
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=rows.device)
    wide_rows = widest_view(rows)
    column = weights.to(torch.float32).unsqueeze(1)
    # consecutive blocks keep each token's order and keep the float32 temporaries small enough to
    # be reused instead of faulted in
    for start in range(0, order.numel(), block_rows):
        block = slice(start, start + block_rows)
        scaled = wide_rows.index_select(0, order[block]).view(rows.dtype).float().mul_(column[block])
        acc.index_add_(0, tokens[block], scaled)
    return acc
