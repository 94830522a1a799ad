"""ep-bench: option validation, routing generators, statistics, baselines' bookkeeping, the
reference check, the report schema, the scale-out model, and short end-to-end runs."""
from __future__ import annotations

import json
import math

import pytest
import torch

from ep_comm.cli import check as ck
from ep_comm.cli.baselines import NaiveAllToAll
from ep_comm.cli.cases import EpLowLatencyCase, EpNormalCase, Inputs
from ep_comm.cli.config import BenchConfig, ConfigError, parse_args
from ep_comm.cli.main import main
from ep_comm.cli.metrics import build_results
from ep_comm.cli.report import SCHEMA, validate_report
from ep_comm.cli.routing import group_limited_routing, make_routing, uniform_routing, zipf_routing
from ep_comm.cli.simulator import CodecSpeed, Links, Traffic, codec_speed, fit, op_time, simulate, units
from ep_comm.cli.timing import LatencySummary, percentile
from ep_comm.codecs import auto

SMALL = ["--ranks", "2", "--tokens", "8", "--hidden", "256", "--experts", "8", "--topk", "2",
         "--warmup", "0", "--iters", "2", "--quiet"]


# -- option validation -----------------------------------------------------------------------
def test_repeated_list_values_count_once():
    cfg = parse_args(["--mode", "normal,normal", "--codec", "none,none,fp8"])
    assert cfg.modes == ("normal",) and cfg.codecs == ("none", "fp8")


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "3", "--experts", "8"], "must be divisible by the number of ranks"),
    (["--experts", "8", "--topk", "9", "--ranks", "2"], "cannot exceed --experts"),
    (["--hidden", "200", "--codec", "fp8"], "multiple of 128"),
    (["--mode", "low-latency", "--codec", "lossless"], "low-latency mode supports"),
    (["--mode", "normal,low-latency", "--codec", "lossless"], "low-latency mode supports"),
    (["--tokens", "0"], "--tokens must be positive"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--codec", "zstd"], "unknown value"),
    (["--routing", "group-limited", "--num-groups", "7"], "must divide --experts"),
    (["--routing", "group-limited", "--topk-groups", "9"], "--topk-groups"),
    (["--routing", "group-limited", "--experts", "16", "--num-groups", "8", "--topk-groups", "1",
      "--topk", "3"], "exceeds the experts reachable"),
    (["--backend", "nvshmem", "--launcher", "local"], "needs NVIDIA GPUs"),
    (["--launcher", "torchrun"], "RANK/WORLD_SIZE/LOCAL_RANK are not set"),
    (["--ranks", "4", "--node-aware", "3"], "--node-aware 3 must divide the number of ranks (4)"),
    (["--node-aware", "-2"], "--node-aware must be a positive number"),
    (["--ranks", "4", "--node-aware", "4"], "makes a single node"),
    (["--mode", "low-latency", "--node-aware", "2"], "low-latency mode stays flat"),
    (["--simulate", "--node-aware", "2"], "run it without --node-aware"),
    (["--codec-gbps", "400,500"], "add --simulate"),
    (["--simulate", "--codec-gbps", "400,0"], "two positive finite GB/s"),
    (["--simulate", "--codec-gbps", "400,inf"], "two positive finite GB/s"),
    (["--simulate", "--codec-gbps", "400"], "expected two figures ENC,DEC"),
    (["--simulate", "--codec-gbps", "fast,slow"], "expected ENC,DEC in GB/s"),
    (["--codec", ""], "--codec needs at least one value"),
    (["--codec", ","], "--codec needs at least one value"),
    (["--nvl-gbps", "5"], "--nvl-gbps is used only with --simulate"),
    (["--sim-experts", "1"], "--sim-experts is used only with --simulate"),
    (["--sim-ep", "8"], "--sim-ep is used only with --simulate"),
    (["--zipf-s", "-3"], "--zipf-s is used only with --routing zipf"),
    (["--routing", "zipf", "--num-groups", "3"], "--num-groups is used only with --routing group-limited"),
    (["--json", "/nonexistent-folder/report.json"], "is not a folder this process can write to"),
    (["--plot", "/tmp"], "is not a file name"),
])
def test_invalid_options_exit_2_with_reason(argv, message, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_are_the_deepseek_shape(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = parse_args([])
    assert (cfg.ranks, cfg.tokens, cfg.hidden, cfg.experts, cfg.topk) == (4, 128, 7168, 64, 8)
    assert cfg.modes == ("normal", "low-latency") and cfg.codecs == ("none",)
    assert cfg.resolved_launcher() == "local"
    assert parse_args(["--simulate"]).codecs == ("none", "fp8", "lossless")
    assert parse_args(["--simulate"]).codec_gbps is None
    assert parse_args(["--simulate", "--codec-gbps", "400, 500.5"]).codec_gbps == (400.0, 500.5)
    assert parse_args(["--mode", "both"]).modes == ("normal", "low-latency")
    assert parse_args(["--codec", "none,fp8", "--mode", "low-latency"]).mode_codecs("low-latency") == \
        ["none", "fp8"]
    assert parse_args(["--codec", "lossless,fp8"]).mode_codecs("low-latency") == ["fp8"]


def test_node_aware_is_separate_from_the_simulated_ranks_per_node(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = parse_args(["--simulate", "--ranks-per-node", "4"])
    assert (cfg.ranks_per_node, cfg.node_aware) == (4, 0)
    cfg = parse_args(["--node-aware", "2"])
    assert (cfg.ranks_per_node, cfg.node_aware, cfg.modes) == (8, 2, ("normal", "low-latency"))
    with pytest.raises(ConfigError, match="must divide the number of ranks"):
        BenchConfig(ranks=6, experts=12, node_aware=4, launcher="local").validate()


def test_torchrun_world_size_sets_ranks(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert parse_args([]).ranks == 8
    with pytest.raises(ConfigError, match="divisible"):
        BenchConfig(experts=12, ranks=8, launcher="local").validate()


# -- statistics --------------------------------------------------------------------------------
def test_percentile_matches_linear_interpolation():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 10) == pytest.approx(1.4)
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    s = LatencySummary.of([0.001, 0.003, 0.002])
    assert (s.median, s.min, s.max, s.count) == (pytest.approx(2000.0), pytest.approx(1000.0),
                                                 pytest.approx(3000.0), 3)


# -- routing -----------------------------------------------------------------------------------
def _distinct_in_range(idx: torch.Tensor, num_experts: int) -> bool:
    sorted_idx = idx.sort(1).values
    return bool((idx >= 0).all() and (idx < num_experts).all()
                and (sorted_idx[:, 1:] != sorted_idx[:, :-1]).all())


def test_routing_generators_pick_distinct_experts_with_normalised_weights():
    g = torch.Generator().manual_seed(1)
    for idx, w in (uniform_routing(500, 32, 4, g), zipf_routing(500, 32, 4, 1.2, g, torch.Generator()),
                   group_limited_routing(500, 32, 4, 8, 2, g)):
        assert idx.shape == w.shape == (500, 4) and idx.dtype == torch.int64 and w.dtype == torch.float32
        assert _distinct_in_range(idx, 32)
        assert torch.allclose(w.sum(1), torch.ones(500)) and bool((w > 0).all())


def test_zipf_is_skewed_and_group_limited_stays_in_its_groups():
    g = torch.Generator().manual_seed(2)
    zidx, _ = zipf_routing(4000, 64, 2, 1.2, g, torch.Generator().manual_seed(0))
    counts = torch.bincount(zidx.flatten(), minlength=64).sort(descending=True).values
    uidx, _ = uniform_routing(4000, 64, 2, g)
    ucounts = torch.bincount(uidx.flatten(), minlength=64).sort(descending=True).values
    assert counts[0] > 3 * ucounts[0]
    gidx, _ = group_limited_routing(2000, 64, 6, 8, 2, g)
    groups_per_token = torch.tensor([len(set((row // 8).tolist())) for row in gidx])
    assert int(groups_per_token.max()) <= 2


def test_routing_is_a_function_of_seed_and_rank():
    cfg = BenchConfig(tokens=16, experts=16, topk=4, routing="zipf")
    a, b = make_routing(cfg, 1), make_routing(cfg, 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(make_routing(cfg, 0)[0], a[0])


# -- naive baseline bookkeeping ------------------------------------------------------------------
def test_expert_major_index_reorders_rank_major_blocks():
    # received blocks (rank, expert): r0e0=2 rows, r0e1=1, r1e0=1, r1e1=2 -> rows 0..5
    counts = torch.tensor([[2, 1], [1, 2]])
    # expert-major: r0e0 (0,1), r1e0 (3), r0e1 (2), r1e1 (4,5)
    assert NaiveAllToAll._expert_major_index(counts).tolist() == [0, 1, 3, 2, 4, 5]


# -- the reference check -------------------------------------------------------------------------
def _global_inputs() -> ck.GlobalInputs:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 256, generator=g).to(torch.bfloat16)
    idx = torch.stack([uniform_routing(6, 8, 2, g)[0] for _ in range(2)])
    idx[0, 5] = torch.tensor([-1, -1])  # a token routed nowhere
    w = torch.rand(2, 6, 2, generator=g)
    return ck.GlobalInputs(x, idx, w, 8)


def _ref_normal_case(gi: ck.GlobalInputs, rank: int) -> EpNormalCase:
    inp = Inputs(gi.x[rank], gi.topk_idx[rank], gi.topk_weights[rank], 8, rank, 2)
    case = EpNormalCase(None, inp, "none")
    rx, ridx, rw, counts = ck.ref_dispatch(gi, rank)
    case.out = (rx, ridx, rw, counts, None, None)
    want, _ = ck.ref_normal_combine(gi, rank)
    valid_w = torch.where(gi.topk_idx[rank] >= 0, gi.topk_weights[rank], torch.zeros(()))
    case.combined = (want.to(torch.bfloat16), valid_w, None)
    return case


def test_check_accepts_the_reference_and_catches_corruption():
    gi = _global_inputs()
    case = _ref_normal_case(gi, 1)
    assert case.verify(gi, 1) == []
    rx = case.out[0].clone()
    rx[[0, 1]] = rx[[1, 0]]  # two rows swapped
    case.out = (rx, *case.out[1:])
    assert any("recv_x" in p for p in case.verify(gi, 1))
    case = _ref_normal_case(gi, 0)
    bad = case.combined[0].clone()
    bad[2] *= 2
    case.combined = (bad, *case.combined[1:])
    assert any("combined_x" in p for p in case.verify(gi, 0))


def _ref_low_latency_case(gi: ck.GlobalInputs, rank: int) -> EpLowLatencyCase:
    inp = Inputs(gi.x[rank], gi.topk_idx[rank], gi.topk_weights[rank], 8, rank, 2)
    case = EpLowLatencyCase(None, inp, "none")
    recv_x = torch.zeros(gi.num_local, 2 * 6, 256, dtype=torch.bfloat16)
    counts = torch.zeros(gi.num_local, dtype=torch.int32)
    for j in range(gi.num_local):
        rows = torch.cat(ck.ref_expert_rows(gi, rank, j))
        recv_x[j, :rows.shape[0]] = rows
        counts[j] = rows.shape[0]
    case.out = (recv_x, counts, None, None, None)
    case.combined = (ck.ref_weighted_combine(gi, rank)[0].to(torch.bfloat16), None, None)
    return case


def test_low_latency_check_accepts_the_reference_and_catches_corruption():
    gi = _global_inputs()
    case = _ref_low_latency_case(gi, 0)
    assert case.verify(gi, 0) == []
    case.out[1][1] -= 1  # one row fewer announced
    assert any("recv_count[1]" in p for p in case.verify(gi, 0))
    case = _ref_low_latency_case(gi, 1)
    case.out[0][0, 0] = case.out[0][1, 0]  # expert 0's first row replaced by expert 1's
    assert case.verify(gi, 1) != []


def test_reference_dispatch_by_hand():
    x = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2).to(torch.bfloat16)
    idx = torch.tensor([[[0, 3], [1, -1], [2, 3]], [[3, 2], [0, 1], [-1, -1]]])
    gi = ck.GlobalInputs(x, idx, torch.ones(2, 3, 2), 4)  # 2 experts per rank
    rx, ridx, rw, counts = ck.ref_dispatch(gi, 1)  # rank 1 owns experts 2, 3
    assert rx.tolist() == [x[0, 0].tolist(), x[0, 2].tolist(), x[1, 0].tolist()]
    assert ridx.tolist() == [[-1, 1], [0, 1], [1, 0]]
    assert rw.tolist() == [[0, 1], [1, 1], [1, 1]]
    assert counts == [2, 3]


def test_match_rows_ignores_order_but_not_content():
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    assert ck.match_rows("r", rows[[3, 1, 0, 4, 2]], rows, False) == []
    dup = rows.clone()
    dup[1] = rows[0]
    assert ck.match_rows("r", dup, rows, False) != []
    scales = rows.float().view(5, 2, 128).abs().amax(2) / 448  # DeepEP's per-128-channel scales
    q = (rows.float().view(5, 2, 128) / scales[..., None]).to(torch.float8_e4m3fn).view(5, 256)
    assert ck.match_rows("r", ck.dequantize(q, scales), rows, True) == []


# -- report schema and metrics arithmetic ----------------------------------------------------------
def _raw(samples_ep, samples_naive, samples_floor, wire) -> dict:
    def rank(r):
        return {"rank": r, "token_rank_pairs": 10 + 2 * r,
                "samples": {"ep_comm/normal/none": samples_ep, "naive/-/none": samples_naive,
                            "floor/normal/none": samples_floor},
                "problems": {}, "checked": {},
                "wire": {name: {op: {"sent_wire": wire[r], "recv_wire": wire[r], "sent_raw": wire[r],
                                     "recv_raw": wire[r]} for op in ("dispatch", "combine")}
                         for name in ("ep_comm/normal/none", "naive/-/none", "floor/normal/none")}}

    return {"ranks": [rank(0), rank(1)], "errors": {}, "cases": [],
            "environment": {"device": "cpu", "dist_backend": "gloo", "ep_comm_backend": {}, "torch": "x"}}


def test_metrics_arithmetic_on_a_hand_case():
    cfg = BenchConfig(ranks=2, tokens=4, hidden=128, experts=4, topk=2, modes=("normal",))
    ms = 1e-3
    raw = _raw({"dispatch": [1 * ms, 3 * ms], "combine": [2 * ms, 2 * ms]},
               {"dispatch": [4 * ms, 4 * ms], "combine": [4 * ms, 4 * ms]},
               {"dispatch": [1 * ms, 1 * ms], "combine": [1 * ms, 1 * ms]},
               wire=[[100, 300], [500, 700]])
    results, targets = build_results(cfg, raw)
    d = next(r for r in results if r["op"] == "dispatch")
    # samples pooled over 2 ranks: [1, 3, 1, 3] ms -> median 2 ms
    assert d["ep_comm"]["latency_us"]["median"] == pytest.approx(2000.0)
    alg = (10 + 12) / 2 * 128 * 2  # mean token-rank pairs x H x 2 bytes
    assert d["ep_comm"]["algbw_gbps"] == pytest.approx(alg / 2e-3 / 1e9)
    wire = (300 + 500) / 2  # bytes to the other rank, averaged over ranks
    assert d["ep_comm"]["wirebw_gbps"] == pytest.approx(wire / 2e-3 / 1e9)
    assert d["ep_comm"]["wire_bytes_per_token"] == pytest.approx(wire / 4)
    assert d["ratio_vs_naive"] == pytest.approx(0.5) and d["ratio_vs_floor"] == pytest.approx(2.0)
    dc = next(r for r in results if r["op"] == "dispatch+combine")
    assert dc["ep_comm"]["latency_us"]["median"] == pytest.approx(4000.0)  # [3, 5, 3, 5]
    assert dc["ratio_vs_naive"] == pytest.approx(0.5)
    assert [t["met"] for t in targets] == [False, False]


def test_schema_validator_rejects_broken_reports():
    assert validate_report({"schema": SCHEMA}) != []
    cfg = BenchConfig(ranks=2, tokens=4, hidden=128, experts=4, topk=2, modes=("normal",))
    ms = 1e-3
    raw = _raw({"dispatch": [ms], "combine": [ms]}, {"dispatch": [ms], "combine": [ms]},
               {"dispatch": [ms], "combine": [ms]}, wire=[[1, 2], [3, 4]])
    results, targets = build_results(cfg, raw)
    report = {"schema": SCHEMA, "problem": "p", "config": cfg.to_dict(), "environment": raw["environment"],
              "results": results, "targets": targets, "check": {"enabled": False}, "simulation": None,
              "wall_time_s": 1.0}
    assert validate_report(json.loads(json.dumps(report))) == []
    del report["results"][0]["naive"]["algbw_gbps"]
    assert any("naive.algbw_gbps" in e for e in validate_report(report))


# -- the scale-out model ---------------------------------------------------------------------------
def test_op_time_by_hand():
    # 4 ranks, 2 per node; 1 GB/s NVLink (+1 s), 0.5 GB/s RDMA (+2 s)
    links = Links(nvl_bw=1e9, rdma_bw=0.5e9, nvl_latency=1.0, rdma_latency=2.0, ranks_per_node=2)
    b = torch.tensor([[9e9, 1e9, 1e9, 0.0],
                      [3e9, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0]])
    # rank 0: NVLink send 1 GB (to 1), receive 3 GB (from 1) -> 1 + 3 = 4 s;
    #         RDMA send 1 GB (to 2) -> 2 + 2 = 4 s. rank 1: NVLink send 3 GB -> 4 s.
    # rank 2: RDMA receive 1 GB -> 4 s. Self bytes (9 GB) are free.
    t, _ = op_time(b, links)
    assert t == pytest.approx(4.0)
    b[0, 3] = 1e9  # rank 0 now sends 2 GB over RDMA: 2 + 4 = 6 s
    t, where = op_time(b, links)
    assert t == pytest.approx(6.0) and where == "rdma"


def test_units_and_fit_by_hand():
    # 2 ranks, 4 experts (2 per rank); rank 0's tokens: [0,1] -> rank 0 only; [1,2] -> both
    idx = torch.tensor([[[0, 1], [1, 2]], [[3, 2], [0, 3]]])
    assert units(idx, 4, "token-rank").tolist() == [[2, 1], [1, 2]]
    assert units(idx, 4, "token-expert").tolist() == [[3, 1], [1, 3]]
    u = units(idx, 4, "token-rank")
    coef, err = fit(u * 10, u, False)
    assert coef == pytest.approx(10.0) and err == pytest.approx(0.0)
    coef, err = fit(u.t() * 10, u, True)  # a combine: the owner sends back
    assert coef == pytest.approx(10.0) and err == pytest.approx(0.0)
    _, err = fit(u * 10 + torch.tensor([[0.0, 5.0], [0.0, 0.0]]), u, True)
    assert err > 0.1
    coef, err = fit(torch.full((2, 2), 7.0), units(idx, 4, "per-peer"), False)
    assert coef == pytest.approx(7.0) and err == 0.0


def test_simulate_scales_with_bytes_and_skips_impossible_sizes():
    cfg = BenchConfig(ranks=2, tokens=16, hidden=128, experts=32, topk=4, sim_ep=(8, 16, 64),
                      sim_experts=32)
    u = units(torch.stack([make_routing(cfg, r)[0] for r in range(2)]), 32, "token-rank")
    measured = {("normal", "none", "dispatch"): u * 1000.0, ("normal", "fp8", "dispatch"): u * 500.0}
    sim = simulate(cfg, measured)
    assert sim["skipped"] == ["EP 64: 32 experts are not divisible by 64"]
    by = {(r["ep"], r["codec"]): r for r in sim["rows"]}
    for ep in (8, 16):
        none, fp8 = by[(ep, "none")], by[(ep, "fp8")]
        assert fp8["total_us"] < none["total_us"]
    # EP 8 fits one node: NVLink only; time = latency + busiest port bytes / bandwidth
    assert by[(8, "none")]["dispatch_bottleneck"] == "nvlink"
    assert by[(16, "none")]["dispatch_bottleneck"] == "rdma"
    nvl_only = by[(8, "none")]["dispatch_us"] - cfg.nvl_latency_us
    nvl_only_fp8 = by[(8, "fp8")]["dispatch_us"] - cfg.nvl_latency_us
    assert nvl_only == pytest.approx(2 * nvl_only_fp8)


def _codec_traffic(cfg: BenchConfig, rho: float) -> dict:
    """Normal-mode none and lossless traffic as the run measures it: ``bytes(r, s) = b * units``
    (combines reversed), lossless at ``rho`` of the raw bytes."""
    u = units(torch.stack([make_routing(cfg, r)[0] for r in range(cfg.ranks)]), cfg.experts, "token-rank")
    out = {}
    for op, m in (("dispatch", u), ("combine", u.t())):
        raw = m * 14_400.0
        out[("normal", "none", op)] = Traffic(raw, raw, "none")
        out[("normal", "lossless", op)] = Traffic(raw * rho, raw, "lossless")
    return out


SIM_CFG = dict(ranks=2, tokens=16, hidden=128, experts=32, topk=4, sim_ep=(8, 16, 32), sim_experts=32)


def test_a_codec_of_infinite_speed_projects_the_bytes_alone():
    cfg = BenchConfig(**SIM_CFG)
    traffic = _codec_traffic(cfg, 0.66)
    free = simulate(cfg, traffic, CodecSpeed(math.inf, math.inf, "test"))
    bytes_only = simulate(cfg, {key: t.wire for key, t in traffic.items()})  # no codec anywhere
    assert free["codec"]["encode_gbps"] == math.inf and bytes_only["codec"] is None
    got = {(r["ep"], r["codec"]): r for r in free["rows"]}
    want = {(r["ep"], r["codec"]): r for r in bytes_only["rows"]}
    assert set(want) == {(ep, c) for ep in (8, 16, 32) for c in ("none", "lossless")}
    for key, row in want.items():
        for field in ("dispatch_us", "combine_us", "total_us"):
            assert got[key][field] == pytest.approx(row[field], rel=1e-12), (key, field)
        assert got[key]["dispatch_bottleneck"] == row["dispatch_bottleneck"]
    # any saving pays for a free codec: auto compresses on every link, at lossless's time
    assert free["auto"]["normal"]["choice"] == {"nvlink": "lossless", "rdma": "lossless"}
    for ep in (8, 16, 32):
        assert got[(ep, "auto")]["total_us"] == pytest.approx(got[(ep, "lossless")]["total_us"])
        assert got[(ep, "lossless")]["total_us"] < got[(ep, "none")]["total_us"]
    assert got[(8, "auto")]["auto_by_link"] == {"nvlink": "lossless"}  # one node: NVLink only
    assert got[(16, "auto")]["auto_by_link"] == {"nvlink": "lossless", "rdma": "lossless"}


def test_auto_declines_a_codec_slower_than_break_even_and_costs_the_uncompressed_time():
    cfg = BenchConfig(**SIM_CFG, nvl_latency_us=0.0, rdma_latency_us=0.0)
    rho = 0.66
    # break-even (encode = decode) is 2 L / (1 - rho): well above the codec on both links
    slow = auto.break_even_gbps(cfg.rdma_gbps, rho) / 4
    assert slow < auto.break_even_gbps(cfg.nvl_gbps, rho)
    sim = simulate(cfg, _codec_traffic(cfg, rho), CodecSpeed(slow, slow, "test"))
    decision = sim["auto"]["normal"]
    assert decision["ratio"] == pytest.approx(rho) and decision["ratio_source"] == "measured"
    assert decision["choice"] == {"nvlink": "none", "rdma": "none"}
    assert decision["break_even_gbps"]["rdma"] == pytest.approx(2 * cfg.rdma_gbps / (1 - rho))
    by = {(r["ep"], r["codec"]): r for r in sim["rows"]}
    for ep in (8, 16, 32):
        none, lossless, chosen = by[(ep, "none")], by[(ep, "lossless")], by[(ep, "auto")]
        assert (chosen["dispatch_choice"], chosen["combine_choice"]) == ("none", "none")
        assert chosen["total_us"] == pytest.approx(none["total_us"])
        assert lossless["total_us"] > none["total_us"]  # compressing would have lost time
        # the codec's serial share: the slowest encoder's raw bytes / enc + decoder's / dec
        assert lossless["dispatch_codec_us"] > 0
        link_only = lossless["dispatch_us"] - lossless["dispatch_codec_us"]
        assert link_only == pytest.approx(none["dispatch_us"] * rho)  # no latency: bytes alone


def test_codec_time_is_serial_encode_then_transfer_then_decode():
    # 2 ranks on one node, 1 GB/s NVLink, no latency; rank 0 sends 4 GB raw (2 GB to itself),
    # compressed to half; encode 2 GB/s, decode 4 GB/s
    cfg = BenchConfig(ranks=2, tokens=16, hidden=128, experts=4, topk=1, sim_ep=(2,), sim_experts=4,
                      nvl_gbps=1.0, nvl_latency_us=0.0, routing="uniform")
    u = units(torch.stack([make_routing(cfg, r)[0] for r in range(2)]), 4, "token-rank")
    raw = u * 1e8
    sim = simulate(cfg, {("normal", "lossless", "dispatch"): Traffic(raw * 0.5, raw, "lossless")},
                   CodecSpeed(2.0, 4.0, "test"))
    row = sim["rows"][-1] if sim["rows"][-1]["codec"] == "lossless" else sim["rows"][0]
    assert row["codec"] == "lossless"
    encode = float(raw.sum(1).max()) / 2e9
    decode = float(raw.sum(0).max()) / 4e9
    link = float(torch.maximum(raw.fill_diagonal_(0).sum(1), raw.sum(0)).max()) * 0.5 / 1e9
    assert row["dispatch_codec_us"] == pytest.approx((encode + decode) * 1e6)
    assert row["dispatch_us"] == pytest.approx((encode + link + decode) * 1e6)


def test_the_simulator_and_the_buffer_decide_with_one_rule(monkeypatch):
    cfg = BenchConfig(**SIM_CFG)
    seen = []

    def rule(link, ratio, enc, dec):
        seen.append(link)
        return link < 100.0  # "pays" on the slow link only

    monkeypatch.setattr(auto, "compression_pays", rule)
    sim = simulate(cfg, _codec_traffic(cfg, 0.66), CodecSpeed(1.0, 1.0, "test"))
    assert sim["auto"]["normal"]["choice"] == {"nvlink": "none", "rdma": "lossless"}
    by = {(r["ep"], r["codec"]): r for r in sim["rows"]}
    assert by[(8, "auto")]["dispatch_choice"] == "none"  # one node: bounded by NVLink
    assert by[(16, "auto")]["dispatch_choice"] == "lossless"  # bounded by RDMA
    assert by[(16, "auto")]["total_us"] == pytest.approx(by[(16, "lossless")]["total_us"])
    policy = auto.AutoCodecPolicy(link_gbps=50.0, encode_gbps=1.0, decode_gbps=1.0)
    assert auto.choose_codec(torch.zeros(2, 8, dtype=torch.bfloat16), policy, "nccl") == "lossless"
    assert seen[-1] == 50.0


def test_codec_speed_is_given_or_measured_where_the_payload_is_coded():
    given = codec_speed(BenchConfig(simulate=True, codec_gbps=(400.0, 500.0)))
    assert (given.encode_gbps, given.decode_gbps) == (400.0, 500.0) and "--codec-gbps" in given.source
    measured = codec_speed(BenchConfig(simulate=True), "cpu", threads=1)
    assert measured.encode_gbps > 0 and measured.decode_gbps > 0
    assert "host codec on the CPU, 1 thread per rank" in measured.source


def test_projection_of_a_run_uses_its_raw_bytes_and_prints_the_codec_model():
    from rich.console import Console

    from ep_comm.cli.main import simulation
    from ep_comm.cli.report import print_simulation

    cfg = BenchConfig(**SIM_CFG, simulate=True, codec_gbps=(400.0, 500.0), modes=("normal",),
                      codecs=("none", "lossless"))
    traffic = _codec_traffic(cfg, 0.66)
    cases = [{"name": f"ep_comm/normal/{c}", "method": "ep_comm", "mode": "normal", "codec": c}
             for c in ("none", "lossless")]
    ranks = [{"wire": {f"ep_comm/normal/{c}": {op: {
        "sent_wire": traffic[("normal", c, op)].wire[r].tolist(),
        "sent_raw": traffic[("normal", c, op)].raw[r].tolist(), "codec": c}
        for op in ("dispatch", "combine")} for c in ("none", "lossless")}} for r in range(cfg.ranks)]
    sim = simulation(cfg, {"cases": cases, "ranks": ranks, "environment": {"device": "cpu"}})
    assert sim["codec"]["source"] == "given by --codec-gbps"
    lossless = next(c for c in sim["coefficients"] if (c["codec"], c["op"]) == ("lossless", "dispatch"))
    assert lossless["codec_used"] == "lossless"
    assert lossless["bytes_per_unit"] == pytest.approx(0.66 * lossless["raw_bytes_per_unit"])
    console = Console(record=True, width=240)
    print_simulation(sim, console)
    text = console.export_text()
    assert "charged serially" in text and "encode 400 GB/s, decode 500 GB/s" in text
    assert "break-even encode = decode: NVLink 2.65 TB/s, RDMA 294 GB/s" in text
    # 400/500 GB/s clears RDMA's break-even, not NVLink's
    assert "picks NVLink none, RDMA lossless" in text
    assert "auto (none/none)" in text and "auto (lossless/lossless)" in text


# -- end to end (spawns its own ranks) -------------------------------------------------------------
def test_normal_mode_runs_checked_and_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    code = main([*SMALL, "--mode", "normal", "--codec", "none,fp8", "--check", "--json", str(out),
                 "--plot", str(png), "--simulate", "--sim-ep", "8,16"])
    assert code == 0
    report = json.loads(out.read_text())
    assert validate_report(report) == []
    assert report["check"]["passed"] and report["check"]["verified_calls"] >= 2 * 2 * 3
    ok = [r for r in report["results"] if r["status"] == "ok"]
    assert {(r["codec"], r["op"]) for r in ok} >= {("none", "dispatch+combine"), ("fp8", "dispatch")}
    fp8 = next(r for r in ok if r["codec"] == "fp8" and r["op"] == "dispatch")
    none = next(r for r in ok if r["codec"] == "none" and r["op"] == "dispatch")
    assert fp8["ep_comm"]["wire_bytes_per_token"] < none["ep_comm"]["wire_bytes_per_token"]
    assert png.stat().st_size > 10_000
    assert (tmp_path / "r_simulate.png").stat().st_size > 10_000
    _assert_model_fits(report)


def _assert_model_fits(report: dict) -> None:
    """The traffic model reproduces the bytes ep_comm actually sent (uncompressed codec)."""
    for c in report["simulation"]["coefficients"]:
        if c["codec"] == "none":
            assert c["fit_error"] < 0.02, c
        assert c["bytes_per_unit"] > 0 and not math.isnan(c["bytes_per_unit"])


def test_low_latency_mode_runs_checked_with_simulation(tmp_path):
    out = tmp_path / "ll.json"
    code = main([*SMALL, "--mode", "low-latency", "--codec", "none,fp8", "--routing", "group-limited",
                 "--num-groups", "4", "--topk-groups", "2", "--check", "--simulate", "--sim-ep", "8",
                 "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert validate_report(report) == []
    assert report["check"]["passed"]
    assert {r["codec"] for r in report["simulation"]["rows"]} == {"none", "fp8"}
    _assert_model_fits(report)


def test_node_aware_sends_fewer_inter_node_bytes_than_flat_and_checks(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = ["--ranks", "4", "--tokens", "8", "--hidden", "256", "--experts", "8", "--topk", "4",
            "--warmup", "0", "--iters", "1", "--quiet", "--mode", "normal,low-latency",
            "--node-aware", "2", "--check"]
    # the routing sends tokens to both ranks of another node: the case two hops save on
    cfg = parse_args(argv)
    idx = make_routing(cfg, 0)[0]
    owners = idx // cfg.local_experts
    assert bool(((owners == 2).any(1) & (owners == 3).any(1)).any())
    out = tmp_path / "na.json"
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert validate_report(report) == []
    assert report["check"]["passed"]
    assert "flat/normal/none" not in report["check"]["failed_cases"]
    assert report["config"]["node_aware"] == 2
    normal = [r for r in report["results"] if r["mode"] == "normal" and r["status"] == "ok"]
    assert {r["op"] for r in normal} == {"dispatch", "combine", "dispatch+combine"}
    for row in normal:
        n = row["node_aware"]
        assert (n["ranks_per_node"], n["nodes"]) == (2, 2)
        assert 0 < n["inter_node_bytes_per_token"] < n["flat_inter_node_bytes_per_token"], row["op"]
        assert n["inter_node_ratio_vs_flat"] < 1 and row["ratio_vs_flat"] > 0
        assert row["flat"]["wire_bytes_per_token"] > 0
        if row["op"] == "dispatch":  # bytes_sent_off_node agrees with the per-peer matrix
            m = row["wire_bytes_per_peer"]
            off = sum(m[r][s] for r in range(4) for s in range(4) if r // 2 != s // 2)
            assert n["inter_node_bytes_per_token"] == pytest.approx(off / 4 / 8)
    low = [r for r in report["results"] if r["mode"] == "low-latency"]
    assert low and all("node_aware" not in r for r in low)  # low-latency mode stays flat


def test_low_latency_dispatch_projects_the_transfer_the_buffer_would_choose():
    """Measured in fixed blocks on 2 ranks (T + 1 slots of a row's bytes per peer): EP 8 (top-4,
    8 <= 2K) is projected in fixed blocks, EP 16 and 32 in needed rows (one row per token-rank
    pair, plus the count exchange's latency), the row priced from the measured block."""
    cfg = BenchConfig(**SIM_CFG)
    row_bytes = 1000.0
    block = torch.full((2, 2), row_bytes * (cfg.tokens + 1))
    sim = simulate(cfg, {("low-latency", "none", "dispatch"): block})
    by = {r["ep"]: r for r in sim["rows"]}
    assert [by[ep]["dispatch_transfer"] for ep in (8, 16, 32)] == ["fixed", "needed", "needed"]
    links = Links.from_config(cfg)
    for ep in (8, 16, 32):
        routing = torch.stack([make_routing(cfg, r, num_experts=32)[0] for r in range(ep)])
        kind = "per-peer" if ep == 8 else "token-rank"
        expected, where = op_time(units(routing, 32, kind) * (row_bytes * (cfg.tokens + 1) if ep == 8 else row_bytes),
                                  links)
        if ep != 8:
            expected += links.nvl_latency if where == "nvlink" else links.rdma_latency
        assert by[ep]["dispatch_us"] == pytest.approx(expected * 1e6)
    # the needed rows at EP 32 cost less than fixed blocks of the same rows would
    fixed_32 = op_time(units(torch.stack([make_routing(cfg, r, num_experts=32)[0] for r in range(32)]), 32, "per-peer")
                       * row_bytes * (cfg.tokens + 1), links)[0]
    assert by[32]["dispatch_us"] < fixed_32 * 1e6
