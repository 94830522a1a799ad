"""Normal-mode dispatch/combine on 1, 2 and 4 gloo ranks against the single-process reference."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from support.rank_cases import make_routing, make_x

import ep_comm
from ep_comm import reference
from ep_comm.placement import ExpertPlacement


@dataclass(frozen=True)
class Case:
    world: int
    tokens: tuple[int, ...]  # tokens per rank (0 allowed)
    experts: int
    topk: int
    hidden: int
    dtype: torch.dtype
    drop: float = 0.1
    seed: int = 0


CASES = [
    Case(1, (7,), 4, 2, 128, torch.bfloat16),
    Case(2, (6, 9), 4, 1, 128, torch.float32),
    Case(2, (0, 12), 8, 2, 200, torch.bfloat16),
    Case(2, (16, 5), 16, 6, 7168, torch.bfloat16),
    Case(4, (5, 0, 9, 3), 8, 2, 128, torch.bfloat16),
    Case(4, (11, 4, 7, 1), 16, 6, 200, torch.float32),
    Case(4, (8, 8, 8, 8), 32, 8, 7168, torch.bfloat16),
    Case(4, (9, 3, 0, 6), 64, 8, 128, torch.float32, drop=0.3),
    Case(4, (6, 6, 6, 6), 16, 1, 128, torch.bfloat16, drop=0.0),
    # routing that leaves rank 3 with nothing: experts 12..15 are never chosen
    Case(4, (5, 7, 3, 4), 16, 2, 128, torch.bfloat16, drop=0.0, seed=-1),
]


def _inputs(rank: int, case: Case):
    n = case.tokens[rank]
    if case.seed == -1:
        idx, w = make_routing(rank, 5, n, case.experts * 3 // 4, case.topk, 0.0)
    else:
        idx, w = make_routing(rank, case.seed, n, case.experts, case.topk, case.drop)
    x = make_x(rank, case.seed, n, case.hidden, case.dtype)
    return x, idx, w


def _dispatch_combine(rank: int, world: int, group, case: Case):
    x, idx, w = _inputs(rank, case)
    buf = ep_comm.Buffer(group, timeout_s=60)
    x_before = x.clone()
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, case.experts)
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=w)
    dispatch_stats = buf.last_stats
    expert_out = (recv_x.float() * (rank + 2)).to(case.dtype)
    combined, combined_w, _ = buf.combine(expert_out, handle, topk_weights=recv_w)
    assert torch.equal(x, x_before), "dispatch modified its input"
    return dict(x=x, idx=idx, w=w, per_rank=per_rank, per_expert=per_expert, in_rank=in_rank,
                recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, counts=counts,
                src=handle.recv_src_token_index, expert_out=expert_out, combined=combined,
                combined_w=combined_w, stats=dispatch_stats, per_rdma=per_rdma)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"R{c.world}-K{c.topk}-H{c.hidden}-{str(c.dtype)[6:]}")
def test_dispatch_combine_matches_reference(ranks, case: Case):
    results = ranks(case.world, _dispatch_combine, case)
    placement = ExpertPlacement.contiguous(case.experts, case.world)
    ref = reference.dispatch([r["x"] for r in results], [r["idx"] for r in results],
                             [r["w"] for r in results], placement)
    for rank, (got, want) in enumerate(zip(results, ref)):
        assert got["per_rdma"] is None
        assert got["per_rank"].tolist() == [sum(1 for s, _ in r.sources if s == rank) for r in ref]
        assert got["per_expert"].dtype == torch.int32 and got["per_rank"].dtype == torch.int32
        assert got["in_rank"].shape == (case.tokens[rank], case.world)
        assert got["recv_x"].dtype == case.dtype
        assert torch.equal(got["recv_x"], want.x), f"rank {rank}: recv_x"
        assert torch.equal(got["recv_idx"], want.topk_idx), f"rank {rank}: recv_topk_idx"
        assert got["recv_w"].dtype == torch.float32
        assert torch.equal(got["recv_w"], want.topk_weights), f"rank {rank}: recv_topk_weights"
        assert got["counts"] == want.counts_per_expert
        # ordering contract: by source rank, then source token
        assert got["src"].tolist() == [t for _, t in want.sources]
        stats = got["stats"]
        assert sum(stats.bytes_sent_wire) > 0 or case.tokens[rank] == 0 or not got["in_rank"].any()
    combined_ref = reference.combine([r["expert_out"] for r in results], ref, list(case.tokens))
    for rank, got in enumerate(results):
        assert torch.equal(got["combined"], combined_ref[rank]), f"rank {rank}: combined_x"
        # weights of valid entries come back summed over ranks -> the original weights
        valid = got["idx"] >= 0
        routed = valid.any(1)
        expected_w = torch.where(valid, got["w"], torch.zeros_like(got["w"]))
        assert torch.equal(got["combined_w"][routed], expected_w[routed])
        assert torch.equal(got["combined"][~routed], torch.zeros_like(got["combined"][~routed]))


def _each_token_sent_once_per_rank(rank, world, group):
    x, idx, w = _inputs(rank, Case(4, (10, 10, 10, 10), 8, 8, 128, torch.bfloat16, drop=0.0))
    buf = ep_comm.Buffer(group)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, 8)
    buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    return buf.last_stats


def test_token_goes_once_per_rank_not_per_expert(ranks):
    # top-8 of 8 experts on 4 ranks: each token selects 2 experts on every rank, but is sent once
    for stats in ranks(4, _each_token_sent_once_per_rank):
        row_bytes = 128 * 2 + 4 + 8 * 4 + 8 * 4  # bf16 row, source index, 8 ids, 8 weights
        assert stats.bytes_sent_wire == [10 * row_bytes] * 4
        assert stats.num_collectives == 3  # the opening header, the counts, the payload


def _alignment_and_worst(rank, world, group):
    case = Case(2, (9, 13), 8, 3, 128, torch.bfloat16)
    x, idx, w = _inputs(rank, case)
    buf = ep_comm.Buffer(group)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, case.experts)
    _, _, _, counts1, _, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    _, _, _, counts8, _, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                          expert_alignment=8)
    rx, ridx, rw, counts_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                     num_tokens_per_expert=per_expert, num_worst_tokens=40)
    rx_plain, *_ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    combined, _, _ = buf.combine(rx, handle)
    cached, none1, none2, none3, none4, _ = buf.dispatch(x, handle=handle)
    return dict(counts1=counts1, counts8=counts8, rx=rx, ridx=ridx, rw=rw, counts_w=counts_w,
                rx_plain=rx_plain, combined=combined, x=x, idx=idx, cached=cached,
                nones=(none1, none2, none3, none4))


def test_expert_alignment_and_num_worst_tokens(ranks):
    for r in ranks(2, _alignment_and_worst):
        assert r["counts8"] == [(c + 7) // 8 * 8 for c in r["counts1"]]
        assert r["counts_w"] == []
        m = r["rx_plain"].shape[0]
        assert r["rx"].shape[0] == 40 and r["ridx"].shape[0] == 40 and r["rw"].shape[0] == 40
        assert torch.equal(r["rx"][:m], r["rx_plain"])
        assert torch.equal(r["rx"][m:], torch.zeros_like(r["rx"][m:]))
        assert bool((r["ridx"][m:] == -1).all()) and bool((r["rw"][m:] == 0).all())
        # combine of the padded rows ignores the padding: each token comes back times its rank count
        copies = torch.zeros(r["x"].shape[0])
        for rank in range(2):
            copies += ((r["idx"] >= 0) & (r["idx"] // 4 == rank)).any(1).float()
        expected = (r["x"].float() * copies[:, None]).to(torch.bfloat16)
        assert torch.equal(r["combined"], expected)
        assert torch.equal(r["cached"], r["rx"]) and r["nones"] == (None, None, None, None)


def _cached_and_reuse(rank, world, group, seed):
    case = Case(4, (7, 5, 8, 2), 16, 4, 256, torch.bfloat16, seed=seed)
    x, idx, w = _inputs(rank, case)
    buf = ep_comm.Buffer(group)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, case.experts)
    rx, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    outs = []
    for scale in (1.0, -3.0, 0.5):
        x2 = (x.float() * scale).to(torch.bfloat16)
        cached, *_ = buf.dispatch(x2, handle=handle)
        fresh, *_ = buf.dispatch(x2, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
        combined, _, _ = buf.combine(cached, handle)
        outs.append((torch.equal(cached, fresh), combined, buf.last_stats.num_collectives))
    fp8_x = (x[:, :].float().to(torch.float8_e4m3fn), torch.rand(x.shape[0], 2))
    rq, *_ = buf.dispatch(fp8_x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    rq_cached, *_ = buf.dispatch(fp8_x, handle=handle)
    return outs, rx, fp8_x, rq, rq_cached, idx


def test_cached_dispatch_and_handle_reuse_and_fp8_tuple(ranks):
    results = ranks(4, _cached_and_reuse, 3)
    placement = ExpertPlacement.contiguous(16, 4)
    fp8_in = [r[2] for r in results]
    ref = reference.dispatch([q.view(torch.uint8) for q, _ in fp8_in], [r[5] for r in results],
                             [torch.zeros(r[5].shape) for r in results], placement)
    ref_s = reference.dispatch([s for _, s in fp8_in], [r[5] for r in results],
                               [torch.zeros(r[5].shape) for r in results], placement)
    for rank, (outs, _rx, _, rq, rq_cached, _) in enumerate(results):
        for same, _combined, collectives in outs:
            assert same
            assert collectives == 2  # the opening header and the payload: no layout exchange
        assert rq[0].dtype == torch.float8_e4m3fn and rq[1].dtype == torch.float32
        assert torch.equal(rq[0].view(torch.uint8), ref[rank].x)
        assert torch.equal(rq[1], ref_s[rank].x)
        assert torch.equal(rq_cached[0].view(torch.uint8), rq[0].view(torch.uint8))


def _determinism(rank, world, group):
    case = Case(4, (12, 12, 12, 12), 16, 8, 512, torch.bfloat16)
    x, idx, w = _inputs(rank, case)
    buf = ep_comm.Buffer(group)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, case.experts)
    outs = []
    for _ in range(3):
        rx, ridx, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                  num_tokens_per_expert=per_expert)
        y = (rx.float() * torch.linspace(-1, 1, rx.shape[1])).to(torch.bfloat16)
        combined, cw, _ = buf.combine(y, handle, topk_weights=rw)
        outs.append((rx, combined, cw))
    return outs


def test_bitwise_determinism(ranks):
    for outs in ranks(4, _determinism):
        for rx, combined, cw in outs[1:]:
            assert torch.equal(rx, outs[0][0])
            assert torch.equal(combined.view(torch.int16), outs[0][1].view(torch.int16))
            assert torch.equal(cw, outs[0][2])


def _event_and_bias(rank, world, group):
    x, idx, w = _inputs(rank, Case(2, (6, 4), 4, 2, 128, torch.float32))
    buf = ep_comm.Buffer(group)
    per_rank, _, per_expert, in_rank, ev = buf.get_dispatch_layout(idx, 4, async_finish=True)
    ev.current_stream_wait()
    rx, _, rw, _, handle, ev2 = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                             is_token_in_rank=in_rank, previous_event=ev, async_finish=True)
    with ev2:  # DeepEP's "with event:" form waits on exit
        assert rx.shape[1] == x.shape[1]
    bias = torch.ones_like(x)
    combined, _, ev3 = buf.combine(rx, handle, bias=(bias, bias), previous_event=ev2)
    plain, _, _ = buf.combine(rx, handle)
    return torch.allclose(combined, plain + 2, atol=1e-5), ev3.event is None, ev2.event is not None


def test_events_and_bias(ranks):
    for ok, sync_has_no_event, async_has_event in ranks(2, _event_and_bias):
        assert ok and sync_has_no_event and async_has_event
