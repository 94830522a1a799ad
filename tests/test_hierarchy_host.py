"""The two-hop routing helpers of csrc/common/hierarchy.h against the Python two-hop plan
(ep_comm/plan.py, ep_comm/layout.py) on random routings: the buffer layout through ep_comm._host
(ep_comm/engines/two_hop.py sizes its buffer with it), the per-token helpers through the test-only
bindings (fixture ``host_test_module``, tests/native/host_test_bindings.cpp)."""
from __future__ import annotations

import pytest
import torch

from ep_comm.layout import token_node_mask
from ep_comm.plan import NodeTopology, build_send_plan, forward_counts, node_receive_order

host = pytest.importorskip("ep_comm._host", reason="ep_comm._host is not built")
if not hasattr(host, "hier_two_hop_layout"):
    pytest.skip("ep_comm._host predates the two-hop helpers: rebuild it", allow_module_level=True)

SHAPES = [(4, 2), (4, 1), (4, 4), (8, 2), (16, 4), (6, 3), (32, 8)]


def _in_rank(gen: torch.Generator, n: int, r: int, density: float) -> torch.Tensor:
    return torch.rand(n, r, generator=gen) < density


@pytest.mark.parametrize("r,p", SHAPES)
def test_forwarding_peer_and_node_mask(r: int, p: int, host_test_module) -> None:
    topo = NodeTopology(r, p)
    for src in range(r):
        for node in range(topo.num_nodes):
            peer = host_test_module.hier_forwarding_peer(r, p, src, node)
            assert peer == topo.forwarding_peer(src, node)
            assert topo.node_of(peer) == node and topo.local_of(peer) == topo.local_of(src)
    gen = torch.Generator().manual_seed(r * 10 + p)
    for n, density in ((0, 0.3), (1, 0.9), (37, 0.2), (200, 0.05)):
        in_rank = _in_rank(gen, n, r, density)
        got = torch.from_numpy(host_test_module.hier_token_node_mask(in_rank.numpy(), p))
        assert torch.equal(got, token_node_mask(in_rank, p))


@pytest.mark.parametrize("r,p", SHAPES)
def test_forward_counts_match_plan(r: int, p: int, host_test_module) -> None:
    """A forwarder's [P, G] table from the target bits its rail peers put on each row."""
    topo = NodeTopology(r, p)
    gen = torch.Generator().manual_seed(100 + r * 10 + p)
    for forwarder in range(r):
        node = topo.node_of(forwarder)
        bits, masks, counts = [], [], []
        for _source in topo.rail_ranks(topo.local_of(forwarder)):  # rail rank g is on node g
            in_rank = _in_rank(gen, int(torch.randint(0, 40, (1,), generator=gen)), r, 0.3)
            sent = token_node_mask(in_rank, p)[:, node]
            rows = in_rank[sent][:, node * p:(node + 1) * p]
            masks.append(rows)
            counts.append(int(sent.sum()))
            src_bits = host_test_module.hier_target_bits(in_rank.numpy(), p, node)
            bits += [b for b, keep in zip(src_bits, sent.tolist()) if keep]
        target_mask = torch.cat(masks)
        want = forward_counts(target_mask, torch.tensor(counts))
        got = torch.from_numpy(host_test_module.hier_forward_counts(bits, counts, p))
        assert torch.equal(got, want)
    with pytest.raises(ValueError):
        host_test_module.hier_forward_counts([1, 2], [3], 2)


@pytest.mark.parametrize("r,p", SHAPES)
def test_receive_order_matches_plan_and_contract(r: int, p: int, host_test_module) -> None:
    """Simulates every receiver: rows arrive by (forwarder, source node, token); the order from
    the helper must restore (source rank, token), like plan.node_receive_order."""
    topo = NodeTopology(r, p)
    gen = torch.Generator().manual_seed(200 + r * 10 + p)
    in_ranks = [_in_rank(gen, int(torch.randint(0, 30, (1,), generator=gen)), r, 0.35) for _ in range(r)]
    for receiver in range(r):
        arrived, table = [], torch.zeros(p, topo.num_nodes, dtype=torch.int64)
        for local in range(p):
            for g in range(topo.num_nodes):
                src = g * p + local
                tokens = build_send_plan(in_ranks[src][:, receiver:receiver + 1]).token_index.tolist()
                arrived += [(src, t) for t in tokens]
                table[local, g] = len(tokens)
        recv_counts, order = host_test_module.hier_receive_order(table.numpy())
        want = node_receive_order(table)
        assert recv_counts == want.recv_counts.tolist()
        assert order == want.order.tolist()
        final = [arrived[i] for i in order]
        assert final == sorted(arrived)
        assert recv_counts == [int(m[:, receiver].sum()) for m in in_ranks]


def test_rejects_bad_shapes(host_test_module) -> None:
    with pytest.raises(ValueError):
        host_test_module.hier_forwarding_peer(4, 3, 0, 0)
    with pytest.raises(ValueError):
        host_test_module.hier_token_node_mask(torch.zeros(3, 4, dtype=torch.bool).numpy(), 0)
    with pytest.raises(ValueError):
        host_test_module.hier_receive_order(torch.zeros(4, dtype=torch.int64).numpy())


