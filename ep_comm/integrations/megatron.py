"""Megatron-core integration: an ep_comm token dispatcher for Megatron's ``MoELayer``.

``EpCommTokenDispatcher`` implements Megatron's six-method token-dispatcher API on top of the
differentiable ``ep_comm.dispatch`` / ``ep_comm.combine`` (so gradients flow through both), and is
constructed like Megatron's own dispatchers. Two ways to switch a model to it:

* for the whole process, before building the model: ``patch_megatron(codec=None)``, which makes every
  ``MoELayer`` configured with ``moe_token_dispatcher_type="alltoall"`` (or the type given) build
  this dispatcher instead; ``unpatch_megatron()`` undoes it;
* per layer: ``EpCommMoELayer`` (a ``MoELayer`` subclass taking ``codec=``), built directly or named
  in a layer spec (``spec.module = EpCommMoELayer``, ``spec.params = {"codec": "lossless"}``).

How it moves tokens: each token is sent once to every EP rank that holds one of its experts
(``ep_comm.dispatch``), then copied locally once per (token, local expert) pair and sorted by local
expert for Megatron's experts, which apply the routing probabilities themselves. After the experts,
the rows of each received token are summed locally and ``ep_comm.combine`` sums the per-rank
results at the token's source. So the wire carries one row per (token, rank), not per (token,
expert).

Supported configurations: dropless or token-dropping routing without padding to capacity, expert
tensor parallel size 1, any attention TP/SP, the default contiguous expert placement, and no
shared-expert overlap (shared experts computed by the layer itself are fine). Others raise
``ValueError`` at construction.

CUDA graphs: ep_comm's dispatch learns the received-token counts on the host, so the dispatch
itself cannot be inside a CUDA graph. Partial graphs that stop before it work (``cuda_graph_scope``
with ``moe_router`` and ``moe_preprocess``, either ``cuda_graph_impl``): ``dispatch_preprocess``
runs no host synchronisation, and what the rest of the forward needs from it is kept across graph
replays (see ``EpCommTokenDispatcher``). A configuration that puts the dispatch inside a graph (an
empty scope, i.e. the whole layer; ``moe``; ``full_iteration``) raises ``ValueError`` at
construction -- in particular Megatron inference's whole-layer decode graphs, the setting that
``moe_pad_experts_for_cuda_graph_inference`` is made for. When Megatron inference switches decode
padding on around partial graphs (``set_decode_expert_padding``), the dispatcher follows Megatron's
AlltoAll dispatcher: every (token, expert) pair of the padded routing map is dispatched, the
padding pairs with weight 0.

This module imports megatron-core; ``import ep_comm`` never imports it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_layer as _moe_layer
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.transformer.transformer_config import TransformerConfig

from ..autograd import combine, dispatch
from ..buffer import Buffer
from ..handle import DispatchHandle

__all__ = ["EpCommMoELayer", "EpCommTokenDispatcher", "get_buffer", "patch_megatron", "unpatch_megatron"]

_buffers: dict[dist.ProcessGroup, Buffer] = {}


def get_buffer(group: dist.ProcessGroup) -> Buffer:
    """The ``Buffer`` shared by every MoE layer of ``group`` (created, collectively, on first use)."""
    if group not in _buffers:
        _buffers[group] = Buffer(group)
    return _buffers[group]


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor,
                        topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's dense routing to ep_comm's top-k form.

    Args:
        routing_map: ``[N, E]`` bool, True where a token goes to an expert (at most ``topk`` per row).
        probs: ``[N, E]`` float routing probabilities. topk: ``K``.
    Returns:
        ``(topk_idx [N, K]`` int64, the routed experts of each row in ascending order then ``-1``,
        ``topk_weights [N, K]`` float32 (float64 if ``probs`` is), ``probs`` at those experts and
        0 at ``-1``; differentiable with respect to ``probs``).

    Runs no host synchronisation while a CUDA graph is being captured (the check that no row has
    more than ``topk`` experts is skipped then), so it may sit inside a ``moe_preprocess`` graph.
    """
    num_experts = routing_map.shape[1]
    capturing = routing_map.is_cuda and torch.cuda.is_current_stream_capturing()
    most = int(routing_map.sum(dim=1).max()) if routing_map.numel() and not capturing else 0
    if most > topk:
        raise ValueError(f"routing_map routes a token to {most} experts, more than moe_router_topk={topk}")
    rank_key = routing_map.to(torch.int32) * torch.arange(num_experts, 0, -1, dtype=torch.int32,
                                                           device=routing_map.device)
    key, idx = rank_key.topk(topk, dim=1)
    routed = key > 0
    topk_idx = torch.where(routed, idx, torch.full_like(idx, -1)).to(torch.int64)
    weight_dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
    topk_weights = probs.gather(1, idx).to(weight_dtype) * routed.to(weight_dtype)
    return topk_idx, topk_weights


