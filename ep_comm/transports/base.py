"""The transport interface every backend implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


class PendingExchange:
    """An exchange in flight; ``wait()`` returns the received bytes (1-D uint8)."""

    def __init__(self, wait: Callable[[], torch.Tensor]) -> None:
        self._wait = wait
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._wait()
        return self._result


class Transport(ABC):
    """Moves bytes between the ranks of one group.

    Attributes:
        rank: this rank's index in the group. num_ranks: ``R``. device: where payloads live.
        num_collectives: collectives issued so far (for ``CommStats``).
    """

    name: str = "abstract"

    def __init__(self, rank: int, num_ranks: int, device: torch.device) -> None:
        self.rank = rank
        self.num_ranks = num_ranks
        self.device = device
        self.num_collectives = 0

    @abstractmethod
    def exchange_bytes(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                       phase: str, out: torch.Tensor | None = None) -> PendingExchange:
        """Starts an all-to-all of bytes.

        Args:
            send: ``[sum(send_splits)]`` uint8, the chunk for rank ``r`` at
                ``[sum(send_splits[:r]), sum(send_splits[:r+1]))``.
            send_splits / recv_splits: ``R`` byte counts each way (the receiver must know its
                counts, e.g. from ``exchange_counts``).
            phase: a name for error messages (``"dispatch/payload"``).
            out: optional ``[sum(recv_splits)]`` uint8 contiguous tensor to receive into (a
                reused buffer); a transport may receive elsewhere instead (e.g. when it stages
                through host memory), so callers read what ``wait()`` returns.
        Returns:
            a pending exchange whose ``wait()`` gives ``[sum(recv_splits)]`` uint8 ordered by
            source rank.
        """

    @abstractmethod
    def exchange_counts(self, counts: torch.Tensor, phase: str) -> torch.Tensor:
        """Transposes a ``[R, C]`` int64 table: row ``r`` goes to rank ``r``; returns the
        ``[R, C]`` int64 rows received from every rank (on the CPU)."""

    def barrier(self, phase: str = "barrier") -> None:
        """Waits until every rank arrives (an exchange of nothing)."""
        self.exchange_counts(torch.zeros(self.num_ranks, 1, dtype=torch.int64), phase)
