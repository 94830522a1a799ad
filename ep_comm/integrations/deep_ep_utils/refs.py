"""``deep_ep.utils.refs``: reference dispatch/combine that DeepEP's V2 test checks ElasticBuffer against.

* :func:`dispatch`: a plain ``torch.distributed`` all-to-all (collective over the default group;
  tensors move as raw bytes, so bfloat16 / FP8 / int64 all work on gloo as on NCCL). Not expanded;
  received rows sorted by source global token index ``src_rank * num_max_tokens_per_rank + token``.
* :func:`generate_pre_combine_data`: deterministic expert outputs ``y`` computed from each row's
  source global token index, so every rank can build the same values without communication.
* :func:`ordered_accumulate` and :func:`combine`: the combine result with DeepEP's summation order
  (float32 accumulation, rounding to the input dtype after each reduction level).

No GPU is needed; the device of the inputs is used throughout.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .envs import get_global_seed
from .math import ceil_div

__all__ = ["combine", "dispatch", "generate_pre_combine_data", "ordered_accumulate"]

_SEED_PRIME = 131071


def _exchange(send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """All-to-all of ``send``'s rows (``send_counts[r]`` rows to rank ``r``), moved as bytes."""
    row_shape = send.shape[1:]
    row_bytes = int(math.prod(row_shape)) * send.element_size()
    send_bytes = send.contiguous().view(torch.uint8).reshape(send.shape[0], row_bytes)
    recv_bytes = torch.empty(sum(recv_counts), row_bytes, dtype=torch.uint8, device=send.device)
    if row_bytes:
        dist.all_to_all_single(recv_bytes, send_bytes, recv_counts, send_counts)
    return recv_bytes.view(send.dtype).reshape(sum(recv_counts), *row_shape)


def dispatch(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], topk_idx: torch.Tensor,
             topk_weights: torch.Tensor | None, num_max_tokens_per_rank: int, num_experts: int):
    """Reference (non-expanded) dispatch over the default process group.

    Args:
        x: ``[N, H]``, or ``([N, H], [N, ceil(H / 128)])`` FP8 data and scales.
        topk_idx: ``[N, K]`` global expert ids, ``-1`` for none; experts are split evenly and in
            order over the ranks.
        topk_weights: ``[N, K]``; required (as in DeepEP).
        num_max_tokens_per_rank: the stride of the global token index (at least ``N`` on every rank).
        num_experts: total experts, a multiple of the world size.
    Returns:
        ``(recv_x, recv_topk_idx, recv_topk_weights, recv_src_token_idx, num_recv_tokens_per_rank)``:
        the rows of every token with at least one expert here, by source rank then token;
        ``recv_topk_idx`` holds local expert ids (``-1`` for experts elsewhere);
        ``recv_src_token_idx`` is ``[M]`` int32 global token indices; ``num_recv_tokens_per_rank``
        is a ``[R]`` int32 CPU tensor.
    """
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of the world size ({num_ranks})")
    if topk_weights is None:
        raise ValueError("topk_weights is required")
    per_rank = num_experts // num_ranks
    data, sf = x if isinstance(x, tuple) else (x, None)
    num_tokens, hidden = data.shape
    if topk_idx.shape[0] != num_tokens or topk_weights.shape != topk_idx.shape:
        raise ValueError("x, topk_idx and topk_weights must have the same number of rows (and top-k)")
    if sf is not None and tuple(sf.shape) != (num_tokens, ceil_div(hidden, 128)):
        raise ValueError(f"FP8 scales must be [{num_tokens}, {ceil_div(hidden, 128)}], got {tuple(sf.shape)}")
    if num_tokens > num_max_tokens_per_rank:
        raise ValueError(f"{num_tokens} tokens exceed num_max_tokens_per_rank={num_max_tokens_per_rank}")

    dst_rank = torch.where(topk_idx >= 0, topk_idx // per_rank, torch.full_like(topk_idx, -1))
    order: list[torch.Tensor] = []
    for r in range(num_ranks):
        order.append((dst_rank == r).any(dim=1).nonzero().flatten())
    send_counts = [int(t.numel()) for t in order]
    rows = torch.cat(order)
    counts = torch.tensor(send_counts, dtype=torch.int64)
    recv_counts_t = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts_t, counts)
    recv_counts = recv_counts_t.tolist()

    src_idx = (rows + rank * num_max_tokens_per_rank).to(torch.int32)
    recv_data = _exchange(data[rows], send_counts, recv_counts)
    recv_sf = _exchange(sf[rows], send_counts, recv_counts) if sf is not None else None
    recv_topk = _exchange(topk_idx[rows], send_counts, recv_counts)
    recv_w = _exchange(topk_weights[rows], send_counts, recv_counts)
    recv_src = _exchange(src_idx, send_counts, recv_counts)

    first = rank * per_rank
    here = (recv_topk >= first) & (recv_topk < first + per_rank)
    recv_topk = torch.where(here, recv_topk - first, torch.full_like(recv_topk, -1))
    recv_x = (recv_data, recv_sf) if sf is not None else recv_data
    return recv_x, recv_topk, recv_w, recv_src, torch.tensor(recv_counts, dtype=torch.int32)


