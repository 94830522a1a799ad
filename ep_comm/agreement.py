"""The opening exchange of every call on the portable transport: a fixed-size header from each
rank, checked before any payload size is trusted.

Ranks that call with different arguments (another hidden size, dtype, top-k, expert count,
expert placement or capacity, another mode, a call behind or ahead) would otherwise exchange payloads whose sizes
each computed alone, which aborts gloo's process or delivers wrong bytes. The header is the same
size in every mode, so even ranks in different calls meet in it; every rank then raises the same
``ValueError``, naming the field and the ranks that differ, and the group stays in step. A rank
whose own arguments were rejected sends a failed status instead, so its peers fail with it rather
than time out.
"""
from __future__ import annotations

import enum
import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from .errors import BufferStateError, CommTimeoutError
from .placement import ExpertPlacement
from .transports.base import Transport

VERSION = 4
"""Changes whenever the wire format of any mode changes: ranks of different ep_comm versions fail
in the header instead of misreading each other's payloads."""

MODES = ("dispatch", "cached_dispatch", "combine", "low_latency_dispatch", "low_latency_combine", "rejoining_ranks")
CODECS = ("none", "fp8", "lossless", "auto", "fp8_round", "fp8_ue8m0")
DTYPES = (None, torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn)


class BackwardVote(enum.IntEnum):
    """What a rank's differentiable call (``ep_comm.dispatch`` / ``combine``) says of its backward.

    A call's outputs depend on every rank's inputs, so its backward runs on every rank or on none:
    when any live rank votes ``REQUIRES``, the ``FOLLOWS`` ranks' outputs require grad too and their
    backward runs the collective calls their peers' backward makes. ``OFF`` beside ``REQUIRES`` is
    a disagreement (that rank can never run the backward).
    """

    OFF = 0       # grad mode is off (or not a differentiable call)
    FOLLOWS = 1   # grad mode on, no input requires grad: takes part when a peer's inputs do
    REQUIRES = 2  # an input requires grad


@dataclass
class BackwardCall:
    """One differentiable call's backward vote.

    Attributes:
        vote: this rank's :class:`BackwardVote`.
        agreed: the live ranks' strongest vote, set by the call's opening exchange; None before it
            and on a transport without one, where :attr:`runs` goes by ``vote``.
    """

    vote: BackwardVote
    agreed: BackwardVote | None = None

    @property
    def runs(self) -> bool:
        """Whether the call's backward runs on every rank (its outputs require grad)."""
        return (self.vote if self.agreed is None else self.agreed) == BackwardVote.REQUIRES


@dataclass(frozen=True)
class CallHeader:
    """What every rank must agree on for one call (0 where a field does not apply).

    Attributes:
        mode: one of ``MODES``. seq: the Buffer's call counter (a rank in another call shows here).
        ok: 0 when this rank rejected its own arguments. dtype: payload dtype. hidden: ``H``.
        topk: ``K`` of the routing or the weights carried. num_experts: ``E``. capacity: ``T`` of
        low-latency mode. codec: one of ``CODECS``. weights: whether top-k weights travel.
        placement: :func:`placement_digest` of the Buffer's ``expert_placement``.
        backward: a differentiable call's :class:`BackwardVote` (``OFF`` for every other call).
        handle: a call that reuses a dispatch's handle (combine, cached dispatch): this rank's
            :func:`handle_digests`; else ``(0, 0)``.
    """

    mode: str
    seq: int
    ok: bool = True
    dtype: torch.dtype | None = None
    hidden: int = 0
    topk: int = 0
    num_experts: int = 0
    capacity: int = 0
    codec: str = "none"
    weights: bool = False
    placement: int = 0
    backward: BackwardVote = BackwardVote.OFF
    handle: tuple[int, int] = (0, 0)

    def row(self) -> list[int]:
        return [VERSION, MODES.index(self.mode) + 1, self.seq, int(self.ok), DTYPES.index(self.dtype), self.hidden,
                self.topk, self.num_experts, self.capacity, CODECS.index(self.codec), int(self.weights),
                self.placement, int(self.backward), *self.handle]


