"""The csrc/common routing and buffer-layout helpers against the reference routing maths in
ep_comm/layout.py and ep_comm/plan.py, on random routings: the buffer layouts through ep_comm._host
(the engines size their buffers with them), the per-token helpers through the test-only bindings
(fixture ``host_test_module``, tests/native/host_test_bindings.cpp)."""
from __future__ import annotations

import pytest
import torch

from ep_comm.layout import compute_dispatch_layout, localize_topk
from ep_comm.placement import ExpertPlacement
from ep_comm.plan import build_expert_slot_plan, build_send_plan

host = pytest.importorskip("ep_comm._host", reason="ep_comm._host is not built")


def _routing(gen: torch.Generator, n: int, k: int, e: int, holes: bool = True) -> torch.Tensor:
    """Random [N, K] routing with -1 holes and, sometimes, an expert repeated within a row."""
    topk = torch.randint(0, e, (n, k), generator=gen)
    if holes:
        topk[torch.rand(n, k, generator=gen) < 0.15] = -1
    return topk


def _placements(gen: torch.Generator, e: int, r: int) -> list[ExpertPlacement]:
    owners = torch.randint(0, r, (e,), generator=gen)  # non-uniform, some ranks may own none
    return [ExpertPlacement.contiguous(e, r), ExpertPlacement.from_expert_to_rank(owners, r)]


CASES = [(2, 8, 37, 4), (4, 16, 64, 6), (8, 32, 129, 8), (16, 64, 50, 8), (3, 9, 1, 2), (4, 8, 0, 3)]


@pytest.mark.parametrize("r,e,n,k", CASES)
def test_dispatch_layout_matches_reference(r: int, e: int, n: int, k: int, host_test_module) -> None:
    gen = torch.Generator().manual_seed(r * 1000 + n)
    for placement in _placements(gen, e, r):
        topk = _routing(gen, n, k, e)
        ref = compute_dispatch_layout(topk, placement)
        per_rank, per_node, per_expert, mask = host_test_module.routing_dispatch_layout(
            topk.numpy(), placement.expert_to_rank.int().numpy(), r, 8)
        assert per_rank == ref.num_tokens_per_rank.tolist()
        assert per_expert == ref.num_tokens_per_expert.tolist()
        assert torch.equal(torch.from_numpy(mask), ref.is_token_in_rank)
        if ref.num_tokens_per_rdma_rank is None:
            assert per_node == []
        else:
            assert per_node == ref.num_tokens_per_rdma_rank.tolist()


def test_dispatch_layout_rejects_bad_ids(host_test_module) -> None:
    placement = ExpertPlacement.contiguous(8, 2)
    with pytest.raises(ValueError):
        host_test_module.routing_dispatch_layout(torch.tensor([[8, 0]]).numpy(),
                                                 placement.expert_to_rank.int().numpy(), 2, 8)


@pytest.mark.parametrize("r,e,n,k", CASES[:4])
def test_localize_matches_reference(r: int, e: int, n: int, k: int, host_test_module) -> None:
    gen = torch.Generator().manual_seed(7 + n)
    for placement in _placements(gen, e, r):
        topk = _routing(gen, n, k, e)
        weights = torch.rand(n, k, generator=gen)
        for rank in range(r):
            ref_idx, ref_w = localize_topk(topk, weights, rank, placement)
            idx, w = host_test_module.routing_localize(topk.numpy(), weights.numpy(), rank,
                                                       placement.expert_to_rank.int().numpy(),
                                                       placement.expert_to_local.int().numpy())
            assert torch.equal(torch.from_numpy(idx), ref_idx)
            assert torch.equal(torch.from_numpy(w), ref_w)


@pytest.mark.parametrize("n,c", [(0, 4), (1, 4), (7, 3), (100, 8), (4096, 20), (5, 8)])
def test_channel_ranges_tile_tokens_in_order(n: int, c: int, host_test_module) -> None:
    covered = []
    previous_end = 0
    for ch in range(c):
        begin, end = host_test_module.routing_channel_range(n, c, ch)
        assert begin == previous_end and begin <= end
        covered.extend(range(begin, end))
        previous_end = end
    assert covered == list(range(n))


