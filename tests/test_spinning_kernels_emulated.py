"""The intranode kernels (csrc/cuda/intranode.cu), whose sender and receiver blocks of every virtual
rank spin on each other's ring tails and heads, run on the CPU through the CUDA emulation with all
blocks of a launch co-resident as interleaved fibers (csrc/emulation/grid.h): ep_comm's
IntranodeEngine on 2, 4 and 8 virtual ranks, driving the real bindings (peer_kernels.cpp) over the
emulated kernels, bit-exact against ep_comm/reference.py in both schedule orders, through the rings
and with direct writes; the launch check refuses a grid that the emulated device cannot hold; a grid
held back from co-residency fails with the emulation's stall report instead of hanging (and so does
a missing release: removing the dispatch sender's last publish, or the __syncwarp before a publish,
makes the ring cases fail); the ring kernels also with 2 and 3 warps (and sub-rings) per peer. The
low-latency kernels (csrc/cuda/low_latency.cu) likewise, through their bindings, with the send and
receive launches also run at once on emulated streams (a stream per rank, or the receivers' launch
queued before the senders'), so the receivers' spins wait on the senders' flags: a receiver that does
not wait, or a sender that never publishes, fails."""
from __future__ import annotations

import pytest
import torch
from support.native import compiler

from ep_comm import reference
from ep_comm.engines.intranode import IntranodeEngine
from ep_comm.errors import CommTimeoutError
from ep_comm.placement import ExpertPlacement

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler")


@pytest.fixture(scope="module")
def kernels(request, tmp_path_factory):
    """The peer-kernel bindings over the emulated kernels, built once and kept in pytest's cache
    while csrc/ and tests/native/ are unchanged."""
    from support.emulated_cuda import cached_peer_module

    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    module = cached_peer_module(cache.mkdir("ep_emulated_peer") if cache is not None
                                else tmp_path_factory.mktemp("ep_emulated_peer"))
    yield module
    module.set_schedule(0)
    module.set_device(1, 1)
    module.set_resident_limit(0)
    module.set_stall_failure(0)


def _emulated_device(kernels, blocks: int, reverse: int) -> None:
    """An emulated device that holds `blocks` blocks of up to 256 threads at once (2 per SM)."""
    kernels.set_device((blocks + 1) // 2, 2)
    kernels.set_resident_limit(0)
    kernels.set_schedule(reverse)
    kernels.set_stall_failure(1)


def _case(num_ranks: int, tokens: int, hidden: int, topk: int, experts_per_rank: int, seed: int,
          first_tokens: int | None = None):
    """Random routing with dropped entries and uneven token counts; rank 1 has no tokens and the last
    rank no experts (both then pass empty tensors: null pointers to the kernels); rank 0 has
    `first_tokens` tokens when given."""
    gen = torch.Generator().manual_seed(seed)
    e = num_ranks * experts_per_rank
    owners = torch.randint(0, num_ranks - 1, (e,), generator=gen)
    owners[: num_ranks - 1] = torch.arange(num_ranks - 1)
    placement = ExpertPlacement.from_expert_to_rank(owners, num_ranks)
    xs, idxs, ws = [], [], []
    for r in range(num_ranks):
        n = 0 if r == 1 else first_tokens if r == 0 and first_tokens is not None else tokens + r
        xs.append(torch.randn(n, hidden, generator=gen).to(torch.bfloat16))
        idx = torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(n)]) if n else \
            torch.empty(0, topk, dtype=torch.int64)
        idx[torch.rand(n, topk, generator=gen) < 0.15] = -1  # dropped entries
        idxs.append(idx)
        ws.append(torch.rand(n, topk, generator=gen))
    return placement, xs, idxs, ws


def _engine(kernels, placement, num_ranks: int, topk: int, hidden: int, channels: int, slots: int,
            timeout_s: float = 1.0, copy: str | None = "ring", warps_per_peer: int = 1) -> IntranodeEngine:
    return IntranodeEngine(num_ranks, placement, torch.device("cpu"), topk, 2 * hidden, num_channels=channels,
                           ring_slots=slots, timeout_s=timeout_s, kernels=kernels, copy=copy,
                           warps_per_peer=warps_per_peer)


