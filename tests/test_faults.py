"""Faults and ranks that disagree, on 2 and 4 gloo ranks: every disagreement is a ValueError on
every rank naming the field and each rank's value (never a crash, a hang or wrong data), the group
stays in step for a valid call right after, a rank that rejects its own arguments makes its peers
fail with it (no timeout), a timeout leaves the Buffer refusing calls until ``reset()``, and a
second failure after ``mask_ranks`` names the dead rank's Buffer rank."""
from __future__ import annotations

import os
import time

import pytest
import torch
from support.mp_pool import spawn_once
from support.rank_cases import make_routing, make_x

import ep_comm
from ep_comm import reference
from ep_comm.placement import ExpertPlacement

EXPERTS = 8


def _valid_round(buf, rank, seed=3):
    """A dispatch + combine every rank makes alike; returns what it received and combined."""
    idx, w = make_routing(rank, seed, 7, EXPERTS, 2)
    x = make_x(rank, seed, 7, 64, torch.bfloat16)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                              num_tokens_per_expert=torch.zeros(EXPERTS, dtype=torch.int32))
    combined, _, _ = buf.combine(recv_x, handle)
    return dict(x=x, idx=idx, w=w, recv_x=recv_x, combined=combined)


def _disagree(rank, world, group, case):
    buf = ep_comm.Buffer(group, timeout_s=30)
    idx, w = make_routing(rank, 5, 6, EXPERTS, 2)
    x = make_x(rank, 5, 6, 128, torch.bfloat16)
    counts = torch.zeros(EXPERTS, dtype=torch.int32)
    odd = rank == world - 1
    try:
        if case == "dtype":
            buf.dispatch(x.half() if odd else x, topk_idx=idx, num_tokens_per_expert=counts)
        elif case == "num_experts":
            buf.dispatch(x, topk_idx=idx.clamp(max=3), num_tokens_per_expert=counts[:4] if odd else counts)
        elif case == "topk":
            buf.dispatch(x, topk_idx=idx[:, :1] if odd else idx, num_tokens_per_expert=counts)
        elif case == "combine_hidden":
            recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_tokens_per_expert=counts)
            rows = torch.zeros(recv_x.shape[0], 256 if odd else 128, dtype=torch.bfloat16)
            buf.combine(rows, handle)
        elif case == "ll_hidden":
            buf.low_latency_dispatch(x[:, :64] if odd else x, idx, 8, EXPERTS, use_fp8=False)
        elif case == "ll_capacity":
            buf.low_latency_dispatch(x, idx, 16 if odd else 8, EXPERTS, use_fp8=False)
        elif case == "mode":
            if odd:
                buf.low_latency_dispatch(x, idx, 8, EXPERTS, use_fp8=False)
            else:
                buf.dispatch(x, topk_idx=idx, num_tokens_per_expert=counts)
        elif case == "placement":  # the last rank's Buffer places experts 0 and 1 the other way
            order = torch.arange(EXPERTS) // (EXPERTS // world)
            if odd:
                order[[0, 1]] = torch.tensor([world - 1, 0])
            placed = ep_comm.Buffer(group, timeout_s=30, expert_placement=order)
            placed.dispatch(x, topk_idx=idx, num_tokens_per_expert=counts)
        elif case == "rejected":  # one rank's own topk_idx is out of range
            buf.dispatch(x, topk_idx=idx + (100 if odd else 0), num_tokens_per_expert=counts)
        elif case in ("combine_handles", "cached_handles"):  # the last rank takes another dispatch's handle
            a = buf.dispatch(x, topk_idx=idx, num_tokens_per_expert=counts)
            b = buf.dispatch(x, topk_idx=idx[:, :1], num_tokens_per_expert=counts)
            recv_x, handle = (b[0], b[4]) if odd else (a[0], a[4])
            if case == "combine_handles":
                buf.combine(recv_x, handle)
            else:
                buf.dispatch(x, handle=handle)
        error = None
    except ValueError as e:
        error = str(e)
    return dict(error=error, after=_valid_round(buf, rank))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case,field", [
    ("dtype", "dtype"), ("num_experts", "num_experts"), ("topk", "topk"), ("combine_hidden", "hidden"),
    ("ll_hidden", "hidden"), ("ll_capacity", "capacity"), ("mode", "mode"), ("rejected", "topk_idx"),
    ("placement", "placement"), ("combine_handles", "handles"), ("cached_handles", "handles"),
])
def test_ranks_that_disagree_fail_alike_and_stay_in_step(ranks, world, case, field):
    results = ranks(world, _disagree, case)
    odd = world - 1
    for rank, got in enumerate(results):
        assert got["error"] is not None, f"rank {rank} raised nothing"
        if case == "rejected" and rank != odd:
            assert f"rank(s) [{odd}] rejected their arguments" in got["error"]
        elif case == "rejected":
            assert "topk_idx" in got["error"]
        elif field == "handles":  # every rank names the same pair whose counts differ
            assert "handles do not match" in got["error"] and got["error"] == results[0]["error"], got["error"]
        else:
            assert f"disagree on {field}" in got["error"], got["error"]
            assert f"rank {odd}:" in got["error"] and "rank 0:" in got["error"]
    # the next call on the same Buffers is in step and exact
    placement = ExpertPlacement.contiguous(EXPERTS, world)
    after = [r["after"] for r in results]
    ref = reference.dispatch([a["x"] for a in after], [a["idx"] for a in after], [a["w"] for a in after], placement)
    for rank, got in enumerate(after):
        assert torch.equal(got["recv_x"], ref[rank].x)
    combined = reference.combine([a["recv_x"] for a in after], ref, [a["x"].shape[0] for a in after])
    for rank, got in enumerate(after):
        assert torch.equal(got["combined"], combined[rank])


