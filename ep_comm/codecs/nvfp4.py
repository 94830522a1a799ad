"""NVFP4 codec: e2m1 values, one e4m3 (UE4M3) scale per 16 values, and a per-tensor global scale.

A row ``x [H]`` (``H % 16 == 0``) with the global scale ``g`` (float32; usually
``448 * 6 / amax(x)`` over the whole tensor, so every block scale fits e4m3) is stored as:

- per block of 16 values with ``amax_b`` its largest magnitude: the scale
  ``s_b = e4m3(min(g * amax_b / 6, 448))`` (round to nearest even);
- per value: ``q = e2m1(x * g / s_b)`` (0 where ``s_b == 0``), the nearest of
  ``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` (ties to the even code, magnitudes above 6 saturate), as a
  4-bit code (bit 3 the sign, kept for values that round to zero as IEEE rounding does; bits
  0-2 the magnitude's index), two codes per byte: value ``2i``
  in the low nibble of byte ``i``, value ``2i + 1`` in the high nibble;
- decoded as ``q * s_b / g``.

The rounding is exact float32 arithmetic (a GPU quantizer that uses approximate reciprocals can
differ by one code where a value lies on a rounding boundary). :func:`reference_quantize` computes
the same codes independently (nearest value by search, float64); tests compare the two and bound
the error of :func:`dequantize` by the e2m1 spacing.
"""
from __future__ import annotations

import torch

BLOCK = 16
"""Values per scale."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitude of code ``c & 7``."""
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROUND_UP_ON_TIE = (False, True, False, True, False, True, False)
"""At midpoint ``i`` (between codes ``i`` and ``i + 1``) a tie goes to the even code."""


def _check(x: object, name: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} must be bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"{name}'s last dimension must be a positive multiple of {BLOCK}, got shape "
                         f"{tuple(x.shape)}")
    return x


def check_global_scale(global_scale: object, name: str = "x_global_scale") -> torch.Tensor:
    """A float32 tensor of one element (0-d or ``[1]``); returned 0-d."""
    if not isinstance(global_scale, torch.Tensor) or global_scale.dtype != torch.float32 \
            or global_scale.numel() != 1:
        shown = (f"{global_scale.dtype} tensor of shape {tuple(global_scale.shape)}"
                 if isinstance(global_scale, torch.Tensor) else type(global_scale).__name__)
        raise ValueError(f"{name} must be a float32 tensor of one element (the NVFP4 global scale), got {shown}")
    return global_scale.reshape(())


def global_scale_of(x: torch.Tensor) -> torch.Tensor:
    """``448 * 6 / amax(x)`` as a 0-d float32 tensor (1 where ``x`` is all zeros): the global
    scale that puts the largest block scale at the top of e4m3's range."""
    amax = _check(x).abs().amax().float()
    return torch.where(amax > 0, (E4M3_MAX * E2M1_MAX) / amax, torch.ones_like(amax))


