"""A peer that never calls, or dies, gives CommTimeoutError naming it within timeout_s."""
from __future__ import annotations

import os
import time

import pytest
import torch
from support.mp_pool import spawn_once
from support.rank_cases import make_routing, make_x

import ep_comm

TIMEOUT_S = 4.0
SLACK_S = 2.0


def _one_rank_stalls(rank, world, group, how):
    buf = ep_comm.Buffer(group, timeout_s=TIMEOUT_S)
    idx, w = make_routing(rank, 1, 6, 8, 2, 0.0)
    x = make_x(rank, 1, 6, 128, torch.bfloat16)
    if rank == world - 1:
        if how == "dies":
            os._exit(3)
        time.sleep(TIMEOUT_S + 6 * SLACK_S)  # never calls
        return None
    started = time.monotonic()
    try:
        if how == "low_latency":
            buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=False)
        else:
            buf.dispatch(x, topk_idx=idx, topk_weights=w,
                         num_tokens_per_expert=torch.zeros(8, dtype=torch.int32))
    except ep_comm.CommTimeoutError as error:
        return dict(elapsed=time.monotonic() - started, peers=error.peers, message=str(error),
                    phase=error.phase)
    return dict(elapsed=time.monotonic() - started, peers=None, message="no error", phase="")


@pytest.mark.parametrize("how", ["never_calls", "dies", "low_latency"])
def test_dead_or_silent_peer_raises_comm_timeout(how):
    results = spawn_once(4, _one_rank_stalls, how, timeout=60, may_die=frozenset({3}))
    for rank, r in enumerate(results[:3]):
        assert r is not None, f"rank {rank} gave no result"
        assert r["peers"] == [3], f"rank {rank}: {r['message']}"
        assert "3" in r["message"] and r["phase"]
        assert r["elapsed"] < TIMEOUT_S + SLACK_S, f"rank {rank} took {r['elapsed']:.1f}s"
