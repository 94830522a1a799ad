"""``--check``: every result of a timed call against a plain single-process reference.

Each rank gathers all ranks' inputs (``x``, ``topk_idx``, ``topk_weights``) and recomputes what
it should have received with :mod:`ep_comm.reference` (the definitions of docs/design.md §1,
independent of ep_comm's layout/plan code). Bit-exact codecs (``none``, ``lossless``) must match
exactly on dispatch; FP8 within e4m3's rounding; combines within bf16 rounding of the sums.

The combine inputs are made rank- or expert-dependent (``rank_factor``, ``expert_factor``), so a
row returned to the wrong token or reduced by the wrong weight shows up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import reference
from ..placement import ExpertPlacement

BF16_REL = 2.0 ** -6
FP8_REL = 2.0 ** -4 + 2.0 ** -7


@dataclass
class GlobalInputs:
    """All ranks' inputs, on the CPU: ``x [R, N, H]`` bf16, ``topk_idx [R, N, K]``,
    ``topk_weights [R, N, K]``."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_experts: int

    @property
    def num_ranks(self) -> int:
        return self.x.shape[0]

    @property
    def num_local(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def placement(self) -> ExpertPlacement:
        """ep-bench's placement: DeepEP's contiguous blocks of ``E / R`` experts."""
        return ExpertPlacement.contiguous(self.num_experts, self.num_ranks)


def gather_inputs(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  num_experts: int, group: dist.ProcessGroup | None) -> GlobalInputs:
    """All-gathers every rank's inputs (as bytes, which every backend can move)."""
    def gather(t: torch.Tensor) -> torch.Tensor:
        flat = t.contiguous().view(torch.uint8).reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, flat, group=group)
        return torch.stack([p.cpu().view(t.dtype).reshape(t.shape) for p in parts])

    return GlobalInputs(gather(x), gather(topk_idx), gather(topk_weights), num_experts)


def rank_factor(rank: int) -> float:
    """What rank ``rank`` multiplies received rows by before a normal-mode combine."""
    return 1.0 + rank


def expert_factor(expert: torch.Tensor) -> torch.Tensor:
    """What the expert ``expert`` (global id) multiplies its rows by before a weighted combine."""
    return 1.0 + (expert % 4).to(torch.float32) / 4.0


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[..., H]`` with float32 ``[..., H/128]`` scales -> bf16."""
    vals = q.view(torch.float8_e4m3fn).float()
    shape = vals.shape
    groups = scales.shape[-1]
    out = vals.reshape(*shape[:-1], groups, shape[-1] // groups) * scales.float().unsqueeze(-1)
    return out.reshape(shape).to(torch.bfloat16)


def as_bf16(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return dequantize(*x) if isinstance(x, tuple) else x


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-element max |x| of its 128-channel block (float32)."""
    xf = x.float().abs()
    if xf.shape[-1] % 128:
        return xf.amax(-1, keepdim=True).expand_as(xf)
    blocks = xf.reshape(*xf.shape[:-1], -1, 128).amax(-1, keepdim=True)
    return blocks.expand(*blocks.shape[:-1], 128).reshape(xf.shape)


