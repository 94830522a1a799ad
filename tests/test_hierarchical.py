"""Node-aware (two-hop) dispatch/combine: 4 gloo ranks as 2 nodes x 2, 4 x 1 and 1 x 4 against the
single-process reference and the flat exchange.

Tolerance of the combine: with one node (1 x 4) or one rank per node (4 x 1) the two-hop combine
sums in the flat order and is bit-identical. With 2 x 2, each node's partial sum is rounded to the
payload dtype before the source adds the nodes: at most one extra rounding step per node, so
bf16 results agree within ``4 * 2**-8`` relative to the row's magnitude, float32 within ``1e-5``.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from support.rank_cases import make_routing, make_x

import ep_comm
from ep_comm import reference
from ep_comm.layout import compute_dispatch_layout
from ep_comm.placement import ExpertPlacement
from ep_comm.plan import virtual_node_plans


@dataclass(frozen=True)
class Case:
    nodes: int
    per_node: int
    tokens: tuple[int, ...]  # tokens per rank (0 allowed)
    experts: int
    topk: int
    hidden: int
    dtype: torch.dtype
    routing: str = "uniform"  # uniform | skewed | empty_rank | holes
    seed: int = 0

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


CASES = [
    Case(2, 2, (7, 5, 9, 4), 8, 2, 128, torch.bfloat16),
    Case(2, 2, (11, 4, 0, 6), 16, 6, 200, torch.float32, routing="holes"),
    Case(2, 2, (8, 8, 8, 8), 16, 4, 256, torch.bfloat16, routing="skewed", seed=2),
    Case(2, 2, (5, 7, 3, 4), 16, 2, 128, torch.bfloat16, routing="empty_rank"),
    Case(2, 2, (6, 9, 4, 7), 32, 8, 128, torch.float32, seed=4),
    Case(4, 1, (7, 5, 9, 4), 8, 3, 128, torch.bfloat16, seed=5),
    Case(4, 1, (3, 0, 8, 6), 16, 4, 64, torch.float32, routing="holes", seed=6),
    Case(1, 4, (7, 5, 9, 4), 8, 3, 128, torch.bfloat16, seed=7),
    Case(1, 4, (8, 2, 6, 0), 16, 6, 96, torch.float32, routing="skewed", seed=8),
]


def _inputs(rank: int, case: Case):
    n = case.tokens[rank]
    if case.routing == "empty_rank":  # experts of rank 3 (12..15) are never chosen
        idx, w = make_routing(rank, case.seed, n, case.experts * 3 // 4, case.topk, 0.0)
    elif case.routing == "holes":  # many -1 entries, some tokens routed nowhere
        idx, w = make_routing(rank, case.seed, n, case.experts, case.topk, 0.5)
        idx[::3] = -1
    elif case.routing == "skewed":  # most entries on the experts of rank 0 and 1
        idx, w = make_routing(rank, case.seed, n, case.experts, case.topk, 0.0)
        idx = torch.where(idx % 3 != 0, idx % (case.experts // 2), idx)
        idx = _dedupe(idx)
    else:
        idx, w = make_routing(rank, case.seed, n, case.experts, case.topk, 0.0)
    return make_x(rank, case.seed, n, case.hidden, case.dtype), idx, w


def _dedupe(idx: torch.Tensor) -> torch.Tensor:
    """-1 for a repeated expert in a row (routings select distinct experts)."""
    out = idx.clone()
    for k in range(1, idx.shape[1]):
        repeated = (idx[:, :k] == idx[:, k:k + 1]).any(1)
        out[:, k] = torch.where(repeated, torch.full_like(idx[:, k], -1), idx[:, k])
    return out


def _run(rank: int, world: int, group, case: Case):
    x, idx, w = _inputs(rank, case)
    x_before = x.clone()
    hier = ep_comm.Buffer(group, ranks_per_node=case.per_node)
    flat = ep_comm.Buffer(group)
    layout = hier.get_dispatch_layout(idx, case.experts)
    per_rank, per_rdma, per_expert, in_rank, _ = layout
    recv_x, recv_idx, recv_w, counts, handle, _ = hier.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert, is_token_in_rank=in_rank)
    stats = hier.last_stats
    f_x, f_idx, f_w, f_counts, f_handle, _ = flat.dispatch(x, topk_idx=idx, topk_weights=w,
                                                           num_tokens_per_expert=per_expert)
    flat_stats = flat.last_stats
    y = (recv_x.float() * (rank + 2) - 0.37).to(case.dtype)
    combined, combined_w, _ = hier.combine(y, handle, topk_weights=recv_w)
    combine_stats = hier.last_stats
    combined_now, none_w, _ = hier.combine(y, handle)
    flat_combined, _, _ = flat.combine(y, f_handle, topk_weights=f_w)
    flat_combine_stats = flat.last_stats
    assert torch.equal(x, x_before), "dispatch modified its input"
    return dict(x=x, idx=idx, w=w, per_rank=per_rank, per_rdma=per_rdma, recv_x=recv_x, recv_idx=recv_idx,
                recv_w=recv_w, counts=counts, handle=handle, f_handle=f_handle, stats=stats,
                flat_stats=flat_stats, y=y, combined=combined, combined_w=combined_w,
                combined_now=combined_now, none_w=none_w, flat_combined=flat_combined,
                combine_stats=combine_stats, flat_combine_stats=flat_combine_stats,
                same_as_flat=(torch.equal(recv_x, f_x), torch.equal(recv_idx, f_idx), torch.equal(recv_w, f_w),
                              counts == f_counts))


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 4 * 2.0**-8 if dtype == torch.bfloat16 else 1e-5
    scale = want.float().abs().amax(1, keepdim=True).clamp(min=1.0)
    return bool(((got.float() - want.float()).abs() <= tol * scale).all())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.nodes}x{c.per_node}-K{c.topk}-{c.routing}-"
                                                      f"{str(c.dtype)[6:]}")
def test_two_hop_matches_reference_and_flat(ranks, case: Case):
    results = ranks(case.world, _run, case)
    placement = ExpertPlacement.contiguous(case.experts, case.world)
    ref = reference.dispatch([r["x"] for r in results], [r["idx"] for r in results],
                             [r["w"] for r in results], placement)
    exact_combine = case.nodes == 1 or case.per_node == 1
    combined_ref = reference.combine([r["y"] for r in results], ref, list(case.tokens))
    # the plans a process knowing every layout builds (virtual ranks) are the exchanged ones
    masks = [compute_dispatch_layout(r["idx"], placement).is_token_in_rank for r in results]
    for got, plan in zip(results, virtual_node_plans(masks, case.per_node)):
        mine = got["handle"].node_plan
        for a, b in ((mine.rail_plan.token_index, plan.rail_plan.token_index),
                     (mine.rail_plan.send_counts, plan.rail_plan.send_counts),
                     (mine.rail_recv_counts, plan.rail_recv_counts),
                     (mine.forward_plan.token_index, plan.forward_plan.token_index),
                     (mine.forward_plan.send_counts, plan.forward_plan.send_counts),
                     (mine.node_recv_counts, plan.node_recv_counts), (mine.recv_order, plan.recv_order)):
            assert torch.equal(a, b)
    for rank, (got, want) in enumerate(zip(results, ref)):
        handle, f_handle = got["handle"], got["f_handle"]
        assert handle.node_plan is not None and handle.node_plan.ranks_per_node == case.per_node
        assert f_handle.node_plan is None
        # layout: per node counts
        if case.nodes == 1:
            assert got["per_rdma"] is None
        else:
            per_node = got["idx"].new_zeros(case.nodes)
            owner = placement.expert_to_rank[got["idx"].clamp(min=0)] // case.per_node
            for g in range(case.nodes):
                per_node[g] = ((owner == g) & (got["idx"] >= 0)).any(1).sum()
            assert got["per_rdma"].dtype == torch.int32 and got["per_rdma"].tolist() == per_node.tolist()
        # dispatch: bit-identical to the reference and to the flat exchange
        assert torch.equal(got["recv_x"], want.x), f"rank {rank}: recv_x"
        assert torch.equal(got["recv_idx"], want.topk_idx), f"rank {rank}: recv_topk_idx"
        assert torch.equal(got["recv_w"], want.topk_weights), f"rank {rank}: recv_topk_weights"
        assert got["counts"] == want.counts_per_expert
        assert all(got["same_as_flat"]), f"rank {rank}: differs from the flat dispatch"
        assert handle.recv_src_token_index.tolist() == [t for _, t in want.sources]
        assert handle.recv_counts.tolist() == f_handle.recv_counts.tolist()
        assert torch.equal(handle.send_plan.token_index, f_handle.send_plan.token_index)
        # per-peer stats over all R ranks; with one rank per node every other peer is a rail peer
        # and sends the flat path's bytes plus a 1-byte target mask per row (the forwarding hop
        # is a copy to self, counted under this rank)
        assert got["stats"].op == "dispatch" and len(got["stats"].bytes_sent_raw) == case.world
        if case.per_node == 1:
            extra = handle.recv_counts.tolist()
            for peer in range(case.world):
                if peer != rank:
                    assert got["stats"].bytes_recv_raw[peer] == got["flat_stats"].bytes_recv_raw[peer] + extra[peer]
        # combine
        if exact_combine:
            assert torch.equal(got["combined"], combined_ref[rank]), f"rank {rank}: combined_x"
            assert torch.equal(got["combined"], got["flat_combined"])
        else:
            assert _close(got["combined"], combined_ref[rank], case.dtype), f"rank {rank}: combined_x"
        assert torch.equal(got["combined_now"], got["combined"]), "combine without weights differs"
        assert got["none_w"] is None
        valid = got["idx"] >= 0
        routed = valid.any(1)
        expected_w = torch.where(valid, got["w"], torch.zeros_like(got["w"]))
        assert torch.equal(got["combined_w"][routed], expected_w[routed])
        assert torch.equal(got["combined"][~routed], torch.zeros_like(got["combined"][~routed]))


def _bytes_case(rank, world, group):
    # top-4 of 8 experts on 2 x 2: most tokens hit both ranks of a node
    x, idx, w = _inputs(rank, Case(2, 2, (16, 16, 16, 16), 8, 4, 512, torch.bfloat16, seed=11))
    out = {}
    for name, buf in (("flat", ep_comm.Buffer(group)), ("hier", ep_comm.Buffer(group, ranks_per_node=2))):
        _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, 8)
        rx, _, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
        dispatch_stats = buf.last_stats
        buf.combine(rx, handle, topk_weights=rw)
        out[name] = (dispatch_stats, buf.last_stats)
    return out


def test_inter_node_bytes_below_flat(ranks):
    for rank, out in enumerate(ranks(4, _bytes_case)):
        for i, op in enumerate(("dispatch", "combine")):
            flat, hier = out["flat"][i], out["hier"][i]
            assert hier.op == op
            for wire in (False, True):
                flat_off = flat.bytes_sent_off_node(2, wire=wire)
                hier_off = hier.bytes_sent_off_node(2, wire=wire)
                assert 0 < hier_off < flat_off, f"rank {rank} {op}: {hier_off} vs flat {flat_off}"
            # inter-node bytes only go to the rail peer (same local index)
            peer = (rank + 2) % 4
            assert [n for r, n in enumerate(hier.bytes_sent_raw) if r // 2 != rank // 2 and r != peer] == [0]


def _cached_alignment_codecs(rank, world, group):
    case = Case(2, 2, (9, 13, 6, 10), 8, 3, 256, torch.bfloat16, seed=3)
    x, idx, w = _inputs(rank, case)
    buf = ep_comm.Buffer(group, ranks_per_node=2)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, 8)
    rx, ridx, rw, counts1, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                    num_tokens_per_expert=per_expert)
    _, _, _, counts8, _, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                          expert_alignment=8)
    out = dict(counts1=counts1, counts8=counts8, rx=rx)
    x2 = (x.float() * -1.5).to(torch.bfloat16)
    out["cached"], *out["nones"] = buf.dispatch(x2, handle=handle)[:5]
    out["cached_collectives"] = buf.last_stats.num_collectives
    out["fresh"] = buf.dispatch(x2, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)[0]
    out["lossless"] = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                   codec="lossless")[0]
    out["lossless_cached"] = buf.dispatch(x, handle=handle, codec="lossless")[0]
    y = (rx.float() * 0.75).to(torch.bfloat16)
    out["comb"] = buf.combine(y, handle, topk_weights=rw)[0]
    out["comb_lossless"] = buf.combine(y, handle, topk_weights=rw, codec="lossless")[0]
    out["fp8"] = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert, codec="fp8")[0]
    fp8_x = (x.float().to(torch.float8_e4m3fn), torch.rand(x.shape[0], 2))
    out["fp8_tuple"] = buf.dispatch(fp8_x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)[0]
    out["fp8_tuple_cached"] = buf.dispatch(fp8_x, handle=handle)[0]
    flat = ep_comm.Buffer(group)
    out["flat_fp8"] = flat.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                    codec="fp8")[0]
    out["flat_fp8_tuple"] = flat.dispatch(fp8_x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)[0]
    worst = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert, num_worst_tokens=40)
    out["worst"] = worst[:4]
    out["worst_comb"] = buf.combine(torch.nn.functional.pad(y, (0, 0, 0, 40 - y.shape[0])), worst[4],
                                    topk_weights=torch.nn.functional.pad(rw, (0, 0, 0, 40 - rw.shape[0])))[0]
    return out


def test_cached_dispatch_alignment_worst_and_codecs(ranks):
    for r in ranks(4, _cached_alignment_codecs):
        m = r["rx"].shape[0]
        assert r["counts8"] == [(c + 7) // 8 * 8 for c in r["counts1"]]
        assert torch.equal(r["cached"], r["fresh"]) and r["nones"] == [None, None, None, None]
        assert r["cached_collectives"] == 3  # the opening header, one payload all-to-all per hop, no counts
        assert torch.equal(r["lossless"], r["rx"]) and torch.equal(r["lossless_cached"], r["rx"])
        assert torch.equal(r["comb_lossless"], r["comb"])
        assert torch.equal(r["fp8"][0].view(torch.uint8), r["flat_fp8"][0].view(torch.uint8))
        assert torch.equal(r["fp8"][1], r["flat_fp8"][1])
        for key in ("fp8_tuple", "fp8_tuple_cached"):
            assert torch.equal(r[key][0].view(torch.uint8), r["flat_fp8_tuple"][0].view(torch.uint8))
            assert torch.equal(r[key][1], r["flat_fp8_tuple"][1])
        wx, widx, ww, wcounts = r["worst"]
        assert wx.shape[0] == 40 and wcounts == [] and torch.equal(wx[:m], r["rx"])
        assert bool((widx[m:] == -1).all()) and bool((ww[m:] == 0).all())
        assert torch.equal(r["worst_comb"], r["comb"])


def _autograd_chain(rank, world, group):
    idx, w = make_routing(rank, 9, 6, 8, 3, 0.1)
    x = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    outs = []
    for buf in (ep_comm.Buffer(group), ep_comm.Buffer(group, ranks_per_node=2)):
        xg, wg = x.clone().requires_grad_(), w.double().requires_grad_()
        recv_x, _, recv_w, _, handle, _ = ep_comm.dispatch(buf, xg, idx, wg, 8)
        y = recv_x * recv_w.sum(1, keepdim=True) + recv_x.pow(2)
        out, out_w, _ = ep_comm.combine(buf, y, handle, topk_weights=recv_w)
        (out.sum() + (out_w * out_w).sum()).backward()
        outs.append((out.detach(), xg.grad, wg.grad))
    return outs


def test_autograd_through_node_aware_buffer(ranks):
    for flat, hier in ranks(4, _autograd_chain):
        for a, b in zip(flat, hier):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def _masked_falls_back(rank, world, group):
    x, idx, w = _inputs(rank, Case(2, 2, (5, 5, 5, 5), 8, 2, 128, torch.bfloat16))
    buf = ep_comm.Buffer(group, ranks_per_node=2)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, 8)
    before = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    buf.mask_ranks([])  # forms a group of the live ranks: the Buffer goes flat from here on
    after = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    return before[4].node_plan is not None, after[4].node_plan is None, torch.equal(before[0], after[0])


def test_mask_ranks_falls_back_to_flat(ranks):
    for was_two_hop, now_flat, same in ranks(4, _masked_falls_back):
        assert was_two_hop and now_flat and same


def _bad_args(rank, world, group):
    errors = []
    # backend="nvshmem" with ranks_per_node: tests/test_two_hop_path.py
    for kwargs in (dict(ranks_per_node=3), dict(ranks_per_node=0), dict(ranks_per_node=2.0)):
        try:
            ep_comm.Buffer(group, **kwargs)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_ranks_per_node_validation(ranks):
    for errors in ranks(4, _bad_args):
        assert len(errors) == 3 and all("ranks_per_node" in e for e in errors)
