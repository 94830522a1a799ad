"""Low-latency dispatch/combine on 2 and 4 gloo ranks against the reference."""
from __future__ import annotations

import pytest
import torch
from support.rank_cases import make_routing, make_x

import ep_comm
from ep_comm import reference
from ep_comm.codecs import fp8
from ep_comm.placement import ExpertPlacement

MAX_TOKENS = 16


def _ll_case(rank, world, group, experts, topk, hidden, tokens, use_fp8, round_scale, use_ue8m0, hook):
    n = tokens[rank]
    idx, w = make_routing(rank, 11, n, experts, topk, 0.15)
    x = make_x(rank, 11, n, hidden, torch.bfloat16)
    buf = ep_comm.Buffer(group, low_latency_mode=True)
    stats_acc = torch.zeros(experts // world, dtype=torch.int32)
    recv_x, recv_count, handle, event, recv_hook = buf.low_latency_dispatch(
        x, idx, MAX_TOKENS, experts, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
        return_recv_hook=hook, cumulative_local_expert_recv_stats=stats_acc)
    if hook:
        assert recv_hook is not None
        recv_hook()
        recv_hook()  # idempotent
    else:
        assert recv_hook is None
    if use_fp8:
        q, scales = recv_x
        expert_in = fp8.dequantize(q, scales)
    else:
        expert_in = recv_x
    y = (expert_in.float() * torch.arange(1, expert_in.shape[0] + 1).view(-1, 1, 1)).to(torch.bfloat16)
    combined, _, combine_hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)
    if hook:
        combine_hook()
    return dict(x=x, idx=idx, w=w, recv_x=recv_x, recv_count=recv_count, y=y, combined=combined,
                stats_acc=stats_acc, handle=tuple(handle), wire=buf.last_stats,
                scales_stride=recv_x[1].stride() if use_fp8 else None)


