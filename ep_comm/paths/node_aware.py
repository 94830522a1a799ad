"""The node-aware path: normal-mode dispatch and combine in two hops (``hierarchical.py``) over
the Buffer's node transports (``torch.distributed`` subgroups). It takes every normal-mode call of
a Buffer made with ``ranks_per_node`` until ranks are masked; low-latency calls stay flat."""
from __future__ import annotations

import torch

from .. import hierarchical
from ..normal import DispatchOutput
from ..payload import Payload
from ..stats import CommStats
from ..transports.base import Transport
from ..transports.node_groups import NodeTransports
from .base import CachedDispatchCall, CombineCall, DispatchCall, Path

MASKED = "ranks were masked: the Buffer runs flat for the rest of its life"


class NodeAwarePath(Path):
    """``hierarchical.py`` over ``groups`` (this rank's rail and node transports)."""

    name = "node-aware"

    def __init__(self, groups: NodeTransports | None, buffer_id: int, unavailable: str | None = None) -> None:
        super().__init__(unavailable)
        self.groups, self.buffer_id = groups, buffer_id

    def ranks_changed(self, transport: Transport) -> None:
        # the node subgroups may hold a half-finished exchange with a failed peer
        self.unavailable = self.unavailable or MASKED

    def dispatch_reason(self, call: DispatchCall) -> str | None:
        return None

    def dispatch(self, call: DispatchCall) -> DispatchOutput:
        return hierarchical.dispatch(self.groups, self.buffer_id, call.x, call.topk_idx, call.topk_weights,
                                     call.is_token_in_rank, call.placement, call.codec)

    def cached_dispatch_reason(self, call: CachedDispatchCall) -> str | None:
        return None if call.handle.node_plan is not None else "the dispatch ran flat"

    def cached_dispatch(self, call: CachedDispatchCall) -> tuple[Payload, CommStats]:
        return hierarchical.cached_dispatch(self.groups, call.handle, call.x, call.codec)

    def combine_reason(self, call: CombineCall) -> str | None:
        return None if call.handle.node_plan is not None else "the dispatch ran flat"

    def combine(self, call: CombineCall) -> tuple[torch.Tensor, torch.Tensor | None, CommStats]:
        return hierarchical.combine(self.groups, call.handle, call.x, call.topk_weights, call.biases, call.codec)
