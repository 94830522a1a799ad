"""Buffer: the public facade with DeepEP's V1 calls (layout, dispatch, combine, low-latency)."""
from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from . import handle_entries, low_latency, normal
from .agreement import BackwardCall, BackwardVote, CallHeader, agree, collective, handle_digests, placement_digest
from .codecs import nvfp4
from .codecs.auto import AutoCodecPolicy, agree_on_codec, check_codec_input
from .config import Config, default_combine_config, default_dispatch_config
from .errors import CommTimeoutError
from .event import EventHandle, EventOverlap, finish_event, wait_previous
from .handle import (
    DispatchHandle,
    DispatchState,
    InternodeDispatchHandle,
    IntranodeDispatchHandle,
    LowLatencyHandle,
    LowLatencyState,
)
from .layout import NUM_MAX_NVL_PEERS, align_up, compute_dispatch_layout
from .masking import RankMasking
from .paths import (
    CachedDispatchCall,
    CombineCall,
    DispatchCall,
    FlatPath,
    FusedKernelPath,
    LowLatencyCombineCall,
    LowLatencyDispatchCall,
    NodeAwarePath,
    PathPlan,
    TwoHopKernelPath,
)
from .placement import ExpertPlacement
from .rows import ScratchPool
from .stats import CommStats
from .transports.base import Transport
from .transports.job_store import arrive, resolve_store
from .transports.select import make_transport, pick_device
from .validation import (
    PAYLOAD_DTYPES,
    DeviceStatus,
    check_buffer_arguments,
    check_codec,
    check_dispatch_input,
    check_low_latency_dispatch,
    check_nonneg_int,
    check_num_experts,
    check_topk_idx,
    check_topk_weights,
    require_shape,
    require_tensor,
)

_buffer_ids = itertools.count(1)
_live_buffers: "weakref.WeakValueDictionary[int, Buffer]" = weakref.WeakValueDictionary()


