"""ep_comm.codecs.fp8: the C++ core (csrc/codec/fp8_core.h, host build) is bit-identical to the
torch reference, accurate on normal data, and its UE8M0 scales are powers of two."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_comm.codecs import fp8


def host_cast(host_test_module, x: torch.Tensor) -> torch.Tensor:
    """The core's float -> e4m3 cast (csrc/codec/fp8_core.h, through the test-only bindings)."""
    src = x.float().contiguous().reshape(-1)
    out = torch.empty(src.numel(), dtype=torch.uint8)
    host_test_module.fp8_cast_into(src.numpy(), out.numpy())
    return out


def torch_cast(x: torch.Tensor) -> torch.Tensor:
    return x.float().reshape(-1).to(torch.float8_e4m3fn).view(torch.uint8)


def test_cast_matches_torch_on_every_bf16_value(host_test_module):
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    assert torch.equal(host_cast(host_test_module, x), torch_cast(x))


def test_cast_matches_torch_on_random_and_boundary_floats(host_test_module):
    g = torch.Generator().manual_seed(0)
    rand_bits = torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    x = rand_bits.view(torch.float32)
    assert torch.equal(host_cast(host_test_module, x), torch_cast(x))
    # every float within a few ulps of each e4m3 value, of each rounding midpoint and of 448 / 464
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].unique()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    centers = torch.cat([e4m3, mids, torch.tensor([448.0, 464.0, 480.0, 2.0**-9, 2.0**-10, 2.0**-6])])
    offsets = torch.arange(-4, 5, dtype=torch.int32)
    near = (centers.abs().view(torch.int32)[:, None] + offsets[None, :]).clamp(min=0).view(torch.float32)
    near = torch.cat([near.reshape(-1), -near.reshape(-1)])
    assert torch.equal(host_cast(host_test_module, near), torch_cast(near))


def test_decode_matches_torch_for_every_byte(host_test_module):
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = b.view(torch.float8_e4m3fn).float()
    got = torch.tensor([host_test_module.fp8_to_float(int(v)) for v in b])
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32))


def assert_same(x: torch.Tensor, round_scale: bool, use_ue8m0: bool) -> None:
    q_ref, s_ref = fp8.quantize_reference(x, round_scale, use_ue8m0)
    q, s = fp8.quantize(x, round_scale, use_ue8m0)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == s_ref.dtype and s.shape == s_ref.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))


FLAGS = [(False, False), (True, False), (True, True)]


@pytest.mark.parametrize("round_scale,use_ue8m0", FLAGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_core_matches_reference(round_scale, use_ue8m0, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 1024, generator=g) * torch.logspace(-8, 4, 37)[:, None]
    x[3, :128] = 0                    # amax below the 1e-4 floor
    x[4, 130] = float("inf")
    x[5, 600] = float("nan")
    x[6, 5] = -float("inf")
    x[7] = 1e-6
    assert_same(x.to(dtype), round_scale, use_ue8m0)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 6), groups=st.sampled_from([1, 3, 4, 8]), seed=st.integers(0, 2**31 - 1),
       log_scale=st.floats(-30, 30), flags=st.sampled_from(FLAGS), lead=st.booleans())
def test_hypothesis_core_matches_reference(rows, groups, seed, log_scale, flags, lead):
    round_scale, use_ue8m0 = flags
    if use_ue8m0 and groups % 4:
        groups = 4
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 128 * groups, generator=g) * 2.0**log_scale).bfloat16()
    if lead:
        x = x.reshape(1, rows, 128 * groups)
    assert_same(x, round_scale, use_ue8m0)


def test_random_bit_patterns_match_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-32768, 32768, (64, 512), generator=g, dtype=torch.int16).view(torch.bfloat16)
    for round_scale, use_ue8m0 in FLAGS:
        assert_same(x, round_scale, use_ue8m0)


@pytest.mark.parametrize("round_scale,use_ue8m0", FLAGS)
def test_accuracy_on_normal_data(round_scale, use_ue8m0):
    x = torch.randn(128, 7168, generator=torch.Generator().manual_seed(3)).bfloat16()
    q, s = fp8.quantize(x, round_scale, use_ue8m0)
    diff = fp8.calc_diff(fp8.dequantize(q, s), x)
    assert 0 < diff < 9e-4


def test_ue8m0_scales_are_powers_of_two():
    x = (torch.randn(16, 2048) * torch.logspace(-5, 5, 16)[:, None]).bfloat16()
    q, packed = fp8.quantize(x, round_scale=True, use_ue8m0=True)
    assert packed.dtype == torch.int32 and packed.shape == (16, 2048 // 512)
    scales = fp8.unpack_ue8m0(packed)
    assert torch.all((scales.view(torch.int32) & 0x7FFFFF) == 0)
    _, float_scales = fp8.quantize(x, round_scale=True)
    assert torch.equal(scales, float_scales)
    # a power-of-two scale never exceeds amax/448 by 2x, and covers it
    amax = x.float().reshape(16, -1, 128).abs().amax(-1).clamp(min=1e-4)
    assert torch.all(float_scales >= amax / 448) and torch.all(float_scales < amax / 224)


def test_input_unmodified_and_errors():
    x = torch.randn(4, 512).bfloat16()
    before = x.clone()
    for round_scale, use_ue8m0 in FLAGS:
        fp8.quantize(x, round_scale, use_ue8m0)
    assert torch.equal(x.view(torch.int16), before.view(torch.int16))
    with pytest.raises(ValueError, match="x"):
        fp8.quantize(torch.randn(4, 100))
    with pytest.raises(ValueError):
        fp8.quantize(torch.randn(4, 256), round_scale=True, use_ue8m0=True)  # 256 % 512 != 0


def test_zero_hidden_is_rejected_by_name():
    with pytest.raises(ValueError, match="x's last dimension must be a positive multiple of 128"):
        fp8.quantize(torch.empty(4, 0, dtype=torch.bfloat16))
    q, scales = fp8.quantize(torch.empty(0, 256, dtype=torch.bfloat16))
    assert q.shape == (0, 256) and scales.shape == (0, 2)


def test_flags_and_helpers_name_their_bad_arguments():
    import numpy as np

    x = torch.randn(2, 512)
    assert torch.equal(fp8.quantize(x, round_scale=1)[1], fp8.quantize(x, round_scale=True)[1])  # DeepEP's 0/1
    for bad in ("no", 2, None, torch.tensor(True)):
        with pytest.raises(ValueError, match="round_scale must be a bool"):
            fp8.quantize(x, round_scale=bad)
        with pytest.raises(ValueError, match="use_ue8m0 must be a bool"):
            fp8.quantize(x, round_scale=True, use_ue8m0=bad)
    q, s = fp8.quantize(x, round_scale=np.bool_(True))
    assert torch.equal(s, fp8.quantize(x, round_scale=True)[1])
    with pytest.raises(ValueError, match="x must be a dense tensor"):
        fp8.quantize(torch.eye(128).to_sparse())
    with pytest.raises(ValueError, match="q must be a tensor"):
        fp8.dequantize(None, s)
    with pytest.raises(ValueError, match="scales must be a tensor"):
        fp8.dequantize(q, [[1.0]])
    for bad in ("bfloat16", torch.int32):
        with pytest.raises(ValueError, match="dtype must be a torch floating-point dtype"):
            fp8.dequantize(q, s, bad)
    with pytest.raises(ValueError, match="last dimension is a multiple of 4"):
        fp8.pack_ue8m0(torch.ones(2, 3))
