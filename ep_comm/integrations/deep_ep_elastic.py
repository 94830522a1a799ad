"""DeepEP 2.x's ``ElasticBuffer`` and ``EPHandle`` (its unified expert-parallel dispatch/combine),
served by an ep_comm :class:`~ep_comm.Buffer`.

One routing implementation: every dispatch and combine here is one call of the wrapped Buffer's
normal-mode ``dispatch`` / ``combine`` (plus, when ``topk_weights`` ride along a cached dispatch,
a second cached dispatch of the weights). What 2.x adds on top is local layout maths:

- **Received rows** are ep_comm's: ordered by source rank, then source token. That is the order
  DeepEP's deterministic mode sorts into (ascending source global index), so every dispatch here is
  deterministic; ``deterministic=True`` is accepted and changes nothing.
- **Expand mode** (``do_expand=True``): the received rows laid out once per (token, local expert)
  pair, grouped by local expert, each expert's block starting at a multiple of
  ``expert_alignment``; within a block the pairs follow the received order. The rows are gathered
  from the normal dispatch's received rows (no second exchange). ``recv_topk_idx`` is None and
  ``recv_topk_weights`` is ``[num_expanded_tokens]``, the weight of each pair.
- **Combine** returns every received row to its source and sums it there, unweighted (DeepEP 2.x's
  combine does not apply ``topk_weights`` to ``x``; it reduces the weights alongside). In expand
  mode each received token's pair rows are first summed locally, in top-k order, in float32 and
  rounded to ``x``'s dtype (DeepEP's "multiple reduction"), then combined as above. With
  ``allow_multiple_reduction=False`` they are not: each pair row travels back on its own (one
  ``H``-wide column block per top-k slot, ``K`` times the traffic) and the source sums the bias and
  the token's slots in top-k order in float32, rounding once -- DeepEP's single-reduction result.
  The cross-rank sum is ep_comm's: float32, source ranks in ascending order, bias included, one
  rounding at the end. DeepEP's reference adds a token's rank contributions in the order of each
  rank's last top-k slot instead; with up to two contributing ranks the results are bit-identical,
  with three or more they can differ by float32 reassociation before the final rounding.
- **``do_cpu_sync=False``** (and every cached dispatch): received tensors padded to the worst case,
  ``R * num_max_tokens_per_rank`` rows (expand mode: ``R * num_max_tokens_per_rank *
  min(K, L) + L * (expert_alignment - 1)``), with the real counts in the handle's prefix sums and
  ``num_recv_tokens_per_expert_list`` empty.

``num_sms`` and ``num_qps``: ``num_sms`` becomes the wrapped Buffer's ``Config(num_sms)`` (the
kernel paths' SM count; the portable torch.distributed path has no SMs and ignores it) and is kept
in the handle for the combine, as in DeepEP; ``num_qps`` must not exceed ``num_allocated_qps`` and
otherwise has no effect (ep_comm's transports do not take a QP count per call).

Not offered (the names are absent): Engram (``engram_*``, ``num_cpu_bytes > 0`` is refused),
pipeline-parallel send/recv (``pp_*``) and all-gather/reduce-scatter calls (``agrs_*``,
``all_gather``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..config import Config
from ..event import EventHandle, EventOverlap
from ..handle import DispatchHandle
from .deep_ep_utils.envs import get_logical_domain_size, get_physical_domain_size

__all__ = ["BUFFER_ALIGNMENT", "EPHandle", "ElasticBuffer"]

BUFFER_ALIGNMENT = 2 << 20
"""DeepEP 2.x's buffer-size granularity (2 MiB); sizes from :meth:`ElasticBuffer.get_buffer_size_hint`
are multiples of it."""

_TMA_ROW_ALIGNMENT = 4  # float32 scales: 16-byte TMA alignment of each column


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


class EPHandle:
    """What a 2.x dispatch hands to its combine or to a cached dispatch (DeepEP's attributes).

    Attributes:
        do_expand: whether the dispatch used the expanded layout.
        num_experts / expert_alignment / num_max_tokens_per_rank / num_sms: the dispatch's values.
        topk_idx: ``[N, K]`` the dispatch's ``topk_idx`` (a copy when ``do_handle_copy``).
        num_recv_tokens: ``M``, tokens received (deduplicated per rank).
        num_expanded_tokens: expand mode: rows of the expanded tensors without trailing padding
            (``align(psum_num_recv_tokens_per_expert[-1])`` summed block sizes); else ``M``.
        num_recv_tokens_per_expert_list: per local expert received counts, each rounded up to
            ``expert_alignment`` (empty without CPU sync).
        psum_num_recv_tokens_per_scaleup_rank: ``[num_scaleup_ranks]`` int32, inclusive prefix sum
            of the tokens received from each scale-up rank (summed over scale-out ranks); the last
            entry is ``M``.
        psum_num_recv_tokens_per_expert: ``[L]`` int32. Non-expand: inclusive prefix sum of the
            aligned counts. Expand: ``psum[i]`` = start of expert ``i``'s block + its real count.
        num_unaligned_recv_tokens_per_expert: ``[L]`` int32 real counts (expand mode only, else None).
        recv_src_metadata: ``[rows, 2 + K]`` int32 per received row: the source global token index
            ``src_rank * num_max_tokens_per_rank + src_token``, the source rank (ep_comm has no
            buffer slots; DeepEP keeps its slot here), and per top-k entry the row of that
            (token, expert) pair in the expanded tensors, ``-1`` where the expert is elsewhere or
            the dispatch was not expanded.
        dst_buffer_slot_idx: ``[N, K]`` int32, for each of this rank's tokens and top-k entries the
            row the token occupies in the destination rank's received tensors (``-1`` for none).
        token_metadata_at_forward / channel_linked_list: DeepEP's hybrid-mode entries; None here
            (ep_comm's flat exchange forwards nothing).
        buffer_handle: the wrapped ep_comm Buffer's :class:`~ep_comm.DispatchHandle`.
        recv_topk_idx: ``[rows, K]`` int64 local expert ids of the received rows (``-1`` elsewhere).
    """

    def __init__(self, *, do_expand: bool, num_experts: int, expert_alignment: int,
                 num_max_tokens_per_rank: int, num_sms: int, topk_idx: torch.Tensor,
                 num_recv_tokens: int, num_expanded_tokens: int, num_recv_tokens_per_expert_list: list,
                 psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                 psum_num_recv_tokens_per_expert: torch.Tensor,
                 num_unaligned_recv_tokens_per_expert: torch.Tensor | None,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor,
                 buffer_handle: DispatchHandle, recv_topk_idx: torch.Tensor,
                 num_expanded_rows: int) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        self.buffer_handle = buffer_handle
        self.recv_topk_idx = recv_topk_idx
        self.num_expanded_rows = num_expanded_rows

    @property
    def expanded_slots(self) -> torch.Tensor:
        """``[M, K]`` int64: each received row's (token, expert) pair row in the expanded tensors, or -1."""
        return self.recv_src_metadata[:self.num_recv_tokens, 2:].long()


class ElasticBuffer:
    """DeepEP 2.x's ``ElasticBuffer`` (expert-parallel part) over an ep_comm Buffer.

    Attributes:
        group / rank_idx / num_ranks: the communication group, this rank, its size.
        buffer: the wrapped :class:`ep_comm.Buffer`.
        num_bytes: the buffer size (given, or from the MoE settings).
        num_max_tokens_per_rank: the default ``num_max_tokens_per_rank`` of :meth:`dispatch`.
        num_scaleout_ranks / num_scaleup_ranks / scaleout_rank_idx / scaleup_rank_idx: the logical
            domains (``deep_ep.get_logical_domain_size``).
        num_rdma_ranks / num_nvlink_ranks: the physical domains.
        num_allocated_qps: the QP budget ``num_qps`` is checked against.
    """

    def __init__(self, group: dist.ProcessGroup, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3, num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False) -> None:
        """Makes the buffer (collective over ``group``).

        Args:
            group: the communication group.
            num_bytes: buffer size; when None it comes from :meth:`get_buffer_size_hint` with the
                MoE settings (``num_max_tokens_per_rank``, ``hidden``, ``num_topk``,
                ``use_fp8_dispatch``).
            num_cpu_bytes: Engram's CPU storage: not offered, must be 0.
            deterministic: accepted; every dispatch here is deterministic (see the module docstring).
            allow_hybrid_mode: picks the logical domains as DeepEP does.
            allow_multiple_reduction: whether an expand-mode combine may sum each token's local
                pair rows (rounding to ``x``'s dtype) before sending them (see the module docstring).
            prefer_overlap_with_compute / sl_idx / num_gpu_timeout_secs: accepted and kept; ep_comm
                has no RDMA service levels or GPU-side timeouts.
            num_allocated_qps: the QP budget (0: 17, or 129 with hybrid mode, as DeepEP's default).
            num_cpu_timeout_secs: the wrapped Buffer's ``timeout_s``.
            explicitly_destroy: :meth:`destroy` must then be called (and may only be called then).
        """
        if num_cpu_bytes:
            raise ValueError("num_cpu_bytes: Engram's CPU storage is not offered by ep_comm; pass 0")
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                            ("num_topk", num_topk), ("num_allocated_qps", num_allocated_qps)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if num_cpu_timeout_secs <= 0:
            raise ValueError(f"num_cpu_timeout_secs must be positive, got {num_cpu_timeout_secs}")
        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = group.size()
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.sl_idx = sl_idx
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self.explicitly_destroy = explicitly_destroy
        if num_bytes is None:
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk,
                                                  use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction)
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be non-negative, got {num_bytes}")
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_allocated_qps = num_allocated_qps or (129 if allow_hybrid_mode else 17)
        self.buffer = Buffer(group, num_nvl_bytes=num_bytes, explicitly_destroy=explicitly_destroy,
                             timeout_s=float(num_cpu_timeout_secs))
        self.num_scaleout_ranks, self.num_scaleup_ranks = get_logical_domain_size(group, allow_hybrid_mode)
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = get_physical_domain_size(group)
        self._destroyed = False

    # -- sizes, domains, streams ----------------------------------------------------------------
    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes for the worst-case receive of one dispatch, 2 MiB aligned: ``R *
        num_max_tokens_per_rank`` rows of the token (bf16, or e4m3 plus a float32 scale per 128
        channels), its top-k ids (int64) and weights (float32) and the row's metadata."""
        if num_max_tokens_per_rank < 0 or hidden < 0 or num_topk < 0:
            raise ValueError("num_max_tokens_per_rank, hidden and num_topk must be non-negative")
        token_bytes = hidden + 4 * ((hidden + 127) // 128) if use_fp8_dispatch else 2 * hidden
        row_bytes = token_bytes + num_topk * (8 + 4) + 4 * (2 + num_topk)
        return max(BUFFER_ALIGNMENT, _align(group.size() * num_max_tokens_per_rank * row_bytes, BUFFER_ALIGNMENT))

    def get_physical_domain_size(self) -> tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, *args: object, **kwargs: object) -> int:
        """The SM count a call uses when given ``num_sms=0``: the wrapped Buffer's configured
        count (ep_comm has no bandwidth model; the arguments are accepted for DeepEP parity)."""
        return int(self.buffer.num_sms)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """The QP count a call uses when given ``num_qps=0``: one per SM plus one, capped by
        ``num_allocated_qps`` (informational: ep_comm's transports take no QP count)."""
        return min(num_sms + 1, self.num_allocated_qps)

    @staticmethod
    def capture() -> EventHandle:
        """An event on the current stream (already complete on the CPU)."""
        return EventHandle()

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The stream the calls run on (the wrapped Buffer's; None on the CPU)."""
        return self.buffer.get_comm_stream()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier over the group (synchronising the device first and after when ``with_cpu_sync``)."""
        self._check_alive()
        cuda = self.buffer.device.type == "cuda"
        if with_cpu_sync and cuda:
            torch.cuda.synchronize(self.buffer.device)
        dist.barrier(group=self.group)
        if with_cpu_sync and cuda:
            torch.cuda.synchronize(self.buffer.device)

    def destroy(self) -> None:
        """Releases the buffer; only for ``explicitly_destroy=True`` buffers. Later calls raise."""
        if not self.explicitly_destroy:
            raise ValueError("destroy() needs ElasticBuffer(..., explicitly_destroy=True)")
        if not self._destroyed:
            self.buffer.destroy()
            self._destroyed = True

    def _check_alive(self) -> None:
        if self._destroyed:
            raise ValueError("this ElasticBuffer was destroyed")

    # -- argument handling ---------------------------------------------------------------------
    def _sms_and_qps(self, num_sms: int, num_qps: int, default_sms: int) -> int:
        if not isinstance(num_sms, int) or num_sms < 0 or num_sms % 2:
            raise ValueError(f"num_sms must be 0 (automatic) or a positive even int, got {num_sms!r}")
        if not isinstance(num_qps, int) or num_qps < 0:
            raise ValueError(f"num_qps must be a non-negative int, got {num_qps!r}")
        num_sms = num_sms or default_sms
        if (num_qps or self.get_theoretical_num_qps(num_sms)) > self.num_allocated_qps:
            raise ValueError(f"num_qps={num_qps} exceeds num_allocated_qps={self.num_allocated_qps}")
        return num_sms

    @staticmethod
    def _wait_events(previous_event: EventHandle | None, allocate_on_comm_stream: bool, name: str) -> None:
        if previous_event is None:
            return
        if not allocate_on_comm_stream:
            raise ValueError(f"{name} needs allocate_on_comm_stream=True (DeepEP's rule)")
        if not isinstance(previous_event, EventHandle):
            raise ValueError(f"{name} must be an EventHandle (ElasticBuffer.capture()), "
                             f"got {type(previous_event).__name__}")
        previous_event.current_stream_wait()

    def _finish(self, async_with_compute_stream: bool) -> EventOverlap:
        return EventOverlap(EventHandle(self.buffer.device)) if async_with_compute_stream else EventOverlap(None)

    # -- dispatch -------------------------------------------------------------------------------
    def dispatch(self, x, topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None, num_experts: int | None = None,
                 num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event: EventHandle | None = None,
                 previous_event_before_epilogue: EventHandle | None = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: EPHandle | None = None, do_handle_copy: bool = True, do_cpu_sync: bool | None = None,
                 do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False):
        """Sends every token once to each rank holding one of its experts (DeepEP 2.x's dispatch).

        Args:
            x: ``[N, H]`` bf16, or ``(float8_e4m3fn [N, H], float32 scales [N, H // 128])``.
            topk_idx: ``[N, K]`` int64 expert ids, ``-1`` for none; None with ``handle``.
            topk_weights: ``[N, K]`` float32 (optional; with ``handle`` too).
            cumulative_local_expert_recv_stats: ``[L]`` int32, incremented by each local expert's
                received (unaligned) token count.
            num_experts / num_max_tokens_per_rank / expert_alignment: taken from ``handle`` when
                given (and must then match it); ``num_max_tokens_per_rank`` defaults to the
                constructor's and must be at least ``N``.
            num_sms / num_qps: see the module docstring.
            previous_event / previous_event_before_epilogue: ``EventHandle`` s waited for before the
                exchange / before the expand gather (``previous_event`` needs
                ``allocate_on_comm_stream``).
            async_with_compute_stream: return an event to wait on instead of a finished call.
            handle: an ``EPHandle`` from an earlier dispatch: re-send ``x`` along its layout.
            do_handle_copy: the handle keeps a copy of ``topk_idx`` (else ``topk_idx`` itself).
            do_cpu_sync: exact-size outputs (default True; must not be True with ``handle``).
            do_expand: the expanded layout; must equal ``handle.do_expand`` with a handle.
            do_zero_padding: zero the alignment padding of the expanded tensors (expand mode only;
                otherwise its content is unspecified).
            use_tma_aligned_col_major_sf: FP8 scales stored column-major with the row count padded
                to a multiple of 4 (same values, a transposed view).
        Returns:
            ``(recv_x, recv_topk_idx [rows, K]`` int64 local ids or None in expand mode,
            ``recv_topk_weights [rows, K]`` (``[rows]`` in expand mode) float32 or None,
            ``handle, event)``.
        """
        self._check_alive()
        self._wait_events(previous_event, allocate_on_comm_stream, "previous_event")
        if do_zero_padding and not do_expand:
            raise ValueError("do_zero_padding is only valid with do_expand=True")
        cached = handle is not None
        if cached:
            if not isinstance(handle, EPHandle):
                raise ValueError(f"handle must be an EPHandle, got {type(handle).__name__}")
            if topk_idx is not None:
                raise ValueError("topk_idx must be None with handle (the handle's is used)")
            if do_cpu_sync:
                raise ValueError("do_cpu_sync=True is not possible with a cached handle")
            if do_expand != handle.do_expand:
                raise ValueError(f"do_expand={do_expand} but the handle was made with do_expand={handle.do_expand}")
            given = (num_experts, expert_alignment, num_max_tokens_per_rank)
            expected = (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            for name, value, want in zip(("num_experts", "expert_alignment", "num_max_tokens_per_rank"),
                                         given, expected):
                if value is not None and value != want:
                    raise ValueError(f"{name}={value} does not match the handle's {want}")
            num_experts, expert_alignment, num_max_tokens_per_rank = expected
            do_cpu_sync = False
            topk_idx = handle.topk_idx
        else:
            if topk_idx is None or num_experts is None:
                raise ValueError("topk_idx and num_experts are required without a handle")
            expert_alignment = 1 if expert_alignment is None else expert_alignment
            num_max_tokens_per_rank = (self.num_max_tokens_per_rank if num_max_tokens_per_rank is None
                                       else num_max_tokens_per_rank)
            do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        if not isinstance(expert_alignment, int) or expert_alignment <= 0:
            raise ValueError(f"expert_alignment must be a positive int, got {expert_alignment!r}")
        num_tokens = (x[0] if isinstance(x, tuple) else x).shape[0]
        if not isinstance(num_max_tokens_per_rank, int) or num_max_tokens_per_rank < max(num_tokens, 1):
            raise ValueError(f"num_max_tokens_per_rank ({num_max_tokens_per_rank}) must be at least the "
                             f"{num_tokens} tokens of x (and positive); set it here or in the constructor")
        num_sms = self._sms_and_qps(num_sms, num_qps, handle.num_sms if cached else self.buffer.num_sms)
        num_local_experts = num_experts // self.num_ranks
        if cumulative_local_expert_recv_stats is not None:
            t = cumulative_local_expert_recv_stats
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (num_local_experts,):
                raise ValueError(f"cumulative_local_expert_recv_stats must be a [{num_local_experts}] int32 tensor")
        num_worst = 0 if do_cpu_sync else self.num_ranks * num_max_tokens_per_rank

        if cached:
            recv_x = self.buffer.dispatch(x, handle=handle.buffer_handle)[0]
            recv_w = None
            if topk_weights is not None:
                recv_w = self.buffer.dispatch(topk_weights.float().contiguous(), handle=handle.buffer_handle)[0]
                recv_w = recv_w.masked_fill(handle.recv_topk_idx < 0, 0)
            recv_topk = handle.recv_topk_idx
            out_handle = handle
        else:
            per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, num_experts)
            recv_x, recv_topk, recv_w, counts_list, inner, _ = self.buffer.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=expert_alignment,
                num_worst_tokens=num_worst, config=Config(num_sms=num_sms))
            out_handle = self._make_handle(inner, topk_idx, recv_topk, counts_list, num_experts, expert_alignment,
                                           num_max_tokens_per_rank, num_sms, do_expand, do_handle_copy)
        if cumulative_local_expert_recv_stats is not None:
            real = recv_topk[:out_handle.num_recv_tokens]
            counts = _local_counts(real, num_local_experts)
            cumulative_local_expert_recv_stats += counts.to(torch.int32).to(cumulative_local_expert_recv_stats.device)

        if previous_event_before_epilogue is not None:
            self._wait_events(previous_event_before_epilogue, True, "previous_event_before_epilogue")
        if do_expand:
            recv_x = self._expand(recv_x, out_handle, do_zero_padding)
            if recv_w is not None:
                recv_w = self._expand(recv_w, out_handle, do_zero_padding, per_slot=True)
            recv_topk = None
        if use_tma_aligned_col_major_sf and isinstance(recv_x, tuple):
            recv_x = (recv_x[0], _tma_col_major(recv_x[1]))
        return recv_x, recv_topk, recv_w, out_handle, self._finish(async_with_compute_stream)

    def _make_handle(self, inner: DispatchHandle, topk_idx: torch.Tensor, recv_topk: torch.Tensor,
                     counts_list: list[int], num_experts: int, alignment: int, num_max: int, num_sms: int,
                     do_expand: bool, do_handle_copy: bool) -> EPHandle:
        state = inner.state
        device = recv_topk.device
        num_recv, rows = state.num_recv_tokens, recv_topk.shape[0]
        num_topk = recv_topk.shape[1]
        num_local = num_experts // self.num_ranks
        recv_counts = state.recv_counts.to(torch.int64)

        per_rank = recv_counts.view(self.num_scaleout_ranks, self.num_scaleup_ranks).sum(0)
        psum_scaleup = per_rank.cumsum(0).to(torch.int32).to(device)

        real = recv_topk[:num_recv]
        unaligned = _local_counts(real, num_local)
        aligned = (unaligned + alignment - 1) // alignment * alignment
        starts = aligned.cumsum(0) - aligned

        src_rank = torch.repeat_interleave(torch.arange(self.num_ranks, dtype=torch.int64), recv_counts.cpu())
        metadata = torch.full((rows, 2 + num_topk), -1, dtype=torch.int32)
        metadata[:num_recv, 0] = (src_rank * num_max + state.recv_src_token_index.cpu()).to(torch.int32)
        metadata[:num_recv, 1] = src_rank.to(torch.int32)
        if do_expand:
            valid = real >= 0
            experts = real[valid]
            order = torch.sort(experts, stable=True).indices
            rank_in_expert = torch.empty_like(order)
            rank_in_expert[order] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
            first = unaligned.cumsum(0) - unaligned
            slots = torch.full_like(real, -1)
            slots[valid] = starts.to(device)[experts] + rank_in_expert - first.to(device)[experts]
            metadata[:num_recv, 2:] = slots.to(torch.int32).cpu()
            psum_expert = (starts + unaligned).to(torch.int32)
            num_expanded = int(aligned.sum())
            num_rows_expanded = num_expanded if state.num_worst_tokens == 0 else \
                rows * min(num_topk, num_local) + num_local * (alignment - 1)
        else:
            psum_expert = aligned.cumsum(0).to(torch.int32)
            num_expanded, num_rows_expanded = num_recv, rows

        matrix = inner[0].to(torch.int64).cpu()
        offsets = matrix[self.rank_idx - 1] if self.rank_idx > 0 else torch.zeros(self.num_ranks, dtype=torch.int64)
        in_rank = state.is_token_in_rank.cpu()
        position = in_rank.to(torch.int64).cumsum(0) - 1 + offsets
        placement = self.buffer.placement(num_experts)
        topk_cpu = topk_idx.cpu()
        dst_rank = placement.expert_to_rank.cpu()[topk_cpu.clamp(min=0)]
        dst_slot = position.gather(1, dst_rank.long()).masked_fill(topk_cpu < 0, -1).to(torch.int32)

        return EPHandle(do_expand=do_expand, num_experts=num_experts, expert_alignment=alignment,
                        num_max_tokens_per_rank=num_max, num_sms=num_sms,
                        topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
                        num_recv_tokens=num_recv, num_expanded_tokens=num_expanded,
                        num_recv_tokens_per_expert_list=list(counts_list),
                        psum_num_recv_tokens_per_scaleup_rank=psum_scaleup,
                        psum_num_recv_tokens_per_expert=psum_expert.to(device),
                        num_unaligned_recv_tokens_per_expert=(unaligned.to(torch.int32).to(device)
                                                              if do_expand else None),
                        recv_src_metadata=metadata.to(device), dst_buffer_slot_idx=dst_slot.to(device),
                        buffer_handle=inner, recv_topk_idx=recv_topk, num_expanded_rows=num_rows_expanded)

    @staticmethod
    def _expand(t, handle: EPHandle, zero_padding: bool, per_slot: bool = False):
        """Received rows -> rows per (token, local expert) pair (``per_slot``: ``[M, K]`` values
        -> ``[T]``, one per pair)."""
        if isinstance(t, tuple):
            return tuple(ElasticBuffer._expand(part, handle, zero_padding) for part in t)
        slots = handle.expanded_slots.to(t.device)
        valid = slots >= 0
        rows = torch.arange(slots.shape[0], device=t.device).unsqueeze(1).expand_as(slots)[valid]
        make = torch.zeros if zero_padding else torch.empty
        if per_slot:
            out = make(handle.num_expanded_rows, dtype=t.dtype, device=t.device)
            out[slots[valid]] = t[:slots.shape[0]][valid]
        else:
            out = make(handle.num_expanded_rows, *t.shape[1:], dtype=t.dtype, device=t.device)
            out[slots[valid]] = t[rows]
        return out

    # -- combine --------------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None, num_sms: int = 0,
                num_qps: int = 0, previous_event: EventHandle | None = None,
                previous_event_before_epilogue: EventHandle | None = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Returns every received row to its source and sums it per token (DeepEP 2.x's combine).

        Args:
            x: ``[rows, H]`` in the dispatch's received order, or ``[expanded rows, H]`` for an
                expand-mode handle (padding rows ignored).
            handle: the dispatch's ``EPHandle``.
            topk_weights: ``[rows, K]`` float32, or ``[expanded rows]`` in expand mode: reduced to
                ``[N, K]`` alongside (not applied to ``x``).
            bias: up to two ``[N, H]`` tensors added to the result.
            num_sms / num_qps: 0 reuses the dispatch's; see the module docstring.
        Returns:
            ``(combined_x [N, H]``, ``combined_topk_weights [N, K]`` float32 or None, ``event)``.
        """
        self._check_alive()
        if not isinstance(handle, EPHandle):
            raise ValueError(f"handle must be an EPHandle, got {type(handle).__name__}")
        self._wait_events(previous_event, allocate_on_comm_stream, "previous_event")
        self._sms_and_qps(num_sms, num_qps, handle.num_sms)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError("x must be a 2-D tensor")
        if bias is not None and not isinstance(bias, (torch.Tensor, tuple)):
            raise ValueError("bias must be a tensor or a tuple of two tensors")
        inner = handle.buffer_handle
        if handle.do_expand:
            if x.shape[0] != handle.num_expanded_rows:
                raise ValueError(f"x has {x.shape[0]} rows but the expanded dispatch made {handle.num_expanded_rows}")
            if topk_weights is not None and (topk_weights.dim() != 1 or topk_weights.shape[0] != x.shape[0]):
                raise ValueError(f"topk_weights must be [{x.shape[0]}] in expand mode")
            if previous_event_before_epilogue is not None:
                self._wait_events(previous_event_before_epilogue, True, "previous_event_before_epilogue")
            slots = handle.expanded_slots.to(x.device)
            valid = slots >= 0
            safe = slots.clamp(min=0)
            if self.allow_multiple_reduction:
                acc = torch.zeros(slots.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
                for k in range(slots.shape[1]):
                    acc += x[safe[:, k]].float() * valid[:, k:k + 1]
                x = acc.to(x.dtype)
            else:
                # One row per top-k slot: [M, K * H], zero where the slot's expert is elsewhere.
                per_slot_hidden = x.shape[1]
                x = torch.where(valid.unsqueeze(-1), x[safe], x.new_zeros(())).reshape(slots.shape[0], -1)
            if topk_weights is not None:
                topk_weights = topk_weights[safe].float().masked_fill(~valid, 0)
            rows = inner.state.num_recv_rows
            if rows > x.shape[0]:
                x = torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])
                if topk_weights is not None:
                    topk_weights = torch.cat([topk_weights, topk_weights.new_zeros(rows - topk_weights.shape[0],
                                                                                   topk_weights.shape[1])])
        elif topk_weights is not None and topk_weights.dim() != 2:
            raise ValueError("topk_weights must be [rows, K] for a non-expanded handle")
        if handle.do_expand and not self.allow_multiple_reduction:
            # Each (token, slot) value comes from exactly one rank, so the cross-rank sum moves it
            # unchanged; the slots are then summed here, with the bias, in one float32 pass.
            biases = bias if isinstance(bias, tuple) else (bias,) if bias is not None else ()
            want = (handle.topk_idx.shape[0], per_slot_hidden)
            if len(biases) > 2 or any(tuple(b.shape) != want for b in biases):
                raise ValueError(f"bias must be one or two [{want[0]}, {want[1]}] tensors")
            combined, combined_w, _ = self.buffer.combine(x, inner, topk_weights)
            combined = combined.view(combined.shape[0], -1, per_slot_hidden)
            acc = torch.zeros(combined.shape[0], per_slot_hidden, dtype=torch.float32, device=combined.device)
            for b in biases:
                acc += b.float()
            for k in range(combined.shape[1]):
                acc += combined[:, k].float()
            combined = acc.to(combined.dtype)
        else:
            combined, combined_w, _ = self.buffer.combine(x, inner, topk_weights, bias=bias)
        if previous_event_before_epilogue is not None and not handle.do_expand:
            self._wait_events(previous_event_before_epilogue, True, "previous_event_before_epilogue")
        return combined, combined_w, self._finish(async_with_compute_stream)


def _local_counts(recv_topk: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """``[L]`` int64: the received (token, local expert) pairs of each local expert."""
    return torch.bincount(recv_topk[recv_topk >= 0].flatten(), minlength=num_local_experts)[:num_local_experts]


def _tma_col_major(sf: torch.Tensor) -> torch.Tensor:
    """``sf [M, S]`` as a column-major view whose column stride is ``M`` rounded up to 4."""
    rows, cols = sf.shape
    storage = torch.zeros(cols, _align(max(rows, 1), _TMA_ROW_ALIGNMENT), dtype=sf.dtype, device=sf.device)
    storage[:, :rows] = sf.t()
    return storage[:, :rows].t()
