"""What vLLM's and SGLang's DeepEP paths pass beyond DeepEP V1 (SGLang's single-batch overlap
arguments on ``low_latency_combine``, the NVFP4 ones on ``low_latency_dispatch``, configs following
``set_num_sms``, handles across rebuilt Buffers), and the engines' call sequences on ep_comm's
``deep_ep`` against the reference (no engine needed; tools/serving_engine_tests.sh runs the engines'
own modules)."""
from __future__ import annotations

import threading
import time

import torch
from support.rank_cases import make_routing, make_x

import ep_comm
from ep_comm import reference
from ep_comm.placement import ExpertPlacement

EXPERTS, HIDDEN, TOKENS, MAX_TOKENS, BLOCK_M = 8, 128, 9, 16, 8


def _dispatch(buf, rank, seed=1):
    idx, w = make_routing(rank, seed, TOKENS, EXPERTS, 3, 0.1)
    x = make_x(rank, seed, TOKENS, HIDDEN, torch.bfloat16)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS, use_fp8=False)
    return idx, w, recv_x * 3, count, handle


def _overlap(rank, world, group):
    buf = ep_comm.Buffer(group, low_latency_mode=True, timeout_s=5.0)
    idx, w, y, count, handle = _dispatch(buf, rank)
    plain = buf.low_latency_combine(y, idx, w, handle)[0]
    local, slots = EXPERTS // world, world * MAX_TOKENS
    blocks = -(-slots // BLOCK_M)
    out = {"plain": plain}
    # Hopper spelling, every signal already set: the same result
    signal = torch.full((local, blocks), 2, dtype=torch.int32)
    out["hopper"] = buf.low_latency_combine(y, idx, w, handle, overlap=True, packed_recv_count=count,
                                            comp_signal=signal, block_m=BLOCK_M, threshold=2, num_sms=3)[0]
    # the GEMM signals its last needed block late: the combine waits for it
    late = torch.full((local, blocks), 2, dtype=torch.int32)
    busiest = int(count.argmax())
    last_block = (int(count[busiest]) - 1) // BLOCK_M
    late[busiest, last_block] = 0
    unneeded = torch.zeros(local, blocks, dtype=torch.bool)
    unneeded[:, :] = (torch.arange(blocks) * BLOCK_M >= count.unsqueeze(1))
    late[unneeded] = -5  # blocks past the counts are never waited for
    y_late = torch.zeros_like(y)

    def gemm():
        time.sleep(0.3)
        y_late.copy_(y)
        late[busiest, last_block] = 2

    worker = threading.Thread(target=gemm)
    started = time.monotonic()
    worker.start()
    out["late"] = buf.low_latency_combine(y_late, idx, w, handle, overlap=True, comp_signal=late, block_m=BLOCK_M,
                                          threshold=2)[0]
    out["waited"] = time.monotonic() - started
    worker.join()
    # Blackwell spelling: one signal per local expert
    src = torch.where(count > 0, 4, -1).to(torch.int32)
    out["blackwell"] = buf.low_latency_combine(y, idx, w, handle, overlap=True, src_signals=src,
                                               src_signal_expect_value=4)[0]
    # overlap=False: the other arguments are ignored
    out["off"] = buf.low_latency_combine(y, idx, w, handle, overlap=False, comp_signal=torch.zeros(1),
                                         block_m=0, threshold=99, src_signals=torch.zeros(1))[0]
    return out


def test_single_batch_overlap_arguments_give_the_plain_result(ranks):
    for out in ranks(2, _overlap):
        for key in ("hopper", "late", "blackwell", "off"):
            assert torch.equal(out[key], out["plain"]), key
        assert out["waited"] >= 0.25  # it waited for the late signal instead of reading x early


def _bad_signals(rank, world, group):
    buf = ep_comm.Buffer(group, low_latency_mode=True, timeout_s=0.5)
    idx, w, y, count, handle = _dispatch(buf, rank)
    local, blocks = EXPERTS // world, world * MAX_TOKENS // BLOCK_M
    errors = {}
    for name, kwargs in (
            ("never", dict(comp_signal=torch.zeros(local, blocks, dtype=torch.int32), block_m=BLOCK_M, threshold=1)),
            ("shape", dict(comp_signal=torch.zeros(3, dtype=torch.int32), block_m=BLOCK_M)),
            ("block_m", dict(comp_signal=torch.zeros(local, blocks, dtype=torch.int32), block_m=0)),
            ("src", dict(src_signals=torch.zeros(local + 1, dtype=torch.int32))),
            ("count", dict(packed_recv_count=torch.zeros(local + 1, dtype=torch.int32),
                           src_signals=torch.zeros(local, dtype=torch.int32)))):
        try:
            buf.low_latency_combine(y, idx, w, handle, overlap=True, **kwargs)
        except ValueError as error:
            errors[name] = str(error)
    # the Buffer is still in step afterwards
    ok = torch.equal(buf.low_latency_combine(y, idx, w, handle)[0], buf.low_latency_combine(y, idx, w, handle)[0])
    return errors, ok


def test_overlap_signals_checked_and_bounded(ranks):
    for errors, ok in ranks(2, _bad_signals):
        assert set(errors) == {"never", "shape", "block_m", "src", "count"} and ok
        assert "did not reach 1" in errors["never"]


def _nvfp4(rank, world, group):
    buf = ep_comm.Buffer(group, low_latency_mode=True)
    idx, _ = make_routing(rank, 1, TOKENS, EXPERTS, 3, 0.1)
    x = make_x(rank, 1, TOKENS, HIDDEN, torch.bfloat16)
    errors = {}
    for name, kwargs in (("use_nvfp4", dict(use_nvfp4=True)),  # NVFP4 needs its global scale
                         ("x_global_scale", dict(x_global_scale=torch.ones(1)))):
        try:
            buf.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS, use_fp8=False, **kwargs)
        except ValueError as error:
            errors[name] = str(error)
    recv = buf.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS, use_fp8=False, use_nvfp4=False)[1]
    return errors, recv.sum().item()