def _assert_dispatched(outs: list[dict], want: list) -> None:
    """Each virtual rank's dispatch outputs equal the reference's, bit for bit."""
    for rank, (out, ref) in enumerate(zip(outs, want)):
        assert torch.equal(out["recv_x"], ref.x), rank
        assert torch.equal(out["recv_topk_idx"], ref.topk_idx), rank
        assert torch.equal(out["recv_topk_weights"], ref.topk_weights), rank
        assert torch.equal(out["recv_src_idx"].long(), ref.src_idx), rank


def _assert_combined(engine, outs: list[dict], want: list, xs: list[torch.Tensor]) -> None:
    """The engine's combine of the dispatched rows equals the reference's, bit for bit. Expert
    outputs: each received row scaled by its rank, so a row summed into the wrong token shows."""
    ys = [(o["recv_x"].float() * (1 + r)).to(torch.bfloat16) for r, o in enumerate(outs)]
    combined = engine.combine(ys, [o["handle"] for o in outs], [o["recv_topk_weights"] for o in outs])
    want_x = reference.combine(ys, want, [x.shape[0] for x in xs])
    want_w = reference.combine([ref.topk_weights for ref in want], want, [x.shape[0] for x in xs])
    for rank in range(len(outs)):
        assert torch.equal(combined[rank][0], want_x[rank]), rank
        assert torch.equal(combined[rank][1], want_w[rank]), rank


@pytest.mark.parametrize("copy", ["ring", "direct"])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("num_ranks,tokens,hidden,topk,channels,slots", [
    (2, 40, 264, 3, 2, 8),     # rings wrap: 40+ rows per channel through 8 slots; a partial copy batch
    (4, 33, 2048, 4, 3, 8),    # whole 8-vector batches per lane
    (8, 12, 128, 8, 1, 8),     # every rank a peer of every other, one channel
])
def test_dispatch_and_combine_match_the_reference(kernels, copy, reverse, num_ranks, tokens, hidden, topk,
                                                  channels, slots):
    """The ring kernels (senders and receivers spinning on each other) and the direct-write ones."""
    placement, xs, idxs, ws = _case(num_ranks, tokens, hidden, topk, 2, seed=num_ranks * 100 + reverse)
    _emulated_device(kernels, 2 * channels * num_ranks, reverse)
    engine = _engine(kernels, placement, num_ranks, topk, hidden, channels, slots, copy=copy)
    outs = engine.dispatch(xs, idxs, ws, threads=32 * num_ranks)
    want = reference.dispatch(xs, idxs, ws, placement)
    _assert_dispatched(outs, want)
    for rank, (out, ref) in enumerate(zip(outs, want)):
        assert out["num_recv_tokens_per_expert"] == ref.counts_per_expert, rank
    _assert_combined(engine, outs, want, xs)


@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("warps_per_peer,num_ranks,tokens,hidden,topk,channels,slots", [
    (2, 2, 40, 264, 3, 2, 8),    # sub-rings of 4 slots wrap many times; a partial copy batch
    (3, 2, 40, 264, 3, 2, 9),    # 3 sub-rings of 3 slots (the least ring for 3 warps per peer)
    (3, 4, 33, 512, 4, 2, 12),   # 384 threads per block
    (2, 8, 12, 128, 8, 1, 8),    # 512 threads per block: 16 warps, 2 per peer
])
def test_ring_kernels_with_several_warps_per_peer(kernels, reverse, warps_per_peer, num_ranks, tokens, hidden, topk,
                                                  channels, slots):
    """Each peer's rows dealt out among warps_per_peer warps and sub-rings in the ring dispatch and
    the ring combine's senders, bit-exact against the reference."""
    placement, xs, idxs, ws = _case(num_ranks, tokens, hidden, topk, 2, seed=num_ranks * 7 + warps_per_peer + reverse)
    _emulated_device(kernels, 2 * channels * num_ranks, reverse)
    engine = _engine(kernels, placement, num_ranks, topk, hidden, channels, slots, warps_per_peer=warps_per_peer)
    outs = engine.dispatch(xs, idxs, ws, threads=32 * num_ranks)
    want = reference.dispatch(xs, idxs, ws, placement)
    _assert_dispatched(outs, want)
    _assert_combined(engine, outs, want, xs)


