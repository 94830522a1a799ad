"""The host-staged all-to-all of GPU payloads over gloo (``ep_comm.transports.host_staged``):
chunk plans, and bytes identical to the plain exchange for chunks smaller and larger than the
messages, empty messages and a rank's message to itself, on 2 and 4 gloo ranks (CPU tensors run
the same pipeline with plain copies; the overlap itself is timed on a GPU by bench/portable_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from ep_comm.transports.host_staged import Chunk, PinnedPool, plan_chunks


def test_chunks_cover_every_message_to_another_rank_in_ring_order():
    splits = [5, 0, 12, 3]
    chunks = plan_chunks(splits, rank=1, chunk_bytes=4)
    # ring order from rank 2; rank 1's own message is left out; rank 3's 3 bytes fit one chunk
    assert [c.peer for c in chunks] == [2, 2, 2, 3, 0, 0]
    assert chunks[:3] == [Chunk(2, 5, 4, 0), Chunk(2, 9, 4, 1), Chunk(2, 13, 4, 2)]
    assert chunks[3] == Chunk(3, 17, 3, 0) and chunks[4:] == [Chunk(0, 0, 4, 0), Chunk(0, 4, 1, 1)]
    for chunk_bytes in (1, 3, 5, 12, 100):
        covered = sorted((c.offset, c.offset + c.length) for c in plan_chunks(splits, 1, chunk_bytes))
        expected = [0]
        spans = []
        for r, n in enumerate(splits):
            if r != 1:
                spans += [(expected[-1] + a, expected[-1] + min(a + chunk_bytes, n)) for a in range(0, n, chunk_bytes)]
            expected.append(expected[-1] + n)
        assert covered == sorted(spans)
        assert all(0 < c.length <= chunk_bytes for c in plan_chunks(splits, 1, chunk_bytes))


def test_empty_messages_and_bad_chunk_sizes():
    assert plan_chunks([0, 0, 0], rank=0, chunk_bytes=8) == []
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks([1, 2], 0, 0)


def test_pool_never_hands_out_a_buffer_in_use():
    pool = PinnedPool(keep=2)
    a, b = pool.take(10, pinned=False), pool.take(10, pinned=False)
    assert a.data_ptr() != b.data_ptr()
    pool.give(a)
    assert pool.take(8, pinned=False).data_ptr() == a.data_ptr()
    assert pool.take(20, pinned=False).numel() >= 20


def _splits(world, seed, empty_share=0.3, largest=300):
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, largest, (world, world), generator=g)
    return table.masked_fill(torch.rand(world, world, generator=g) < empty_share, 0)


def _staged_case(rank, world, group, seed, chunk_sizes):
    import torch.distributed as dist

    from ep_comm.transports.torch_dist import TorchDistTransport

    table = _splits(world, seed)
    send_splits = table[rank].tolist()
    recv_splits = table[:, rank].tolist()
    g = torch.Generator().manual_seed(seed * 31 + rank)
    send = torch.randint(0, 256, (sum(send_splits),), generator=g, dtype=torch.uint8)
    plain = torch.empty(sum(recv_splits), dtype=torch.uint8)
    dist.all_to_all_single(plain, send, recv_splits, send_splits, group=group)
    transport = TorchDistTransport(group, 60.0, torch.device("cpu"), f"staged{seed}")
    mismatches = []
    for chunk_bytes in chunk_sizes:
        transport.staging_chunk_bytes = chunk_bytes
        # two exchanges in flight at once: each has its own host buffers
        first = transport._exchange_staged(send, send_splits, recv_splits, "staged/first")
        second = transport._exchange_staged(send.flip(0).contiguous(), send_splits,
                                            recv_splits, "staged/second")
        got_first, got_second = first.wait(), second.wait()
        flipped = torch.empty_like(plain)
        dist.all_to_all_single(flipped, send.flip(0).contiguous(), recv_splits, send_splits, group=group)
        if not torch.equal(got_first, plain):
            mismatches.append(("first", chunk_bytes))
        if not torch.equal(got_second, flipped):
            mismatches.append(("second", chunk_bytes))
    return mismatches, transport.num_collectives


@pytest.mark.parametrize("world", [2, 4])
def test_staged_exchange_is_bit_identical_to_the_plain_one(ranks, world):
    chunk_sizes = [5, 64, 1 << 20]  # smaller than most messages ... larger than all
    results = ranks(world, _staged_case, 11 + world, chunk_sizes)
    for mismatches, collectives in results:
        assert mismatches == []
        assert collectives == 2 * len(chunk_sizes)
