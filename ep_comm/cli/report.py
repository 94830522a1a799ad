"""The report: one JSON-ready dict, the rich tables printed at the end, and its schema check."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from .config import BenchConfig

SCHEMA = "ep-bench/1"
METHOD_KEYS = {"latency_us": dict, "algbw_gbps": float, "wirebw_gbps": float,
               "wire_bytes_per_token": float, "wire_bytes_per_rank": float}
LATENCY_KEYS = ("median", "p10", "p90", "mean", "min", "max", "count")


def problem_text(cfg: BenchConfig) -> str:
    routing = cfg.routing
    if routing == "zipf":
        routing += f" (s={cfg.zipf_s:g})"
    elif routing == "group-limited":
        routing += f" (top-{cfg.topk_groups} of {cfg.num_groups} groups)"
    return (f"{cfg.ranks} ranks x {cfg.tokens} tokens, hidden {cfg.hidden} bf16, top-{cfg.topk} of "
            f"{cfg.experts} experts ({cfg.local_experts} per rank), {routing} routing, "
            f"{cfg.warmup} warm-up + {cfg.iters} timed iterations")


def build_report(cfg: BenchConfig, raw: dict, results: list[dict], targets: list[dict],
                 check: dict, simulation: dict | None, wall_s: float) -> dict[str, Any]:
    return {"schema": SCHEMA, "problem": problem_text(cfg), "config": cfg.to_dict(),
            "environment": raw["environment"], "results": results, "targets": targets,
            "check": check, "simulation": simulation, "wall_time_s": wall_s}


def validate_report(report: Any) -> list[str]:
    """Problems with ``report``'s structure (empty when it follows ``ep-bench/1``)."""
    errs: list[str] = []
    if not isinstance(report, dict):
        return ["report is not an object"]
    for key, kind in (("schema", str), ("problem", str), ("config", dict), ("environment", dict),
                      ("results", list), ("targets", list), ("check", dict), ("wall_time_s", (int, float))):
        if not isinstance(report.get(key), kind):
            errs.append(f"{key}: missing or not {kind}")
    if report.get("schema") != SCHEMA:
        errs.append(f"schema must be {SCHEMA!r}")
    for i, row in enumerate(report.get("results") or []):
        errs += [f"results[{i}]: {e}" for e in _validate_row(row)]
    for i, t in enumerate(report.get("targets") or []):
        for key in ("mode", "codec", "baseline", "target", "measured", "met"):
            if key not in t:
                errs.append(f"targets[{i}]: missing {key}")
    sim = report.get("simulation")
    if sim is not None:
        if not isinstance(sim, dict) or not isinstance(sim.get("rows"), list):
            errs.append("simulation: must be null or an object with rows")
        else:
            for i, row in enumerate(sim["rows"]):
                for key in ("ep", "nodes", "mode", "codec", "total_us"):
                    if key not in row:
                        errs.append(f"simulation.rows[{i}]: missing {key}")
    return errs


def _validate_row(row: dict) -> list[str]:
    errs = [f"missing {k}" for k in ("mode", "codec", "op", "status") if k not in row]
    if row.get("status") == "error":
        return errs + ([] if isinstance(row.get("error"), str) else ["error rows need an error string"])
    if row.get("status") != "ok":
        return errs + [f"status must be ok or error, got {row.get('status')!r}"]
    for method in ("ep_comm", "naive", "floor"):
        m = row.get(method)
        if not isinstance(m, dict):
            errs.append(f"{method}: missing")
            continue
        for key, kind in METHOD_KEYS.items():
            if not isinstance(m.get(key), (kind, int) if kind is float else kind):
                errs.append(f"{method}.{key}: missing or not {kind.__name__}")
        lat = m.get("latency_us") or {}
        errs += [f"{method}.latency_us.{k}: missing" for k in LATENCY_KEYS if k not in lat]
        if all(k in lat for k in ("p10", "median", "p90")) and not lat["p10"] <= lat["median"] <= lat["p90"]:
            errs.append(f"{method}.latency_us: p10 <= median <= p90 violated")
    for key in ("ratio_vs_naive", "ratio_vs_floor"):
        if not isinstance(row.get(key), (int, float)) or row[key] <= 0:
            errs.append(f"{key}: missing or not positive")
    if "node_aware" in row:
        n = row["node_aware"]
        errs += [f"node_aware.{k}: missing" for k in ("ranks_per_node", "inter_node_bytes_per_token",
                                                       "flat_inter_node_bytes_per_token") if k not in n]
        errs += [] if isinstance(row.get("flat"), dict) else ["flat: missing next to node_aware"]
    return errs


