"""The Triton row kernels (ep_comm.row_kernels) on a GPU: every result checked bit for bit against
the CPU reference, and each kernel's bandwidth against the device copy of the same bytes.

    python bench/triton_rows.py [--json out.json] [--tokens 4096] [--hidden 7168] [--ranks 8]

Operations, each through the entry ep_comm's portable path calls on GPU tensors:
  copy_rows        rows.copy_rows: rows gathered by index and scattered by index (low-latency slots)
  pack             payload.pack of a normal dispatch message (x, src, topk, weights; one launch per field)
  unpack           payload.unpack of it (each field's blocks concatenated, one launch per field)
  quantize         DeepEP's FP8 cast of [N, H] (plain; and round_scale + UE8M0)
  quantize_rows    the cast fused into packing: tokens quantized into their low-latency message rows
  reduce           rows.reduce_by_source: normal combine's per-token sum of message blocks
  weighted_sum     rows.weighted_sum_by_token: low-latency combine's top-k weighted sum

Bytes count what the operation's kernels read plus write (the main data: rows, messages, scales),
the device copy's convention (``torch.Tensor.copy_`` of n bytes moves 2n). ``kernel_gbps`` divides
them by the Triton kernels' own device time (torch.profiler; index preparation excluded),
``call_gbps`` by the whole call's time (CUDA events, back to back, index preparation and launch
overheads included); ``of_copy`` is kernel_gbps over the copy's GB/s measured at the same size in
the same run. ``torch_call_ms`` is the same entry with ``EP_COMM_TRITON=0`` (torch operations:
index_add_ for the sums, whose results are then not deterministic). Sums are compared NaN for NaN
(no two float units agree on NaN payloads); everything else byte for byte. Exit status 1 when any
result differs.

``--device cpu`` runs the same checks on tiny inputs under ``TRITON_INTERPRET=1`` (no timing):
the test suite does so to keep this script working between GPU leases.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ep_comm import payload, row_kernels, rows  # noqa: E402
from ep_comm.codecs import fp8 as fp8_codec  # noqa: E402
from ep_comm.low_latency import _row_format  # noqa: E402
from ep_comm.plan import build_send_plan  # noqa: E402
from ep_comm.row_kernels import fp8 as fp8_kernels  # noqa: E402

KERNELS = ("copy_rows_kernel", "quantize_rows_kernel", "sum_rows_kernel")


@dataclass
class Op:
    """``run()`` on the device; ``check(result)`` raises when it differs from the CPU reference."""

    name: str
    nbytes: int
    run: Callable[[], object]
    check: Callable[[object], None]
    torch_run: Callable[[], object] | None = None


def _specials_into(x: torch.Tensor, seed: int, share: float = 1e-4) -> torch.Tensor:
    """``x`` with NaNs, infinities, subnormals and signed zeros at a few random places."""
    g = torch.Generator().manual_seed(seed)
    flat = x.view(-1)
    picks = torch.randint(0, flat.numel(), (max(8, int(flat.numel() * share)),), generator=g)
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 0.0, -0.0, 3e38])
    flat[picks] = values[torch.arange(picks.numel()) % values.numel()].to(x.dtype)
    return x


def _bf16(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return _specials_into((torch.randn(shape, generator=g) * 2).to(torch.bfloat16), seed)


def _same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.cpu().contiguous(), want.contiguous()
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: {got.dtype}{tuple(got.shape)} against {want.dtype}{tuple(want.shape)}")
    bad = int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
    if bad:
        raise AssertionError(f"{what}: {bad} bytes differ")


def _same_sums(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    if not torch.equal(torch.isnan(got), torch.isnan(want)):
        raise AssertionError(f"{what}: NaNs in different places")
    nan = torch.full_like(got, float("nan"))
    _same_bytes(torch.where(torch.isnan(got), nan, got), torch.where(torch.isnan(want), nan, want), what)


@contextlib.contextmanager
def _torch_ops():
    """The portable path without the kernels (``EP_COMM_TRITON=0``)."""
    previous = os.environ.get(row_kernels.SWITCH)
    os.environ[row_kernels.SWITCH] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[row_kernels.SWITCH]
        else:
            os.environ[row_kernels.SWITCH] = previous


def build_ops(tokens: int, hidden: int, num_ranks: int, topk: int, device: torch.device) -> list[Op]:
    """The operations at a normal-mode size of ``tokens`` per rank (and the low-latency ones at a
    quarter of it, each token sent to about three ranks)."""
    ops: list[Op] = []
    on_gpu = device.type == "cuda"
    g = torch.Generator().manual_seed(0)

    # -- copy_rows: gather by index, scatter by index
    src = _bf16((2 * tokens, hidden), 1)
    dst_index = torch.randperm(3 * tokens, generator=g)[:2 * tokens]
    src_index = torch.randperm(2 * tokens, generator=g)
    want_dst = torch.zeros(3 * tokens, hidden, dtype=torch.bfloat16)
    want_dst[dst_index] = src[src_index]
    dev_src, dev_dst = src.to(device), torch.zeros(3 * tokens, hidden, dtype=torch.bfloat16, device=device)
    dev_dst_index, dev_src_index = dst_index.to(device), src_index.to(device)
    ops.append(Op("copy_rows", 2 * src.numel() * 2,
                  lambda: (_copy_rows(dev_dst, dev_dst_index, dev_src, dev_src_index, on_gpu), dev_dst)[1],
                  lambda got: _same_bytes(got, want_dst, "copy_rows"),
                  (lambda: rows.copy_rows(dev_dst, dev_dst_index, dev_src, dev_src_index)) if on_gpu else None))

    # -- pack / unpack of a normal dispatch message
    mask = torch.rand(tokens, num_ranks, generator=g) < 0.4
    plan = build_send_plan(mask)
    splits = plan.splits()
    x = _bf16((tokens, hidden), 2)
    fmt = payload.RowFormat((payload.FieldSpec("x", torch.bfloat16, hidden), payload.FieldSpec("src", torch.int32, 1),
                             payload.FieldSpec("topk", torch.int32, topk),
                             payload.FieldSpec("weights", torch.float32, topk)))
    topk_rows = torch.randint(-1, 32, (plan.num_rows, topk), generator=g).to(torch.int32)
    weights = torch.rand(tokens, topk, generator=g)

    def values(dev: torch.device) -> dict[str, payload.RowSource]:
        index = plan.token_index.to(dev)
        return {"x": payload.RowSource(x.to(dev), index), "src": payload.RowSource(index.to(torch.int32)[:, None]),
                "topk": payload.RowSource(topk_rows.to(dev)), "weights": payload.RowSource(weights.to(dev), index)}

    want_message = payload.pack(fmt, values(torch.device("cpu")), splits, "none")
    dev_values = values(device)
    field_bytes = plan.num_rows * (hidden * 2 + 4 + 8 * topk)
    ops.append(Op("pack", 2 * field_bytes, lambda: _pack(fmt, dev_values, splits, on_gpu),
                  lambda got: _same_bytes(got.data, want_message.data, "pack"),
                  (lambda: payload.pack(fmt, dev_values, splits, "none")) if on_gpu else None))
    want_fields = payload.unpack(fmt, want_message.data, splits, want_message.byte_splits, "none")
    dev_message = want_message.data.to(device)

    def check_unpack(got):
        for name, want in want_fields.items():
            _same_bytes(got[name], want, f"unpack {name}")

    ops.append(Op("unpack", 2 * field_bytes,
                  lambda: _unpack(fmt, dev_message, splits, want_message.byte_splits, on_gpu), check_unpack,
                  (lambda: payload.unpack(fmt, dev_message, splits, want_message.byte_splits, "none"))
                  if on_gpu else None))

    # -- FP8: plain, and fused into low-latency message rows
    dev_x = x.to(device)
    for round_scale, ue8m0 in [(False, False), (True, True)]:
        want_q, want_s = fp8_codec.quantize_reference(x, round_scale, ue8m0)

        def check_quantize(got, want_q=want_q, want_s=want_s, name=f"quantize{'_ue8m0' if ue8m0 else ''}"):
            _same_bytes(got[0].view(torch.uint8), want_q.view(torch.uint8), name)
            _same_bytes(got[1], want_s, name)

        ops.append(Op(f"quantize{'_ue8m0' if ue8m0 else ''}",
                      x.numel() * 3 + want_s.numel() * want_s.element_size(),
                      lambda round_scale=round_scale, ue8m0=ue8m0: fp8_kernels.quantize(dev_x, round_scale, ue8m0),
                      check_quantize))
    ll_tokens = max(1, tokens // 4)
    ll_mask = torch.rand(ll_tokens, num_ranks, generator=g) < 3 / num_ranks
    token, dest = torch.nonzero(ll_mask, as_tuple=True)
    position = torch.cumsum(ll_mask.to(torch.int64), 0) - 1
    slots = ll_tokens + 1
    send_row = dest * slots + position[token, dest]
    ll_fmt = _row_format(hidden, topk, True, False)
    ll_x = x[:ll_tokens]
    want_ll = torch.zeros(num_ranks * slots, ll_fmt.row_bytes, dtype=torch.uint8)
    q_ref, s_ref = fp8_codec.quantize_reference(ll_x)
    want_fields_ll = ll_fmt.views(want_ll)
    want_fields_ll["x"][send_row] = q_ref.view(torch.uint8)[token]
    want_fields_ll["scales"][send_row] = s_ref[token]
    dev_ll = torch.zeros_like(want_ll, device=device)
    dev_ll_fields = ll_fmt.views(dev_ll)
    dev_token, dev_send_row, dev_ll_x = token.to(device), send_row.to(device), ll_x.to(device)
    ops.append(Op("quantize_rows", token.numel() * (hidden * 3 + (hidden // 128) * 4),
                  lambda: (fp8_kernels.quantize_rows(dev_ll_x, dev_token, dev_ll_fields["x"], dev_ll_fields["scales"],
                                                     dev_send_row, False, False), dev_ll)[1],
                  lambda got: _same_bytes(got, want_ll, "quantize_rows")))

    # -- sums: normal combine over message blocks, low-latency weighted sum
    returned = _bf16((plan.num_rows, hidden), 3)
    blocks = list(returned.split(splits))
    bias = (_bf16((tokens, hidden), 4),)
    want_sum = rows.reduce_by_source(blocks, plan, tokens, bias)
    dev_returned, dev_bias = returned.to(device), (bias[0].to(device),)
    dev_plan = type(plan)(plan.token_index.to(device), plan.send_counts.to(device))
    dev_blocks = list(dev_returned.split(splits))
    ops.append(Op("reduce", (plan.num_rows + 2 * tokens) * hidden * 2,
                  lambda: _reduce(dev_blocks, dev_plan, tokens, dev_bias, on_gpu),
                  lambda got: _same_sums(got, want_sum, "reduce"),
                  (lambda: rows.reduce_by_source(dev_blocks, dev_plan, tokens, dev_bias)) if on_gpu else None))
    pairs = ll_tokens * topk
    pair_rows = _bf16((pairs, hidden), 5)
    pair_tokens = torch.arange(ll_tokens).repeat_interleave(topk)
    pair_order = torch.randperm(pairs, generator=g)
    pair_weights = torch.rand(pairs, generator=g)
    want_weighted = rows.weighted_sum_by_token(pair_rows, pair_order, pair_tokens, pair_weights, ll_tokens, 128)
    dev_pair = [t.to(device) for t in (pair_rows, pair_order, pair_tokens, pair_weights)]
    ops.append(Op("weighted_sum", pairs * hidden * 2 + ll_tokens * hidden * 4,
                  lambda: _weighted(*dev_pair, ll_tokens, on_gpu),
                  lambda got: _same_sums(got, want_weighted, "weighted_sum"),
                  (lambda: rows.weighted_sum_by_token(*dev_pair, ll_tokens, 128)) if on_gpu else None))
    return ops


# the entries: on a GPU the public ones (they take the kernels); on the CPU (the interpreter) the
# kernels' own launchers, which the public entries only call for GPU tensors

def _copy_rows(dst, dst_index, src, src_index, on_gpu):
    if on_gpu:
        return rows.copy_rows(dst, dst_index, src, src_index)
    from ep_comm.row_kernels import rowcopy
    return rowcopy.copy_rows(dst, dst_index, src, src_index)


def _pack(fmt, values, splits, on_gpu):
    if on_gpu:
        return payload.pack(fmt, values, splits, "none")
    with _kernels_for_cpu():
        return payload.pack(fmt, values, splits, "none")


def _unpack(fmt, message, splits, byte_splits, on_gpu):
    if on_gpu:
        return payload.unpack(fmt, message, splits, byte_splits, "none")
    with _kernels_for_cpu():
        return payload.unpack(fmt, message, splits, byte_splits, "none")


def _reduce(blocks, plan, tokens, bias, on_gpu):
    if on_gpu:
        return rows.reduce_by_source(blocks, plan, tokens, bias)
    return row_kernels.reduce_by_source(blocks, plan.token_index, tokens, bias)


def _weighted(pair_rows, order, tokens, weights, num_tokens, on_gpu):
    if on_gpu:
        return rows.weighted_sum_by_token(pair_rows, order, tokens, weights, num_tokens, 128)
    return row_kernels.weighted_sum_by_token(pair_rows, order, tokens, weights, num_tokens)


@contextlib.contextmanager
def _kernels_for_cpu():
    """CPU dry run: payload.pack / unpack take the kernels for CPU tensors."""
    usable = row_kernels.usable
    row_kernels.usable = lambda *ts: bool(ts) and all(isinstance(t, torch.Tensor) for t in ts)
    try:
        yield
    finally:
        row_kernels.usable = usable


# ---- timing --------------------------------------------------------------------------------------

def _call_seconds(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call, ``iters`` calls back to back between two CUDA events (median of 3)."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(runs)


def _kernel_seconds(fn: Callable[[], object], iters: int) -> float | None:
    """Device seconds per call of the Triton kernels the call launches (torch.profiler), or None
    when the profiler gives no kernel records."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.events():
        if any(k in event.name for k in KERNELS) and getattr(event, "device_type", None) is not None \
                and str(event.device_type).endswith("CUDA"):
            total_us += event.device_time if hasattr(event, "device_time") else event.cuda_time
    return total_us / 1e6 / iters if total_us > 0 else None