class EpCommTokenDispatcher(MoETokenDispatcher):
    """Megatron token dispatcher that moves tokens with ep_comm.

    Args:
        num_local_experts: experts on this EP rank (``L``).
        local_expert_indices: their global ids (must be ``[ep_rank * L, (ep_rank + 1) * L)``).
        config: the layer's ``TransformerConfig``.
        pg_collection: Megatron's ``ProcessGroupCollection`` (``ep`` is the EP group); default:
            Megatron's global parallel state.
        codec: ep_comm codec for the dispatch (``None``, ``"lossless"``, ``"fp8"``, ``"auto"``);
            the combine uses it too, except ``"fp8"``, which is dispatch-only.
        buffer: the ``ep_comm.Buffer`` to use (default: one shared per EP group, ``get_buffer``).

    Between the calls of one forward, the dispatcher keeps the routing and the dispatch handle:
    ``topk_idx [N, K]`` int64, ``handle``, ``recv_topk_idx [M, K]`` int64 and the row permutation
    ``permuted_rows [P]`` int64 (``P`` = received (token, local expert) pairs).

    ``dispatch_preprocess`` produces ``topk_idx``, ``hidden_shape`` (the input's shape) and
    ``probs_dtype``. A partial CUDA graph replay skips it, so these must outlive the forward:
    ``topk_idx`` is in ``cudagraph_attrs`` (a graph output, which Megatron sets back on the
    dispatcher at every replay), and ``hidden_shape`` / ``probs_dtype``, which are not tensors, are
    kept from the last ``dispatch_preprocess`` (a graph always replays the shapes it captured).

    ``drop_and_pad``: False unless Megatron inference switches decode padding on
    (``set_decode_expert_padding``); then routing maps may select up to ``E`` experts per token
    (the padding pairs with probability 0), and all of them are dispatched.
    """

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config: TransformerConfig,
                 pg_collection: Any = None, *, codec: str | None = None,
                 buffer: Buffer | None = None) -> None:
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        _check_supported(config, self.tp_size)
        self.drop_and_pad = False
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.router_topk = config.moe_router_topk
        self.codec = codec
        self.buffer = buffer if buffer is not None else get_buffer(self.ep_group)
        if self.buffer.group_size != self.ep_size:
            raise ValueError(f"buffer spans {self.buffer.group_size} ranks but the EP group has "
                             f"{self.ep_size}")
        owned = self.buffer.placement(self.num_experts).local_experts(self.buffer.rank).tolist()
        if owned != self.local_expert_indices or len(owned) != num_local_experts:
            raise ValueError(f"local_expert_indices {self.local_expert_indices} differ from the experts "
                             f"ep_comm places on EP rank {self.buffer.rank}: {owned}")
        self.cudagraph_attrs = ["topk_idx"]
        self.hidden_shape: torch.Size | None = None
        self.probs_dtype = torch.float32
        self.tokens_per_expert: list[int] = []
        self.topk_idx: torch.Tensor | None = None
        self.handle: DispatchHandle | None = None
        self.recv_topk_idx: torch.Tensor | None = None
        self.permuted_rows: torch.Tensor | None = None

    def set_shared_experts(self, shared_experts: Any) -> None:
        """Shared-expert overlap is not supported (the layer computes shared experts itself)."""
        raise ValueError("EpCommTokenDispatcher does not overlap shared experts: set "
                         "moe_shared_expert_overlap=False")

    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flattens the tokens and converts the routing (no communication).

        Args:
            tokens: ``[S, B, H]`` (or ``[N, H]``) hidden states. routing_map: ``[N, E]`` bool.
            probs: ``[N, E]`` float routing probabilities (``N = S * B``).
        Returns:
            ``(hidden [N, H]`` tokens' dtype, ``topk_weights [N, K]`` float32); ``topk_idx [N, K]``
            is kept on the dispatcher.
        """
        self.hidden_shape = tokens.shape
        hidden = tokens.reshape(-1, tokens.shape[-1])
        num_tokens = hidden.shape[0]
        topk = self.num_experts if self.drop_and_pad else self.router_topk
        self.topk_idx, topk_weights = routing_map_to_topk(
            routing_map.reshape(num_tokens, -1), probs.reshape(num_tokens, -1), topk)
        self.probs_dtype = probs.dtype
        return hidden, topk_weights

    def token_dispatch(self, hidden_states: torch.Tensor,
                       probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sends each token once to every EP rank holding one of its experts.

        Args:
            hidden_states: ``[N, H]``. probs: ``[N, K]`` float32 top-k weights.
        Returns:
            ``(recv_x [M, H]``, ``recv_weights [M, K]`` float32, 0 where the expert is elsewhere).
        """
        recv_x, recv_idx, recv_w, counts, handle, _ = dispatch(self.buffer, hidden_states.contiguous(),
                                                          self.topk_idx, probs, self.num_experts,
                                                          codec=self.codec)
        self.handle, self.recv_topk_idx, self.tokens_per_expert = handle, recv_idx, counts
        return recv_x, recv_w

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies each received token once per local expert and groups the copies by expert.

        Args:
            hidden_states: ``[M, H]`` received tokens. probs: ``[M, K]`` their weights.
        Returns:
            ``(permuted_tokens [P, H]``, ``tokens_per_expert [L]`` int64 on the CPU,
            ``permuted_probs [P]`` in the router's probs dtype), rows of local expert 0 first; within
            an expert, rows keep the received order (by source rank, then source token).
        """
        rows, cols = torch.nonzero(self.recv_topk_idx >= 0, as_tuple=True)
        experts = self.recv_topk_idx[rows, cols]
        order = torch.argsort(experts, stable=True)
        self.permuted_rows, cols = rows[order], cols[order]
        tokens_per_expert = torch.tensor(self.tokens_per_expert, dtype=torch.int64)
        permuted_tokens = hidden_states.index_select(0, self.permuted_rows)
        permuted_probs = probs[self.permuted_rows, cols].to(self.probs_dtype)
        return permuted_tokens, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Sums each received token's expert outputs (already weighted by the experts).

        Args:
            hidden_states: ``[P, H]`` expert outputs in ``dispatch_postprocess``'s order.
        Returns:
            ``[M, H]``, one row per received token (accumulated in float32 for 16-bit inputs).
        """
        acc = hidden_states.dtype if hidden_states.dtype in (torch.float32, torch.float64) else torch.float32
        out = hidden_states.new_zeros(self.handle.num_recv_rows, hidden_states.shape[1], dtype=acc)
        out = out.index_add(0, self.permuted_rows, hidden_states.to(acc))
        self.permuted_rows = None
        return out.to(hidden_states.dtype)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Returns the per-rank sums to each token's source rank and adds them up.

        Args:
            hidden_states: ``[M, H]``.
        Returns:
            ``[N, H]`` in the original token order.
        """
        combine_codec = None if self.codec == "fp8" else self.codec
        out, _, _ = combine(self.buffer, hidden_states.contiguous(), self.handle, codec=combine_codec)
        self.handle, self.recv_topk_idx = None, None
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` -> the input's shape (``[S, B, H]``).

        ``hidden_shape`` stays set: a partial CUDA graph replay of the next forward skips
        ``dispatch_preprocess`` and reuses it.
        """
        out = hidden_states.view(self.hidden_shape)
        self.topk_idx = None
        return out


_GRAPHED_DISPATCH_SCOPES = ("moe", "full_iteration")
"""CUDA graph scopes that put the token dispatch inside a graph (an empty scope does too)."""


def _check_supported(config: TransformerConfig, expert_tp_size: int) -> None:
    if config.cuda_graph_impl not in (None, "none"):
        scopes = [getattr(scope, "name", str(scope)) for scope in (config.cuda_graph_scope or [])]
        if not scopes or any(scope in _GRAPHED_DISPATCH_SCOPES for scope in scopes):
            raise ValueError(
                f"EpCommTokenDispatcher cannot run inside a CUDA graph (cuda_graph_impl="
                f"{config.cuda_graph_impl!r}, cuda_graph_scope={scopes or 'the whole layer'}): ep_comm's "
                "dispatch learns the received-token counts on the host. Capture only up to the dispatch "
                "(cuda_graph_scope with 'moe_router' and 'moe_preprocess', plus 'attn' if wanted); this "
                "also rules out Megatron inference's whole-layer decode graphs "
                "(moe_pad_experts_for_cuda_graph_inference)")
    if expert_tp_size != 1:
        raise ValueError(f"EpCommTokenDispatcher needs expert_tensor_parallel_size=1, got {expert_tp_size}")
    if config.moe_pad_expert_input_to_capacity:
        raise ValueError("EpCommTokenDispatcher does not support moe_pad_expert_input_to_capacity")
    if config.moe_router_padding_for_quantization:
        raise ValueError("EpCommTokenDispatcher does not support moe_router_padding_for_quantization")
    if config.moe_shared_expert_overlap:
        raise ValueError("EpCommTokenDispatcher does not support moe_shared_expert_overlap")


class EpCommMoELayer(MoELayer):
    """Megatron's ``MoELayer`` with an ``EpCommTokenDispatcher``, whatever
    ``moe_token_dispatcher_type`` says.

    Args: those of ``MoELayer`` (``config, submodules, layer_number, pg_collection``), plus
        ``codec`` and ``buffer`` for the dispatcher.

    In a layer spec (``spec.module = EpCommMoELayer``), note that megatron-core 0.16's
    ``TransformerLayer`` passes its ``pg_collection`` only to the exact ``MoELayer`` class, so this
    layer then uses Megatron's global parallel state unless ``spec.params`` holds a
    ``pg_collection``; ``patch_megatron`` has no such caveat.
    """

    def __init__(self, config: TransformerConfig, submodules: MoESubmodules | None = None,
                 layer_number: int | None = None, pg_collection: Any = None, *,
                 codec: str | None = None, buffer: Buffer | None = None) -> None:
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        with _dispatcher_as(config.moe_token_dispatcher_type, _factory(codec, buffer)):
            super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                             pg_collection=pg_collection)


_DISPATCHER_NAMES = {"allgather": "MoEAllGatherTokenDispatcher", "alltoall": "MoEAlltoAllTokenDispatcher",
                     "flex": "MoEFlexTokenDispatcher"}
_originals: dict[str, Any] = {}


def _factory(codec: str | None, buffer: Buffer | None) -> Callable[..., Any]:
    """A callable with the constructor signature of Megatron's dispatchers."""
    def make(num_local_experts: int, local_expert_indices: list[int], config: TransformerConfig,
             pg_collection: Any = None) -> EpCommTokenDispatcher:
        return EpCommTokenDispatcher(num_local_experts, local_expert_indices, config=config,
                                     pg_collection=pg_collection, codec=codec, buffer=buffer)
    return make


@contextmanager
def _dispatcher_as(dispatcher_type: str, factory: Callable[..., Any]) -> Iterator[None]:
    """Within the block, ``MoELayer`` builds ``factory(...)`` for ``dispatcher_type``."""
    if dispatcher_type not in _DISPATCHER_NAMES:
        raise ValueError(f"unknown moe_token_dispatcher_type {dispatcher_type!r}")
    name = _DISPATCHER_NAMES[dispatcher_type]
    saved = getattr(_moe_layer, name)
    setattr(_moe_layer, name, factory)
    try:
        yield
    finally:
        setattr(_moe_layer, name, saved)


def patch_megatron(codec: str | None = None, dispatcher_type: str = "alltoall") -> None:
    """Makes every ``MoELayer`` built from now on with ``moe_token_dispatcher_type ==
    dispatcher_type`` use ``EpCommTokenDispatcher(codec=codec)``. Call on every rank before
    building the model; ``unpatch_megatron()`` restores Megatron's dispatcher."""
    if dispatcher_type not in _DISPATCHER_NAMES:
        raise ValueError(f"dispatcher_type must be one of {sorted(_DISPATCHER_NAMES)}, "
                         f"got {dispatcher_type!r}")
    name = _DISPATCHER_NAMES[dispatcher_type]
    _originals.setdefault(name, getattr(_moe_layer, name))
    setattr(_moe_layer, name, _factory(codec, None))


def unpatch_megatron() -> None:
    """Undoes every ``patch_megatron``."""
    for name, original in _originals.items():
        setattr(_moe_layer, name, original)
    _originals.clear()
