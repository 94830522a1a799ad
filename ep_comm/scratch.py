"""Reusable byte buffers for messages that never leave the library.

Low-latency calls move the same large messages on every call (a rank's send and receive bytes:
about 7 MB each for dispatch and 15 MB each for combine at 128 tokens x 7168 on 4 ranks). Fresh
tensors for them are faulted in page by page on every call on the CPU; a Buffer's pool hands the
same memory back instead. A buffer is taken for one message and given back only once the message
is consumed (its exchange finished and its bytes read), so two calls in flight (a receive hook not
called yet) never share one: a take finding no free buffer of the role allocates a new one.
"""
from __future__ import annotations

import torch


class ScratchPool:
    """Free uint8 buffers per (role, device), at most ``keep`` each (the largest kept).

    Not thread-safe: one Buffer's calls are made from one thread, as DeepEP's are.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: dict[tuple[str, torch.device], list[torch.Tensor]] = {}

    def take(self, role: str, nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(buffer, bytes)``: a buffer of at least ``nbytes`` (give it back with :meth:`give`
        once its message is consumed) and its first ``nbytes`` as a 1-D uint8 view (contents
        undefined)."""
        free = self._free.get((role, torch.device(device)), [])
        fits = [i for i, buffer in enumerate(free) if buffer.numel() >= nbytes]
        if fits:  # the smallest that fits, so that a larger message later finds the larger one
            buffer = free.pop(min(fits, key=lambda i: free[i].numel()))
            return buffer, buffer[:nbytes]
        # room to grow: a message whose size varies with the routing (combine) reuses the buffer
        # when it is up to an eighth larger next time
        buffer = torch.empty(nbytes + nbytes // 8, dtype=torch.uint8, device=device)
        return buffer, buffer[:nbytes]

    def give(self, role: str, buffer: torch.Tensor) -> None:
        """Returns a buffer from :meth:`take` whose message is consumed."""
        free = self._free.setdefault((role, buffer.device), [])
        free.append(buffer)
        free.sort(key=lambda t: t.numel(), reverse=True)
        del free[self.keep:]

    def clear(self) -> None:
        self._free.clear()

    def held_bytes(self) -> int:
        return sum(t.numel() for free in self._free.values() for t in free)
