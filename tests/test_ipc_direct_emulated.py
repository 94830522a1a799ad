"""The intranode direct copy between the processes of a group (ep_comm/engines/intranode.py with
``group=`` and ``copy="direct"``) on the CPU: 2 and 4 gloo rank processes run the real bindings
(csrc/cuda_bindings/peer_kernels.cpp) over the kernels built through the CUDA emulation, their peer
buffers and per-call tensors mapped between the processes by a host-memory stand-in for CUDA IPC
(tests/support/shm_ipc.py), the notify's cross-process barrier (and the rings of the fallback)
spinning on flags the other processes set (the emulation's external-peers mode, csrc/emulation/
grid.h). Dispatch and combine are bit-exact against ep_comm/reference.py; a call where one rank's
combine input cannot be exported runs through the rings on every rank and is still exact; a rank
that cannot map a peer's tensors makes every rank raise, naming it; the import cache maps each peer
allocation once across calls and closes the mappings it evicts."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from support.native import compiler

from ep_comm import reference
from ep_comm.engines.cuda_ipc import IpcImportCache
from ep_comm.engines.intranode import IntranodeEngine
from ep_comm.placement import ExpertPlacement

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler")

EXTERNAL_PEERS_S = 60.0  # real time an idle emulated grid waits for another process's flag
LATE_S = 0.3  # rank 0 starts each call this late: the others' barriers wait for it in real time


@pytest.fixture(scope="module")
def kernels_file(request, tmp_path_factory) -> str:
    """The peer-kernel bindings over the emulated kernels (built once, kept in pytest's cache): the
    path the rank processes import them from."""
    from support.emulated_cuda import cached_peer_module

    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    module = cached_peer_module(cache.mkdir("ep_emulated_peer") if cache is not None
                                else tmp_path_factory.mktemp("ep_emulated_peer"))
    return module.__file__


@pytest.fixture
def shm_dir():
    """A directory on tmpfs for the stand-in's shared files, removed after the test."""
    path = tempfile.mkdtemp(prefix="ep_ipc_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _case(num_ranks: int, tokens: int, hidden: int, topk: int, seed: int, dtype: torch.dtype):
    """Every rank's inputs (the same in every process): random routing with dropped entries; with more
    than 2 ranks, rank 1 has no tokens and the last rank no experts."""
    gen = torch.Generator().manual_seed(seed)
    e = 2 * num_ranks
    owning = num_ranks - 1 if num_ranks > 2 else num_ranks
    owners = torch.randint(0, owning, (e,), generator=gen)
    owners[:owning] = torch.arange(owning)
    placement = ExpertPlacement.from_expert_to_rank(owners, num_ranks)
    xs, idxs, ws = [], [], []
    for r in range(num_ranks):
        n = 0 if r == 1 and num_ranks > 2 else tokens + 3 * r
        xs.append(torch.randn(n, hidden, generator=gen).to(dtype))
        idx = (torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(n)]) if n
               else torch.empty(0, topk, dtype=torch.int64))
        idx[torch.rand(n, topk, generator=gen) < 0.15] = -1
        idxs.append(idx)
        ws.append(torch.rand(n, topk, generator=gen))
    return placement, xs, idxs, ws


def _setup(kernels_file: str, shm_dir: str, group, placement, topk: int, row_bytes: int, channels: int,
           segment_bytes: int = 1 << 20):
    from support.emulated_cuda import import_peer_module
    from support.shm_ipc import ShmIpc

    kernels = import_peer_module(Path(kernels_file))
    kernels.set_schedule(0)
    kernels.set_device(channels, 2)  # a rank's 2 * channels ring blocks co-resident
    kernels.set_resident_limit(0)
    kernels.set_stall_failure(1)
    kernels.set_external_peers(EXTERNAL_PEERS_S)
    api = ShmIpc(shm_dir, segment_bytes)
    engine = IntranodeEngine(0, placement, torch.device("cpu"), topk, row_bytes, num_channels=channels,
                             ring_slots=8, timeout_s=60.0, group=group, kernels=kernels, copy="direct",
                             ipc_api=api)
    return kernels, api, engine


