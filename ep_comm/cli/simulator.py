"""``--simulate``: projects measured wire bytes onto EP clusters of 8 to 256 GPUs.

Traffic model (from the measured run, per mode, codec and op). Every rank ``r`` sends rank ``s``

    bytes(r -> s) = b_op * units_op(r, s)   (dispatch, combine, low-latency combine)
    bytes(r -> s) = a_op                    (low-latency dispatch: fixed-capacity blocks)

where ``units`` counts the rows the algorithm moves: for dispatch the tokens of ``r`` with at least
one expert on ``s`` (token-rank pairs); for normal combine the same pairs in the reverse direction
(``s`` returns one row per token it received from ``r``); for low-latency combine the (token,
expert) pairs of ``r``'s tokens whose expert lives on ``s``. ``b_op`` is the measured wire bytes
divided by the measured units (summed over all ranks and peers: it carries the codec's compression
and the per-row metadata); ``a_op`` is the measured mean bytes per peer. At the target EP size
``P`` the units come from the same router generator (same tokens per rank, top-k, seed) over
``E_sim`` experts (``--sim-experts``, default 256 as in DeepSeek-V3), ``E_sim / P`` per rank.
``fit_error`` reports how far the model is from the measured bytes at the measured size.

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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import BenchConfig
from .routing import make_routing

UNITS = {("normal", "dispatch"): ("token-rank", False), ("normal", "combine"): ("token-rank", True),
         ("low-latency", "dispatch"): ("per-peer", False), ("low-latency", "combine"): ("token-expert", True)}
"""``(mode, op) -> (unit kind, reverse)``; ``reverse``: the bytes flow from the experts' owner back
to the token's rank, opposite to the units' direction."""


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


def simulate(cfg: BenchConfig, measured: dict[tuple[str, str, str], torch.Tensor]) -> dict:
    """Projects every measured ``(mode, codec, op) -> [R, R]`` bytes matrix onto ``cfg.sim_ep``.

    Returns ``{"links": ..., "coefficients": [...], "rows": [...], "skipped": [...]}``.
    """
    links = Links.from_config(cfg)
    here = routing_at(cfg, cfg.ranks, cfg.experts)
    coefs: dict[tuple[str, str, str], float] = {}
    coef_rows = []
    for (mode, codec, op), matrix in sorted(measured.items()):
        kind, reverse = UNITS[(mode, op)]
        coef, err = fit(matrix, units(here, cfg.experts, kind), reverse)
        coefs[(mode, codec, op)] = coef
        coef_rows.append({"mode": mode, "codec": codec, "op": op, "unit": kind, "reverse": reverse,
                          "bytes_per_unit": coef, "fit_error": err})
    rows, skipped = [], []
    for ep in cfg.sim_ep:
        if cfg.sim_experts % ep:
            skipped.append(f"EP {ep}: {cfg.sim_experts} experts are not divisible by {ep}")
            continue
        routing = routing_at(cfg, ep, cfg.sim_experts)
        cache: dict[str, torch.Tensor] = {}
        cases = sorted({(m, c) for m, c, _ in measured})
        for mode, codec in cases:
            row = {"ep": ep, "nodes": -(-ep // links.ranks_per_node), "mode": mode, "codec": codec}
            total = 0.0
            for op in ("dispatch", "combine"):
                if (mode, codec, op) not in coefs:
                    continue
                kind, reverse = UNITS[(mode, op)]
                if kind not in cache:
                    cache[kind] = units(routing, cfg.sim_experts, kind)
                t, where = op_time(bytes_from_units(cache[kind], coefs[(mode, codec, op)], reverse), links)
                row[f"{op}_us"] = t * 1e6
                row[f"{op}_bottleneck"] = where
                total += t
            row["total_us"] = total * 1e6
            rows.append(row)
    return {"experts": cfg.sim_experts, "links": {"nvl_gbps": cfg.nvl_gbps, "rdma_gbps": cfg.rdma_gbps,
                      "nvl_latency_us": cfg.nvl_latency_us, "rdma_latency_us": cfg.rdma_latency_us,
                      "ranks_per_node": cfg.ranks_per_node},
            "coefficients": coef_rows, "rows": rows, "skipped": skipped}