def test_warps_per_peer_is_checked(kernels):
    placement = ExpertPlacement.contiguous(16, 8)
    with pytest.raises(ValueError, match="warps_per_peer must be 1, 2 or 3"):
        _engine(kernels, placement, 8, 2, 64, 1, 8, warps_per_peer=4)
    with pytest.raises(ValueError, match="warps_per_peer=3 with 8 ranks needs 768 threads"):
        _engine(kernels, placement, 8, 2, 64, 1, 16, warps_per_peer=3)
    with pytest.raises(ValueError, match="ring_slots must be >= 9 with warps_per_peer=3"):
        _engine(kernels, ExpertPlacement.contiguous(4, 2), 2, 2, 64, 1, 8, warps_per_peer=3)


@pytest.mark.parametrize("copy", ["ring", "direct"])
def test_a_combine_takes_its_own_dispatch_after_another(kernels, copy):
    """Dispatch A, dispatch B with other routing, then combine A's rows with A's handles."""
    placement, xs, idxs_a, ws = _case(4, 20, 128, 3, 2, seed=51)
    idxs_b = [torch.roll(i, 1, dims=0) if i.shape[0] else i for i in idxs_a]
    _emulated_device(kernels, 2 * 2 * 4, 0)
    engine = _engine(kernels, placement, 4, 3, 128, 2, 8, copy=copy)
    outs_a = engine.dispatch(xs, idxs_a, ws, threads=128)
    engine.dispatch(xs, idxs_b, ws, threads=128)
    ys = [o["recv_x"] for o in outs_a]
    combined = engine.combine(ys, [o["handle"] for o in outs_a])
    want = reference.combine(ys, reference.dispatch(xs, idxs_a, ws, placement), [x.shape[0] for x in xs])
    for rank in range(4):
        assert torch.equal(combined[rank][0], want[rank]), rank


@pytest.mark.parametrize("warps_per_rank", [1, 2, 3])
def test_direct_dispatch_with_several_warps_per_destination(kernels, warps_per_rank):
    """Each destination's rows shared out among warps_per_rank warps (blocks of 32 * ranks * that)."""
    placement, xs, idxs, ws = _case(4, 70, 256, 4, 2, seed=41)
    _emulated_device(kernels, 2 * 2 * 4, 0)
    engine = _engine(kernels, placement, 4, 4, 256, 2, 8, copy="direct")
    outs = engine.dispatch(xs, idxs, ws, threads=32 * 4 * warps_per_rank)
    for rank, (out, ref) in enumerate(zip(outs, reference.dispatch(xs, idxs, ws, placement))):
        assert torch.equal(out["recv_x"], ref.x), rank
        assert torch.equal(out["recv_topk_idx"], ref.topk_idx), rank
        assert torch.equal(out["recv_src_idx"].long(), ref.src_idx), rank


def test_a_grid_the_device_cannot_hold_is_refused_at_launch(kernels):
    placement, xs, idxs, ws = _case(2, 8, 64, 2, 2, seed=5)
    _emulated_device(kernels, 4, 0)
    engine = _engine(kernels, placement, 2, 2, 64, channels=3, slots=8)  # 12 blocks, room for 4
    with pytest.raises(RuntimeError, match="cannot be resident at once"):
        engine.dispatch(xs, idxs, ws, threads=64)


