"""Every collective the library issues on a group that, like NCCL's or RCCL's, takes tensors on
its device only: full Buffer calls on 2 ranks through ``support.strict_device``'s group, which
refuses any tensor not on its device in every collective and point-to-point call (a CPU count
table, vote or mask included), with results bit-exact against ``ep_comm.reference``."""
from __future__ import annotations

import pytest
import torch
from support.mp_pool import spawn_once
from support.rank_cases import make_routing, make_x

EXPERTS, TOPK, HIDDEN, TOKENS, MAX_TOKENS, SEED = 4, 2, 256, 8, 8, 26


def _both_cases(rank, world, _group):
    """Both cases on one throw-away pair of processes (the device and the backend are registered
    in the process for good)."""
    from support import strict_device as sd

    group = sd.new_device_only_group(world)
    return {"group": _group_case(rank, world, group), "buffer": _buffer_case(rank, world, group),
            "gloo": _gloo_case(rank, world, _group)}


@pytest.fixture(scope="module")
def results():
    return spawn_once(2, _both_cases, timeout=200)


def _group_case(rank, world, group):
    """The group itself: each kind of call refuses a CPU tensor and carries device tensors."""
    import torch.distributed as dist
    from support import strict_device as sd
    refused = {}
    calls = {
        "all_to_all_single": lambda t: dist.all_to_all_single(torch.empty_like(t), t, group=group),
        "all_gather": lambda t: dist.all_gather([torch.empty_like(t) for _ in range(world)], t, group=group),
        "all_gather_into_tensor": lambda t: dist.all_gather_into_tensor(
            torch.empty(world * t.numel(), dtype=t.dtype, device=t.device), t, group=group),
        "all_reduce": lambda t: dist.all_reduce(t, group=group),
        "broadcast": lambda t: dist.broadcast(t, src=0, group=group),
        "send_recv": lambda t: (dist.send(t, dst=1, group=group) if rank == 0 else dist.recv(t, src=0, group=group)),
        "isend_irecv": lambda t: (dist.isend(t, dst=1, group=group) if rank == 0
                                  else dist.irecv(t, src=0, group=group)).wait(),
        "batch_isend_irecv": lambda t: [w.wait() for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, t, 1 - rank, group),
             dist.P2POp(dist.irecv, torch.empty_like(t), 1 - rank, group)])],
    }
    with sd.DeviceMode():
        for name, call in calls.items():
            try:
                call(torch.ones(world * 2, dtype=torch.int64))
                refused[name] = False
            except RuntimeError as error:
                refused[name] = "No backend type associated with device type cpu" in str(error)
        moved = torch.arange(world * 2, dtype=torch.int64).to(sd.DEVICE) + 100 * rank
        got = torch.empty_like(moved)
        dist.all_to_all_single(got, moved, group=group)
        total = torch.full((3,), float(rank + 1), device=sd.DEVICE)
        dist.all_reduce(total, group=group)
        objects = [None] * world
        dist.all_gather_object(objects, ("rank", rank), group=group)
        box = [f"from {rank}"]
        dist.broadcast_object_list(box, src=0, group=group)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(rank * 10, gathered, dst=0, group=group)
        dist.barrier(group=group)
        return {"refused": refused, "a2a": got.cpu().tolist(), "sum": total.cpu().tolist(),
                "objects": objects, "box": box, "gathered": gathered, "backend": str(dist.get_backend(group)),
                "device_kind": type(moved).__name__}


def test_the_group_refuses_every_cpu_tensor_and_carries_device_tensors(results):
    for rank, out in enumerate(r["group"] for r in results):
        assert out["refused"] and all(out["refused"].values()), out["refused"]
        assert out["a2a"] == [rank * 2, rank * 2 + 1, 100 + rank * 2, 100 + rank * 2 + 1]
        assert out["sum"] == [3.0] * 3 and out["objects"] == [("rank", 0), ("rank", 1)]
        assert out["gathered"] == ([0, 10] if rank == 0 else None)
        assert out["box"] == ["from 0"] and out["backend"] == "device_only" and out["device_kind"] == "DeviceTensor"


def _inputs(world):
    from ep_comm.placement import ExpertPlacement

    routing = [make_routing(r, SEED, TOKENS, EXPERTS, TOPK) for r in range(world)]
    xs = [make_x(r, SEED, TOKENS, HIDDEN, torch.bfloat16) for r in range(world)]
    xs2 = [make_x(r, SEED + 1, TOKENS, HIDDEN, torch.bfloat16) for r in range(world)]
    return ([i for i, _ in routing], [w for _, w in routing], xs, xs2, ExpertPlacement.contiguous(EXPERTS, world))