_COLUMNS = ("version", "mode", "seq", "ok", "dtype", "hidden", "topk", "num_experts", "capacity", "codec",
            "weights", "placement", "backward")
assert len(_COLUMNS) == len(fields(CallHeader))  # (version added; handle's two digests summed apart)
_HANDLE_MODES = ("combine", "cached_dispatch")
_PRIME = (1 << 61) - 1


@functools.lru_cache(maxsize=64)
def _weights(num_ranks: int, salt: int) -> tuple[int, ...]:
    """Pseudo-random weights in [1, 2^61 - 1), one per rank, the same on every rank (splitmix64)."""
    out = []
    for i in range(num_ranks):
        x = (i * 0x9E3779B97F4A7C15 + salt) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        out.append((x ^ (x >> 31)) % (_PRIME - 1) + 1)
    return tuple(out)


def handle_digests(rank: int, sends: Sequence[int], expects: Sequence[int]) -> tuple[int, int]:
    """Two numbers from a rank's handle whose sums over the ranks agree when every rank sends each
    rank the rows that rank expects: with ``S[r][p]`` the rows ``r`` sends to ``p`` and ``X[p][r]``
    the rows ``p`` expects from ``r``, rank ``r`` gives ``(u_r sum_p v_p S[r][p], v_r sum_q u_q
    X[r][q])`` mod ``2^61 - 1`` (``u``, ``v``: :func:`_weights`), and the two sums over ``r`` are
    ``u^T S v`` and ``u^T X^T v``, equal when ``S = X^T`` and, for other counts, equal with
    probability about ``2^-61``. Two ints a rank, however many ranks."""
    u, v = _weights(len(sends), 1), _weights(len(sends), 2)
    sent = u[rank] * (sum(w * int(c) for w, c in zip(v, sends)) % _PRIME) % _PRIME
    expected = v[rank] * (sum(w * int(c) for w, c in zip(u, expects)) % _PRIME) % _PRIME
    return sent, expected


def placement_digest(placement: ExpertPlacement | None) -> int:
    """0 for the default contiguous placement, else a 56-bit digest of ``expert_to_rank`` (equal
    placements give equal digests on every rank)."""
    if placement is None:
        return 0
    data = placement.expert_to_rank.to(torch.int64).contiguous().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little") or 1


_VOTES_SHOWN = {BackwardVote.OFF: "grad mode off", BackwardVote.FOLLOWS: "no input requires grad",
                BackwardVote.REQUIRES: "inputs require grad"}


def _shown(column: str, value: int) -> str:
    if column == "mode":
        return MODES[value - 1] if 1 <= value <= len(MODES) else f"mode {value}"
    if column == "dtype":
        return str(DTYPES[value]) if 0 <= value < len(DTYPES) else f"dtype {value}"
    if column == "codec":
        return CODECS[value] if 0 <= value < len(CODECS) else f"codec {value}"
    if column == "placement":
        return "the default" if value == 0 else f"expert_placement digest {value:#x}"
    if column == "backward":
        return _VOTES_SHOWN.get(value, f"vote {value}")
    return str(value)


