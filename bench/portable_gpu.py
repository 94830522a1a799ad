"""The portable backend (``Buffer(backend="torch")``) on a GPU: results against the CPU reference,
and its cost against a bare ``all_to_all_single`` of the same bytes.

    python bench/portable_gpu.py [--device cuda|cpu] [--json out.json] [--tokens 2048] [--hidden 4096]

Parts (each prints one JSON line; the exit status is 1 when any result differs from the reference):
  one_rank   a one-rank group (NCCL on a GPU: NCCL refuses two ranks on one GPU; gloo on the CPU):
             normal dispatch + combine and low-latency dispatch + combine, bit-exact against
             ``ep_comm.reference``; then dispatch + combine timed against two bare
             ``all_to_all_single`` calls moving the same wire bytes on the same group
             (``ratio``: portable over bare; the target is at most 1.3).
  gloo       2 and 4 gloo ranks with their tensors on the GPU (each a rank of a mixed-vendor job):
             the same calls against the CPU reference, every payload staged through pinned host
             memory (``ep_comm.transports.host_staged``); dispatch + combine timed against bare
             gloo ``all_to_all_single`` calls of the same bytes on host tensors; and one large
             exchange staged in 4 MiB chunks against the same exchange in one chunk per message
             (``overlap_speedup``: how much the copies hidden behind the wire save).

``--device cpu`` runs every part with CPU tensors on small inputs (the staged pipeline then makes
plain copies): the test suite does so, to keep this script working between GPU leases.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ep_comm  # noqa: E402
from ep_comm import reference  # noqa: E402
from ep_comm.placement import ExpertPlacement  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(world: int, tokens: int, hidden: int, experts: int, topk: int):
    """Every rank's ``x [N, H]`` bf16, ``topk_idx [N, K]`` int64 (distinct experts) and weights."""
    xs, idxs, weights = [], [], []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 + r)
        xs.append(torch.randn(tokens, hidden, generator=g).to(torch.bfloat16))
        idxs.append(torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices)
        weights.append(torch.rand(tokens, topk, generator=g))
    return xs, idxs, weights


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def check_calls(buf, rank: int, world: int, device: torch.device, args) -> tuple[list[str], dict]:
    """Normal and low-latency dispatch + combine of this rank against the CPU reference; returns
    ``(what differed, the normal call's arguments for timing)``."""
    experts = args.experts
    placement = ExpertPlacement.contiguous(experts, world)
    xs, idxs, weights = _inputs(world, args.tokens, args.hidden, experts, args.topk)
    x, idx, w = xs[rank].to(device), idxs[rank].to(device), weights[rank].to(device)
    failures = []
    per_expert = buf.get_dispatch_layout(idx, experts)[2]
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    receives = reference.dispatch(xs, idxs, weights, placement)
    if not torch.equal(recv_x.cpu(), receives[rank].x):
        failures.append("dispatch")
    combined = buf.combine(recv_x, handle)[0]
    want_combined = reference.combine([r.x for r in receives], receives, [args.tokens] * world)[rank]
    if not torch.equal(combined.cpu(), want_combined):
        failures.append("combine")
    ll_tokens = min(args.tokens, 128)
    ll_receives = reference.low_latency_dispatch([t[:ll_tokens] for t in xs], [t[:ll_tokens] for t in idxs],
                                                 ll_tokens, placement)
    ll_x, ll_count, ll_handle, _, _ = buf.low_latency_dispatch(x[:ll_tokens], idx[:ll_tokens], ll_tokens, experts,
                                                               use_fp8=False)
    want = ll_receives[rank]
    if ll_count.cpu().tolist() != want.count or any(
            not torch.equal(ll_x[j, :n].cpu(), want.x[j, :n]) for j, n in enumerate(want.count)):
        failures.append("low_latency_dispatch")
    ll_combined = buf.low_latency_combine(ll_x, idx[:ll_tokens], w[:ll_tokens], ll_handle)[0]
    want_ll = reference.low_latency_combine([r.x for r in ll_receives], ll_receives, [t[:ll_tokens] for t in idxs],
                                            [t[:ll_tokens] for t in weights], placement)[rank]
    if not torch.equal(ll_combined.cpu(), want_ll):
        failures.append("low_latency_combine")
    return failures, {"x": x, "idx": idx, "w": w, "per_expert": per_expert}


