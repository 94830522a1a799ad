"""Rank 0 is not special, and a restarted process rejoins, on 2 and 4 gloo ranks.

With the store outside the workers (the launcher hosts it, as torchrun's elastic agent does) the
death of any rank, rank 0 included, is named within ``timeout_s`` + 1 s and masked, later steps
are exact with the dead rank's entries dropped and counted; the restarted process (a new pid, the
same rank) rejoins through the store (``rejoining_ranks`` + ``unmask_ranks`` on the survivors,
``Buffer.rejoin`` on the newcomer) and its experts are served again, bit-exact against
``ep_comm.reference`` in normal and low-latency mode. A store given as ``Buffer(store=...)`` does
the same under the default launch, whose own store (in rank 0's process) dies with rank 0; a
Buffer on that store alone gets a ``StoreLostError`` that says which launches survive it.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from support.mp_pool import spawn_once
from support.rank_cases import make_routing, make_x
from support.store_launch import run_with_agent_store

import ep_comm
from ep_comm import reference
from ep_comm.errors import BufferStateError, StoreLostError
from ep_comm.placement import ExpertPlacement

EXPERTS, HIDDEN, TOKENS, TOPK, MAX_TOKENS = 8, 64, 6, 2, 8
TIMEOUT_S = 5.0


def _steps(buf, rank, seed):
    """A normal dispatch + combine and a low-latency dispatch + combine; inputs and outputs."""
    idx, w = make_routing(rank, seed, TOKENS, EXPERTS, TOPK)
    x = make_x(rank, seed, TOKENS, HIDDEN, torch.bfloat16)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                              num_tokens_per_expert=torch.zeros(EXPERTS, dtype=torch.int32))
    dropped = buf.last_stats.dropped_topk_entries
    y = recv_x * 3
    combined, _, _ = buf.combine(y, handle)
    ll_x, count, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, MAX_TOKENS, EXPERTS, use_fp8=False)
    ll_dropped = buf.last_stats.dropped_topk_entries
    ll_y = ll_x * 2
    ll_combined, _, _ = buf.low_latency_combine(ll_y, idx, w, ll_handle)
    return dict(x=x, idx=idx, w=w, recv_x=recv_x, y=y, combined=combined, dropped=dropped, ll_x=ll_x.clone(),
                count=count.tolist(), ll_y=ll_y.clone(), ll_combined=ll_combined, ll_dropped=ll_dropped)



def _lose_and_mask(buf, rank: int, victim: int) -> dict:
    """Step 1 on every rank; ``victim`` then exits; the survivors' step 2 names it (``peers``, and
    ``detect_s`` the seconds it took), they mask it and run step 3 (``masked``)."""
    out = dict(before=_steps(buf, rank, 1))
    if rank == victim:
        os._exit(3)
    started = time.monotonic()
    try:
        _steps(buf, rank, 2)
    except ep_comm.CommTimeoutError as error:
        out["peers"], out["detect_s"] = error.peers, time.monotonic() - started
    buf.mask_ranks(out["peers"])
    out["masked"] = _steps(buf, rank, 3)
    return out

def _survivor(rank, world, group, victim):
    buf = ep_comm.Buffer(group, timeout_s=TIMEOUT_S, low_latency_mode=True)
    out = _lose_and_mask(buf, rank, victim)
    out["pid"] = os.getpid()
    polls, deadline = 0, time.monotonic() + 90
    while not (back := buf.rejoining_ranks()) and time.monotonic() < deadline:
        polls += 1
        time.sleep(0.1)
    out["back"], out["polls"] = back, polls
    buf.unmask_ranks(back)
    out["rejoined"] = _steps(buf, rank, 4)
    out["masked_end"] = sorted(buf.masked_ranks)
    out["attributes"] = sorted(vars(buf))
    return out


def _newcomer(rank, world, store, victim):
    buf = ep_comm.Buffer.rejoin(store, rank, wait_s=90)
    return dict(rejoined=_steps(buf, rank, 4), pid=os.getpid(), masked_end=sorted(buf.masked_ranks),
                attributes=sorted(vars(buf)), group=buf.group, rank=buf.rank, group_size=buf.group_size)


def _check(results, key, live, world):
    """``results[r][key]`` of every live rank against the reference, dead ranks sending nothing."""
    placement = ExpertPlacement.contiguous(EXPERTS, world)
    dead = torch.tensor([r for r in range(world) if r not in live], dtype=torch.int64)
    xs, idxs, ws = [], [], []
    for rank in range(world):
        if rank in live:
            got = results[rank][key]
            idx = got["idx"].clone()
            lost = (idx >= 0) & torch.isin(placement.expert_to_rank[idx.clamp(min=0)], dead)
            assert got["dropped"] == got["ll_dropped"] == int(lost.sum()), (key, rank)
            xs.append(got["x"])
            idxs.append(idx.masked_fill(lost, -1))
            ws.append(got["w"])
        else:
            xs.append(torch.zeros(0, HIDDEN, dtype=torch.bfloat16))
            idxs.append(torch.zeros(0, TOPK, dtype=torch.int64))
            ws.append(torch.zeros(0, TOPK))
    ref = reference.dispatch(xs, idxs, ws, placement)
    ys = [results[r][key]["y"] if r in live else ref[r].x * 3 for r in range(world)]
    combined = reference.combine(ys, ref, [x.shape[0] for x in xs])
    ll = reference.low_latency_dispatch(xs, idxs, MAX_TOKENS, placement)
    ll_ys = [results[r][key]["ll_y"] if r in live else
             torch.zeros(EXPERTS // world, world * MAX_TOKENS, HIDDEN, dtype=torch.bfloat16) for r in range(world)]
    ll_combined = reference.low_latency_combine(ll_ys, ll, idxs, ws, placement)
    for rank in live:
        got = results[rank][key]
        assert torch.equal(got["recv_x"], ref[rank].x), (key, rank)
        assert torch.equal(got["combined"], combined[rank]), (key, rank)
        assert got["count"] == ll[rank].count, (key, rank)
        for j, c in enumerate(ll[rank].count):
            assert torch.equal(got["ll_x"][j, :c], ll[rank].x[j, :c]), (key, rank, j)
        assert torch.equal(got["ll_combined"], ll_combined[rank]), (key, rank)


@pytest.mark.parametrize("world,victim", [(2, 0), pytest.param(4, 0, marks=pytest.mark.slow),
                                          pytest.param(4, 2, marks=pytest.mark.slow)])
def test_a_dead_rank_is_named_masked_and_its_restarted_process_rejoins(world, victim):
    results = run_with_agent_store(world, _survivor, victim, timeout=150, restart={victim: _newcomer})
    everyone = list(range(world))
    survivors = [r for r in everyone if r != victim]
    for rank in survivors:
        got = results[rank]
        assert got["peers"] == [victim], got["peers"]
        assert got["detect_s"] <= TIMEOUT_S + 1.0, got["detect_s"]
        assert got["back"] == [victim] and got["masked_end"] == []
    _check(results, "masked", survivors, world)
    # at least one dropped entry, so the masked step shows the dead rank's experts left out
    assert sum(results[r]["masked"]["dropped"] for r in survivors) > 0
    newcomer = results[victim]
    assert newcomer["group"] is None and newcomer["rank"] == victim and newcomer["group_size"] == world
    assert newcomer["masked_end"] == []
    assert set(results[survivors[0]]["attributes"]) <= set(newcomer["attributes"])
    _check(results, "rejoined", everyone, world)
    # the newcomer's experts are served again: entries that select them arrive there
    assert sum(int((results[r]["rejoined"]["idx"] // (EXPERTS // world) == victim).sum()) for r in everyone) > 0


def _own_store_survives_rank0(rank, world, group, port):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    buf = ep_comm.Buffer(group, timeout_s=TIMEOUT_S, low_latency_mode=True, store=store)
    return _lose_and_mask(buf, rank, 0)


def test_a_store_given_to_the_buffer_survives_rank0_under_the_default_launch():
    """``tcp://`` rendezvous (rank 0 hosts the process group's store), ``Buffer(store=...)`` a store
    this process hosts: rank 0's death is named, masked and the survivors' steps exact."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    results = spawn_once(2, _own_store_survives_rank0, store.port, timeout=90, may_die=frozenset({0}))
    got = results[1]
    assert got["peers"] == [0] and got["detect_s"] <= TIMEOUT_S + 1.0
    _check(results, "masked", [1], 2)
    assert got["masked"]["dropped"] > 0


