"""NVFP4 codec (ep_comm.codecs.nvfp4) against its float64 reference and the e2m1 spacing, and the
NVFP4 low-latency dispatch (``use_nvfp4=True, x_global_scale=...``) on 2 and 4 gloo ranks."""
from __future__ import annotations

import pytest
import torch
from support.rank_cases import make_routing, make_x

import ep_comm
from ep_comm import reference
from ep_comm.codecs import nvfp4
from ep_comm.paths import FusedKernelPath, LowLatencyDispatchCall
from ep_comm.placement import ExpertPlacement

MAX_TOKENS = 8


def _samples() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(4, 256, generator=g) * 10 ** torch.randint(-3, 4, (4, 1), generator=g),
            torch.zeros(1, 256),  # an all-zero row: zero scales, zero codes
            torch.linspace(-7, 7, 256).unsqueeze(0)]
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                         0.1])  # amax 6: scale g * 1 is exact, so these lie on the rounding midpoints
    rows.append(ties.repeat(16).unsqueeze(0))
    return torch.cat(rows).to(torch.bfloat16)


def test_quantize_matches_reference_bit_for_bit() -> None:
    x = _samples()
    for g in (nvfp4.global_scale_of(x), torch.tensor(1.0), torch.tensor([448.0 * 6 / 7.0])):
        packed, scales = nvfp4.quantize(x, g)
        ref_packed, ref_scales = nvfp4.reference_quantize(x, g)
        assert packed.dtype == torch.uint8 and packed.shape == (x.shape[0], x.shape[1] // 2)
        assert scales.dtype == torch.float8_e4m3fn and scales.shape == (x.shape[0], x.shape[1] // 16)
        assert torch.equal(packed, ref_packed)
        assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))


def test_ties_round_to_the_even_code() -> None:
    ties = _samples()[-1:, :16]
    packed, scales = nvfp4.quantize(ties, torch.tensor(1.0))
    assert float(scales[0, 0].float()) == 1.0  # amax 6 -> block scale 1
    back = nvfp4.dequantize(packed, scales, torch.tensor(1.0), torch.float32)[0]
    assert back.tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, 0.0]


def _half_gap(magnitude: torch.Tensor) -> torch.Tensor:
    """Half the distance between the e2m1 values around ``magnitude`` (in block-scale units)."""
    return torch.where(magnitude < 2, 0.25, torch.where(magnitude < 4, 0.5, 1.0))


def test_dequantize_error_is_within_the_e2m1_spacing() -> None:
    g0 = torch.Generator().manual_seed(9)
    x = (torch.randn(64, 512, generator=g0) * torch.rand(64, 1, generator=g0) * 30).to(torch.bfloat16)
    g = nvfp4.global_scale_of(x)
    packed, scales = nvfp4.quantize(x, g)
    back = nvfp4.dequantize(packed, scales, g, torch.float32)
    unit = scales.float().repeat_interleave(16, dim=1) / g  # one e2m1 step of 1.0 in x's units
    v = x.float() / unit  # x in block-scale units
    # a value rounds to a neighbour on the e2m1 grid (at most half the gap away), or saturates at
    # 6, which the e4m3 rounding of the scale (3 mantissa bits: relative 1/16) keeps within 0.4
    bound = torch.where(v.abs() > 6, v.abs() - 6, _half_gap(v.abs())) * unit
    err = (back - x.float()).abs()
    slack = 1e-5 * 6 * unit  # float32 rounding of x * g / s (a few ulps of the block's largest value)
    assert bool((err <= bound + slack).all()), float((err - bound).max())
    assert float((v.abs() - 6).clamp(min=0).max()) <= 6 / (1 - 1 / 16) - 6
    # and overall: the relative error of a block is at most 1/4 of its largest value (half the
    # largest gap, 1, over 6, with the scale's rounding)
    blocks = (back - x.float()).unflatten(1, (-1, 16)).abs().amax(-1)
    assert bool((blocks <= x.float().unflatten(1, (-1, 16)).abs().amax(-1) / 4 + 1e-12).all())