def time_against_bare(buf, group, device: torch.device, bare_device: torch.device, call: dict, iters: int) -> dict:
    """Dispatch + combine against bare ``all_to_all_single`` calls moving the same wire bytes
    (the splits each call sent) on ``bare_device`` tensors."""
    def portable():
        recv_x, _, _, _, handle, _ = buf.dispatch(call["x"], topk_idx=call["idx"], topk_weights=call["w"],
                                                  num_tokens_per_expert=call["per_expert"])
        buf.combine(recv_x, handle)

    portable()
    recv_x, _, _, _, handle, _ = buf.dispatch(call["x"], topk_idx=call["idx"], topk_weights=call["w"],
                                              num_tokens_per_expert=call["per_expert"])
    dispatch_stats = buf.last_stats
    buf.combine(recv_x, handle)
    combine_stats = buf.last_stats
    messages = []
    for stats in (dispatch_stats, combine_stats):
        send = torch.empty(sum(stats.bytes_sent_wire), dtype=torch.uint8, device=bare_device)
        recv = torch.empty(sum(stats.bytes_recv_wire), dtype=torch.uint8, device=bare_device)
        messages.append((recv, send, list(stats.bytes_recv_wire), list(stats.bytes_sent_wire)))

    def bare():
        for recv, send, recv_splits, send_splits in messages:
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)

    portable_ms = _median_ms(portable, device, iters)
    bare_ms = _median_ms(bare, bare_device, iters)
    return {"portable_ms": portable_ms, "bare_ms": bare_ms, "ratio": portable_ms / bare_ms if bare_ms else None,
            "wire_bytes": sum(sum(m[1].shape) for m in messages)}


def one_rank(args) -> dict:
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        buf = ep_comm.Buffer(group, backend="torch")
        failures, call = check_calls(buf, 0, 1, device, args)
        timing = time_against_bare(buf, group, device, device, call, args.iters)
        return {"part": "one_rank", "backend": backend, "buffer_device": str(buf.device), "failures": failures,
                **timing}
    finally:
        dist.destroy_process_group()


def _gloo_rank(rank: int, world: int, port: int, args, results) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        buf = ep_comm.Buffer(group, backend="torch")
        failures, call = check_calls(buf, rank, world, device, args)
        timing = time_against_bare(buf, group, device, torch.device("cpu"), call, args.iters)
        transport = buf.transport
        per_peer = args.staged_mb * (1 << 20) // world
        send = torch.randint(0, 256, (per_peer * world,), dtype=torch.uint8, device=device)
        splits = [per_peer] * world
        expected = torch.empty(per_peer * world, dtype=torch.uint8)
        dist.all_to_all_single(expected, send.cpu(), splits, splits, group=group)
        staged = {}
        for name, chunk in (("chunked", 4 << 20), ("one_chunk", per_peer * world)):
            transport.staging_chunk_bytes = chunk
            got = transport.exchange_bytes(send, splits, splits, "bench/staged").wait()
            if not torch.equal(got.cpu(), expected):
                failures.append(f"staged/{name}")
            staged[f"{name}_ms"] = _median_ms(
                lambda: transport.exchange_bytes(send, splits, splits, "bench/staged").wait(), device, args.iters)
        staged["overlap_speedup"] = staged["one_chunk_ms"] / staged["chunked_ms"]
        results.put((rank, {"failures": failures, **timing, **staged}))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        results.put((rank, {"failures": [f"{type(error).__name__}: {error}"]}))
    finally:
        dist.destroy_process_group()


def gloo(args, world: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world):
            rank, value = results.get(timeout=args.rank_timeout)
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    first = out.get(0, {})
    return {"part": "gloo", "world": world, "tensors_on": args.device,
            "failures": sorted({f for r in out.values() for f in r.get("failures", [])}),
            **{k: v for k, v in first.items() if k != "failures"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--staged-mb", type=int, default=256, help="bytes per rank of the staged exchange timed")
    parser.add_argument("--rank-timeout", type=float, default=240.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    lines = [one_rank(args)]
    print(json.dumps(lines[-1]), flush=True)
    for world in (int(w) for w in args.worlds.split(",") if w):
        lines.append(gloo(args, world))
        print(json.dumps(lines[-1]), flush=True)
    if args.json:
        args.json.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return 1 if any(line["failures"] for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