def _buffer_case(rank, world, group):
    """Every Buffer call through the device-only group; each result checked here against the
    reference (bit-exact), so a rank reports only what failed."""
    from support import strict_device as sd

    import ep_comm
    from ep_comm import reference
    from ep_comm.codecs import fp8

    idxs, weights, xs, xs2, placement = _inputs(world)
    want = reference.dispatch_to(rank, xs, idxs, weights, placement)
    failures = []

    def check(name, got, expected):
        got = sd.cpu_values(got)
        if not (isinstance(got, torch.Tensor) and got.device.type == "cpu" and got.dtype == expected.dtype
                and torch.equal(got, expected)):
            failures.append(name)

    before = len(group.refused)  # the group case's own refusals
    with sd.DeviceMode():
        def dev(t):
            return t.to(sd.DEVICE)

        buf = ep_comm.Buffer(group, backend="auto", timeout_s=60)  # the transport agreement runs here
        facts = {"device": str(buf.device), "transport": buf.transport.name,
                 "backend": getattr(buf.transport, "backend_name", "")}
        x, idx, w = dev(xs[rank]), dev(idxs[rank]), dev(weights[rank])
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, EXPERTS)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w)
        facts["recv_device"] = str(recv_x.device)
        check("dispatch/x", recv_x, want.x)
        check("dispatch/topk_idx", recv_idx, want.topk_idx)
        check("dispatch/topk_weights", recv_w, want.topk_weights)
        if list(counts) != want.counts_per_expert:
            failures.append("dispatch/counts")
        y = recv_x * 2
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
        want_y = [reference.dispatch_to(r, xs, idxs, weights, placement).x * 2 for r in range(world)]
        receives = reference.dispatch(xs, idxs, weights, placement)
        check("combine/x", combined, reference.combine(want_y, receives, [TOKENS] * world)[rank])
        check("combine/weights", combined_w,
              reference.combine([r.topk_weights for r in receives], receives, [TOKENS] * world)[rank])
        cached = buf.dispatch(dev(xs2[rank]), handle=handle)[0]
        check("cached_dispatch", cached, reference.dispatch_to(rank, xs2, idxs, weights, placement).x)
        q, scales = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                 codec="fp8")[0]
        want_q, want_s = fp8.quantize(want.x)
        check("fp8/values", q.view(torch.uint8), want_q.view(torch.uint8))
        check("fp8/scales", scales, want_s)
        lossless_x, _, _, _, lossless_handle, _ = buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert, codec="lossless")
        check("lossless/dispatch", lossless_x, want.x)
        check("lossless/combine", buf.combine(lossless_x * 2, lossless_handle, codec="lossless")[0],
              reference.combine(want_y, receives, [TOKENS] * world)[rank])
        check("lossless/cached", buf.dispatch(dev(xs2[rank]), handle=lossless_handle, codec="lossless")[0],
              reference.dispatch_to(rank, xs2, idxs, weights, placement).x)

        auto_x = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert, codec="auto")[0]
        check("auto_codec/dispatch", auto_x, want.x)  # the ranks' vote is an exchange too
        # node-aware (two hops over rail and node subgroups of the same backend)
        nodes = ep_comm.Buffer(group, backend="torch", timeout_s=60, ranks_per_node=1)
        hop_x, _, hop_w, _, hop_handle, _ = nodes.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=w)
        check("node_aware/dispatch", hop_x, want.x)
        check("node_aware/combine", nodes.combine(hop_x * 2, hop_handle)[0],
              reference.combine(want_y, receives, [TOKENS] * world)[rank])
        _low_latency(buf, rank, world, placement, check, failures, dev)
        # masking: each rank runs alone, then both re-form the group and run together again
        buf.mask_ranks([1 - rank])
        alone, alone_count, _, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS, use_fp8=False)
        # the reference with the other rank sending nothing and this rank's entries for it dropped
        other = 1 - rank
        kept = [torch.where(reference.owned_by(i, other, placement), -1, i) for i in idxs]
        kept[other], alone_xs = kept[other][:0], [t[:0] if r == other else t for r, t in enumerate(xs)]
        mine = reference.low_latency_dispatch_to(rank, alone_xs, kept, MAX_TOKENS, placement)
        if sd.cpu_values(alone_count).tolist() != mine.count:
            failures.append("masked/count")
        for j, n in enumerate(mine.count):
            check(f"masked/x[{j}]", sd.cpu_values(alone)[j, :n], mine.x[j, :n])
        buf.unmask_ranks([1 - rank])
        buf.reset()
        again = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)[0]
        check("after_reset/dispatch", again, want.x)
        refused = list(group.refused[before:])
    return {"failures": failures, "refused": refused, **facts}


