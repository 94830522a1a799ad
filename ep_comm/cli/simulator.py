"""``--simulate``: projects measured wire bytes onto EP clusters of 8 to 256 GPUs.

Traffic model (from the measured run, per mode, codec and op). Every rank ``r`` sends rank ``s``

    bytes(r -> s) = b_op * units_op(r, s)   (dispatch, combine, low-latency combine)
    bytes(r -> s) = a_op                    (low-latency dispatch in fixed-capacity blocks)

where ``units`` counts the rows the algorithm moves: for dispatch the tokens of ``r`` with at least
one expert on ``s`` (token-rank pairs); for normal combine the same pairs in the reverse direction
(``s`` returns one row per token it received from ``r``); for low-latency combine the (token,
expert) pairs of ``r``'s tokens whose expert lives on ``s``. ``b_op`` is the measured wire bytes
divided by the measured units (summed over all ranks and peers: it carries the codec's compression
and the per-row metadata); ``a_op`` is the measured mean bytes per peer. At the target EP size
``P`` the units come from the same router generator (same tokens per rank, top-k, seed) over
``E_sim`` experts (``--sim-experts``, default 256 as in DeepSeek-V3), ``E_sim / P`` per rank.
``fit_error`` reports how far the model is from the measured bytes at the measured size.

Low-latency dispatch sends each peer either ``T + 1`` fixed slots (``T`` tokens per rank, the last
slot its count) or, when ``ep_comm.low_latency.choose_transfer`` takes the needed rows at that
EP size (``P > 2 K``), one row per token-rank pair after a count exchange. Both move rows of the
same size, so a row's bytes measured in one transfer (``a_op / (T + 1)``, or ``b_op``) price the
other; the needed rows pay one more latency of the link class that bounds the op (the counts).

Time model. Ranks ``r`` and ``s`` share a node when ``r // G == s // G`` (``G`` = GPUs per node,
default 8); a rank's own bytes cost nothing. Each GPU has one NVLink port (bandwidth ``B_nvl``,
latency ``a_nvl``; default 450 GB/s one way, 2 us) and one NIC (``B_rdma``, ``a_rdma``; default
400 Gb/s = 50 GB/s, 5 us), full duplex, used concurrently. With ``S_c(r)`` / ``R_c(r)`` the bytes
``r`` sends / receives over link class ``c``:

    t_c(r) = a_c + max(S_c(r), R_c(r)) / B_c     (0 when r moves nothing over c)
    T_op   = max over r of max(t_nvl(r), t_rdma(r))

so an op lasts as long as the busiest port of the busiest GPU. The model ignores compute, kernel
launch, congestion and DeepEP-style forwarding of inter-node traffic through NVLink; it is a
bandwidth/latency projection of the bytes, not a measurement.

Codec time. ep_comm codes lossless messages serially with the transfer: ``payload.pack`` encodes
every destination's message (its own included) before the size and payload exchanges, and
``payload.unpack`` decodes every source's message after the payload exchange has completed
(``normal.dispatch`` / ``normal.combine``); nothing overlaps, and the collectives line the ranks
up. With ``raw(r, s)`` the bytes before the codec (projected like the wire bytes, from the measured
raw bytes per unit) and ``enc`` / ``dec`` the codec's throughputs on raw bytes, an op whose
messages are lossless-coded lasts

    T_op = max_r sum_s raw(r, s) / enc  +  T_link(wire)  +  max_r sum_s raw(s, r) / dec

and ``T_link`` as above. ``enc`` / ``dec`` come from ``--codec-gbps`` or are measured when the
projection starts (:func:`codec_speed`). FP8's quantisation is not charged.

``auto``. Per mode with lossless-coded traffic, ``rho`` = measured wire / raw bytes of its lossless
messages (dispatch and combine together, as the Buffer's running ratio mixes them). Per link class
carrying traffic at an EP size, ``auto`` would compress when
``ep_comm.codecs.auto.compression_pays(B_c, rho, enc, dec)``, the rule the Buffer applies. The
``auto`` row's ops take, each, the codec that rule picks for the link class bounding the op's
uncompressed projection (the bandwidth to give ``Buffer.auto_codec.link_gbps`` on that cluster),
and that codec's projected time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs import auto
from ..low_latency import choose_transfer
from .config import CODECS, MODES, BenchConfig
from .routing import make_routing

UNITS = {("normal", "dispatch"): ("token-rank", False), ("normal", "combine"): ("token-rank", True),
         ("low-latency", "dispatch"): ("per-peer", False), ("low-latency", "combine"): ("token-expert", True)}
"""``(mode, op) -> (unit kind, reverse)``; ``reverse``: the bytes flow from the experts' owner back
to the token's rank, opposite to the units' direction."""



def unit_kind(mode: str, op: str, num_ranks: int, topk: int) -> tuple[str, bool]:
    """``(unit kind, reverse)`` of ``(mode, op)`` at ``num_ranks`` ranks: :data:`UNITS`, except a
    low-latency dispatch that sends only the needed rows there (one row per token-rank pair)."""
    if (mode, op) == ("low-latency", "dispatch") and choose_transfer("auto", num_ranks, topk) == "needed":
        return "token-rank", False
    return UNITS[(mode, op)]


def rescale(coef: float, kind: str, to_kind: str, tokens: int) -> float:
    """``coef`` bytes per ``kind`` unit as bytes per ``to_kind`` unit, for the two low-latency
    dispatch transfers: a fixed block (``per-peer``) is ``tokens + 1`` rows, a needed row one."""
    if kind == to_kind:
        return coef
    if (kind, to_kind) == ("per-peer", "token-rank"):
        return coef / (tokens + 1)
    if (kind, to_kind) == ("token-rank", "per-peer"):
        return coef * (tokens + 1)
    raise ValueError(f"no conversion from {kind!r} to {to_kind!r} units")


OPS = ("dispatch", "combine")
LINK_CLASSES = ("nvlink", "rdma")
SAMPLE_BYTES = 4 << 20
"""Size of the bf16 sample the host or device codec is timed on when the projection starts."""


@dataclass(frozen=True)
class Traffic:
    """One measured op: ``[R, R]`` bytes rank ``r`` sent rank ``s`` on the wire and before the
    codec (sender-major), and the codec its messages used (``auto`` resolved to what it chose)."""

    wire: torch.Tensor
    raw: torch.Tensor
    codec: str


@dataclass(frozen=True)
class CodecSpeed:
    """The lossless codec's throughputs on raw bytes (GB/s) and where they come from (printed)."""

    encode_gbps: float
    decode_gbps: float
    source: str