def _store_dies_with_rank0(rank, world, group):
    buf = ep_comm.Buffer(group, timeout_s=TIMEOUT_S)
    _steps(buf, rank, 1)
    if rank == 0:
        os._exit(3)
    out = {}
    started = time.monotonic()
    try:
        _steps(buf, rank, 2)
    except StoreLostError as error:
        out["call"] = (str(error), error.peers, time.monotonic() - started)
    started = time.monotonic()
    try:
        buf.mask_ranks([0])
    except StoreLostError as error:
        out["mask"] = (str(error), time.monotonic() - started)
    try:
        _steps(buf, rank, 3)
    except BufferStateError as error:
        out["refused"] = str(error)
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_store_rank0_hosts_dies_with_it_and_the_error_says_which_launches_survive(world):
    results = spawn_once(world, _store_dies_with_rank0, timeout=90, may_die=frozenset({0}))
    for rank in range(1, world):
        got = results[rank]
        text, peers, took = got["call"]
        assert isinstance(peers, list) and peers == [] and took <= TIMEOUT_S + 1.0
        for error in (text, got["mask"][0]):
            assert "key-value store no longer answers" in error and "torchrun" in error
            assert "store=" in error
        assert got["mask"][1] <= TIMEOUT_S + 1.0
        assert "reset()" in got["refused"]


def test_rejoin_without_an_invite_times_out_and_bad_arguments_are_value_errors():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    started = time.monotonic()
    with pytest.raises(ep_comm.CommTimeoutError, match="no live Buffer invited global rank 5"):
        ep_comm.Buffer.rejoin(store, 5, wait_s=0.5)
    assert time.monotonic() - started < 5
    assert not store.check(["ep_comm/rejoin/5/waiting"])  # the announcement is withdrawn
    for kwargs, name in [(dict(store="host:port", rank=0), "store"), (dict(store=store, rank=-1), "rank"),
                         (dict(store=store, rank=0, wait_s=0), "wait_s")]:
        with pytest.raises(ValueError, match=name):
            ep_comm.Buffer.rejoin(**kwargs)


def _bad_store(rank, world, group):
    try:
        ep_comm.Buffer(group, store="127.0.0.1:29500")
    except ValueError as error:
        return str(error)
    return None


def test_a_store_that_is_not_a_store_is_a_value_error(ranks):
    assert all(error is not None and error.startswith("store must be") for error in ranks(2, _bad_store))
