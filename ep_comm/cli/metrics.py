"""From raw per-rank samples to the reported figures.

Definitions (per operation: dispatch, combine, and dispatch+combine = their sum per iteration and
rank):

- **latency**: wall time of one call on one rank, from just after a barrier to the moment its
  results are usable; median, p10 and p90 over all timed iterations of all ranks.
- **algorithm bytes** ``A``: the bf16 payload the problem itself requires a rank to deliver: one
  ``H * 2``-byte row per (token, destination rank) pair, its own rank included, averaged over ranks.
  Dispatch and combine each move ``A``; the figure is the same for every method and codec.
- **algorithm bandwidth** = ``A / median latency`` (GB/s, 1e9 bytes/s). Comparable across methods:
  a ratio of algorithm bandwidths is the inverse ratio of latencies.
- **wire bytes** ``W``: bytes a rank actually sends to *other* ranks (its own rows are a local
  copy), averaged over ranks: ``CommStats.bytes_sent_wire`` for ep_comm (payload after the codec,
  routing metadata and headers), the rows and count messages for the naive baseline, and ep_comm's
  figure for the transport floor.
- **wire bandwidth** = ``W / median latency`` (GB/s); **wire bytes per token** = ``W / N``.
- **x naive**, **x floor**: ep_comm's median latency divided by the baseline's median latency of the
  same operation measured in the same run (below 1 = ep_comm faster).
- with ``--node-aware P`` (normal mode): **inter-node bytes per token** = the bytes a rank sent to
  ranks of other virtual nodes of ``P`` consecutive ranks (``CommStats.bytes_sent_off_node(P)``),
  averaged over ranks, divided by ``N``; for ep_comm (node-aware Buffer) and for the flat Buffer
  run on the same data in the same run. **x flat** is the latency ratio against that flat run.
"""
from __future__ import annotations

from typing import Any

from .config import BenchConfig
from .timing import LatencySummary

OPS3 = ("dispatch", "combine", "dispatch+combine")
TARGETS = {"normal": {"naive": 0.25, "floor": 1.3}, "low-latency": {"floor": 1.5}}


def pooled(raw: dict, case: str, op: str) -> list[float]:
    """All timed samples (seconds) of ``case``/``op`` over ranks; ``dispatch+combine`` sums the
    two calls of the same iteration on the same rank."""
    out: list[float] = []
    for r in raw["ranks"]:
        s = r["samples"][case]
        out += [d + c for d, c in zip(s["dispatch"], s["combine"])] if op == "dispatch+combine" else s[op]
    return out


def wire_sent_matrix(raw: dict, case: str, op: str, field: str = "sent_wire") -> list[list[int]]:
    """``[R][R]``: bytes rank ``r`` sent to rank ``s`` in ``op`` (sender-major); ``field``
    ``"sent_raw"``: the same messages' bytes before the codec."""
    return [list(r["wire"][case][op][field]) for r in raw["ranks"]]


def mean_wire_to_others(raw: dict, case: str, op: str) -> float:
    ops = ("dispatch", "combine") if op == "dispatch+combine" else (op,)
    total = 0
    for o in ops:
        for rank, sent in enumerate(wire_sent_matrix(raw, case, o)):
            total += sum(b for s, b in enumerate(sent) if s != rank)
    return total / len(raw["ranks"])


def method_metrics(raw: dict, case: str, op: str, alg_bytes: float, tokens: int) -> dict[str, Any]:
    lat = LatencySummary.of(pooled(raw, case, op))
    alg = alg_bytes * (2 if op == "dispatch+combine" else 1)
    wire = mean_wire_to_others(raw, case, op)
    seconds = lat.median * 1e-6
    return {"latency_us": lat.to_dict(), "algbw_gbps": alg / seconds / 1e9,
            "wirebw_gbps": wire / seconds / 1e9, "wire_bytes_per_rank": wire,
            "wire_bytes_per_token": wire / tokens}


def off_node_per_token(raw: dict, case: str, op: str, tokens: int) -> float:
    """Mean over ranks of the bytes ``case`` sent to other nodes in ``op``, per token."""
    ops = ("dispatch", "combine") if op == "dispatch+combine" else (op,)
    total = sum(r["wire"][case][o]["sent_off_node"] for r in raw["ranks"] for o in ops)
    return total / len(raw["ranks"]) / tokens


