"""Argument checks shared by the public calls: each failure is a ValueError naming the argument."""
from __future__ import annotations

import torch

PAYLOAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def require_tensor(name: str, value: object, *, dtypes: tuple[torch.dtype, ...] | None = None,
                   dim: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """Checks that ``value`` is a tensor of one of ``dtypes``, ``dim`` dims, on ``device`` (any
    device when ``device`` is None)."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype {allowed}; got {str(value.dtype).replace('torch.', '')}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(value.shape)}")
    if device is not None and value.device != device and not (
            device.type == value.device.type and device.index is None):
        raise ValueError(f"{name} is on {value.device}, expected {device}")
    return value


def require_shape(name: str, value: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")


def check_topk_idx(topk_idx: object, num_experts: int, device: torch.device,
                   num_tokens: int | None = None, name: str = "topk_idx") -> torch.Tensor:
    """``[N, K]`` int64 with every entry in ``[-1, num_experts)``."""
    t = require_tensor(name, topk_idx, dtypes=(torch.int64,), dim=2, device=device)
    if num_tokens is not None and t.shape[0] != num_tokens:
        raise ValueError(f"{name} has {t.shape[0]} rows but x has {num_tokens} tokens")
    if t.shape[1] == 0:
        raise ValueError(f"{name} must have at least one column (top-k >= 1)")
    if t.numel() > 0:
        low, high = int(t.min()), int(t.max())
        if low < -1 or high >= num_experts:
            raise ValueError(f"{name} entries must lie in [-1, {num_experts}); found values in "
                             f"[{low}, {high}]")
    return t


def check_topk_weights(topk_weights: object, topk_idx: torch.Tensor, device: torch.device,
                       name: str = "topk_weights") -> torch.Tensor:
    """``[N, K]`` float32 matching ``topk_idx`` (float64 accepted for gradient checks)."""
    t = require_tensor(name, topk_weights, dtypes=(torch.float32, torch.float64), dim=2, device=device)
    require_shape(name, t, tuple(topk_idx.shape))
    return t


def check_num_experts(num_experts: object, num_ranks: int, fixed_placement: bool) -> int:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not fixed_placement and num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks "
                         f"({num_ranks}) for the default contiguous placement")
    return num_experts


def check_nonneg_int(name: str, value: object, *, positive: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < (1 if positive else 0):
        kind = "a positive" if positive else "a non-negative"
        raise ValueError(f"{name} must be {kind} int, got {value!r}")
    return value


def check_codec(codec: object, allowed: tuple[str, ...]) -> str:
    name = "none" if codec is None else codec
    if name not in allowed:
        raise ValueError(f"codec must be one of {allowed} (or None), got {codec!r}")
    return str(name)