def _low_latency(buf, rank, world, placement, check, failures, dev):
    from support import strict_device as sd

    from ep_comm import reference
    from ep_comm.codecs import fp8

    idxs, weights, xs, _, _ = _inputs(world)
    x, idx, w = dev(xs[rank]), dev(idxs[rank]), dev(weights[rank])
    receives = reference.low_latency_dispatch(xs, idxs, MAX_TOKENS, placement)
    want = receives[rank]
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS, use_fp8=False)
    count = sd.cpu_values(recv_count)
    if count.tolist() != want.count:
        failures.append("low_latency/count")
    got = sd.cpu_values(recv_x)
    for j, n in enumerate(want.count):
        check(f"low_latency/x[{j}]", got[j, :n], want.x[j, :n])
    outputs = [r.x * 3 for r in receives]
    combined = buf.low_latency_combine(recv_x * 3, idx, w, handle)[0]
    want_combined = reference.low_latency_combine(outputs, receives, idxs, weights, placement)[rank]
    check("low_latency/combine", combined, want_combined)
    (q, scales), _, _, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS, use_fp8=True)
    q, scales = sd.cpu_values(q), sd.cpu_values(scales)
    for j, n in enumerate(want.count):
        want_q, want_s = fp8.quantize(want.x[j, :n])
        check(f"low_latency_fp8/q[{j}]", q[j, :n].view(torch.uint8), want_q.view(torch.uint8))
        check(f"low_latency_fp8/scales[{j}]", scales[j, :n].contiguous(), want_s)


def test_every_buffer_call_keeps_its_collectives_on_the_groups_device(results):
    for out in (r["buffer"] for r in results):
        assert out["device"] == "privateuseone:0" and out["transport"] == "torch", out
        assert out["backend"] == "device_only" and out["recv_device"] == "privateuseone:0", out
        assert out["refused"] == [], out["refused"]
        assert out["failures"] == [], out["failures"]


def _gloo_case(rank, world, group):
    """Device tensors on a gloo group (one rank of a mixed-vendor job): every payload is staged
    through host memory in chunks (chunks of 64 bytes here, so every message is cut)."""
    from support import strict_device as sd

    import ep_comm
    from ep_comm import reference

    idxs, weights, xs, _, placement = _inputs(world)
    want = reference.dispatch_to(rank, xs, idxs, weights, placement)
    receives = reference.dispatch(xs, idxs, weights, placement)
    failures = []
    with sd.DeviceMode():
        buf = ep_comm.Buffer(group, backend="torch", timeout_s=60)
        buf.transport.staging_chunk_bytes = 64
        x, idx, w = (t.to(sd.DEVICE) for t in (xs[rank], idxs[rank], weights[rank]))
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                       num_tokens_per_expert=buf.get_dispatch_layout(idx, EXPERTS)[2])
        combined = buf.combine(recv_x * 2, handle)[0]
        ll_receives = reference.low_latency_dispatch(xs, idxs, MAX_TOKENS, placement)
        ll_x, ll_count, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS, use_fp8=False)
        ll_combined = buf.low_latency_combine(ll_x * 3, idx, w, ll_handle)[0]
        devices = {str(t.device) for t in (recv_x, recv_w, combined, ll_x, ll_combined)}
        got = sd.cpu_values({"x": recv_x, "combined": combined, "ll_x": ll_x, "ll_count": ll_count,
                             "ll_combined": ll_combined})
    want_combined = reference.combine([r.x * 2 for r in receives], receives, [TOKENS] * world)[rank]
    want_ll = reference.low_latency_combine([r.x * 3 for r in ll_receives], ll_receives, idxs, weights, placement)
    if not torch.equal(got["x"], want.x):
        failures.append("dispatch")
    if not torch.equal(got["combined"], want_combined):
        failures.append("combine")
    if got["ll_count"].tolist() != ll_receives[rank].count:
        failures.append("low_latency/count")
    for j, n in enumerate(ll_receives[rank].count):
        if not torch.equal(got["ll_x"][j, :n], ll_receives[rank].x[j, :n]):
            failures.append(f"low_latency/x[{j}]")
    if not torch.equal(got["ll_combined"], want_ll[rank]):
        failures.append("low_latency/combine")
    return {"failures": failures, "devices": sorted(devices), "device": str(buf.device)}


def test_device_tensors_on_a_gloo_group_are_staged_through_host_memory(results):
    for out in (r["gloo"] for r in results):
        assert out["device"] == "cpu" and out["devices"] == ["privateuseone:0"], out
        assert out["failures"] == [], out["failures"]
