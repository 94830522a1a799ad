"""CommStats: what the last call put on the wire."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CommStats:
    """Bytes of one call, per peer rank (index = peer rank in the Buffer's group).

    ``raw`` counts the bytes the payload would take uncompressed (the input dtype plus routing
    metadata); ``wire`` counts what was actually sent. Bytes a rank sends to itself are included
    (they are copied locally, not over a link): ``self_bytes_sent_wire`` says how many.

    Attributes:
        op: ``"dispatch"``, ``"combine"``, ``"low_latency_dispatch"``, ``"low_latency_combine"``,
            ``"cached_dispatch"``.
        codec: the codec used (``"none"``, ``"fp8"``, ``"lossless"``).
        bytes_sent_raw / bytes_sent_wire / bytes_recv_raw / bytes_recv_wire: ``[R]`` ints.
        num_collectives: collective calls made by the transport.
        dropped_topk_entries: top-k entries dropped because their expert's rank is masked.
    """

    op: str
    codec: str
    bytes_sent_raw: list[int]
    bytes_sent_wire: list[int]
    bytes_recv_raw: list[int]
    bytes_recv_wire: list[int]
    rank: int = 0
    num_collectives: int = 0
    dropped_topk_entries: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    pending: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    """Fills the per-peer byte lists from counts a kernel path left on the device (None once
    filled); :meth:`settle` runs it, which waits for those counts."""

    def settle(self) -> CommStats:
        """Runs :attr:`pending` once (``Buffer.last_stats`` does it on read)."""
        fill, self.pending = self.pending, None
        if fill is not None:
            fill()
        return self

    @property
    def total_sent_raw(self) -> int:
        return sum(self.bytes_sent_raw)

    @property
    def total_sent_wire(self) -> int:
        return sum(self.bytes_sent_wire)

    @property
    def total_recv_wire(self) -> int:
        return sum(self.bytes_recv_wire)

    @property
    def self_bytes_sent_wire(self) -> int:
        return self.bytes_sent_wire[self.rank] if self.bytes_sent_wire else 0

    def bytes_sent_off_node(self, ranks_per_node: int, wire: bool = True) -> int:
        """Bytes sent to ranks on other nodes (nodes of ``ranks_per_node`` consecutive ranks):
        the traffic that crosses the network. ``wire=False`` counts raw bytes."""
        if not isinstance(ranks_per_node, int) or ranks_per_node <= 0:
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        per_peer = self.bytes_sent_wire if wire else self.bytes_sent_raw
        node = self.rank // ranks_per_node
        return sum(n for peer, n in enumerate(per_peer) if peer // ranks_per_node != node)

    @property
    def compression_ratio(self) -> float:
        """wire / raw over all bytes sent (1.0 when nothing was sent)."""
        raw = self.total_sent_raw
        return self.total_sent_wire / raw if raw else 1.0
