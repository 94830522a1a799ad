"""DeepEP's FP8 cast on the GPU, bit-identical to ``ep_comm.codecs.fp8.quantize_reference`` on
the CPU (and to csrc/codec/fp8_core.h): per row and group of 128 channels, ``amax`` (NaN
propagates) clamped below at 1e-4, scale ``amax / 448`` (rounded up to a power of two with
``round_scale``; as UE8M0 exponent bytes with ``use_ue8m0``), values ``e4m3(x / scale)``.

One kernel, :func:`quantize_rows_kernel`, reads rows (optionally gathered by an index) and writes
the e4m3 bytes and scales at rows of its outputs (optionally scattered by an index): plain
quantization for ``fp8.quantize``, or fused into packing, quantizing each token straight into its
row of a message (the low-latency dispatch's send slots). The amax is a maximum of integer bits
and the cast is integer arithmetic (``bits.py``), so the interpreter and every GPU agree.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bits import BF16, F16, F32, divide_x86_bits, f32_bits_to_e4m3, group_scale_bits, to_f32
from .rowcopy import device_guard

GROUP = 128
_KINDS = {torch.bfloat16: BF16, torch.float16: F16, torch.float32: F32}

COMPILE_OPTIONS = {"num_warps": 4}
"""Launch options of :func:`quantize_rows_kernel` (also what tests/test_triton_aot.py compiles with)."""


@triton.jit
def quantize_rows_kernel(src, src_index, src_stride, q, q_index, q_stride, scales, scales_stride, num_groups,
                         SRC_KIND: tl.constexpr, SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr,
                         ROUND_SCALE: tl.constexpr, UE8M0: tl.constexpr, GROUPS: tl.constexpr):
    """Program ``(i, j)`` quantizes groups ``[j * GROUPS, (j + 1) * GROUPS)`` of row ``i``: source
    row ``src_index[i]`` (or ``i``) into row ``q_index[i]`` (or ``i``) of ``q`` (uint8) and of
    ``scales`` (float32, or uint8 exponent bytes with ``UE8M0``)."""
    i = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    channels = tl.arange(0, 128)
    group_mask = groups < num_groups
    cols = groups[:, None] * 128 + channels[None, :]
    mask = group_mask[:, None] & (channels[None, :] < 128)
    if SRC_INDEXED:
        s = tl.load(src_index + i).to(tl.int64)
    else:
        s = i.to(tl.int64)
    if DST_INDEXED:
        d = tl.load(q_index + i).to(tl.int64)
    else:
        d = i.to(tl.int64)
    value = to_f32(tl.load(src + s * src_stride + cols, mask=mask, other=0), SRC_KIND)
    amax = tl.max(value.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, axis=1)
    scale_bits = group_scale_bits(amax, ROUND_SCALE)
    scale = tl.broadcast_to(scale_bits.to(tl.float32, bitcast=True)[:, None], value.shape)
    tl.store(q + d * q_stride + cols, f32_bits_to_e4m3(divide_x86_bits(value, scale)).to(tl.uint8), mask=mask)
    if UE8M0:
        tl.store(scales + d * scales_stride + groups, ((scale_bits >> 23) & 0xFF).to(tl.uint8), mask=group_mask)
    else:
        tl.store(scales + d * scales_stride + groups, scale_bits.to(tl.float32, bitcast=True), mask=group_mask)


def supports(x: torch.Tensor) -> bool:
    """Whether the kernel takes rows of ``x``'s dtype (bf16, fp16, fp32)."""
    return x.dtype in _KINDS


def quantize_rows(x: torch.Tensor, src_index: torch.Tensor | None, q: torch.Tensor, scales: torch.Tensor,
                  dst_index: torch.Tensor | None, round_scale: bool, use_ue8m0: bool) -> None:
    """Quantizes rows ``x[src_index[i]]`` (``x [N, H]`` bf16/fp16/fp32, ``H % 128 == 0``; all of
    ``x`` without ``src_index``) into row ``dst_index[i]`` (or ``i``) of ``q [.., H]`` (uint8 or
    e4m3) and ``scales`` (``[.., H // 128]`` float32, or ``[.., H // 512]`` int32 with
    ``use_ue8m0``). Outputs may be strided views (the fields of a message's rows); each row's
    elements must be adjacent."""
    hidden = x.shape[1]
    rows = x.shape[0] if src_index is None else src_index.numel()
    num_groups = hidden // GROUP
    if rows == 0 or num_groups == 0:
        return
    if hidden > 1 and x.stride(1) != 1:
        x = x.contiguous()
    source = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    q = q.view(torch.uint8)
    scales = scales.view(torch.uint8) if use_ue8m0 else scales
    groups = min(8, triton.next_power_of_2(num_groups))
    grid = (rows, triton.cdiv(num_groups, groups))
    with device_guard(x):
        quantize_rows_kernel[grid](
            source, source if src_index is None else src_index.to(torch.int64), source.stride(0),
            q, q if dst_index is None else dst_index.to(torch.int64), q.stride(0), scales, scales.stride(0),
            num_groups, SRC_KIND=_KINDS[x.dtype], SRC_INDEXED=src_index is not None,
            DST_INDEXED=dst_index is not None, ROUND_SCALE=round_scale or use_ue8m0, UE8M0=use_ue8m0,
            GROUPS=groups, **COMPILE_OPTIONS)


def quantize(x: torch.Tensor, round_scale: bool, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``ep_comm.codecs.fp8.quantize`` of ``x [..., H]`` (arguments checked by the caller):
    ``(e4m3 [..., H], scales [..., H // 128]`` float32 or ``[..., H // 512]`` int32)."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    groups = hidden // (4 * GROUP) if use_ue8m0 else hidden // GROUP
    scales = torch.empty((*x.shape[:-1], groups), dtype=torch.int32 if use_ue8m0 else torch.float32,
                         device=x.device)
    quantize_rows(rows, None, q.view(-1, hidden), scales.view(-1, groups), None, round_scale, use_ue8m0)
    return q.view(torch.float8_e4m3fn), scales