@pytest.mark.parametrize("reverse", [0, 1])
def test_a_grid_held_back_from_co_residency_stalls_and_fails(kernels, reverse):
    """The launch check passes, but only one block runs at a time: the notify's barrier waits for a
    rank whose block never becomes resident."""
    placement, xs, idxs, ws = _case(2, 8, 64, 2, 2, seed=6)
    _emulated_device(kernels, 4, reverse)
    kernels.set_resident_limit(1)
    engine = _engine(kernels, placement, 2, 2, 64, channels=1, slots=8, timeout_s=3600.0)
    try:
        with pytest.raises(RuntimeError, match="blocks were never resident") as info:
            engine.dispatch(xs, idxs, ws, threads=64)
        assert "stall" in str(info.value) and "intranode_notify" in str(info.value)
    finally:
        kernels.set_resident_limit(0)


def test_a_stall_without_the_stall_report_is_the_kernels_timeout(kernels):
    """As on a GPU: the bounded waits give up (the emulation's clock jumps once nothing else can
    change) and the engine raises CommTimeoutError naming the phase."""
    placement, xs, idxs, ws = _case(2, 8, 64, 2, 2, seed=7)
    _emulated_device(kernels, 4, 0)
    kernels.set_stall_failure(0)
    kernels.set_resident_limit(1)
    engine = _engine(kernels, placement, 2, 2, 64, channels=1, slots=8, timeout_s=3600.0)
    try:
        with pytest.raises(CommTimeoutError, match="intranode/barrier"):
            engine.dispatch(xs, idxs, ws, threads=64)
    finally:
        kernels.set_resident_limit(0)


# ---- low-latency kernels (csrc/cuda/low_latency.cu) on virtual ranks ------------------------------
# How the send and receive launches of the virtual ranks run:
#  "one_stream":  all ranks in each launch (grid.y), one launch after the other, as the engine runs
#                 virtual ranks on one GPU: a receiver's flags are all set before it starts;
#  "rank_streams": each rank's launches on a stream of its own, the streams at once (as ranks in
#                 processes of their own, each on its GPU): a rank's receive runs while other ranks
#                 still send, its spins waiting on their flags;
#  "recv_first":  the receive launch of all ranks on one stream and the send launch on another, the
#                 receive queued first: every receiver waits on flags the senders set while it spins.
LL_MODES = ("one_stream", "rank_streams", "recv_first")