def _teardown(kernels, api, engine, failed: bool) -> None:
    """Closes the engine (collective) unless the task failed on this rank: then the others may be in
    another collective, so only this process's memory and settings are released."""
    if not failed:
        engine.close()
    api.close()
    kernels.set_external_peers(0.0)
    kernels.set_stall_failure(0)


def _round_trip(rank: int, engine, api, case, plain_x: bool, late: bool = False) -> dict:
    """One dispatch and one combine of this rank's part of `case`; what differs from the reference.
    The expert outputs are the reference's received rows scaled by their rank (a row summed into the
    wrong token shows), in a tensor of the stand-in's memory unless `plain_x` (then not exportable).
    `late`: rank 0 starts the dispatch and the combine LATE_S after the others."""
    placement, xs, idxs, ws = case
    want = reference.dispatch(xs, idxs, ws, placement)
    if late and rank == 0:
        time.sleep(LATE_S)
    out = engine.dispatch([xs[rank]], [idxs[rank]], [ws[rank]], threads=64)[0]
    ref = want[rank]
    bad = [name for name, got, exp in (
        ("recv_x", out["recv_x"], ref.x), ("recv_topk_idx", out["recv_topk_idx"], ref.topk_idx),
        ("recv_topk_weights", out["recv_topk_weights"], ref.topk_weights),
        ("recv_src_idx", out["recv_src_idx"].long(), ref.src_idx)) if not torch.equal(got, exp)]
    if out["num_recv_tokens_per_expert"] != ref.counts_per_expert:
        bad.append("num_recv_tokens_per_expert")
    dispatch_copy = engine.last_copy
    ys = [(w.x.float() * (1 + r)).to(xs[0].dtype) for r, w in enumerate(want)]
    y = ys[rank].clone() if plain_x else api.empty(tuple(ys[rank].shape), ys[rank].dtype).copy_(ys[rank])
    if late and rank == 0:
        time.sleep(LATE_S)
    cx, cw = engine.combine([y], [out["handle"]], [out["recv_topk_weights"]])[0]
    counts = [x.shape[0] for x in xs]
    if not torch.equal(cx, reference.combine(ys, want, counts)[rank]):
        bad.append("combined_x")
    if not torch.equal(cw, reference.combine([w.topk_weights for w in want], want, counts)[rank]):
        bad.append("combined_topk_weights")
    return {"bad": bad, "copies": (dispatch_copy, engine.last_copy), "rows": out["recv_x"].shape[0]}


def _exact(rank, world, group, kernels_file, shm_dir, dtype, seed):
    case = _case(world, 21, 264, 3, seed, dtype)
    kernels, api, engine = _setup(kernels_file, shm_dir, group, case[0], 3, 264 * case[1][0].element_size(), 2)
    failed = True
    try:
        result = _round_trip(rank, engine, api, case, plain_x=False, late=True)
        failed = False
    finally:
        _teardown(kernels, api, engine, failed)
    return result


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_direct_copy_between_processes_matches_the_reference(ranks, kernels_file, shm_dir, world, dtype):
    """Every rank writes its rows into the others' outputs and reads the returned rows from their x,
    all mapped per call; on 4 ranks rank 1 sends nothing and the last rank receives nothing."""
    results = ranks(world, _exact, kernels_file, shm_dir, dtype, 7 * world)
    for rank, res in enumerate(results):
        assert res["bad"] == [], (rank, res)
        assert res["copies"] == ("direct", "direct"), (rank, res)
    assert (results[-1]["rows"] == 0) == (world > 2) and all(r["rows"] > 0 for r in results[:-1])