def codec_speed(cfg: BenchConfig, device: torch.device | str = "cpu", threads: int | None = None) -> CodecSpeed:
    """``--codec-gbps`` when given; else the lossless codec timed now on a ``SAMPLE_BYTES`` bf16
    sample shaped like the run's tokens (standard normal, ``cfg.hidden`` wide), where the run's
    payload on ``device`` is coded: the GPU codec kernels when built for it, else the host codec
    with ``threads`` CPU threads (the ranks' count; None = this process's)."""
    if cfg.codec_gbps is not None:
        enc, dec = cfg.codec_gbps
        return CodecSpeed(enc, dec, "given by --codec-gbps")
    from ..codecs import lossless

    where = auto.codec_place(device)
    on_host = where.type == "cpu"
    threads = (threads or lossless.message_threads()) if on_host else None
    rows = max(1, SAMPLE_BYTES // (cfg.hidden * 2))
    gen = torch.Generator().manual_seed(cfg.seed)
    sample = torch.randn(rows, cfg.hidden, generator=gen).to(torch.bfloat16).to(where)
    enc, dec = auto.measure_codec_gbps(sample, threads=threads, repeats=3)
    mib = sample.numel() * 2 / 2**20
    if on_host:
        what = f"host codec on the CPU, {threads} thread{'s' if threads != 1 else ''} per rank as the measured ranks"
    else:
        what = f"GPU codec kernels on {where}"
    return CodecSpeed(enc, dec, f"measured here at the start of the projection: {what}, {mib:.1f} MiB bf16 sample")


@dataclass(frozen=True)
class Links:
    """Per-GPU link bandwidths (bytes/s, one way) and latencies (s)."""

    nvl_bw: float
    rdma_bw: float
    nvl_latency: float
    rdma_latency: float
    ranks_per_node: int

    @staticmethod
    def from_config(cfg: BenchConfig) -> "Links":
        return Links(cfg.nvl_gbps * 1e9, cfg.rdma_gbps * 1e9, cfg.nvl_latency_us * 1e-6,
                     cfg.rdma_latency_us * 1e-6, cfg.ranks_per_node)


def op_time(bytes_matrix: torch.Tensor, links: Links) -> tuple[float, str]:
    """``(seconds, bottleneck link)`` of one op whose rank ``r`` sends ``bytes_matrix[r, s]``."""
    b = bytes_matrix.to(torch.float64).clone()
    b.fill_diagonal_(0)
    num = b.shape[0]
    node = torch.arange(num) // links.ranks_per_node
    same = node[:, None] == node[None, :]
    best, where = 0.0, "none"
    for name, mask, bw, lat in (("nvlink", same, links.nvl_bw, links.nvl_latency),
                                ("rdma", ~same, links.rdma_bw, links.rdma_latency)):
        m = b * mask
        busiest = torch.maximum(m.sum(1), m.sum(0))  # send, receive per rank
        t = torch.where(busiest > 0, lat + busiest / bw, torch.zeros_like(busiest))
        if float(t.max()) > best:
            best, where = float(t.max()), name
    return best, where


def units(topk_idx: torch.Tensor, num_experts: int, kind: str) -> torch.Tensor:
    """``[P, P]`` float64 units of ``kind`` from all ranks' ``topk_idx [P, N, K]``."""
    num_ranks = topk_idx.shape[0]
    owner = torch.where(topk_idx >= 0, topk_idx.clamp(min=0) // (num_experts // num_ranks),
                        torch.full_like(topk_idx, num_ranks))
    hits = torch.zeros(*topk_idx.shape[:2], num_ranks + 1, dtype=torch.float64)
    hits.scatter_add_(2, owner, torch.ones_like(owner, dtype=torch.float64))
    hits = hits[..., :num_ranks]
    if kind == "token-rank":
        return (hits > 0).sum(1).to(torch.float64)
    if kind == "token-expert":
        return hits.sum(1)
    if kind == "per-peer":
        return torch.ones(num_ranks, num_ranks, dtype=torch.float64)
    raise ValueError(f"unknown unit kind {kind!r}")


def routing_at(cfg: BenchConfig, num_ranks: int, num_experts: int) -> torch.Tensor:
    """``[P, N, K]`` routing of ``num_ranks`` ranks over ``num_experts`` under ``cfg``'s generator."""
    return torch.stack([make_routing(cfg, r, num_experts=num_experts)[0] for r in range(num_ranks)])


def bytes_from_units(u: torch.Tensor, coef: float, reverse: bool) -> torch.Tensor:
    """``bytes[r, s]`` sent by rank ``r`` to ``s``; combines flow opposite to their units."""
    b = u * coef
    return b.t().contiguous() if reverse else b


def fit(measured: torch.Tensor, u: torch.Tensor, reverse: bool) -> tuple[float, float]:
    """``(coefficient, fit_error)`` from a measured ``[R, R]`` bytes matrix (sender-major).

    ``fit_error`` = max over peers of ``|model - measured|`` / mean measured bytes per peer.
    """
    flows = measured.to(torch.float64)
    total_units = float(u.sum())
    coef = float(flows.sum()) / total_units if total_units else 0.0
    model = bytes_from_units(u, coef, reverse)
    mean = float(measured.to(torch.float64).mean()) or 1.0
    return coef, float((model - measured.to(torch.float64)).abs().max()) / mean


def codec_time(raw: torch.Tensor, codec: CodecSpeed) -> float:
    """Seconds of serial codec work in one op whose rank ``r`` codes ``raw[r, s]`` bytes for ``s``:
    the slowest encoder (all it sends, its own rows included) plus the slowest decoder (all it
    receives)."""
    b = raw.to(torch.float64)
    encode = float(b.sum(1).max()) / (codec.encode_gbps * 1e9) if b.numel() else 0.0
    decode = float(b.sum(0).max()) / (codec.decode_gbps * 1e9) if b.numel() else 0.0
    return encode + decode


def links_used(bytes_matrix: torch.Tensor, links: Links) -> list[str]:
    """The link classes that carry any of ``bytes_matrix`` between distinct ranks."""
    num = bytes_matrix.shape[0]
    node = torch.arange(num) // links.ranks_per_node
    same = node[:, None] == node[None, :]
    off_diag = bytes_matrix.to(torch.float64) * ~torch.eye(num, dtype=torch.bool)
    return [name for name, mask in (("nvlink", same), ("rdma", ~same)) if float((off_diag * mask).sum()) > 0]


def link_gbps(cfg: BenchConfig, link: str) -> float:
    return {"nvlink": cfg.nvl_gbps, "rdma": cfg.rdma_gbps}[link]


def _as_traffic(value: Traffic | torch.Tensor) -> Traffic:
    """A bare bytes matrix is projected as bytes alone: no codec time, its raw bytes its wire bytes."""
    return value if isinstance(value, Traffic) else Traffic(value, value, "none")


def _mode_ratio(traffic: dict[tuple[str, str, str], Traffic], mode: str) -> tuple[float, str]:
    """``(rho, "measured" | "assumed")``: wire / raw bytes of ``mode``'s lossless-coded traffic,
    else the Buffer's expected ratio before any lossless message."""
    coded = [t for (m, _, _), t in traffic.items() if m == mode and t.codec == "lossless"]
    raw = sum(float(t.raw.to(torch.float64).sum()) for t in coded)
    if raw > 0:
        return sum(float(t.wire.to(torch.float64).sum()) for t in coded) / raw, "measured"
    return auto.AutoCodecPolicy().expected_ratio, "assumed"


def simulate(cfg: BenchConfig, measured: dict[tuple[str, str, str], Traffic | torch.Tensor],
             codec: CodecSpeed | None = None) -> dict:
    """Projects every measured ``(mode, codec, op)`` traffic onto ``cfg.sim_ep``.

    ``measured`` values are :class:`Traffic`, or bare ``[R, R]`` wire-byte matrices projected as
    bytes alone (no codec time, whatever the case's name). ``codec``: the lossless codec's speed
    (None: :func:`codec_speed` of ``cfg`` on this process's CPU, when any traffic needs it). A
    measured ``auto`` case, and any mode with lossless-coded traffic, gets an ``auto`` row
    (module docstring).

    Returns ``{"links", "codec", "auto", "coefficients", "rows", "skipped", "experts"}``.
    """
    links = Links.from_config(cfg)
    traffic = {key: _as_traffic(value) for key, value in measured.items()}
    here = routing_at(cfg, cfg.ranks, cfg.experts)
    wire_coef: dict[tuple[str, str, str], float] = {}
    raw_coef: dict[tuple[str, str, str], float] = {}
    coef_rows = []
    for key, t in sorted(traffic.items()):
        mode, name, op = key
        kind, reverse = unit_kind(mode, op, cfg.ranks, cfg.topk)
        u = units(here, cfg.experts, kind)
        wire_coef[key], err = fit(t.wire, u, reverse)
        raw_coef[key] = fit(t.raw, u, reverse)[0]
        coef_rows.append({"mode": mode, "codec": name, "op": op, "unit": kind, "reverse": reverse,
                          "bytes_per_unit": wire_coef[key], "raw_bytes_per_unit": raw_coef[key],
                          "codec_used": t.codec, "fit_error": err})
    auto_modes = [m for m in MODES if any(k[0] == m and (k[1] == "auto" or t.codec == "lossless")
                                          for k, t in traffic.items())]
    if codec is None and auto_modes:
        codec = codec_speed(cfg)
    decisions = {mode: _decision(cfg, *_mode_ratio(traffic, mode), codec) for mode in auto_modes}
    cases = [(m, c) for m in MODES for c in CODECS
             if any(k[:2] == (m, c) for k in traffic) or (c == "auto" and m in auto_modes)]
    rows, skipped = [], []
    for ep in cfg.sim_ep:
        if cfg.sim_experts % ep:
            skipped.append(f"EP {ep}: {cfg.sim_experts} experts are not divisible by {ep}")
            continue
        at = _Projection(links, traffic, wire_coef, raw_coef, decisions, codec,
                         routing_at(cfg, ep, cfg.sim_experts), cfg.sim_experts, cfg)
        for mode, name in cases:
            row = {"ep": ep, "nodes": -(-ep // links.ranks_per_node), "mode": mode, "codec": name}
            total = 0.0
            for op in OPS:
                got = at.auto_op(mode, op) if name == "auto" else at.op(mode, op, name)
                if got is None:
                    continue
                row[f"{op}_us"] = got["us"]
                row[f"{op}_bottleneck"] = got["bottleneck"]
                if got["codec_us"]:
                    row[f"{op}_codec_us"] = got["codec_us"]
                if "choice" in got:
                    row[f"{op}_choice"] = got["choice"]
                if "transfer" in got:
                    row[f"{op}_transfer"] = got["transfer"]
                if mode in decisions and (name == "auto" or traffic[(mode, name, op)].codec == "lossless"):
                    by_link = row.setdefault("auto_by_link", {})
                    for link in got["links"]:
                        by_link[link] = decisions[mode]["choice"][link]
                total += got["us"]
            row["total_us"] = total
            rows.append(row)
    return {"experts": cfg.sim_experts, "links": {"nvl_gbps": cfg.nvl_gbps, "rdma_gbps": cfg.rdma_gbps,
                      "nvl_latency_us": cfg.nvl_latency_us, "rdma_latency_us": cfg.rdma_latency_us,
                      "ranks_per_node": cfg.ranks_per_node},
            "codec": None if codec is None else {
                "encode_gbps": codec.encode_gbps, "decode_gbps": codec.decode_gbps, "source": codec.source,
                "charged": "serial"},
            "auto": decisions, "coefficients": coef_rows, "rows": rows, "skipped": skipped}


def _decision(cfg: BenchConfig, rho: float, source: str, codec: CodecSpeed) -> dict:
    """What ``auto`` decides on each link class for a mode of compression ratio ``rho``."""
    return {"ratio": rho, "ratio_source": source,
            "break_even_gbps": {c: auto.break_even_gbps(link_gbps(cfg, c), rho) for c in LINK_CLASSES},
            "choice": {c: "lossless" if auto.compression_pays(link_gbps(cfg, c), rho, codec.encode_gbps,
                                                              codec.decode_gbps) else "none"
                       for c in LINK_CLASSES}}


@dataclass
class _Projection:
    """The measured traffic projected onto one EP size (its routing ``routing [P, N, K]``)."""

    links: Links
    traffic: dict[tuple[str, str, str], Traffic]
    wire_coef: dict[tuple[str, str, str], float]
    raw_coef: dict[tuple[str, str, str], float]
    decisions: dict[str, dict]
    codec: CodecSpeed | None
    routing: torch.Tensor
    num_experts: int
    measured: BenchConfig
    """The measured run's configuration (its ranks, tokens and top-k)."""

    def __post_init__(self) -> None:
        self._units: dict[str, torch.Tensor] = {}

    def op(self, mode: str, op: str, name: str, coded: str | None = None) -> dict | None:
        """``{"us", "codec_us", "bottleneck", "links"}`` of ``(mode, name, op)``'s traffic: as
        measured (``coded`` None), sent raw (``"none"``), or lossless-coded (``"lossless"``: at
        the mode's ratio when the measured messages were not coded); None when not measured."""
        key = (mode, name, op)
        if key not in self.traffic:
            return None
        cfg = self.measured
        measured_kind = unit_kind(mode, op, cfg.ranks, cfg.topk)[0]
        kind, reverse = unit_kind(mode, op, self.routing.shape[0], cfg.topk)
        if kind not in self._units:
            self._units[kind] = units(self.routing, self.num_experts, kind)
        t = self.traffic[key]
        raw = bytes_from_units(self._units[kind], rescale(self.raw_coef[key], measured_kind, kind, cfg.tokens),
                               reverse)
        used = coded or t.codec
        if used == "none" and t.codec != "none":
            wire = raw
        elif used == "lossless" and t.codec != "lossless":
            wire = raw * self.decisions[mode]["ratio"]
        else:
            wire = bytes_from_units(self._units[kind], rescale(self.wire_coef[key], measured_kind, kind, cfg.tokens),
                                    reverse)
        link_s, where = op_time(wire, self.links)
        got = {}
        if (mode, op) == ("low-latency", "dispatch"):
            got["transfer"] = "needed" if kind == "token-rank" else "fixed"
            if kind == "token-rank" and where in LINK_CLASSES:  # the count exchange before the rows
                link_s += {"nvlink": self.links.nvl_latency, "rdma": self.links.rdma_latency}[where]
        spent = codec_time(raw, self.codec) if used == "lossless" and self.codec is not None else 0.0
        return {"us": (link_s + spent) * 1e6, "codec_us": spent * 1e6,
                "bottleneck": "codec" if spent > link_s else where, "links": links_used(wire, self.links), **got}

    def auto_op(self, mode: str, op: str) -> dict | None:
        """``auto``'s projection of one op: the codec the rule picks at the bandwidth of the link
        class bounding the uncompressed op, with that codec's projected time."""
        names = [n for n in ("none", "lossless", "auto") if (mode, n, op) in self.traffic]
        if not names:
            return None
        plain = self.op(mode, op, names[0], "none")
        choice = self.decisions[mode]["choice"].get(plain["bottleneck"], "none")
        got = plain
        if choice == "lossless":
            coded = [n for n in names if self.traffic[(mode, n, op)].codec == "lossless"]
            got = self.op(mode, op, (coded or names)[0], "lossless")
        return {**got, "links": plain["links"], "choice": choice}