def fmt_time(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} us"


def _console() -> Console:
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    return console


def print_results(report: dict, console: Console | None = None) -> None:
    console = console or _console()
    env = report["environment"]
    console.print(f"[bold]ep-bench[/]: {report['problem']}")
    console.print(f"device {env['device']}, {env['dist_backend']}, ep_comm backend "
                  f"{env['ep_comm_backend']}, torch {env['torch']}")
    table = Table(title="dispatch / combine latency and bandwidth (baselines measured in the same run)")
    node_aware = any("node_aware" in r for r in report["results"])
    cols = ["mode", "codec", "op", "median", "p10", "p90", "alg GB/s", "wire GB/s", "wire B/tok",
            "naive median", "x naive", "floor median", "x floor"]
    cols += ["inter-node B/tok", "flat inter-node B/tok", "x flat"] if node_aware else []
    for col in cols:
        table.add_column(col, justify="left" if col in ("mode", "codec", "op") else "right")
    for row in report["results"]:
        if row["status"] != "ok":
            table.add_row(row["mode"], row["codec"], row["op"], "[red]error[/]", *["-"] * (len(cols) - 4))
            continue
        ep, lat = row["ep_comm"], row["ep_comm"]["latency_us"]
        used = row.get("codec_used") or [row["codec"]]
        codec = row["codec"] if used == [row["codec"]] else f"{row['codec']} ({'/'.join(used)})"
        table.add_row(row["mode"], codec, row["op"], fmt_time(lat["median"]), fmt_time(lat["p10"]),
                      fmt_time(lat["p90"]), f"{ep['algbw_gbps']:.3f}", f"{ep['wirebw_gbps']:.3f}",
                      f"{ep['wire_bytes_per_token']:,.0f}", fmt_time(row["naive"]["latency_us"]["median"]),
                      f"{row['ratio_vs_naive']:.2f}x", fmt_time(row["floor"]["latency_us"]["median"]),
                      f"{row['ratio_vs_floor']:.2f}x", *(_node_cells(row) if node_aware else []))
    console.print(table)
    if node_aware:
        console.print(_node_note(report))
    for row in report["results"]:
        if row["status"] != "ok":
            console.print(f"[red]{row['mode']}/{row['codec']} not measured[/]: {row['error']}")
    naive = next((r["naive"] for r in report["results"] if r["status"] == "ok"
                  and r["op"] == "dispatch+combine"), None)
    if naive is not None:
        med = fmt_time(naive["latency_us"]["median"])
        console.print(f"naive per-expert all-to-all, dispatch+combine: {med} median, "
                      f"{naive['wire_bytes_per_token']:,.0f} wire B/token")
    for t in report["targets"]:
        verdict = "[green]met[/]" if t["met"] else "[red]not met[/]"
        console.print(f"target {t['mode']}/{t['codec']} dispatch+combine <= {t['target']}x {t['baseline']}: "
                      f"measured {t['measured']:.2f}x, {verdict}")
    chk = report["check"]
    if chk.get("enabled"):
        state = "[green]passed[/]" if chk["passed"] else f"[red]FAILED[/] ({', '.join(chk['failed_cases'])})"
        console.print(f"--check: {chk['verified_calls']} calls verified against the reference, {state}")
        for p in chk["problems"][:10]:
            console.print(f"  {p}")
    if report.get("simulation"):
        print_simulation(report["simulation"], console)
    console.print(f"wall time {report['wall_time_s']:.1f} s")


def _node_cells(row: dict) -> list[str]:
    """The ``--node-aware`` columns of one result row (dashes on flat-only low-latency rows)."""
    n = row.get("node_aware")
    if n is None:
        return ["-", "-", "-"]
    return [f"{n['inter_node_bytes_per_token']:,.0f}", f"{n['flat_inter_node_bytes_per_token']:,.0f}",
            f"{row['ratio_vs_flat']:.2f}x"]


def _node_note(report: dict) -> str:
    n = next(r["node_aware"] for r in report["results"] if "node_aware" in r)
    ratios = [(r["codec"], r["node_aware"]["inter_node_ratio_vs_flat"]) for r in report["results"]
              if "node_aware" in r and r["op"] == "dispatch+combine"]
    saving = ", ".join(f"{c} {x:.2f}x" for c, x in ratios if x is not None) or "-"
    return (f"--node-aware: normal mode over {n['nodes']} virtual nodes of {n['ranks_per_node']} ranks; "
            f"inter-node B/tok = bytes sent to other nodes per token (bytes_sent_off_node), flat = a "
            f"flat Buffer on the same data; dispatch+combine inter-node bytes vs flat: {saving}. "
            f"Low-latency mode stays flat.")