def generate_pre_combine_data(src_token_global_idx: torch.Tensor, num_max_tokens_per_rank: int,
                              num_topk: int, hidden: int) -> torch.Tensor:
    """``[M, K, H]`` bfloat16 stand-in expert outputs, a pure function of the global token index.

    For row ``i``, slot ``j`` and channel ``c``, with ``s = src_token_global_idx[i] * K + j`` and
    ``S = world_size * num_max_tokens_per_rank * K``::

        y[i, j, c] = sin(((s * 131071 mod S) + 1) / S * (c + 1) + sin(global_seed))

    computed in float32 and rounded to bfloat16 (``global_seed`` from ``init_seed``).
    """
    device = src_token_global_idx.device
    max_seed = dist.get_world_size() * num_max_tokens_per_rank * num_topk
    seeds = src_token_global_idx.to(torch.int64).unsqueeze(1) * num_topk + \
        torch.arange(num_topk, device=device, dtype=torch.int64)
    phase = ((seeds * _SEED_PRIME) % max_seed).to(torch.float32).add(1).div(max_seed)
    channels = torch.arange(1, hidden + 1, device=device, dtype=torch.float32)
    y = torch.sin(phase.unsqueeze(-1) * channels + math.sin(float(get_global_seed())))
    return y.to(torch.bfloat16)


def ordered_accumulate(data: torch.Tensor, initial_value: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, H]``: ``initial_value`` (float32; zeros if None) plus ``data[:, 0]``, ``data[:, 1]``,
    ... in slot order, accumulated in float32 and rounded once to ``data``'s dtype.

    Args:
        data: ``[M, K, H]``.
    """
    acc = torch.zeros(data.shape[0], data.shape[2], dtype=torch.float32, device=data.device) \
        if initial_value is None else initial_value.float().clone()
    for k in range(data.shape[1]):
        acc += data[:, k].float()
    return acc.to(data.dtype)


def _reduce_groups(y: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per token, sums the slots of each group (float32, in slot order, rounded to ``y``'s dtype)
    into the group's last slot and zeroes its other slots."""
    num_topk = y.shape[1]
    out = torch.zeros_like(y)
    for k in range(num_topk):
        same_before = (groups[:, :k] == groups[:, k:k + 1])  # [M, k]
        later = (groups[:, k + 1:] == groups[:, k:k + 1]).any(dim=1)
        if k == 0:
            acc = y[:, 0].float()
        else:
            mask = same_before.unsqueeze(-1)
            # Slot order within the group: add earlier members one by one.
            acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
            for j in range(k):
                acc += torch.where(mask[:, j], y[:, j].float(), torch.zeros((), device=y.device))
            acc += y[:, k].float()
        last = ~later
        out[:, k] = torch.where(last.unsqueeze(-1), acc.to(y.dtype), torch.zeros((), dtype=y.dtype, device=y.device))
    return out


def combine(y: torch.Tensor, topk_idx: torch.Tensor, num_scaleout_ranks: int, num_scaleup_ranks: int,
            num_experts: int, bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
            reduce_in_local: bool, reduce_in_scaleup: bool) -> torch.Tensor:
    """Reference combine of one rank's tokens: ``[N, H]``.

    Args:
        y: ``[N, K, H]`` the expert outputs of each token's top-k slots (zero where the slot is unused).
        topk_idx: ``[N, K]`` global expert ids (``-1`` for none).
        num_scaleout_ranks / num_scaleup_ranks: the logical domains; ranks are
            ``num_scaleout_ranks * num_scaleup_ranks``, experts split evenly over them in order.
        bias: None, one ``[N, H]`` tensor, or two (summed in float32 first).
        reduce_in_local: first sum the slots sharing a rank (into that rank's last slot, rounded
            to ``y``'s dtype) -- what a rank's own per-token reduction does.
        reduce_in_scaleup: then likewise per scale-up domain (needs ``reduce_in_local``).
    Returns:
        ``bias + sum over slots`` in float32, slots in order, rounded once to ``y``'s dtype.
    """
    if reduce_in_scaleup and not reduce_in_local:
        raise ValueError("reduce_in_scaleup needs reduce_in_local")
    per_rank = num_experts // (num_scaleout_ranks * num_scaleup_ranks)
    if reduce_in_local:
        y = _reduce_groups(y, torch.div(topk_idx, per_rank, rounding_mode="floor"))
    if reduce_in_scaleup:
        y = _reduce_groups(y, torch.div(topk_idx, per_rank * num_scaleup_ranks, rounding_mode="floor"))
    if isinstance(bias, tuple):
        initial = bias[0].float() + bias[1].float()
    else:
        initial = bias.float() if bias is not None else None
    return ordered_accumulate(y, initial)