def test_nvfp4_keywords_checked(ranks):  # the NVFP4 dispatch itself: tests/test_nvfp4.py
    results = ranks(2, _nvfp4)
    for errors, _ in results:
        assert set(errors) == {"use_nvfp4", "x_global_scale"}
        assert all(name in text for name, text in errors.items())
    assert sum(total for _, total in results) == sum(
        int((make_routing(r, 1, TOKENS, EXPERTS, 3, 0.1)[0] >= 0).sum()) for r in range(2))


def test_configs_follow_set_num_sms():
    before = ep_comm.Buffer.num_sms
    try:
        ep_comm.Buffer.set_num_sms(24)
        for ranks_ in (2, 16):
            assert ep_comm.Buffer.get_dispatch_config(ranks_).num_sms == 24
            assert ep_comm.Buffer.get_combine_config(ranks_).num_sms == 24
        assert ep_comm.Buffer.get_dispatch_config(16).num_max_nvl_chunked_send_tokens == 8  # the rest unchanged
    finally:
        ep_comm.Buffer.set_num_sms(before)
    assert ep_comm.Buffer.get_dispatch_config(2).num_sms == before


def _rebuilt_buffer(rank, world, group):
    idx, w = make_routing(rank, 8, 6, 8, 2)
    x = make_x(rank, 8, 6, 128, torch.bfloat16)
    first = ep_comm.Buffer(group)
    recv_x, _, _, _, handle, _ = first.dispatch(x, topk_idx=idx, topk_weights=w,
                                                num_tokens_per_expert=torch.zeros(8, dtype=torch.int32))
    expected, _, _ = first.combine(recv_x, handle)
    ll_x, _, ll_handle, _, _ = first.low_latency_dispatch(x, idx, 8, 8, use_fp8=False)
    ll_expected, _, _ = first.low_latency_combine(ll_x, idx, w, ll_handle)
    rebuilt = ep_comm.Buffer(group)  # as Megatron rebuilds its Buffer for the same group
    combined, _, _ = rebuilt.combine(recv_x, handle)
    cached, *_ = rebuilt.dispatch(x, handle)
    ll_combined, _, _ = rebuilt.low_latency_combine(ll_x, idx, w, ll_handle)
    other = ep_comm.Buffer(group, expert_placement=torch.tensor([1, 0] * 4))
    try:
        other.combine(recv_x, handle)
        refused = ""
    except ValueError as error:
        refused = str(error)
    return dict(same=torch.equal(combined, expected), cached=torch.equal(cached, recv_x),
                ll_same=torch.equal(ll_combined, ll_expected), refused=refused)


