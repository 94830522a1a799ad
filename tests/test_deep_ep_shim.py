"""DeepEP-style client code (written as Megatron's fused_a2a and DeepEP's tests do) on ep_comm, and the
``deep_ep`` package the shim provides: real module specs, DeepEP 2.x's top-level names, the helper
modules ``deep_ep.utils.{envs, math, testing, event}``."""
from __future__ import annotations

import pytest
import torch
from support.rank_cases import make_routing, make_x


def _deep_ep_client(rank, world, group):
    from ep_comm.integrations import deep_ep as shim

    shim.install()
    import deep_ep
    from deep_ep.utils import EventHandle, EventOverlap

    num_experts, hidden = 8, 256
    x = make_x(rank, 2, 10 + rank, hidden, torch.bfloat16)
    topk_idx, topk_weights = make_routing(rank, 2, 10 + rank, num_experts, 4)

    deep_ep.Buffer.set_num_sms(24)
    config = deep_ep.Buffer.get_dispatch_config(world)
    combine_config = deep_ep.Buffer.get_combine_config(world)
    hidden_bytes = hidden * 2
    num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, world),
                        combine_config.get_nvl_buffer_size_hint(hidden_bytes, world))
    num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, world),
                         combine_config.get_rdma_buffer_size_hint(hidden_bytes, world))
    buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)
    assert buffer.group is group and buffer.num_nvl_bytes == num_nvl_bytes
    assert buffer.num_rdma_bytes == num_rdma_bytes and deep_ep.Buffer.num_sms == 24

    previous_event = EventOverlap(EventHandle())
    (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
     event) = buffer.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event,
                                         async_finish=True, allocate_on_comm_stream=True)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \
        buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                        num_tokens_per_rank=num_tokens_per_rank,
                        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                        previous_event=event, async_finish=True, allocate_on_comm_stream=True,
                        config=config)
    event.current_stream_wait()
    combined_x, combined_topk_weights, event = buffer.combine(
        recv_x, handle, topk_weights=recv_topk_weights, config=combine_config, async_finish=True,
        previous_event=event, allocate_on_comm_stream=True)
    event.current_stream_wait()
    cached_x, _, _, _, _, _ = buffer.dispatch(x, handle=handle, config=config)

    ll_size = deep_ep.Buffer.get_low_latency_rdma_size_hint(32, hidden, world, num_experts)
    ll_buffer = deep_ep.Buffer(group, 0, ll_size, low_latency_mode=True,
                               num_qps_per_rank=num_experts // world)
    packed_x, packed_count, ll_handle, ll_event, hook = ll_buffer.low_latency_dispatch(
        x, topk_idx, 32, num_experts, use_fp8=False, async_finish=False, return_recv_hook=True)
    hook()
    ll_out, ll_event, ll_hook = ll_buffer.low_latency_combine(
        packed_x, topk_idx, topk_weights, ll_handle, async_finish=False, return_recv_hook=False)
    copies = torch.zeros(x.shape[0])
    for r in range(world):
        copies += ((topk_idx >= 0) & (topk_idx // (num_experts // world) == r)).any(1).float()
    weight_sum = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights)).sum(1)
    shim.uninstall()
    return dict(
        combined_ok=torch.equal(combined_x, (x.float() * copies[:, None]).to(torch.bfloat16)),
        cached_ok=torch.equal(cached_x, recv_x), counts=sum(num_recv_tokens_per_expert_list),
        recv_entries=int((recv_topk_idx >= 0).sum()),
        ll_ok=torch.allclose(ll_out.float(), x.float() * weight_sum[:, None], rtol=2e-2, atol=2e-2),
        ll_hook_none=ll_hook is None, ll_size=ll_size)


def test_deep_ep_style_client_runs_unmodified(ranks):
    for r in ranks(2, _deep_ep_client):
        assert r["combined_ok"] and r["cached_ok"] and r["ll_ok"] and r["ll_hook_none"]
        assert r["counts"] == r["recv_entries"]
        assert r["ll_size"] > 0


def test_install_is_idempotent_and_reversible():
    import sys

    from ep_comm.integrations import deep_ep as shim

    module = shim.install()
    assert shim.install() is module
    import deep_ep

    assert deep_ep.Buffer.__module__ == "ep_comm.buffer"
    shim.uninstall()
    assert "deep_ep" not in sys.modules


def test_installed_modules_have_specs_that_find_spec_returns():
    import importlib.util

    from ep_comm.integrations import deep_ep as shim

    shim.install()
    try:
        spec = importlib.util.find_spec("deep_ep")
        assert spec is not None and spec.submodule_search_locations
        assert spec.origin.startswith(shim.PATH_ENTRY)
        for name in ("deep_ep.utils", "deep_ep.utils.envs", "deep_ep.utils.math", "deep_ep.utils.testing",
                     "deep_ep.utils.event", "deep_ep.utils.gate", "deep_ep.utils.refs", "deep_ep_cpp"):
            sub = importlib.util.find_spec(name)
            assert sub is not None and sub.origin.startswith(shim.PATH_ENTRY), name
    finally:
        shim.uninstall()


def test_deep_ep_2x_top_level_names_and_helper_modules():
    import inspect

    version = pytest.importorskip("packaging.version")
    import ep_comm
    from ep_comm.integrations import deep_ep as shim
    from ep_comm.integrations.deep_ep_utils import envs, gate, refs, testing
    from ep_comm.integrations.deep_ep_utils import math as ep_math

    shim.install()
    try:
        import deep_ep
        from deep_ep.utils.envs import init_dist
        from deep_ep.utils.event import EventHandle, EventOverlap
        from deep_ep.utils.gate import get_unbalanced_scores
        from deep_ep.utils.math import (
            calc_diff,
            create_grouped_scores,
            hash_tensor,
            inplace_unique,
            per_token_cast_back,
            per_token_cast_to_fp8,
        )
        from deep_ep.utils.refs import combine as ref_combine
        from deep_ep.utils.refs import dispatch as ref_dispatch
        from deep_ep.utils.refs import generate_pre_combine_data, ordered_accumulate
        from deep_ep.utils.testing import bench, bench_kineto

        assert deep_ep.EventHandle is ep_comm.EventHandle is EventHandle
        assert deep_ep.EventOverlap is EventOverlap is ep_comm.EventOverlap
        assert deep_ep.get_physical_domain_size is envs.get_physical_domain_size
        assert deep_ep.get_logical_domain_size is envs.get_logical_domain_size
        assert init_dist is envs.init_dist and bench is testing.bench and bench_kineto is testing.bench_kineto
        assert (calc_diff, create_grouped_scores, hash_tensor, inplace_unique, per_token_cast_back,
                per_token_cast_to_fp8) == (ep_math.calc_diff, ep_math.create_grouped_scores, ep_math.hash_tensor,
                                           ep_math.inplace_unique, ep_math.per_token_cast_back,
                                           ep_math.per_token_cast_to_fp8)
        assert deep_ep.utils.math.calc_diff is calc_diff  # submodules are attributes after import deep_ep
        assert get_unbalanced_scores is gate.get_unbalanced_scores
        assert (ref_combine, ref_dispatch, generate_pre_combine_data, ordered_accumulate) == (
            refs.combine, refs.dispatch, refs.generate_pre_combine_data, refs.ordered_accumulate)
        assert deep_ep.utils.gate.get_unbalanced_scores is get_unbalanced_scores
        assert "release_handle" in inspect.signature(EventOverlap.current_stream_wait).parameters
        parsed = version.Version(deep_ep.__version__)
        assert parsed.release == (2, 1, 0)  # DeepEP 2.x's API level: V1's Buffer and 2.x's ElasticBuffer
        assert parsed.local == f"epcomm.{ep_comm.__version__}"
    finally:
        shim.uninstall()


def test_install_refuses_to_mix_with_another_deep_ep():
    import sys
    import types

    from ep_comm.integrations import deep_ep as shim

    other = types.ModuleType("deep_ep")
    sys.modules["deep_ep"] = other
    try:
        with pytest.raises(ValueError, match="replace_existing"):
            shim.install()
        module = shim.install(replace_existing=True)
        assert module is not other and shim.is_provided(module)
    finally:
        shim.uninstall()
        sys.modules.pop("deep_ep", None)
