"""The portable low-latency dispatch's needed-rows transfer (counts first, then only the real rows)
delivers what the fixed blocks deliver: the reference's ``[L, R*T, H]`` slots, counts, handle and
combine, bit-exact, on 2 and 4 gloo ranks; ``"auto"`` takes it when ``R > 2 K``; it sends fewer
bytes and one more collective."""
from __future__ import annotations

import pytest
import torch
from support.rank_cases import make_routing, make_x

from ep_comm.low_latency import choose_transfer

HIDDEN, TOKENS, MAX_TOKENS, SEED = 128, 6, 8, 41


def test_auto_takes_the_needed_rows_when_the_blocks_would_carry_twice_the_real_rows():
    assert choose_transfer("auto", 256, 8) == "needed" and choose_transfer("auto", 16, 8) == "fixed"
    assert choose_transfer("auto", 17, 8) == "needed" and choose_transfer("fixed", 256, 8) == "fixed"
    assert choose_transfer("needed", 2, 8) == "needed"
    with pytest.raises(ValueError, match="transfer"):
        choose_transfer("some", 4, 2)


def _case(rank, world, group, experts, topk, use_fp8):
    import ep_comm
    from ep_comm import reference
    from ep_comm.codecs import fp8
    from ep_comm.placement import ExpertPlacement

    placement = ExpertPlacement.contiguous(experts, world)
    routing = [make_routing(r, SEED, TOKENS, experts, topk) for r in range(world)]
    idxs, weights = [i for i, _ in routing], [w for _, w in routing]
    xs = [make_x(r, SEED, TOKENS, HIDDEN, torch.bfloat16) for r in range(world)]
    receives = reference.low_latency_dispatch(xs, idxs, MAX_TOKENS, placement)
    want = receives[rank]
    want_combined = reference.low_latency_combine([r.x * 3 for r in receives], receives, idxs, weights,
                                                  placement)[rank]
    buf = ep_comm.Buffer(group, backend="torch")
    flat = buf.path_plan.paths[-1]
    out = {}
    for transfer in ("fixed", "needed"):
        flat.low_latency_transfer = transfer
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(xs[rank], idxs[rank], MAX_TOKENS, experts,
                                                               use_fp8=use_fp8)
        stats = buf.last_stats
        failures = []
        if count.tolist() != want.count:
            failures.append("count")
        if use_fp8:
            q, scales = recv_x
            for j, n in enumerate(want.count):
                want_q, want_s = fp8.quantize(want.x[j, :n])
                if not (torch.equal(q[j, :n].view(torch.uint8), want_q.view(torch.uint8))
                        and torch.equal(scales[j, :n], want_s)):
                    failures.append(f"x[{j}]")
            expert_out = fp8.dequantize(q, scales).to(torch.bfloat16)
        else:
            for j, n in enumerate(want.count):
                if not torch.equal(recv_x[j, :n], want.x[j, :n]):
                    failures.append(f"x[{j}]")
            expert_out = recv_x * 3
        if not torch.equal(handle.layout_range, reference_layout_range(want, world)):
            failures.append("layout_range")
        combined = buf.low_latency_combine(expert_out, idxs[rank], weights[rank], handle)[0]
        if not use_fp8 and not torch.equal(combined, want_combined):
            failures.append("combine")
        out[transfer] = {"failures": failures, "sent": sum(stats.bytes_sent_wire),
                         "collectives": stats.num_collectives,
                         "combined": combined.clone(), "src_info": handle.recv_src_info.clone()}
    out["same"] = (torch.equal(out["fixed"]["combined"], out["needed"]["combined"])
                   and torch.equal(out["fixed"]["src_info"], out["needed"]["src_info"]))
    return out


def reference_layout_range(want, world):
    pairs = want.layout_range(world)
    return (pairs[..., 0] << 32) | pairs[..., 1]


@pytest.mark.parametrize("world, experts, topk, use_fp8", [(2, 4, 2, False), (4, 8, 1, False), (4, 8, 1, True)])
def test_needed_rows_deliver_what_the_fixed_blocks_deliver(ranks, world, experts, topk, use_fp8):
    for out in ranks(world, _case, experts, topk, use_fp8):
        assert out["fixed"]["failures"] == [] and out["needed"]["failures"] == [], out
        assert out["same"]
        assert out["needed"]["sent"] < out["fixed"]["sent"]
        assert out["needed"]["collectives"] == out["fixed"]["collectives"] + 1  # the count exchange
