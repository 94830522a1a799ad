"""The portable wire is versioned and vendor-neutral: every call's opening header carries the
wire-format version (ranks of different versions fail in the header, naming it), and FP8 travels
as OCP e4m3fn whatever the rank's vendor (a ROCm rank simulated here by ``torch.version.hip``;
MI300's native float8_e4m3fnuz encodes the same values differently and is never the wire)."""
from __future__ import annotations

import torch
from support.rank_cases import make_routing

HIDDEN, TOKENS, EXPERTS = 256, 6, 4


def ocp_e4m3fn(byte: int) -> float:
    """The value of one OCP FP8 E4M3 byte (bias 7, no infinities, NaN at S.1111.111), from the
    OCP 8-bit floating point specification, independent of torch."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0 ** -6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def test_torch_e4m3fn_is_the_ocp_encoding_and_fnuz_is_not():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    mine = torch.tensor([ocp_e4m3fn(b) for b in range(256)], dtype=torch.float32)
    theirs = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(theirs.isnan(), mine.isnan())
    assert torch.equal(theirs[~mine.isnan()], mine[~mine.isnan()])
    fnuz = codes.view(torch.float8_e4m3fnuz).float()
    assert not torch.equal(fnuz.nan_to_num(0), mine.nan_to_num(0))  # e.g. 0x38: 1.0 in OCP, 0.5 in fnuz


def ocp_e4m3fn_encode(value: float) -> int:
    """The OCP E4M3 byte nearest ``value`` (ties to an even mantissa), by search over the codes."""
    best = None
    for byte in range(256):
        decoded = ocp_e4m3fn(byte)
        if decoded != decoded:
            continue
        key = (abs(decoded - value), byte & 1)
        if best is None or key < best[0]:
            best = (key, byte)
    return best[1]


def _source_row(src):
    """Every token of rank ``src``: ``0.5 + src`` in even columns, ``-(1 + src) / 3`` in odd ones."""
    x = torch.full((TOKENS, HIDDEN), 0.5 + src, dtype=torch.bfloat16)
    x[:, 1::2] = -(1.0 + src) / 3
    return x


def _fp8_case(rank, world, group, simulated_rocm):
    import ep_comm

    previous = torch.version.hip
    torch.version.hip = "6.3.0" if rank in simulated_rocm else None  # this rank's build, simulated
    try:
        buf = ep_comm.Buffer(group, backend="torch")
        x = _source_row(rank)
        idx = torch.tensor([[0, 1]] * TOKENS)  # experts 0 and 1: both on rank 0
        counts = buf.get_dispatch_layout(idx, EXPERTS)[2]
        (q, scales), *_ = buf.dispatch(x, topk_idx=idx, topk_weights=torch.ones(idx.shape),
                                       num_tokens_per_expert=counts, codec="fp8")
        (ll_q, ll_scales), ll_count, *_ = buf.low_latency_dispatch(x, idx, TOKENS, EXPERTS, use_fp8=True)
        n = int(ll_count[0]) if ll_count.numel() else 0
        return {"q": q.view(torch.uint8).clone(), "scales": scales.clone(), "hip": torch.version.hip,
                "ll_q": ll_q[0, :n].view(torch.uint8).clone(), "ll_scales": ll_scales[0, :n].clone()}
    finally:
        torch.version.hip = previous


def _expected_bytes(scales):
    """``[2T, H]`` OCP bytes of the rows rank 0 receives (rank 0's tokens, then rank 1's), from
    the values and the scales that came with them."""
    rows = []
    for i in range(2 * TOKENS):
        values = _source_row(i // TOKENS)[0].float()
        scale = scales[i].float().repeat_interleave(128)
        rows.append([ocp_e4m3fn_encode(float(v / s)) for v, s in zip(values[:2], scale[:2])])
    return torch.tensor(rows, dtype=torch.uint8)


def test_fp8_on_the_wire_is_ocp_e4m3fn_whatever_the_vendor(ranks):
    results = ranks(2, _fp8_case, (1,))
    assert results[1]["hip"] == "6.3.0" and results[0]["hip"] is None
    got = results[0]
    for q, scales in ((got["q"], got["scales"]), (got["ll_q"], got["ll_scales"])):
        assert q.shape == (2 * TOKENS, HIDDEN)
        # each row is two values repeated: the first two columns name them all
        assert torch.equal(q, q[:, :2].repeat(1, HIDDEN // 2))
        assert torch.equal(q[:, :2], _expected_bytes(scales))
        assert int(q[TOKENS, 0]) == 0x7E  # 448, the OCP maximum: fnuz (maximum 240) has no such byte


def _version_case(rank, world, group, skewed_rank):
    import ep_comm
    from ep_comm import agreement

    previous = agreement.VERSION
    if rank == skewed_rank:
        agreement.VERSION = previous + 1  # this rank speaks a newer wire format
    try:
        buf = ep_comm.Buffer(group, backend="torch")
        x = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
        idx, weights = make_routing(rank, 3, TOKENS, EXPERTS, 2)
        try:
            buf.dispatch(x, topk_idx=idx, topk_weights=weights,
                         num_tokens_per_expert=buf.get_dispatch_layout(idx, EXPERTS)[2])
        except ValueError as error:
            return str(error)
        return "no error"
    finally:
        agreement.VERSION = previous


def test_the_header_carries_the_wire_version_and_ranks_of_two_versions_fail_naming_it(ranks):
    from ep_comm import agreement

    assert agreement.CallHeader("dispatch", 0).row()[0] == agreement.VERSION
    for message in ranks(2, _version_case, 1):
        assert "disagree on version" in message and "rank 1" in message, message
