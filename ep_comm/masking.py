"""Failed ranks: the Buffer's masking of dead or stalled ranks (``mask_ranks`` / ``unmask_ranks``),
``reset()`` after a call left the group out of step, and DeepEP's shrink-mode calls on top of them.

A mixin of :class:`ep_comm.Buffer` (its state: ``group``, ``rank``, ``group_size``, ``transport``,
``masked_ranks``, ``mask_epoch``, ``path_plan``): one job, kept out of ``buffer.py``.
"""
from __future__ import annotations

import torch

from .layout import drop_entries_of_ranks
from .placement import ExpertPlacement
from .transports.masked import form_live_transport
from .validation import check_nonneg_int, check_rank_list, require_shape, require_tensor


class RankMasking:
    """Masking, reset and DeepEP's shrink mode of a Buffer (see the module docstring)."""

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
        new group of themselves. The job's key-value store (hosted by global rank 0 with the
        usual ``tcp://``/``env://`` rendezvous) must still be alive.
        """
        self._set_masked(self.masked_ranks | check_rank_list("ranks", ranks, self.group_size, self.rank))

    def unmask_ranks(self, ranks: list[int]) -> None:
        """Brings ``ranks`` back into the exchanges; collective over the new set of live ranks.

        The survivors pass the ranks that return; a returning rank (whose own Buffer masked
        nothing) passes ``[]``. Everyone then exchanges over a new group of the live ranks.
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
        base = getattr(self._unmasked_transport, "instance_id", self.buffer_id)
        name = f"ep_comm/{base}/live/{'_'.join(map(str, live))}/{formed}"
        transport = form_live_transport(self.group, live, self.rank, self.timeout_s, self.device, name)
        self._formations[tuple(live)] = formed + 1
        transport.inner.num_collectives = self.transport.num_collectives
        self.transport = transport
        self.masked_ranks = masked
        if self._mask_request == masked:
            self._mask_request = None
        self.mask_epoch += 1
        self._broken, self._seq = None, 0
        for path in self.path_plan.paths:
            path.ranks_changed(self.transport)

    def _drop_masked(self, topk_idx: torch.Tensor, placement: ExpertPlacement) -> tuple[torch.Tensor, int]:
        return drop_entries_of_ranks(topk_idx, placement, self.masked_ranks)

