"""Triton kernels for the portable path's row work on GPUs (one source for AMD and NVIDIA), and
the switch that sends CUDA/ROCm tensors to them.

On GPU tensors the portable path (``normal.py``, ``low_latency.py``, ``hierarchical.py``) does its
row work through ``ep_comm.rows``, ``ep_comm.payload`` and ``ep_comm.codecs.fp8``; those call this
package when :func:`usable` says so, and keep their torch operations otherwise (CPU tensors,
Triton absent, or ``EP_COMM_TRITON=0``). The kernels:

- ``rowcopy.py``: row gathers and scatters: a message's blocks packed in one launch per field, the
  received blocks unpacked (concatenated) into the normal mode's ``[M, W]`` fields, rows placed
  into the low-latency ``[L, R*T, H]`` slots (``rows.copy_rows``);
- ``fp8.py``: DeepEP's FP8 cast (plain, or fused into packing rows by destination);
- ``reduce.py``: combine's per-token sums in a fixed order (deterministic; ``index_add_`` on a
  GPU sums with atomics in any order);
- ``bits.py``: the float conversions they share, done on the bits.

Each gives the CPU reference's bits. Tests run every kernel under Triton's interpreter and compile
every kernel for gfx942, gfx950, sm_90 and sm_100 (tests/test_triton_kernels.py,
tests/test_triton_aot.py). Importing this package does not import Triton; the first GPU call does.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

SWITCH = "EP_COMM_TRITON"
"""Environment variable: ``0`` keeps GPU row work on torch operations."""

_triton_ok: bool | None = None


def _triton_importable() -> bool:
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
        except ImportError:
            _triton_ok = False
        else:
            _triton_ok = True
    return _triton_ok


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: all on a CUDA/ROCm GPU, Triton importable, and
    ``EP_COMM_TRITON`` not ``0``."""
    if not tensors or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return False
    return os.environ.get(SWITCH, "1") != "0" and _triton_importable()


def copy_rows(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor) -> bool:
    """``dst[dst_index[i]] = src[src_index[i]]`` (``rows.copy_rows``'s contract); False when the
    tensors' layouts are not the kernel's (2-D, each row's elements adjacent)."""
    if dst.dim() != 2 or src.dim() != 2 or any(t.shape[1] > 1 and t.stride(1) != 1 for t in (dst, src)):
        return False
    if dst.is_neg() or src.is_neg() or dst.is_conj() or src.is_conj():
        return False
    from . import rowcopy

    rowcopy.copy_rows(dst, dst_index, src, src_index)
    return True


def pack_blocks(data: torch.Tensor, blocks: Sequence[tuple[int, int, int]], source: torch.Tensor,
                index: torch.Tensor | None) -> None:
    """One field's blocks of a message, in one launch (``rowcopy.pack_blocks``)."""
    from . import rowcopy

    rowcopy.pack_blocks(data, blocks, source, index)


def zero_ranges(data: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> None:
    """Zeros byte ranges of a message in one operation (``rowcopy.zero_ranges``)."""
    from . import rowcopy

    rowcopy.zero_ranges(data, ranges)


def concat_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat`` of received row blocks in one launch; None when they are not views of one
    buffer (``rowcopy.concat_rows``)."""
    from . import rowcopy

    return rowcopy.concat_rows(parts)


def reduce_by_source(blocks: Sequence[torch.Tensor], token_index: torch.Tensor, num_tokens: int,
                     bias: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``rows.reduce_by_source``'s sum; None when the kernel does not take these rows."""
    from . import reduce

    return reduce.reduce_by_source(blocks, token_index, num_tokens, bias)


def weighted_sum_by_token(rows: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor,
                          num_tokens: int) -> torch.Tensor | None:
    """``rows.weighted_sum_by_token``'s sum (float32); None when the kernel does not take these rows."""
    from . import reduce

    if not reduce.supports(rows.dtype):
        return None
    return reduce.weighted_sum_by_token(rows, order, tokens, weights, num_tokens)


def quantize(x: torch.Tensor, round_scale: bool, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``codecs.fp8.quantize`` (arguments already checked); None for a dtype the kernel does not take."""
    from . import fp8

    if not fp8.supports(x):
        return None
    return fp8.quantize(x, round_scale, use_ue8m0)


def quantize_rows(x: torch.Tensor, src_index: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                  dst_index: torch.Tensor, round_scale: bool, use_ue8m0: bool) -> None:
    """Packs rows by destination fused with the FP8 cast: ``x[src_index[i]]`` (bf16/fp16/fp32)
    quantized into row ``dst_index[i]`` of ``q`` and ``scales`` (``fp8.quantize_rows``)."""
    from . import fp8

    if not fp8.supports(x):
        raise ValueError(f"x must be bf16, fp16 or fp32 to be quantized, got {x.dtype}")
    fp8.quantize_rows(x, src_index, q, scales, dst_index, round_scale, use_ue8m0)