def test_exclusive_scan(host_test_module) -> None:
    values = [3, 0, 5, 1, 0, 9]
    out = host_test_module.routing_exclusive_scan(values)
    assert out == [0, 3, 3, 8, 9, 9, 18]


@pytest.mark.parametrize("r,e,c", [(2, 8, 1), (4, 16, 3), (8, 32, 8), (8, 64, 5)])
def test_intranode_receive_order_matches_plan(r: int, e: int, c: int, host_test_module) -> None:
    """Channels + per-channel counts + recv_row_of place rows by source rank, then source token."""
    gen = torch.Generator().manual_seed(r * 31 + c)
    placement = _placements(gen, e, r)[1]
    masks = []
    for _ in range(r):
        topk = _routing(gen, int(torch.randint(0, 90, (1,), generator=gen)), 4, e)
        masks.append(compute_dispatch_layout(topk, placement).is_token_in_rank)
    for receiver in range(r):
        expected = []
        for s, mask in enumerate(masks):
            plan = build_send_plan(mask)
            start = int(plan.send_counts[:receiver].sum())
            rows = plan.token_index[start:start + int(plan.send_counts[receiver])]
            expected += [(s, int(t)) for t in rows]
        got = host_test_module.routing_intranode_recv_order([m.numpy() for m in masks], c, receiver)
        assert [tuple(x) for x in got] == expected


@pytest.mark.parametrize("r,e,n,k", [(2, 8, 20, 4), (4, 16, 33, 6), (8, 32, 64, 8), (4, 4, 10, 5)])
def test_low_latency_slots_match_plan(r: int, e: int, n: int, k: int, host_test_module) -> None:
    """Slot of each (token, k) pair = first slot of its source in the expert's block (the prefix of
    earlier sources' pair counts) + ll_pair_index, as low_latency.cu places them."""
    gen = torch.Generator().manual_seed(e * 17 + n)
    for placement in _placements(gen, e, r):
        topks = [_routing(gen, n, k, e) for _ in range(r)]  # repeats within a row included
        for receiver in range(r):
            local_experts = placement.local_experts(receiver).tolist()
            # reference: received rows by source then token; slots from build_expert_slot_plan
            rows, row_src, row_token = [], [], []
            per_rank = []
            for s, topk in enumerate(topks):
                mask = compute_dispatch_layout(topk, placement).is_token_in_rank[:, receiver]
                tokens = torch.nonzero(mask).flatten()
                rows.append(localize_topk(topk[tokens], None, receiver, placement)[0])
                row_src += [s] * len(tokens)
                row_token += tokens.tolist()
                per_rank.append(len(tokens))
            recv_local = torch.cat(rows) if rows else torch.empty(0, k, dtype=torch.int64)
            plan = build_expert_slot_plan(recv_local, torch.tensor(per_rank), len(local_experts))
            expected = sorted((int(le), int(sl), row_src[int(rw)], row_token[int(rw)])
                              for rw, le, sl in zip(plan.row, plan.local_expert, plan.slot))
            got = []
            for local, expert in enumerate(local_experts):
                first = 0
                for s, topk in enumerate(topks):
                    pairs = host_test_module.routing_ll_pairs(topk.numpy(), expert)
                    got += [(local, first + index, s, token) for token, _, index in pairs]
                    assert int(plan.layout_range[local, s, 0]) == first
                    assert int(plan.layout_range[local, s, 1]) == len(pairs)
                    first += len(pairs)
                assert first == int(plan.recv_count[local])
            assert sorted(got) == expected


def _regions(layout: dict, names: list[str]) -> list[int]:
    return [layout[n] for n in names]


