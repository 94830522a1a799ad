"""Argument checks shared by the public calls: each failure is a ValueError naming the argument."""
from __future__ import annotations

import math

import torch

PAYLOAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FP8_INPUT_SCALE_DTYPES = (torch.float32, torch.int32)


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
                   num_tokens: int | None = None, name: str = "topk_idx", *, check_values: bool = True) -> torch.Tensor:
    """``[N, K]`` int64 with every entry in ``[-1, num_experts)`` (the entries are read only
    with ``check_values``; :class:`DeviceStatus` checks them on the device instead)."""
    t = require_tensor(name, topk_idx, dtypes=(torch.int64,), dim=2, device=device)
    if num_tokens is not None and t.shape[0] != num_tokens:
        raise ValueError(f"{name} has {t.shape[0]} rows but x has {num_tokens} tokens")
    if t.shape[1] == 0:
        raise ValueError(f"{name} must have at least one column (top-k >= 1)")
    if check_values and t.numel() > 0:
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


def check_dispatch_input(x: object, device: torch.device | None) -> tuple[int, int]:
    """Validates a dispatch's ``x`` (a tensor, or DeepEP's FP8 tuple ``(e4m3 [N, H], scales
    [N, H // 128]`` float32 or ``[N, H // 512]`` int32 UE8M0)); returns ``(N, H)``."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError("x as a tuple must be (fp8 values [N, H], scales [N, H // 128])")
        q = require_tensor("x[0]", x[0], dtypes=(torch.float8_e4m3fn,), dim=2, device=device)
        s = require_tensor("x[1]", x[1], dtypes=FP8_INPUT_SCALE_DTYPES, dim=2, device=device)
        if s.shape[0] != q.shape[0]:
            raise ValueError(f"x[1] (scales) has {s.shape[0]} rows but x[0] has {q.shape[0]}")
        hidden = q.shape[1]
        groups = hidden // 512 if s.dtype == torch.int32 else hidden // 128
        if hidden % 128 or s.shape[1] != groups:
            raise ValueError(f"x[1] (scales) must be [N, H // 128] float32 or [N, H // 512] int32 for "
                             f"H = {hidden} (a multiple of 128); got {tuple(s.shape)} {s.dtype}")
        return int(q.shape[0]), int(q.shape[1])
    t = require_tensor("x", x, dtypes=PAYLOAD_DTYPES, dim=2, device=device)
    return int(t.shape[0]), int(t.shape[1])


def check_flag(name: str, flag: object) -> bool:
    """``flag`` as a bool, or ValueError naming it unless it is a bool, a NumPy bool or an int 0/1
    (what DeepEP's boolean arguments take)."""
    numpy_bool = type(flag).__module__ == "numpy" and type(flag).__name__ in ("bool", "bool_")
    if not (numpy_bool or (isinstance(flag, int) and flag in (0, 1))):
        raise ValueError(f"{name} must be a bool, got {flag!r}")
    return bool(flag)


def check_low_latency_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: object, use_fp8: bool,
                               round_scale: bool, use_ue8m0: bool, *, check_values: bool = True) -> None:
    """The low-latency dispatch's limits: ``N <= num_max_dispatch_tokens_per_rank``, the FP8 and
    UE8M0 hidden-size multiples, and (with ``check_values``; else :class:`DeviceStatus` on the
    device) no token selecting one expert twice (each (token, expert) pair has one slot)."""
    for name, flag in (("use_fp8", use_fp8), ("round_scale", round_scale), ("use_ue8m0", use_ue8m0)):
        check_flag(name, flag)
    check_nonneg_int("num_max_dispatch_tokens_per_rank", max_tokens, positive=True)
    if x.shape[0] > max_tokens:  # type: ignore[operator]
        raise ValueError(f"x has {x.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank "
                         f"({max_tokens}): low-latency capacity overflow")
    if use_fp8 and x.shape[1] % 128 != 0:
        raise ValueError(f"use_fp8 needs a hidden size divisible by 128, got {x.shape[1]}")
    if use_ue8m0 and not (use_fp8 and round_scale):
        raise ValueError("use_ue8m0=True needs use_fp8=True and round_scale=True")
    if use_ue8m0 and x.shape[1] % 512 != 0:
        raise ValueError(f"use_ue8m0 packs four scales per int32: hidden must be a multiple of 512, got {x.shape[1]}")
    if check_values and topk_idx.shape[1] > 1 and topk_idx.numel() > 0:
        ordered = topk_idx.sort(dim=1).values
        if bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()):
            raise ValueError("topk_idx selects the same expert twice for one token; low-latency mode "
                             "gives each (token, expert) one slot")


