"""Float conversions done on the bits, so that Triton's interpreter and every GPU give the CPU
reference's results.

Triton's interpreter gets float32 -> bf16 (it truncates) and float -> fp8 casts wrong, and bf16
arithmetic is unreliable on some AMD compilers; integer arithmetic is exact everywhere. So the
kernels load bf16 as int16 bits and widen them by a shift, round float32 to bf16 and to e4m3 with
integer operations, and divide with ``div_rn`` (Triton's ``/`` is an approximate division on
NVIDIA GPUs). Every helper here works elementwise on tensors of any shape.

Row dtype codes (``KIND`` constexprs of the kernels): :data:`BF16` (rows passed as int16 bits),
:data:`F16`, :data:`F32`.
"""
from __future__ import annotations

import struct

import triton
import triton.language as tl

BF16 = 0
F16 = 1
F32 = 2

AMAX_FLOOR_BITS = tl.constexpr(struct.unpack("<I", struct.pack("<f", 1e-4))[0])
"""The float32 bits of fp8's amax floor (1e-4 rounded to float32, as the reference clamps)."""


@triton.jit
def bf16_bits_to_f32(bits):
    """int16 bf16 bits -> float32 (exact)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def to_f32(value, KIND: tl.constexpr):
    """A loaded row value of kind ``KIND`` (bf16 as int16 bits, fp16, fp32) -> float32 (exact)."""
    if KIND == 0:
        return bf16_bits_to_f32(value)
    else:
        return value.to(tl.float32)


@triton.jit
def f32_to_bf16_bits(value):
    """float32 -> int16 bf16 bits, rounded to nearest even; NaN -> 0x7FC0 with the NaN's sign."""
    u = value.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out = tl.where(nan, ((u >> 16) & 0x8000) | 0x7FC0, rounded)
    return out.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def from_f32(value, KIND: tl.constexpr):
    """float32 -> a row value of kind ``KIND`` (bf16 as int16 bits, fp16, fp32), rounded to
    nearest even."""
    if KIND == 0:
        return f32_to_bf16_bits(value)
    elif KIND == 1:
        return value.to(tl.float16, fp_downcast_rounding="rtne")
    else:
        return value


@triton.jit
def is_nan_bits(u):
    """Whether uint32 float bits hold a NaN."""
    return (u & 0x7FFFFFFF) > 0x7F800000


@triton.jit
def divide_x86_bits(x, scale):
    """``x / scale`` (float32, correctly rounded) as uint32 bits, with the NaN an x86 CPU gives
    (the reference's): a NaN operand comes back quieted (``x`` first), an invalid operation
    (inf / inf) gives the "indefinite" NaN 0xFFC00000."""
    r = tl.math.div_rn(x, scale).to(tl.uint32, bitcast=True)
    xb = x.to(tl.uint32, bitcast=True)
    sb = scale.to(tl.uint32, bitcast=True)
    nan_fix = tl.where(is_nan_bits(xb), xb | 0x400000, tl.where(is_nan_bits(sb), sb | 0x400000, 0xFFC00000))
    return tl.where(is_nan_bits(r), nan_fix, r)


@triton.jit
def f32_bits_to_e4m3(u):
    """uint32 float32 bits -> float8_e4m3fn bits (uint32 in [0, 255]): round to nearest even,
    magnitudes >= 448 (and infinities) saturate to 448, NaN -> 0x7F with the NaN's sign; the
    cast of the reference (ep_comm/codecs/fp8.py) and of csrc/codec/fp8_core.h."""
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # normal e4m3 (a >= 2^-6): rebias the exponent 127 -> 7, round the 20 dropped bits
    w = a - (120 << 23)
    normal = (w + 0x7FFFF + ((w >> 20) & 1)) >> 20
    # subnormal e4m3, m * 2^-9: float exponents 117..120 (shifts 24..21); below rounds to zero
    exponent = (a >> 23).to(tl.int32)
    shift = tl.minimum(tl.maximum(141 - exponent, 21), 24).to(tl.uint32)
    mantissa = (a & 0x7FFFFF) | 0x800000
    q = mantissa >> shift
    rest = mantissa & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rest > half) | ((rest == half) & ((q & 1) == 1))
    subnormal = tl.where(exponent >= 117, q + up.to(tl.uint32), 0)
    magnitude = tl.where(a > 0x7F800000, 0x7F,
                         tl.where(a >= 0x43E00000, 0x7E, tl.where(a >= 0x3C800000, normal, subnormal)))
    return sign | magnitude


@triton.jit
def group_scale_bits(amax_bits, ROUND_SCALE: tl.constexpr):
    """An fp8 group's scale (uint32 float32 bits) from its amax's bits: a NaN amax gives the
    canonical NaN; else ``max(amax, 1e-4) / 448``, with ``ROUND_SCALE`` rounded up to a power of
    two on the bits (infinity passes through)."""
    clamped = tl.maximum(amax_bits, AMAX_FLOOR_BITS).to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(clamped, tl.full(clamped.shape, 448.0, tl.float32)).to(tl.uint32, bitcast=True)
    if ROUND_SCALE:
        scale = tl.where((scale & 0x7F800000) == 0x7F800000, scale, (scale + 0x7FFFFF) & 0xFF800000)
    return tl.where(is_nan_bits(amax_bits), 0x7FC00000, scale)
