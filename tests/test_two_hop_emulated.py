"""The two-hop kernels (csrc/cuda/internode_two_hop.cu, internode_two_hop_combine.cu), whose forwarders
and receivers spin on the rail signals and node flags of other ranks, run on the CPU through the CUDA
emulation over its NVSHMEM of one PE (csrc/emulation/nvshmem.h): ep_comm's TwoHopEngine on virtual
ranks (2 nodes x 2 and 2 x 4, as tests/gpu/test_two_hop_virtual.py runs them on one GPU) drives the
real bindings (csrc/cuda_bindings/two_hop.cpp), in both schedule orders and with each call's launches
run four ways: all ranks in one launch after another (the engine's one stream), each rank on an
emulated stream of its own with the streams at once (as one rank per PE), the same with the streams
queued from the last rank down, and with the last rank's stream held back until the others ran as far
as they can (its rail peers' forwarders then spin on its rail signals and its node peers on its node
flags, so a kernel that does not wait for them reads stale stages and fails). Dispatch is
bit-exact against ep_comm/reference.py; combine bit-exact against the two-hop order (float32 sums
per node, local rank ascending, rounded to the payload dtype, then over nodes ascending), built
from the reference's per-rank combine. A rank that never launches makes the others stall: the
emulation's stall report, or without it the kernels' bounded wait naming the rail peer."""
from __future__ import annotations

import pytest
import torch
from support.native import compiler

from ep_comm import reference
from ep_comm.engines import TwoHopEngine
from ep_comm.errors import CommTimeoutError
from ep_comm.placement import ExpertPlacement

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler")

MODES = ("one_stream", "rank_streams", "last_rank_first", "last_rank_late")


@pytest.fixture(scope="module")
def kernels(request, tmp_path_factory):
    """The two-hop bindings over the emulated kernels, built once and kept in pytest's cache while
    csrc/ and tests/native/ are unchanged."""
    from support.emulated_cuda import cached_two_hop_module

    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    module = cached_two_hop_module(cache.mkdir("ep_emulated_two_hop") if cache is not None
                                   else tmp_path_factory.mktemp("ep_emulated_two_hop"))
    module.set_device(8, 2)
    yield module
    module.set_schedule(0)
    module.set_device(1, 1)
    module.set_stall_failure(0)


class _Launches:
    """The emulated bindings with each two-hop call launched as ``mode`` says (MODES); ``skip``: a
    rank whose launch is left out (a rank that never calls)."""

    def __init__(self, kernels, mode: str, skip: int | None = None) -> None:
        self.kernels, self.mode, self.skip = kernels, mode, skip
        self.hold_word = torch.zeros(1, dtype=torch.int32)

    def __getattr__(self, name: str):
        return getattr(self.kernels, name)

    def _run(self, launch, ranks: list[dict]) -> None:
        ranks = [a for a in ranks if a["rank"] != self.skip]
        if self.mode == "one_stream":
            launch(ranks, 0)
            return
        order = reversed(range(len(ranks))) if self.mode == "last_rank_first" else range(len(ranks))
        self.kernels.begin_streams()
        try:
            if self.mode == "last_rank_late":
                self.kernels.hold_stream(self.hold_word.data_ptr(), 256, len(ranks))
            for i in order:
                launch([ranks[i]], i + 1)
        finally:
            self.kernels.run_streams()

    def two_hop_dispatch(self, common: dict, ranks: list[dict], stream: int) -> None:
        self._run(lambda rs, s: self.kernels.two_hop_dispatch(common, rs, s), ranks)

    def two_hop_combine(self, common: dict, fmt: dict, ranks: list[dict], stream: int) -> None:
        self._run(lambda rs, s: self.kernels.two_hop_combine(common, fmt, rs, s), ranks)


def _case(nodes: int, per_node: int, dtype: torch.dtype, seed: int, max_tokens: int = 24):
    """Random routing with dropped entries and uneven token counts; rank 1 has no tokens."""
    from support.rank_cases import random_routing

    r, k = nodes * per_node, 4
    e = 4 * r
    gen = torch.Generator().manual_seed(seed)
    placement = ExpertPlacement.from_expert_to_rank(torch.randint(0, r, (e,), generator=gen), r)
    counts = [int(torch.randint(1, max_tokens + 1, (1,), generator=gen)) for _ in range(r)]
    counts[1] = 0
    xs = [torch.randn(n, 96, generator=gen).to(dtype) for n in counts]
    topks = [random_routing(gen, n, k, e) for n in counts]
    weights = [torch.rand(n, k, generator=gen) for n in counts]
    return placement, xs, topks, weights


