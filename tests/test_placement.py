"""Non-uniform expert placement, the placement planner, and failed-rank masking."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from support.mp_pool import spawn_once
from support.rank_cases import make_routing, make_x

import ep_comm
from ep_comm import reference
from ep_comm.placement import ExpertPlacement, plan_placement

# 10 experts on 4 ranks: rank 0 owns 5, rank 1 owns 2, rank 2 none, rank 3 owns 3 (not contiguous)
UNEVEN = torch.tensor([0, 3, 0, 1, 0, 3, 0, 1, 0, 3])


def test_placement_map_local_ids():
    placement = ExpertPlacement.from_expert_to_rank(UNEVEN, 4)
    assert placement.num_local_experts.tolist() == [5, 2, 0, 3]
    assert placement.local_experts(3).tolist() == [1, 5, 9]
    assert placement.expert_to_local.tolist() == [0, 0, 1, 0, 2, 1, 3, 1, 4, 2]
    with pytest.raises(ValueError, match="expert_placement"):
        ExpertPlacement.from_expert_to_rank(torch.tensor([[0, 1], [1, 0]]), 2)


def _uneven_case(rank, world, group):
    n = [6, 9, 4, 0][rank]
    idx, w = make_routing(rank, 21, n, 10, 3, 0.1)
    x = make_x(rank, 21, n, 128, torch.bfloat16)
    buf = ep_comm.Buffer(group, expert_placement=UNEVEN)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, 10)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    y = (recv_x.float() * 2).to(torch.bfloat16)
    combined, _, _ = buf.combine(y, handle)
    ll_x, ll_count, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, 12, 10, use_fp8=False)
    ll_y = (ll_x.float() * 3).to(torch.bfloat16)
    ll_out, _, _ = buf.low_latency_combine(ll_y, idx, w, ll_handle)
    xg = x.float().requires_grad_()
    rx, _, _, _, h2, _ = ep_comm.dispatch(buf, xg, idx, w, 10)
    out, _, _ = ep_comm.combine(buf, rx * 2, h2)
    out.sum().backward()
    return dict(x=x, idx=idx, w=w, recv_x=recv_x, recv_idx=recv_idx, counts=counts, y=y,
                combined=combined, ll_x=ll_x, ll_count=ll_count, ll_y=ll_y, ll_out=ll_out,
                grad=xg.grad)


def test_uneven_placement_normal_low_latency_and_autograd(ranks):
    results = ranks(4, _uneven_case)
    placement = ExpertPlacement.from_expert_to_rank(UNEVEN, 4)
    xs, idxs, ws = [r["x"] for r in results], [r["idx"] for r in results], [r["w"] for r in results]
    ref = reference.dispatch(xs, idxs, ws, placement)
    combined = reference.combine([r["y"] for r in results], ref, [x.shape[0] for x in xs])
    ll_ref = reference.low_latency_dispatch(xs, idxs, 12, placement)
    ll_comb = reference.low_latency_combine([r["ll_y"] for r in results], ll_ref, idxs, ws, placement)
    for rank, r in enumerate(results):
        assert torch.equal(r["recv_x"], ref[rank].x)
        assert torch.equal(r["recv_idx"], ref[rank].topk_idx)
        assert r["counts"] == ref[rank].counts_per_expert
        assert len(r["counts"]) == [5, 2, 0, 3][rank]
        assert torch.equal(r["combined"], combined[rank])
        assert r["ll_x"].shape == ([5, 2, 0, 3][rank], 4 * 12, 128)
        assert r["ll_count"].tolist() == ll_ref[rank].count
        for j, count in enumerate(ll_ref[rank].count):
            assert torch.equal(r["ll_x"][j, :count], ll_ref[rank].x[j, :count])
        assert torch.equal(r["ll_out"], ll_comb[rank])
        copies = sum(((r["idx"] >= 0) & (UNEVEN[r["idx"].clamp(min=0)] == d)).any(1).float() for d in range(4))
        torch.testing.assert_close(r["grad"], 2 * copies[:, None].expand_as(r["grad"]))


def test_planner_gives_half_capacity_rank_half_the_load():
    torch.manual_seed(0)
    load = torch.randint(50, 150, (64,)).double()
    capacity = torch.tensor([1.0, 1.0, 0.5, 1.0])
    plan = plan_placement(load, capacity)
    share = plan.load_per_rank / plan.load_per_rank.sum()
    full_share = float(share[[0, 1, 3]].mean())
    assert abs(float(share[2]) / full_share - 0.5) < 0.1
    assert plan.imbalance < 1.05
    assert torch.equal(plan.expert_to_rank.bincount(minlength=4).sum(), torch.tensor(64))
    skewed = plan_placement(torch.tensor([100.0, 1, 1, 1, 1, 1]), torch.ones(2), max_experts_per_rank=3)
    assert skewed.expert_to_rank.bincount(minlength=2).tolist() == [3, 3]
    with pytest.raises(ValueError, match="rank_capacity"):
        plan_placement(load, torch.zeros(4))
    with pytest.raises(ValueError, match="max_experts_per_rank"):
        plan_placement(load, capacity, max_experts_per_rank=10)


STALLED_RANK, TIMEOUT_S = 2, 4.0


def _one_rank_stops_mid_run(rank, world, group):
    buf = ep_comm.Buffer(group, timeout_s=TIMEOUT_S)
    per_expert = torch.zeros(8, dtype=torch.int32)
    idx, w = make_routing(rank, 31, 7, 8, 3, 0.0)
    x = make_x(rank, 31, 7, 128, torch.bfloat16)
    rx, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    buf.combine(rx, handle)  # step 1 completes on every rank
    store = torch.distributed.distributed_c10d._get_default_store()
    if rank == STALLED_RANK:
        time.sleep(TIMEOUT_S + 1)
        # comes back once the survivors have carried on without it, and rejoins
        store.wait(["test/survivors_done"], timedelta(seconds=60))
        buf.unmask_ranks([])
        return dict(rejoined=_full_step(buf, x, idx, w, per_expert))
    try:
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
        return dict(error=None)
    except ep_comm.CommTimeoutError as error:
        peers = error.peers
    buf.mask_ranks(peers)
    with pytest.raises(ValueError, match="before the last mask_ranks"):
        buf.combine(rx, handle)
    recv_x, recv_idx, _, counts, handle2, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    dropped = buf.last_stats.dropped_topk_entries
    y = (recv_x.float() * 2).to(torch.bfloat16)
    combined, _, _ = buf.combine(y, handle2)
    ll_x, ll_count, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=False)
    ll_out, _, _ = buf.low_latency_combine(ll_x, idx, w, ll_handle)
    if rank == 0:
        store.set("test/survivors_done", "1")
    buf.unmask_ranks([STALLED_RANK])
    rejoined = _full_step(buf, x, idx, w, per_expert)
    return dict(error=peers, x=x, idx=idx, w=w, recv_x=recv_x, recv_idx=recv_idx, counts=counts,
                dropped=dropped, y=y, combined=combined, ll_x=ll_x, ll_count=ll_count, ll_out=ll_out,
                rejoined=rejoined)


def _full_step(buf, x, idx, w, per_expert):
    """After unmasking: a dispatch + combine over all ranks again."""
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    combined, _, _ = buf.combine(recv_x, handle)
    return dict(x=x, idx=idx, w=w, recv_x=recv_x, combined=combined, dropped=buf.last_stats.dropped_topk_entries,
                masked=sorted(buf.masked_ranks))


def test_survivors_mask_a_stalled_rank_and_continue():
    results = spawn_once(4, _one_rank_stops_mid_run, timeout=120)
    survivors = [r for r in range(4) if r != STALLED_RANK]
    placement = ExpertPlacement.contiguous(8, 4)
    dead_experts = placement.local_experts(STALLED_RANK)
    xs, idxs, ws = [], [], []
    for rank in range(4):
        if rank == STALLED_RANK:
            xs.append(torch.empty(0, 128, dtype=torch.bfloat16))
            idxs.append(torch.empty(0, 3, dtype=torch.int64))
            ws.append(torch.empty(0, 3))
            continue
        r = results[rank]
        assert r["error"] == [STALLED_RANK], r
        masked = torch.where(torch.isin(r["idx"], dead_experts), -1, r["idx"])
        assert r["dropped"] == int(torch.isin(r["idx"], dead_experts).sum()) > 0
        xs.append(r["x"])
        idxs.append(masked)
        ws.append(r["w"])
    ref = reference.dispatch(xs, idxs, ws, placement)
    combined = reference.combine([results[r]["y"] if r != STALLED_RANK else ref[r].x for r in range(4)],
                                 ref, [x.shape[0] for x in xs])
    ll_ref = reference.low_latency_dispatch(xs, idxs, 8, placement)
    for rank in survivors:
        r = results[rank]
        assert torch.equal(r["recv_x"], ref[rank].x)
        assert torch.equal(r["recv_idx"], ref[rank].topk_idx)
        assert r["counts"] == ref[rank].counts_per_expert
        assert torch.equal(r["combined"], combined[rank])
        assert r["ll_count"].tolist() == ll_ref[rank].count
        for j, count in enumerate(ll_ref[rank].count):
            assert torch.equal(r["ll_x"][j, :count], ll_ref[rank].x[j, :count])
    ll_comb = reference.low_latency_combine([results[r]["ll_x"] if r != STALLED_RANK else ll_ref[r].x
                                             for r in range(4)], ll_ref, idxs, ws, placement)
    for rank in survivors:
        assert torch.equal(results[rank]["ll_out"], ll_comb[rank])
    # then the stalled rank comes back: everyone unmasks it and the full exchange works again
    full = [results[r]["rejoined"] for r in range(4)]
    full_ref = reference.dispatch([f["x"] for f in full], [f["idx"] for f in full], [f["w"] for f in full],
                                  placement)
    for rank, f in enumerate(full):
        assert f["masked"] == [] and f["dropped"] == 0
        assert torch.equal(f["recv_x"], full_ref[rank].x)
        copies = sum(((f["idx"] >= 0) & (f["idx"] // 2 == d)).any(1).float() for d in range(4))
        assert torch.equal(f["combined"], (f["x"].float() * copies[:, None]).to(torch.bfloat16))
