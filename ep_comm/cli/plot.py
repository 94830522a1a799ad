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
    """Projected dispatch and combine time vs EP size, one line per (mode, codec); with lossless
    traffic, a third panel marks the break-even codec throughput per link class against the codec
    speed the projection charged."""
    codec = sim.get("codec")
    decisions = sim.get("auto") or {}
    panels = 3 if codec and decisions else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.2), squeeze=False)
    series = list(dict.fromkeys((r["mode"], r["codec"]) for r in sim["rows"]))
    for ax, op in zip(axes[0], ("dispatch_us", "combine_us")):
        for mode, name in series:
            pts = [(r["ep"], r.get(op, 0.0)) for r in sim["rows"] if (r["mode"], r["codec"]) == (mode, name)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="x" if name == "auto" else "o",
                    linestyle="--" if name == "auto" else "-", label=f"{mode} / {name}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["ep"] for r in sim["rows"]}))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_yscale("log")
        ax.set_xlabel("EP size (GPUs)")
        ax.set_ylabel("projected time, us")
        ax.set_title(op.replace("_us", ""))
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if panels == 3:
        _plot_break_even(axes[0][2], sim)
    links = sim["links"]
    title = (f"model: NVLink {links['nvl_gbps']:g} GB/s within {links['ranks_per_node']}-GPU nodes, "
             f"RDMA {links['rdma_gbps']:g} GB/s between (projection from measured bytes)")
    if codec:
        title += (f"\nlossless codec time charged serially, encode {codec['encode_gbps']:.3g} / decode "
                  f"{codec['decode_gbps']:.3g} GB/s:\n{codec['source']}")
    fig.suptitle(title, fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _plot_break_even(ax, sim: dict) -> None:
    """Bars: per mode and link class, the codec throughput (encode = decode) above which ``auto``
    compresses; lines: the encode and decode throughputs the projection charged."""
    decisions, codec = sim["auto"], sim["codec"]
    names = {"nvlink": "NVLink", "rdma": "RDMA"}
    labels, heights = [], []
    for mode, d in decisions.items():
        for link, gbps in d["break_even_gbps"].items():
            labels.append(f"{names.get(link, link)}\n{mode}, rho {d['ratio']:.2f}")
            heights.append(gbps if gbps != float("inf") else float("nan"))
    bars = ax.bar(range(len(labels)), heights, color="tab:gray", label="break-even (encode = decode)")
    for bar, gbps in zip(bars, heights):
        ax.annotate(f"{gbps:,.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7)
    ax.axhline(codec["encode_gbps"], color="tab:blue", linestyle="--", label="encode (charged)")
    ax.axhline(codec["decode_gbps"], color="tab:orange", linestyle=":", label="decode (charged)")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_yscale("log")
    shown = [h for h in heights if h == h] + [codec["encode_gbps"], codec["decode_gbps"]]
    ax.set_ylim(min(shown) / 4, max(shown) * 3)
    ax.set_ylabel("codec throughput, GB/s of raw bytes")
    ax.set_title("break-even codec speed per link\n(auto compresses when the codec is faster)", fontsize=9)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)


def simulation_path(plot_path: str | Path) -> Path:
    """Where the projection's PNG goes next to ``--plot PATH``: ``PATH-stem_simulate.png``."""
    p = Path(plot_path)
    return p.with_name(f"{p.stem}_simulate{p.suffix or '.png'}")
