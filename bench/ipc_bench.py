"""The intranode engine between processes of one GPU over CUDA IPC (``IntranodeEngine(group=...)``):
for each copy (``--copy ring,direct``), each rank's whole dispatch and combine call time against its
data-moving kernel's time, so the difference is the call's host work (layout, notify, host sync,
allocation, and for the direct copy the per-call exchange of IPC handles and the barrier after the
kernel). Prints one JSON line, last: rank 0's medians.

The processes share one GPU without MPS, so their kernels take turns on it: the ring kernels,
whose senders and receivers in different processes wait for each other, advance only as the GPU
switches between the processes, and neither copy's bandwidth here says anything about NVLink
(``bench/gpu_bench.py`` compares the copies' kernels with virtual ranks). What this measures is the
per-call cost the direct copy adds between processes, and that both copies give the same rows.

    python bench/ipc_bench.py --ranks 2 --tokens 1024 --hidden 7168
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ep_comm.engines import IntranodeEngine
from ep_comm.placement import ExpertPlacement


def _inputs(rank: int, tokens: int, hidden: int, topk: int, experts: int):
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    idx = torch.rand(tokens, experts, device="cuda", generator=gen).topk(topk, dim=1).indices
    weights = torch.rand(tokens, topk, device="cuda", generator=gen)
    return x, idx, weights


def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def _rank(rank: int, args: argparse.Namespace, port: int, results) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks,
                            timeout=timedelta(seconds=60))
    try:
        placement = ExpertPlacement.contiguous(args.experts, args.ranks)
        x, idx, weights = _inputs(rank, args.tokens, args.hidden, args.topk, args.experts)
        out: dict[str, dict] = {}
        received: dict[str, torch.Tensor] = {}
        for copy in args.copy.split(","):
            eng = IntranodeEngine(args.ranks, placement, torch.device("cuda"), args.topk, args.hidden * 2,
                                  num_channels=args.channels, ring_slots=128, timeout_s=60.0,
                                  group=dist.group.WORLD, copy=copy)
            times: dict[str, list[float]] = {"dispatch_call": [], "dispatch_kernel": [], "combine_call": [],
                                             "combine_kernel": []}
            copies = set()
            for it in range(args.iters + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                (got,) = eng.dispatch([x], [idx], [weights])
                t1 = time.perf_counter()
                dispatch_kernel = eng.last_kernel_ms
                copies.add(eng.last_copy)
                eng.combine([got["recv_x"]], [got["handle"]])
                t2 = time.perf_counter()
                copies.add(eng.last_copy)
                if it == 0:  # the warm-up: first mappings, first allocations
                    received[copy] = got["recv_x"].clone()
                    continue
                times["dispatch_call"].append((t1 - t0) * 1e3)
                times["dispatch_kernel"].append(dispatch_kernel)
                times["combine_call"].append((t2 - t1) * 1e3)
                times["combine_kernel"].append(eng.last_kernel_ms)
            eng.close()
            out[copy] = {k: _median_ms(v) for k, v in times.items()}
            out[copy]["copies_used"] = sorted(copies)
            out[copy]["recv_rows"] = int(got["recv_x"].shape[0])
        if len(received) == 2:
            a, b = received.values()
            out["same_rows"] = bool(torch.equal(a, b))
        results[rank] = out
    except Exception as error:  # noqa: BLE001 - reported by the parent
        results[rank] = {"error": f"{type(error).__name__}: {error}"}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--copy", default="ring,direct", help="comma-separated: ring, direct")
    args = parser.parse_args()
    for copy in args.copy.split(","):
        if copy not in ("ring", "direct"):
            parser.error(f"--copy takes ring and direct, got {copy!r}")
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        raise SystemExit(1)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_rank, args=(r, args, port, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=float(os.environ.get("EP_IPC_BENCH_LIMIT_S", "240")))
        if p.is_alive():
            p.kill()
    rows = {r: results.get(r, {"error": "no result (killed at the limit)"}) for r in range(args.ranks)}
    for r, row in rows.items():
        print(f"rank {r}: {json.dumps(row)}")
    print(json.dumps({"ranks": args.ranks, "tokens": args.tokens, "hidden": args.hidden, "rank0": rows[0]}))
    if any("error" in row for row in rows.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
