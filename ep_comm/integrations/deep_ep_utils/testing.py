"""``deep_ep.utils.testing``: the timing helpers of DeepEP's test scripts, on CUDA and on the CPU.

* :func:`bench` times whole calls: with CUDA events on a GPU, with ``time.perf_counter`` on the CPU.
* :func:`bench_kineto` times named GPU kernels with the PyTorch profiler (kineto). A named kernel
  exists only where a CUDA kernel of that name runs -- DeepEP's (or ep_comm's fused) kernels on a
  GPU. Where none of the names is found (on the CPU; on ep_comm's portable path, whose work runs in
  other kernels and on the host; under ``EP_USE_NVIDIA_TOOLS=1``, where the profiler is skipped as
  in DeepEP), it returns, for every name, the measured wall time of one ``fn()`` call and warns
  (:class:`KernelTimingUnavailableWarning`) that it did so. It never reports a figure it did not
  measure: with ``num_kernels_per_period > 1`` the first entry of each name is that wall time and
  the others are NaN, as the split inside one call is unknown; and where some names match kernels
  and others do not, the others are NaN (with the same warning).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["KernelTimingUnavailableWarning", "bench", "bench_kineto", "flush_l2_cache", "kernel_times",
           "suppress_stdout_stderr"]

_NAN = float("nan")
L2_FLUSH_BYTES = 256_000_000
"""Bytes written to evict the GPU's L2 cache between timed calls (more than any current L2)."""


class KernelTimingUnavailableWarning(UserWarning):
    """:func:`bench_kineto` found no kernel of a requested name and reported wall time instead."""


def _timing_device(device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def flush_l2_cache(enabled: bool = True) -> None:
    """Evicts the GPU's L2 cache by zeroing a 256 MB tensor (a no-op without CUDA or when disabled)."""
    if enabled and torch.cuda.is_available():
        torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda").zero_()


def bench(fn: Callable[[], Any], num_warmups: int = 50, num_tests: int = 50,
          post_fn: Callable[[], Any] | None = None, flush_l2: bool = True, *,
          device: str | torch.device | None = None) -> tuple[float, float, float]:
    """Times ``fn()``: returns ``(average, minimum, maximum)`` seconds per call.

    Runs ``num_warmups`` untimed calls, then ``num_tests`` timed ones (``post_fn()`` after each,
    untimed); as in DeepEP the first timed call is left out of the statistics when there are more.
    On CUDA each call is timed by CUDA events on the current stream (GPU time, the L2 cache flushed
    before each call when ``flush_l2``); on the CPU by ``time.perf_counter`` around the call
    (``flush_l2`` has no CPU equivalent and is ignored).

    Args:
        device: ``"cuda"`` or ``"cpu"`` timing; default ``cuda`` when CUDA is available.
    """
    if num_tests < 1:
        raise ValueError(f"num_tests must be at least 1, got {num_tests}")
    use_cuda = _timing_device(device).type == "cuda"
    if use_cuda:
        torch.cuda.synchronize()
    for _ in range(num_warmups):
        fn()
    times: list[float] = []
    if use_cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_tests)]
        for start, end in zip(starts, ends):
            flush_l2_cache(flush_l2)
            start.record()
            fn()
            end.record()
            if post_fn is not None:
                post_fn()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]
    else:
        for _ in range(num_tests):
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
            if post_fn is not None:
                post_fn()
    if len(times) > 1:
        times = times[1:]
    return sum(times) / len(times), min(times), max(times)