class Buffer(RankMasking):
    """Expert-parallel communication buffer over one process group (DeepEP V1 API).

    Construction is collective: every rank of ``group`` must create its Buffer together.

    Args:
        group: the ``torch.distributed`` process group of the EP ranks (``R`` ranks).
        num_nvl_bytes / num_rdma_bytes: NVLink / RDMA buffer sizes for the NVSHMEM backend (the
            portable backend allocates per call and ignores them).
        low_latency_mode: whether the low-latency calls will be used (kept for DeepEP parity).
        num_qps_per_rank: RDMA queue pairs per rank (NVSHMEM backend).
        allow_nvlink_for_low_latency_mode / allow_mnnvl / use_fabric / explicitly_destroy: DeepEP's
            flags, accepted and kept as attributes (the low-latency kernels here use NVLink peers
            whenever NVSHMEM reaches them; ``destroy()`` may be called either way).
        enable_shrink: enables DeepEP's low-latency mask-buffer calls
            (``low_latency_update_mask_buffer`` / ``_query_`` / ``_clean_``), which record a mask
            locally and apply it with ``mask_ranks`` / ``unmask_ranks`` at the next
            ``low_latency_dispatch``; a low-latency call that times out adds the peers it names.
            comm: must be None.
        backend: ``"auto"`` (NVSHMEM when built and on NVIDIA GPUs, else torch), ``"torch"`` or
            ``"nvshmem"``. With NVSHMEM and 1..8 ranks on one host, normal and low-latency calls
            run the fused CUDA kernels (``ep_comm.paths.fused``; ``path_plan`` says which and why);
            ``backend="nvshmem"`` puts the Buffer on this process's current CUDA device even over
            a gloo group (the group then only bootstraps).
        timeout_s: the longest the constructor or any call waits for a peer before
            ``CommTimeoutError``.
        expert_placement: optional ``[E]`` int64 map from global expert to owning rank (default:
            contiguous ``E / R`` blocks).
        ranks_per_node: ``None`` (default): DeepEP's rule, nodes of 8 NVLink peers when the group
            has more than 8 ranks (a multiple of 8: DeepEP's internode mode, node-aware here too),
            else the flat single-level exchange. ``P`` (a divisor of
            ``R``): ranks form nodes of ``P`` consecutive ranks and normal-mode dispatch/combine
            run node-aware in two hops (each token crosses to a node once, to the rank with the
            sender's local index, which forwards it inside the node; see
            ``ep_comm.hierarchical``). Results are identical to the flat dispatch; the combine
            sums per node first (bit-identical to the flat combine with one node or one rank per
            node, else within the payload dtype's rounding). ``get_dispatch_layout`` then counts
            ``num_tokens_per_rdma_rank`` over ``R / P`` nodes. With the NVSHMEM transport
            (``backend="nvshmem"``, or ``"auto"`` on NVIDIA when built) and ``P <= 8`` ranks per
            node whose GPUs reach each other through NVSHMEM, supported calls run the two-hop
            kernels, one NVSHMEM PE per process (``ep_comm.paths.two_hop``; ``path_plan`` says
            whether and why not); other calls run ``ep_comm.hierarchical`` over ``torch``
            subgroups. Low-latency mode stays flat; after ``mask_ranks`` the Buffer runs flat for
            the rest of its life. Construction creates the rail and node subgroups with
            ``dist.new_group`` (collective).
        store: the key-value store that names dead peers and re-forms groups (``mask_ranks``,
            ``unmask_ranks``, ``reset``, ``Buffer.rejoin``); default: the store the default process
            group was launched with. Pass one hosted outside the workers (the same on every rank)
            when that one lives in rank 0's process (``tcp://``/``env://`` outside torchrun), so
            the job survives rank 0's death.
        intranode_copy: how the fused kernels move normal-mode rows between the processes of one
            host (the same on every rank): ``"ring"`` through ring buffers in the CUDA IPC peer
            buffers, or ``"direct"``, each row written once at its final place in the receiver's
            output (the combine reading each row from its sender's ``x``), at the cost of a
            per-call exchange of IPC handles; a call where a rank cannot export its tensors (e.g.
            torch's expandable segments) runs through the rings. docs/design.md compares them.
    """

    num_sms: int = 20
    _seq = 0
    _opened = False
    _disagreed = False
    _broken: str | None = None
    _call_mode = ""
    _backward: BackwardCall | None = None  # a differentiable op's call, while it runs (_backward_call)
    _last_backward: BackwardCall | None = None  # the last one, once it returned
    _header_collectives = 0
    _mask_request: frozenset[int] | None = None
    enable_shrink = False

    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: object | None = None, *, backend: str = "auto",
                 timeout_s: float = 60.0, expert_placement: torch.Tensor | None = None,
                 ranks_per_node: int | None = None, store: dist.Store | None = None,
                 intranode_copy: str = "ring") -> None:
        check_buffer_arguments(group, num_nvl_bytes, num_rdma_bytes, num_qps_per_rank, backend, timeout_s,
                               ranks_per_node, allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode,
                               allow_mnnvl=allow_mnnvl, use_fabric=use_fabric, explicitly_destroy=explicitly_destroy,
                               enable_shrink=enable_shrink)
        if comm is not None:
            raise ValueError("comm: ep_comm runs over the torch.distributed group only; pass comm=None")
        size = dist.get_world_size(group)
        if ranks_per_node is None and size > NUM_MAX_NVL_PEERS and size % NUM_MAX_NVL_PEERS == 0:
            ranks_per_node = NUM_MAX_NVL_PEERS
        self.ranks_per_node = ranks_per_node
        self.group = group
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        self.allow_mnnvl = bool(allow_mnnvl)
        self.use_fabric = bool(use_fabric)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        self._mask_request: frozenset[int] | None = None  # shrink mode: the mask the next LL dispatch applies
        self._local_buffers: dict[bool, torch.Tensor] = {}  # get_local_buffer_tensor's bytes (nvl / rdma)
        self.timeout_s = float(timeout_s)
        if intranode_copy not in ("ring", "direct"):
            raise ValueError(f"intranode_copy must be 'ring' or 'direct', got {intranode_copy!r}")
        self.intranode_copy = intranode_copy
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self._take_buffer_id()
        self._store = resolve_store(store)
        self.device = pick_device(group, backend)
        # gloo stages payloads through host memory, so it takes tensors on any device (a
        # mixed-vendor job's GPUs); NCCL/RCCL take tensors on this rank's GPU only
        self._input_device: torch.device | None = None if str(dist.get_backend(group)) == "gloo" else self.device
        self._placement: ExpertPlacement | None = None
        if expert_placement is not None:
            self._placement = ExpertPlacement.from_expert_to_rank(expert_placement, self.group_size)
        # every rank here within timeout_s before the first collective (whose wait is the group's
        # timeout, not timeout_s): a rank that never constructs is named, not waited for
        global_ranks = dist.get_process_group_ranks(group)
        try:
            name = group.group_name
        except RuntimeError:  # a group made without a name: its ranks name it (the same on every rank)
            name = "ranks-" + "-".join(map(str, global_ranks))
        try:
            arrive(self._store, f"{name}/construct", global_ranks, self.rank, self.timeout_s, "Buffer construction")
        except CommTimeoutError as error:
            error.name_global_ranks(global_ranks)
            raise
        self.transport: Transport
        self.transport, self.transport_reason = make_transport(group, backend, self.device, self.timeout_s,
                                                               num_nvl_bytes, num_rdma_bytes, num_qps_per_rank)
        """Why every rank chose this transport (the same on every rank)."""
        if self.transport.name == "torch":
            self.transport.store = self._store  # type: ignore[attr-defined]
        self.backend = self.transport.name
        self._scratch = ScratchPool()  # low-latency message bytes, reused across calls
        self.path_plan = self._make_paths(ranks_per_node)
        """The Buffer's paths in the order they are tried, and the choice of each mode's last call
        (``ep_comm.paths.PathPlan``; ``print(buf.path_plan)`` says what may run and why not)."""
        self._last_stats: CommStats | None = None
        self._device_status = DeviceStatus()  # the kernel path's data checks (check_low_latency_status)
        self.masked_ranks: frozenset[int] = frozenset()
        self.mask_epoch = 0
        self._unmasked_transport = self.transport
        self._formations: dict[tuple[int, ...], int] = {}
        self._ll_receive_areas = low_latency.ReceiveAreas()
        self.auto_codec = AutoCodecPolicy()
        """The rule ``codec="auto"`` follows (see ep_comm.codecs.auto); set its fields to tune."""

    @property
    def last_stats(self) -> CommStats | None:
        """The ``CommStats`` of the last call. After a low-latency call on the kernel path its
        per-peer counts stay on the device until this is read (reading them waits for them)."""
        return None if self._last_stats is None else self._last_stats.settle()

    @last_stats.setter
    def last_stats(self, stats: CommStats | None) -> None:
        self._last_stats = stats

    # -- construction helpers ------------------------------------------------------------------
    def _take_buffer_id(self) -> None:
        """Sets ``buffer_id``, a number no other Buffer of this process has (handles remember it),
        under which the differentiable ops find this Buffer (:meth:`_live`), and ``_grad_anchor``,
        their input in grad mode: a ``[1]`` float32 CPU leaf of zeros that requires grad
        (autograd records a call even where its other inputs need none)."""
        self.buffer_id = next(_buffer_ids)
        _live_buffers[self.buffer_id] = self
        self._grad_anchor = torch.zeros(1, dtype=torch.float32, device="cpu", requires_grad=True)

    @staticmethod
    def _live(buffer_id: int) -> "Buffer":
        """The Buffer of ``buffer_id`` while it has not been freed (a weak registry: the
        differentiable ops take Buffers by id), or ValueError."""
        try:
            return _live_buffers[buffer_id]
        except KeyError:
            raise ValueError(f"no live ep_comm.Buffer with id {buffer_id}") from None

    def _make_paths(self, ranks_per_node: int | None) -> PathPlan:
        """The paths in order of preference (collective: the kernel paths agree on what may run,
        and ``ranks_per_node`` creates the node subgroups)."""
        group, device, timeout, bid = self.group, self.device, self.timeout_s, self.buffer_id
        if ranks_per_node is None:
            unset = "ranks_per_node is not set"
            two_hop = TwoHopKernelPath(None, device, None, None, 1, timeout, bid, unset)
            node_aware = NodeAwarePath(None, bid, unset)
        else:
            from .transports.node_groups import create_node_transports

            groups = create_node_transports(group, ranks_per_node, timeout, device,
                                            str(getattr(self.transport, "instance_id", bid)))
            two_hop = TwoHopKernelPath.build(group, device, self.transport, groups, ranks_per_node, timeout, bid)
            node_aware = NodeAwarePath(groups, bid)
        fused = FusedKernelPath.build(group, device, self.transport.name, timeout, bid, self.intranode_copy)
        return PathPlan([two_hop, node_aware, fused, FlatPath(self.transport, bid, self._scratch)],
                        f"{self.transport.name} ({self.transport_reason})")

    @property
    def kernel_plan(self) -> PathPlan:
        """The same object as :attr:`path_plan`."""
        return self.path_plan

    def close(self) -> None:
        """Releases the kernel paths' buffers (CUDA IPC mappings, NVSHMEM memory). Collective:
        every rank calls it together; later calls make them again."""
        for path in self.path_plan.paths:
            path.close()

    @staticmethod
    def capture() -> EventOverlap:
        """An event at this point of the current stream (DeepEP's ``Buffer.capture``; on the CPU
        an event that is already complete)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether ``ep_comm._cuda`` is built for sm_90 (Hopper)."""
        from ._build import build_info

        return "90" in build_info()["archs"]

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The stream the Buffer's calls run on: this rank's current CUDA stream (the calls here
        enqueue their kernels there, no separate communication stream), or None on the CPU
        (``torch.cuda.stream(None)`` is a no-op, so DeepEP-style ``with`` blocks still work)."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.current_stream(self.device)

    def destroy(self) -> None:
        """DeepEP's name for releasing the Buffer (code built with ``explicitly_destroy=True``
        calls it): the same as :meth:`close`."""
        self.close()

    def placement(self, num_experts: int) -> ExpertPlacement:
        """The expert -> rank map for ``num_experts`` experts."""
        check_num_experts(num_experts, self.group_size, self._placement is not None)
        if self._placement is not None:
            if self._placement.num_experts != num_experts:
                raise ValueError(f"num_experts ({num_experts}) does not match expert_placement, "
                                 f"which places {self._placement.num_experts} experts")
            return self._placement
        return ExpertPlacement.contiguous(num_experts, self.group_size)

    def _num_local_experts(self, num_experts: int) -> int:
        """This rank's number of experts among ``num_experts`` (already checked), from Python ints
        (the differentiable dispatch's fake kernel asks while ``torch.compile`` traces, where a
        new tensor would be a fake one)."""
        if self._placement is None:
            return num_experts // self.group_size
        return self._placement.local_expert_counts[self.rank]

    # -- DeepEP static helpers -----------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SM count the normal-mode kernels use (an even number)."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"new_num_sms must be a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A tuned dispatch ``Config`` for ``num_ranks`` ranks, using ``Buffer.num_sms`` SMs (as
        :meth:`set_num_sms` left it, like DeepEP's)."""
        return replace(default_dispatch_config(num_ranks), num_sms=Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A tuned combine ``Config`` for ``num_ranks`` ranks, using ``Buffer.num_sms`` SMs."""
        return replace(default_combine_config(num_ranks), num_sms=Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of RDMA buffer the low-latency mode needs (send + receive, dispatch + combine)."""
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_ranks", num_ranks), ("num_experts", num_experts)):
            check_nonneg_int(name, value, positive=True)
        return low_latency.rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def _open(self, header: CallHeader) -> None:
        """The call's opening exchange (portable transport): every live rank's header must match
        this one before any payload moves (``ep_comm.agreement``)."""
        seq, self._seq = self._seq, self._seq + 1
        self._opened = True
        if self.transport.name == "torch":
            live = [r for r in range(self.group_size) if r not in self.masked_ranks]
            self._header_collectives = 1
            vote = BackwardVote.OFF if self._backward is None else self._backward.vote
            try:
                agreed = agree(self.transport, replace(header, seq=seq, placement=placement_digest(self._placement),
                                                       backward=vote), live, self._global_ranks)
            except ValueError:
                self._disagreed = True
                raise
            if self._backward is not None:
                self._backward.agreed = agreed

    def _group_key(self) -> tuple:
        placement = None if self._placement is None else tuple(self._placement.expert_to_rank.tolist())
        return (self._global_ranks(), placement, self.ranks_per_node)

    def _run(self, mode: str, call: object):
        """Runs ``call`` on the first path of :attr:`path_plan` that takes it."""
        return getattr(self.path_plan.choose(mode, call), mode)(call)

    def _record(self, stats: CommStats, dropped: int = 0) -> None:
        stats.dropped_topk_entries = dropped
        stats.num_collectives += self._header_collectives  # the call's opening exchange
        self._header_collectives = 0
        if stats.codec == "lossless":
            self.auto_codec.observe(stats.total_sent_raw, stats.total_sent_wire)
        self.last_stats = stats

    # -- layout --------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: EventOverlap | None = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Computes the dispatch layout of this rank's tokens (no communication).

        Args:
            topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none.
            num_experts: ``E``.
        Returns:
            ``(num_tokens_per_rank [R]`` int32, ``num_tokens_per_rdma_rank [R / P]`` int32 or
            None (one node), ``num_tokens_per_expert [E]`` int32, ``is_token_in_rank [N, R]``
            bool, ``event)``; ``P`` is ``ranks_per_node`` (8 when not given).
        """
        placement = self.placement(num_experts)
        topk_idx = check_topk_idx(topk_idx, num_experts, self._input_device)
        topk_idx, _ = self._drop_masked(topk_idx, placement)
        wait_previous(previous_event)
        layout = compute_dispatch_layout(topk_idx, placement, self.ranks_per_node or NUM_MAX_NVL_PEERS)
        event = finish_event(async_finish, self.device)
        return (layout.num_tokens_per_rank, layout.num_tokens_per_rdma_rank,
                layout.num_tokens_per_expert, layout.is_token_in_rank, event)

    # -- normal dispatch / combine -------------------------------------------------------------
    @collective("dispatch")
    def dispatch(self, x, handle: DispatchHandle | None = None,
                 num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Config | None = None,
                 previous_event: EventOverlap | None = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *, codec: str | None = None):
        """Sends every token once to each rank holding one of its experts.

        Args:
            x: ``[N, H]`` bf16/fp16/fp32 (fp64 for gradient checks), or DeepEP's FP8 input
                ``(float8_e4m3fn [N, H], float32 scales [N, H // 128])``, carried unchanged.
            handle: a ``DispatchHandle`` from an earlier dispatch: re-send ``x`` along its plan.
            num_tokens_per_rank / num_tokens_per_rdma_rank / num_tokens_per_expert: the layout
                (accepted for DeepEP parity; recomputed from ``topk_idx`` when absent).
            is_token_in_rank: ``[N, R]`` bool (computed from ``topk_idx`` when absent).
            topk_idx: ``[N, K]`` int64 global ids in ``[-1, E)``; needed unless ``handle``.
            topk_weights: ``[N, K]`` float32.
            expert_alignment: each per-expert count is rounded up to a multiple of this.
            num_worst_tokens: when > 0, the received tensors have exactly this many rows (padded
                with zeros, ids ``-1``) and the counts list is empty.
            codec: ``None``/``"none"``, ``"fp8"``, ``"lossless"`` or ``"auto"``.
        Returns:
            ``(recv_x, recv_topk_idx [M, K]`` int64 local ids, ``recv_topk_weights [M, K]``
            float32, ``num_recv_tokens_per_expert_list``, ``handle``, ``event)``; received rows are
            ordered by source rank, then source token. With ``handle``, only ``recv_x`` and
            ``event`` are set.
        """
        num_tokens, hidden = check_dispatch_input(x, self._input_device)
        codec_name = check_codec(codec, ("none", "fp8", "lossless", "auto"))
        check_nonneg_int("expert_alignment", expert_alignment, positive=True)
        check_nonneg_int("num_worst_tokens", num_worst_tokens)
        if config is not None and not isinstance(config, Config):
            raise ValueError(f"config must be an ep_comm.Config, got {type(config).__name__}")
        if codec_name != "auto":
            check_codec_input(codec_name, x, hidden)
        wait_previous(previous_event)
        dtype = (x[0] if isinstance(x, tuple) else x).dtype

        if handle is not None:
            self._call_mode = "cached_dispatch"
            self._check_handle(handle, "handle")
            if num_tokens != handle.num_tokens:  # the hidden size may differ (the layout is per token)
                raise ValueError(f"x has {num_tokens} tokens but handle was made for {handle.num_tokens}")
            self._open(CallHeader("cached_dispatch", 0, dtype=dtype, hidden=hidden, codec=codec_name,
                                  handle=self._handle_digests(handle.send_plan.send_counts, handle.recv_counts)))
            codec_name = self._resolve_codec(codec_name, x, hidden)
            recv_x, stats = self._run("cached_dispatch", CachedDispatchCall(handle, x, codec_name,
                                                                            bool(self.masked_ranks)))
            self._record(stats)
            recv_x = normal.pad_rows(recv_x, handle.num_worst_tokens)
            return recv_x, None, None, None, None, finish_event(async_finish, self.device)

        x_device = (x[0] if isinstance(x, tuple) else x).device
        if topk_idx is None:
            return self._dispatch_without_topk(x, num_tokens, is_token_in_rank, num_tokens_per_expert,
                                               topk_weights, expert_alignment, num_worst_tokens, codec_name,
                                               async_finish, x_device, config)
        num_experts = self._infer_num_experts(num_tokens_per_expert)
        topk_idx = check_topk_idx(topk_idx, num_experts, x_device, num_tokens)
        if topk_weights is not None:
            topk_weights = check_topk_weights(topk_weights, topk_idx, x_device)
        placement = self.placement(num_experts)
        topk_idx, dropped = self._drop_masked(topk_idx, placement)
        if is_token_in_rank is None or self.masked_ranks:
            if is_token_in_rank is not None:
                require_shape("is_token_in_rank", is_token_in_rank, (num_tokens, self.group_size))
            is_token_in_rank = compute_dispatch_layout(topk_idx, placement).is_token_in_rank
        else:
            require_tensor("is_token_in_rank", is_token_in_rank, dtypes=(torch.bool,), dim=2, device=x_device)
            require_shape("is_token_in_rank", is_token_in_rank, (num_tokens, self.group_size))
        if num_tokens_per_rank is not None:
            require_tensor("num_tokens_per_rank", num_tokens_per_rank, dim=1, device=self._input_device)
            require_shape("num_tokens_per_rank", num_tokens_per_rank, (self.group_size,))

        self._open(CallHeader("dispatch", 0, dtype=dtype, hidden=hidden, topk=int(topk_idx.shape[1]),
                              num_experts=num_experts, codec=codec_name, weights=topk_weights is not None))
        codec_name = self._resolve_codec(codec_name, x, hidden)
        out = self._run("dispatch", DispatchCall(x, topk_idx, topk_weights, is_token_in_rank, placement, codec_name,
                                                 bool(self.masked_ranks), self.num_sms))
        self._record(out.stats, dropped)
        return self._dispatch_result(out, out.counts_per_expert, expert_alignment, num_worst_tokens, async_finish,
                                     config)

    def _dispatch_result(self, out: normal.DispatchOutput, counts_per_expert: torch.Tensor,
                         expert_alignment: int, num_worst_tokens: int, async_finish: bool, config: Config | None):
        """A fresh dispatch's return tuple (padded to ``num_worst_tokens`` when > 0)."""
        state = replace(out.handle, mask_epoch=self.mask_epoch, group_key=self._group_key())
        recv_x, recv_topk, recv_w = out.x, out.topk_idx, out.topk_weights
        if num_worst_tokens > 0:
            self._check_num_worst_tokens(state.num_recv_tokens, num_worst_tokens)
            state = replace(state, num_worst_tokens=num_worst_tokens)
            recv_x = normal.pad_rows(recv_x, num_worst_tokens)
            recv_topk = normal.pad_rows(recv_topk, num_worst_tokens, -1)
            recv_w = normal.pad_rows(recv_w, num_worst_tokens, 0)
            counts_list: list[int] = []
        else:
            counts_list = align_up(counts_per_expert.tolist(), expert_alignment)
        handle_out = self._deep_ep_handle(state, (config.num_sms if config is not None else self.num_sms) // 2)
        event = finish_event(async_finish, self.device)
        return recv_x, recv_topk, recv_w, counts_list, handle_out, event

    def _check_num_worst_tokens(self, received: int, num_worst_tokens: int) -> None:
        """ValueError when this rank received more rows than its ``num_worst_tokens``. DeepEP lets
        each rank pass its own value (0 on some), so no rank learns another's: the call's exchanges
        have completed on every rank, the others return normally, and the group stays in step (the
        next call works on every rank)."""
        if received > num_worst_tokens:
            self._disagreed = True  # the exchanges completed: not a group out of step
            raise ValueError(f"num_worst_tokens ({num_worst_tokens}) is smaller than the {received} tokens this "
                             f"rank received (the other ranks' dispatch returned; this Buffer stays usable)")

    def _deep_ep_handle(self, state: DispatchState, num_channels: int) -> DispatchHandle:
        """DeepEP's handle tuple of a dispatch (its entries on the Buffer's device). The per-rank
        token counts the entries need come from the path, or from one more count exchange."""
        if state.tokens_per_rank is None or (state.node_plan is None and state.count_matrix is None):
            row = torch.tensor([*state.send_plan.send_counts.tolist(), state.num_tokens], dtype=torch.int64)
            table = self.transport.exchange_counts(row.expand(self.group_size, -1).contiguous(),
                                                   "dispatch/handle_counts")
            state = replace(state, count_matrix=table[:, :-1], tokens_per_rank=table[:, -1])
        if state.node_plan is not None:
            entries, kind = handle_entries.internode_entries(state, num_channels, self.rank), InternodeDispatchHandle
        else:
            entries, kind = handle_entries.intranode_entries(state, num_channels), IntranodeDispatchHandle
        device = state.is_token_in_rank.device
        return kind(tuple(t.to(device) for t in entries), state)

    def _dispatch_without_topk(self, x, num_tokens: int, is_token_in_rank: torch.Tensor | None,
                               num_tokens_per_expert: torch.Tensor | None, topk_weights: torch.Tensor | None,
                               expert_alignment: int, num_worst_tokens: int, codec: str, async_finish: bool,
                               x_device: torch.device, config: Config | None):
        """DeepEP's dispatch from the layout alone: rows go where ``is_token_in_rank`` says;
        ``recv_topk_idx`` / ``recv_topk_weights`` are None and the per-expert counts are the
        senders' ``num_tokens_per_expert`` for this rank's experts, summed (one more exchange)."""
        if topk_weights is not None:
            raise ValueError("topk_weights needs topk_idx (which experts the weights belong to)")
        if is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("a dispatch without topk_idx (and without a handle) needs is_token_in_rank "
                             "and num_tokens_per_expert, as get_dispatch_layout returns them")
        require_tensor("is_token_in_rank", is_token_in_rank, dtypes=(torch.bool,), dim=2, device=x_device)
        require_shape("is_token_in_rank", is_token_in_rank, (num_tokens, self.group_size))
        num_experts = self._infer_num_experts(num_tokens_per_expert)
        check_num_experts(num_experts, self.group_size, self._placement is not None)
        if num_tokens_per_expert.dtype not in (torch.int32, torch.int64) or bool((num_tokens_per_expert < 0).any()):
            raise ValueError("num_tokens_per_expert must hold non-negative int32/int64 counts")
        placement = self.placement(num_experts)
        if self.masked_ranks:
            dead = torch.zeros(self.group_size, dtype=torch.bool, device=is_token_in_rank.device)
            dead[list(self.masked_ranks)] = True
            is_token_in_rank = is_token_in_rank & ~dead
        self._open(CallHeader("dispatch", 0, dtype=(x[0] if isinstance(x, tuple) else x).dtype,
                              hidden=int((x[0] if isinstance(x, tuple) else x).shape[1]), num_experts=num_experts,
                              codec=codec))
        codec = self._resolve_codec(codec, x, 0)
        out = self._run("dispatch", DispatchCall(x, None, None, is_token_in_rank, placement, codec,
                                                 bool(self.masked_ranks), self.num_sms))
        mine = normal.exchange_expert_counts(self.transport, placement, num_tokens_per_expert, self.masked_ranks)
        out.stats.num_collectives += 1
        self._record(out.stats)
        return self._dispatch_result(out, mine, expert_alignment, num_worst_tokens, async_finish, config)

    def _infer_num_experts(self, num_tokens_per_expert: torch.Tensor | None) -> int:
        if num_tokens_per_expert is not None:
            require_tensor("num_tokens_per_expert", num_tokens_per_expert, dim=1, device=self._input_device)
            return int(num_tokens_per_expert.numel())
        if self._placement is not None:
            return self._placement.num_experts
        raise ValueError("num_tokens_per_expert is required (it tells the number of experts); "
                         "pass the value get_dispatch_layout returned")

    def _resolve_codec(self, codec: str, x: object, hidden: int) -> str:
        if codec == "auto":
            return agree_on_codec(x, self.auto_codec, self.transport, self.masked_ranks)
        return check_codec_input(codec, x, hidden)

    def _handle_digests(self, sends: torch.Tensor, expects: torch.Tensor) -> tuple[int, int]:
        """A combine's or cached dispatch's :func:`agreement.handle_digests` (``sends``, ``expects``:
        ``[R]`` rows to and from each rank), where the opening exchange runs (portable transport)."""
        if self.transport.name != "torch":
            return (0, 0)
        return handle_digests(self.rank, sends.tolist(), expects.tolist())

    @contextlib.contextmanager
    def _backward_call(self, vote: BackwardVote):
        """Within it, calls open with ``vote`` in their header (a differentiable op's call); yields
        its :class:`BackwardCall`, whose ``agreed`` the call's opening exchange sets (on a
        transport without one it stays None: the call goes by this rank's own vote), and which
        ``_last_backward`` then holds."""
        call = BackwardCall(vote)
        previous, self._backward, self._last_backward = self._backward, call, None
        try:
            yield call
        finally:
            self._backward, self._last_backward = previous, call

    def _refuse(self, mode: str, error: ValueError) -> None:
        """Raises ``error``, an argument this rank rejected before a call of ``mode`` opened (the
        differentiable wrappers' checks), as a Buffer method's own check does: the call opens with
        a failed status first, so the peers fail with it (naming this rank) instead of pairing
        with its next call, and the group stays in step."""
        @collective(mode)
        def refused(buffer: Buffer) -> None:
            raise error

        refused(self)

    def _check_handle(self, handle: object, name: str, kind: type = DispatchHandle) -> None:
        if not isinstance(handle, kind):
            made = " (a tuple built or sliced outside ep_comm is not one)" if isinstance(handle, (tuple, list)) else ""
            raise ValueError(f"{name} must be the ep_comm.{kind.__name__} a dispatch of this Buffer returned"
                             f"{made}, got {type(handle).__name__}")
        if handle.buffer_id != self.buffer_id:  # type: ignore[attr-defined]
            # DeepEP's handles are plain tensors, valid with any Buffer of the group (Megatron
            # rebuilds its Buffer): take one made by a Buffer of the same group, placement and
            # nodes, unmasked, whose dispatch did not leave state in a kernel engine of its own
            if handle.group_key != self._group_key() or not handle.group_key:  # type: ignore[attr-defined]
                raise ValueError(f"{name} was made by a Buffer of another group, placement or node size")
            if handle.kernel is not None or handle.mask_epoch or self.mask_epoch:  # type: ignore[attr-defined]
                raise ValueError(f"{name} was made by another Buffer whose dispatch ran on its kernel engines "
                                 f"or under masked ranks; dispatch again on this Buffer")
            return
        if handle.mask_epoch != self.mask_epoch:  # type: ignore[attr-defined]
            raise ValueError(f"{name} was made before the last mask_ranks/unmask_ranks; dispatch again")

    @collective("combine")
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None,
                bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None, config: Config | None = None,
                previous_event: EventOverlap | None = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, *, codec: str | None = None):
        """Returns every received row to its source and sums them per token.

        Args:
            x: ``[M, H]`` (or ``[num_worst_tokens, H]``) rows in the received order.
            handle: the dispatch's ``DispatchHandle``.
            topk_weights: ``[M, K]`` float32, summed the same way (optional).
            bias: up to two ``[N, H]`` tensors added to the result.
            codec: ``None``/``"none"``, ``"lossless"`` or ``"auto"``.
        Returns:
            ``(combined_x [N, H]`` x's dtype, ``combined_topk_weights [N, K]`` float32 or None,
            ``event)``. A token routed to no rank combines to zeros.
        """
        self._check_handle(handle, "handle")
        require_tensor("x", x, dtypes=PAYLOAD_DTYPES, dim=2, device=self._input_device)
        if x.shape[0] != handle.num_recv_rows:
            raise ValueError(f"x has {x.shape[0]} rows but the handle received "
                             f"{handle.num_recv_rows}: x and handle do not match")
        codec_name = check_codec(codec, ("none", "lossless", "auto"))
        if codec_name != "auto":
            check_codec_input(codec_name, x, x.shape[1])
        if topk_weights is not None:
            require_tensor("topk_weights", topk_weights, dtypes=(torch.float32, torch.float64), dim=2,
                           device=self._input_device)
            if topk_weights.shape[0] != x.shape[0]:
                raise ValueError(f"topk_weights has {topk_weights.shape[0]} rows, x has {x.shape[0]}")
        biases: tuple[torch.Tensor, ...] = ()
        if bias is not None:
            biases = bias if isinstance(bias, tuple) else (bias,)
            if len(biases) > 2:
                raise ValueError("bias takes at most two tensors")
            for i, b in enumerate(biases):
                require_tensor(f"bias[{i}]", b, dtypes=PAYLOAD_DTYPES, dim=2, device=self._input_device)
                require_shape(f"bias[{i}]", b, (handle.num_tokens, x.shape[1]))
        wait_previous(previous_event)
        self._open(CallHeader("combine", 0, dtype=x.dtype, hidden=int(x.shape[1]), codec=codec_name,
                              topk=0 if topk_weights is None else int(topk_weights.shape[1]),
                              weights=topk_weights is not None,
                              handle=self._handle_digests(handle.recv_counts, handle.send_plan.send_counts)))
        codec_name = self._resolve_codec(codec_name, x, x.shape[1])
        combined, combined_w, stats = self._run("combine", CombineCall(handle, x, topk_weights, biases, codec_name,
                                                                       bool(self.masked_ranks)))
        self._record(stats)
        if combined_w is not None and combined_w.dtype != torch.float64:
            combined_w = combined_w.float()
        return combined, combined_w, finish_event(async_finish, self.device)

    # -- low-latency mode ----------------------------------------------------------------------
    @collective("low_latency_dispatch")
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False, *,
                             use_nvfp4: bool = False, x_global_scale: torch.Tensor | None = None):
        """Decode-time dispatch into fixed per-expert slots.

        On the NVIDIA kernel path with CUDA tensors (``path_plan``) the call, its hook and the
        combine never wait for the device, so they can be captured in a CUDA graph; checks that
        read ``topk_idx``'s values run on the device and are raised by a later call or
        :meth:`check_low_latency_status`.

        Args:
            x: ``[N, H]`` bf16 with ``N <= num_max_dispatch_tokens_per_rank``.
            topk_idx: ``[N, K]`` int64 global expert ids, ``-1`` for none.
            use_fp8 / round_scale / use_ue8m0: cast to e4m3 on the sender with per-128-channel
                scales (power-of-two with ``round_scale``; packed UE8M0 with ``use_ue8m0``).
            return_recv_hook: return right after sending; calling the hook completes the receive.
            cumulative_local_expert_recv_stats: optional ``[L]`` int32, incremented by recv_count.
            dispatch_wait_recv_cost_stats: optional ``[R]`` int64 (DeepEP's slow-peer statistics):
                each entry of a live source rank grows by the nanoseconds this rank waited in the
                receive (the transports here receive from every source at once, so all grow alike).
            use_nvfp4 / x_global_scale: the serving engines' NVFP4 dispatch (DeepEP's NVFP4
                fork; keyword-only): the sender quantizes ``x`` to e2m1 with one e4m3 scale per 16
                values under the global scale ``x_global_scale`` (float32, one element, on x's
                device; ``ep_comm.codecs.nvfp4``) and sends the packed bytes: on the portable
                path ``H/2 + H/16`` bytes a row (padded to 256) instead of ``2H``; on the kernel
                path in rows of ``2H`` bytes (its engine serves the combine's bf16 rows too),
                so the values are NVFP4's but the bytes moved are bf16's. ``use_fp8`` /
                ``round_scale`` / ``use_ue8m0`` are then ignored. Needs ``H % 16 == 0``.
        Returns:
            ``(recv_x, recv_count [L]`` int32, ``handle``, ``event``, ``hook`` or None): ``recv_x``
            is ``[L, R * T, H]`` bf16 or ``(e4m3 [L, R*T, H], scales [L, R*T, H // 128]`` float32
            / ``[L, R*T, H // 512]`` int32 with UE8M0, column-major in their last two dimensions
            as DeepEP's, strides ``(G * R*T, 1, R*T)``); with ``use_nvfp4``, DeepEP's NVFP4
            layout: ``(packed [R*T, H/2, L]`` uint8, a view of a contiguous ``[L, R*T, H/2]``,
            ``scales [32, 4, rm, 4, rk, L]`` float8_e4m3fn, the 128x4-tiled block scales with
            ``rm = ceil(R*T / 128)``, ``rk = ceil(H / 64)`` (``nvfp4.swizzle_scales``)); local
            expert ``j``'s tokens are rows ``[0, recv_count[j])`` of ``recv_x[j]``, grouped by
            source rank. As in DeepEP, the
            receive tensors are double-buffered inside the Buffer: they stay valid until the call
            after next, so clone them to keep them longer.
        """
        if not isinstance(use_nvfp4, (bool, int)) or use_nvfp4 not in (0, 1):
            raise ValueError(f"use_nvfp4 must be a bool, got {use_nvfp4!r}")
        if x_global_scale is not None and not use_nvfp4:
            raise ValueError("x_global_scale is the NVFP4 global scale; it needs use_nvfp4=True")
        num_experts = check_num_experts(num_experts, self.group_size, self._placement is not None)
        require_tensor("x", x, dtypes=(torch.bfloat16,), dim=2, device=self._input_device)
        hidden = int(x.shape[1])
        compact = False
        if use_nvfp4:
            if x_global_scale is None:
                raise ValueError("use_nvfp4=True needs x_global_scale (float32, one element: the NVFP4 global scale)")
            global_scale = nvfp4.check_global_scale(x_global_scale)
            use_fp8 = round_scale = use_ue8m0 = False
        placement = self.placement(num_experts)
        on_device = self._on_kernel_path("low_latency_dispatch", LowLatencyDispatchCall(
            x, topk_idx, num_max_dispatch_tokens_per_rank, placement, use_fp8, round_scale, use_ue8m0, (),
            bool(self.masked_ranks)))
        if use_nvfp4:
            # the kernel path's engine is sized by H for the combine as well: its rows keep H words;
            # the portable path sends compact rows
            compact = not on_device
            x = nvfp4.pack_rows(x, global_scale, None if compact else 2 * hidden)
        if on_device:
            self._device_status.report()
        topk_idx = check_topk_idx(topk_idx, num_experts, x.device, x.shape[0], check_values=not on_device)
        check_low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, use_fp8, round_scale, use_ue8m0,
                                   check_values=not on_device)
        num_local = int(placement.num_local_experts[self.rank])
        if cumulative_local_expert_recv_stats is not None:
            require_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                           dtypes=(torch.int32, torch.int64), dim=1, device=self._input_device)
            require_shape("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                          (num_local,))
        self._check_wait_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats)
        topk_idx, dropped = self._drop_masked(topk_idx, placement)
        if on_device:
            topk_idx = self._device_status.dispatch_routing(topk_idx, num_experts)
        fp8_kind = "none" if not use_fp8 else "fp8_ue8m0" if use_ue8m0 else "fp8_round" if round_scale else "fp8"
        self._open(CallHeader("low_latency_dispatch", 0, dtype=x.dtype, hidden=int(x.shape[1]),
                              topk=int(topk_idx.shape[1]), num_experts=num_experts,
                              capacity=num_max_dispatch_tokens_per_rank, codec=fp8_kind))
        area = self._ll_receive_areas.next(num_local, self.group_size * num_max_dispatch_tokens_per_rank,
                                           x.shape[1], use_fp8, use_ue8m0, x.device)
        out = self._run("low_latency_dispatch", LowLatencyDispatchCall(
            x, topk_idx, num_max_dispatch_tokens_per_rank, placement, use_fp8, round_scale, use_ue8m0, area,
            bool(self.masked_ranks), compact))
        if use_nvfp4:
            out.stats.codec = "nvfp4"
        self._record(out.stats, dropped)
        handle = LowLatencyHandle(
            (out.recv_src_info, out.layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts),
            LowLatencyState(buffer_id=self.buffer_id, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                            hidden=hidden, num_experts=num_experts, num_local_experts=num_local,
                            topk_idx=topk_idx.clone(), receive=out.state, recv_count=out.recv_count,
                            mask_epoch=self.mask_epoch, kernel=out.kernel, group_key=self._group_key()))

        recv_x = out.recv_x
        unpack = None
        if use_nvfp4:
            recv_x, unpack = nvfp4.receive_tensors(out.recv_x, hidden)

        def receive() -> None:
            with self._global_rank_names(), self._waited(dispatch_wait_recv_cost_stats):
                out.receive()
            if unpack is not None:
                unpack()
            if cumulative_local_expert_recv_stats is not None and not handle.stats_added:
                cumulative_local_expert_recv_stats.add_(out.recv_count.to(
                    cumulative_local_expert_recv_stats.dtype))
                handle.state.stats_added = True

        hook: Callable[[], None] | None = receive
        if not return_recv_hook:
            receive()
            hook = None
        if on_device:
            self._device_status.publish()
        event = finish_event(async_finish, self.device)
        return recv_x, out.recv_count, handle, event, hook

    def _on_kernel_path(self, mode: str, call: object) -> bool:
        """Whether the kernel path takes this low-latency call with device tensors: then the call
        makes no host round trip (CUDA-graph capturable) and its data checks run on the device
        (:meth:`check_low_latency_status`)."""
        if call.x.device.type == "cpu":  # type: ignore[attr-defined]
            return False
        for path in self.path_plan.paths:
            if (path.unavailable or getattr(path, f"{mode}_reason")(call)) is None:
                return isinstance(path, FusedKernelPath)
        return False

    def check_low_latency_status(self) -> None:
        """Waits for this rank's stream, then raises what the low-latency calls on the kernel path
        left to report. Those calls never wait for the device (so they can be captured in a CUDA
        graph and replayed): their data checks (``topk_idx`` entries in range, no expert twice
        per token, a combine's routing equal to its dispatch's) run on the device, and the kernels
        record timeouts and capacity overflows. The next low-latency call raises what has reached
        the host by then; this call waits first, so it raises everything up to now: a
        ``ValueError`` naming the call and the argument, or ``CommTimeoutError`` naming the peer
        (the group is then out of step until ``reset()``). Entries that failed a check were
        treated as ``-1`` (the token skipped that expert); a combine whose ``topk_idx`` differed
        from its dispatch's combined along the dispatch's routing."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        fused = self.path_plan.get(FusedKernelPath.name)
        if isinstance(fused, FusedKernelPath):
            try:
                with self._global_rank_names():
                    fused.low_latency_status(wait=False)
            except CommTimeoutError:
                self._broken = "a low-latency call whose kernels timed out"
                raise
        self._device_status.report()

    @contextlib.contextmanager
    def _global_rank_names(self):
        """A CommTimeoutError leaving the block (a receive hook's) names its peers' global ranks
        too, as the collective calls' do (``CommTimeoutError.name_global_ranks``)."""
        try:
            yield
        except CommTimeoutError as error:
            self._name_global_ranks(error)
            raise

    def _check_wait_stats(self, name: str, stats: torch.Tensor | None) -> None:
        if stats is not None:
            require_tensor(name, stats, dtypes=(torch.int64,), dim=1, device=self._input_device)
            require_shape(name, stats, (self.group_size,))
            if not stats.is_contiguous():
                raise ValueError(f"{name} must be contiguous")

    def _waited(self, stats: torch.Tensor | None):
        if stats is not None and stats.device.type != "cpu" and torch.cuda.is_current_stream_capturing():
            return contextlib.nullcontext()  # a host-measured wait means nothing in a graph replay
        live = torch.ones(self.group_size, dtype=torch.bool)
        live[list(self.masked_ranks)] = False
        return low_latency.timed_wait(stats, live)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """DeepEP's reset of the low-latency buffer before low-latency calls that follow normal
        ones. The calls here keep no state across them that needs it: this checks the arguments
        and drops the Buffer's cached low-latency receive tensors and message buffers. No
        communication."""
        check_nonneg_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, positive=True)
        check_nonneg_int("hidden", hidden, positive=True)
        check_num_experts(num_experts, self.group_size, self._placement is not None)
        self._ll_receive_areas.clear()
        self._scratch.clear()

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """A ``[L, R * T, H]`` bf16 tensor for the expert outputs of ``handle``'s tokens, to fill
        and pass as ``x`` to :meth:`low_latency_combine` (DeepEP's zero-copy combine input; here a
        new tensor on the dispatch's device each call, so two batches in flight never share one)."""
        self._check_handle(handle, "handle", LowLatencyHandle)
        slots = self.group_size * handle.num_max_dispatch_tokens_per_rank
        return torch.empty(handle.num_local_experts, slots, handle.hidden, dtype=torch.bfloat16,
                           device=handle.topk_idx.device)

    @collective("low_latency_combine")
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None, *,
                            overlap: bool = False, packed_recv_count: torch.Tensor | None = None,
                            comp_signal: torch.Tensor | None = None, block_m: int = 64, threshold: int = 0,
                            num_sms: int = 3, src_signals: torch.Tensor | None = None,
                            src_signal_expect_value: int = 0):
        """Returns expert outputs and reduces them with the top-k weights.

        Args:
            x: ``[L, R * T, H]`` bf16 expert outputs in the dispatch's slots.
            topk_idx: ``[N, K]`` int64, the routing that was dispatched.
            topk_weights: ``[N, K]`` float32.
            handle: the ``LowLatencyHandle`` of the dispatch (its receive must be complete).
            return_recv_hook: return after sending; the hook completes the receive into the
                returned tensor.
            zero_copy: accepted for DeepEP parity (no effect: ``x`` may come from
                :meth:`get_next_low_latency_combine_buffer` or anywhere else).
            out: optional ``[N, H]`` bf16 output tensor.
            use_logfmt: accepted for DeepEP parity; the expert outputs are sent as exact bf16
                either way (no LogFMT compression).
            combine_wait_recv_cost_stats: optional ``[R]`` int64, as ``dispatch_wait_recv_cost_stats``
                of :meth:`low_latency_dispatch`.
            overlap / packed_recv_count / comp_signal / block_m / threshold / num_sms /
                src_signals / src_signal_expect_value: SGLang's single-batch overlap (keyword-only;
                Hopper and Blackwell spellings). With ``overlap=True`` the combine may be issued
                while the down GEMM still writes ``x``: DeepEP's kernel sends each block of
                ``block_m`` slots once the GEMM has signalled it. Here the combine waits, before it
                reads ``x``, until every needed signal is set: ``comp_signal`` (int32, ``L *
                ceil(R*T / block_m)`` entries, expert-major) ``>= threshold`` for each block holding
                rows below ``packed_recv_count[j]`` (default: the dispatch's counts), and
                ``src_signals`` (one entry per local expert) ``>= src_signal_expect_value`` for
                each expert that received rows. The wait polls the signals from the host (up to
                ``timeout_s``), so results are right and only the overlap is lost. ``num_sms`` is
                accepted and unused; with ``overlap=False`` every one of them is ignored.
        Returns:
            ``(combined_x [N, H]`` bf16, ``event``, ``hook`` or None), where
            ``combined_x[i] = sum_k topk_weights[i, k] * x[expert of k][slot of i]``.
        """
        self._check_handle(handle, "handle", LowLatencyHandle)
        if not handle.receive.done:
            raise ValueError("handle: the dispatch's receive hook has not been called yet")
        num_ranks = self.group_size
        slots = num_ranks * handle.num_max_dispatch_tokens_per_rank
        require_tensor("x", x, dtypes=(torch.bfloat16,), dim=3, device=self._input_device)
        require_shape("x", x, (handle.num_local_experts, slots, handle.hidden))
        placement = self.placement(handle.num_experts)
        on_device = self._on_kernel_path("low_latency_combine", LowLatencyCombineCall(
            handle, x, topk_idx, topk_weights, placement, out, bool(self.masked_ranks)))
        if on_device:
            self._device_status.report()
        topk_idx = check_topk_idx(topk_idx, handle.num_experts, x.device, check_values=not on_device)
        topk_idx, dropped = self._drop_masked(topk_idx, placement)
        if topk_idx.shape != handle.topk_idx.shape:
            raise ValueError(f"topk_idx has shape {tuple(topk_idx.shape)}, the handle dispatched "
                             f"{tuple(handle.topk_idx.shape)}")
        if on_device:  # compared on the device; the kernels follow the dispatched routing
            self._device_status.combine_routing(topk_idx, handle.topk_idx, handle.num_experts)
            topk_idx = handle.topk_idx
        elif not torch.equal(topk_idx, handle.topk_idx):
            raise ValueError("topk_idx differs from the routing the handle dispatched")
        topk_weights = check_topk_weights(topk_weights, topk_idx, x.device)
        if out is not None:
            require_tensor("out", out, dtypes=(torch.bfloat16,), dim=2, device=self._input_device)
            require_shape("out", out, (topk_idx.shape[0], handle.hidden))
        for name, flag in (("use_logfmt", use_logfmt), ("zero_copy", zero_copy)):
            if not isinstance(flag, (bool, int)) or flag not in (0, 1):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        self._check_wait_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats)
        if not isinstance(overlap, (bool, int)) or overlap not in (0, 1):
            raise ValueError(f"overlap must be a bool, got {overlap!r}")
        if overlap:
            if on_device and torch.cuda.is_current_stream_capturing():
                raise ValueError("overlap=True: the combine waits for the expert GEMM's signals from the host, "
                                 "which a CUDA graph cannot hold; capture the combine with overlap=False")
            low_latency.wait_for_expert_signals(handle.recv_count, slots, packed_recv_count, comp_signal, block_m,
                                                threshold, src_signals, src_signal_expect_value, self.timeout_s)
        self._open(CallHeader("low_latency_combine", 0, dtype=x.dtype, hidden=handle.hidden,
                              topk=int(topk_idx.shape[1]), num_experts=handle.num_experts,
                              capacity=handle.num_max_dispatch_tokens_per_rank))
        result = torch.empty(topk_idx.shape[0], handle.hidden, dtype=torch.bfloat16, device=x.device) \
            if out is None else out
        finish, stats = self._run("low_latency_combine", LowLatencyCombineCall(
            handle, x, topk_idx, topk_weights, placement, result, bool(self.masked_ranks)))
        self._record(stats, dropped)
        done = [False]

        def receive() -> None:
            if not done[0]:
                with self._global_rank_names(), self._waited(combine_wait_recv_cost_stats):
                    received = finish()
                if received is not result:
                    result.copy_(received)
                done[0] = True

        hook: Callable[[], None] | None = receive
        if not return_recv_hook:
            receive()
            hook = None
        if on_device:
            self._device_status.publish()
        return result, finish_event(async_finish, self.device), hook
