"""Silent wrong decodes of the lossless codec under single-bit flips, per format version.

Flips every bit of the blobs of seeded gradient-like tensors (values rounded to 3 mantissa bits,
a share of +0.0: their raw fields are coded, modes 4 and 5) one at a time, decodes each flipped
blob on the portable path and counts the flips that decode to other values without an error (the
chunk checksums missed them). A small sweep of the same kind runs in
tests/test_codec_lossless_v7.py.

    python bench/codec_flips.py --values 96 --seeds 600                    # one-state blobs
    python bench/codec_flips.py --values 4096 --chunk-values 2048 --seeds 40 --zero-share 0.3
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.codec_kernel_cases import gradient_like, silent_flips  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=96, help="values per tensor")
    parser.add_argument("--seeds", type=int, default=100, help="tensors (seeds 0 to N - 1)")
    parser.add_argument("--chunk-values", type=int, help="chunk size (default: the codec's)")
    parser.add_argument("--zero-share", type=float, default=0.5)
    parser.add_argument("--versions", default="6,7")
    args = parser.parse_args()
    for version in (int(v) for v in args.versions.split(",")):
        start, silent, flips, seen = time.time(), 0, 0, set()
        for seed in range(args.seeds):
            x = gradient_like(1, seed=seed, hidden=args.values, zero_share=args.zero_share)
            s, n, m = silent_flips(x, version, args.chunk_values)
            silent, flips, seen = silent + s, flips + n, seen | set(m)
        print(f"version {version}: {silent} silent wrong decodes of {flips} flips ({args.seeds} tensors of "
              f"{args.values} values, chunk modes {sorted(seen)}; {time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
