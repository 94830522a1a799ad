"""The two-hop kernel path of a node-aware Buffer (``ep_comm/paths/two_hop.py``) on the CPU:

- ``hierarchical.exchange_node_plan``, run by 4 gloo ranks (the per-process plan a
  ``TwoHopEngine`` with one PE per process launches with), equals the virtual-rank plan
  (``virtual_node_plans``) field by field, and so do the kernel index arrays
  (``two_hop_arrays``) built from it; a broken exchange (mask rows swapped) is caught;
- the per-call choice (``TwoHopKernelPath.dispatch_reason`` / ``combine_reason``), the
  construction-time choice (``TwoHopKernelPath.decide``) and the engine capacity rounding;
- argument checks of ``TwoHopEngine`` that run before any GPU work, and Buffer's
  ``backend="nvshmem"`` + ``ranks_per_node`` on a machine without CUDA.
"""
from __future__ import annotations

import types

import pytest
import torch
from support.rank_cases import make_routing

import ep_comm
from ep_comm.engines import two_hop_arrays
from ep_comm.handle import DispatchState
from ep_comm.hierarchical import exchange_node_plan
from ep_comm.layout import compute_dispatch_layout
from ep_comm.paths import CombineCall, DispatchCall, TwoHopKernelPath
from ep_comm.paths.two_hop import MIN_TWO_HOP_CAPACITY, TwoHopKernelHandle, two_hop_capacity
from ep_comm.placement import ExpertPlacement
from ep_comm.plan import build_send_plan, virtual_node_plans
from ep_comm.transports.torch_dist import TorchDistTransport

SHAPES = [(2, 2), (4, 1), (1, 4)]


def _routes(world: int, seed: int, experts: int = 16, topk: int = 3):
    gen = torch.Generator().manual_seed(seed)
    tokens = [int(n) for n in torch.randint(0, 25, (world,), generator=gen)]
    tokens[seed % world] = 0  # one rank without tokens
    placement = ExpertPlacement.contiguous(experts, world)
    masks = [compute_dispatch_layout(make_routing(r, seed, n, experts, topk, 0.3)[0], placement).is_token_in_rank
             for r, n in enumerate(tokens)]
    return tokens, masks


def _plan_fields(plan) -> list[torch.Tensor]:
    return [plan.rail_plan.token_index, plan.rail_plan.send_counts, plan.rail_recv_counts,
            plan.forward_plan.token_index, plan.forward_plan.send_counts, plan.node_recv_counts,
            plan.recv_order]