def _block_scales(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``[..., H/16]`` e4m3 block scales of ``x [..., H]`` (float32)."""
    amax = x.unflatten(-1, (-1, BLOCK)).abs().amax(-1)
    return (g * (amax / E2M1_MAX)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)


def quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x [..., H]`` (bf16/fp16/fp32, ``H % 16 == 0``) with the global scale (float32,
    one element, on ``x``'s device). Device ops only (no host round trip).

    Returns:
        ``(packed [..., H/2]`` uint8, two e2m1 codes per byte, ``scales [..., H/16]``
        float8_e4m3fn``)``.
    """
    x = _check(x).float()
    g = check_global_scale(global_scale, "global_scale").to(x.device)
    scales = _block_scales(x, g)
    s = scales.float().repeat_interleave(BLOCK, dim=-1)
    factor = torch.where(s > 0, g / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    v = x * factor
    a = v.abs()
    code = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for mid, up in zip(_MIDPOINTS, _ROUND_UP_ON_TIE):
        code += ((a > mid) | ((a == mid) & up)).to(torch.uint8)
    code |= torch.signbit(v).to(torch.uint8) << 3
    pairs = code.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4), scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``packed [..., H/2]`` uint8 and ``scales [..., H/16]`` float8_e4m3fn back to ``[..., H]``
    ``dtype`` (``q * s_b / g`` in float32)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError("packed must be a uint8 tensor (two e2m1 codes per byte)")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float8_e4m3fn:
        raise ValueError("scales must be a float8_e4m3fn tensor")
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * BLOCK != packed.shape[-1] * 2:
        raise ValueError(f"scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)}: "
                         f"one scale per {BLOCK} values ({BLOCK // 2} bytes)")
    g = check_global_scale(global_scale, "global_scale").to(packed.device)
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    values = table[(codes & 7).long()] * (1 - 2 * (codes >> 3).float())
    return (values * scales.float().repeat_interleave(BLOCK, dim=-1) / g).to(dtype)


def reference_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` computed another way (float64, each value's code chosen by searching the
    e2m1 values for the nearest, ties to the even code): for tests."""
    x = _check(x).double().cpu()
    g = float(check_global_scale(global_scale, "global_scale"))
    scales = _block_scales(x.float(), torch.tensor(g, dtype=torch.float32))
    s = scales.double().repeat_interleave(BLOCK, dim=-1)
    v = torch.where(s > 0, x.float() * (torch.tensor(g, dtype=torch.float32) / s.float().clamp(min=1e-30)),
                    x.float() * 0.0).double()  # a zero scale zeroes the block, keeping each sign
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    dist = (v.abs().unsqueeze(-1) - grid).abs()  # [..., H, 8]
    best = dist.min(-1, keepdim=True).values
    candidates = dist == best
    even = candidates & (torch.arange(8) % 2 == 0)
    pick = torch.where(even.any(-1, keepdim=True), even, candidates)
    magnitude = pick.to(torch.int64).argmax(-1)  # the one candidate, or the even one of a tie
    magnitude = torch.where(v.abs() > E2M1_MAX, torch.full_like(magnitude, 7), magnitude)
    code = (magnitude | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)
    pairs = code.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4), scales


def swizzled_scale_shape(rows: int, hidden: int) -> tuple[int, int]:
    """``(rm, rk)`` of the 128x4 swizzled scale layout for ``rows`` rows of ``hidden`` values:
    ``rm = ceil(rows / 128)`` row tiles, ``rk = ceil(hidden / 16 / 4)`` scale-column tiles."""
    return -(-rows // 128), -(-(hidden // BLOCK) // 4)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales ``[L, M, H/16]`` in the 128x4 tiled layout the NVFP4 grouped GEMMs read
    (CUTLASS / cuBLAS block-scaled operands): a contiguous ``[L, rm, rk, 32, 4, 4]`` tensor where
    scale ``(l, m, k)`` sits at ``[l, m // 128, k // 4, m % 32, (m % 128) // 32, k % 4]``, padding
    zero; returned as the view ``[32, 4, rm, 4, rk, L]`` (dims ``m % 32, (m % 128) // 32, m //
    128, k % 4, k // 4, l``) that DeepEP's NVFP4 low-latency dispatch returns."""
    num_local, rows, cols = scales.shape
    rm, rk = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(num_local, rm * 128, rk * 4, dtype=scales.dtype, device=scales.device)
    padded[:, :rows, :cols] = scales
    tiles = padded.view(num_local, rm, 4, 32, rk, 4).permute(0, 1, 4, 3, 2, 5).contiguous()
    return tiles.permute(3, 4, 1, 5, 2, 0)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The inverse of :func:`swizzle_scales`: ``[32, 4, rm, 4, rk, L]`` back to ``[L, rows, cols]``."""
    tiles = swizzled.permute(5, 2, 4, 0, 1, 3)  # [L, rm, rk, 32, 4, 4]
    num_local, rm, rk = tiles.shape[:3]
    flat = tiles.permute(0, 1, 4, 3, 2, 5).reshape(num_local, rm * 128, rk * 4)
    return flat[:, :rows, :cols]


ROW_ALIGN = 256
"""Bytes a compact wire row is padded to (a multiple of 128 bf16 words, as every path's rows)."""


def pack_rows(x: torch.Tensor, global_scale: torch.Tensor, row_bytes: int | None = None) -> torch.Tensor:
    """``x [N, H]`` quantized and packed for a low-latency dispatch: per row the ``H/2`` code
    bytes, the ``H/16`` e4m3 scale bytes, zero padding to ``row_bytes`` (default: the next
    multiple of :data:`ROW_ALIGN`); returned as ``[N, row_bytes / 2]`` bf16 words, which every
    path moves bit for bit. Device ops only."""
    hidden = int(x.shape[1])
    if hidden % BLOCK:
        raise ValueError(f"use_nvfp4 needs a hidden size divisible by {BLOCK}, got {hidden}")
    packed, scales = quantize(x, global_scale.to(x.device))
    used = hidden // 2 + hidden // BLOCK
    width = -(-used // ROW_ALIGN) * ROW_ALIGN if row_bytes is None else row_bytes
    if width < used or width % 2:
        raise ValueError(f"row_bytes ({row_bytes}) must be even and hold the {used} packed bytes of a row")
    wire = torch.zeros(x.shape[0], width, dtype=torch.uint8, device=x.device)
    wire[:, :hidden // 2] = packed
    wire[:, hidden // 2:used] = scales.view(torch.uint8)
    return wire.view(torch.bfloat16)


def receive_tensors(area: torch.Tensor, hidden: int):
    """The NVFP4 dispatch's outputs for received :func:`pack_rows` rows ``area [L, R*T, W]`` bf16
    words: ``(packed [R*T, H/2, L]`` uint8, a view of a contiguous ``[L, R*T, H/2]``, ``scales
    [32, 4, rm, 4, rk, L]`` float8_e4m3fn, :func:`swizzle_scales`'s layout``)``, and the callable
    that fills them once the rows have arrived (device ops only)."""
    num_local, slots = area.shape[0], area.shape[1]
    raw = area.view(torch.uint8)
    half, groups = hidden // 2, hidden // BLOCK
    packed = torch.empty(num_local, slots, half, dtype=torch.uint8, device=area.device)
    rm, rk = swizzled_scale_shape(slots, hidden)
    tiles = torch.empty(num_local, rm, rk, 32, 4, 4, dtype=torch.uint8, device=area.device)

    def unpack() -> None:
        packed.copy_(raw[..., :half])
        tiles.copy_(swizzle_scales(raw[..., half:half + groups]).permute(5, 2, 4, 0, 1, 3))

    return (packed.permute(1, 2, 0), tiles.permute(3, 4, 1, 5, 2, 0).view(torch.float8_e4m3fn)), unpack
