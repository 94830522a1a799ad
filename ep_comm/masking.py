"""Failed ranks: the Buffer's masking of dead or stalled ranks (``mask_ranks`` / ``unmask_ranks``),
``reset()`` after a call left the group out of step, a restarted process rejoining
(``Buffer.rejoin`` / ``rejoining_ranks``), and DeepEP's shrink-mode calls on top of them.

A mixin of :class:`ep_comm.Buffer` (its state: ``group``, ``rank``, ``group_size``, ``transport``,
``masked_ranks``, ``mask_epoch``, ``path_plan``, ``_store``): one job, kept out of ``buffer.py``.
Every change of the live set re-forms one group of the live ranks through the job's store
(``form_live_transport``); a rejoin is such a change whose newcomer learns the group's name from
the survivors' invite (``ep_comm.transports.job_store``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from . import low_latency
from .agreement import CallHeader, collective
from .codecs.auto import AutoCodecPolicy
from .errors import CommTimeoutError, StoreLostError
from .layout import drop_entries_of_ranks
from .placement import ExpertPlacement
from .rows import ScratchPool
from .transports import job_store
from .transports.masked import MaskedTransport, form_live_transport
from .validation import DeviceStatus, check_nonneg_int, check_rank_list, require_shape, require_tensor

REJOIN_DESCRIPTION_VERSION = 1


class RankMasking:
    """Masking, reset, rejoin and DeepEP's shrink mode of a Buffer (see the module docstring)."""

    _rejoined_id: str | None = None  # a rejoined Buffer's name in the store (others: their transport's)
    _rejoined_global_ranks: tuple[int, ...] = ()  # a rejoined Buffer's global ranks (it has no group)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of this Buffer's local scratch bytes as ``dtype`` (DeepEP's raw-buffer access).

        DeepEP returns a view of its registered NVLink (``use_rdma_buffer=False``) or RDMA buffer;
        here each is a Buffer-owned byte tensor of ``num_nvl_bytes`` / ``num_rdma_bytes`` on the
        Buffer's device, allocated (zeroed) on first use and the same memory on every later call.
        It is *not* registered communication memory: peers cannot read it, and ep_comm's calls
        neither read nor write it. ``offset`` is in bytes (as DeepEP's runtime takes it) and must be
        a multiple of ``dtype``'s size; without ``size`` the view runs to the end of the buffer,
        with ``size`` it holds ``size.numel()`` elements shaped as ``size``.
        """
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        check_nonneg_int("offset", offset)
        num_bytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        name = "num_rdma_bytes" if use_rdma_buffer else "num_nvl_bytes"
        if num_bytes == 0:
            raise ValueError(f"use_rdma_buffer={bool(use_rdma_buffer)}: this Buffer was built with {name}=0")
        item = torch.empty((), dtype=dtype).element_size()
        if offset % item or offset > num_bytes:
            raise ValueError(f"offset ({offset}) must be a multiple of {item} bytes ({dtype}) within {name} "
                             f"({num_bytes})")
        raw = self._local_buffers.get(bool(use_rdma_buffer))
        if raw is None:
            raw = torch.zeros(num_bytes, dtype=torch.uint8, device=self.device)
            self._local_buffers[bool(use_rdma_buffer)] = raw
        view = raw[offset:offset + (num_bytes - offset) // item * item].view(dtype)
        if size is None:
            return view
        numel = torch.Size(size).numel()
        if numel > view.numel():
            raise ValueError(f"size {tuple(size)} needs {numel} elements; {name} holds {view.numel()} "
                             f"from offset {offset}")
        return view[:numel].view(size)

    # -- DeepEP's shrink mode (low-latency mask buffer) ----------------------------------------
    def _requested_mask(self) -> frozenset[int]:
        return self.masked_ranks if self._mask_request is None else self._mask_request

    def _check_shrink(self) -> None:
        if not self.enable_shrink:
            raise ValueError("the low-latency mask buffer needs Buffer(..., enable_shrink=True) "
                             "(or call mask_ranks / unmask_ranks)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (``mask=True``) or unmasks a rank for the low-latency calls (DeepEP's shrink mode).

        DeepEP writes its local mask buffer, which its kernels read. ep_comm's masking is
        collective (``mask_ranks``), so this only records the change locally (as
        :meth:`low_latency_query_mask_buffer` shows at once); the next ``low_latency_dispatch``
        applies the recorded mask with ``mask_ranks`` / ``unmask_ranks`` semantics before it
        exchanges anything. Every live rank must therefore record the same changes before that
        dispatch (as elastic-EP callers do: they mask the same failed rank on every survivor), and a
        rank that comes back joins with ``unmask_ranks([])`` while the others apply its unmask.
        A combine runs under its dispatch's mask: a change recorded between them waits for the next
        dispatch. Once applied the mask holds for every mode of this Buffer, as ``mask_ranks``'.
        """
        self._check_shrink()
        check_nonneg_int("rank_to_mask", rank_to_mask)
        if rank_to_mask >= self.group_size:
            raise ValueError(f"rank_to_mask must be in [0, {self.group_size}), got {rank_to_mask}")
        if not isinstance(mask, (bool, int)) or mask not in (0, 1):
            raise ValueError(f"mask must be a bool, got {mask!r}")
        if mask and rank_to_mask == self.rank:
            raise ValueError(f"rank_to_mask is this rank ({rank_to_mask}): a rank cannot mask itself")
        current = self._requested_mask()
        wanted = current | {rank_to_mask} if mask else current - {rank_to_mask}
        self._mask_request = None if wanted == self.masked_ranks else frozenset(wanted)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes each rank's mask into ``mask_status`` (``[R]`` int32, any device): 1 masked, 0
        not: the mask the next low-latency dispatch runs with (applied, or recorded by
        :meth:`low_latency_update_mask_buffer` / a low-latency timeout and not yet applied)."""
        self._check_shrink()
        require_tensor("mask_status", mask_status, dtypes=(torch.int32,), dim=1)
        require_shape("mask_status", mask_status, (self.group_size,))
        status = torch.zeros(self.group_size, dtype=torch.int32)
        status[sorted(self._requested_mask())] = 1
        mask_status.copy_(status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank (recorded locally, applied at the next low-latency dispatch, as
        :meth:`low_latency_update_mask_buffer` does)."""
        self._check_shrink()
        self._mask_request = frozenset() if self.masked_ranks else None

    def _apply_mask_request(self) -> None:
        """Applies the recorded mask (collective over the ranks live under it)."""
        request = self._mask_request
        assert request is not None
        self._set_masked(request)  # on failure the request stays recorded

    # -- failed-rank masking -------------------------------------------------------------------
    def mask_ranks(self, ranks: list[int]) -> None:
        """Stops exchanging with ``ranks`` (e.g. the peers a ``CommTimeoutError`` named).

        Collective over the surviving ranks, which must all call it with the same list. From then
        on, top-k entries that select an expert of a masked rank are dropped (treated as ``-1``,
        counted in ``last_stats.dropped_topk_entries``), and the survivors' exchanges run over a
        new group of themselves, formed through the job's key-value store (``Buffer(store=...)``,
        else the default process group's). That store must still be alive: one hosted outside the
        workers outlives any rank, rank 0's included; with the usual ``tcp://``/``env://``
        rendezvous outside torchrun it lives in global rank 0's process, and after rank 0's death
        every call raises ``StoreLostError`` (a ``CommTimeoutError``) saying so.
        """
        self._set_masked(self.masked_ranks | check_rank_list("ranks", ranks, self.group_size, self.rank))

    def unmask_ranks(self, ranks: list[int]) -> None:
        """Brings ``ranks`` back into the exchanges; collective over the new set of live ranks.

        The survivors pass the ranks that return. A rank that stalled and came back (the same
        process, whose own Buffer masked nothing) passes ``[]``; a restarted process (a new one of
        the same global rank) calls :meth:`rejoin` instead, which waits for this call. Everyone
        then exchanges over a new group of the live ranks, and the returning ranks' experts are
        served again. Waits up to ``timeout_s`` for the returning ranks.
        """
        self._set_masked(self.masked_ranks - check_rank_list("ranks", ranks, self.group_size, self.rank))

    def reset(self) -> None:
        """Re-forms the group of the live ranks after a failed call (a ``CommTimeoutError``, an
        exchange cut short) left it out of step; until then every call raises
        ``BufferStateError``. Collective over the live ranks; ``mask_ranks`` does the same while
        taking ranks out. Handles made before it are rejected; normal mode then runs flat."""
        self._set_masked(self.masked_ranks)

    def _set_masked(self, masked: frozenset[int]) -> None:
        live = [r for r in range(self.group_size) if r not in masked]
        if len(live) < 1:
            raise ValueError("ranks would mask every rank")
        # name the new group after this Buffer, the live set and how often that set was formed, so
        # every member derives the same name without relying on torch's group counter
        formed = self._formations.get(tuple(live), 0)
        name = f"ep_comm/{self._fault_id()}/live/{'_'.join(map(str, live))}/{formed}"
        formations = {**self._formations, tuple(live): formed + 1}
        returning = sorted(self.masked_ranks - masked)
        staying = [r for r in live if r not in returning]
        # the lowest staying rank invites the returning ranks' restarted processes (if any wait in
        # rejoin); a newcomer can only meet a group made straight from the store (gloo)
        inviter = bool(returning) and self.rank == staying[0] and self._forms_from_store()
        global_ranks = self._global_ranks()
        if inviter:
            for r in returning:
                job_store.invite(self._store, global_ranks[r],
                                 self._rejoin_description(r, name, live, masked, formations))
        try:
            transport = form_live_transport(self._store, self.group, live, self.rank, self.group_size,
                                            self.timeout_s, self.device, name)
        finally:
            if inviter:
                for r in returning:
                    job_store.withdraw(self._store, global_ranks[r])
        transport.inner.num_collectives = self.transport.num_collectives
        self._adopt(transport, masked, formations)

    def _adopt(self, transport: MaskedTransport, masked: frozenset[int],
               formations: dict[tuple[int, ...], int]) -> None:
        """Runs the Buffer's calls over ``transport`` (the group of the ranks not in ``masked``)."""
        self._formations = formations
        self.transport = transport
        self.masked_ranks = masked
        if self._mask_request == masked:
            self._mask_request = None
        self.mask_epoch += 1
        self._broken, self._seq = None, 0
        for path in self.path_plan.paths:
            path.ranks_changed(self.transport)

    def _fault_id(self) -> str:
        """This Buffer's name in the job's store, the same on every rank."""
        if self._rejoined_id is not None:
            return self._rejoined_id
        return str(getattr(self._unmasked_transport, "instance_id", self.buffer_id))

    def _global_ranks(self) -> tuple[int, ...]:
        """The global rank of each of the Buffer's ranks (``[R]``)."""
        if self.group is None:
            return self._rejoined_global_ranks
        return tuple(dist.get_global_rank(self.group, r) for r in range(self.group_size))

    def _name_global_ranks(self, error: CommTimeoutError) -> None:
        """Adds the global ranks of ``error``'s peers (``CommTimeoutError.name_global_ranks``);
        where they cannot be looked up (the group was destroyed) the timeout is raised as it is."""
        with contextlib.suppress(ValueError, RuntimeError):
            error.name_global_ranks(self._global_ranks())

    def _forms_from_store(self) -> bool:
        return self.group is None or str(dist.get_backend(self.group)) == "gloo"

    # -- a restarted process rejoining -----------------------------------------------------------
    @collective("rejoining_ranks")
    def rejoining_ranks(self) -> list[int]:
        """The masked ranks whose restarted process waits in :meth:`rejoin` (sorted; the same list
        on every live rank). Collective over the live ranks, one small exchange: call it where
        every live rank is (e.g. between steps) and pass a non-empty answer to
        :meth:`unmask_ranks` on every live rank.

        Raises:
            StoreLostError: the job's store is gone.
        """
        self._open(CallHeader("rejoining_ranks", 0))
        self._header_collectives = 0  # nothing records stats for this call
        live = [r for r in range(self.group_size) if r not in self.masked_ranks]
        row = torch.zeros(self.group_size, dtype=torch.int64)
        if self.rank == live[0] and self.masked_ranks:
            global_ranks = self._global_ranks()
            try:
                back = set(job_store.waiting(self._store, [global_ranks[r] for r in sorted(self.masked_ranks)]))
            except StoreLostError:
                row[:] = -1  # the peers raise it too instead of waiting
            else:
                row[[r for r in sorted(self.masked_ranks) if global_ranks[r] in back]] = 1
        got = self.transport.exchange_counts(row.expand(self.group_size, -1).contiguous(), "rejoining_ranks")
        answer = got[live[0]]
        if bool((answer < 0).any()):
            raise job_store.store_lost("rejoining_ranks")
        return [r for r in range(self.group_size) if int(answer[r]) == 1]

    def _rejoin_description(self, rank: int, name: str, live: list[int], masked: frozenset[int],
                            formations: dict[tuple[int, ...], int]) -> dict:
        """What the restarted process of Buffer rank ``rank`` needs to build this Buffer's twin."""
        placement = None if self._placement is None else self._placement.expert_to_rank.tolist()
        return dict(
            version=REJOIN_DESCRIPTION_VERSION, id=self._fault_id(), name=name, rank=rank, live=live,
            masked=sorted(masked), formations=[[list(k), v] for k, v in formations.items()],
            mask_epoch=self.mask_epoch + 1, global_ranks=list(self._global_ranks()), timeout_s=self.timeout_s,
            placement=placement, ranks_per_node=self.ranks_per_node, low_latency_mode=self.low_latency_mode,
            enable_shrink=self.enable_shrink, num_nvl_bytes=self.num_nvl_bytes, num_rdma_bytes=self.num_rdma_bytes,
            num_qps_per_rank=self.num_qps_per_rank,
            allow_nvlink_for_low_latency_mode=self.allow_nvlink_for_low_latency_mode,
            allow_mnnvl=self.allow_mnnvl, use_fabric=self.use_fabric, explicitly_destroy=self.explicitly_destroy,
            num_collectives=self.transport.num_collectives)

    @classmethod
    def rejoin(cls, store: dist.Store, rank: int, *, wait_s: float = 600.0):
        """A restarted process's way back into a live Buffer: returns its twin of the survivors'
        Buffer, which serves this rank's experts again.

        The process that replaces a dead rank (a new pid, the same global ``rank``) has no process
        group with the survivors, only the job's store: pass a client of the store the survivors'
        Buffer uses (the one given as ``Buffer(store=...)``; else the store the job was launched
        with: the ``store=`` given to ``init_process_group``, or a client of the same server such as
        ``TCPStore(MASTER_ADDR, MASTER_PORT, is_master=False)``). The call announces the rank in the store and
        waits up to ``wait_s`` seconds until the survivors, seeing it in
        :meth:`rejoining_ranks`, call ``unmask_ranks([...])`` with it; both then form a group of
        the live ranks and the next call on every live rank runs over it. The returned Buffer
        takes the survivors' construction arguments (placement, ``timeout_s``, modes), runs flat
        over gloo on the CPU, has ``group`` None, and masks what the survivors mask. A process
        with several Buffers rejoins them in the order the survivors unmask them. Needs a Buffer
        over a gloo group (the group is made from the store; other backends need a process group
        the newcomer cannot have).

        Raises:
            ValueError: bad arguments. CommTimeoutError: no survivor invited ``rank`` within
                ``wait_s``, or the group could not be formed. StoreLostError: the store is gone.
        """
        if not isinstance(store, dist.Store):
            raise ValueError(f"store must be a torch.distributed.Store, got {type(store).__name__}")
        check_nonneg_int("rank", rank)
        if not isinstance(wait_s, (int, float)) or isinstance(wait_s, bool) or not wait_s > 0:
            raise ValueError(f"wait_s must be a positive number of seconds, got {wait_s!r}")
        desc = job_store.accept(store, rank, float(wait_s))
        if desc.get("version") != REJOIN_DESCRIPTION_VERSION:
            raise ValueError(f"rejoin: the survivors describe their Buffer in format {desc.get('version')!r}, "
                             f"this ep_comm reads {REJOIN_DESCRIPTION_VERSION} (mixed ep_comm versions)")
        self = cls.__new__(cls)
        self._init_rejoined(store, desc)
        transport = form_live_transport(store, None, desc["live"], self.rank, self.group_size, self.timeout_s,
                                        self.device, desc["name"])
        transport.inner.num_collectives = int(desc["num_collectives"])
        self.transport = transport
        self.path_plan = self._make_paths(None)  # the flat path; masked Buffers run flat
        self._adopt(transport, frozenset(desc["masked"]),
                    {tuple(k): int(v) for k, v in desc["formations"]})
        return self

    def _init_rejoined(self, store: dist.Store, desc: dict) -> None:
        """The attributes ``Buffer.__init__`` sets, from the survivors' description (no group).
        Mirrors ``Buffer.__init__``: tests/test_rank0_and_rejoin.py checks no attribute is missing."""
        self.group = None
        for key in ("ranks_per_node", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                    "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
                    "enable_shrink"):
            setattr(self, key, desc[key])
        self._mask_request = None
        self._local_buffers = {}
        self.timeout_s = float(desc["timeout_s"])
        self.intranode_copy = "ring"  # masked and rejoined Buffers run flat: no fused kernels
        self.rank = int(desc["rank"])
        self.group_size = len(desc["global_ranks"])
        self._take_buffer_id()
        self.device = torch.device("cpu")
        self._input_device = None  # gloo stages through host memory
        self._placement = (None if desc["placement"] is None else
                           ExpertPlacement.from_expert_to_rank(torch.tensor(desc["placement"]), self.group_size))
        self._store = store
        self._rejoined_id = str(desc["id"])
        self._rejoined_global_ranks = tuple(int(g) for g in desc["global_ranks"])
        self.transport = None  # the group of the live ranks, formed next
        self.transport_reason = "rejoined the survivors' Buffer through the job's store (gloo)"
        self.backend = "torch"
        self._scratch = ScratchPool()
        self.last_stats = None
        self.masked_ranks = frozenset()
        self.mask_epoch = int(desc["mask_epoch"]) - 1  # _adopt counts the rejoin's formation
        self._formations = {}
        self._ll_receive_areas = low_latency.ReceiveAreas()
        self.auto_codec = AutoCodecPolicy()
        self._unmasked_transport = None
        self._device_status = DeviceStatus()

    def _drop_masked(self, topk_idx: torch.Tensor, placement: ExpertPlacement) -> tuple[torch.Tensor, int]:
        return drop_entries_of_ranks(topk_idx, placement, self.masked_ranks)