def agree(transport: Transport, header: CallHeader, live: list[int],
          global_ranks: Callable[[], Sequence[int]] | None = None) -> BackwardVote:
    """Exchanges ``header`` with every rank (one small collective) and checks the live ranks'
    headers are equal (their backward votes agree: no ``OFF`` beside ``REQUIRES``).

    Args:
        global_ranks: gives the global rank of each rank of the Buffer's group (called only to
            word an error), named in the messages beside a rank where they differ (a Buffer over
            a subgroup).

    Raises:
        ValueError: a rank rejected its arguments, or the ranks disagree; the message names the
            field and each rank's value (ranks of the Buffer's group).

    Returns:
        the live ranks' strongest :class:`BackwardVote`.
    """
    def to_global(ranks: list[int]) -> list[int]:
        table = global_ranks() if global_ranks is not None else ()
        return [int(table[r]) if r < len(table) else r for r in ranks]

    def named(r: int, g: int) -> str:
        return f"rank {r}" if g == r else f"rank {r} (global rank {g})"

    row = header.row()
    table = torch.tensor([row] * transport.num_ranks, dtype=torch.int64)
    got = transport.exchange_counts(table, f"{header.mode}/header")
    rejected = [r for r in live if int(got[r, _COLUMNS.index("ok")]) == 0 and int(got[r, 0]) != 0]
    if rejected and header.ok:
        gone = to_global(rejected)
        who = f"rank(s) {rejected}" + (f" (global rank(s) {gone})" if gone != rejected else "")
        raise ValueError(f"ep_comm {header.mode}: {who} rejected their arguments to this call "
                         f"(the error on those ranks says why); no rank sent any payload")
    if not header.ok:
        return header.backward  # this rank raises its own argument error
    for i, column in enumerate(_COLUMNS):
        values = {r: int(got[r, i]) for r in live}
        differ = ({BackwardVote.OFF, BackwardVote.REQUIRES} <= set(values.values()) if column == "backward"
                  else len(set(values.values())) > 1)
        if differ:
            shown = ", ".join(f"{named(r, g)}: {_shown(column, v)}" for (r, v), g in zip(values.items(),
                                                                                         to_global(list(values))))
            hint = (" (a rank is in another call)" if column in ("mode", "seq") else
                    " (a rank with grad mode off would skip the calls its peers' backward makes)"
                    if column == "backward" else "")
            raise ValueError(f"ep_comm {header.mode}: the ranks disagree on {column}{hint}: {shown}; "
                             f"no rank sent any payload")
    if header.mode in _HANDLE_MODES:  # the rows each rank sends each other == the rows that rank expects
        at = len(_COLUMNS)
        sent = sum(int(got[r, at]) for r in live) % _PRIME
        expected = sum(int(got[r, at + 1]) for r in live) % _PRIME
        if sent != expected:
            raise ValueError(f"ep_comm {header.mode}: the ranks' handles do not match: the rows they would "
                             f"send each other are not the rows they expect (handles of different dispatches?); "
                             f"no rank sent any payload")
    return BackwardVote(max(int(got[r, _COLUMNS.index("backward")]) for r in live))


def collective(mode: str):
    """Wraps a communicating call: refuses it while the group is out of step; when the call fails
    before its opening exchange (its arguments were rejected), still opens with a failed status so
    the peers fail with it instead of timing out; when it fails after (a timeout, an exchange cut
    short), marks the group out of step until ``reset()`` or ``mask_ranks()``."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if mode == "low_latency_dispatch" and self._mask_request is not None:
                self._apply_mask_request()
            if self._broken is not None:
                raise BufferStateError(f"ep_comm: this Buffer's group is out of step since {self._broken}; "
                                       f"call reset() (or mask_ranks(...) with the failed ranks) on every live rank")
            self._call_mode, self._opened, self._disagreed = mode, False, False
            try:
                return method(self, *args, **kwargs)
            except ValueError:
                if not self._opened:
                    self._open(CallHeader(self._call_mode, 0, ok=False))
                elif not self._disagreed:
                    self._broken = f"a failed {self._call_mode}"
                raise
            except Exception as error:
                if self._opened:
                    self._broken = f"a failed {self._call_mode} ({type(error).__name__})"
                if isinstance(error, CommTimeoutError):
                    self._name_global_ranks(error)
                if isinstance(error, CommTimeoutError) and self.enable_shrink and mode.startswith("low_latency"):
                    # DeepEP's shrink mode masks a peer that timed out; here the call still fails
                    # (its exchange was cut short) and the next low-latency dispatch applies it
                    self._mask_request = self._requested_mask() | (frozenset(error.peers) - {self.rank})
                raise
        return call
    return wrap