def _ll_launch(kernels, placement, xs, idxs, ws, max_tokens: int, hidden: int, reverse: int,
               mode: str = "one_stream"):
    """Low-latency dispatch then combine of every virtual rank through the bindings (one buffer per
    rank in host memory, as ep_comm/engines/low_latency.py lays them out), launched as `mode` says
    (LL_MODES): per rank the dispatch's (recv_x, count, src_info, layout_range) and the combined
    [N, H] bf16 rows, with every expert's output its received rows scaled by (1 + local expert)."""
    from ep_comm.engines.runtime import TimeoutRecord, host_module

    r, k, e = placement.num_ranks, idxs[0].shape[1], placement.num_experts
    max_local = int(placement.num_local_experts.max())
    lay = host_module().routing_low_latency_layout(r, max_local, e, max_tokens, k, hidden)
    buffers = [torch.zeros(int(lay["total_bytes"]), dtype=torch.uint8) for _ in range(r)]
    e2r, e2l = placement.expert_to_rank.to(torch.int32), placement.expert_to_local.to(torch.int32)
    common = {"peers": [b.data_ptr() for b in buffers], "symmetric_base": None, "expert_to_rank": e2r.data_ptr(),
              "expert_to_local": e2l.data_ptr(), "num_ranks": r, "num_experts": e, "max_local_experts": max_local,
              "num_topk": k, "max_tokens": max_tokens, "hidden": hidden, "timeout_ns": 10**9}
    records = [TimeoutRecord() for _ in range(r)]
    outs = []
    for rank in range(r):
        local = int(placement.num_local_experts[rank])
        outs.append({"recv_x": torch.zeros(local, r * max_tokens, hidden, dtype=torch.bfloat16),
                     "count": torch.full((local,), -1, dtype=torch.int32),
                     "src_info": torch.full((local, r * max_tokens), -1, dtype=torch.int32),
                     "topk_slot": torch.full((local, r * max_tokens), -1, dtype=torch.int32),
                     "layout_range": torch.full((local, r, 2), -1, dtype=torch.int64),
                     "combined": torch.full((idxs[rank].shape[0], hidden), 7.0, dtype=torch.bfloat16)})

    def rank_args(rank: int, x: torch.Tensor) -> dict:
        o = outs[rank]

        def p(t):
            return t.data_ptr() if t.numel() else None
        return {"rank": rank, "num_tokens": idxs[rank].shape[0],
                "num_local_experts": int(placement.num_local_experts[rank]), "x": p(x),
                "topk_idx": p(idxs[rank]), "topk_weights": p(ws[rank]), "recv_x": p(o["recv_x"]), "recv_scales": None,
                "recv_count": p(o["count"]), "recv_src_info": p(o["src_info"]),
                "recv_topk_slot": p(o["topk_slot"]), "layout_range": p(o["layout_range"]),
                "combined_x": p(o["combined"]), "record": records[rank].ptr}

    def phase(send, recv, rows: list[torch.Tensor], *flags) -> None:
        """send then recv, launched as `mode` says."""
        if mode == "one_stream":
            send(common, [rank_args(i, rows[i]) for i in range(r)], *flags, 0)
            recv(common, [rank_args(i, rows[i]) for i in range(r)], *flags, 0)
        elif mode == "rank_streams":
            kernels.begin_streams()
            for i in range(r):
                send(common, [rank_args(i, rows[i])], *flags, i + 1)
                recv(common, [rank_args(i, rows[i])], *flags, i + 1)
            kernels.run_streams()
        else:
            kernels.begin_streams()
            recv(common, [rank_args(i, rows[i]) for i in range(r)], *flags, 1)
            send(common, [rank_args(i, rows[i]) for i in range(r)], *flags, 2)
            kernels.run_streams()
        for record in records:
            record.check()

    _emulated_device(kernels, 8, reverse)
    phase(kernels.low_latency_dispatch_send, kernels.low_latency_dispatch_recv, xs, False, False, False)
    ys = []
    for o in outs:
        scale = torch.arange(1, o["recv_x"].shape[0] + 1, dtype=torch.float32).view(-1, 1, 1)
        ys.append((o["recv_x"].float() * scale).to(torch.bfloat16).contiguous())
    phase(kernels.low_latency_combine_send, kernels.low_latency_combine_recv, ys)
    return outs, ys


@pytest.mark.parametrize("mode", LL_MODES)
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("num_ranks,tokens,hidden,topk", [(2, 9, 256, 3), (4, 6, 384, 8), (8, 3, 128, 10)])
def test_low_latency_dispatch_and_combine_match_the_reference(kernels, mode, reverse, num_ranks, tokens, hidden,
                                                              topk):
    """bf16 payload; top-8 takes combine_recv's register path, top-10 its shared-memory path; with
    receivers running while the senders send ("rank_streams", "recv_first"), their spins wait on the
    senders' releases (removing the __syncwarp before dispatch_send's count publish, or the
    __syncthreads before combine_send's flags, makes those modes fail)."""
    # rank 0 sends 100 tokens (4 windows of 32): with a stream per rank the others receive while it sends
    placement, xs, idxs, ws = _case(num_ranks, tokens, hidden, topk, 3, seed=num_ranks * 10 + reverse,
                                    first_tokens=100)
    max_tokens = 100
    outs, ys = _ll_launch(kernels, placement, xs, idxs, ws, max_tokens, hidden, reverse, mode)
    want = reference.low_latency_dispatch(xs, idxs, max_tokens, placement)
    for rank, (o, ref) in enumerate(zip(outs, want)):
        assert o["count"].tolist() == ref.count, rank
        assert torch.equal(o["layout_range"], ref.layout_range(num_ranks)), rank
        for j, slots in enumerate(ref.slots):
            n = len(slots)
            assert torch.equal(o["recv_x"][j, :n], ref.x[j, :n]), (rank, j)
            assert o["src_info"][j, :n].tolist() == [t for _, t in slots], (rank, j)
    combined = reference.low_latency_combine(ys, want, idxs, ws, placement)
    for rank, o in enumerate(outs):
        assert torch.equal(o["combined"], combined[rank]), rank


