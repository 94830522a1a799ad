"""Per-message cost of the codecs on CUDA tensors through the public API, as the dispatch/combine
path calls them: ``lossless.encode(x)`` and ``lossless.decode(blob, expected_shape=...)`` of one
EP message (rows of H = 7168 bf16), each call's allocations and its one synchronisation included,
beside a device-to-device copy of the same tensor measured in the same run. Also ``fp8.quantize``.

    python bench/codec_device_api.py --tensors .gpu_carry/tensors.pt   # on a GPU (tensors optional)

Real tensors (bench/codec_bench.py --save-tensors) are reshaped to rows of 7168; without them, the
rows are Gaussian bf16 (ratios then mean little; times still do).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ep_comm.codecs import fp8, lossless  # noqa: E402
from ep_comm.codecs.device_kernels import codec_kernels  # noqa: E402

HIDDEN = 7168


def wall_us(fn, reps: int) -> float:
    """Best wall time of one call (us) over ``reps`` calls after a warm-up; each call ends synchronised."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def message(values: torch.Tensor | None, tokens: int) -> torch.Tensor:
    """[tokens, HIDDEN] bf16 on the GPU: the real values tiled, or Gaussian."""
    n = tokens * HIDDEN
    if values is None:
        values = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
    reps = -(-n // values.numel())
    return values.repeat(reps)[:n].cuda().view(tokens, HIDDEN)


def measure_message(x: torch.Tensor, chunk_values: int, reps: int) -> dict:
    """Checks one message's device round trip against the host codec, then times it."""
    raw, shape = x.numel() * 2, tuple(x.shape)
    blob = lossless.encode(x, chunk_values=chunk_values)
    if not (blob.is_cuda and torch.equal(blob.cpu(), lossless.encode(x.cpu(), chunk_values=chunk_values))):
        raise RuntimeError("the device blob is not the host blob")
    if not torch.equal(lossless.decode(blob, expected_shape=shape).view(torch.int16), x.view(torch.int16)):
        raise RuntimeError("the device round trip is not exact")
    times = {"copy_us": wall_us(x.clone, reps),
             "encode_us": wall_us(lambda: lossless.encode(x, chunk_values=chunk_values), reps),
             "decode_us": wall_us(lambda: lossless.decode(blob, expected_shape=shape), reps),
             "fp8_us": wall_us(lambda: fp8.quantize(x), reps)}
    return {"raw_mb": raw / 1e6, "ratio": blob.numel() / raw, **times,
            "encode_gbs": raw / times["encode_us"] / 1e3, "decode_gbs": raw / times["decode_us"] / 1e3}


def measure(kinds: dict[str, torch.Tensor | None], token_counts: list[int], chunk_sizes: list[int],
            reps: int) -> list[dict]:
    return [{"kind": kind, "tokens": tokens, "chunk_values": cv,
             **measure_message(message(values, tokens), cv, reps)}
            for kind, values in kinds.items() for tokens in token_counts for cv in chunk_sizes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=Path, help="real tensors from bench/codec_bench.py --save-tensors")
    parser.add_argument("--tokens", default="64,1024", help="comma-separated message sizes in rows of 7168")
    parser.add_argument("--chunk-values", default="65536,8192,2048",
                        help="comma-separated chunk sizes (values per independently coded chunk: one GPU warp each)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or codec_kernels(torch.device("cuda")) is None:
        print("needs a CUDA device and ep_comm._cuda built with the codec kernels")
        return 1
    if args.tensors:
        data = torch.load(args.tensors, map_location="cpu")
        kinds = {k: v.reshape(-1).to(torch.bfloat16) for k, v in data.items()}
    else:
        kinds = {"gaussian": None}
    rows = measure(kinds, [int(t) for t in args.tokens.split(",")], [int(c) for c in args.chunk_values.split(",")],
                   args.reps)
    print(f"{'kind':12} {'tokens':>6} {'chunk':>6} {'MB':>7} {'ratio':>6} {'copy us':>8} {'enc us':>8} {'dec us':>8} "
          f"{'fp8 us':>8} {'enc GB/s':>9} {'dec GB/s':>9}")
    for r in rows:
        print(f"{r['kind']:12} {r['tokens']:6d} {r['chunk_values']:6d} {r['raw_mb']:7.2f} {r['ratio']:6.4f} "
              f"{r['copy_us']:8.1f} {r['encode_us']:8.1f} {r['decode_us']:8.1f} {r['fp8_us']:8.1f} "
              f"{r['encode_gbs']:9.1f} {r['decode_gbs']:9.1f}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
