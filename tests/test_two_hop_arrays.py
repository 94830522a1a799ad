"""The two-hop kernels' index arrays (``engines.two_hop.two_hop_arrays``) and the virtual-rank
plans (``hierarchical.virtual_node_plans``), checked on the CPU by replaying what the kernels of
``csrc/cuda/internode_two_hop*.cu`` do with them, against ``ep_comm.reference``."""
from __future__ import annotations

import pytest
import torch
from support.rank_cases import make_routing

from ep_comm import reference
from ep_comm.engines import two_hop_arrays
from ep_comm.layout import compute_dispatch_layout
from ep_comm.placement import ExpertPlacement
from ep_comm.plan import virtual_node_plans

SHAPES = [(2, 2), (2, 4), (4, 1), (1, 4), (3, 2)]


def _setup(nodes: int, per_node: int, seed: int):
    r, e, k, hidden = nodes * per_node, 4 * nodes * per_node, 3, 8
    placement = ExpertPlacement.contiguous(e, r)
    tokens = [int(n) for n in torch.randint(0, 20, (r,), generator=torch.Generator().manual_seed(seed))]
    routes = [make_routing(rank, seed, n, e, k, 0.2) for rank, n in enumerate(tokens)]
    xs = [torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed + rank))
          for rank, n in enumerate(tokens)]
    masks = [compute_dispatch_layout(idx, placement).is_token_in_rank for idx, _ in routes]
    plans = virtual_node_plans(masks, per_node)
    rail_rows, node_rows = max(tokens + [1]), nodes * max(tokens + [1])
    arrays = [two_hop_arrays(p, n, rail_rows, node_rows, torch.device("cpu"))
              for p, n in zip(plans, tokens)]
    return placement, tokens, routes, xs, plans, arrays, rail_rows, node_rows


@pytest.mark.parametrize("nodes,per_node", SHAPES)
def test_replayed_kernels_match_reference(nodes: int, per_node: int) -> None:
    placement, tokens, routes, xs, plans, arrays, rail_rows, node_rows = _setup(nodes, per_node, 7)
    r, hidden = nodes * per_node, xs[0].shape[1]
    ref = reference.dispatch(xs, [i for i, _ in routes], [w for _, w in routes], placement)
    # dispatch: rail_put, forward, node_gather
    rail = torch.full((r, nodes * rail_rows, hidden), float("nan"))
    stage = torch.full((r, per_node * node_rows, hidden), float("nan"))
    for rank in range(r):
        node, local = divmod(rank, per_node)
        off = arrays[rank][1]["rail_send_offsets"]
        sent = xs[rank][plans[rank].rail_plan.token_index]
        for g in range(nodes):
            rows = sent[off[g]:off[g + 1]]
            rail[g * per_node + local, node * rail_rows: node * rail_rows + len(rows)] = rows
    for rank in range(r):
        node, local = divmod(rank, per_node)
        a = arrays[rank][1]
        for g in range(nodes):
            for e in range(int(a["fwd_offsets"][g]), int(a["fwd_offsets"][g + 1])):
                dst = node * per_node + int(a["fwd_target"][e])
                stage[dst, local * node_rows + a["fwd_slot"][e]] = rail[rank, g * rail_rows + a["fwd_row"][e]]
    for rank in range(r):
        got = stage[rank][arrays[rank][1]["recv_stage_row"]]
        assert torch.equal(got, ref[rank].x), f"rank {rank}: dispatched rows"
    # combine: node_return, rail_reduce, source_reduce
    ys = [torch.randn(len(ref[rank].sources), hidden) for rank in range(r)]
    stage.fill_(float("nan"))
    back = torch.full((r, nodes * rail_rows, hidden), float("nan"))
    for rank in range(r):
        node, local = divmod(rank, per_node)
        h = arrays[rank][0]
        for b in range(per_node * nodes):
            fwd = b // nodes
            first = int(h.ret_offsets[fwd * nodes])
            for i in range(int(h.ret_offsets[b]), int(h.ret_offsets[b + 1])):
                stage[node * per_node + fwd, local * node_rows + i - first] = ys[rank][h.ret_row[i]]
    for rank in range(r):
        node, local = divmod(rank, per_node)
        h = arrays[rank][0]
        partial = torch.stack([stage[rank][h.red_stage_row[h.red_offsets[s]:h.red_offsets[s + 1]]].sum(0)
                               for s in range(len(h.red_offsets) - 1)] or [torch.zeros(hidden)])
        for g in range(nodes):
            rows = partial[h.rail_offsets[g]:h.rail_offsets[g + 1]]
            back[g * per_node + local, node * rail_rows: node * rail_rows + len(rows)] = rows
    want = reference.combine(ys, ref, tokens)
    for rank in range(r):
        h = arrays[rank][0]
        got = torch.stack([back[rank][h.src_stage_row[h.src_offsets[t]:h.src_offsets[t + 1]]].sum(0)
                           for t in range(tokens[rank])] or [torch.zeros(hidden)])[:tokens[rank]]
        torch.testing.assert_close(got, want[rank], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nodes,per_node", SHAPES)
def test_sum_orders_follow_hierarchical_combine(nodes: int, per_node: int) -> None:
    """Forwarder sums run local rank ascending, source sums node ascending (hierarchical.combine),
    and every stage row index stays inside its stage."""
    _, tokens, _, _, plans, arrays, rail_rows, node_rows = _setup(nodes, per_node, 11)
    for plan, (h, d) in zip(plans, arrays):
        for s in range(len(h.red_offsets) - 1):
            rows = h.red_stage_row[h.red_offsets[s]:h.red_offsets[s + 1]]
            assert torch.equal(rows // node_rows, (rows // node_rows).sort().values)
        for t in range(h.num_tokens):
            rows = h.src_stage_row[h.src_offsets[t]:h.src_offsets[t + 1]]
            assert torch.equal(rows // rail_rows, (rows // rail_rows).sort().values)
            assert len(set((rows // rail_rows).tolist())) == len(rows)
        assert bool((d["fwd_slot"] < node_rows).all()) and bool((d["fwd_row"] < rail_rows).all())
        assert max(plan.rail_plan.send_counts.tolist() + [0]) <= rail_rows
        assert int(h.ret_offsets[-1]) == h.num_recv == int(plan.recv_order.numel())


def test_virtual_plans_reject_bad_node_size() -> None:
    with pytest.raises(ValueError):
        virtual_node_plans([torch.zeros(2, 4, dtype=torch.bool)] * 4, 3)