def _two_hop_layout_py(r: int, p: int, rail_rows: int, node_rows: int, row_bytes: int) -> dict:
    """The offsets of csrc/common/hierarchy.h's TwoHopLayout, computed independently."""
    def up(n: int) -> int:
        return (n + 127) // 128 * 128
    g = r // p
    out = {"rail_signal": 0, "node_flag": up(8 * g)}
    out["rail_stage"] = up(out["node_flag"] + 4 * p * g)
    out["node_stage"] = up(out["rail_stage"] + g * rail_rows * row_bytes)
    out["barrier"] = up(out["node_stage"] + p * node_rows * row_bytes)
    out["total_bytes"] = up(out["barrier"] + 8 * r)
    return out


@pytest.mark.parametrize("r,p", SHAPES)
@pytest.mark.parametrize("rail_rows,node_rows,row_bytes", [(0, 0, 16), (1, 3, 48), (37, 74, 528), (4096, 8192, 7168)])
def test_two_hop_layout_matches_python(r: int, p: int, rail_rows: int, node_rows: int, row_bytes: int) -> None:
    got = host.hier_two_hop_layout(r, p, rail_rows, node_rows, row_bytes)
    want = _two_hop_layout_py(r, p, rail_rows, node_rows, row_bytes)
    assert {k: got[k] for k in want} == want
    assert (got["rail_rows"], got["node_rows"], got["row_bytes"]) == (rail_rows, node_rows, row_bytes)
    assert all(got[k] % 128 == 0 for k in want)
    # regions do not overlap: signals, flags, rail stage, node stage, barrier in that order
    g = r // p
    assert got["node_flag"] >= 8 * g and got["rail_stage"] >= got["node_flag"] + 4 * p * g
    assert got["node_stage"] >= got["rail_stage"] + g * rail_rows * row_bytes
    assert got["barrier"] >= got["node_stage"] + p * node_rows * row_bytes
    assert got["total_bytes"] >= got["barrier"] + 8 * r
    for bad in (dict(row_bytes=24), dict(row_bytes=0), dict(rail_rows=-1)):
        args = dict(num_ranks=r, ranks_per_node=p, rail_rows=rail_rows, node_rows=node_rows, row_bytes=row_bytes)
        with pytest.raises(ValueError):
            host.hier_two_hop_layout(**{**args, **bad})


def test_two_hop_launchers_validate_before_launching() -> None:
    """The bound kernel launchers (ep_comm._cuda.two_hop_dispatch / two_hop_combine) reject bad
    geometry on the CPU, before touching the GPU; this runs without a GPU whenever ep_comm._cuda
    is built."""
    try:
        import ep_comm._cuda as cuda
    except ImportError:
        pytest.skip("ep_comm._cuda is not built")
    if not hasattr(cuda, "two_hop_combine"):
        pytest.fail("ep_comm._cuda is built but lacks two_hop_combine: rebuild it")
    if not cuda.nvshmem_built():
        pytest.skip("ep_comm._cuda was built without NVSHMEM")
    common = dict(symmetric_base=1, rank_stride=0, my_pe=0, num_ranks=4, ranks_per_node=2, rail_rows=8,
                  node_rows=16, row_bytes=64, payload_bytes=32, round_value=1, timeout_ns=1)
    rank = dict(rank=0, node_peers=[1, 2], send_rows=1, rail_send_offsets=1, fwd_offsets=1, fwd_row=1,
                fwd_target=1, fwd_slot=1, recv_rows=1, recv_stage_row=1, num_recv_rows=0, record=1)
    bad_common = (dict(ranks_per_node=3), dict(row_bytes=24), dict(payload_bytes=80), dict(payload_bytes=0),
                  dict(rank_stride=100), dict(symmetric_base=0), dict(my_pe=4), dict(my_pe=-1),
                  dict(rank_stride=128, my_pe=1))
    for bad in bad_common:
        with pytest.raises(ValueError):
            cuda.two_hop_dispatch({**common, **bad}, [rank], 0)
    for bad in (dict(node_peers=[1]), dict(node_peers=[1, 0]), dict(rank=4), dict(record=None)):
        with pytest.raises(ValueError):
            cuda.two_hop_dispatch(common, [{**rank, **bad}], 0)
    with pytest.raises(ValueError, match="exactly one rank"):
        cuda.two_hop_dispatch(common, [rank, {**rank, "rank": 1}], 0)
    with pytest.raises(ValueError, match="missing field"):
        cuda.two_hop_dispatch(common, [{k: v for k, v in rank.items() if k != "record"}], 0)
    crank = dict(rank=0, node_peers=[1, 2], x=1, ret_row=1, ret_offsets=1, rail_offsets=1, red_offsets=1,
                 red_stage_row=1, partial=1, src_offsets=1, src_stage_row=1, num_tokens=0, combined_x=1,
                 combined_weights=None, record=1)
    fmt = dict(hidden=8, dtype=0, num_weights=2, weights_offset=16)
    for bad in (dict(dtype=2), dict(weights_offset=8), dict(weights_offset=18), dict(num_weights=5),
                dict(hidden=0)):
        with pytest.raises(ValueError):
            cuda.two_hop_combine(common, {**fmt, **bad}, [crank], 0)
    with pytest.raises(ValueError):
        cuda.two_hop_combine(common, fmt, [{**crank, "src_offsets": None}], 0)
