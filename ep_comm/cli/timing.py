"""Timing one call on one rank, and summarising samples across iterations and ranks.

A sample is the wall time of one call on one rank: the ranks first meet at a barrier (outside the
sample), then the clock runs from just before the call until its results are usable (on a GPU,
after ``torch.cuda.synchronize``). Samples of all timed iterations and all ranks are pooled.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default method). Raises ``ValueError`` on an empty list."""
    if not values:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class LatencySummary:
    """Latency statistics in microseconds over pooled samples."""

    median: float
    p10: float
    p90: float
    mean: float
    min: float
    max: float
    count: int

    @staticmethod
    def of(samples_s: list[float]) -> "LatencySummary":
        us = [s * 1e6 for s in samples_s]
        return LatencySummary(percentile(us, 50), percentile(us, 10), percentile(us, 90),
                              sum(us) / len(us), min(us), max(us), len(us))

    def to_dict(self) -> dict[str, float]:
        return {"median": self.median, "p10": self.p10, "p90": self.p90, "mean": self.mean,
                "min": self.min, "max": self.max, "count": self.count}


class Clock:
    """Times calls on one rank; synchronises the device so a sample covers the whole call."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None) -> None:
        self.device = device
        self.group = group

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self._sync()
        if self.group is not None:
            dist.barrier(group=self.group)

    def time(self, fn: Callable[[], T]) -> tuple[float, T]:
        """Barrier, then ``(seconds, fn())`` where the seconds cover ``fn`` and its device work."""
        self.barrier()
        start = time.perf_counter()
        out = fn()
        self._sync()
        return time.perf_counter() - start, out