def fmt_gbps(gbps: float) -> str:
    if gbps == float("inf"):
        return "inf"
    return f"{gbps / 1e3:.2f} TB/s" if gbps >= 1e3 else f"{gbps:.3g} GB/s"


def simulation_header(sim: dict) -> list[str]:
    """The projection's model in words: links, the codec's charged time and speed, ``auto``'s rule."""
    links = sim["links"]
    lines = [f"projected time (model, not measured): NVLink {links['nvl_gbps']:g} GB/s "
             f"+{links['nvl_latency_us']:g} us within {links['ranks_per_node']}-GPU nodes, "
             f"RDMA {links['rdma_gbps']:g} GB/s +{links['rdma_latency_us']:g} us between"]
    codec = sim.get("codec")
    if codec:
        lines.append("lossless codec time charged serially, as ep_comm codes messages (all encoded before the "
                     "exchange, decoded after it): max over ranks of raw bytes sent / encode + transfer + max "
                     "of raw bytes received / decode")
        lines.append(f"codec speed: encode {fmt_gbps(codec['encode_gbps'])}, decode "
                     f"{fmt_gbps(codec['decode_gbps'])} of raw bytes ({codec['source']}); "
                     f"--codec-gbps ENC,DEC projects another codec, e.g. the GPU kernels")
    for mode, d in (sim.get("auto") or {}).items():
        even = ", ".join(f"{_LINK_NAMES[c]} {fmt_gbps(g)}" for c, g in d["break_even_gbps"].items())
        picks = ", ".join(f"{_LINK_NAMES[c]} {choice}" for c, choice in d["choice"].items())
        lines.append(f"auto ({mode}): rho {d['ratio']:.3f} ({d['ratio_source']}); compresses when (1 - rho) / L "
                     f"> 1 / enc + 1 / dec; break-even encode = decode: {even}; picks {picks}")
    return lines


_LINK_NAMES = {"nvlink": "NVLink", "rdma": "RDMA"}


def print_simulation(sim: dict, console: Console) -> None:
    for line in simulation_header(sim):
        console.print(line)
    table = Table()
    cols = ["EP", "nodes", "mode", "codec", "dispatch", "combine", "total", "vs none", "bottleneck"]
    with_auto = bool(sim.get("auto"))
    cols += ["auto picks"] if with_auto else []
    for col in cols:
        table.add_column(col, justify="left" if col in ("mode", "codec", "bottleneck", "auto picks") else "right")
    base = {(r["ep"], r["mode"]): r["total_us"] for r in sim["rows"] if r["codec"] == "none"}
    for r in sim["rows"]:
        ref = base.get((r["ep"], r["mode"]))
        codec = r["codec"]
        if codec == "auto":
            codec += f" ({r.get('dispatch_choice', '-')}/{r.get('combine_choice', '-')})"
        mode = r["mode"] + (f" ({r['dispatch_transfer']})" if "dispatch_transfer" in r else "")
        cells = [str(r["ep"]), str(r["nodes"]), mode, codec,
                 fmt_time(r.get("dispatch_us", 0.0)), fmt_time(r.get("combine_us", 0.0)),
                 fmt_time(r["total_us"]), f"{r['total_us'] / ref:.2f}x" if ref else "-",
                 f"{r.get('dispatch_bottleneck', '-')}/{r.get('combine_bottleneck', '-')}"]
        if with_auto:
            by_link = r.get("auto_by_link") or {}
            cells.append(", ".join(f"{_LINK_NAMES[c]} {v}" for c, v in by_link.items()) or "-")
        table.add_row(*cells)
    console.print(table)
    if with_auto:
        console.print("  auto (d/c): the codec auto picks for dispatch / combine, by the rule at the bandwidth of "
                      "the link bounding the uncompressed op; auto picks: the rule's pick on each link class the "
                      "op uses; bottleneck codec: the codec's serial time exceeds the transfer's")
    if any("dispatch_transfer" in r for r in sim["rows"]):
        console.print("  low-latency (fixed): T + 1 slots to every peer; (needed): only the real rows, after a "
                      "count exchange (ep_comm.low_latency.choose_transfer)")
    for c in sim["coefficients"]:
        console.print(f"  {c['mode']}/{c['codec']} {c['op']}: {c['bytes_per_unit']:,.1f} B per {c['unit']} "
                      f"unit (fit error {c['fit_error']:.1%})")
    for s in sim["skipped"]:
        console.print(f"  skipped {s}")
