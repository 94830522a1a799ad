"""``deep_ep.utils.math``: the numeric helpers DeepEP's tests use to build inputs and check results.

Same names, signatures and results as DeepEP's; plain eager PyTorch (DeepEP wraps the FP8 casts in
``torch.compile``), so they run on the CPU as well as on CUDA.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["align", "calc_diff", "ceil_div", "count_bytes", "create_grouped_scores", "hash_tensor",
           "hash_tensors", "inplace_unique", "per_token_cast_back", "per_token_cast_to_fp8", "safe_div"]

FP8_E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value: a block's absolute maximum is scaled to it."""
FP8_BLOCK = 128
"""Channels sharing one scale in the per-token FP8 format."""


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """``1 - 2 <x', y'> / (|x'|^2 + |y'|^2)`` with ``x' = x + 1``, ``y' = y + 1``, in float64.

    0 for equal tensors; small and scale-aware otherwise (the ``+ 1`` keeps all-zero tensors
    comparable).
    """
    a = x.double() + 1
    b = y.double() + 1
    return float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())


def safe_div(a: Any, b: Any) -> Any:
    """``a / b``, except ``0 / 0 == 0`` (a nonzero ``a / 0`` still raises ZeroDivisionError)."""
    if b == 0 and a == 0:
        return 0
    return a / b


def ceil_div(x: int, y: int) -> int:
    """``ceil(x / y)`` for positive integers."""
    return -(-x // y)


def align(x: int, y: int) -> int:
    """``x`` rounded up to a multiple of ``y``."""
    return ceil_div(x, y) * y


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel FP8 quantization (DeepEP's test input format).

    Args:
        x: ``[m, n]`` float tensor.
    Returns:
        ``(x_fp8 [m, n]`` float8_e4m3fn, ``scales [m, ceil(n / 128)]`` float32``): each block of
        128 channels (the last one zero-padded) is divided by ``amax / 448``, where ``amax`` is the
        block's largest absolute value, at least ``1e-4``; ``x ~= x_fp8 * scales`` blockwise.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [m, n], got shape {tuple(x.shape)}")
    m, n = x.shape
    padded = align(n, FP8_BLOCK)
    blocks = torch.nn.functional.pad(x.float(), (0, padded - n)).view(m, -1, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    q = (blocks * (FP8_E4M3_MAX / amax).unsqueeze(2)).to(torch.float8_e4m3fn)
    return q.view(m, padded)[:, :n].contiguous(), amax / FP8_E4M3_MAX


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """Undoes :func:`per_token_cast_to_fp8`: ``[m, n]`` bfloat16.

    Args:
        x_fp8: ``[m, n]`` float8_e4m3fn.
        x_scales: ``[m, ceil(n / 128)]`` float32, or DeepEP's UE8M0 form: ``int32 [m, ceil(n / 512)]``
            holding four 8-bit exponents per element (scale ``2 ** (e - 127)``).
    """
    if x_fp8.numel() == 0:
        return x_fp8.to(torch.bfloat16)
    if x_fp8.dim() != 2:
        raise ValueError(f"x_fp8 must be 2-D [m, n], got shape {tuple(x_fp8.shape)}")
    m, n = x_fp8.shape
    padded = align(n, FP8_BLOCK)
    if x_scales.dtype == torch.int32:
        exponents = x_scales.clone(memory_format=torch.contiguous_format).view(torch.uint8).to(torch.int32)
        x_scales = (exponents << 23).view(torch.float32)
    values = torch.nn.functional.pad(x_fp8.view(torch.uint8), (0, padded - n)).view(torch.float8_e4m3fn)
    blocks = values.float().view(m, -1, FP8_BLOCK) * x_scales.float().reshape(m, -1, 1)
    return blocks.view(m, padded).to(torch.bfloat16)[:, :n].contiguous()


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Replaces each row of ``x`` by its distinct non-negative values, largest first, then ``-1``.

    Args:
        x: ``[n, k]`` integer tensor with values in ``[-1, num_slots)``, modified in place;
            negative entries mean "none".
        num_slots: the value range (e.g. the number of ranks when ``x`` holds rank ids).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [n, k], got shape {tuple(x.shape)}")
    slots = x.masked_fill(x < 0, num_slots).long()
    present = torch.zeros(x.shape[0], num_slots + 1, dtype=torch.bool, device=x.device)
    present.scatter_(1, slots, True)
    ids = torch.arange(num_slots, dtype=x.dtype, device=x.device).expand(x.shape[0], -1)
    unique = torch.where(present[:, :num_slots], ids, torch.full_like(ids, -1))
    unique = unique.sort(dim=1, descending=True).values
    width = min(num_slots, x.shape[1])
    x.fill_(-1)
    x[:, :width] = unique[:, :width]


def create_grouped_scores(scores: torch.Tensor, group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Zeroes the scores of experts outside each token's selected groups.

    Args:
        scores: ``[n, E]``; experts form ``num_groups`` consecutive groups of ``E / num_groups``.
        group_idx: ``[n, g]`` int64, the groups each token may use.
    Returns:
        ``[n, E]``: ``scores`` where the expert's group is in the token's ``group_idx``, else 0.
    """
    num_tokens, num_experts = scores.shape
    selected = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
    selected.scatter_(1, group_idx, True)
    keep = selected.repeat_interleave(num_experts // num_groups, dim=1)
    return scores * keep


def hash_tensor(t: torch.Tensor) -> int:
    """The sum of ``t``'s bytes read as int32 values (a cheap fingerprint for bitwise comparisons)."""
    return int(t.view(torch.int32).sum().item())


def hash_tensors(*tensors: Any) -> int:
    """XOR of :func:`hash_tensor` over the tensors given, looking into tuples/lists, skipping others."""
    value = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            value ^= hash_tensors(*t)
        elif isinstance(t, torch.Tensor):
            value ^= hash_tensor(t)
    return value


def count_bytes(*tensors: Any) -> int:
    """Total bytes of the tensors given, looking into tuples/lists, skipping None."""
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif t is not None:
            total += t.numel() * t.element_size()
    return total