def check_buffer_arguments(group: object, num_nvl_bytes: object, num_rdma_bytes: object, num_qps_per_rank: object,
                           backend: object, timeout_s: object, ranks_per_node: object, **flags: object) -> None:
    """The ``Buffer`` constructor's arguments: the group, byte sizes, backend, timeout, node size,
    and DeepEP's boolean ``flags`` (each by name)."""
    import torch.distributed as dist

    if group is None or not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    for name, flag in flags.items():
        check_flag(name, flag)
    check_nonneg_int("num_nvl_bytes", num_nvl_bytes)
    check_nonneg_int("num_rdma_bytes", num_rdma_bytes)
    check_nonneg_int("num_qps_per_rank", num_qps_per_rank, positive=True)
    if backend not in ("auto", "torch", "nvshmem"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'nvshmem', got {backend!r}")
    if (not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not math.isfinite(timeout_s)
            or timeout_s <= 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if ranks_per_node is not None:
        check_nonneg_int("ranks_per_node", ranks_per_node, positive=True)
        if dist.get_world_size(group) % ranks_per_node:  # type: ignore[operator]
            raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide the group size "
                             f"({dist.get_world_size(group)})")


def check_rank_list(name: str, ranks: object, num_ranks: int, rank: int) -> frozenset[int]:
    """``ranks`` (an iterable of ranks in ``[0, num_ranks)``, without ``rank`` itself) as a set."""
    if isinstance(ranks, int) or not hasattr(ranks, "__iter__"):
        raise ValueError(f"{name} must be a list of ranks, got {ranks!r}")
    out = set()
    for r in ranks:  # type: ignore[union-attr]
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < num_ranks:
            raise ValueError(f"{name} must hold ranks in [0, {num_ranks}), got {r!r}")
        out.add(r)
    if rank in out:
        raise ValueError(f"{name} includes this rank ({rank}): a rank cannot mask itself")
    return frozenset(out)


def _out_of_range_or_repeated(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` bool masks of the entries outside ``[-1, num_experts)`` and of the valid entries
    that repeat an expert an earlier column of the same token selected (device ops only)."""
    out_of_range = (topk_idx < -1) | (topk_idx >= num_experts)
    k = topk_idx.shape[1]
    earlier = torch.ones(k, k, dtype=torch.bool, device=topk_idx.device).tril(-1)  # [k, j]: j < k
    same = topk_idx.unsqueeze(2) == topk_idx.unsqueeze(1)  # [N, k, j]
    repeated = (same & earlier).any(2) & (topk_idx >= 0) & ~out_of_range
    return out_of_range, repeated


class DeviceStatus:
    """The data checks of the low-latency calls when they run on the kernel path: done by device
    ops without a host round trip (so the calls can be captured in a CUDA graph), reported later.

    Each check adds its failure count to a device word ``[C]`` int32 (``C`` checks); every call
    then copies the word asynchronously into a host mirror (pinned memory on a GPU). The next
    low-latency call of the Buffer, or :meth:`report` (``Buffer.check_low_latency_status``, which
    first waits for the stream), raises a ``ValueError`` naming the call and the argument for
    each count that grew since the last report. The offending entries never reach the kernels:
    a bad ``topk_idx`` entry is treated as ``-1`` (the token skips that expert); a combine whose
    ``topk_idx`` differs from its dispatch's combines along the dispatch's routing.
    """

    CHECKS = (
        ("low_latency_dispatch", "topk_idx", "entries must lie in [-1, {num_experts})"),
        ("low_latency_dispatch", "topk_idx", "selects the same expert twice for one token; low-latency mode "
                                             "gives each (token, expert) one slot"),
        ("low_latency_combine", "topk_idx", "differs from the routing the handle dispatched"),
    )
    RANGE, REPEAT, MISMATCH = 0, 1, 2

    def __init__(self) -> None:
        self._word: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._reported = [0] * len(self.CHECKS)
        self._details: dict[int, dict[str, object]] = {}

    def _words(self, device: torch.device) -> torch.Tensor:
        if self._word is None or self._word.device != device:
            self._word = torch.zeros(len(self.CHECKS), dtype=torch.int32, device=device)
            self._host = torch.zeros(len(self.CHECKS), dtype=torch.int32,
                                     pin_memory=device.type == "cuda")
            self._reported = [0] * len(self.CHECKS)
        return self._word

    def _flag(self, check: int, bad: torch.Tensor, **details: object) -> None:
        self._words(bad.device)[check:check + 1].add_(bad.reshape(1).to(torch.int32))
        self._details[check] = details

    def dispatch_routing(self, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        """Flags the dispatch's bad ``topk_idx`` entries; returns ``topk_idx`` with them ``-1``."""
        out_of_range, repeated = _out_of_range_or_repeated(topk_idx, num_experts)
        self._flag(self.RANGE, out_of_range.any(), num_experts=num_experts)
        self._flag(self.REPEAT, repeated.any())
        return topk_idx.masked_fill(out_of_range | repeated, -1)

    def combine_routing(self, topk_idx: torch.Tensor, dispatched: torch.Tensor, num_experts: int) -> None:
        """Flags a combine ``topk_idx`` that differs from ``dispatched`` (the dispatch's routing
        as :meth:`dispatch_routing` left it)."""
        out_of_range, repeated = _out_of_range_or_repeated(topk_idx, num_experts)
        self._flag(self.MISMATCH, (topk_idx.masked_fill(out_of_range | repeated, -1) != dispatched).any())

    def publish(self) -> None:
        """Queues the copy of the counts to the host mirror (asynchronous, capturable)."""
        if self._word is not None:
            self._host.copy_(self._word, non_blocking=True)  # type: ignore[union-attr]

    def report(self) -> None:
        """Raises a ValueError for each check whose count grew since the last report, as far as
        the host mirror shows it (no wait)."""
        if self._host is None:
            return
        counts = self._host.tolist()
        grown = [i for i, (now, seen) in enumerate(zip(counts, self._reported)) if now > seen]
        self._reported = [max(a, b) for a, b in zip(counts, self._reported)]
        if grown:
            lines = []
            for i in grown:
                call, name, what = self.CHECKS[i]
                lines.append(f"{name} of an earlier {call} (checked on the device, {counts[i]} call(s) so far) "
                             + what.format(**self._details.get(i, {})))
            raise ValueError("; ".join(lines))
