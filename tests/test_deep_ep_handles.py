"""Dispatch handles are DeepEP's tuples: every entry's value, dtype and shape against DeepEP's
definitions, computed here by brute force from all ranks' routings (2 and 4 gloo ranks, flat and
node-aware); DeepEP V1's positional order on every public method; and tuples built or sliced
outside ep_comm are refused."""
from __future__ import annotations

import inspect
import math

import pytest
import torch
from support.rank_cases import make_routing, make_x

import ep_comm
from ep_comm.handle import InternodeDispatchHandle, IntranodeDispatchHandle, LowLatencyHandle

NUM_SMS = 8  # DeepEP's channels: num_sms // 2


def _dispatch_case(rank, world, group, experts, tokens, ranks_per_node):
    idx, w = make_routing(rank, 11, tokens[rank], experts, 3)
    x = make_x(rank, 11, tokens[rank], 32, torch.bfloat16)
    buf = ep_comm.Buffer(group, ranks_per_node=ranks_per_node)
    layout = buf.get_dispatch_layout(idx, experts)
    config = ep_comm.Config(NUM_SMS)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, None, layout[0], layout[1], layout[3], layout[2], idx, w,
                                              config=config)
    combined, _, _ = buf.combine(recv_x, handle)
    cached, *_ = buf.dispatch(x, handle)
    errors = {}
    for name, bad in (("sliced", handle[:]), ("rebuilt", tuple(handle)), ("list", list(handle))):
        try:
            buf.combine(recv_x, bad)
        except ValueError as error:
            errors[name] = str(error)
    return dict(kind=type(handle).__name__, entries=tuple(handle), mask=layout[3], x=x,
                cached_equal=torch.equal(cached, recv_x), combined=combined, errors=errors,
                names=type(handle).FIELDS, by_name={n: getattr(handle, n) for n in type(handle).FIELDS})


def _channels(num_tokens: int) -> list[range]:
    c = NUM_SMS // 2
    per = max(1, math.ceil(num_tokens / c))
    return [range(min(per * i, num_tokens), min(per * i + per, num_tokens)) for i in range(c)]


def _channel_of(t: int, num_tokens: int) -> int:
    return next(i for i, r in enumerate(_channels(num_tokens)) if t in r)


def _check_common(results):
    for got in results:
        assert got["cached_equal"]
        for name in ("sliced", "rebuilt", "list"):
            assert "handle" in got["errors"][name] and "outside ep_comm" in got["errors"][name]
        for i, name in enumerate(got["names"]):
            assert got["by_name"][name] is got["entries"][i]


@pytest.mark.parametrize("world,tokens", [(2, (9, 0)), (4, (13, 6, 1, 20))])
def test_intranode_handle_entries(ranks, world, tokens):
    experts = 4 * world
    results = ranks(world, _dispatch_case, experts, tokens, None)
    _check_common(results)
    masks = [r["mask"] for r in results]
    sent = torch.tensor([[int(m[:, j].sum()) for j in range(world)] for m in masks])  # [src, dst]
    for rank, got in enumerate(results):
        assert got["kind"] == IntranodeDispatchHandle.__name__ and len(got["entries"]) == 6
        rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, is_token_in_rank, send_head = got["entries"]
        c = NUM_SMS // 2
        assert rank_prefix.dtype == torch.int32 and rank_prefix.shape == (world, world)
        assert torch.equal(rank_prefix, sent.cumsum(0).int())
        mask = masks[rank]
        n = mask.shape[0]
        assert channel_prefix.dtype == torch.int32 and channel_prefix.shape == (world, c)
        for j in range(world):
            per_channel = [int(mask[list(ch), j].sum()) if len(ch) else 0 for ch in _channels(n)]
            assert channel_prefix[j].tolist() == list(torch.tensor(per_channel).cumsum(0))
        # rows arrive by source rank, then source token
        expected_src = [t for i in range(world) for t in range(masks[i].shape[0]) if masks[i][t, rank]]
        assert recv_src_idx.dtype == torch.int32 and recv_src_idx.tolist() == expected_src
        assert recv_channel_prefix.dtype == torch.int32 and recv_channel_prefix.shape == (world, c)
        for i in range(world):
            mine = [t for t in range(masks[i].shape[0]) if masks[i][t, rank]]
            starts = [sum(1 for t in mine if _channel_of(t, masks[i].shape[0]) < ch) for ch in range(c)]
            assert recv_channel_prefix[i].tolist() == starts
        assert torch.equal(is_token_in_rank, mask)
        assert send_head.dtype == torch.int32 and send_head.shape == (n, world)
        for t in range(n):
            ch = _channels(n)[_channel_of(t, n)]
            for j in range(world):
                want = sum(1 for u in ch if u < t and mask[u, j]) if mask[t, j] else -1
                assert int(send_head[t, j]) == want


