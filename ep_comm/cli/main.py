"""``ep-bench``: the command-line entry point (also ``python -m ep_comm.bench``).

Exit status: 0 on success, 1 when ``--check`` found a wrong result or a rank failed, 2 for invalid
options.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from .config import BenchConfig, parse_args
from .launch import LaunchError, run_local, run_torchrun
from .metrics import build_results, check_totals, wire_sent_matrix
from .report import build_report, print_results, problem_text


def measured_traffic(cfg: BenchConfig, raw: dict) -> dict:
    """``(mode, codec, op) -> Traffic``: the ``[R, R]`` wire and raw (before the codec) bytes every
    ep_comm case that ran sent, and the codec its messages used."""
    from .simulator import Traffic

    out = {}
    for case in raw["cases"]:
        if case["method"] == "ep_comm":
            for op in ("dispatch", "combine"):
                wire = torch.tensor(wire_sent_matrix(raw, case["name"], op), dtype=torch.float64)
                sent_raw = torch.tensor(wire_sent_matrix(raw, case["name"], op, "sent_raw"), dtype=torch.float64)
                used = raw["ranks"][0]["wire"][case["name"]][op].get("codec", case["codec"])
                out[(case["mode"], case["codec"], op)] = Traffic(wire, sent_raw, str(used))
    return out


def simulation(cfg: BenchConfig, raw: dict) -> dict:
    """The ``--simulate`` projection of the run; the lossless codec's speed is ``--codec-gbps`` or
    is timed now where the run coded its payload, with the ranks' CPU threads."""
    from .simulator import codec_speed, simulate

    traffic = measured_traffic(cfg, raw)
    speed = None
    if any(name == "auto" or t.codec == "lossless" for (_, name, _), t in traffic.items()):
        env = raw["environment"]
        speed = codec_speed(cfg, env.get("device", "cpu"), env.get("cpu_threads_per_rank"))
    return simulate(cfg, traffic, speed)


def finish(cfg: BenchConfig, raw: dict, started: float) -> dict:
    """Turns rank 0's raw results into the report; prints it and writes the requested files."""
    results, targets = build_results(cfg, raw)
    projection = simulation(cfg, raw) if cfg.simulate else None
    report = build_report(cfg, raw, results, targets, check_totals(cfg, raw), projection,
                          time.perf_counter() - started)
    print_results(report)
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {cfg.json_path}")
    if cfg.plot_path:
        from .plot import plot_results, plot_simulation, simulation_path

        print(f"wrote {plot_results(report, cfg.plot_path)}")
        if projection is not None and projection["rows"]:
            print(f"wrote {plot_simulation(projection, simulation_path(cfg.plot_path))}")
    return report


def run(cfg: BenchConfig) -> int:
    """Runs the benchmark described by ``cfg``; returns the exit status."""
    started = time.perf_counter()
    if not cfg.quiet and os.environ.get("RANK", "0") == "0":
        where = f"{cfg.ranks} local CPU ranks (gloo)" if cfg.resolved_launcher() == "local" else "torchrun"
        print(f"ep-bench: {problem_text(cfg)}; starting {where}", file=sys.stderr)
    try:
        raw = run_local(cfg) if cfg.resolved_launcher() == "local" else run_torchrun(cfg)
    except LaunchError as error:
        print(f"ep-bench: a rank failed:\n{error}", file=sys.stderr)
        return 1
    if raw is None:  # not rank 0 under torchrun
        return 0
    report = finish(cfg, raw, started)
    failed = report["check"].get("enabled") and not report["check"]["passed"]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    code = run(parse_args(argv))
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
