"""The keywords vLLM's and SGLang's DeepEP paths pass beyond DeepEP V1: SGLang's single-batch
overlap arguments on ``low_latency_combine`` and the NVFP4 ones on ``low_latency_dispatch``."""
from __future__ import annotations

import threading
import time

import torch
from support.rank_cases import make_routing, make_x

import ep_comm

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
    for name, kwargs in (("use_nvfp4", dict(use_nvfp4=True, x_global_scale=torch.ones(1))),
                         ("x_global_scale", dict(x_global_scale=torch.ones(1)))):
        try:
            buf.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS, use_fp8=False, **kwargs)
        except ValueError as error:
            errors[name] = str(error)
    recv = buf.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS, use_fp8=False, use_nvfp4=False)[1]
    return errors, recv.sum().item()


def test_nvfp4_keywords_refused_clearly(ranks):
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