def test_internode_handle_entries(ranks):
    world, per_node, tokens = 4, 2, (11, 5, 0, 17)
    results = ranks(world, _dispatch_case, 16, tokens, per_node)
    _check_common(results)
    masks = [r["mask"] for r in results]
    nodes, c = world // per_node, NUM_SMS // 2
    for rank, got in enumerate(results):
        assert got["kind"] == InternodeDispatchHandle.__name__ and len(got["entries"]) == 10
        (is_token_in_rank, rdma_prefix, gbl_prefix, recv_rdma_prefix, recv_rdma_rank_prefix, recv_gbl_prefix,
         recv_gbl_rank_prefix, src_meta, send_rdma_head, send_nvl_head) = got["entries"]
        mask = masks[rank]
        n = mask.shape[0]
        node_mask = mask.view(n, nodes, per_node).any(2)
        node, local = divmod(rank, per_node)
        assert torch.equal(is_token_in_rank, mask)

        def inclusive(m, col):
            counts = [int(m[list(ch), col].sum()) if len(ch) else 0 for ch in _channels(m.shape[0])]
            return list(torch.tensor(counts).cumsum(0))

        assert rdma_prefix.shape == (nodes, c) and rdma_prefix.dtype == torch.int32
        assert [rdma_prefix[g].tolist() for g in range(nodes)] == [inclusive(node_mask, g) for g in range(nodes)]
        assert [gbl_prefix[j].tolist() for j in range(world)] == [inclusive(mask, j) for j in range(world)]
        # as a forwarder: the rail rows from node g's peer with this rank's local index
        rail = []  # (source node, token, targets on this node)
        for g in range(nodes):
            src = masks[g * per_node + local]
            here = src[:, node * per_node:(node + 1) * per_node]
            rail += [(g, t, here[t]) for t in range(src.shape[0]) if bool(here[t].any())]
        rail_counts = [sum(1 for g, _, _ in rail if g == gg) for gg in range(nodes)]
        assert recv_rdma_rank_prefix.tolist() == list(torch.tensor(rail_counts).cumsum(0))
        for g in range(nodes):
            n_src = masks[g * per_node + local].shape[0]
            per_channel = [sum(1 for gg, t, _ in rail if gg == g and _channel_of(t, n_src) == ch) for ch in range(c)]
            assert recv_rdma_prefix[g].tolist() == list(torch.tensor(per_channel).cumsum(0))
        assert send_nvl_head.shape == (len(rail), per_node)
        for q, (g, t, targets) in enumerate(rail):
            n_src = masks[g * per_node + local].shape[0]
            for lr in range(per_node):
                before = sum(1 for gg, u, tg in rail[:q] if gg == g and _channel_of(u, n_src) == _channel_of(t, n_src)
                             and tg[lr])
                assert int(send_nvl_head[q, lr]) == (before if targets[lr] else -1)
        # as a receiver: rows by source rank, then token
        received = [(i, t) for i in range(world) for t in range(masks[i].shape[0]) if masks[i][t, rank]]
        per_source = [sum(1 for i, _ in received if i == s) for s in range(world)]
        assert recv_gbl_rank_prefix.tolist() == list(torch.tensor(per_source).cumsum(0))
        for i in range(world):
            n_src = masks[i].shape[0]
            starts = [sum(1 for s, t in received if s == i and _channel_of(t, n_src) < ch) for ch in range(c)]
            assert recv_gbl_prefix[i].tolist() == starts
        assert src_meta.dtype == torch.uint8 and src_meta.shape == (len(received), 8)
        meta = src_meta.view(torch.int32)
        for row, (i, t) in enumerate(received):
            bits = sum(1 << lr for lr in range(per_node) if masks[i][t, node * per_node + lr])
            assert meta[row].tolist() == [i // per_node, bits]
        for t in range(n):
            ch = _channels(n)[_channel_of(t, n)]
            for g in range(nodes):
                want = sum(1 for u in ch if u < t and node_mask[u, g]) if node_mask[t, g] else -1
                assert int(send_rdma_head[t, g]) == want


def test_low_latency_handle_is_deep_eps_tuple(ranks):
    results = ranks(2, _ll_case)
    for got in results:
        assert got["kind"] == LowLatencyHandle.__name__ and got["length"] == 5
        assert got["sizes"] == [8, 128, 4]
        assert "outside ep_comm" in got["error"]


def _ll_case(rank, world, group):
    idx, w = make_routing(rank, 5, 6, 4, 2)
    x = make_x(rank, 5, 6, 128, torch.bfloat16)
    buf = ep_comm.Buffer(group, low_latency_mode=True)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 8, 4, None, None, False)
    try:
        buf.low_latency_combine(recv_x, idx, w, handle[:])
        error = ""
    except ValueError as e:
        error = str(e)
    return dict(kind=type(handle).__name__, length=len(handle), sizes=list(handle[2:]), error=error)


# DeepEP V1's parameters of each public method, in its order (its last V1 deep_ep/buffer.py)
DEEP_EP_V1 = {
    "__init__": ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                 "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
                 "enable_shrink", "comm"],
    "get_dispatch_layout": ["topk_idx", "num_experts", "previous_event", "async_finish", "allocate_on_comm_stream"],
    "dispatch": ["x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
                 "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens",
                 "config", "previous_event", "async_finish", "allocate_on_comm_stream"],
    "combine": ["x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
                "allocate_on_comm_stream"],
    "low_latency_dispatch": ["x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
                             "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "use_fp8",
                             "round_scale", "use_ue8m0", "async_finish", "return_recv_hook"],
    "low_latency_combine": ["x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy", "async_finish",
                            "return_recv_hook", "out", "combine_wait_recv_cost_stats"],
    "clean_low_latency_buffer": ["num_max_dispatch_tokens_per_rank", "hidden", "num_experts"],
    "get_next_low_latency_combine_buffer": ["handle"],
    "get_local_buffer_tensor": ["dtype", "size", "offset", "use_rdma_buffer"],
    "get_low_latency_rdma_size_hint": ["num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts"],
    "set_num_sms": ["new_num_sms"],
    "get_dispatch_config": ["num_ranks"],
    "get_combine_config": ["num_ranks"],
}


@pytest.mark.parametrize("method", sorted(DEEP_EP_V1))
def test_positional_order_is_deep_ep_v1(method):
    params = [p for p in inspect.signature(getattr(ep_comm.Buffer, method)).parameters.values() if p.name != "self"]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert positional == DEEP_EP_V1[method]
    # ep_comm's extras are keyword-only
    assert all(p.kind == p.KEYWORD_ONLY for p in params if p.name not in DEEP_EP_V1[method])
