"""ep-bench's settings: one dataclass, its command line, and the checks that reject impossible shapes.

Every check raises ``ConfigError`` naming the option and the numbers, so ``ep-bench`` fails before
it spawns a single rank.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass

MODES = ("normal", "low-latency")
CODECS = ("none", "fp8", "lossless", "auto")
LOW_LATENCY_CODECS = ("none", "fp8")
ROUTINGS = ("uniform", "zipf", "group-limited")
LAUNCHERS = ("auto", "local", "torchrun")
BACKENDS = ("auto", "torch", "nvshmem")
SIMULATED_EP = (8, 16, 32, 64, 128, 256)


class ConfigError(ValueError):
    """An impossible or unsupported combination of options."""


@dataclass
class BenchConfig:
    """One ep-bench run.

    The defaults are DeepSeek-V3's MoE layer scaled to 4 CPU ranks: hidden 7168 bf16, top-8
    routing, 16 experts per rank (DeepSeek-V3's 256 experts at EP 16; 64 experts over 4 ranks here),
    128 tokens per rank (a decode step; DeepEP's low-latency test size).

    Attributes:
        tokens: tokens per rank ``N`` (also the low-latency capacity per rank).
        hidden: hidden size ``H`` (bf16 elements per token).
        experts: global experts ``E`` (a multiple of ``ranks``).
        topk: experts per token ``K``.
        ranks: local ranks to spawn (``--launcher local``); under torchrun, ``WORLD_SIZE``.
        modes: ``normal`` and/or ``low-latency``.
        codecs: dispatch codecs to measure (combine uses ``lossless`` with ``lossless``/``auto``
            and ``none`` otherwise); low-latency mode measures only ``none`` and ``fp8``.
        routing: ``uniform``, ``zipf`` (skewed expert popularity) or ``group-limited``
            (DeepSeek-V3's node-limited top-k: top ``topk_groups`` of ``num_groups`` groups).
        zipf_s: Zipf exponent of expert popularity.
        num_groups / topk_groups: group-limited routing's expert groups and groups per token.
        warmup / iters: untimed and timed iterations.
        seed: seed of the data and routing.
        json_path / plot_path: where to write the report / the PNG.
        check: verify every result against a single-process reference.
        launcher: ``local`` spawns ``ranks`` CPU processes over gloo; ``torchrun`` joins the
            job torchrun started; ``auto`` picks torchrun when its environment is present.
        backend: ``Buffer(backend=...)``.
        simulate: project the measured wire bytes onto EP 8..256 clusters.
        sim_ep / sim_experts: the projected EP sizes and the experts of the projected model
            (default 256, DeepSeek-V3's count).
        codec_gbps: ``(encode, decode)`` GB/s of raw bytes that ``--simulate`` charges the lossless
            codec; None = measure the codec where the run's payload is coded (see
            ``ep_comm.cli.simulator.codec_speed``).
        timeout_s: ``Buffer(timeout_s=...)``.
        node_aware: ``P`` > 0 runs normal mode node-aware: ``Buffer(ranks_per_node=P)``, the
            ranks grouped into virtual nodes of ``P`` consecutive ranks, plus a flat Buffer on the
            same data for the inter-node bytes comparison; 0 (default) = flat only. Low-latency
            mode stays flat. Unrelated to ``ranks_per_node``, which only shapes the
            ``--simulate`` model.
    """

    tokens: int = 128
    hidden: int = 7168
    experts: int = 64
    topk: int = 8
    ranks: int = 4
    modes: tuple[str, ...] = MODES
    codecs: tuple[str, ...] = ("none",)
    routing: str = "uniform"
    zipf_s: float = 1.2
    num_groups: int = 8
    topk_groups: int = 4
    warmup: int = 2
    iters: int = 10
    seed: int = 0
    json_path: str | None = None
    plot_path: str | None = None
    check: bool = False
    launcher: str = "auto"
    backend: str = "auto"
    simulate: bool = False
    sim_ep: tuple[int, ...] = SIMULATED_EP
    sim_experts: int = 256
    nvl_gbps: float = 450.0
    rdma_gbps: float = 50.0
    nvl_latency_us: float = 2.0
    rdma_latency_us: float = 5.0
    ranks_per_node: int = 8
    codec_gbps: tuple[float, float] | None = None
    timeout_s: float = 60.0
    quiet: bool = False
    node_aware: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def local_experts(self) -> int:
        return self.experts // self.ranks

    def mode_codecs(self, mode: str) -> list[str]:
        """The codecs measured in ``mode`` (low-latency mode has no lossless/auto codec)."""
        if mode == "low-latency":
            return [c for c in self.codecs if c in LOW_LATENCY_CODECS]
        return list(self.codecs)

    def validate(self) -> None:
        """Raises ``ConfigError`` for an impossible shape or option."""
        _positive(tokens=self.tokens, hidden=self.hidden, experts=self.experts, topk=self.topk,
                  ranks=self.ranks, iters=self.iters)
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if self.experts % self.ranks:
            raise ConfigError(f"--experts ({self.experts}) must be divisible by the number of ranks "
                              f"({self.ranks}): each rank owns experts/ranks experts")
        if self.topk > self.experts:
            raise ConfigError(f"--topk ({self.topk}) cannot exceed --experts ({self.experts})")
        for name, values, allowed in (("--mode", self.modes, MODES), ("--codec", self.codecs, CODECS)):
            if not values:
                raise ConfigError(f"{name} needs at least one value")
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ConfigError(f"{name}: unknown value(s) {bad}; choose from {list(allowed)}")
        if "low-latency" in self.modes and not self.mode_codecs("low-latency"):
            raise ConfigError(f"low-latency mode supports --codec {' or '.join(LOW_LATENCY_CODECS)}, "
                              f"got {list(self.codecs)}; add one of them or drop low-latency from --mode")
        uses_fp8 = "fp8" in self.codecs
        if uses_fp8 and self.hidden % 128:
            raise ConfigError(f"--codec fp8 needs --hidden to be a multiple of 128 (one scale per 128 "
                              f"channels), got {self.hidden}")
        self._validate_routing()
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"--launcher must be one of {list(LAUNCHERS)}, got {self.launcher!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.backend == "nvshmem" and self.resolved_launcher() == "local":
            raise ConfigError("--backend nvshmem needs NVIDIA GPUs: run under torchrun, e.g. "
                              "torchrun --nproc-per-node 8 -m ep_comm.bench --backend nvshmem")
        if self.resolved_launcher() == "torchrun" and not _torchrun_env():
            raise ConfigError("--launcher torchrun: RANK/WORLD_SIZE/LOCAL_RANK are not set; start "
                              "ep-bench with torchrun --nproc-per-node N -m ep_comm.bench ...")
        if self.resolved_launcher() == "local" and self.ranks > 64:
            raise ConfigError(f"--ranks {self.ranks}: the local launcher spawns at most 64 processes")
        for name, value in (("--nvl-gbps", self.nvl_gbps), ("--rdma-gbps", self.rdma_gbps),
                            ("--ranks-per-node", self.ranks_per_node), ("--timeout", self.timeout_s)):
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.nvl_latency_us < 0 or self.rdma_latency_us < 0:
            raise ConfigError("link latencies must be >= 0")
        self._validate_node_aware()
        if not self.sim_ep or any(e <= 0 for e in self.sim_ep):
            raise ConfigError(f"--sim-ep must list positive EP sizes, got {list(self.sim_ep)}")
        self._validate_codec_gbps()
        self._validate_output_paths()
        if self.simulate:
            if self.sim_experts < self.topk:
                raise ConfigError(f"--sim-experts ({self.sim_experts}) cannot be below --topk ({self.topk})")
            if self.routing == "group-limited" and self.sim_experts % self.num_groups:
                raise ConfigError(f"--num-groups ({self.num_groups}) must divide --sim-experts "
                                  f"({self.sim_experts})")

    def _validate_routing(self) -> None:
        if self.routing not in ROUTINGS:
            raise ConfigError(f"--routing must be one of {list(ROUTINGS)}, got {self.routing!r}")
        if self.routing == "zipf" and self.zipf_s <= 0:
            raise ConfigError(f"--zipf-s must be positive, got {self.zipf_s}")
        if self.routing == "group-limited":
            if self.num_groups <= 0 or self.experts % self.num_groups:
                raise ConfigError(f"--num-groups ({self.num_groups}) must divide --experts "
                                  f"({self.experts})")
            if not 1 <= self.topk_groups <= self.num_groups:
                raise ConfigError(f"--topk-groups ({self.topk_groups}) must be in [1, --num-groups "
                                  f"({self.num_groups})]")
            reachable = self.topk_groups * (self.experts // self.num_groups)
            if self.topk > reachable:
                raise ConfigError(f"--topk ({self.topk}) exceeds the experts reachable through "
                                  f"{self.topk_groups} groups of {self.experts // self.num_groups} "
                                  f"({reachable})")

    def _validate_output_paths(self) -> None:
        """--json and --plot must name files that can be written, checked before any rank runs (on
        the rank that writes them: under torchrun, rank 0)."""
        if _torchrun_env() and os.environ.get("RANK") != "0":
            return
        for name, path in (("--json", self.json_path), ("--plot", self.plot_path)):
            if path is None:
                continue
            folder = os.path.dirname(os.path.abspath(path))
            if not path or os.path.isdir(path):
                raise ConfigError(f"{name} {path!r} is not a file name")
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise ConfigError(f"{name} {path!r}: {folder} is not a folder this process can write to")

    def unused_options(self, given: dict[str, object]) -> list[str]:
        """Options in ``given`` (name -> value, as set on the command line) that this run would not
        use: the --simulate model's without --simulate, a routing's without that --routing."""
        only = {"--sim-ep": "--simulate", "--sim-experts": "--simulate", "--nvl-gbps": "--simulate",
                "--rdma-gbps": "--simulate", "--nvl-latency-us": "--simulate",
                "--rdma-latency-us": "--simulate", "--zipf-s": "--routing zipf",
                "--num-groups": "--routing group-limited", "--topk-groups": "--routing group-limited"}
        needed = {"--simulate": self.simulate, "--routing zipf": self.routing == "zipf",
                  "--routing group-limited": self.routing == "group-limited"}
        return [f"{name} is used only with {only[name]}" for name in given if name in only and not needed[only[name]]]

    def _validate_codec_gbps(self) -> None:
        if self.codec_gbps is None:
            return
        if not self.simulate:
            raise ConfigError("--codec-gbps sets the codec speed of the --simulate projection; add --simulate")
        if len(self.codec_gbps) != 2 or not all(math.isfinite(v) and v > 0 for v in self.codec_gbps):
            raise ConfigError(f"--codec-gbps takes ENC,DEC: two positive finite GB/s figures, got "
                              f"{list(self.codec_gbps)}")

    def _validate_node_aware(self) -> None:
        p = self.node_aware
        if p == 0:
            return
        if p < 0:
            raise ConfigError(f"--node-aware must be a positive number of ranks per node, got {p}")
        if self.ranks % p:
            raise ConfigError(f"--node-aware {p} must divide the number of ranks ({self.ranks})")
        if self.ranks // p < 2:
            raise ConfigError(f"--node-aware {p} with {self.ranks} ranks makes a single node: no "
                              "inter-node traffic to compare; choose P <= ranks / 2")
        if "normal" not in self.modes:
            raise ConfigError("--node-aware applies to normal mode only (low-latency mode stays "
                              "flat); add normal to --mode")
        if self.simulate:
            raise ConfigError("--simulate models the flat exchange; run it without --node-aware")

    def resolved_launcher(self) -> str:
        if self.launcher != "auto":
            return self.launcher
        return "torchrun" if _torchrun_env() else "local"


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ConfigError(f"--{name} must be positive, got {value}")


def _torchrun_env() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _csv(kind: type, choices: tuple | None = None):
    def parse(text: str) -> tuple:
        items = [s.strip() for s in text.split(",") if s.strip()]
        if choices is not None and "both" in items:
            items = [c for c in choices if c not in items] + [c for c in items if c != "both"]
        return tuple(dict.fromkeys(kind(s) for s in items))  # repeated values once, order kept

    return parse


def _gbps_pair(text: str) -> tuple[float, float]:
    parts = [s.strip() for s in text.split(",")]
    try:
        values = tuple(float(s) for s in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ENC,DEC in GB/s, e.g. 400,500; got {text!r}") from None
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected two figures ENC,DEC in GB/s, got {text!r}")
    return values  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="ep-bench",
        description="Benchmark ep_comm's MoE dispatch/combine against a naive per-expert "
                    "all-to-all and the transport floor, measured in the same run.")
    shape = p.add_argument_group("problem")
    shape.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank (default %(default)s)")
    shape.add_argument("--hidden", type=int, default=d.hidden, help="hidden size (default %(default)s)")
    shape.add_argument("--experts", type=int, default=d.experts, help="global experts (default %(default)s)")
    shape.add_argument("--topk", type=int, default=d.topk, help="experts per token (default %(default)s)")
    shape.add_argument("--ranks", type=int, default=None,
                       help=f"local ranks to spawn (default {d.ranks}; WORLD_SIZE under torchrun)")
    shape.add_argument("--routing", choices=ROUTINGS, default=d.routing)
    shape.add_argument("--zipf-s", type=float, default=d.zipf_s, help="Zipf exponent (zipf routing)")
    shape.add_argument("--num-groups", type=int, default=d.num_groups, help="expert groups (group-limited)")
    shape.add_argument("--topk-groups", type=int, default=d.topk_groups,
                       help="groups per token (group-limited)")
    shape.add_argument("--seed", type=int, default=d.seed, help="seed of the data and routing")
    run = p.add_argument_group("run")
    run.add_argument("--mode", type=_csv(str, MODES), default=d.modes,
                     help="normal, low-latency or both (comma list; default both)")
    run.add_argument("--codec", type=_csv(str), default=None,
                     help="dispatch codec(s), comma list of none,fp8,lossless,auto (default none; "
                          "with --simulate: none,fp8,lossless)")
    run.add_argument("--warmup", type=int, default=d.warmup, help="untimed iterations (default %(default)s)")
    run.add_argument("--iters", type=int, default=d.iters, help="timed iterations (default %(default)s)")
    run.add_argument("--check", action="store_true", help="verify every result against a reference")
    run.add_argument("--launcher", choices=LAUNCHERS, default=d.launcher)
    run.add_argument("--backend", choices=BACKENDS, default=d.backend)
    run.add_argument("--timeout", dest="timeout_s", type=float, default=d.timeout_s,
                     help="seconds a rank waits for a peer")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--node-aware", type=int, default=d.node_aware, metavar="P",
                     help="run normal mode node-aware (two-hop) over virtual nodes of P consecutive "
                          "ranks, and the flat path on the same data for comparison; reports "
                          "inter-node bytes per token of both. Low-latency mode stays flat. Not "
                          "--ranks-per-node, which only shapes the --simulate model (default 0: off)")
    out = p.add_argument_group("output")
    out.add_argument("--json", dest="json_path", default=None, help="write the report as JSON")
    out.add_argument("--plot", dest="plot_path", default=None, help="write a PNG of the results")
    sim = p.add_argument_group("scale-out model (--simulate)")
    sim.add_argument("--simulate", action="store_true",
                     help="project the measured wire bytes onto EP 8..256 clusters, charging "
                          "lossless messages their codec time, with an auto row: what codec=auto "
                          "would pick there and its time")
    sim.add_argument("--sim-ep", type=_csv(int), default=d.sim_ep, help="EP sizes to project")
    sim.add_argument("--sim-experts", type=int, default=d.sim_experts,
                     help="experts of the projected model (default %(default)s)")
    sim.add_argument("--nvl-gbps", type=float, default=d.nvl_gbps,
                     help="NVLink GB/s per GPU, one way (default %(default)s)")
    sim.add_argument("--rdma-gbps", type=float, default=d.rdma_gbps,
                     help="RDMA GB/s per GPU, one way (default 50 = 400 Gb/s)")
    sim.add_argument("--nvl-latency-us", type=float, default=d.nvl_latency_us,
                     help="NVLink latency per op, assumed (default %(default)s)")
    sim.add_argument("--rdma-latency-us", type=float, default=d.rdma_latency_us,
                     help="RDMA latency per op, assumed (default %(default)s)")
    sim.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node,
                     help="GPUs per NVLink domain in the model (default %(default)s); does not "
                          "affect the measured run, see --node-aware")
    sim.add_argument("--codec-gbps", type=_gbps_pair, default=d.codec_gbps, metavar="ENC,DEC",
                     help="encode,decode GB/s of raw bytes charged to every lossless message: "
                          "serially, as ep_comm codes them (all messages encoded before the "
                          "exchange, decoded after it); also the speeds codec=auto's rule is "
                          "evaluated with. Default: measured at the start of the projection where "
                          "the run coded its payload (the GPU codec kernels when built for its "
                          "device, else the host codec with the ranks' threads); the projection's "
                          "header says which. Give the GPU kernels' figures to project a GPU codec "
                          "from a CPU run")
    return p


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    """Parses and validates ``argv``; exits with status 2 and a one-line reason when invalid."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    values = vars(ns)
    ranks = values.pop("ranks")
    mode = values.pop("mode")
    codec = values.pop("codec")
    cfg = BenchConfig(**values, modes=tuple(mode),
                      codecs=tuple(codec) if codec is not None else (("none", "fp8", "lossless")
                                                                     if ns.simulate else ("none",)))
    defaults = build_parser().parse_args([])
    given = {f"--{k.replace('_', '-')}": v for k, v in vars(ns).items() if v != getattr(defaults, k)}
    unused = cfg.unused_options(given)
    if unused:
        parser.error("; ".join(unused))
    if cfg.resolved_launcher() == "torchrun" and _torchrun_env():
        world = int(os.environ["WORLD_SIZE"])
        if ranks is not None and ranks != world:
            parser.error(f"--ranks {ranks} differs from torchrun's WORLD_SIZE {world}")
        cfg.ranks = world
    elif ranks is not None:
        cfg.ranks = ranks
    try:
        cfg.validate()
    except ConfigError as error:
        parser.error(str(error))
    return cfg
