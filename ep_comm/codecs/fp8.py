"""FP8 codec: DeepEP-compatible per-token, per-128-channel e4m3 quantization.

Each group of 128 consecutive channels of a row gets one scale ``s = amax / 448`` (amax clamped
below at 1e-4), and the values are stored as ``float8_e4m3fn(x / s)``. With ``round_scale`` the
scale is rounded up to a power of two, ``2 ** ceil(log2(amax / 448))``; with ``use_ue8m0`` those
power-of-two scales are stored as their biased exponent byte (UE8M0), four per int32, channel
group ``4i + j`` in byte ``j`` (least significant first).
"""
from __future__ import annotations

import torch

from .. import row_kernels
from . import device_kernels

try:
    from ep_comm import _host
except ImportError:  # pragma: no cover - the host build is part of every install
    _host = None

GROUP = 128
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def _check(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} must be bf16, fp16 or fp32, got {x.dtype}")
    if x.layout != torch.strided or x.device.type == "meta":
        raise ValueError(f"{name} must be a dense tensor with data, got layout {x.layout} on {x.device}")
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % GROUP != 0:
        raise ValueError(f"{name}'s last dimension must be a positive multiple of {GROUP}, got shape "
                         f"{tuple(x.shape)}")


def quantize(x: torch.Tensor, round_scale: bool = False,
             use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x [..., H]`` (bf16/fp16/fp32, ``H % 128 == 0``).

    Returns:
        ``(q [..., H]`` float8_e4m3fn, ``scales)``: ``[..., H // 128]`` float32, or with
        ``use_ue8m0`` ``[..., H // 512]`` int32 (UE8M0 bytes packed four per int32).
    """
    _check(x)
    _check_flags(x, round_scale, use_ue8m0)
    round_scale, use_ue8m0 = bool(round_scale), bool(use_ue8m0)
    if _host is not None and x.device.type == "cpu":
        return _quantize_host(x, round_scale, use_ue8m0)
    if x.dtype == torch.bfloat16 and device_kernels.codec_kernels(x.device) is not None:
        return _quantize_device(x, round_scale, use_ue8m0)
    if row_kernels.usable(x):  # the Triton kernel (AMD, or NVIDIA without the CUDA build): the same bits
        quantized = row_kernels.quantize(x, round_scale, use_ue8m0)
        if quantized is not None:
            return quantized
    return quantize_reference(x, round_scale, use_ue8m0)


def _scales_like(x: torch.Tensor, use_ue8m0: bool) -> torch.Tensor:
    """Uninitialised scales for ``x [..., H]``: ``[..., H // 128]`` float32, or with ``use_ue8m0``
    ``[..., H // 512]`` int32, on ``x``'s device."""
    hidden = x.shape[-1]
    if use_ue8m0:
        return torch.empty((*x.shape[:-1], hidden // (4 * GROUP)), dtype=torch.int32, device=x.device)
    return torch.empty((*x.shape[:-1], hidden // GROUP), dtype=torch.float32, device=x.device)


def _quantize_device(x: torch.Tensor, round_scale: bool, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize`` of a bf16 CUDA tensor by the CUDA kernel (csrc/cuda/fp8_kernels.cu, the same
    core as the host build); bit-identical to ``quantize_reference``."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    src = x.detach().contiguous()
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = _scales_like(x, use_ue8m0)
    if rows:
        with device_kernels.launch_context(x.device):
            device_kernels.codec_kernels(x.device).fp8_quantize(
                src.data_ptr(), rows, hidden, round_scale, use_ue8m0, q.data_ptr(), scales.data_ptr(),
                device_kernels.current_stream(x.device))
    return q.view(torch.float8_e4m3fn), scales


def _check_flags(x: torch.Tensor, round_scale: bool, use_ue8m0: bool) -> None:
    for name, flag in (("round_scale", round_scale), ("use_ue8m0", use_ue8m0)):  # bools, NumPy bools, 0 or 1
        numpy_bool = type(flag).__module__ == "numpy" and type(flag).__name__ in ("bool", "bool_")
        if not (numpy_bool or (isinstance(flag, int) and flag in (0, 1))):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True needs round_scale=True (UE8M0 holds powers of two only)")
    if use_ue8m0 and x.shape[-1] % (4 * GROUP) != 0:
        raise ValueError(f"use_ue8m0 packs 4 scales per int32: the hidden size must be a multiple "
                         f"of {4 * GROUP}, got {x.shape[-1]}")


def _quantize_host(x: torch.Tensor, round_scale: bool, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize`` on the CPU through the C++ core (csrc/codec/fp8_core.h); bit-identical to
    ``quantize_reference``."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    if x.dtype == torch.bfloat16:
        src = x.detach().contiguous().view(torch.int16).reshape(-1).numpy()
    else:
        src = x.detach().float().contiguous().reshape(-1).numpy()  # fp16 -> fp32 is exact
    q = torch.empty(x.shape, dtype=torch.uint8)
    scales = _scales_like(x, use_ue8m0)
    _host.fp8_quantize(src, rows, hidden, round_scale, use_ue8m0, q.reshape(-1).numpy(),
                       scales.reshape(-1).numpy())
    return q.view(torch.float8_e4m3fn), scales


def pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(scale))`` of positive float32 ``scale`` (any shape), exactly: computed on the
    bits (a mantissa other than zero rounds the exponent up), as DeepEP's kernels do; NaN and inf
    pass through."""
    b = scale.contiguous().view(torch.int32)
    rounded = ((b + 0x7FFFFF) & -0x800000).view(torch.float32)  # -0x800000 == 0xFF800000 as int32
    return torch.where(torch.isfinite(scale), rounded, scale)


def quantize_reference(x: torch.Tensor, round_scale: bool = False,
                       use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The pure-torch ``quantize`` (any device): the reference the C++/CUDA core is tested against."""
    _check(x)
    _check_flags(x, round_scale, use_ue8m0)
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    scale = amax / E4M3_MAX
    if round_scale:
        scale = pow2_ceil(scale)
    q = (groups / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(x.shape)
    if use_ue8m0:
        return q, pack_ue8m0(scale)
    return q, scale.contiguous()


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """``[..., G]`` float32 powers of two -> ``[..., G // 4]`` int32 of biased exponent bytes."""
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.dim() < 1 \
            or scale.shape[-1] % 4:
        got = (f"{scale.dtype} of shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor)
               else type(scale).__name__)
        raise ValueError(f"scale must be a float32 tensor whose last dimension is a multiple of 4, got {got}")
    exponent = (scale.contiguous().view(torch.int32) >> 23) & 0xFF
    # four exponent bytes side by side are one little-endian int32
    as_bytes = exponent.to(torch.uint8).reshape(*scale.shape[:-1], scale.shape[-1] // 4, 4)
    return as_bytes.contiguous().view(torch.int32).squeeze(-1)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """``[..., G // 4]`` int32 -> ``[..., G]`` float32 power-of-two scales."""
    # a fresh row-major copy: .contiguous() keeps a column-major view whose last dimension has
    # one element (DeepEP's scale layout), which .view(uint8) cannot widen
    exponent = packed.clone(memory_format=torch.contiguous_format).view(torch.uint8).to(torch.int32)  # [..., G]
    return (exponent << 23).view(torch.float32)


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q [..., H]`` e4m3 and ``scales`` (float32 ``[..., H//128]`` or packed UE8M0 int32
    ``[..., H//512]``) -> ``[..., H]`` of ``dtype``."""
    for name, t in (("q", q), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a torch floating-point dtype, got {dtype!r}")
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