def _fallback(rank, world, group, kernels_file, shm_dir):
    case = _case(world, 17, 128, 2, 11, torch.bfloat16)
    kernels, api, engine = _setup(kernels_file, shm_dir, group, case[0], 2, 256, 2)
    failed = True
    try:
        refused = _round_trip(rank, engine, api, case, plain_x=(rank == 0), late=True)
        refusal = engine.exchange.last_refusal
        again = _round_trip(rank, engine, api, case, plain_x=False)  # the next call is direct again
        failed = False
    finally:
        _teardown(kernels, api, engine, failed)
    return refused, refusal, again


def test_a_rank_that_cannot_export_sends_every_rank_through_the_rings(ranks, kernels_file, shm_dir):
    """Rank 0's combine input is plain memory, which the stand-in cannot export (as CUDA IPC cannot
    export torch's expandable segments): that combine runs through the rings on every rank."""
    for rank, (refused, refusal, again) in enumerate(ranks(2, _fallback, kernels_file, shm_dir)):
        assert refused["bad"] == [] and again["bad"] == [], rank
        assert refused["copies"] == ("direct", "ring"), rank
        assert again["copies"] == ("direct", "direct"), rank
        assert ("cudaIpcGetMemHandle failed" in refusal) == (rank == 0), refusal


def _reuse(rank, world, group, kernels_file, shm_dir, segment_bytes, rounds):
    case = _case(world, 13, 128, 2, 5, torch.bfloat16)
    kernels, api, engine = _setup(kernels_file, shm_dir, group, case[0], 2, 256, 1, segment_bytes)
    opens, bad, failed = [], [], True
    try:
        for _ in range(rounds):
            bad += _round_trip(rank, engine, api, case, plain_x=False)["bad"]
            opens.append(api.opens)
        mapped, cached, evicted = api.open_count, len(engine.exchange.imports), api.closes
        failed = False
    finally:
        _teardown(kernels, api, engine, failed)
    return {"bad": bad, "opens": opens, "evicted": evicted, "closes": api.closes, "mapped": mapped,
            "cached": cached, "left_open": api.open_count}


def test_the_import_cache_maps_each_allocation_once(ranks, kernels_file, shm_dir):
    """Tensors carved from one segment share its handle: later calls open nothing new."""
    for rank, res in enumerate(ranks(2, _reuse, kernels_file, shm_dir, 1 << 20, 3)):
        assert res["bad"] == [], rank
        # the peer buffer, then its segment: nothing opened after the first call
        assert res["opens"] == [2, 2, 2], (rank, res)
        assert res["evicted"] == 0 and res["closes"] == 2 and res["left_open"] == 0, (rank, res)


def test_the_import_cache_closes_the_mappings_it_evicts(ranks, kernels_file, shm_dir):
    """Every tensor in a segment of its own: each call maps new allocations, the cache keeps the 64
    most recent and closes the rest, and every result stays exact."""
    for rank, res in enumerate(ranks(2, _reuse, kernels_file, shm_dir, 256, 12)):
        assert res["bad"] == [], rank
        opened = res["opens"][-1]
        assert opened > 64 + 1, (rank, res)  # + the peer buffer, mapped apart from the cache
        assert res["cached"] == 64 and res["mapped"] == 64 + 1, (rank, res)
        assert res["evicted"] == opened - 64 - 1, (rank, res)
        assert res["closes"] == opened and res["left_open"] == 0, (rank, res)


def _import_fails(rank, world, group, kernels_file, shm_dir):
    case = _case(world, 9, 128, 2, 3, torch.bfloat16)
    kernels, api, engine = _setup(kernels_file, shm_dir, group, case[0], 2, 256, 1)
    failed = True
    try:
        if rank == 1:  # the peer buffer is mapped; the tensors of a call cannot be
            def refuse(handle: bytes) -> int:
                raise RuntimeError("cudaIpcOpenMemHandle failed: cudaErrorMapBufferObjectFailed (205)")
            api.open_handle = refuse
        placement, xs, idxs, ws = case
        try:
            engine.dispatch([xs[rank]], [idxs[rank]], [ws[rank]], threads=64)
            message = ""
        except RuntimeError as error:
            message = str(error)
        failed = False
    finally:
        _teardown(kernels, api, engine, failed)
    return message


