"""The path interface: one implementation of the Buffer's calls (flat, node-aware, fused kernels,
two-hop kernels), and :class:`PathPlan`, the ordered list of a Buffer's paths that picks one per
call.

A path answers two questions per mode: may it take this call (``*_reason`` returns ``None``, or a
one-line reason why not), and what the call returns (the mode's method). Every input of a reason
is the same on every rank (shapes, dtypes, codec, the masked-rank state, engine generations), so
all ranks of a Buffer pick the same path for every call.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..handle import DispatchHandle, LowLatencyHandle
from ..low_latency import LowLatencyDispatchOutput
from ..normal import DispatchOutput
from ..payload import Payload
from ..placement import ExpertPlacement
from ..stats import CommStats
from ..transports.base import Transport

MODES = ("dispatch", "cached_dispatch", "combine", "low_latency_dispatch", "low_latency_combine")
"""The calls a path may implement, in the order :class:`PathPlan` reports them."""


@dataclass(frozen=True)
class DispatchCall:
    """A fresh normal dispatch, its arguments checked by the Buffer.

    Attributes:
        x: ``[N, H]`` rows, or DeepEP's FP8 input ``(e4m3 [N, H], scales [N, G])``.
        topk_idx: ``[N, K]`` int64 global expert ids with masked ranks' entries already ``-1``, or
            None (a dispatch from the layout alone). topk_weights: ``[N, K]`` float or None.
        is_token_in_rank: ``[N, R]`` bool. placement: the expert -> rank map.
        codec: ``"none"``, ``"fp8"`` or ``"lossless"`` (``"auto"`` already resolved).
        masked: whether any rank is masked. num_sms: the Buffer's SM budget (``Buffer.num_sms``).
    """

    x: Payload
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    is_token_in_rank: torch.Tensor
    placement: ExpertPlacement
    codec: str
    masked: bool
    num_sms: int


@dataclass(frozen=True)
class CachedDispatchCall:
    """A dispatch along an earlier dispatch's handle: ``x [N, H]`` (or an FP8 tuple)."""

    handle: DispatchHandle
    x: Payload
    codec: str
    masked: bool


@dataclass(frozen=True)
class CombineCall:
    """A normal combine: ``x [M, H]`` received rows, ``topk_weights [M, K]`` or None, up to two
    ``[N, H]`` biases."""

    handle: DispatchHandle
    x: torch.Tensor
    topk_weights: torch.Tensor | None
    biases: tuple[torch.Tensor, ...]
    codec: str
    masked: bool


