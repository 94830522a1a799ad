"""Exceptions raised by ep_comm."""
from __future__ import annotations

from collections.abc import Sequence


class CommTimeoutError(RuntimeError):
    """A peer stopped answering: raised on the surviving ranks within ``Buffer.timeout_s``.

    Attributes:
        peers: ranks (within the Buffer's group) that did not take part in the collective.
            Empty when the library could not tell which peer was missing.
        global_peers: the same peers as global ranks (of torch.distributed's default group), in
            the same order; the message names them too where they differ from ``peers`` (a
            Buffer over a subgroup). Filled in by the Buffer the error leaves; empty before.
        phase: the step that was waiting (for example ``"dispatch/counts"``).
    """

    def __init__(self, message: str, peers: list[int] | None = None, phase: str = "") -> None:
        super().__init__(message)
        self.peers = list(peers or [])
        self.global_peers: list[int] = []
        self.phase = phase

    def name_global_ranks(self, global_ranks: Sequence[int]) -> None:
        """Sets ``global_peers`` from ``global_ranks`` (the global rank of each rank of the
        Buffer's group) and, where they differ from ``peers``, adds them to the message. Once."""
        if self.global_peers or not self.peers or any(not 0 <= p < len(global_ranks) for p in self.peers):
            return
        self.global_peers = [int(global_ranks[p]) for p in self.peers]
        if self.global_peers != self.peers and self.args:
            self.args = (f"{self.args[0]} [global rank(s) {self.global_peers}]", *self.args[1:])


class BufferStateError(RuntimeError):
    """The Buffer's group is out of step after a failed call (a timeout, or an exchange that
    stopped half-way): every further call raises this until ``Buffer.reset()`` or
    ``Buffer.mask_ranks(...)`` re-forms the group."""


class StoreLostError(CommTimeoutError):
    """The job's key-value store stopped answering (its host process died: with the usual
    ``tcp://`` / ``env://`` rendezvous outside torchrun, global rank 0's). Without it no peer can
    be named (``peers`` is empty), masked or re-formed; the message says which launches survive
    that (a store hosted outside the workers, passed to ``init_process_group`` or ``Buffer``)."""