def _two_hop_sum(rows: list[torch.Tensor], receives, counts: list[int], per_node: int) -> list[torch.Tensor]:
    """Per source token, the float32 sum of the returned rows per node (local rank ascending) rounded
    to the rows' dtype, then of those partial sums over nodes ascending, in float32, rounded again."""
    nodes = len(rows) // per_node
    partials = []
    for g in range(nodes):
        mine = [y if d // per_node == g else torch.zeros_like(y) for d, y in enumerate(rows)]
        partials.append(reference.combine(mine, receives, counts))
    out = []
    for src, n in enumerate(counts):
        acc = torch.zeros(n, rows[0].shape[1], dtype=torch.float32)
        for g in range(nodes):
            acc = acc + partials[g][src].float()
        out.append(acc.to(rows[0].dtype))
    return out


def _engine(kernels, placement, nodes: int, per_node: int, mode: str, timeout_s: float = 10.0,
            skip: int | None = None) -> TwoHopEngine:
    return TwoHopEngine(nodes * per_node, per_node, placement, torch.device("cpu"), None, 24, 96 * 4, 4,
                        timeout_s=timeout_s, kernels=_Launches(kernels, mode, skip))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("nodes,per_node,dtype", [(2, 2, torch.bfloat16), (2, 4, torch.float32)])
def test_dispatch_and_combine_match_the_reference(kernels, mode, reverse, nodes, per_node, dtype):
    placement, xs, topks, weights = _case(nodes, per_node, dtype, seed=nodes * per_node * 10 + reverse)
    kernels.set_schedule(reverse)
    kernels.set_stall_failure(1)
    engine = _engine(kernels, placement, nodes, per_node, mode)
    want = reference.dispatch(xs, topks, weights, placement)
    counts = [x.shape[0] for x in xs]
    try:
        for round_ in range(2):  # the second round reuses the stages, signals and flags
            got = engine.dispatch(xs, topks, weights)
            for rank, (g, ref) in enumerate(zip(got, want)):
                assert torch.equal(g.recv_x, ref.x), (round_, rank)
                assert torch.equal(g.recv_topk_idx, ref.topk_idx), (round_, rank)
                assert torch.equal(g.recv_topk_weights, ref.topk_weights), (round_, rank)
                assert g.recv_src_idx.tolist() == [t for _, t in ref.sources], (round_, rank)
                assert g.num_recv_tokens_per_expert == ref.counts_per_expert, (round_, rank)
            # expert outputs: each received row scaled by its rank, so a row summed into the wrong token shows
            ys = [(g.recv_x.float() * (r + 2) - 0.37).to(dtype) for r, g in enumerate(got)]
            combined = engine.combine(ys, [g.handle for g in got], [g.recv_topk_weights for g in got])
            want_x = _two_hop_sum(ys, want, counts, per_node)
            want_w = _two_hop_sum([ref.topk_weights for ref in want], want, counts, per_node)
            for rank, (cx, cw) in enumerate(combined):
                assert torch.equal(cx, want_x[rank]), (round_, rank)
                assert torch.equal(cw, want_w[rank]), (round_, rank)
    finally:
        engine.close()


@pytest.mark.parametrize("reverse", [0, 1])
def test_a_rank_that_never_launches_stalls_the_others(kernels, reverse):
    """Rank 3 (node 1, local 1) never puts its rows: rank 1, its forwarder on node 0, spins on the
    rail signal forever, and the emulation fails the launches with its stall report."""
    placement, xs, topks, weights = _case(2, 2, torch.bfloat16, seed=3)
    kernels.set_schedule(reverse)
    kernels.set_stall_failure(1)
    engine = _engine(kernels, placement, 2, 2, "rank_streams", timeout_s=3600.0, skip=3)
    try:
        with pytest.raises(RuntimeError, match="stall") as info:
            engine.dispatch(xs, topks, weights)
        assert "a flag they wait for is never released" in str(info.value)
    finally:
        engine.close()


def test_a_stall_without_the_stall_report_is_the_kernels_timeout(kernels):
    """As on a GPU: the bounded waits give up (the emulation's clock jumps once nothing else can
    change), the engine raises CommTimeoutError, and rank 1's record names the rail-recv phase and
    rank 3, the rail peer that never came (as tests/gpu/test_two_hop_virtual.py checks)."""
    placement, xs, topks, weights = _case(2, 2, torch.bfloat16, seed=4)
    kernels.set_schedule(0)
    kernels.set_stall_failure(0)
    engine = _engine(kernels, placement, 2, 2, "rank_streams", timeout_s=3600.0, skip=3)
    try:
        with pytest.raises(CommTimeoutError):
            engine.dispatch(xs, topks, weights)
        with pytest.raises(CommTimeoutError) as info:
            engine.records[1].check()
        assert info.value.peers == [3] and info.value.phase == "internode/rail-recv"
    finally:
        engine.close()