@dataclass(frozen=True)
class LowLatencyDispatchCall:
    """A low-latency dispatch: ``x [N, H]`` bf16, ``topk_idx [N, K]`` int64 (masked ranks'
    entries ``-1``), capacity ``max_tokens`` per rank, and the Buffer's receive tensors to fill.
    ``nvfp4``: ``x`` holds compact NVFP4 rows (``ep_comm.codecs.nvfp4.pack_rows``), narrower
    than the combine's ``H``."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    max_tokens: int
    placement: ExpertPlacement
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    receive_area: tuple[torch.Tensor, ...]
    masked: bool
    nvfp4: bool = False


@dataclass(frozen=True)
class LowLatencyCombineCall:
    """A low-latency combine: ``x [L, R*T, H]`` bf16 expert outputs, the dispatch's routing and
    ``topk_weights [N, K]`` float32, an optional ``[N, H]`` bf16 ``out``."""

    handle: LowLatencyHandle
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    placement: ExpertPlacement
    out: torch.Tensor | None
    masked: bool


class Path:
    """One implementation of the Buffer's calls. A subclass overrides the modes it offers (their
    reason and their method); the others answer that the path does not offer them.

    Attributes:
        name: the path's name in :class:`PathPlan` reports.
        unavailable: why this path cannot run any call on this Buffer (decided at construction,
            or when the Buffer masks ranks), or None.
    """

    name = "path"

    def __init__(self, unavailable: str | None = None) -> None:
        self.unavailable = unavailable

    def mode_unavailable(self, mode: str) -> str | None:
        """Why this path cannot run ``mode`` on this Buffer whatever the call (None: it may)."""
        return self.unavailable

    def _not_offered(self, mode: str) -> str:
        return f"the {self.name} path has no {mode.replace('_', ' ')}"

    # -- normal mode -----------------------------------------------------------------------------
    def dispatch_reason(self, call: DispatchCall) -> str | None:
        return self._not_offered("dispatch")

    def dispatch(self, call: DispatchCall) -> DispatchOutput:
        raise NotImplementedError(self._not_offered("dispatch"))

    def cached_dispatch_reason(self, call: CachedDispatchCall) -> str | None:
        return self._not_offered("cached_dispatch")

    def cached_dispatch(self, call: CachedDispatchCall) -> tuple[Payload, CommStats]:
        raise NotImplementedError(self._not_offered("cached_dispatch"))

    def combine_reason(self, call: CombineCall) -> str | None:
        return self._not_offered("combine")

    def combine(self, call: CombineCall) -> tuple[torch.Tensor, torch.Tensor | None, CommStats]:
        raise NotImplementedError(self._not_offered("combine"))

    # -- low-latency mode ------------------------------------------------------------------------
    def low_latency_dispatch_reason(self, call: LowLatencyDispatchCall) -> str | None:
        return self._not_offered("low_latency_dispatch")

    def low_latency_dispatch(self, call: LowLatencyDispatchCall) -> LowLatencyDispatchOutput:
        raise NotImplementedError(self._not_offered("low_latency_dispatch"))

    def low_latency_combine_reason(self, call: LowLatencyCombineCall) -> str | None:
        return self._not_offered("low_latency_combine")

    def low_latency_combine(self, call: LowLatencyCombineCall
                            ) -> tuple[Callable[[], torch.Tensor], CommStats]:
        raise NotImplementedError(self._not_offered("low_latency_combine"))

    def ranks_changed(self, transport: Transport) -> None:
        """The Buffer's live ranks changed (``mask_ranks`` / ``unmask_ranks``); ``transport`` is
        its new flat transport over them."""

    def close(self) -> None:
        """Releases what the path holds (collective where its engines are)."""


@dataclass(frozen=True)
class PathChoice:
    """Which path ran a call, and why each path before it in the order did not take it."""

    mode: str
    path: str
    passed_over: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        skipped = "; ".join(f"not {name}: {why}" for name, why in self.passed_over)
        return f"{self.mode}: {self.path}" + (f" ({skipped})" if skipped else "")


@dataclass
class PathPlan:
    """A Buffer's paths in order of preference; :meth:`choose` gives each call the first path
    that takes it.

    ``str(plan)`` (and :meth:`describe`) says, for every mode, which paths may run at all and why
    the others cannot; ``last`` holds the choice of the latest call of each mode with the reasons
    the paths before it gave.
    """

    paths: list[Path]
    transport: str = ""
    """The transport every rank agreed on, and why (``"torch: ..."``)."""
    last: dict[str, PathChoice] = field(default_factory=dict)

    def choose(self, mode: str, call: object) -> Path:
        """The first path whose ``<mode>_reason(call)`` is None.

        Raises:
            ValueError: no path takes the call (each path's reason is in the message).
        """
        passed: list[tuple[str, str]] = []
        for path in self.paths:
            why = path.unavailable or getattr(path, f"{mode}_reason")(call)
            if why is None:
                self.last[mode] = PathChoice(mode, path.name, tuple(passed))
                return path
            passed.append((path.name, why))
        raise ValueError(f"no path of this Buffer takes this {mode}: "
                         + "; ".join(f"{name}: {why}" for name, why in passed))

    def get(self, name: str) -> Path | None:
        """The path called ``name``, or None."""
        return next((p for p in self.paths if p.name == name), None)

    def describe(self) -> dict[str, list[tuple[str, str | None]]]:
        """``{mode: [(path, None if it may run that mode on this Buffer else why not), ...]}``,
        in the order the paths are tried. Whether a call is taken also depends on the call
        (``last`` records those decisions)."""
        out: dict[str, list[tuple[str, str | None]]] = {}
        for mode in MODES:
            rows: list[tuple[str, str | None]] = []
            for path in self.paths:
                offered = getattr(type(path), f"{mode}_reason") is not getattr(Path, f"{mode}_reason")
                rows.append((path.name, path.mode_unavailable(mode) if offered else path._not_offered(mode)))
            out[mode] = rows
        return out

    def __str__(self) -> str:
        lines = [f"transport: {self.transport}"] if self.transport else []
        for mode, rows in self.describe().items():
            parts = [name if why is None else f"{name} (no: {why})" for name, why in rows]
            lines.append(f"{mode}: " + " > ".join(parts))
        return "\n".join(lines)
