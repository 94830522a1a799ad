"""Short GPU benchmark: virtual-rank dispatch/combine bandwidth as a fraction of the device-to-device
copy bandwidth measured in the same run (target >= 0.7), for each intranode copy (``--copy``: the
ring kernels and the direct-write ones; "normal" reports the faster, "normal_by_copy" each). Prints
one JSON line, last.

Bandwidth counts payload bytes once (bytes of the rows received, resp. returned) per second of
the data-moving kernel (CUDA events; best of the iterations), the same way the copy's bandwidth
counts the bytes copied once. Whole-call times (layout, notify, host sync, allocation) are
reported alongside.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ep_comm.engines import IntranodeEngine, LowLatencyEngine
from ep_comm.placement import ExpertPlacement


def copy_bandwidth(nbytes: int, iters: int = 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return nbytes * iters / (start.elapsed_time(end) / 1e3)


def timed(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def normal_mode(r: int, tokens: int, hidden: int, k: int, experts: int, channels: int, iters: int,
                copy: str, warps_per_rank: int = 1) -> dict:
    """Dispatch/combine bandwidth of one intranode copy; ``warps_per_rank``: the direct dispatch's
    warps per destination, or the ring kernels' warps (and sub-rings) per peer."""
    placement = ExpertPlacement.contiguous(experts, r)
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16() for _ in range(r)]
    topks = [torch.rand(tokens, experts, device="cuda", generator=gen).topk(k, dim=1).indices
             for _ in range(r)]
    weights = [torch.rand(tokens, k, device="cuda", generator=gen) for _ in range(r)]
    eng = IntranodeEngine(r, placement, torch.device("cuda"), k, hidden * 2, num_channels=channels,
                          ring_slots=128, copy=copy, warps_per_peer=warps_per_rank if copy == "ring" else 1)
    threads = 32 * r * warps_per_rank  # the dispatch's warps per destination rank
    got = eng.dispatch(xs, topks, weights, threads=threads)
    recv_bytes = sum(g["recv_x"].numel() * 2 for g in got)
    kernel_ms = {"dispatch": [], "combine": []}

    def run_dispatch() -> None:
        eng.dispatch(xs, topks, weights, threads=threads)
        kernel_ms["dispatch"].append(eng.last_kernel_ms)

    dispatch_s = timed(run_dispatch, iters)
    ys = [g["recv_x"] for g in got]
    handles = [g["handle"] for g in got]

    def run_combine() -> None:
        eng.combine(ys, handles)
        kernel_ms["combine"].append(eng.last_kernel_ms)

    combine_s = timed(run_combine, iters)
    d_kernel = min(kernel_ms["dispatch"]) / 1e3
    c_kernel = min(kernel_ms["combine"]) / 1e3
    return {"dispatch_GBps": recv_bytes / d_kernel / 1e9, "combine_GBps": recv_bytes / c_kernel / 1e9,
            "dispatch_kernel_ms": d_kernel * 1e3, "combine_kernel_ms": c_kernel * 1e3,
            "dispatch_call_ms": dispatch_s * 1e3, "combine_call_ms": combine_s * 1e3,
            "bytes": recv_bytes}


def low_latency_mode(r: int, tokens: int, hidden: int, k: int, experts: int, iters: int) -> dict:
    placement = ExpertPlacement.contiguous(experts, r)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16() for _ in range(r)]
    topks = [torch.rand(tokens, experts, device="cuda", generator=gen).topk(k, dim=1).indices
             for _ in range(r)]
    weights = [torch.rand(tokens, k, device="cuda", generator=gen) for _ in range(r)]
    eng = LowLatencyEngine(r, placement, torch.device("cuda"), tokens, hidden, k)
    got = eng.dispatch(xs, topks)
    pairs = sum(int(g.recv_count.sum()) for g in got)
    dispatch_s = timed(lambda: eng.dispatch(xs, topks), iters)
    ys = [g.recv_x for g in got]
    combine_s = timed(lambda: eng.combine(ys, topks, weights, got), iters)
    nbytes = pairs * hidden * 2
    return {"dispatch_GBps": nbytes / dispatch_s / 1e9, "combine_GBps": nbytes / combine_s / 1e9,
            "dispatch_us": dispatch_s * 1e6, "combine_us": combine_s * 1e6, "bytes": nbytes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--copy", default="ring,direct",
                        help="intranode kernels to time, comma-separated: ring (rows through the peer buffers' "
                             "rings) and/or direct (rows written straight into the receivers' outputs)")
    parser.add_argument("--direct-warps", default="1,2",
                        help="warps per destination rank of the direct dispatch to time, comma-separated "
                             "(\"direct\" is 1; 2 is timed as \"direct_w2\"; blocks of at most 512 threads)")
    parser.add_argument("--ring-warps", default="1,2",
                        help="warps (and sub-rings) per peer of the ring kernels to time, comma-separated "
                             "(\"ring\" is 1; 2 is timed as \"ring_w2\"; blocks of 32 * ranks * warps threads, "
                             "at most 512; a grid the GPU cannot hold at once is reported, not timed)")
    parser.add_argument("--no-low-latency", action="store_true",
                        help="normal mode only (e.g. under ncu, which profiles the intranode kernels)")
    a = parser.parse_args()
    copy_bps = copy_bandwidth(1 << 30)
    variants = []  # (name, copy, warps per destination)
    for c in (c for c in a.copy.split(",") if c):
        warps = [int(w) for w in (a.direct_warps if c == "direct" else a.ring_warps).split(",") if w]
        variants += [(c if w == 1 else f"{c}_w{w}", c, w) for w in warps]
    by_copy, refused = {}, {}
    for name, c, w in variants:
        try:
            by_copy[name] = normal_mode(a.ranks, a.tokens, a.hidden, a.topk, a.experts, a.channels, a.iters, c, w)
        except RuntimeError as e:  # the launch check: a grid that cannot be resident at once
            if "cannot be resident at once" not in str(e):
                raise
            refused[name] = str(e)
    ll = None if a.no_low_latency else low_latency_mode(a.ranks, 128, a.hidden, a.topk, a.experts, a.iters)
    copy_gbps = copy_bps / 1e9
    # the faster kernels by their slower phase (dispatch or combine): the default these figures support
    best = max(by_copy, key=lambda c: min(by_copy[c]["dispatch_GBps"], by_copy[c]["combine_GBps"]))
    normal = by_copy[best]
    summary = {"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbps, "channels": a.channels,
               "normal_copy": best, "normal": normal, "low_latency": ll,
               "normal_dispatch_fraction": normal["dispatch_GBps"] / copy_gbps,
               "normal_combine_fraction": normal["combine_GBps"] / copy_gbps,
               "normal_by_copy": {c: {"dispatch_fraction": v["dispatch_GBps"] / copy_gbps,
                                      "combine_fraction": v["combine_GBps"] / copy_gbps, **v}
                                  for c, v in by_copy.items()},
               "refused": refused, "target_fraction": 0.7}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