def _exchange_case(rank: int, world: int, group, per_node: int, seed: int, corrupt: bool):
    from ep_comm.transports.node_groups import create_node_transports

    tokens, masks = _routes(world, seed)
    flat = TorchDistTransport(group, 30.0, torch.device("cpu"), f"two_hop_path/{per_node}/{seed}")
    groups = create_node_transports(group, per_node, 30.0, torch.device("cpu"), f"two_hop_path/{per_node}/{seed}")
    mask = masks[rank]
    if corrupt and rank == 0 and mask.shape[0] > 1:  # a wrong layout must give another plan
        mask = mask.flip(0)
    got = exchange_node_plan(flat, groups, mask)
    want = virtual_node_plans(masks, per_node)[rank]
    same_plan = all(torch.equal(a, b) for a, b in zip(_plan_fields(got.plan), _plan_fields(want)))
    rows = max(tokens + [1])
    h_got, d_got = two_hop_arrays(got.plan, tokens[rank], rows, (world // per_node) * rows, torch.device("cpu"))
    h_want, d_want = two_hop_arrays(want, tokens[rank], rows, (world // per_node) * rows, torch.device("cpu"))
    same_arrays = all(torch.equal(d_got[k], d_want[k]) for k in d_want) and all(
        torch.equal(getattr(h_got, k), getattr(h_want, k))
        for k in ("ret_row", "ret_offsets", "rail_offsets", "red_offsets", "red_stage_row", "src_offsets",
                  "src_stage_row"))
    recv_counts = torch.stack([build_send_plan(m).send_counts[rank] for m in masks])
    return (same_plan, same_arrays, got.tokens_per_rank.tolist() == tokens,
            torch.equal(got.recv_counts, recv_counts), flat.num_collectives + groups.num_collectives)


@pytest.mark.parametrize("nodes,per_node", SHAPES)
def test_exchanged_plan_equals_virtual_plan(ranks, nodes: int, per_node: int) -> None:
    for seed in (3, 4):
        for rank, (same_plan, same_arrays, tokens_ok, recv_ok, collectives) in enumerate(
                ranks(nodes * per_node, _exchange_case, per_node, seed, False)):
            assert same_plan, f"rank {rank}: exchanged plan differs from the virtual-rank plan"
            assert same_arrays, f"rank {rank}: kernel arrays differ"
            assert tokens_ok and recv_ok, f"rank {rank}: token or receive counts wrong"
            assert collectives == 3, f"rank {rank}: {collectives} collectives, expected 3"


def test_exchanged_plan_sees_a_wrong_layout(ranks) -> None:
    results = ranks(4, _exchange_case, 2, 5, True)
    assert not all(same_plan for same_plan, *_ in results)


# -- per-call and construction-time choices -----------------------------------------------------
def _x(n: int = 4, h: int = 16, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.zeros(n, h, dtype=dtype)


def _path(generation: int = 0, row_bytes: int = 0) -> TwoHopKernelPath:
    """A path whose engine is at ``generation`` with rows of up to ``row_bytes`` (0: none made)."""
    path = TwoHopKernelPath(None, torch.device("cpu"), None, None, 2, 1.0, 1)
    path.generation = generation
    if row_bytes:
        path.engine = types.SimpleNamespace(row_bytes=row_bytes)  # the one engine fact the choice reads
    return path


def two_hop_dispatch_reason(x, topk_idx, topk_weights, codec, masked):
    mask = torch.zeros(4, 2, dtype=torch.bool)
    call = DispatchCall(x, topk_idx, topk_weights, mask, ExpertPlacement.contiguous(4, 2), codec, masked, 20)
    return _path().dispatch_reason(call)


def two_hop_combine_reason(handle, x, topk_weights, num_biases, codec, masked, generation, row_bytes):
    call = CombineCall(handle, x, topk_weights, (x,) * num_biases, codec, masked)
    return _path(generation, row_bytes).combine_reason(call)


def test_dispatch_reason() -> None:
    idx, w = torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2)
    assert two_hop_dispatch_reason(_x(), idx, w, "none", False) is None
    assert two_hop_dispatch_reason(_x(4, 5, torch.float64), idx, None, "none", False) is None  # any row size
    assert "masked" in two_hop_dispatch_reason(_x(), idx, w, "none", True)
    assert "codec" in two_hop_dispatch_reason(_x(), idx, w, "lossless", False)
    assert "FP8" in two_hop_dispatch_reason((_x(), torch.zeros(4, 1)), idx, w, "none", False)
    assert "topk_idx" in two_hop_dispatch_reason(_x(), None, None, "none", False)
    assert "num_topk" in two_hop_dispatch_reason(_x(), torch.zeros(4, 0, dtype=torch.int64), None, "none", False)
    assert "float32" in two_hop_dispatch_reason(_x(), idx, w.double(), "none", False)


def _handle(kernel: object) -> DispatchState:
    mask = torch.zeros(4, 2, dtype=torch.bool)
    return DispatchState(buffer_id=1, send_plan=build_send_plan(mask), recv_counts=torch.zeros(2, dtype=torch.int64),
                          is_token_in_rank=mask, num_tokens=4, num_recv_tokens=4, num_worst_tokens=0, hidden=16,
                          num_experts=4, recv_src_token_index=torch.zeros(4, dtype=torch.int64), kernel=kernel)


def test_combine_reason() -> None:
    h = _handle(TwoHopKernelHandle(2, None, 2))
    w = torch.zeros(4, 2)
    assert two_hop_combine_reason(h, _x(), w, 0, "none", False, 2, 64) is None
    assert two_hop_combine_reason(h, _x(dtype=torch.float32), None, 0, "none", False, 2, 64) is None
    assert "masked" in two_hop_combine_reason(h, _x(), w, 0, "none", True, 2, 64)
    assert "engine" in two_hop_combine_reason(h, _x(), w, 0, "none", False, 3, 64)
    assert "engine" in two_hop_combine_reason(_handle(None), _x(), w, 0, "none", False, 2, 64)
    assert "codec" in two_hop_combine_reason(h, _x(), w, 0, "lossless", False, 2, 64)
    assert "bias" in two_hop_combine_reason(h, _x(), w, 1, "none", False, 2, 64)
    assert "sums" in two_hop_combine_reason(h, _x(dtype=torch.float64), w, 0, "none", False, 2, 64)
    assert "float32" in two_hop_combine_reason(h, _x(), w.double(), 0, "none", False, 2, 64)
    # 16 bf16 = 32 bytes + 2 weights = 48 bytes: fits 48, not 32
    assert two_hop_combine_reason(h, _x(), w, 0, "none", False, 2, 48) is None
    assert "exceed" in two_hop_combine_reason(h, _x(), w, 0, "none", False, 2, 32)


def test_construction_decision_and_capacity() -> None:
    decide = TwoHopKernelPath.decide
    assert decide(True, "cuda", 2, [True] * 4) is None
    assert "NVSHMEM" in decide(False, "cuda", 2, [True] * 4)
    assert "cpu" in decide(True, "cpu", 2, [True] * 4)
    assert "at most 8" in decide(True, "cuda", 16, [True] * 16)
    assert "[1, 3]" in decide(True, "cuda", 2, [True, False, True, False])
    assert two_hop_capacity(0) == two_hop_capacity(1) == MIN_TWO_HOP_CAPACITY
    assert two_hop_capacity(MIN_TWO_HOP_CAPACITY + 1) == 2 * MIN_TWO_HOP_CAPACITY
    assert two_hop_capacity(1000) == 1024 and two_hop_capacity(1024) == 1024


# -- argument checks ----------------------------------------------------------------------------
def _engine_args(rank: int, world: int, group):
    from ep_comm.engines import TwoHopEngine

    placement = ExpertPlacement.contiguous(8, 4)
    errors = []
    for kwargs in (dict(num_ranks=4, ranks_per_node=2),     # group of 2 processes, 4 ranks
                   dict(num_ranks=2, ranks_per_node=9),     # more than 8 per node
                   dict(num_ranks=2, ranks_per_node=3),     # does not divide
                   dict(num_ranks=2, ranks_per_node=1, max_tokens=0)):
        args = dict(placement=placement if kwargs["num_ranks"] == 4 else ExpertPlacement.contiguous(8, 2),
                    device=torch.device("cpu"), group=group, max_tokens=8, max_x_bytes=64, num_topk=2)
        args.update(kwargs)
        try:
            TwoHopEngine(**args)
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_engine_argument_checks(ranks) -> None:
    for errors in ranks(2, _engine_args):
        assert len(errors) == 4, errors
        assert "group has 2 processes" in errors[0]
        assert all("ranks_per_node" in e for e in errors[1:3]) and "max_tokens" in errors[3]


def _buffer_nvshmem_node_aware(rank: int, world: int, group):
    try:
        ep_comm.Buffer(group, backend="nvshmem", ranks_per_node=2)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_buffer_nvshmem_node_aware_needs_cuda(ranks) -> None:
    for message in ranks(4, _buffer_nvshmem_node_aware):
        assert "nvshmem" in message and "CUDA" in message, message


# -- the engine's host code (packing, unpacking) around a replay of the kernels -----------------
def _host_engine(rank: int, nodes: int, per_node: int, placement: ExpertPlacement, max_tokens: int,
                 x_bytes: int, num_topk: int):
    """A one-PE-per-process ``TwoHopEngine`` without NVSHMEM: only the attributes its host code
    reads (the launches are replayed in Python by the test)."""
    from ep_comm.engines import TimeoutRecord, TwoHopEngine, TwoHopRows

    eng = object.__new__(TwoHopEngine)
    eng.per_process, eng.rank, eng.device = True, rank, torch.device("cpu")
    eng.num_ranks, eng.ranks_per_node, eng.num_nodes = nodes * per_node, per_node, nodes
    eng.placement, eng.max_tokens, eng.num_topk = placement, max_tokens, num_topk
    eng.row_bytes = TwoHopRows(x_bytes, num_topk).payload_bytes
    eng.layout = {"rail_rows": max_tokens, "node_rows": nodes * max_tokens}
    eng.peers, eng.records = [1] * per_node, [TimeoutRecord()]
    return eng


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (4, 1), (1, 4)])
def test_per_process_host_code_matches_reference(nodes: int, per_node: int) -> None:
    from ep_comm import reference
    from ep_comm.engines import TwoHopRows

    world, experts, k, hidden, seed = nodes * per_node, 16, 3, 24, 9
    placement = ExpertPlacement.contiguous(experts, world)
    tokens = [int(n) for n in torch.randint(0, 20, (world,), generator=torch.Generator().manual_seed(seed))]
    routes = [make_routing(r, seed, n, experts, k, 0.3) for r, n in enumerate(tokens)]
    xs = [torch.randn(n, hidden, generator=torch.Generator().manual_seed(r)).bfloat16() for r, n in enumerate(tokens)]
    plans = virtual_node_plans([compute_dispatch_layout(i, placement).is_token_in_rank for i, _ in routes], per_node)
    cap = max(tokens + [1])
    fmt = TwoHopRows(hidden * 2, k)
    pb = fmt.payload_bytes
    engines = [_host_engine(r, nodes, per_node, placement, cap, hidden * 2, k) for r in range(world)]
    entries = []
    for r, eng in enumerate(engines):
        staging = torch.full((nodes * cap * pb,), 0xAB, dtype=torch.uint8)  # stale bytes must not leak
        send = staging[:plans[r].rail_plan.num_rows * pb].view(-1, pb)
        entries.append(eng._dispatch_entry(r, plans[r], xs[r], routes[r][0], routes[r][1], fmt, send))
    # replay rail_put, forward, node_gather at the byte level
    rail = torch.zeros(world, nodes * cap, pb, dtype=torch.uint8)
    stage = torch.zeros(world, per_node * nodes * cap, pb, dtype=torch.uint8)
    for r, (_, _, (send, _, arrays)) in enumerate(entries):
        node, local = divmod(r, per_node)
        off = arrays["rail_send_offsets"]
        for g in range(nodes):
            rows = send[off[g]:off[g + 1]]
            rail[g * per_node + local, node * cap:node * cap + len(rows)] = rows
    for r, (_, _, (_, _, a)) in enumerate(entries):
        node, local = divmod(r, per_node)
        for g in range(nodes):
            for e in range(int(a["fwd_offsets"][g]), int(a["fwd_offsets"][g + 1])):
                dst = node * per_node + int(a["fwd_target"][e])
                stage[dst, local * nodes * cap + a["fwd_slot"][e]] = rail[r, g * cap + a["fwd_row"][e]]
    ref = reference.dispatch(xs, [i for i, _ in routes], [w for _, w in routes], placement)
    for r, (args, handle, (_, recv, a)) in enumerate(entries):
        assert args["num_recv_rows"] == handle.num_recv == len(ref[r].sources)
        recv.copy_(stage[r][a["recv_stage_row"]])
        got = engines[r]._unpack(r, recv, fmt, handle, torch.bfloat16, hidden, True)
        assert torch.equal(got.recv_x, ref[r].x), f"rank {r}: recv_x"
        assert torch.equal(got.recv_topk_idx, ref[r].topk_idx), f"rank {r}: topk"
        assert torch.equal(got.recv_topk_weights, ref[r].topk_weights), f"rank {r}: weights"
        assert got.recv_src_idx.tolist() == [t for _, t in ref[r].sources]
        assert got.num_recv_tokens_per_expert == ref[r].counts_per_expert


def test_per_process_engine_rejects_plans_beyond_capacity() -> None:
    placement = ExpertPlacement.contiguous(8, 4)
    masks = [torch.ones(6, 4, dtype=torch.bool) for _ in range(4)]
    plan = virtual_node_plans(masks, 2)[0]
    small = _host_engine(0, 2, 2, placement, 4, 32, 2)  # 6 tokens per node > rail_rows 4
    with pytest.raises(ValueError, match="rail_rows"):
        small._check_plan(plan)
    _host_engine(0, 2, 2, placement, 6, 32, 2)._check_plan(plan)
    with pytest.raises(ValueError, match="nodes"):
        _host_engine(0, 1, 4, placement, 6, 32, 2)._check_plan(plan)