def test_a_failed_import_raises_on_every_rank(ranks, kernels_file, shm_dir):
    """Rank 1 cannot map rank 0's outputs after the exchange: both ranks raise, naming rank 1."""
    messages = ranks(2, _import_fails, kernels_file, shm_dir)
    assert all("the direct copy failed on rank(s) [1]" in m for m in messages), messages
    assert "cudaIpcOpenMemHandle failed" in messages[1], messages


# -- without processes -----------------------------------------------------------------------------
class _CountingApi:
    def __init__(self) -> None:
        self.opened: dict[int, bytes] = {}
        self.closed: list[bytes] = []
        self.next = 0x1000

    def open_handle(self, handle: bytes) -> int:
        self.next += 0x1000
        self.opened[self.next] = handle
        return self.next

    def close_handle(self, ptr: int) -> None:
        self.closed.append(self.opened.pop(ptr))


def test_import_cache_is_least_recently_used_first_out() -> None:
    api = _CountingApi()
    cache = IpcImportCache(api, capacity=48)
    handles = [bytes([i]) * 64 for i in range(50)]
    first = cache.address(handles[0], 16)
    for h in handles[1:48]:
        cache.address(h, 0)
    assert cache.address(handles[0], 32) == first + 16  # a hit: same mapping, refreshed
    cache.address(handles[48], 0)
    cache.address(handles[49], 0)
    assert api.closed == [handles[1], handles[2]] and len(cache) == 48 and cache.opens == 50
    cache.close()
    assert not api.opened and len(cache) == 0
    with pytest.raises(ValueError, match="capacity"):
        IpcImportCache(api, capacity=8)


def test_direct_launch_refuses_bad_entries(kernels_file) -> None:
    """The bindings refuse a local range outside the entries and a set without every rank."""
    from support.emulated_cuda import import_peer_module

    kernels = import_peer_module(Path(kernels_file))
    common = {"peers": [0, 0], "expert_to_rank": None, "expert_to_local": None, "num_ranks": 2,
              "num_channels": 1, "max_local_experts": 1, "num_experts": 2, "num_topk": 1, "ring_slots": 8,
              "row_bytes": 256, "timeout_ns": 1, "barrier_value": 1}
    remote = {"rank": 1, "meta": None, "x": None, "topk_weights": None}
    local = dict(remote, rank=0, num_tokens=0, is_token_in_rank=None, combined_x=None,
                 combined_topk_weights=None, record=None)
    with pytest.raises(ValueError, match="local_begin 2"):
        kernels.intranode_combine_direct(common, [local, remote], 128, 0, 0, 2, 1)
    with pytest.raises(ValueError, match="num_local 2 from local_begin 1"):
        kernels.intranode_combine_direct(common, [local, remote], 128, 0, 0, 1, 2)
    with pytest.raises(ValueError, match="missing field: num_tokens"):
        kernels.intranode_combine_direct(common, [remote, dict(remote, rank=0)], 128, 0, 0, 1, 1)
    with pytest.raises(RuntimeError, match="an entry for every rank"):
        kernels.intranode_combine_direct(common, [remote, local], 128, 0, 0, 1, 1)
    with pytest.raises(RuntimeError, match="an entry for every rank"):
        kernels.intranode_combine_direct(common, [local], 128, 0, 0, 0, 1)


def test_ipc_api_needs_a_group() -> None:
    placement = ExpertPlacement.from_expert_to_rank(torch.tensor([0, 1]), 2)
    with pytest.raises(ValueError, match="ipc_api"):
        IntranodeEngine(2, placement, torch.device("cpu"), 1, 256, kernels=object(), ipc_api=object())
