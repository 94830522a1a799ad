"""Exceptions raised by ep_comm."""
from __future__ import annotations


class CommTimeoutError(RuntimeError):
    """A peer stopped answering: raised on the surviving ranks within ``Buffer.timeout_s``.

    Attributes:
        peers: ranks (within the Buffer's group) that did not take part in the collective.
            Empty when the library could not tell which peer was missing.
        phase: the step that was waiting (for example ``"dispatch/counts"``).
    """

    def __init__(self, message: str, peers: list[int] | None = None, phase: str = "") -> None:
        super().__init__(message)
        self.peers = list(peers or [])
        self.phase = phase


class BufferStateError(RuntimeError):
    """The Buffer's group is out of step after a failed call (a timeout, or an exchange that
    stopped half-way): every further call raises this until ``Buffer.reset()`` or
    ``Buffer.mask_ranks(...)`` re-forms the group."""


class StoreLostError(CommTimeoutError):
    """The job's key-value store stopped answering (its host process died: with the usual
    ``tcp://`` / ``env://`` rendezvous outside torchrun, global rank 0's). Without it no peer can
    be named (``peers`` is empty), masked or re-formed; the message says which launches survive
    that (a store hosted outside the workers, passed to ``init_process_group`` or ``Buffer``)."""
