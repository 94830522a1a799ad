"""DeepEP V1 calls beyond the core contract that DeepEP client code makes: the constructor's
flags and destroy(), the low-latency helpers (clean buffer, zero-copy combine buffer, LogFMT flag,
wait-cost statistics), dispatch from the layout alone (no topk_idx), a cached dispatch of another
hidden size, FP8 raw byte counts, and the shim's extension-module names. 2 and 4 gloo ranks."""
from __future__ import annotations

import pytest
import torch
from support.rank_cases import make_routing, make_x

import ep_comm

NUM_EXPERTS, HIDDEN = 8, 256


def _constructor_flags(rank, world, group):
    buf = ep_comm.Buffer(group, 0, 0, False, 24, True, False, False, True)  # DeepEP's positional order
    flags = (buf.allow_nvlink_for_low_latency_mode, buf.allow_mnnvl, buf.use_fabric, buf.explicitly_destroy)
    event = ep_comm.Buffer.capture()
    event.current_stream_wait()
    with torch.cuda.stream(buf.get_comm_stream()):  # None on the CPU: a no-op, as DeepEP code uses it
        layout = buf.get_dispatch_layout(torch.zeros(3, 1, dtype=torch.int64), 2)
    flags += (isinstance(ep_comm.Buffer.is_sm90_compiled(), bool), buf.get_comm_stream() is None,
              layout[0].tolist() == [3, 0])
    buf.destroy()
    errors = {}
    for name, kwargs in (("enable_shrink", dict(enable_shrink="yes")), ("comm", dict(comm=object())),
                         ("allow_mnnvl", dict(allow_mnnvl="yes"))):
        try:
            ep_comm.Buffer(group, allow_nvlink_for_low_latency_mode=False, **kwargs)
        except ValueError as error:
            errors[name] = str(error)
    return flags, errors


def test_deep_ep_constructor_flags_and_destroy(ranks):
    for flags, errors in ranks(2, _constructor_flags):
        assert flags == (True, False, False, True, True, True, True)
        assert set(errors) == {"enable_shrink", "comm", "allow_mnnvl"}
        for name, text in errors.items():
            assert name in text


def _low_latency_helpers(rank, world, group):
    buf = ep_comm.Buffer(group, 0, 1 << 20, low_latency_mode=True)
    x = make_x(rank, 3, 12, HIDDEN, torch.bfloat16)
    topk_idx, topk_weights = make_routing(rank, 3, 12, NUM_EXPERTS, 3)
    buf.clean_low_latency_buffer(16, HIDDEN, NUM_EXPERTS)
    waits = torch.zeros(world, dtype=torch.int64)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, topk_idx, 16, NUM_EXPERTS, use_fp8=False,
                                                           dispatch_wait_recv_cost_stats=waits)
    expert_out = recv_x * 2
    reference, _, _ = buf.low_latency_combine(expert_out, topk_idx, topk_weights, handle)
    staged = buf.get_next_low_latency_combine_buffer(handle)
    shape_ok = staged.shape == expert_out.shape and staged.dtype == torch.bfloat16
    staged.copy_(expert_out)
    combine_waits = torch.zeros(world, dtype=torch.int64)
    zero_copy, _, hook = buf.low_latency_combine(staged, topk_idx, topk_weights, handle, zero_copy=True,
                                                 use_logfmt=True, return_recv_hook=True,
                                                 combine_wait_recv_cost_stats=combine_waits)
    hook()
    errors = []
    for bad in (torch.zeros(world + 1, dtype=torch.int64), torch.zeros(world, dtype=torch.int32)):
        try:
            buf.low_latency_dispatch(x, topk_idx, 16, NUM_EXPERTS, use_fp8=False,
                                     dispatch_wait_recv_cost_stats=bad)
        except ValueError as error:
            errors.append("dispatch_wait_recv_cost_stats" in str(error))
    try:
        buf.clean_low_latency_buffer(0, HIDDEN, NUM_EXPERTS)
    except ValueError as error:
        errors.append("num_max_dispatch_tokens_per_rank" in str(error))
    for name in ("zero_copy", "use_logfmt"):
        try:
            buf.low_latency_combine(expert_out, topk_idx, topk_weights, handle, **{name: "yes"})
        except ValueError as error:
            errors.append(name in str(error))
    return dict(same=torch.equal(zero_copy, reference), shape_ok=shape_ok, waits=waits.tolist(),
                combine_waits=combine_waits.tolist(), errors=errors)