def node_aware_metrics(cfg: BenchConfig, raw: dict, name: str, flat: str, op: str) -> dict[str, Any]:
    """Inter-node bytes per token of the node-aware ``name`` and the flat ``flat`` cases."""
    ep = off_node_per_token(raw, name, op, cfg.tokens)
    base = off_node_per_token(raw, flat, op, cfg.tokens)
    return {"ranks_per_node": cfg.node_aware, "nodes": cfg.ranks // cfg.node_aware,
            "inter_node_bytes_per_token": ep, "flat_inter_node_bytes_per_token": base,
            "inter_node_ratio_vs_flat": ep / base if base else None}


def alg_bytes(raw: dict, hidden: int) -> float:
    """Mean over ranks of token-rank pairs times ``H * 2`` bytes."""
    pairs = [r["token_rank_pairs"] for r in raw["ranks"]]
    return sum(pairs) / len(pairs) * hidden * 2


def build_results(cfg: BenchConfig, raw: dict) -> tuple[list[dict], list[dict]]:
    """``(results, targets)``: one result per (mode, codec, op) and one target verdict per
    (mode, codec) on dispatch+combine."""
    a = alg_bytes(raw, cfg.hidden)
    results: list[dict] = []
    targets: list[dict] = []
    naive_case = "naive/-/none"
    for mode in cfg.modes:
        for codec in cfg.mode_codecs(mode):
            name = f"ep_comm/{mode}/{codec}"
            flat = f"flat/{mode}/{codec}" if cfg.node_aware and mode == "normal" else None
            failed = [n for n in (name, flat) if n in raw["errors"]]
            if failed:
                error = (raw["errors"][name] if name in raw["errors"]
                         else f"flat comparison: {raw['errors'][flat]}")
                results.append({"mode": mode, "codec": codec, "op": "dispatch+combine", "status": "error",
                                "error": error})
                continue
            for op in OPS3:
                row: dict[str, Any] = {"mode": mode, "codec": codec, "op": op, "status": "ok"}
                for method, case in (("ep_comm", name), ("naive", naive_case),
                                     ("floor", f"floor/{mode}/{codec}")):
                    row[method] = method_metrics(raw, case, op, a, cfg.tokens)
                ep = row["ep_comm"]["latency_us"]["median"]
                row["ratio_vs_naive"] = ep / row["naive"]["latency_us"]["median"]
                row["ratio_vs_floor"] = ep / row["floor"]["latency_us"]["median"]
                if flat is not None:
                    row["flat"] = method_metrics(raw, flat, op, a, cfg.tokens)
                    row["ratio_vs_flat"] = ep / row["flat"]["latency_us"]["median"]
                    row["node_aware"] = node_aware_metrics(cfg, raw, name, flat, op)
                if op != "dispatch+combine":
                    row["codec_used"] = sorted({str(r["wire"][name][op].get("codec", codec))
                                                for r in raw["ranks"]})
                    row["wire_bytes_per_peer"] = wire_sent_matrix(raw, name, op)
                    row["raw_bytes_per_peer"] = [list(r["wire"][name][op]["sent_raw"]) for r in raw["ranks"]]
                row["check"] = _check_summary(raw, name) if cfg.check else None
                results.append(row)
                if op == "dispatch+combine":
                    for base, limit in TARGETS[mode].items():
                        ratio = row[f"ratio_vs_{base}"]
                        targets.append({"mode": mode, "codec": codec, "op": op, "baseline": base,
                                        "target": limit, "measured": ratio, "met": ratio <= limit})
    return results, targets


def _check_summary(raw: dict, case: str) -> dict[str, Any]:
    problems = [f"rank {r['rank']}: {p}" for r in raw["ranks"] for p in r["problems"][case]]
    return {"verified_calls": sum(r["checked"][case] for r in raw["ranks"]), "problems": problems[:20],
            "passed": not problems}


def check_totals(cfg: BenchConfig, raw: dict) -> dict[str, Any]:
    """Over every checked case (the naive baseline included)."""
    if not cfg.check:
        return {"enabled": False}
    cases = [c["name"] for c in raw["cases"] if c["method"] != "floor"]
    per = {c: _check_summary(raw, c) for c in cases}
    return {"enabled": True, "verified_calls": sum(p["verified_calls"] for p in per.values()),
            "failed_cases": [c for c, p in per.items() if not p["passed"]],
            "problems": [f"{c}: {m}" for c, p in per.items() for m in p["problems"]][:20],
            "passed": all(p["passed"] for p in per.values())}