@pytest.mark.parametrize("world,experts,topk,hidden,tokens,hook", [
    (2, 4, 2, 128, (5, 16), False),
    (2, 8, 6, 256, (0, 9), True),
    (4, 16, 8, 512, (16, 3, 0, 11), False),
    (4, 32, 1, 7168, (4, 4, 4, 4), True),
])
def test_low_latency_bf16_matches_reference(ranks, world, experts, topk, hidden, tokens, hook):
    results = ranks(world, _ll_case, experts, topk, hidden, tokens, False, False, False, hook)
    placement = ExpertPlacement.contiguous(experts, world)
    ref = reference.low_latency_dispatch([r["x"] for r in results], [r["idx"] for r in results],
                                         MAX_TOKENS, placement)
    for rank, (got, want) in enumerate(zip(results, ref)):
        assert got["recv_x"].shape == (experts // world, world * MAX_TOKENS, hidden)
        for j, count in enumerate(want.count):  # rows past recv_count hold no data (DeepEP's contract)
            assert torch.equal(got["recv_x"][j, :count], want.x[j, :count]), f"rank {rank} expert {j}"
        assert got["recv_count"].dtype == torch.int32
        assert got["recv_count"].tolist() == want.count
        assert torch.equal(got["stats_acc"], got["recv_count"])
        # DeepEP's handle: (recv_src_info, layout_range, T, hidden, E)
        recv_src_info, layout_range, *sizes = got["handle"]
        assert sizes == [MAX_TOKENS, hidden, experts]
        assert recv_src_info.dtype == torch.int32 and recv_src_info.shape == (experts // world, world * MAX_TOKENS)
        assert layout_range.dtype == torch.int64 and layout_range.shape == (experts // world, world)
        for j, slots in enumerate(want.slots):
            # each filled slot holds its token's index on the source rank
            assert recv_src_info[j, :len(slots)].tolist() == [token for _, token in slots]
            # layout_range: per source rank, first slot << 32 | count of that rank's tokens
            for src in range(world):
                positions = [i for i, (s, _) in enumerate(slots) if s == src]
                packed = int(layout_range[j, src])
                first, count = packed >> 32, packed & 0xFFFFFFFF
                assert count == len(positions)
                if positions:
                    assert positions == list(range(first, first + count))
    combined_ref = reference.low_latency_combine([r["y"] for r in results], ref, [r["idx"] for r in results],
                                                 [r["w"] for r in results], placement)
    for rank, got in enumerate(results):
        assert torch.equal(got["combined"], combined_ref[rank]), f"rank {rank}"


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_low_latency_fp8(ranks, round_scale, use_ue8m0):
    experts, hidden, tokens = 8, 1024, (16, 12)
    results = ranks(2, _ll_case, experts, 4, hidden, tokens, True, round_scale, use_ue8m0, False)
    placement = ExpertPlacement.contiguous(experts, 2)
    ref = reference.low_latency_dispatch([r["x"] for r in results], [r["idx"] for r in results],
                                         MAX_TOKENS, placement)
    for got, want in zip(results, ref):
        q, scales = got["recv_x"]
        assert q.dtype == torch.float8_e4m3fn and q.shape == want.x.shape
        if use_ue8m0:
            assert scales.dtype == torch.int32 and scales.shape == (*want.x.shape[:2], hidden // 512)
        else:
            assert scales.dtype == torch.float32 and scales.shape == (*want.x.shape[:2], hidden // 128)
        # DeepEP's layout: scales column-major in their last two dimensions (TMA loads)
        slots, groups = scales.shape[1], scales.shape[2]
        assert got["scales_stride"] == (groups * slots, 1, slots)
        decoded = fp8.dequantize(q, scales)
        for j, count in enumerate(want.count):
            diff = fp8.calc_diff(decoded[j, :count], want.x[j, :count])
            assert diff < 9e-4, f"calc_diff {diff}"
            # the values are the sender's own cast of each token, whatever the strides
            for slot, (src, token) in enumerate(want.slots[j]):
                want_q, want_s = fp8.quantize(results[src]["x"][token:token + 1], round_scale=round_scale,
                                              use_ue8m0=use_ue8m0)
                assert torch.equal(scales[j, slot], want_s[0]) and torch.equal(q[j, slot].view(torch.uint8),
                                                                               want_q[0].view(torch.uint8))
            if round_scale:
                s = fp8.unpack_ue8m0(scales[j, :count]) if use_ue8m0 else scales[j, :count]
                mantissa, _ = torch.frexp(s)
                assert bool((mantissa == 0.5).all()), "scales must be powers of two"
        assert got["wire"].op == "low_latency_combine"


def test_fp8_codec_matches_deep_ep_definition():
    x = torch.randn(64, 7168).to(torch.bfloat16)
    q, s = fp8.quantize(x)
    amax = x.float().view(64, -1, 128).abs().amax(-1).clamp(min=1e-4)
    assert torch.equal(s, amax / 448.0)
    assert fp8.calc_diff(fp8.dequantize(q, s), x) < 9e-4
    q2, s2 = fp8.quantize(x, round_scale=True, use_ue8m0=True)
    assert torch.equal(fp8.unpack_ue8m0(s2), torch.exp2(torch.ceil(torch.log2(amax / 448.0))))


def _two_calls(rank, world, group):
    buf = ep_comm.Buffer(group)
    outs = []
    for seed in (1, 2):
        idx, _ = make_routing(rank, seed, 6, 4, 2, 0.0)
        x = make_x(rank, seed, 6, 128, torch.bfloat16)
        recv_x, count, _, _, _ = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
        outs.append((x, idx, recv_x, count))
    first_area, second_area = outs[0][2].data_ptr(), outs[1][2].data_ptr()
    return [(x, idx, recv_x.clone(), count) for x, idx, recv_x, count in outs], first_area != second_area


def test_receive_tensors_are_double_buffered(ranks):
    results = ranks(2, _two_calls)
    placement = ExpertPlacement.contiguous(4, 2)
    for call in range(2):
        ref = reference.low_latency_dispatch([r[0][call][0] for r in results], [r[0][call][1] for r in results],
                                             8, placement)
        for rank, (outs, distinct) in enumerate(results):
            assert distinct  # the second call did not overwrite the first call's tensors
            recv_x, count = outs[call][2], outs[call][3]
            assert count.tolist() == ref[rank].count
            for j, c in enumerate(ref[rank].count):
                assert torch.equal(recv_x[j, :c], ref[rank].x[j, :c])


def _two_in_flight_then_repeat(rank, world, group):
    """Two dispatches sent before either receive hook runs, then their combines with hooks, then
    the same calls again: the message buffers the Buffer reuses are never shared by two calls in
    flight, and later calls reuse them (same results, no new buffers)."""
    buf = ep_comm.Buffer(group)
    batches = []
    for seed in (3, 4):
        idx, w = make_routing(rank, seed, 7, 4, 2, 0.0)
        batches.append((make_x(rank, seed, 7, 256, torch.bfloat16), idx, w))

    def run():
        sent = [buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False, return_recv_hook=True)
                for x, idx, _ in batches]
        for out in sent:
            out[4]()
        combines = [buf.low_latency_combine(out[0] * 3, idx, w, out[2], return_recv_hook=True)
                    for out, (_, idx, w) in zip(sent, batches)]
        for c in combines:
            c[2]()
        return [(out[0].clone(), out[1].clone()) for out in sent], [c[0] for c in combines]

    first = run()
    held = buf._scratch.held_bytes()
    again = run()
    held_again = buf._scratch.held_bytes()
    alone = []
    for x, idx, w in batches:  # one at a time, each receive right away
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, 8, 4, use_fp8=False)
        alone.append((recv_x.clone(), count.clone(), buf.low_latency_combine(recv_x * 3, idx, w, handle)[0]))
    return first, again, alone, held, held_again


def test_message_buffers_reused_but_never_shared_in_flight(ranks):
    for first, again, alone, held, held_again in ranks(2, _two_in_flight_then_repeat):
        assert held > 0 and held_again == held  # the repeated calls took the same buffers
        for run in (first, again):
            for b in range(2):
                recv_x, count = run[0][b]
                want_x, want_count, want_combined = alone[b]
                assert torch.equal(count, want_count)
                for j, c in enumerate(count.tolist()):
                    assert torch.equal(recv_x[j, :c], want_x[j, :c])
                assert torch.equal(run[1][b], want_combined)


class _RowMajorKernel:
    """Stands in for the fused low-latency engine (no GPU here): like the CUDA kernels it writes
    row-major scales through a pointer, so it refuses any other layout."""

    def __init__(self, placement, max_tokens, world):
        self.placement, self.max_tokens, self.world = placement, max_tokens, world
        self.e2r = placement.expert_to_rank.to(torch.int32)

    def start_dispatch(self, xs, topks, use_fp8, round_scale, use_ue8m0, outputs):
        from ep_comm.engines.low_latency import LowLatencyResult

        recv_x, scales = outputs[0]
        assert scales.is_contiguous(), "the kernels write row-major scales"
        local, slots = recv_x.shape[0], recv_x.shape[1]
        q, s = fp8.quantize(xs[0], round_scale=round_scale, use_ue8m0=use_ue8m0)
        recv_x.view(torch.uint8)[0, :q.shape[0]] = q.view(torch.uint8)  # every token to local expert 0
        scales[0, :s.shape[0]] = s
        layout = torch.zeros(local, self.world, 2, dtype=torch.int64)
        layout[0, 0, 1] = q.shape[0]
        count = torch.tensor([q.shape[0]] + [0] * (local - 1), dtype=torch.int32)
        return [LowLatencyResult(recv_x, scales, count, torch.zeros(local, slots, dtype=torch.int32),
                                 torch.zeros(local, slots, dtype=torch.int32), layout)], None

    def finish_dispatch(self, launch, wait=True):
        pass


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, True)])
def test_fused_path_returns_column_major_scales(monkeypatch, round_scale, use_ue8m0):
    from ep_comm.low_latency import ReceiveAreas
    from ep_comm.paths import FusedKernelPath

    world, experts, hidden, tokens = 2, 4, 1024, 5
    placement = ExpertPlacement.contiguous(experts, world)
    path = FusedKernelPath(None, torch.device("cpu"), 1.0, 1)
    path.num_ranks, path.rank = world, 0
    fake = _RowMajorKernel(placement, MAX_TOKENS, world)
    monkeypatch.setattr(path, "_low_latency_engine", lambda *args: fake)
    x = make_x(0, 5, tokens, hidden, torch.bfloat16)
    topk = torch.zeros(tokens, 1, dtype=torch.int64)
    area = ReceiveAreas().next(experts // world, world * MAX_TOKENS, hidden, True, use_ue8m0, x.device)
    call = ep_comm.paths.LowLatencyDispatchCall(x, topk, MAX_TOKENS, placement, True, round_scale, use_ue8m0,
                                                area, False)
    out = path.low_latency_dispatch(call)
    out.receive()
    q, scales = out.recv_x
    slots, groups = scales.shape[1], scales.shape[2]
    assert scales.stride() == (groups * slots, 1, slots) and scales is area[1]
    want_q, want_s = fp8.quantize(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert torch.equal(scales[0, :tokens], want_s)
    assert torch.equal(q[0, :tokens].view(torch.uint8), want_q.view(torch.uint8))
