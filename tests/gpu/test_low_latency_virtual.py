"""Low-latency dispatch/combine kernels with R virtual ranks on one GPU against the reference
(ep_comm.reference: which token fills each expert's slots) and the FP8 codec (codecs/fp8.py)."""
from __future__ import annotations

import pytest
import torch
from support.rank_cases import random_routing

from ep_comm import reference
from ep_comm.placement import ExpertPlacement

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MAX_TOKENS = 64


def _run(r: int, use_fp8: bool, round_scale: bool = False, use_ue8m0: bool = False, seed: int = 0):
    from ep_comm.engines import LowLatencyEngine
    gen = torch.Generator().manual_seed(seed + r)
    e, k, hidden, max_tokens = 4 * r, 4, 1024, MAX_TOKENS
    placement = ExpertPlacement.from_expert_to_rank(torch.randint(0, r, (e,), generator=gen), r)
    counts = [int(torch.randint(1, max_tokens + 1, (1,), generator=gen)) for _ in range(r)]
    xs = [torch.randn(n, hidden, generator=gen).bfloat16() for n in counts]
    topks = [random_routing(gen, n, k, e) for n in counts]
    eng = LowLatencyEngine(r, placement, torch.device("cuda"), max_tokens, hidden, k, timeout_s=5.0)
    got = eng.dispatch([x.cuda() for x in xs], [t.cuda() for t in topks], use_fp8, round_scale, use_ue8m0)
    return eng, placement, xs, topks, got


@pytest.mark.parametrize("r", [2, 4, 8])
def test_low_latency_dispatch_bf16_slots(r: int) -> None:
    _, placement, xs, topks, got = _run(r, use_fp8=False)
    for receiver, res in enumerate(got):
        want = reference.low_latency_dispatch_to(receiver, xs, topks, MAX_TOKENS, placement)
        assert res.recv_count.cpu().tolist() == want.count
        assert torch.equal(res.layout_range.cpu(), want.layout_range(r))
        for local, slots in enumerate(want.slots):
            assert torch.equal(res.recv_x[local, :len(slots)].cpu(), want.x[local, :len(slots)])
            assert res.recv_src_info[local, :len(slots)].tolist() == [token for _, token in slots]


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_low_latency_dispatch_fp8_matches_codec(round_scale: bool, use_ue8m0: bool) -> None:
    from ep_comm.codecs import fp8
    _, placement, xs, topks, got = _run(4, True, round_scale, use_ue8m0, seed=9)
    for receiver, res in enumerate(got):
        for local, slots in enumerate(reference.expert_slots_to(receiver, topks, placement)):
            for slot, (s, token) in enumerate(slots):
                q, scales = fp8.quantize(xs[s][token:token + 1], round_scale, use_ue8m0)
                assert torch.equal(res.recv_x[local, slot].cpu().view(torch.uint8), q[0].view(torch.uint8))
                assert torch.equal(res.recv_scales[local, slot].cpu(), scales[0])


@pytest.mark.parametrize("r", [2, 4, 8])
def test_low_latency_combine(r: int) -> None:
    eng, placement, xs, topks, got = _run(r, use_fp8=False, seed=3)
    gen = torch.Generator().manual_seed(r)
    weights = [torch.rand(t.shape[0], t.shape[1], generator=gen) for t in topks]
    # expert outputs: received rows scaled by a per-(rank, local expert) factor
    ys = []
    for rank, res in enumerate(got):
        factor = (torch.arange(res.recv_x.shape[0], dtype=torch.float32) + 1 + rank).cuda()
        ys.append((res.recv_x.float() * factor[:, None, None]).bfloat16())
    for _ in range(2):  # flags re-arm: a second combine on the same dispatch works
        out = eng.combine(ys, [t.cuda() for t in topks], [w.cuda() for w in weights], got)
        for s in range(r):
            owner = placement.expert_to_rank[topks[s].clamp(min=0)]
            local = placement.expert_to_local[topks[s].clamp(min=0)]
            factor = torch.where(topks[s] >= 0, (local + 1 + owner).float(), torch.zeros(()))
            scale = (weights[s] * factor).sum(1, keepdim=True)
            want = xs[s].float() * scale
            torch.testing.assert_close(out[s].cpu().float(), want, atol=5e-2, rtol=2e-2)


def test_low_latency_second_dispatch_reuses_buffers() -> None:
    eng, placement, xs, topks, got = _run(4, use_fp8=False, seed=11)
    again = eng.dispatch([x.cuda() for x in xs], [t.cuda() for t in topks])
    for a, b in zip(got, again):
        assert torch.equal(a.recv_count, b.recv_count) and torch.equal(a.layout_range, b.layout_range)


def test_capacity_is_checked() -> None:
    from ep_comm.engines import LowLatencyEngine
    placement = ExpertPlacement.contiguous(8, 2)
    eng = LowLatencyEngine(2, placement, torch.device("cuda"), 4, 128, 2)
    x = torch.zeros(5, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        eng.dispatch([x, x], [torch.zeros(5, 2, dtype=torch.int64, device="cuda")] * 2)
