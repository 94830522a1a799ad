"""A transport that keeps the full ``R``-rank view while only the live ranks communicate.

After ``Buffer.mask_ranks``, the survivors exchange over a subgroup of themselves. This wrapper
lets the unchanged dispatch/combine algorithms keep indexing ranks ``0..R-1``: chunks for masked
ranks are dropped on send (the routing sends them nothing but fixed-size blocks), and chunks from
masked ranks arrive as zeros (an empty low-latency block, a zero count).
"""
from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError
from .base import PendingExchange, Transport
from .job_store import store_alive, store_lost


class MaskedTransport(Transport):
    """``inner`` connects the live ranks ``live[0..L-1]`` (ascending original ranks)."""

    def __init__(self, inner: Transport, live: list[int], num_ranks: int, rank: int) -> None:
        super().__init__(rank, num_ranks, inner.device)
        self.inner = inner
        self.live = list(live)
        self.name = inner.name
        self.backend_name = getattr(inner, "backend_name", inner.name)

    @contextlib.contextmanager
    def _global_peers(self):
        """Renames the peers of a ``CommTimeoutError`` from the live group's ranks (what the inner
        transport knows) to the full group's ranks (what ``Buffer.mask_ranks`` takes)."""
        try:
            yield
        except CommTimeoutError as error:
            peers = [self.live[p] for p in error.peers if 0 <= p < len(self.live)]
            raise type(error)(f"{error} [live-group ranks {error.peers} are Buffer ranks {peers}]",
                              peers=peers, phase=error.phase) from error

    @property
    def num_collectives(self) -> int:  # type: ignore[override]
        return self.inner.num_collectives

    @num_collectives.setter
    def num_collectives(self, value: int) -> None:
        if hasattr(self, "inner"):
            self.inner.num_collectives = value

    def exchange_bytes(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                       phase: str, out: torch.Tensor | None = None) -> PendingExchange:  # out: unused
        offsets = [0]
        for n in send_splits:
            offsets.append(offsets[-1] + n)
        pieces = [send[offsets[r]:offsets[r + 1]] for r in self.live]
        live_send = torch.cat(pieces) if pieces else send[:0]
        live_recv_splits = [recv_splits[r] for r in self.live]
        with self._global_peers():
            pending = self.inner.exchange_bytes(live_send, [send_splits[r] for r in self.live],
                                                live_recv_splits, phase)

        def expand() -> torch.Tensor:
            with self._global_peers():
                got = pending.wait()
            full = torch.zeros(sum(recv_splits), dtype=torch.uint8, device=got.device)
            recv_offsets = [0]
            for n in recv_splits:
                recv_offsets.append(recv_offsets[-1] + n)
            start = 0
            for r, n in zip(self.live, live_recv_splits):
                full[recv_offsets[r]:recv_offsets[r] + n] = got[start:start + n]
                start += n
            return full

        return PendingExchange(expand)

    def exchange_counts(self, counts: torch.Tensor, phase: str) -> torch.Tensor:
        with self._global_peers():
            got = self.inner.exchange_counts(counts[self.live], phase)
        full = torch.zeros_like(counts, device="cpu")
        full[self.live] = got
        return full


def form_live_transport(store: dist.Store, group: dist.ProcessGroup | None, live: list[int], rank: int,
                        num_ranks: int, timeout_s: float, device: torch.device, name: str) -> MaskedTransport:
    """A ``MaskedTransport`` over a new group of the ``live`` ranks (collective over them).

    ``name`` must be the same on every live rank and new for each formation. On gloo (``group``
    None or a gloo group) the group is made straight from ``store`` under the prefix ``name``, so
    a rank that stalled and came back (and so made fewer groups than the survivors) and a
    restarted process that has no process group with the survivors (``group`` None) still meet
    them; other backends make a subgroup of ``group`` with ``dist.new_group``.

    Raises:
        StoreLostError: ``store`` stopped answering. CommTimeoutError: the group could not be
            formed within ``timeout_s``.
    """
    from .torch_dist import TorchDistTransport

    try:
        if group is None or str(dist.get_backend(group)) == "gloo":
            inner = TorchDistTransport.with_gloo_backend(dist.PrefixStore(name, store), live.index(rank), len(live),
                                                         timeout_s, name)
            inner.store = store
        else:
            subgroup = dist.new_group(ranks=[dist.get_global_rank(group, r) for r in live],
                                      timeout=timedelta(seconds=timeout_s), backend=str(dist.get_backend(group)),
                                      use_local_synchronization=True)
            inner = TorchDistTransport(subgroup, timeout_s, device, name)
            inner.store = store
    except (RuntimeError, dist.DistError) as error:
        if not store_alive(store):
            raise store_lost("mask_ranks", error) from error
        raise CommTimeoutError(f"ep_comm: rank {rank} could not form a group of ranks {live} "
                               f"within timeout_s={timeout_s:g}: {error}", peers=[], phase="mask_ranks") from error
    return MaskedTransport(inner, live, num_ranks, rank)