def test_low_latency_helpers(ranks):
    for r in ranks(2, _low_latency_helpers):
        assert r["same"] and r["shape_ok"]
        assert all(w > 0 for w in r["waits"]) and all(w > 0 for w in r["combine_waits"])
        assert r["errors"] == [True, True, True, True, True]


def _dispatch_without_topk(rank, world, group, alignment):
    buf = ep_comm.Buffer(group)
    x = make_x(rank, 5, 20 + rank, HIDDEN, torch.bfloat16)
    topk_idx, topk_weights = make_routing(rank, 5, 20 + rank, NUM_EXPERTS, 3)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    full = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                        expert_alignment=alignment)
    bare = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, expert_alignment=alignment)
    combined, weights, _ = buf.combine(bare[0], bare[4])
    copies = in_rank.sum(1, keepdim=True).float()
    errors = []
    for kwargs in (dict(num_tokens_per_expert=per_expert), dict(is_token_in_rank=in_rank),
                   dict(is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_weights=topk_weights)):
        try:
            buf.dispatch(x, **kwargs)
        except ValueError as error:
            errors.append(str(error))
    return dict(x_same=torch.equal(bare[0], full[0]), counts=(bare[3], full[3]),
                none=(bare[1] is None and bare[2] is None),
                combined=torch.equal(combined, (x.float() * copies).to(torch.bfloat16)),
                weights_none=weights is None, errors=errors)


@pytest.mark.parametrize("world,alignment", [(2, 1), (4, 4)])
def test_dispatch_from_the_layout_alone(ranks, world, alignment):
    for r in ranks(world, _dispatch_without_topk, alignment):
        assert r["x_same"] and r["none"] and r["combined"] and r["weights_none"]
        assert r["counts"][0] == r["counts"][1]
        assert len(r["errors"]) == 3
        assert "is_token_in_rank" in r["errors"][0] and "num_tokens_per_expert" in r["errors"][1]
        assert "topk_weights" in r["errors"][2]


def _cached_other_hidden(rank, world, group):
    buf = ep_comm.Buffer(group)
    x = make_x(rank, 6, 15, HIDDEN, torch.bfloat16)
    wide = make_x(rank, 7, 15, 3 * HIDDEN, torch.float32)
    topk_idx, topk_weights = make_routing(rank, 6, 15, NUM_EXPERTS, 2)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    out = buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx)
    cached = buf.dispatch(wide, handle=out[4])[0]
    fresh = buf.dispatch(wide, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx)[0]
    try:
        buf.dispatch(wide[:-1], handle=out[4])
        error = ""
    except ValueError as e:
        error = str(e)
    return torch.equal(cached, fresh), error


def test_cached_dispatch_of_another_hidden_size(ranks):
    for same, error in ranks(2, _cached_other_hidden):
        assert same
        assert "14 tokens" in error


def _fp8_raw_bytes(rank, world, group):
    buf = ep_comm.Buffer(group)
    x = make_x(rank, 8, 16, HIDDEN, torch.bfloat16)
    topk_idx, topk_weights = make_routing(rank, 8, 16, NUM_EXPERTS, 3)
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    stats = {}
    for codec in ("none", "fp8"):
        out = buf.dispatch(x, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                           topk_weights=topk_weights, codec=codec)
        stats[codec] = buf.last_stats
        buf.dispatch(x, handle=out[4], codec=codec)
        stats[f"cached_{codec}"] = buf.last_stats
    return {k: (s.bytes_sent_raw, s.bytes_recv_raw, s.total_sent_wire) for k, s in stats.items()}


def test_fp8_stats_count_raw_bytes_in_the_input_dtype(ranks):
    for r in ranks(2, _fp8_raw_bytes):
        for kind in ("", "cached_"):
            none, fp8 = r[kind + "none"], r[kind + "fp8"]
            assert fp8[0] == none[0] and fp8[1] == none[1]
            assert fp8[2] < 0.6 * none[2]


def test_shim_exports_the_extension_names():
    import sys

    from ep_comm.integrations import deep_ep as shim

    shim.install()
    try:
        import deep_ep
        import deep_ep_cpp

        assert deep_ep.topk_idx_t is torch.int64 and deep_ep_cpp.topk_idx_t is torch.int64
        assert deep_ep_cpp.Config is ep_comm.Config and deep_ep_cpp.EventHandle is deep_ep.utils.EventHandle
    finally:
        shim.uninstall()
    assert "deep_ep_cpp" not in sys.modules and "deep_ep" not in sys.modules