def _copy_gbps(nbytes: int, iters: int, device: torch.device) -> float:
    """The device copy's GB/s moving ``nbytes`` (read plus write): ``copy_`` of ``nbytes / 2``."""
    half = max(1, nbytes // 2)
    src = torch.empty(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * half / _call_seconds(lambda: dst.copy_(src), iters) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for the interpreter dry run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("no GPU", file=sys.stderr)
            return 2
        import triton

        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}"
              f" {'ROCm ' + torch.version.hip if torch.version.hip else 'CUDA ' + str(torch.version.cuda)}")
    started = time.perf_counter()
    ops = build_ops(args.tokens, args.hidden, args.ranks, args.topk, device)
    print(f"# inputs and CPU references in {time.perf_counter() - started:.1f} s")
    results, failed = [], False
    for op in ops:
        row: dict[str, object] = {"op": op.name, "bytes": op.nbytes}
        try:
            op.check(op.run())
            row["exact"] = True
        except AssertionError as error:
            row["exact"], row["error"] = False, str(error)
            failed = True
        if device.type == "cuda":
            call = _call_seconds(op.run, args.iters)
            kernel = _kernel_seconds(op.run, args.iters)
            copy = _copy_gbps(op.nbytes, args.iters, device)
            row.update(call_ms=round(call * 1e3, 4), call_gbps=round(op.nbytes / call / 1e9, 1),
                       copy_gbps=round(copy, 1))
            if kernel is not None:
                row.update(kernel_ms=round(kernel * 1e3, 4), kernel_gbps=round(op.nbytes / kernel / 1e9, 1),
                           of_copy=round(op.nbytes / kernel / 1e9 / copy, 3))
            if op.torch_run is not None:
                with _torch_ops():
                    row["torch_call_ms"] = round(_call_seconds(op.torch_run, args.iters) * 1e3, 4)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print("# all results bit-exact" if not failed else "# RESULTS DIFFER from the CPU reference")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
