"""One NVSHMEM PE per process on one GPU: ``Buffer(group, backend="nvshmem", ranks_per_node=1)``
(two "nodes" of one rank; the network hop is a real NVSHMEM put-with-signal between the two PEs,
``rank_stride == 0`` in the two-hop kernels) against ``Buffer(group, backend="torch")`` on the
same inputs: dispatch bit-identical, combine equal within bf16 rounding, a fallback call (codec)
on ``hierarchical.py``, and a missing peer turning into ``CommTimeoutError``.

Processes, reporting and the skip rule are those of ``test_fused_two_processes.py``: if NVSHMEM
cannot initialise two PEs on one GPU the test skips with that reason after trying; what happened is
appended to ``$EP_COMM_GPU_REPORT``.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_fused_two_processes import (
    WORLD,
    _compare,
    _inputs,
    _report,
    _spawn,
    skip_unless_nvshmem_started,
    stage_marker,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _two_hop_case(rank: int, shared) -> str:
    import ep_comm

    group = dist.group.WORLD
    mark = stage_marker(shared, rank)  # how far this rank got, should it hang
    mark("nvshmem-init")
    try:
        fast = ep_comm.Buffer(group, backend="nvshmem", ranks_per_node=1, timeout_s=5.0)
    except Exception as error:  # noqa: BLE001 - NVSHMEM could not start two PEs on this GPU
        return f"nvshmem-init-failed: {type(error).__name__}: {error}"
    mark("nvshmem buffer made")
    ref = ep_comm.Buffer(group, backend="torch")
    mark("torch buffer made")
    problems: list[str] = []
    two_hop = fast.path_plan.get("two-hop kernels")
    if two_hop.unavailable:
        return f"two-hop kernels unavailable: {two_hop.unavailable}"
    e, k, hidden = 8, 4, 1024
    per_expert = torch.zeros(e, dtype=torch.int32)
    # round 2 reuses the engine; round 3 has no tokens on rank 1; round 4 needs a bigger engine
    for round_, n in enumerate((61 + 30 * rank, 61 + 30 * rank, 40 if rank == 0 else 0, 150 + rank)):
        x, topk, w = _inputs(rank + 10 * round_, e, k, hidden, n)
        mark(f"round {round_}: two-hop dispatch of {n} tokens")
        a = fast.dispatch(x.cuda(), topk_idx=topk.cuda(), topk_weights=w.cuda(), num_tokens_per_expert=per_expert)
        if fast.last_stats.extra.get("two_hop_kernels") != 1.0:
            problems.append(f"round {round_}: dispatch did not run the two-hop kernels")
        mark(f"round {round_}: torch dispatch")
        b = ref.dispatch(x, topk_idx=topk, topk_weights=w, num_tokens_per_expert=per_expert)
        for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
            _compare(problems, f"round {round_} {name}", a[i], b[i])
        if a[3] != b[3]:
            problems.append(f"round {round_} counts {a[3]} != {b[3]}")
        if not torch.equal(a[4].recv_src_token_index.cpu(), b[4].recv_src_token_index.cpu()):
            problems.append(f"round {round_} recv_src_token_index differs")
        y = (a[0].float() * (rank + 1.5)).bfloat16()
        mark(f"round {round_}: two-hop combine of {y.shape[0]} rows")
        ca, wa, _ = fast.combine(y, a[4], topk_weights=a[2])
        if fast.last_stats.extra.get("two_hop_kernels") != 1.0:
            problems.append(f"round {round_}: combine did not run the two-hop kernels")
        mark(f"round {round_}: torch combine")
        cb, wb, _ = ref.combine(y.cpu(), b[4], topk_weights=b[2])
        _compare(problems, f"round {round_} combined_x", ca, cb, exact=False)
        _compare(problems, f"round {round_} combined_topk_weights", wa, wb, exact=False)
    # not supported by the kernels: hierarchical.py over the torch subgroups, same results
    x, topk, w = _inputs(rank, e, k, hidden, 33)
    mark("lossless dispatch (hierarchical.py)")
    a = fast.dispatch(x.cuda(), topk_idx=topk.cuda(), topk_weights=w.cuda(), num_tokens_per_expert=per_expert,
                      codec="lossless")
    if fast.last_stats.extra.get("two_hop_kernels"):
        problems.append("a lossless dispatch ran the two-hop kernels")
    b = ref.dispatch(x, topk_idx=topk, topk_weights=w, num_tokens_per_expert=per_expert)
    _compare(problems, "lossless recv_x", a[0], b[0])
    mark("cached dispatch")
    cached = fast.dispatch(x.cuda(), handle=a[4])[0]
    _compare(problems, "cached dispatch", cached, b[0])

    # a peer that never calls: the plan exchange gives up and names it
    if rank == 0:
        mark("missing peer: rank 0 dispatches alone")
        try:
            fast.dispatch(x.cuda(), topk_idx=topk.cuda(), topk_weights=w.cuda(), num_tokens_per_expert=per_expert)
            problems.append("no CommTimeoutError when rank 1 stayed away")
        except ep_comm.CommTimeoutError as error:
            if error.peers != [1]:
                problems.append(f"timeout named peers {error.peers}, phase {error.phase!r}")
            _report(f"two-hop timeout, rank 0 alone: peers {error.peers}, phase {error.phase!r}")
    mark("final barrier")
    dist.barrier()
    mark("done")
    return "ok" if not problems else "; ".join(problems)


def test_buffer_two_hop_two_processes_match_torch_backend() -> None:
    results, _ = _spawn(_two_hop_case)
    _report(f"Buffer(backend='nvshmem', ranks_per_node=1), 2 processes on one GPU: {results}")
    skip_unless_nvshmem_started(results)
    assert results == ["ok"] * WORLD, results
