"""The all-to-all of a gloo group whose payloads live on a GPU (a mixed-vendor job): staged through
pinned host memory in chunks, with the copies overlapped with the wire.

gloo moves host memory only. Copying a whole message to the host, sending it, then copying the
received bytes back would serialise three transfers; here every message is cut into chunks of at
most ``chunk_bytes`` and the three run as a pipeline:

- all device->host copies are queued at once on a side copy stream, one event per chunk; the CPU
  waits for chunk ``i``'s event and posts its send while the copy engine is still copying chunk
  ``i + 1`` (the copy of chunk ``i + 1`` overlaps chunk ``i`` on the wire);
- every receive is posted before any send (so no rank's send waits for a receive its peer has not
  posted), and as chunk ``i`` arrives its host->device copy is queued while chunk ``i + 1`` is
  still on the wire.

The chunks of a message are point-to-point sends between its two ranks, numbered by their
position in the message (the tag), so sender and receiver cut it the same way from the byte count
they both know (the sender's ``send_splits[peer]`` is the receiver's ``recv_splits[source]``). An
empty message sends nothing; a rank's message to itself is one device copy. Peers are visited in
ring order from ``rank + 1``, so the ranks do not all send to rank 0 first.

Host buffers come from a :class:`PinnedPool` (page-locked on a GPU, so the copies are true DMA
and can run asynchronously; plain memory on the CPU, where the same steps are ordinary copies and
the pipeline is what the CPU tests check for exactness). CPU payloads do not come here: the plain
gloo exchange sends them as they are.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

DEFAULT_CHUNK_BYTES = 4 << 20
"""Chunk size of the pipeline: large enough that gloo's per-message cost is small beside the
transfer, small enough that the first send starts after a fraction of the copy."""

Post = Callable[[torch.Tensor, int, int], object]
"""``post(host_bytes, peer, tag) -> work``: an asynchronous send or receive with ``wait()``."""


@dataclass(frozen=True)
class Chunk:
    """One chunk of one message: bytes ``[offset, offset + length)`` of the buffer, exchanged with
    ``peer`` under ``tag`` (its index within the message)."""

    peer: int
    offset: int
    length: int
    tag: int


def plan_chunks(splits: list[int], rank: int, chunk_bytes: int) -> list[Chunk]:
    """The chunks of every message to or from another rank, in the order they are posted: peers
    in ring order from ``rank + 1``, each message front to back. ``splits[r]`` is the byte count
    exchanged with rank ``r``; the message to or from ``rank`` itself is left out."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    starts = [0]
    for n in splits:
        starts.append(starts[-1] + n)
    num_ranks = len(splits)
    out = []
    for step in range(1, num_ranks):
        peer = (rank + step) % num_ranks
        for tag, at in enumerate(range(0, splits[peer], chunk_bytes)):
            out.append(Chunk(peer, starts[peer] + at, min(chunk_bytes, splits[peer] - at), tag))
    return out


class PinnedPool:
    """Host byte buffers reused across exchanges (page-locked when the payloads are on a GPU). An
    exchange takes its buffers and gives them back when it completes, so exchanges in flight
    together never share one; at most ``keep`` idle buffers are kept."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._idle: list[torch.Tensor] = []

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A host uint8 tensor of at least ``nbytes`` bytes (its contents are undefined)."""
        fits = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes and b.is_pinned() == pinned]
        if fits:
            return self._idle.pop(min(fits, key=lambda i: self._idle[i].numel()))
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)

    def give(self, buffer: torch.Tensor) -> None:
        """Returns a buffer from :meth:`take` (the largest ``keep`` idle ones are kept)."""
        self._idle = sorted([*self._idle, buffer], key=torch.Tensor.numel)[-self.keep:]


class _Copies:
    """Copies between the payload's device and host memory: asynchronous on a side CUDA stream
    (ordered after the work already queued on the current stream) with an event per copy, or
    plain copies elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(torch.cuda.current_stream(device))
            self.device = device

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        """Queues ``dst.copy_(src)``; returns something whose ``synchronize()`` waits for it."""
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def finish(self) -> None:
        """The current stream waits for every queued copy, and the host buffers are free again."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.stream.synchronize()


def staged_all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], rank: int,
                      post_send: Post, post_recv: Post, wait: Callable[[object], None],
                      pool: PinnedPool, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Callable[[], torch.Tensor]:
    """Starts a chunked all-to-all of ``send`` through host memory; returns the function that
    completes it.

    Args:
        send: ``[sum(send_splits)]`` uint8 on any device; the chunk for rank ``r`` at
            ``[sum(send_splits[:r]), sum(send_splits[:r+1]))``.
        send_splits / recv_splits: bytes to / from each rank (``recv_splits[r]`` equals rank
            ``r``'s ``send_splits[rank]``).
        post_send / post_recv: point-to-point calls of the group (:data:`Post`).
        wait: waits for one posted call (bounded by the transport's timeout).
        pool: where the host buffers come from; chunk_bytes: the pipeline's chunk size.
    Returns:
        ``finish()``: waits for every chunk and gives ``[sum(recv_splits)]`` uint8 on
        ``send``'s device, ordered by source rank.
    """
    if send_splits[rank] != recv_splits[rank]:
        raise ValueError(f"rank {rank} sends itself {send_splits[rank]} bytes but expects {recv_splits[rank]}")
    device = send.device
    pinned = device.type == "cuda"
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
    recv_buffer, send_buffer = pool.take(recv.numel(), pinned), pool.take(send.numel(), pinned)
    recv_host, send_host = recv_buffer[:recv.numel()], send_buffer[:send.numel()]
    incoming = plan_chunks(recv_splits, rank, chunk_bytes)
    outgoing = plan_chunks(send_splits, rank, chunk_bytes)
    # every receive is posted before any send
    receives = [post_recv(recv_host[c.offset:c.offset + c.length], c.peer, c.tag) for c in incoming]
    copies = _Copies(device)
    staged = [copies.copy(send_host[c.offset:c.offset + c.length], send[c.offset:c.offset + c.length])
              for c in outgoing]
    sends = []
    for chunk, copied in zip(outgoing, staged):
        if copied is not None:
            copied.synchronize()  # this chunk is on the host; the next ones are still copying
        sends.append(post_send(send_host[chunk.offset:chunk.offset + chunk.length], chunk.peer, chunk.tag))
    own_send, own_recv = sum(send_splits[:rank]), sum(recv_splits[:rank])
    recv[own_recv:own_recv + recv_splits[rank]].copy_(send[own_send:own_send + send_splits[rank]])

    def finish() -> torch.Tensor:
        for chunk, work in zip(incoming, receives):
            wait(work)
            copies.copy(recv[chunk.offset:chunk.offset + chunk.length],
                        recv_host[chunk.offset:chunk.offset + chunk.length])
        for work in sends:
            wait(work)
        copies.finish()
        pool.give(send_buffer)
        pool.give(recv_buffer)
        return recv

    return finish