class suppress_stdout_stderr:
    """Silences stdout and stderr, including output written by C/C++ code to file descriptors 1 and 2."""

    def __enter__(self) -> "suppress_stdout_stderr":
        sys.stdout.flush()
        sys.stderr.flush()
        self._devnull = open(os.devnull, "w")
        self._saved_fds = (os.dup(1), os.dup(2))
        self._saved_streams = (sys.stdout, sys.stderr)
        os.dup2(self._devnull.fileno(), 1)
        os.dup2(self._devnull.fileno(), 2)
        sys.stdout = sys.stderr = self._devnull
        return self

    def __exit__(self, *_: Any) -> None:
        sys.stdout, sys.stderr = self._saved_streams
        for fd, saved in zip((1, 2), self._saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        self._devnull.close()


def _wall_time_per_call(fn: Callable[[], Any], num_tests: int, use_cuda: bool, flush_l2: bool,
                        before_each: Callable[[], None]) -> float:
    total = 0.0
    for _ in range(num_tests):
        flush_l2_cache(flush_l2 and use_cuda)
        before_each()
        if use_cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        fn()
        if use_cuda:
            torch.cuda.synchronize()
        total += time.perf_counter() - begin
    return total / num_tests


def _kernel_events(prof: torch.profiler.profile) -> list[Any]:
    """The profile's GPU kernel events (``name``, start ``time_range``, device duration in us)."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def bench_kineto(fn: Callable[[], Any], kernel_names: str | tuple[str, ...], num_tests: int = 30,
                 suppress_kineto_output: bool = False, trace_path: str | None = None,
                 flush_l2: bool = True, barrier_comm_profiling: bool = False,
                 num_kernels_per_period: int = 1, barrier: Callable[[], Any] | None = None) -> Any:
    """Average GPU time, in seconds, of the kernels whose names contain each of ``kernel_names``.

    As DeepEP's: ``fn()`` runs once, then ``num_tests`` times unprofiled and ``num_tests`` times
    profiled; each name must match at most one kernel. With ``num_kernels_per_period = p > 1``,
    ``fn()`` launches ``p`` kernels of each name per call and each name's result is a list of the
    ``p`` per-position averages. ``barrier_comm_profiling`` sleeps on the GPU and calls ``barrier()``
    (default: an all-reduce over the default group) before each call, evening out launch skew
    between ranks (``EP_DISABLE_BARRIER_PROFILING=1`` turns it off).

    Where no kernel matches any name, the module docstring's fallback applies: per-call wall time,
    with a :class:`KernelTimingUnavailableWarning`. Where some names match and others do not, the
    others get NaN, with the same warning.

    Returns:
        one float (or list) for a ``str`` ``kernel_names``; a list, one per name, for a tuple.
    """
    if not isinstance(kernel_names, (str, tuple)) or not all(
            isinstance(name, str) for name in (kernel_names if isinstance(kernel_names, tuple) else (kernel_names,))):
        raise ValueError(f"kernel_names must be a str or a tuple of str, got {kernel_names!r}")
    if num_tests < 1 or num_kernels_per_period < 1:
        raise ValueError("num_tests and num_kernels_per_period must be at least 1")
    names = (kernel_names,) if isinstance(kernel_names, str) else kernel_names
    use_cuda = torch.cuda.is_available()
    barrier_comm_profiling = barrier_comm_profiling and os.environ.get("EP_DISABLE_BARRIER_PROFILING", "0") in ("", "0")

    def before_each() -> None:
        if not barrier_comm_profiling:
            return
        if use_cuda:
            torch.cuda._sleep(int(2e7))
        if barrier is not None:
            barrier()
        elif dist.is_available() and dist.is_initialized():
            dist.all_reduce(torch.ones(1, device="cuda" if use_cuda else "cpu"))

    fn()
    if use_cuda:
        torch.cuda.synchronize()

    results: list[Any] | None = None
    profiled = use_cuda and os.environ.get("EP_USE_NVIDIA_TOOLS", "0") in ("", "0")
    if profiled:
        results = _profile_kernels(fn, names, num_tests, suppress_kineto_output, trace_path, flush_l2,
                                   num_kernels_per_period, before_each)
    if results is None:
        wall = _wall_time_per_call(fn, num_tests, use_cuda, flush_l2, before_each)
        where = ("the profiler is skipped (EP_USE_NVIDIA_TOOLS=1)" if use_cuda and not profiled
                 else "no GPU kernel with these names ran" if use_cuda else "there are no GPU kernels on the CPU")
        warnings.warn(f"bench_kineto: {where} for {list(names)}; each result is the wall time of one "
                      f"fn() call ({wall * 1e6:.1f} us), not a kernel time",
                      KernelTimingUnavailableWarning, stacklevel=2)
        per_name = wall if num_kernels_per_period == 1 else [wall] + [_NAN] * (num_kernels_per_period - 1)
        results = [per_name for _ in names]
    else:
        missing = [name for name, result in zip(names, results)
                   if result != result or (isinstance(result, list) and result[0] != result[0])]
        if missing:
            warnings.warn(f"bench_kineto: no GPU kernel named like {missing} ran; their results are NaN",
                          KernelTimingUnavailableWarning, stacklevel=2)
    return results if isinstance(kernel_names, tuple) else results[0]


@contextlib.contextmanager
def _maybe_suppressed(suppress: bool) -> Iterator[None]:
    if suppress:
        with suppress_stdout_stderr():
            yield
    else:
        yield


def _profile_kernels(fn: Callable[[], Any], names: tuple[str, ...], num_tests: int, suppress: bool,
                     trace_path: str | None, flush_l2: bool, num_kernels_per_period: int,
                     before_each: Callable[[], None]) -> list[Any] | None:
    """Per-name kernel times from a profile of ``fn``; None when no kernel matches any name."""
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with _maybe_suppressed(suppress):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                    schedule=schedule) as prof:
            for _ in range(2):
                for _ in range(num_tests):
                    flush_l2_cache(flush_l2)
                    before_each()
                    fn()
                torch.cuda.synchronize()
                prof.step()
    results = kernel_times(_kernel_events(prof), names, num_kernels_per_period)
    if results is not None and trace_path is not None:
        prof.export_chrome_trace(trace_path)
    return results


def kernel_times(kernels: list[Any], names: tuple[str, ...], num_kernels_per_period: int = 1) -> list[Any] | None:
    """Per-name average durations (s) of profiled kernels; None when no kernel matches any name.

    A name that matches no kernel while others do gets NaN (a list of NaN with periods).

    Args:
        kernels: kernel events with ``name`` and ``time_range`` (``start``, ``elapsed_us()``), as
            ``torch.profiler`` records them.
        names: substrings; each must match at most one distinct kernel name (else ``ValueError``).
        num_kernels_per_period: ``p``; with ``p > 1`` a name's kernels, in launch order, repeat in
            periods of ``p`` and its result is the list of the ``p`` per-position averages.
    """
    matches = {name: [e for e in kernels if name in e.name] for name in names}
    if not any(matches.values()):
        return None
    results: list[Any] = []
    for name, events in matches.items():
        distinct = sorted({e.name for e in events})
        if len(distinct) > 1:
            raise ValueError(f"bench_kineto: {name!r} matches several kernels: {distinct}")
        if not events:
            results.append(_NAN if num_kernels_per_period == 1 else [_NAN] * num_kernels_per_period)
            continue
        durations = [e.time_range.elapsed_us() / 1e6 for e in sorted(events, key=lambda e: e.time_range.start)]
        if num_kernels_per_period == 1:
            results.append(sum(durations) / len(durations))
            continue
        if len(durations) % num_kernels_per_period:
            raise ValueError(f"bench_kineto: {len(durations)} {name!r} kernels do not divide into periods "
                             f"of {num_kernels_per_period}")
        periods = len(durations) // num_kernels_per_period
        results.append([sum(durations[j::num_kernels_per_period]) / periods for j in range(num_kernels_per_period)])
    return results
