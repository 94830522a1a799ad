"""The flat path: every call as one exchange among all ranks over the Buffer's transport
(``normal.py`` and ``low_latency.py``). It takes every call the other paths leave, except a
cached dispatch or combine of a node-aware dispatch."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .. import low_latency, normal
from ..low_latency import LowLatencyDispatchOutput
from ..normal import DispatchOutput
from ..payload import Payload
from ..rows import ScratchPool
from ..stats import CommStats
from ..transports.base import Transport
from .base import (
    CachedDispatchCall,
    CombineCall,
    DispatchCall,
    LowLatencyCombineCall,
    LowLatencyDispatchCall,
    Path,
)


class FlatPath(Path):
    """``normal.py`` / ``low_latency.py`` over ``transport``; low-latency messages reuse the
    bytes of ``scratch``."""

    name = "flat"
    low_latency_transfer = "auto"
    """How low-latency dispatches send their rows: ``"auto"``, ``"fixed"`` or ``"needed"``
    (``ep_comm.low_latency.choose_transfer``); set it alike on every rank."""

    def __init__(self, transport: Transport, buffer_id: int, scratch: ScratchPool) -> None:
        super().__init__()
        self.transport, self.buffer_id, self.scratch = transport, buffer_id, scratch

    def ranks_changed(self, transport: Transport) -> None:
        self.transport = transport

    def dispatch_reason(self, call: DispatchCall) -> str | None:
        return None

    def dispatch(self, call: DispatchCall) -> DispatchOutput:
        return normal.dispatch(self.transport, self.buffer_id, call.x, call.topk_idx, call.topk_weights,
                               call.is_token_in_rank, call.placement, call.codec)

    def cached_dispatch_reason(self, call: CachedDispatchCall) -> str | None:
        return "the dispatch ran node-aware" if call.handle.node_plan is not None else None

    def cached_dispatch(self, call: CachedDispatchCall) -> tuple[Payload, CommStats]:
        return normal.cached_dispatch(self.transport, call.handle, call.x, call.codec)

    def combine_reason(self, call: CombineCall) -> str | None:
        return "the dispatch ran node-aware" if call.handle.node_plan is not None else None

    def combine(self, call: CombineCall) -> tuple[torch.Tensor, torch.Tensor | None, CommStats]:
        return normal.combine(self.transport, call.handle, call.x, call.topk_weights, call.biases, call.codec)

    def low_latency_dispatch_reason(self, call: LowLatencyDispatchCall) -> str | None:
        return None

    def low_latency_dispatch(self, call: LowLatencyDispatchCall) -> LowLatencyDispatchOutput:
        return low_latency.dispatch(self.transport, call.x, call.topk_idx, call.max_tokens, call.placement,
                                    call.use_fp8, call.round_scale, call.use_ue8m0, call.receive_area,
                                    self.scratch, self.low_latency_transfer)

    def low_latency_combine_reason(self, call: LowLatencyCombineCall) -> str | None:
        return "the dispatch ran on the fused kernels" if call.handle.kernel is not None else None

    def low_latency_combine(self, call: LowLatencyCombineCall) -> tuple[Callable[[], torch.Tensor], CommStats]:
        return low_latency.combine(self.transport, call.x, call.topk_idx, call.topk_weights, call.handle.receive,
                                   call.placement, call.out, self.scratch)
