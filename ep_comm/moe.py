"""A small reference Mixture-of-Experts layer built on the differentiable dispatch/combine.

``MoE`` is what a user can drop into a model: a top-k softmax router, ``E`` two-layer MLP experts
spread over the ranks of a process group, ``ep_comm.dispatch`` to send each token once to every
rank that holds one of its experts, and ``ep_comm.combine`` to bring the results back::

    moe = ep_comm.moe.MoE(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2,
                          group=dist.group.WORLD, init_seed=0)
    y = moe(x)                     # x: [..., 64] -> y: [..., 64], differentiable

Where the routing weights are applied: on the expert's rank, before the combine. Each received
row is run through every local expert it was routed to, each output is multiplied by that
expert's weight, and the weighted outputs of the row are summed; the combine then only sums the
per-rank partial results (so the combine payload is one row per (token, rank), and the weight
gradients flow back through the dispatch of ``topk_weights``).

With ``group=None`` and no ``buffer`` the layer holds all ``E`` experts and does no communication:
that is the single-process reference of the same layer (same routing, same expert maths), which the
tests compare the distributed layer against. ``MoE.copy_from`` loads a rank's share of the experts
from such a full layer.

Gradients of the replicated parameters (the router) are per-rank partial sums, like any
data-parallel parameter: all-reduce them over the data-parallel ranks (see
``replicated_parameters``). Expert parameters live on one rank only and need no reduction across
the expert-parallel group.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .autograd import combine, dispatch
from .buffer import Buffer
from .validation import check_codec


class ExpertMLP(nn.Module):
    """One expert: ``fc2(gelu(fc1(x)))`` without biases.

    Args:
        hidden_size: ``H``. ffn_hidden_size: ``F``.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size, bias=False, device=device, dtype=dtype)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]`` (same dtype)."""
        return self.fc2(F.gelu(self.fc1(x)))


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
          normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing.

    Args:
        x: ``[N, H]`` tokens (any float dtype). router_weight: ``[E, H]``.
        top_k: ``K``. normalize: rescale the ``K`` chosen probabilities to sum to 1.
    Returns:
        ``(topk_idx [N, K]`` int64 global expert ids, ``topk_weights [N, K]`` float32, or float64
        when ``x`` is float64). Softmax and top-k run in that float type.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    probs = torch.softmax(F.linear(x.to(compute), router_weight.to(compute)), dim=-1)
    topk_weights, topk_idx = probs.topk(top_k, dim=-1)
    if normalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_idx.to(torch.int64), topk_weights


def apply_experts(experts: nn.ModuleList, x: torch.Tensor, local_idx: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the chosen experts' outputs, row by row.

    Args:
        experts: ``L`` experts. x: ``[M, H]``. local_idx: ``[M, K]`` int64 in ``[-1, L)``
            (``-1``: not an expert of this list). weights: ``[M, K]`` float32/float64.
    Returns:
        ``[M, H]`` in ``x``'s dtype: ``out[m] = sum_k weights[m, k] * experts[local_idx[m, k]](x[m])``
        (accumulated in float32 for 16-bit ``x``); rows with no expert here are zero.
    """
    acc = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    out = x.new_zeros(x.shape[0], x.shape[1], dtype=acc)
    if len(experts) == 0:
        # no expert here: out stays in x's and weights' graph (sums over no element: exactly 0, even
        # for non-finite x), so this rank still runs the backward's exchanges its peers wait for
        out = out + x[:0].sum().to(acc) + weights[:0].sum().to(acc)
    for j, expert in enumerate(experts):
        rows, cols = torch.nonzero(local_idx == j, as_tuple=True)
        y = expert(x.index_select(0, rows)).to(acc) * weights[rows, cols].to(acc).unsqueeze(-1)
        out = out.index_add(0, rows, y)
    return out.to(x.dtype)


