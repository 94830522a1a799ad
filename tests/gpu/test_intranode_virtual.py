"""Layout, normal dispatch and combine kernels with R virtual ranks on one GPU, against the
routing maths (ep_comm.layout) and ep_comm.reference; and the bounded wait turning a missing rank
into CommTimeoutError."""
from __future__ import annotations

import pytest
import torch
from support.rank_cases import random_routing

from ep_comm import reference
from ep_comm.errors import CommTimeoutError
from ep_comm.layout import compute_dispatch_layout
from ep_comm.placement import ExpertPlacement

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _engine(r: int, placement: ExpertPlacement, k: int, hidden_bytes: int, channels: int = 4,
            timeout_s: float = 5.0, max_scales: int = 0):
    from ep_comm.engines import IntranodeEngine
    return IntranodeEngine(r, placement, torch.device("cuda"), k, hidden_bytes, num_channels=channels,
                           ring_slots=32, timeout_s=timeout_s, max_scales=max_scales)


@pytest.mark.parametrize("r", [2, 4, 8])
def test_layout_kernel_matches_reference(r: int) -> None:
    gen = torch.Generator().manual_seed(r)
    e = 8 * r
    for placement in [ExpertPlacement.contiguous(e, r),
                      ExpertPlacement.from_expert_to_rank(torch.randint(0, r, (e,), generator=gen), r)]:
        topk = random_routing(gen, 777, 6, e)
        eng = _engine(r, placement, 6, 256)
        per_rank, per_node, per_expert, mask = eng.get_dispatch_layout(topk.cuda())
        ref = compute_dispatch_layout(topk, placement)
        assert torch.equal(per_rank.cpu(), ref.num_tokens_per_rank)
        assert torch.equal(per_expert.cpu(), ref.num_tokens_per_expert)
        assert torch.equal(mask.cpu(), ref.is_token_in_rank)
        assert per_node is None and ref.num_tokens_per_rdma_rank is None


@pytest.mark.parametrize("r", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dispatch_combine_virtual_ranks(r: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(100 + r)
    e, k, hidden = 4 * r, 4, 512
    placement = ExpertPlacement.from_expert_to_rank(torch.randint(0, r, (e,), generator=gen), r)
    counts = [int(torch.randint(0, 300, (1,), generator=gen)) for _ in range(r)]
    xs = [torch.randn(n, hidden, generator=gen).to(dtype) for n in counts]
    topks = [random_routing(gen, n, k, e) for n in counts]
    weights = [torch.rand(n, k, generator=gen) for n in counts]
    eng = _engine(r, placement, k, hidden * 4, channels=3)
    for _ in range(2):  # the second round reuses the buffers (ring reset, barrier values)
        got = eng.dispatch([x.cuda() for x in xs], [t.cuda() for t in topks], [w.cuda() for w in weights])
        ref = reference.dispatch(xs, topks, weights, placement)
        for g, want in zip(got, ref):
            assert torch.equal(g["recv_x"].cpu(), want.x)
            assert torch.equal(g["recv_topk_idx"].cpu(), want.topk_idx)
            assert torch.equal(g["recv_topk_weights"].cpu(), want.topk_weights)
            assert torch.equal(g["recv_src_idx"].cpu().long(), want.src_idx)
            assert g["num_recv_tokens_per_expert"] == want.counts_per_expert
        ys = [(g["recv_x"].float() * (i + 1)).to(dtype) for i, g in enumerate(got)]
        combined = eng.combine(ys, [g["handle"] for g in got],
                               [g["recv_topk_weights"] for g in got])
        want = reference.combine([y.cpu().float() for y in ys], ref, counts)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        for (cx, cw), w_x, s in zip(combined, want, range(r)):
            torch.testing.assert_close(cx.cpu().float(), w_x, atol=tol, rtol=tol)
            mask = compute_dispatch_layout(topks[s], placement).is_token_in_rank
            # every rank that got token i returns its localized weights; their sum is the original
            expected_w = torch.where(topks[s] >= 0, weights[s], torch.zeros_like(weights[s]))
            expected_w[~mask.any(1)] = 0
            torch.testing.assert_close(cw.cpu(), expected_w, atol=1e-6, rtol=1e-6)


def test_fp8_input_with_scales_travels_unchanged() -> None:
    from ep_comm.codecs import fp8
    r, e, k, hidden = 4, 16, 4, 1024
    gen = torch.Generator().manual_seed(5)
    placement = ExpertPlacement.contiguous(e, r)
    xs = [torch.randn(64, hidden, generator=gen) for _ in range(r)]
    q = [fp8.quantize(x) for x in xs]
    topks = [random_routing(gen, 64, k, e) for _ in range(r)]
    weights = [torch.rand(64, k, generator=gen) for _ in range(r)]
    eng = _engine(r, placement, k, hidden, max_scales=hidden // 128)
    got = eng.dispatch([a.cuda().view(torch.uint8) for a, _ in q], [t.cuda() for t in topks],
                       [w.cuda() for w in weights], x_scales=[s.cuda() for _, s in q])
    ref_q = reference.dispatch([a.view(torch.uint8) for a, _ in q], topks, weights, placement)
    ref_s = reference.dispatch([s for _, s in q], topks, weights, placement)
    for g, wq, ws in zip(got, ref_q, ref_s):
        assert torch.equal(g["recv_x"].cpu(), wq.x)
        assert torch.equal(g["recv_scales"].cpu(), ws.x)


def test_missing_rank_times_out_with_peer_and_phase() -> None:
    """Only ranks 0..R-2 join the notify barrier: the kernel gives up and names rank R-1."""
    r, e, k = 4, 8, 2
    placement = ExpertPlacement.contiguous(e, r)
    eng = _engine(r, placement, k, 256, timeout_s=0.5)
    topk = random_routing(torch.Generator().manual_seed(0), 16, k, e).cuda()
    _, _, per_expert, mask = eng.get_dispatch_layout(topk)
    meta = torch.zeros(eng.cuda.intranode_meta_words(r, eng.num_channels, eng.max_local),
                       dtype=torch.int32, device="cuda")
    ranks = [{"rank": i, "num_tokens": 16, "is_token_in_rank": mask.data_ptr(),
              "num_tokens_per_expert": per_expert.data_ptr(), "meta": meta.data_ptr(),
              "record": eng.records[i].ptr} for i in range(r - 1)]
    eng.cuda.intranode_notify(eng._common(), ranks, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    with pytest.raises(CommTimeoutError) as caught:
        for record in eng.records:
            record.check()
    assert caught.value.peers == [r - 1] and caught.value.phase == "intranode/barrier"