def test_swizzled_scales_layout() -> None:
    scales = torch.arange(3 * 200 * 9, dtype=torch.float32).reshape(3, 200, 9).to(torch.float8_e4m3fn)
    swz = nvfp4.swizzle_scales(scales)
    rm, rk = nvfp4.swizzled_scale_shape(200, 9 * 16)
    assert swz.shape == (32, 4, rm, 4, rk, 3) == (32, 4, 2, 4, 3, 3)
    assert swz.permute(5, 2, 4, 0, 1, 3).is_contiguous()
    for l_, m, k in ((0, 0, 0), (1, 37, 5), (2, 199, 8), (2, 130, 4)):
        assert swz[m % 32, (m % 128) // 32, m // 128, k % 4, k // 4, l_].view(torch.uint8) == \
            scales[l_, m, k].view(torch.uint8)
    assert torch.equal(nvfp4.unswizzle_scales(swz, 200, 9).view(torch.uint8), scales.view(torch.uint8))


def test_bad_arguments() -> None:
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4.quantize(x, torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.zeros(2, 24), torch.tensor(1.0))


def _nvfp4_case(rank, world, group, experts, topk, hidden, tokens):
    n = tokens[rank]
    idx, w = make_routing(rank, 17, n, experts, topk, 0.2)
    x = make_x(rank, 17, n, hidden, torch.bfloat16)
    g = torch.tensor(448.0 * 6 / 5.0)  # one global scale for the job, as the engines pass it
    buf = ep_comm.Buffer(group, low_latency_mode=True)
    recv_x, count, handle, _, hook = buf.low_latency_dispatch(x, idx, MAX_TOKENS, experts, use_nvfp4=True,
                                                              x_global_scale=g, return_recv_hook=True)
    hook()
    codec = buf.last_stats.codec
    packed, scales = recv_x
    slots = world * MAX_TOKENS
    layout = dict(packed_shape=tuple(packed.shape), packed_stride=packed.stride(), packed_dtype=packed.dtype,
                  scales_shape=tuple(scales.shape), scales_dtype=scales.dtype,
                  scales_contiguous_as_tiles=scales.permute(5, 2, 4, 0, 1, 3).is_contiguous())
    rows = packed.permute(2, 0, 1)  # [L, R*T, H/2]
    row_scales = nvfp4.unswizzle_scales(scales, slots, hidden // 16)
    expert_in = nvfp4.dequantize(rows, row_scales, g)
    y = (expert_in.float() * 0.5).to(torch.bfloat16)
    combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
    return dict(x=x, idx=idx, w=w, g=g, rows=rows.clone(), row_scales=row_scales.clone(), count=count.tolist(),
                y=y, combined=combined, layout=layout, plan=str(buf.path_plan.last["low_latency_dispatch"]),
                codec=codec)


@pytest.mark.parametrize("world,experts,topk,hidden,tokens", [
    (2, 4, 2, 128, (5, 8)),
    (4, 8, 3, 96, (8, 0, 3, 6)),
])
def test_low_latency_dispatch_nvfp4(ranks, world, experts, topk, hidden, tokens):
    out = ranks(world, _nvfp4_case, experts, topk, hidden, tokens)
    placement = ExpertPlacement.contiguous(experts, world)
    want = reference.low_latency_dispatch([r["x"] for r in out], [r["idx"] for r in out], MAX_TOKENS, placement)
    slots = world * MAX_TOKENS
    rm, rk = nvfp4.swizzled_scale_shape(slots, hidden)
    local = experts // world
    for rank, (got, ref) in enumerate(zip(out, want)):
        assert got["layout"] == dict(packed_shape=(slots, hidden // 2, local),
                                     packed_stride=(hidden // 2, 1, slots * hidden // 2), packed_dtype=torch.uint8,
                                     scales_shape=(32, 4, rm, 4, rk, local), scales_dtype=torch.float8_e4m3fn,
                                     scales_contiguous_as_tiles=True)
        assert got["codec"] == "nvfp4"
        assert got["count"] == ref.count
        for j, n in enumerate(ref.count):
            q, s = nvfp4.quantize(ref.x[j, :n], got["g"])
            assert torch.equal(got["rows"][j, :n], q), f"rank {rank} expert {j}"
            assert torch.equal(got["row_scales"][j, :n].view(torch.uint8), s.view(torch.uint8))
    combined = reference.low_latency_combine([r["y"] for r in out], want, [r["idx"] for r in out],
                                             [r["w"] for r in out], placement)
    for rank, got in enumerate(out):
        assert torch.equal(got["combined"], combined[rank]), rank


def _nvfp4_errors(rank, world, group):
    buf = ep_comm.Buffer(group, low_latency_mode=True)
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, dtype=torch.int64)
    seen = []
    for kwargs in (dict(use_nvfp4=True), dict(use_nvfp4=True, x_global_scale=torch.tensor([1.0, 2.0])),
                   dict(x_global_scale=torch.tensor(1.0))):
        try:
            buf.low_latency_dispatch(x, idx, 4, 2, **kwargs)
            seen.append(None)
        except ValueError as error:
            seen.append(str(error))
    return seen


def test_nvfp4_bad_arguments(ranks):
    (seen,) = ranks(1, _nvfp4_errors)
    assert "x_global_scale" in seen[0] and "x_global_scale" in seen[1] and "one element" in seen[1]
    assert "needs use_nvfp4=True" in seen[2]


def test_kernel_path_leaves_nvfp4_to_the_portable_path():
    placement = ExpertPlacement.contiguous(4, 1)
    path = FusedKernelPath(None, torch.device("cpu"), 1.0, 1, unavailable="normal", low_latency_unavailable=None)
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    call = LowLatencyDispatchCall(x, torch.zeros(2, 1, dtype=torch.int64), 4, placement, False, False, False, (),
                                  False, True)
    assert "NVFP4" in path.low_latency_dispatch_reason(call)
    plain = LowLatencyDispatchCall(x, torch.zeros(2, 1, dtype=torch.int64), 4, placement, False, False, False, (),
                                   False)
    assert path.low_latency_dispatch_reason(plain) is None
