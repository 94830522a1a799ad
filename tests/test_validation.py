"""Bad input: every check listed under "Errors" in docs/design.md is a ValueError that names the argument."""
from __future__ import annotations

import pytest
import torch

import ep_comm


def _expect(fn, *names):
    try:
        fn()
    except ValueError as error:
        text = str(error)
        missing = [n for n in names if n not in text]
        return "ok" if not missing else f"message {text!r} does not name {missing}"
    except Exception as error:  # noqa: BLE001
        return f"raised {type(error).__name__}: {error}"
    return "no error"


def _bad_inputs(rank, world, group):
    buf = ep_comm.Buffer(group, timeout_s=30)
    n, h, e = 6, 128, 4
    # a Buffer of the same group with another expert placement: its handles do not fit this one
    other = ep_comm.Buffer(group, timeout_s=30, expert_placement=(torch.arange(e) + 1) % world)
    x = torch.randn(n, h).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, -1], [3, 0], [-1, -1], [1, 2], [0, 3]])
    w = torch.rand(n, 2)
    per_expert = torch.zeros(e, dtype=torch.int32)
    rx, ridx, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    _, _, _, _, other_handle, _ = other.dispatch(x, topk_idx=idx, topk_weights=w,
                                                 num_tokens_per_expert=per_expert)
    llx, _, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, 8, e, use_fp8=False)
    checks = {
        "layout idx dtype": _expect(lambda: buf.get_dispatch_layout(idx.int(), e), "topk_idx", "int64"),
        "layout idx range": _expect(lambda: buf.get_dispatch_layout(idx + 10, e), "topk_idx"),
        "layout idx below -1": _expect(lambda: buf.get_dispatch_layout(idx - 2, e), "topk_idx"),
        "layout idx 1-D": _expect(lambda: buf.get_dispatch_layout(idx[:, 0], e), "topk_idx"),
        "num_experts not divisible": _expect(lambda: buf.get_dispatch_layout(idx, 3), "num_experts"),
        "num_experts not int": _expect(lambda: buf.get_dispatch_layout(idx, 4.0), "num_experts"),
        "x dtype": _expect(lambda: buf.dispatch(x.int(), topk_idx=idx, num_tokens_per_expert=per_expert), "x"),
        "x 3-D": _expect(lambda: buf.dispatch(x[None], topk_idx=idx, num_tokens_per_expert=per_expert), "x"),
        "x not tensor": _expect(lambda: buf.dispatch([1, 2], topk_idx=idx, num_tokens_per_expert=per_expert), "x"),
        "x rows vs topk_idx": _expect(lambda: buf.dispatch(x[:4], topk_idx=idx, num_tokens_per_expert=per_expert),
                                      "topk_idx"),
        "weights shape": _expect(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w[:, :1],
                                                      num_tokens_per_expert=per_expert), "topk_weights"),
        "weights dtype": _expect(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w.half(),
                                                      num_tokens_per_expert=per_expert), "topk_weights"),
        "missing topk_idx": _expect(lambda: buf.dispatch(x), "topk_idx"),
        "topk_idx on another device than x": _expect(lambda: buf.dispatch(
            x, topk_idx=idx.to("meta"), num_tokens_per_expert=per_expert), "topk_idx"),
        "is_token_in_rank shape": _expect(lambda: buf.dispatch(
            x, topk_idx=idx, is_token_in_rank=torch.ones(n, world + 1, dtype=torch.bool),
            num_tokens_per_expert=per_expert), "is_token_in_rank"),
        "expert_alignment": _expect(lambda: buf.dispatch(x, topk_idx=idx, num_tokens_per_expert=per_expert,
                                                         expert_alignment=0), "expert_alignment"),
        "num_worst_tokens": _expect(lambda: buf.dispatch(x, topk_idx=idx, num_tokens_per_expert=per_expert,
                                                         num_worst_tokens=-1), "num_worst_tokens"),
        "codec name": _expect(lambda: buf.dispatch(x, topk_idx=idx, num_tokens_per_expert=per_expert,
                                                   codec="zip"), "codec"),
        "fp8 codec on combine": _expect(lambda: buf.combine(rx, handle, codec="fp8"), "codec"),
        "combine rows": _expect(lambda: buf.combine(rx[:-1] if rx.shape[0] else torch.zeros(1, h), handle),
                                "x", "handle"),
        "combine foreign handle": _expect(lambda: buf.combine(rx, other_handle), "handle"),
        "combine handle type": _expect(lambda: buf.combine(rx, (1, 2, 3)), "handle"),
        "cached dispatch tokens": _expect(lambda: buf.dispatch(x[:-1], handle=handle), "x", "handle"),
        "ll capacity": _expect(lambda: buf.low_latency_dispatch(x, idx, 4, e), "num_max_dispatch_tokens_per_rank"),
        "ll dtype": _expect(lambda: buf.low_latency_dispatch(x.float(), idx, 8, e), "x"),
        "ll ue8m0 without round": _expect(lambda: buf.low_latency_dispatch(x, idx, 8, e, use_ue8m0=True),
                                          "use_ue8m0"),
        "ll fp8 hidden": _expect(lambda: buf.low_latency_dispatch(torch.zeros(n, 100, dtype=torch.bfloat16),
                                                                  idx, 8, e), "hidden"),
        "ll combine shape": _expect(lambda: buf.low_latency_combine(llx[:, :-1], idx, w, ll_handle), "x"),
        "ll combine routing": _expect(lambda: buf.low_latency_combine(llx, idx.flip(0), w, ll_handle),
                                      "topk_idx"),
        "ll combine handle": _expect(lambda: buf.low_latency_combine(llx, idx, w, handle), "handle"),
        "buffer backend": _expect(lambda: ep_comm.Buffer(group, backend="mpi"), "backend"),
        "buffer timeout": _expect(lambda: ep_comm.Buffer(group, timeout_s=0), "timeout_s"),
        "buffer group": _expect(lambda: ep_comm.Buffer(None), "group"),
        "set_num_sms": _expect(lambda: ep_comm.Buffer.set_num_sms(7), "new_num_sms"),
        "ll duplicate expert": _expect(lambda: buf.low_latency_dispatch(
            x, torch.tensor([[1, 1]] * n), 8, e, use_fp8=False), "topk_idx"),
        "fp8 tuple scales shape": _expect(lambda: buf.dispatch(
            (torch.zeros(n, 512).to(torch.float8_e4m3fn), torch.ones(n, 1)), topk_idx=idx,
            num_tokens_per_expert=per_expert), "x[1]"),
        "fp8 tuple hidden": _expect(lambda: buf.dispatch(
            (torch.zeros(n, 100).to(torch.float8_e4m3fn), torch.ones(n, 1)), topk_idx=idx,
            num_tokens_per_expert=per_expert), "x[1]"),
        "buffer timeout nan": _expect(lambda: ep_comm.Buffer(group, timeout_s=float("nan")), "timeout_s"),
        "autograd expert_alignment": _expect(lambda: ep_comm.dispatch(buf, x.float(), idx, w, e,
                                                                      expert_alignment=0), "expert_alignment"),
        "autograd num_worst_tokens": _expect(lambda: ep_comm.dispatch(buf, x.float(), idx, w, e,
                                                                      num_worst_tokens=-5), "num_worst_tokens"),
        "autograd num_experts": _expect(lambda: ep_comm.dispatch(buf, x.float(), idx, w, 4.0), "num_experts"),
        "autograd topk_idx": _expect(lambda: ep_comm.dispatch(buf, x.float(), [[0, 1]], w, e), "topk_idx"),
        "autograd combine weights": _expect(lambda: ep_comm.combine(buf, rx, handle, topk_weights=[1, 2]),
                                            "topk_weights"),
        "placement range": _expect(lambda: ep_comm.Buffer(group, expert_placement=torch.tensor([0, 5])),
                                   "expert_placement"),
    }
    return checks


def test_every_bad_input_is_a_named_value_error(ranks):
    for checks in ranks(2, _bad_inputs):
        failures = {k: v for k, v in checks.items() if v != "ok"}
        assert not failures, failures


def test_codec_and_config_inputs():
    from ep_comm.codecs import fp8

    with pytest.raises(ValueError, match="x"):
        fp8.quantize(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="use_ue8m0"):
        fp8.quantize(torch.zeros(2, 512), use_ue8m0=True)
    with pytest.raises(ValueError, match="num_sms"):
        ep_comm.Config(num_sms=3)
    with pytest.raises(ValueError, match="num_ranks"):
        ep_comm.Buffer.get_dispatch_config(0)
    with pytest.raises(ValueError, match="hidden"):
        ep_comm.Buffer.get_low_latency_rdma_size_hint(128, 0, 8, 64)
