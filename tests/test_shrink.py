"""DeepEP's shrink mode (``enable_shrink=True`` and the low-latency mask-buffer calls) on top of
``Buffer.mask_ranks`` / ``unmask_ranks``, and ``get_local_buffer_tensor``."""
from __future__ import annotations

import os

import pytest
import torch
from support.mp_pool import spawn_once
from support.rank_cases import make_routing, make_x

import ep_comm
from ep_comm import reference
from ep_comm.placement import ExpertPlacement

EXPERTS, HIDDEN, TOKENS, MAX_TOKENS = 8, 128, 6, 8


def _round(buf, rank, seed, world):
    idx, w = make_routing(rank, seed, TOKENS, EXPERTS, 3, 0.1)
    x = make_x(rank, seed, TOKENS, HIDDEN, torch.bfloat16)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS, use_fp8=False)
    y = recv_x * 2
    combined, _, _ = buf.low_latency_combine(y, idx, w, handle)
    return dict(x=x, idx=idx, w=w, recv_x=recv_x.clone(), count=count.tolist(), y=y.clone(), combined=combined)


def _query(buf, world):
    status = torch.full((world,), 7, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    return status.tolist()


def _shrink_and_return(rank, world, group):
    buf = ep_comm.Buffer(group, 0, 1 << 16, low_latency_mode=True, enable_shrink=True)
    out = dict(first=_round(buf, rank, 1, world), queries=[])
    gone = world - 1
    if rank != gone:
        out["queries"].append(_query(buf, world))
        buf.low_latency_update_mask_buffer(gone, True)
        out["queries"].append(_query(buf, world))  # recorded at once, applied by the next dispatch
        out["masked_before"] = sorted(buf.masked_ranks)
        out["shrunk"] = _round(buf, rank, 2, world)
        out["masked_after"] = sorted(buf.masked_ranks)
        out["queries"].append(_query(buf, world))
        buf.low_latency_clean_mask_buffer()
        out["queries"].append(_query(buf, world))
    else:
        buf.unmask_ranks([])  # the returning rank joins while the others apply the clean
    out["back"] = _round(buf, rank, 3, world)
    out["masked_end"] = sorted(buf.masked_ranks)
    return out


def _check_round(results, key, live, world):
    placement = ExpertPlacement.contiguous(EXPERTS, world)
    xs, idxs = [], []
    for rank in range(world):
        r = results[rank].get(key)
        if rank in live:
            idx = r["idx"].clone()
            idx[(idx >= 0) & ~torch.isin(placement.expert_to_rank[idx.clamp(min=0)], torch.tensor(live))] = -1
            xs.append(r["x"])
            idxs.append(idx)
        else:
            xs.append(torch.zeros(0, HIDDEN, dtype=torch.bfloat16))
            idxs.append(torch.zeros(0, 3, dtype=torch.int64))
    ref = reference.low_latency_dispatch(xs, idxs, MAX_TOKENS, placement)
    combined = reference.low_latency_combine([results[r][key]["y"] if r in live else
                                              torch.zeros(EXPERTS // world, world * MAX_TOKENS, HIDDEN,
                                                          dtype=torch.bfloat16) for r in range(world)],
                                             ref, idxs, [results[r][key]["w"] if r in live else
                                                         torch.zeros(0, 3) for r in range(world)], placement)
    for rank in live:
        got = results[rank][key]
        assert got["count"] == ref[rank].count, (key, rank)
        for j, c in enumerate(ref[rank].count):
            assert torch.equal(got["recv_x"][j, :c], ref[rank].x[j, :c]), (key, rank, j)
        assert torch.equal(got["combined"], combined[rank]), (key, rank)


@pytest.mark.parametrize("world", [2, 4])
def test_update_query_clean_map_onto_mask_ranks(ranks, world):
    results = ranks(world, _shrink_and_return)
    gone = world - 1
    everyone = list(range(world))
    _check_round(results, "first", everyone, world)
    _check_round(results, "shrunk", everyone[:-1], world)
    _check_round(results, "back", everyone, world)
    one_masked = [0] * gone + [1]
    for rank in everyone[:-1]:
        r = results[rank]
        assert r["queries"] == [[0] * world, one_masked, one_masked, [0] * world]
        assert r["masked_before"] == [] and r["masked_after"] == [gone]
    assert all(r["masked_end"] == [] for r in results)


def _timeout_masks(rank, world, group):
    buf = ep_comm.Buffer(group, low_latency_mode=True, enable_shrink=True, timeout_s=2.0)
    _round(buf, rank, 1, world)
    if rank == 1:
        os._exit(3)
    try:
        _round(buf, rank, 2, world)
        timed_out = False
    except ep_comm.CommTimeoutError:
        timed_out = True
    status = _query(buf, world)
    alone = _round(buf, rank, 3, world)  # applies the mask the timeout recorded
    return dict(timed_out=timed_out, status=status, masked=sorted(buf.masked_ranks),
                dropped=buf.last_stats.dropped_topk_entries, alone=alone)


def test_a_low_latency_timeout_masks_the_peer_in_shrink_mode():
    r = spawn_once(2, _timeout_masks, timeout=90, may_die=frozenset({1}))[0]
    assert r["timed_out"] and r["status"] == [0, 1] and r["masked"] == [1]
    placement = ExpertPlacement.contiguous(EXPERTS, 2)
    idx = r["alone"]["idx"].clone()
    idx[placement.expert_to_rank[idx.clamp(min=0)] == 1] = -1
    ref = reference.low_latency_dispatch([r["alone"]["x"], torch.zeros(0, HIDDEN, dtype=torch.bfloat16)],
                                         [idx, torch.zeros(0, 3, dtype=torch.int64)], MAX_TOKENS, placement)[0]
    assert r["alone"]["count"] == ref.count
    assert r["dropped"] == int(((r["alone"]["idx"] >= 0) & (idx < 0)).sum()) > 0


def _errors(rank, world, group):
    plain = ep_comm.Buffer(group, 64, 0)
    shrink = ep_comm.Buffer(group, 0, 0, enable_shrink=True)
    status = torch.zeros(world, dtype=torch.int32)
    calls = {
        "needs_shrink": lambda: plain.low_latency_update_mask_buffer(1 - rank, True),
        "query_needs_shrink": lambda: plain.low_latency_query_mask_buffer(status),
        "clean_needs_shrink": plain.low_latency_clean_mask_buffer,
        "self": lambda: shrink.low_latency_update_mask_buffer(rank, True),
        "range": lambda: shrink.low_latency_update_mask_buffer(world, True),
        "flag": lambda: shrink.low_latency_update_mask_buffer(0, "yes"),
        "status_dtype": lambda: shrink.low_latency_query_mask_buffer(torch.zeros(world, dtype=torch.int64)),
        "status_shape": lambda: shrink.low_latency_query_mask_buffer(torch.zeros(world + 1, dtype=torch.int32)),
        "no_rdma_bytes": lambda: plain.get_local_buffer_tensor(torch.float32, use_rdma_buffer=True),
        "offset": lambda: plain.get_local_buffer_tensor(torch.float32, offset=2),
        "too_big": lambda: plain.get_local_buffer_tensor(torch.float32, torch.Size([17])),
    }
    errors = {}
    for name, fn in calls.items():
        try:
            fn()
        except ValueError as error:
            errors[name] = str(error)
    # unmasking a rank that is not masked records nothing: no collective at the next dispatch
    shrink.low_latency_update_mask_buffer(1 - rank, False)
    shrink.low_latency_clean_mask_buffer()
    pending = shrink._mask_request
    plain.destroy()
    shrink.destroy()
    return errors, pending


def test_shrink_argument_errors(ranks):
    for errors, pending in ranks(2, _errors):
        assert set(errors) == {"needs_shrink", "query_needs_shrink", "clean_needs_shrink", "self", "range",
                               "flag", "status_dtype", "status_shape", "no_rdma_bytes", "offset", "too_big"}
        assert "enable_shrink" in errors["needs_shrink"] and "mask_status" in errors["status_dtype"]
        assert pending is None


def _local_buffer(rank, world, group):
    buf = ep_comm.Buffer(group, 256, 1024)
    whole = buf.get_local_buffer_tensor(torch.bfloat16, use_rdma_buffer=True)
    part = buf.get_local_buffer_tensor(torch.float32, torch.Size([4, 8]), offset=64, use_rdma_buffer=True)
    part.fill_(float(rank + 1))
    again = buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
    nvl = buf.get_local_buffer_tensor(torch.int32)
    tail = buf.get_local_buffer_tensor(torch.int64, offset=1016, use_rdma_buffer=True)
    return dict(whole=(whole.dtype, whole.numel()), part=(part.shape, part.dtype), nvl=nvl.numel(),
                shared=again.data_ptr() == whole.data_ptr() and part.data_ptr() == whole.data_ptr() + 64,
                seen=again[64:64 + 128].view(torch.float32).tolist(), untouched=int(again[:64].sum()),
                tail=tail.numel(), separate=nvl.data_ptr() != whole.data_ptr())


def test_get_local_buffer_tensor_views_one_buffer_owned_tensor(ranks):
    for rank, r in enumerate(ranks(2, _local_buffer)):
        assert r["whole"] == (torch.bfloat16, 512) and r["nvl"] == 64 and r["tail"] == 1
        assert r["part"] == (torch.Size([4, 8]), torch.float32)
        assert r["shared"] and r["separate"] and r["untouched"] == 0
        assert r["seen"] == [float(rank + 1)] * 32