def test_a_handle_works_with_a_rebuilt_buffer_of_the_same_group(ranks):
    for got in ranks(2, _rebuilt_buffer):
        assert got["same"] and got["cached"] and got["ll_same"]
        assert "another group, placement or node size" in got["refused"]


# The call sequences below are the engines' own, as tools/serving_engine_tests.sh runs them from
# their wheels: vLLM 0.33's DeepEPLLAll2AllManager + deepep_ll.py, SGLang 0.5's DeepEPDispatcher in
# its auto mode (normal prefill, then low-latency decode on the same Buffer).
ENGINE_EXPERTS, ENGINE_HIDDEN, ENGINE_TOKENS, ENGINE_MAX = 8, 256, (7, 11), 16


def _engine_inputs(rank, seed):
    idx, w = make_routing(rank, seed, ENGINE_TOKENS[rank], ENGINE_EXPERTS, 3, 0.15)
    return make_x(rank, seed, ENGINE_TOKENS[rank], ENGINE_HIDDEN, torch.bfloat16), idx, w


def _vllm_low_latency(rank, world, group):
    import ep_comm.integrations.deep_ep as deep_ep
    local = ENGINE_EXPERTS // world
    # DeepEPLLAll2AllManager._make_all2all_kwargs (enable_shrink: elastic EP's fault tolerance on)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=ENGINE_MAX,
                                                         hidden=ENGINE_HIDDEN, num_ranks=world,
                                                         num_experts=ENGINE_EXPERTS)
    buf = deep_ep.Buffer(group=group, num_nvl_bytes=1 << 20, num_rdma_bytes=rdma, low_latency_mode=True,
                         num_qps_per_rank=local, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                         explicitly_destroy=True, enable_shrink=True)
    x, idx, w = _engine_inputs(rank, 21)
    # deepep_ll.py prepare_async: hook returned, called by the modular kernel before the receiver
    recv_x, count, handle, _, hook = buf.low_latency_dispatch(
        x, idx, ENGINE_MAX, ENGINE_EXPERTS, use_fp8=False, round_scale=False, use_ue8m0=False,
        async_finish=False, return_recv_hook=True)
    hook()
    recv_x, count = recv_x.clone(), count.clone()
    y = (recv_x.float() * torch.arange(1, local + 1).view(-1, 1, 1)).to(torch.bfloat16)
    # deepep_ll.py _finalize: into vLLM's output tensor, hook only when async
    output = torch.full_like(x, float("nan"))
    combined, _, combine_hook = buf.low_latency_combine(y, idx, w, handle, async_finish=False, zero_copy=False,
                                                        return_recv_hook=True, out=output)
    combine_hook()
    same_memory = combined.data_ptr() == output.data_ptr()
    # DeepEPLLAll2AllManager.query_fault / clean_buffers
    mask = torch.zeros(world, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(mask)
    healthy = mask.tolist()
    buf.get_local_buffer_tensor(dtype=torch.int8, use_rdma_buffer=True).zero_()
    buf.low_latency_clean_mask_buffer()
    buf.destroy()
    return dict(x=x, idx=idx, w=w, recv_x=recv_x, count=count.tolist(), y=y, output=output,
                same_memory=same_memory, healthy=healthy)


def test_vllm_low_latency_call_pattern(ranks):
    results = ranks(2, _vllm_low_latency)
    placement = ExpertPlacement.contiguous(ENGINE_EXPERTS, 2)
    ref = reference.low_latency_dispatch([r["x"] for r in results], [r["idx"] for r in results], ENGINE_MAX,
                                         placement)
    combined = reference.low_latency_combine([r["y"] for r in results], ref, [r["idx"] for r in results],
                                             [r["w"] for r in results], placement)
    for rank, (got, want) in enumerate(zip(results, ref)):
        assert got["count"] == want.count
        for j, n in enumerate(want.count):
            assert torch.equal(got["recv_x"][j, :n], want.x[j, :n]), f"rank {rank} expert {j}"
        assert got["same_memory"], "low_latency_combine(out=...) must return vLLM's output tensor"
        assert torch.equal(got["output"], combined[rank]), f"rank {rank}"
        assert got["healthy"] == [0, 0]


def _sglang_auto(rank, world, group):
    import ep_comm.integrations.deep_ep as deep_ep
    Buffer, Config = deep_ep.Buffer, deep_ep.Config
    hidden_bytes = ENGINE_HIDDEN * 2
    # DeepEPBuffer.get_deepep_buffer, auto mode: sized for both, positional byte counts
    nvl = rdma = 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        assert isinstance(config, Config)
        nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), nvl)
        rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), rdma)
    rdma = max(Buffer.get_low_latency_rdma_size_hint(128, ENGINE_HIDDEN, group.size(), ENGINE_EXPERTS), rdma)
    buf = Buffer(group, nvl, rdma, low_latency_mode=True,
                 num_qps_per_rank=max(Buffer.num_sms, ENGINE_EXPERTS // group.size()), allow_mnnvl=False)
    out = dict(sizes=(buf.group_size, buf.low_latency_mode), rounds=[])
    for step in range(2):
        x, idx, w = _engine_inputs(rank, 30 + step)
        # _DeepEPDispatcherImplNormal, async_finish=True, DeepGEMM's expert_alignment
        previous = Buffer.capture()
        per_rank, per_rdma, per_expert, in_rank, previous = buf.get_dispatch_layout(
            idx, ENGINE_EXPERTS, previous_event=previous, async_finish=True, allocate_on_comm_stream=True)
        recv_x, recv_idx, recv_w, per_expert_list, handle, event = buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, previous_event=previous,
            async_finish=True, allocate_on_comm_stream=True, expert_alignment=128, config=None)
        event.current_stream_wait()
        y = (recv_x.float() * 2).to(torch.bfloat16)
        combined, _, event = buf.combine(y, handle, async_finish=True, previous_event=Buffer.capture(),
                                         allocate_on_comm_stream=True, config=None)
        event.current_stream_wait()
        normal = dict(x=x, idx=idx, w=w, recv_x=recv_x, recv_idx=recv_idx, per_expert=per_expert_list, y=y,
                      combined=combined)
        # switching to decode: DeepEPBuffer.clean_buffer, then _DeepEPDispatcherImplLowLatency (async_finish)
        buf.clean_low_latency_buffer(128, ENGINE_HIDDEN, ENGINE_EXPERTS)
        ll_x, count, ll_handle, event, hook = buf.low_latency_dispatch(
            x, idx, 128, ENGINE_EXPERTS, use_fp8=False, async_finish=True, return_recv_hook=False)
        event.current_stream_wait()
        ll_y = (ll_x.float() * 3).to(torch.bfloat16)
        ll_combined, event, hook = buf.low_latency_combine(x=ll_y, topk_idx=idx, topk_weights=w, handle=ll_handle,
                                                           async_finish=True, return_recv_hook=False)
        event.current_stream_wait()
        out["rounds"].append(dict(normal=normal, hook=hook, ll_count=count.tolist(),
                                  ll_combined=ll_combined))
    return out


def test_sglang_auto_mode_call_pattern(ranks):
    results = ranks(2, _sglang_auto)
    placement = ExpertPlacement.contiguous(ENGINE_EXPERTS, 2)
    for got in results:
        assert got["sizes"] == (2, True)
    for step in range(2):
        rounds = [r["rounds"][step] for r in results]
        normal = [r["normal"] for r in rounds]
        ref = reference.dispatch([n["x"] for n in normal], [n["idx"] for n in normal], [n["w"] for n in normal],
                                 placement)
        combined = reference.combine([n["y"] for n in normal], ref, list(ENGINE_TOKENS))
        ll_ref = reference.low_latency_dispatch([n["x"] for n in normal], [n["idx"] for n in normal], 128, placement)
        ll_combined = reference.low_latency_combine(
            [(ll.x.float() * 3).to(torch.bfloat16) for ll in ll_ref], ll_ref, [n["idx"] for n in normal],
            [n["w"] for n in normal], placement)
        for rank, (got, want) in enumerate(zip(rounds, ref)):
            n = got["normal"]
            assert torch.equal(n["recv_x"], want.x) and torch.equal(n["recv_idx"], want.topk_idx)
            # DeepEP pads each expert's count to expert_alignment
            assert n["per_expert"] == [-(-c // 128) * 128 for c in want.counts_per_expert]
            assert torch.equal(n["combined"], combined[rank]), f"round {step} rank {rank}"
            assert got["hook"] is None and got["ll_count"] == ll_ref[rank].count
            assert torch.equal(got["ll_combined"], ll_combined[rank]), f"round {step} rank {rank}"
