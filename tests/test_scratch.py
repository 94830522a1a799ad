"""ScratchPool (ep_comm/scratch.py): buffers are handed out once until given back, best fit first,
at most `keep` kept per role."""
from __future__ import annotations

import torch

from ep_comm.rows import ScratchPool


def test_take_give_best_fit_and_keep():
    pool = ScratchPool(keep=2)
    cpu = torch.device("cpu")
    a, a_view = pool.take("r", 100, cpu)
    b, _ = pool.take("r", 100, cpu)
    assert a_view.numel() == 100 and a.numel() >= 100 and a.data_ptr() != b.data_ptr()  # both in use
    pool.give("r", a)
    pool.give("r", b)
    big, _ = pool.take("r", 1000, cpu)  # nothing fits: a new one
    assert big.data_ptr() not in (a.data_ptr(), b.data_ptr())
    pool.give("r", big)
    assert pool.held_bytes() == big.numel() + a.numel()  # the two largest kept
    small, view = pool.take("r", 50, cpu)  # the smallest that fits, not the big one
    assert small.numel() == a.numel() and view.numel() == 50
    other, _ = pool.take("other role", 50, cpu)  # roles do not share
    assert other.data_ptr() not in (small.data_ptr(), big.data_ptr())
    pool.clear()
    assert pool.held_bytes() == 0
    nothing_kept = ScratchPool(keep=0)
    buffer, _ = nothing_kept.take("r", 10, cpu)
    nothing_kept.give("r", buffer)
    assert nothing_kept.held_bytes() == 0
