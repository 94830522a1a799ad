"""DeepEP 2.x's ElasticBuffer (ep_comm.integrations.deep_ep_elastic) on 2 and 4 gloo ranks,
against ep_comm.reference."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from support.rank_cases import make_routing, make_x

from ep_comm import reference
from ep_comm.codecs import fp8
from ep_comm.integrations.deep_ep_elastic import ElasticBuffer, EPHandle
from ep_comm.placement import ExpertPlacement

HIDDEN, TOPK, MAX_TOKENS = 256, 4, 24


def _tokens(rank: int) -> int:
    return MAX_TOKENS - 3 * rank


def _inputs(rank: int, seed: int, experts: int):
    idx, w = make_routing(rank, seed, _tokens(rank), experts, TOPK)
    return make_x(rank, seed, _tokens(rank), HIDDEN, torch.bfloat16), idx, w


def _expected(world: int, seed: int, experts: int) -> list[reference.RankReceive]:
    ins = [_inputs(r, seed, experts) for r in range(world)]
    return reference.dispatch([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins],
                              ExpertPlacement.contiguous(experts, world))


def _pair_values(handle: EPHandle, rank: int) -> torch.Tensor:
    """``[M, K, H]`` bf16 expert outputs per (received token, top-k entry), from the source ids."""
    src = handle.recv_src_metadata[:handle.num_recv_tokens, 0].double()
    k = torch.arange(TOPK, dtype=torch.float64)
    h = torch.arange(1, HIDDEN + 1, dtype=torch.float64)
    return torch.sin((src[:, None, None] * TOPK + k[None, :, None] + 1) * 0.37 * h + rank).to(torch.bfloat16)


def _main_case(rank, world, group, seed, experts, alignment, cpu_sync):
    x, idx, w = _inputs(rank, seed, experts)
    buf = ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                        explicitly_destroy=True)
    stats = torch.zeros(experts // world, dtype=torch.int32)
    recv_x, recv_idx, recv_w, handle, event = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=experts, expert_alignment=alignment,
        do_cpu_sync=cpu_sync, cumulative_local_expert_recv_stats=stats)
    m = handle.num_recv_tokens
    out = dict(recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, m=m, stats=stats,
               meta=handle.recv_src_metadata, psum_rank=handle.psum_num_recv_tokens_per_scaleup_rank,
               psum_expert=handle.psum_num_recv_tokens_per_expert, counts=handle.num_recv_tokens_per_expert_list,
               dst=handle.dst_buffer_slot_idx, has_event=event.event is not None)
    # combine: per received row, the unweighted sum over its local pairs (multiple reduction)
    pairs = _pair_values(handle, rank)
    valid = recv_idx[:m] >= 0
    acc = torch.zeros(m, HIDDEN)
    for k in range(TOPK):
        acc += pairs[:, k].float() * valid[:, k:k + 1]
    y_rows = torch.zeros(recv_x.shape[0], HIDDEN, dtype=torch.bfloat16)
    y_rows[:m] = acc.to(torch.bfloat16)
    out["y_rows"] = y_rows[:m]
    out["combined"], out["combined_w"], _ = buf.combine(y_rows, handle, topk_weights=recv_w)
    bias = (make_x(rank, seed + 1, _tokens(rank), HIDDEN, torch.bfloat16),
            make_x(rank, seed + 2, _tokens(rank), HIDDEN, torch.bfloat16))
    out["bias"] = bias
    out["combined_bias"], _, _ = buf.combine(y_rows, handle, bias=bias)

    # expand mode
    ex_x, ex_idx, ex_w, ex_handle, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=experts, expert_alignment=alignment,
        do_cpu_sync=cpu_sync, do_expand=True, do_zero_padding=True)
    slots = ex_handle.expanded_slots
    ex_y = torch.zeros(ex_x.shape[0], HIDDEN, dtype=torch.bfloat16)
    ex_y[slots[slots >= 0]] = pairs[slots >= 0]
    out.update(ex_x=ex_x, ex_idx=ex_idx, ex_w=ex_w, ex_slots=slots, ex_psum=ex_handle.psum_num_recv_tokens_per_expert,
               ex_unaligned=ex_handle.num_unaligned_recv_tokens_per_expert,
               ex_num=ex_handle.num_expanded_tokens)
    out["ex_combined"], out["ex_combined_w"], _ = buf.combine(ex_y, ex_handle, topk_weights=ex_w)

    # cached dispatch, plain and expanded (with weights)
    c_x, c_idx, c_w, c_handle, _ = buf.dispatch(x, handle=handle)
    out.update(c_x=c_x, c_idx=c_idx, c_w=c_w, c_same=c_handle is handle)
    cex_x, _, cex_w, _, _ = buf.dispatch(x, topk_weights=w, handle=ex_handle, do_expand=True, do_zero_padding=True)
    out.update(cex_x=cex_x, cex_w=cex_w)
    buf.destroy()
    return out


@pytest.mark.parametrize("world,alignment,cpu_sync", [(2, 1, True), (2, 4, False), (4, 1, False), (4, 8, True)])
def test_dispatch_expand_cached_combine_match_reference(ranks, world, alignment, cpu_sync):
    seed, experts = 11, 8 * world // 2
    results = ranks(world, _main_case, seed, experts, alignment, cpu_sync)
    expected = _expected(world, seed, experts)
    ins = [_inputs(r, seed, experts) for r in range(world)]
    local = experts // world
    for res, ref in zip(results, expected):
        m = len(ref.sources)
        assert res["m"] == m
        rows = res["recv_x"].shape[0]
        assert rows == (m if cpu_sync else world * MAX_TOKENS)
        assert torch.equal(res["recv_x"][:m], ref.x)
        assert torch.equal(res["recv_idx"][:m], ref.topk_idx)
        assert torch.equal(res["recv_w"][:m], ref.topk_weights)
        assert torch.equal(res["stats"], torch.tensor(ref.counts_per_expert, dtype=torch.int32))
        src_global = ref.src_rank * MAX_TOKENS + ref.src_idx
        assert torch.equal(res["meta"][:m, 0].long(), src_global)
        assert torch.equal(res["meta"][:m, 1].long(), ref.src_rank)
        per_source = torch.bincount(ref.src_rank, minlength=world)
        assert torch.equal(res["psum_rank"].long(), per_source.cumsum(0))
        aligned = [(c + alignment - 1) // alignment * alignment for c in ref.counts_per_expert]
        assert res["psum_expert"].tolist() == torch.tensor(aligned).cumsum(0).tolist()
        assert res["counts"] == (aligned if cpu_sync else [])

        # expand layout: expert blocks at aligned starts, pairs in received order, zero padding
        counts = ref.counts_per_expert
        starts = [sum(aligned[:j]) for j in range(local)]
        assert res["ex_idx"] is None
        assert res["ex_unaligned"].tolist() == counts
        assert res["ex_psum"].tolist() == [s + c for s, c in zip(starts, counts)]
        assert res["ex_num"] == sum(aligned)
        filled = torch.zeros(res["ex_x"].shape[0], dtype=torch.bool)
        for j in range(local):
            pair_rows, pair_k = (ref.topk_idx == j).nonzero(as_tuple=True)
            want_slots = torch.arange(starts[j], starts[j] + counts[j])
            assert torch.equal(res["ex_slots"][pair_rows, pair_k], want_slots)
            assert torch.equal(res["ex_x"][want_slots], ref.x[pair_rows])
            assert torch.equal(res["ex_w"][want_slots], ref.topk_weights[pair_rows, pair_k])
            filled[want_slots] = True
        assert (res["ex_slots"][ref.topk_idx < 0] == -1).all()
        assert (res["ex_x"][~filled] == 0).all() and (res["ex_w"][~filled] == 0).all()

        # cached dispatches repeat the first ones bit for bit
        assert res["c_same"] and res["c_w"] is None
        assert torch.equal(res["c_x"], res["recv_x"]) and torch.equal(res["c_idx"], res["recv_idx"])
        assert torch.equal(res["cex_x"], res["ex_x"]) and torch.equal(res["cex_w"], res["ex_w"])

    # dst_buffer_slot_idx: token i's row on the rank owning expert idx[i, k]
    for src, (_, idx, _) in enumerate(ins):
        dst = results[src]["dst"]
        for i in range(idx.shape[0]):
            for k in range(TOPK):
                if idx[i, k] < 0:
                    assert dst[i, k] == -1
                    continue
                owner = int(idx[i, k]) // local
                assert expected[owner].sources[int(dst[i, k])] == (src, i)

    # combine: DeepEP 2.x sums the returned rows unweighted; weights are reduced alongside
    want = reference.combine([r["y_rows"] for r in results], expected, [_tokens(r) for r in range(world)])
    for rank, res in enumerate(results):
        x, idx, w = ins[rank]
        assert torch.equal(res["combined"], want[rank])
        assert torch.equal(res["combined_w"], w.masked_fill(idx < 0, 0))
        assert torch.equal(res["ex_combined"], want[rank])
        assert torch.equal(res["ex_combined_w"], w.masked_fill(idx < 0, 0))
        with_bias = want[rank].float() + res["bias"][0].float() + res["bias"][1].float()
        torch.testing.assert_close(res["combined_bias"].float(), with_bias, rtol=2e-2, atol=2e-2)


def _fp8_case(rank, world, group, seed, experts):
    x, idx, w = _inputs(rank, seed, experts)
    q, s = fp8.quantize(x)
    buf = ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                        use_fp8_dispatch=True)
    plain, _, _, handle, _ = buf.dispatch((q, s), topk_idx=idx, topk_weights=w, num_experts=experts)
    tma, _, _, _, _ = buf.dispatch((q, s), topk_idx=idx, topk_weights=w, num_experts=experts,
                                   use_tma_aligned_col_major_sf=True)
    ex, _, _, ex_handle, _ = buf.dispatch((q, s), topk_idx=idx, topk_weights=w, num_experts=experts,
                                          do_expand=True, expert_alignment=4, use_tma_aligned_col_major_sf=True)
    cached, _, _, _, _ = buf.dispatch((q, s), handle=handle)
    return dict(q=q, s=s, plain=plain, tma=tma, tma_stride=tma[1].stride(), ex=ex,
                slots=ex_handle.expanded_slots, cached=cached)


@pytest.mark.parametrize("world", [2, 4])
def test_fp8_tuple_input(ranks, world):
    seed, experts = 5, 2 * world
    results = ranks(world, _fp8_case, seed, experts)
    expected = _expected(world, seed, experts)
    for res, ref in zip(results, expected):
        rows = torch.tensor([t for _, t in ref.sources], dtype=torch.long)
        srcs = [s for s, _ in ref.sources]
        want_q = torch.stack([results[s]["q"][t] for s, t in zip(srcs, rows.tolist())]) if srcs else None
        want_s = torch.stack([results[s]["s"][t] for s, t in zip(srcs, rows.tolist())]) if srcs else None
        for got in (res["plain"], res["tma"], res["cached"]):
            assert got[0].dtype == torch.float8_e4m3fn
            assert torch.equal(got[0].view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(got[1], want_s)
        m = want_s.shape[0]
        assert res["tma_stride"] == (1, (m + 3) // 4 * 4)
        valid = res["slots"] >= 0
        row_of_pair = torch.arange(m)[:, None].expand_as(res["slots"])[valid]
        assert torch.equal(res["ex"][0][res["slots"][valid]].view(torch.uint8), want_q[row_of_pair].view(torch.uint8))
        assert torch.equal(res["ex"][1][res["slots"][valid]], want_s[row_of_pair])


def _deterministic_case(rank, world, group, seed, experts):
    x, idx, w = _inputs(rank, seed, experts)
    buf = ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, deterministic=True)
    runs = []
    for _ in range(2):
        r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts, expert_alignment=2, do_cpu_sync=False)
        e = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts, do_expand=True, do_zero_padding=True)
        y = (r[0].float() * 1.5).to(torch.bfloat16)
        runs.append(dict(x=r[0], idx=r[1], w=r[2], meta=r[3].recv_src_metadata, ex_x=e[0], ex_w=e[2],
                         ex_meta=e[3].recv_src_metadata, combined=buf.combine(y, r[3], topk_weights=r[2])[0]))
    return runs


@pytest.mark.parametrize("world", [2, 4])
def test_deterministic_bit_identical_across_runs(ranks, world):
    for first, second in ranks(world, _deterministic_case, 3, 4 * world):
        for key in first:
            assert torch.equal(first[key], second[key]), key


def _errors_case(rank, world, group):
    x, idx, w = _inputs(rank, 1, 2 * world)
    errors = {}

    def expect(name, fn):
        try:
            fn()
        except ValueError as e:
            errors[name] = str(e)

    expect("cpu_bytes", lambda: ElasticBuffer(group, num_bytes=2 << 20, num_cpu_bytes=2 << 20))
    buf = ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS)
    _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=2 * world)
    expect("handle_and_topk", lambda: buf.dispatch(x, topk_idx=idx, handle=handle))
    expect("cpu_sync_cached", lambda: buf.dispatch(x, handle=handle, do_cpu_sync=True))
    expect("expand_mismatch", lambda: buf.dispatch(x, handle=handle, do_expand=True))
    expect("zero_padding", lambda: buf.dispatch(x, topk_idx=idx, num_experts=2 * world, do_zero_padding=True))
    expect("max_tokens", lambda: buf.dispatch(x, topk_idx=idx, num_experts=2 * world, num_max_tokens_per_rank=2))
    expect("qps", lambda: buf.dispatch(x, topk_idx=idx, num_experts=2 * world, num_qps=10_000))
    expect("event_stream", lambda: buf.dispatch(x, topk_idx=idx, num_experts=2 * world,
                                                previous_event=buf.capture()))
    expect("weights_dim", lambda: buf.combine(x, handle, topk_weights=torch.zeros(x.shape[0])))
    expect("destroy", buf.destroy)
    return sorted(errors)


def test_refused_arguments_raise_value_error(ranks):
    for names in ranks(2, _errors_case):
        assert names == sorted(["cpu_bytes", "handle_and_topk", "cpu_sync_cached", "expand_mismatch", "zero_padding",
                                "max_tokens", "qps", "event_stream", "weights_dim", "destroy"])


def test_size_hint_is_2mib_aligned_and_grows(ranks):
    sizes = ranks(2, _size_hints)
    small, big, fp8_big = sizes[0]
    assert small % (2 << 20) == 0 and big % (2 << 20) == 0 and big > small and fp8_big < big


def _size_hints(rank, world, group):
    return (ElasticBuffer.get_buffer_size_hint(group, 128, 1024, 8),
            ElasticBuffer.get_buffer_size_hint(group, 8192, 7168, 8),
            ElasticBuffer.get_buffer_size_hint(group, 8192, 7168, 8, use_fp8_dispatch=True))


def test_deep_ep_package_offers_the_2x_names():
    code = ("import ep_comm.integrations.deep_ep as s; s.install(); import deep_ep, torch; "
            "from deep_ep.buffers.legacy import Buffer; from deep_ep.buffers.elastic import ElasticBuffer, EPHandle; "
            "import ep_comm; from ep_comm.integrations import deep_ep_elastic as e; "
            "assert Buffer is ep_comm.Buffer and deep_ep.Buffer is Buffer; "
            "assert deep_ep.ElasticBuffer is ElasticBuffer is e.ElasticBuffer and deep_ep.EPHandle is EPHandle; "
            "assert deep_ep.topk_idx_t is torch.int64 and deep_ep.__version__.startswith('2.1.0+epcomm'); "
            "assert not any(hasattr(ElasticBuffer, n) for n in ('engram_fetch', 'pp_send', 'all_gather', "
            "'agrs_new_session')); "
            "[getattr(deep_ep, n) for n in ('EventOverlap', 'EventHandle', 'Config', 'get_physical_domain_size', "
            "'get_logical_domain_size')]")
    subprocess.run([sys.executable, "-c", code], check=True)


def _slot_values(src_global: torch.Tensor, recv_rank: torch.Tensor) -> torch.Tensor:
    """``[M, K, H]`` bf16 stand-in expert outputs of (token, top-k slot), from the source global
    index and the rank holding the slot's expert: the same on the expert's rank and the source."""
    k = torch.arange(TOPK, dtype=torch.float64)
    h = torch.arange(1, HIDDEN + 1, dtype=torch.float64)
    phase = (src_global.double()[:, None] * TOPK + k + 1) * 0.37
    return torch.sin(phase[:, :, None] * h + recv_rank.double()[:, :, None]).to(torch.bfloat16)


def _single_reduction_case(rank, world, group, seed, experts, cpu_sync):
    x, idx, w = _inputs(rank, seed, experts)
    idx[1, 2] = -1
    buf = ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                        allow_multiple_reduction=False)
    ex_x, _, ex_w, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=experts, do_expand=True,
                                            expert_alignment=4, do_cpu_sync=cpu_sync)
    m = handle.num_recv_tokens
    slots = handle.expanded_slots
    valid = slots >= 0
    y = _slot_values(handle.recv_src_metadata[:m, 0], torch.full((m, TOPK), rank))
    x_expanded = torch.zeros(ex_x.shape[0], HIDDEN, dtype=torch.bfloat16)
    x_expanded[slots[valid]] = y[valid]
    bias = (make_x(rank, seed + 1, _tokens(rank), HIDDEN, torch.bfloat16),
            make_x(rank, seed + 2, _tokens(rank), HIDDEN, torch.bfloat16))
    combined, combined_w, _ = buf.combine(x_expanded, handle, topk_weights=ex_w, bias=bias)
    # expected at the source: bias, then the slots in top-k order, in float32, rounded once
    n = _tokens(rank)
    src_global = rank * MAX_TOKENS + torch.arange(n)
    mine = _slot_values(src_global, torch.div(idx, experts // world, rounding_mode="floor"))
    acc = bias[0].float() + bias[1].float()
    for k in range(TOPK):
        acc += torch.where((idx[:, k] >= 0)[:, None], mine[:, k].float(), torch.zeros(()))
    return dict(combined=combined, expected=acc.to(torch.bfloat16), combined_w=combined_w,
                w=w.masked_fill(idx < 0, 0))


@pytest.mark.parametrize("world,cpu_sync", [(2, True), (4, False)])
def test_expand_combine_without_multiple_reduction_rounds_once(ranks, world, cpu_sync):
    for res in ranks(world, _single_reduction_case, 5, 4 * world, cpu_sync):
        assert torch.equal(res["combined"], res["expected"])
        assert torch.equal(res["combined_w"], res["w"])