class MoE(nn.Module):
    """Top-k MoE layer with expert parallelism over a process group (or none).

    Args:
        hidden_size: ``H``. ffn_hidden_size: each expert's inner size ``F``.
        num_experts: ``E`` (divisible by the group size with the default contiguous placement).
        top_k: experts per token ``K``.
        group: the expert-parallel process group; a ``Buffer`` is created on it (collective).
        buffer: an existing ``ep_comm.Buffer`` to use instead (its group is the EP group).
            With neither, the layer holds all experts and never communicates (the single-process
            reference).
        normalize_weights: rescale each token's top-k probabilities to sum to 1.
        codec: the dispatch codec (``None``, ``"lossless"``, ...); the combine uses it too unless
            it is ``"fp8"``, which is dispatch-only.
        init_seed: when given, the router and each global expert are initialised from their own
            seeded generator, so every world size builds the same global parameters.
        device, dtype: of the parameters (the router is always float32, or float64 with
            ``dtype=torch.float64``); ``x`` must have the experts' dtype (outside autocast).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, *,
                 group: dist.ProcessGroup | None = None, buffer: Buffer | None = None,
                 normalize_weights: bool = True, codec: str | None = None, init_seed: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        check_codec(codec, ("none", "fp8", "lossless", "auto"))
        if codec == "fp8" and hidden_size % 128:
            raise ValueError(f"codec='fp8' needs a hidden_size divisible by 128, got {hidden_size}")
        if buffer is None and group is not None:
            buffer = Buffer(group)
        self.buffer = buffer
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.normalize_weights, self.codec = normalize_weights, codec
        if buffer is None:
            self.global_expert_ids = list(range(num_experts))
        else:
            self.global_expert_ids = buffer.placement(num_experts).local_experts(buffer.rank).tolist()
        router_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device,
                                                      dtype=router_dtype))
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, ffn_hidden_size, device=device, dtype=dtype)
                                     for _ in self.global_expert_ids)
        self.reset_parameters(init_seed)

    def reset_parameters(self, seed: int | None = None) -> None:
        """Re-initialises the parameters (see ``init_seed``)."""
        def gen(stream: int) -> torch.Generator | None:
            return None if seed is None else torch.Generator().manual_seed(seed * 1_000_003 + stream)

        with torch.no_grad():
            self.router_weight.copy_(_normal(self.router_weight, self.hidden_size ** -0.5, gen(0)))
            for expert, g in zip(self.experts, self.global_expert_ids):
                generator = gen(g + 1)
                for lin in (expert.fc1, expert.fc2):
                    lin.weight.copy_(_normal(lin.weight, 1 / math.sqrt(lin.in_features), generator))

    # The state dict also holds "expert_ids": the global ids of experts.0, experts.1, ... (positions
    # in this rank's list). Loading refuses a state dict whose experts are other ones (saved under
    # another expert placement or by another rank); one without the key (saved before it existed)
    # loads unchecked.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "expert_ids"] = torch.tensor(self.global_expert_ids, dtype=torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "expert_ids"
        saved = state_dict.get(key)
        if saved is not None and torch.as_tensor(saved).tolist() != self.global_expert_ids:
            error_msgs.append(f"{key}: the state dict holds experts {torch.as_tensor(saved).tolist()}, this layer "
                              f"holds {self.global_expert_ids} (saved under another expert placement or by "
                              f"another rank)")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if key in unexpected_keys:
            unexpected_keys.remove(key)

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters of the local experts (owned by this rank alone)."""
        return list(self.experts.parameters())

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds a copy of (the router): all-reduce their gradients."""
        return [self.router_weight]

    @torch.no_grad()
    def copy_from(self, full: "MoE") -> None:
        """Loads the router and this rank's experts from a layer holding all ``E`` experts."""
        if full.global_expert_ids != list(range(self.num_experts)):
            raise ValueError("copy_from needs a layer that holds all experts (built without a group)")
        self.router_weight.copy_(full.router_weight)
        for expert, g in zip(self.experts, self.global_expert_ids):
            expert.load_state_dict(full.experts[g].state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]`` (same dtype): ``sum_k w_k * expert_{i_k}(x)`` per token."""
        try:
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.hidden_size:
                shown = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"x must be [..., {self.hidden_size}], got {shown}")
            # (the experts' dtype now: .to(), .bfloat16() and the like may have changed it since)
            expert_dtype = self.experts[0].fc1.weight.dtype if len(self.experts) else x.dtype
            if x.dtype != expert_dtype and not _autocast(x):
                raise ValueError(f"x is {x.dtype}, this layer's experts are {expert_dtype}")
        except ValueError as error:
            if self.buffer is None:
                raise
            self.buffer._refuse("dispatch", error)  # the peers' dispatch fails naming this rank, no timeout
        tokens = x.reshape(-1, self.hidden_size)
        topk_idx, topk_weights = route(tokens, self.router_weight, self.top_k, self.normalize_weights)
        if self.buffer is None:
            return apply_experts(self.experts, tokens, topk_idx, topk_weights).reshape(x.shape)
        recv_x, recv_idx, recv_w, _, handle, _ = dispatch(self.buffer, tokens.contiguous(), topk_idx,
                                                          topk_weights, self.num_experts, codec=self.codec)
        partial = apply_experts(self.experts, recv_x, recv_idx, recv_w)
        combine_codec = None if self.codec == "fp8" else self.codec
        out, _, _ = combine(self.buffer, partial, handle, codec=combine_codec)
        return out.reshape(x.shape)


def _autocast(x: torch.Tensor) -> bool:
    """Whether autocast is on for ``x``'s device (it then casts x for the layer's matmuls)."""
    try:
        return torch.is_autocast_enabled(x.device.type)
    except TypeError:  # a torch whose is_autocast_enabled takes no device type
        return torch.is_autocast_enabled()


def _normal(like: torch.Tensor, std: float, generator: torch.Generator | None) -> torch.Tensor:
    """A ``like``-shaped N(0, std^2) sample, drawn on the CPU so seeded draws match everywhere."""
    sample = torch.randn(like.shape, generator=generator, dtype=torch.float32) * std
    return sample.to(like.device, like.dtype)
