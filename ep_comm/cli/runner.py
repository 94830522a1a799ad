"""The per-rank benchmark loop.

Every rank builds its inputs and Buffers, runs each case once untimed (to learn the wire bytes that
the transport-floor cases then replay, and to surface errors such as a missing codec), then runs
``warmup + iters`` rounds in which every case does one dispatch and one combine, interleaved so
that drifts in machine load hit all methods alike. Rank 0 collects everyone's samples.
"""
from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import check as ck
from .baselines import NaiveAllToAll
from .cases import OPS, Case, EpLowLatencyCase, EpNormalCase, FlatNormalCase, FloorCase, Inputs, NaiveCase
from .config import BenchConfig
from .routing import make_routing, make_tokens
from .timing import Clock

Progress = Callable[[str, int, int], None]
"""``progress(description, done, total)``, called on rank 0 only."""


def _buffer_sizes(cfg: BenchConfig, low_latency: bool) -> tuple[int, int]:
    """Buffer sizes for the NVSHMEM backend (the torch backend ignores them)."""
    import ep_comm

    hidden_bytes = cfg.hidden * 2
    if low_latency:
        return 0, int(ep_comm.Buffer.get_low_latency_rdma_size_hint(cfg.tokens, cfg.hidden, cfg.ranks,
                                                                  cfg.experts))
    nvl = ep_comm.Buffer.get_dispatch_config(cfg.ranks).get_nvl_buffer_size_hint(hidden_bytes, cfg.ranks)
    rdma = ep_comm.Buffer.get_dispatch_config(cfg.ranks).get_rdma_buffer_size_hint(hidden_bytes, cfg.ranks)
    return int(nvl), int(rdma)


