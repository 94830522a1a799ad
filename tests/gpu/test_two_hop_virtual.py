"""Two-hop (node-aware) dispatch and combine kernels with R virtual ranks on one GPU (R = 4 as
2 nodes x 2, R = 8 as 2 x 4), against ep_comm.reference; and the bounded wait naming a missing rank.

NVSHMEM runs with one PE in a spawned process (bootstrapped over a one-process gloo group), so it
never touches the pytest process. The virtual ranks' buffers are carved from one nvshmem_malloc
(TwoHopEngine): the rail hop is a real put-with-signal to this PE, the node hop stores through
the other ranks' addresses. Combine tolerance as tests/test_hierarchical.py: with 2 nodes each
node's partial sum is rounded to the payload dtype once more than the flat sum.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.procs import free_port, run_with_deadline

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = [(2, 2, torch.bfloat16, 0), (2, 2, torch.float32, 1), (2, 4, torch.bfloat16, 2),
         (2, 4, torch.float32, 3)]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 4 * 2.0**-8 if dtype == torch.bfloat16 else 1e-5
    scale = want.float().abs().amax(1, keepdim=True).clamp(min=1.0)
    return bool(((got.float() - want.float()).abs() <= tol * scale).all())


def _case(nodes: int, per_node: int, dtype: torch.dtype, seed: int) -> str:
    from support.rank_cases import random_routing

    from ep_comm import reference
    from ep_comm.engines import TwoHopEngine
    from ep_comm.placement import ExpertPlacement
    r, k, hidden, max_tokens = nodes * per_node, 4, 256, 48
    e = 4 * r
    gen = torch.Generator().manual_seed(seed)
    placement = ExpertPlacement.from_expert_to_rank(torch.randint(0, r, (e,), generator=gen), r)
    counts = [int(torch.randint(0, max_tokens + 1, (1,), generator=gen)) for _ in range(r)]
    counts[1] = 0  # a rank with no tokens
    xs = [torch.randn(n, hidden, generator=gen).to(dtype) for n in counts]
    topks = [random_routing(gen, n, k, e) for n in counts]
    weights = [torch.rand(n, k, generator=gen) for n in counts]
    eng = TwoHopEngine(r, per_node, placement, torch.device("cuda"), dist.group.WORLD, max_tokens,
                       hidden * 4, k, timeout_s=10.0)
    ref = reference.dispatch(xs, topks, weights, placement)
    try:
        for round_ in range(2):  # the second round reuses the stages and flags
            got = eng.dispatch([x.cuda() for x in xs], [t.cuda() for t in topks], [w.cuda() for w in weights])
            for rank, (g, want) in enumerate(zip(got, ref)):
                if not (torch.equal(g.recv_x.cpu(), want.x) and torch.equal(g.recv_topk_idx.cpu(), want.topk_idx)
                        and torch.equal(g.recv_topk_weights.cpu(), want.topk_weights)
                        and g.recv_src_idx.tolist() == [t for _, t in want.sources]
                        and g.num_recv_tokens_per_expert == want.counts_per_expert):
                    return f"{nodes}x{per_node} {dtype} round {round_}: dispatch mismatch on rank {rank}"
            ys = [(g.recv_x.float() * (i + 2) - 0.37).to(dtype) for i, g in enumerate(got)]
            combined = eng.combine(ys, [g.handle for g in got], [g.recv_topk_weights for g in got])
            want_x = reference.combine([y.cpu() for y in ys], ref, counts)
            for rank, ((cx, cw), wx) in enumerate(zip(combined, want_x)):
                valid = topks[rank] >= 0
                routed = valid.any(1)
                want_w = torch.where(valid, weights[rank], torch.zeros_like(weights[rank]))
                want_w[~routed] = 0
                if not (_close(cx.cpu(), wx, dtype) and torch.equal(cw.cpu(), want_w)):
                    return f"{nodes}x{per_node} {dtype} round {round_}: combine mismatch on rank {rank}"
    finally:
        eng.close()
    return "ok"


class _DropLastRank:
    """ep_comm._cuda with the last virtual rank left out of two_hop_dispatch (a rank that never
    calls)."""

    def __init__(self, cuda) -> None:
        self.cuda = cuda

    def __getattr__(self, name: str):
        return getattr(self.cuda, name)

    def two_hop_dispatch(self, common: dict, ranks: list, stream: int) -> None:
        self.cuda.two_hop_dispatch(common, ranks[:-1], stream)


def _timeout_case() -> str:
    from ep_comm.engines import TwoHopEngine
    from ep_comm.errors import CommTimeoutError
    from ep_comm.placement import ExpertPlacement
    r, p, e, k = 4, 2, 8, 2
    placement = ExpertPlacement.contiguous(e, r)
    eng = TwoHopEngine(r, p, placement, torch.device("cuda"), dist.group.WORLD, 8, 128, k, timeout_s=0.5)
    try:
        eng.cuda = _DropLastRank(eng.cuda)
        # a forwarder waits for every rail peer's signal, rows or not
        topk = torch.tensor([[0, 7]] * 4, dtype=torch.int64)
        xs = [torch.randn(4, 32).cuda() for _ in range(r)]
        timed_out = False
        try:
            eng.dispatch(xs, [topk.cuda()] * r, [None] * r)
        except CommTimeoutError:
            timed_out = True
        if not timed_out:
            return "no timeout"
        # rank 1 (node 0, local 1) forwards for rank 3 (node 1, local 1), which never put its rows
        try:
            eng.records[p - 1].check()
            return "rank 1 recorded nothing"
        except CommTimeoutError as error:
            if error.peers != [r - 1] or error.phase != "internode/rail-recv":
                return f"rank 1 recorded peers={error.peers} phase={error.phase}"
    finally:
        eng.close()
    return "ok"


def _worker(rank: int, port: int, results) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        from ep_comm.engines import NvshmemSettings, init_nvshmem
        init_nvshmem(dist.group.WORLD, NvshmemSettings(symmetric_size=1 << 28))
        for case in CASES:
            try:
                results[str(case)] = _case(*case)
            except Exception as error:  # noqa: BLE001 - reported to the parent
                results[str(case)] = f"{type(error).__name__}: {error}"
        try:
            results["timeout"] = _timeout_case()
        except Exception as error:  # noqa: BLE001
            results["timeout"] = f"{type(error).__name__}: {error}"
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    """Runs every case in one spawned process (one NVSHMEM init); a hang is killed after 80 s,
    before pytest-timeout's 100 s, with its stacks in the outcome."""
    results = mp.Manager().dict()
    why = run_with_deadline(_worker, (free_port(), results), 1, 80.0)
    outcome = dict(results)
    if why is not None:
        outcome["process"] = why
    return outcome


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{str(c[2])[6:]}")
def test_two_hop_virtual_ranks_match_reference(outcomes: dict[str, str], case) -> None:
    assert outcomes.get(str(case), f"no result ({outcomes.get('process', 'killed or hung')})") == "ok"


def test_two_hop_missing_rank_times_out_naming_it(outcomes: dict[str, str]) -> None:
    assert outcomes.get("timeout", f"no result ({outcomes.get('process', 'killed or hung')})") == "ok"