TIMEOUT_S = 3.0


def _timeout_then_reset(rank, world, group):
    buf = ep_comm.Buffer(group, timeout_s=TIMEOUT_S)
    out = {}
    if rank == 0:
        try:
            _valid_round(buf, rank)
        except ep_comm.CommTimeoutError as error:
            out["timeout"] = error.peers
        try:
            _valid_round(buf, rank)
        except ep_comm.errors.BufferStateError as error:
            out["refused"] = str(error)
        time.sleep(3)  # the ranks' reset() calls must meet within timeout_s
    else:
        time.sleep(TIMEOUT_S + 4)  # misses rank 0's call
    buf.reset()
    out["after"] = _valid_round(buf, rank, seed=9)
    return out


def test_after_a_timeout_the_buffer_refuses_calls_until_reset():
    results = spawn_once(2, _timeout_then_reset, timeout=60)
    assert results[0]["timeout"] == [1]
    assert "reset()" in results[0]["refused"]
    placement = ExpertPlacement.contiguous(EXPERTS, 2)
    after = [r["after"] for r in results]
    ref = reference.dispatch([a["x"] for a in after], [a["idx"] for a in after], [a["w"] for a in after], placement)
    for rank, got in enumerate(after):
        assert torch.equal(got["recv_x"], ref[rank].x)


def _two_failures(rank, world, group):
    buf = ep_comm.Buffer(group, timeout_s=TIMEOUT_S)
    if rank == 2:
        os._exit(3)
    seen = []
    try:
        _valid_round(buf, rank)
    except ep_comm.CommTimeoutError as error:
        seen.append(error.peers)
    buf.mask_ranks(seen[-1])
    if rank == 3:
        os._exit(3)
    try:
        _valid_round(buf, rank)
    except ep_comm.CommTimeoutError as error:
        seen.append(error.peers)
    buf.mask_ranks(seen[-1])
    after = _valid_round(buf, rank, seed=4)
    return dict(seen=seen, masked=sorted(buf.masked_ranks), combined_rows=after["combined"].shape[0])


def test_a_second_failure_names_the_buffer_rank_and_the_job_recovers():
    results = spawn_once(4, _two_failures, timeout=90, may_die=frozenset({2, 3}))
    for rank in (0, 1):
        assert results[rank]["seen"] == [[2], [3]], results[rank]
        assert results[rank]["masked"] == [2, 3] and results[rank]["combined_rows"] == 7


def _subgroup_faults(rank, world, group):
    """A Buffer over global ranks [1, 2, 3] (Buffer ranks 0-2): global rank 2 passes another hidden
    size, then global rank 3 misses a call."""
    import torch.distributed as dist

    sub = dist.new_group([1, 2, 3])
    if rank == 0:
        return {}
    buf = ep_comm.Buffer(sub, timeout_s=TIMEOUT_S)
    me, experts = rank - 1, 6
    idx, _ = make_routing(me, 5, 6, experts, 2)
    counts = torch.zeros(experts, dtype=torch.int32)
    out = {}
    try:
        buf.dispatch(make_x(me, 5, 6, 256 if rank == 2 else 128, torch.bfloat16), topk_idx=idx,
                     num_tokens_per_expert=counts)
    except ValueError as error:
        out["disagree"] = str(error)
    if rank == 3:
        time.sleep(TIMEOUT_S + 4)  # misses the others' call
    else:
        try:
            buf.dispatch(make_x(me, 5, 6, 128, torch.bfloat16), topk_idx=idx, num_tokens_per_expert=counts)
        except ep_comm.CommTimeoutError as error:
            out["timeout"] = (str(error), error.peers, error.global_peers)
    return out