@pytest.mark.parametrize("r,c,slots,row", [(2, 1, 8, 16), (8, 8, 64, 14400), (4, 20, 128, 7296)])
def test_intranode_layout_regions(r: int, c: int, slots: int, row: int, host_test_module) -> None:
    lay = host.routing_intranode_layout(r, c, 7, slots, row)
    starts = _regions(lay, ["arrival", "channel_counts", "expert_counts", "ring_tail", "ring_head", "ring"])
    sizes = [4 * r, 4 * r * c, 4 * r * 7, 4 * c * r, 4 * c * r, c * r * slots * row]
    for i, start in enumerate(starts):
        assert start % 128 == 0
        end = start + sizes[i]
        assert end <= (starts[i + 1] if i + 1 < len(starts) else lay["total_bytes"])
    seen = set()
    for ch in range(c):
        for src in range(r):
            for slot in range(slots):
                off = host_test_module.routing_ring_row_offset(r, c, 7, slots, row, ch, src, slot)
                assert lay["ring"] <= off and off + row <= lay["total_bytes"]
                seen.add(off)
            # absolute slot counters wrap around the ring
            ring_row_offset = host_test_module.routing_ring_row_offset
            assert ring_row_offset(r, c, 7, slots, row, ch, src, slots + 3) == \
                ring_row_offset(r, c, 7, slots, row, ch, src, 3)
    assert len(seen) == r * c * slots


@pytest.mark.parametrize("hidden_bytes,scales,k,w",
                         [(14336, 56, 8, True), (7168, 0, 1, False), (256, 2, 9, True)])
def test_row_layout_fields_are_aligned_and_disjoint(hidden_bytes: int, scales: int, k: int,
                                                    w: bool) -> None:
    row = host.routing_row_layout(hidden_bytes, scales, k, True, w, True)
    fields = [("x", hidden_bytes), ("scales", 4 * scales), ("topk", 8 * k), ("weights", 4 * k if w else 0),
              ("src", 4)]
    end = 0
    for name, size in fields:
        assert row[name] % 16 == 0 and row[name] >= end
        end = row[name] + size
    assert row["row_bytes"] % 16 == 0 and row["row_bytes"] >= end


@pytest.mark.parametrize("hidden", [128, 2048, 7168])
def test_low_latency_layout(hidden: int) -> None:
    r, l_max, e, t, k = 8, 4, 32, 128, 8
    lay = host.routing_low_latency_layout(r, l_max, e, t, k, hidden)
    payload, scales, row_bytes = host.routing_ll_row(hidden, True)
    assert payload == 16 and scales >= payload + hidden and row_bytes >= scales + 4 * hidden // 128
    payload, _, bf16_bytes = host.routing_ll_row(hidden, False)
    assert bf16_bytes >= payload + 2 * hidden
    assert lay["stage_row_bytes"] == max(row_bytes, bf16_bytes)
    order = ["dispatch_flag", "combine_flag", "dispatch_stage", "combine_stage", "send_scratch", "barrier"]
    sizes = [4 * l_max * r, 4 * e, l_max * r * t * lay["stage_row_bytes"], 2 * t * k * hidden,
             (e + 8 * l_max) * lay["stage_row_bytes"], 8 * r]
    for i, name in enumerate(order):
        nxt = lay[order[i + 1]] if i + 1 < len(order) else lay["total_bytes"]
        assert lay[name] % 128 == 0 and lay[name] + sizes[i] <= nxt


def test_exchange_layout() -> None:
    signal, stage, slot, total = host.routing_exchange_layout(4, 1000)
    assert signal == 0 and stage >= 32 and slot >= 1000 and slot % 128 == 0
    assert total == stage + 4 * slot + 128  # then the closing barrier's uint64[4], one region


def test_timeout_record_layout(host_test_module) -> None:
    fields = host.timeout_record_fields
    names = host.timeout_phase_names
    assert len(set(names.values())) == len(names) and names[0] == "none"
    record = host_test_module.timeout_fill_record(1, 3, 5, 2, 1500, 7)
    assert len(record) == fields["words"]
    assert record[fields["status"]] == 1 and record[fields["rank"]] == 3
    assert record[fields["peer"]] == 5 and names[record[fields["phase"]]] == "intranode/dispatch-send"
    assert record[fields["waited_ms"]] == 1500 and record[fields["detail"]] == 7
