"""FP8 codec: DeepEP-compatible per-token, per-128-channel e4m3 quantization.

Each group of 128 consecutive channels of a row gets one scale ``s = amax / 448`` (amax clamped
below at 1e-4), and the values are stored as ``float8_e4m3fn(x / s)``. With ``round_scale`` the
scale is rounded up to a power of two, ``2 ** ceil(log2(amax / 448))``; with ``use_ue8m0`` those
power-of-two scales are stored as their biased exponent byte (UE8M0), four per int32, channel
group ``4i + j`` in byte ``j`` (least significant first).
"""
from __future__ import annotations

import torch

GROUP = 128
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def _check(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} must be bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % GROUP != 0:
        raise ValueError(f"{name}'s last dimension must be a multiple of {GROUP}, got shape "
                         f"{tuple(x.shape)}")


def quantize(x: torch.Tensor, round_scale: bool = False,
             use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x [..., H]`` (bf16/fp16/fp32, ``H % 128 == 0``).

    Returns:
        ``(q [..., H]`` float8_e4m3fn, ``scales)``: ``[..., H // 128]`` float32, or with
        ``use_ue8m0`` ``[..., H // 512]`` int32 (UE8M0 bytes packed four per int32).
    """
    _check(x)
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True needs round_scale=True (UE8M0 holds powers of two only)")
    if use_ue8m0 and x.shape[-1] % (4 * GROUP) != 0:
        raise ValueError(f"use_ue8m0 packs 4 scales per int32: the hidden size must be a multiple "
                         f"of {4 * GROUP}, got {x.shape[-1]}")
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    scale = amax / E4M3_MAX
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (groups / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(x.shape)
    if use_ue8m0:
        return q, pack_ue8m0(scale)
    return q, scale.contiguous()


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """``[..., G]`` float32 powers of two -> ``[..., G // 4]`` int32 of biased exponent bytes."""
    exponent = (scale.contiguous().view(torch.int32) >> 23) & 0xFF
    # four exponent bytes side by side are one little-endian int32
    as_bytes = exponent.to(torch.uint8).reshape(*scale.shape[:-1], scale.shape[-1] // 4, 4)
    return as_bytes.contiguous().view(torch.int32).squeeze(-1)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """``[..., G // 4]`` int32 -> ``[..., G]`` float32 power-of-two scales."""
    exponent = packed.contiguous().view(torch.uint8).to(torch.int32)  # [..., G]
    return (exponent << 23).view(torch.float32)


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q [..., H]`` e4m3 and ``scales`` (float32 ``[..., H//128]`` or packed UE8M0 int32
    ``[..., H//512]``) -> ``[..., H]`` of ``dtype``."""
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q must be float8_e4m3fn, got {q.dtype}")
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    elif scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 or packed UE8M0 int32, got {scales.dtype}")
    groups = q.shape[-1] // GROUP
    if q.shape[-1] % GROUP or tuple(scales.shape) != (*q.shape[:-1], groups):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match q {tuple(q.shape)}")
    x = q.float().reshape(*q.shape[:-1], groups, GROUP) * scales.unsqueeze(-1)
    return x.reshape(q.shape).to(dtype)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity error: ``1 - 2 <x, y> / (<x, x> + <y, y>)`` in float64."""
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if float(denominator) == 0.0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)