def test_a_subgroup_buffer_names_global_ranks_too():
    """Buffer ranks are named with their global ranks where those differ: in a disagreement (the
    field's value per rank) and in a timeout (the message and ``global_peers``)."""
    results = spawn_once(4, _subgroup_faults, timeout=90)
    for rank in (1, 2, 3):
        assert "rank 1 (global rank 2): 256" in results[rank]["disagree"], results[rank]["disagree"]
        assert "rank 0 (global rank 1): 128" in results[rank]["disagree"]
    for rank in (1, 2):
        text, peers, global_peers = results[rank]["timeout"]
        assert peers == [2] and global_peers == [3], (peers, global_peers)
        assert "rank(s) [2] did not take part" in text and "global rank(s) [3]" in text, text


def _absent_from_construction(rank, world, group):
    """Global rank 3 constructs neither Buffer: one over the whole group (Buffer rank 3), one over
    global ranks [1, 2, 3] (Buffer rank 2)."""
    import torch.distributed as dist

    sub = dist.new_group([1, 2, 3])
    if rank == 3:
        time.sleep(2 * TIMEOUT_S + 4)
        return {}
    out = {}
    for name, g in (("whole", group), ("sub", sub)):
        if g is sub and rank == 0:
            continue
        started = time.monotonic()
        try:
            ep_comm.Buffer(g, timeout_s=TIMEOUT_S)
            out[name] = "constructed"
        except ep_comm.CommTimeoutError as error:
            out[name] = (error.peers, error.global_peers, time.monotonic() - started, str(error))
    return out


def test_buffer_construction_names_a_rank_that_never_arrives():
    """A rank that never constructs the Buffer is named within timeout_s by the others' constructor
    (a CommTimeoutError with its Buffer and global rank), not waited for past it (the constructor's
    first collective would wait for the process group's timeout)."""
    results = spawn_once(4, _absent_from_construction, timeout=90)
    for rank in (0, 1, 2):
        peers, global_peers, waited, text = results[rank]["whole"]
        assert peers == [3] and global_peers == [3] and waited < TIMEOUT_S + 2, results[rank]
        assert "Buffer construction" in text and "rank(s) [3] did not arrive" in text, text
    for rank in (1, 2):
        peers, global_peers, waited, text = results[rank]["sub"]
        assert peers == [2] and global_peers == [3] and waited < TIMEOUT_S + 2, results[rank]
        assert "global rank(s) [3]" in text, text


def test_global_peers_are_named_once_and_only_where_they_differ():
    error = ep_comm.CommTimeoutError("ep_comm x: rank(s) [1] did not take part", peers=[1], phase="x")
    error.name_global_ranks((0, 1, 2))
    assert error.global_peers == [1] and str(error) == "ep_comm x: rank(s) [1] did not take part"
    error = ep_comm.CommTimeoutError("late", peers=[0, 2], phase="x")
    error.name_global_ranks((4, 5, 6))
    error.name_global_ranks((7, 8, 9))
    assert error.global_peers == [4, 6] and str(error) == "late [global rank(s) [4, 6]]"
    unknown = ep_comm.CommTimeoutError("late", peers=[], phase="x")
    unknown.name_global_ranks((4, 5))
    assert unknown.global_peers == [] and str(unknown) == "late"


def _too_few_worst_tokens(rank, world, group):
    """Every token to expert 0 (Buffer rank 0), dispatched with num_worst_tokens below what rank 0
    receives on rank 0 and 0 (no padding, DeepEP's per-rank choice) on the others; then a valid
    round."""
    buf = ep_comm.Buffer(group, timeout_s=30)
    x = make_x(rank, 7, 5, 64, torch.bfloat16)
    idx = torch.zeros(5, 1, dtype=torch.int64)
    counts = torch.zeros(EXPERTS, dtype=torch.int32)
    try:
        recv_x = buf.dispatch(x, topk_idx=idx, topk_weights=torch.ones(5, 1), num_tokens_per_expert=counts,
                              num_worst_tokens=5 * world - 1 if rank == 0 else 0)[0]
        error = None
    except ValueError as e:
        error, recv_x = str(e), None
    return dict(error=error, rows=None if recv_x is None else recv_x.shape[0], after=_valid_round(buf, rank))


@pytest.mark.parametrize("world", [2, 4])
def test_num_worst_tokens_too_small_fails_on_that_rank_and_the_group_stays_in_step(ranks, world):
    """num_worst_tokens is each rank's own (DeepEP's): the rank it is too small for raises, the
    others' dispatch returns (rank 0 got every row), and the next call works on every rank."""
    results = ranks(world, _too_few_worst_tokens)
    assert f"num_worst_tokens ({5 * world - 1}) is smaller than the {5 * world} tokens" in results[0]["error"]
    for rank in range(1, world):
        assert results[rank]["error"] is None and results[rank]["rows"] == 0, results[rank]
    placement = ExpertPlacement.contiguous(EXPERTS, world)
    after = [r["after"] for r in results]
    ref = reference.dispatch([a["x"] for a in after], [a["idx"] for a in after], [a["w"] for a in after], placement)
    for rank, got in enumerate(after):
        assert torch.equal(got["recv_x"], ref[rank].x)
