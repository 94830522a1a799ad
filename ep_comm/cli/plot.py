"""PNG figures (matplotlib, Agg backend): measured latencies, and the scale-out projection."""
from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHODS = (("ep_comm", "ep_comm"), ("naive", "naive all-to-all"), ("floor", "transport floor"))


def plot_results(report: dict, path: str | Path) -> Path:
    """Median latency (bars) with p10-p90 whiskers per (mode, codec) and op, for every method."""
    rows = [r for r in report["results"] if r["status"] == "ok"]
    ops = ("dispatch", "combine", "dispatch+combine")
    cases = sorted({(r["mode"], r["codec"]) for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4.2), squeeze=False)
    width = 0.8 / len(METHODS)
    for ax, op in zip(axes[0], ops):
        for m, (key, label) in enumerate(METHODS):
            meds, lo, hi = [], [], []
            for case in cases:
                row = next(r for r in rows if (r["mode"], r["codec"]) == case and r["op"] == op)
                lat = row[key]["latency_us"]
                meds.append(lat["median"] / 1e3)
                lo.append((lat["median"] - lat["p10"]) / 1e3)
                hi.append((lat["p90"] - lat["median"]) / 1e3)
            xs = [i + (m - 1) * width for i in range(len(cases))]
            ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label=label)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{mode}\n{codec}" for mode, codec in cases], fontsize=8)
        ax.set_title(op)
        ax.set_ylabel("latency, ms (median, p10-p90)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(report["problem"], fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_simulation(sim: dict, path: str | Path) -> Path:
    """Projected dispatch+combine time vs EP size, one line per (mode, codec)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), squeeze=False)
    series = sorted({(r["mode"], r["codec"]) for r in sim["rows"]})
    for ax, op in zip(axes[0], ("dispatch_us", "combine_us")):
        for mode, codec in series:
            pts = [(r["ep"], r.get(op, 0.0)) for r in sim["rows"] if (r["mode"], r["codec"]) == (mode, codec)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode} / {codec}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["ep"] for r in sim["rows"]}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_yscale("log")
        ax.set_xlabel("EP size (GPUs)")
        ax.set_ylabel("projected time, us")
        ax.set_title(op.replace("_us", ""))
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    links = sim["links"]
    fig.suptitle(f"model: NVLink {links['nvl_gbps']:g} GB/s within {links['ranks_per_node']}-GPU nodes, "
                 f"RDMA {links['rdma_gbps']:g} GB/s between (projection from measured bytes)", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def simulation_path(plot_path: str | Path) -> Path:
    """Where the projection's PNG goes next to ``--plot PATH``: ``PATH-stem_simulate.png``."""
    p = Path(plot_path)
    return p.with_name(f"{p.stem}_simulate{p.suffix or '.png'}")