def _make_buffer(cfg: BenchConfig, group: Any, low_latency: bool, ranks_per_node: int | None = None) -> Any:
    """A Buffer for one mode; ``ranks_per_node`` makes normal mode node-aware."""
    import ep_comm

    nvl, rdma = _buffer_sizes(cfg, low_latency)
    return ep_comm.Buffer(group, nvl, rdma, low_latency_mode=low_latency, backend=cfg.backend,
                          timeout_s=cfg.timeout_s, ranks_per_node=ranks_per_node)


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def _agree_errors(local: dict[str, str], names: list[str], group: Any) -> dict[str, str]:
    """Every rank's failures, merged: a case that failed anywhere is dropped everywhere."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    merged: dict[str, str] = {}
    for rank, errs in enumerate(everyone):
        for name in names:
            if name in errs and name not in merged:
                merged[name] = f"rank {rank}: {errs[name]}"
    return merged


def _run_once(case: Case) -> None:
    case.dispatch()
    case.between()
    case.combine()


def build_cases(cfg: BenchConfig, group: Any, inp: Inputs, device: torch.device,
                errors: dict[str, str]) -> tuple[list[Case], dict[str, str]]:
    """The ep_comm cases that ran once successfully, plus the naive baseline; ``errors`` gets
    ``{case name: reason}`` for the rest. With ``--node-aware P`` the normal-mode Buffer is
    node-aware and a flat Buffer runs the same normal-mode calls as the ``flat`` cases."""
    ep_cases: list[Case] = []
    backends: dict[str, str] = {}
    p = cfg.node_aware or None
    for mode in cfg.modes:
        normal = mode == "normal"
        try:
            buf = _make_buffer(cfg, group, not normal, p if normal else None)
            flat = _make_buffer(cfg, group, False) if normal and p else None
            backends[mode] = str(buf.backend)
        except Exception as error:  # noqa: BLE001 - reported, other modes still run
            for codec in cfg.mode_codecs(mode):
                errors[f"ep_comm/{mode}/{codec}"] = _error_text(error)
            continue
        for codec in cfg.mode_codecs(mode):
            ep_cases.append(EpNormalCase(buf, inp, codec, p) if normal
                            else EpLowLatencyCase(buf, inp, codec))
            if flat is not None:
                ep_cases.append(FlatNormalCase(flat, inp, codec, p))
    local: dict[str, str] = {}
    for case in ep_cases:
        try:
            _run_once(case)
        except Exception as error:  # noqa: BLE001 - e.g. a codec that is not built
            local[case.name] = _error_text(error)
    merged = _agree_errors(local, [c.name for c in ep_cases], group)
    errors.update(merged)
    ok = [c for c in ep_cases if c.name not in merged]
    naive = NaiveCase(NaiveAllToAll(group, cfg.experts, device), inp)
    _run_once(naive)
    return [naive, *ok], backends


def token_rank_pairs(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> int:
    """Number of (token, rank) pairs where the token has an expert on the rank."""
    owner = torch.where(topk_idx >= 0, topk_idx.clamp(min=0) // (num_experts // num_ranks),
                        torch.full_like(topk_idx, num_ranks))
    hit = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool)
    hit.scatter_(1, owner.cpu(), True)
    return int(hit[:, :num_ranks].sum())


def run_rank(cfg: BenchConfig, group: Any, device: torch.device, progress: Progress | None) -> dict | None:
    """Runs the benchmark on this rank; returns the raw results on rank 0 (None elsewhere)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    started = time.perf_counter()
    topk_idx, topk_weights = make_routing(cfg, rank)
    inp = Inputs(make_tokens(cfg, rank).to(device), topk_idx.to(device), topk_weights.to(device),
                 cfg.experts, rank, world)
    errors: dict[str, str] = {}
    if progress is not None:
        progress("first (untimed) run of every case", 0, 1)
    cases, backends = build_cases(cfg, group, inp, device, errors)
    cases += [FloorCase(c, group, device) for c in cases if c.method == "ep_comm"]
    for c in cases:
        if c.method == "floor":
            _run_once(c)
    g = ck.gather_inputs(inp.x, inp.topk_idx, inp.topk_weights, cfg.experts, group) if cfg.check else None
    samples: dict[str, dict[str, list[float]]] = {c.name: {op: [] for op in OPS} for c in cases}
    problems: dict[str, list[str]] = {c.name: [] for c in cases}
    checked: dict[str, int] = {c.name: 0 for c in cases}
    clock = Clock(device, group)
    rounds = cfg.warmup + cfg.iters
    total = rounds * len(cases)
    for it in range(rounds):
        for n, case in enumerate(cases):
            if progress is not None:
                phase = "warm-up" if it < cfg.warmup else "timed"
                progress(f"{phase} {it + 1}/{rounds}: {case.name}", it * len(cases) + n, total)
            t_d, _ = clock.time(case.dispatch)
            case.between()
            t_c, _ = clock.time(case.combine)
            if it >= cfg.warmup:
                samples[case.name]["dispatch"].append(t_d)
                samples[case.name]["combine"].append(t_c)
            if g is not None and case.method != "floor":
                problems[case.name] = (problems[case.name] + case.verify(g, rank))[:20]
                checked[case.name] += 1
    if progress is not None:
        progress("collecting", total, total)
    mine = {"rank": rank, "token_rank_pairs": token_rank_pairs(topk_idx, cfg.experts, world),
            "samples": samples, "problems": problems, "checked": checked,
            "wire": {c.name: c.wire for c in cases}}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if rank != 0:
        return None
    return {
        "cases": [{"name": c.name, "method": c.method, "mode": c.mode, "codec": c.codec} for c in cases],
        "errors": errors,
        "ranks": everyone,
        "environment": {
            "world_size": world, "device": str(device), "dist_backend": str(dist.get_backend(group)),
            "ep_comm_backend": backends, "torch": torch.__version__, "python": platform.python_version(),
            "host": platform.node(), "cpu_threads_per_rank": torch.get_num_threads(),
        },
        "rank0_wall_s": time.perf_counter() - started,
    }