def compare(name: str, got: torch.Tensor, want: torch.Tensor, fp8: bool,
            scale: torch.Tensor | None = None, amax: torch.Tensor | None = None,
            rel: float | None = None) -> list[str]:
    """Exact when not ``fp8`` and ``scale`` is None, else ``|got - want| <= tol`` elementwise.

    ``tol = rel * scale + amax / 448 * 2**-8 + 1e-6`` where ``scale`` (default ``|want|``) is the
    magnitude of the terms summed, ``rel`` covers bf16 rounding (and e4m3's with ``fp8``), and
    ``amax`` (default: ``want``'s 128-channel block maxima) covers e4m3's subnormal steps.
    ``rel`` overrides the bf16 part (a sum accumulated in bf16 needs more).
    """
    if got.shape != want.shape:
        return [f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"]
    if not fp8 and scale is None:
        if torch.equal(got.cpu(), want.cpu()):
            return []
        bad = (got.cpu() != want.cpu()).nonzero()
        return [f"{name}: {bad.shape[0]} elements differ (first at {bad[0].tolist()})"]
    g, w = got.cpu().float(), want.cpu().float()
    mag = w.abs() if scale is None else scale.cpu().float()
    if rel is None:
        rel = BF16_REL if scale is not None else 2.0 ** -8
    rel += FP8_REL if fp8 else 0.0
    tol = rel * mag + 1e-6
    if fp8:
        tol = tol + (amax.cpu().float() if amax is not None else block_amax(w)) / 448 * 2.0 ** -8
    err = (g - w).abs()
    if bool((err <= tol).all()):
        return []
    worst = int(torch.argmax(err - tol))
    return [f"{name}: {int((err > tol).sum())} elements out of tolerance (worst error "
            f"{err.reshape(-1)[worst]:.4g} > {tol.reshape(-1)[worst]:.4g})"]


# -- references (ep_comm.reference, for the inputs above) --------------------------------------
def ref_dispatch(g: GlobalInputs, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Normal dispatch on ``rank`` (:func:`ep_comm.reference.dispatch_to`): rows ordered by source
    rank then token, local top-k ids (``-1`` elsewhere), weights (0 elsewhere), tokens per local
    expert."""
    got = reference.dispatch_to(rank, list(g.x), list(g.topk_idx), list(g.topk_weights), g.placement)
    return got.x, got.topk_idx, got.topk_weights, got.counts_per_expert


def ref_normal_combine(g: GlobalInputs, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, H]`` float32 ``sum over ranks r receiving token i of rank_factor(r) * x[i]``,
    the ``[N]`` coefficient); the receiving ranks are :func:`ep_comm.reference.receiving_ranks`."""
    factors = torch.tensor([rank_factor(r) for r in range(g.num_ranks)])
    coef = reference.receiving_ranks(g.topk_idx[rank], g.placement).float() @ factors
    return coef.unsqueeze(1) * g.x[rank].float(), coef


def ref_weighted_combine(g: GlobalInputs, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N, H]`` float32 ``sum_k w[i,k] * expert_factor(e[i,k]) * x[i]``, the coefficient)."""
    idx, w = g.topk_idx[rank], g.topk_weights[rank]
    coef = torch.where(idx >= 0, w * expert_factor(idx.clamp(min=0)), torch.zeros(())).sum(1)
    abs_coef = torch.where(idx >= 0, (w * expert_factor(idx.clamp(min=0))).abs(), torch.zeros(())).sum(1)
    return coef.unsqueeze(1) * g.x[rank].float(), abs_coef


def ref_expert_rows(g: GlobalInputs, rank: int, local_expert: int) -> list[torch.Tensor]:
    """Rows that local expert ``local_expert`` of ``rank`` gets from each source rank, in slot
    order (:func:`ep_comm.reference.expert_slots`)."""
    slots = reference.expert_slots(int(g.placement.local_experts(rank)[local_expert]), list(g.topk_idx))
    return [g.x[src, torch.tensor([t for s, t in slots if s == src], dtype=torch.int64)]
            for src in range(g.num_ranks)]


def match_rows(name: str, got: torch.Tensor, want: torch.Tensor, fp8: bool) -> list[str]:
    """Compares two row sets regardless of order (low-latency mode fixes no order within a
    source rank): each received row is paired with its nearest expected row on 16 random
    projections, the pairing must be one-to-one, then rows are compared."""
    if got.shape != want.shape:
        return [f"{name}: {got.shape[0]} rows, expected {want.shape[0]}"]
    if got.shape[0] == 0:
        return []
    proj = torch.randn(got.shape[1], 16, generator=torch.Generator().manual_seed(0))
    dist_m = torch.cdist(got.float() @ proj, want.float() @ proj)
    nearest = dist_m.argmin(1)
    if torch.unique(nearest).numel() != got.shape[0]:
        return [f"{name}: received rows do not match the expected rows one-to-one"]
    return compare(name, got, want[nearest], fp8)