@pytest.mark.parametrize("reverse", [0, 1])
def test_low_latency_receivers_wait_for_a_sender_that_never_sends(kernels, reverse):
    """A rank whose send launch is missing: the others' receive launches, run with the senders on
    their streams, stall on its flag and fail with the stall report naming the spinning blocks."""
    placement, xs, idxs, ws = _case(2, 5, 128, 2, 2, seed=71)
    num_ranks = placement.num_ranks
    from ep_comm.engines.runtime import TimeoutRecord, host_module

    records = [TimeoutRecord() for _ in range(num_ranks)]
    max_local = int(placement.num_local_experts.max())
    lay = host_module().routing_low_latency_layout(num_ranks, max_local, placement.num_experts, 8, 2, 128)
    buffers = [torch.zeros(int(lay["total_bytes"]), dtype=torch.uint8) for _ in range(num_ranks)]
    e2r, e2l = placement.expert_to_rank.to(torch.int32), placement.expert_to_local.to(torch.int32)
    common = {"peers": [b.data_ptr() for b in buffers], "symmetric_base": None, "expert_to_rank": e2r.data_ptr(),
              "expert_to_local": e2l.data_ptr(), "num_ranks": num_ranks, "num_experts": placement.num_experts,
              "max_local_experts": max_local, "num_topk": 2, "max_tokens": 8, "hidden": 128,
              "timeout_ns": 10**9}
    recv = [torch.zeros(max_local, num_ranks * 8, 128, dtype=torch.bfloat16) for _ in range(num_ranks)]
    meta = [torch.zeros(max_local, num_ranks * 8, dtype=torch.int32) for _ in range(2 * num_ranks)]
    ranges = [torch.zeros(max_local, num_ranks, 2, dtype=torch.int64) for _ in range(num_ranks)]
    counts = [torch.zeros(max_local, dtype=torch.int32) for _ in range(num_ranks)]

    def args(rank):
        return {"rank": rank, "num_tokens": idxs[rank].shape[0],
                "num_local_experts": int(placement.num_local_experts[rank]),
                "x": xs[rank].data_ptr() if xs[rank].numel() else None,
                "topk_idx": idxs[rank].data_ptr() if idxs[rank].numel() else None,
                "topk_weights": None, "recv_x": recv[rank].data_ptr(), "recv_scales": None,
                "recv_count": counts[rank].data_ptr(), "recv_src_info": meta[2 * rank].data_ptr(),
                "recv_topk_slot": meta[2 * rank + 1].data_ptr(), "layout_range": ranges[rank].data_ptr(),
                "combined_x": None, "record": records[rank].ptr}

    _emulated_device(kernels, 8, reverse)
    kernels.begin_streams()
    kernels.low_latency_dispatch_send(common, [args(0)], False, False, False, 1)  # rank 1 never sends
    kernels.low_latency_dispatch_recv(common, [args(0), args(1)], False, False, False, 2)
    with pytest.raises(RuntimeError, match="stall") as info:
        kernels.run_streams()
    assert "a flag they wait for is never released" in str(info.value)
    assert "of launch 1" in str(info.value)


def test_engine_copy_choice(kernels):
    placement = ExpertPlacement.contiguous(4, 2)
    assert _engine(kernels, placement, 2, 2, 64, 1, 8, copy=None).copy == "direct"  # virtual ranks
    with pytest.raises(ValueError, match="copy must be 'ring' or 'direct'"):
        _engine(kernels, placement, 2, 2, 64, 1, 8, copy="rings")
    with pytest.raises(ValueError, match="must be a CUDA device"):
        IntranodeEngine(2, placement, torch.device("cpu"), 2, 128)  # the CPU needs the emulated kernels
