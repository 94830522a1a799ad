"""Codecs on the dispatch/combine path: lossless is bit-identical to uncompressed, FP8 within
DeepEP's tolerance, wire bytes reported, and "auto" follows its documented rule."""
from __future__ import annotations

import pytest
import torch
from support.emulated_cuda import RecordingKernels, device_codecs_on_cpu, import_codec_module
from support.rank_cases import make_routing
from test_buffer_normal import CASES, Case, _inputs

import ep_comm
from ep_comm.codecs import fp8, lossless
from ep_comm.codecs.auto import AutoCodecPolicy, choose_codec

pytest.importorskip("ep_comm._host", reason="the C++ host codec module is not built")

BF16_CASES = [c for c in CASES if c.dtype == torch.bfloat16]


def _with_codecs(rank, world, group, case: Case):
    x, idx, w = _inputs(rank, case)
    # activation-like payload: a narrow exponent range compresses
    x = (x.float() * 0.02).to(torch.bfloat16)
    buf = ep_comm.Buffer(group)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, case.experts)
    out = {}
    for codec in ("none", "lossless"):
        rx, ridx, rw, counts, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                       num_tokens_per_expert=per_expert, codec=codec)
        dispatch_stats = buf.last_stats
        y = (rx.float() * -1.5).to(torch.bfloat16)
        combined, cw, _ = buf.combine(y, handle, topk_weights=rw, codec=codec)
        cached, *_ = buf.dispatch(x, handle=handle, codec=codec)
        out[codec] = (rx, ridx, rw, counts, combined, cw, cached, dispatch_stats, buf.last_stats)
    return out


def _check_lossless_matches_plain(rank: int, out: dict, case: Case) -> None:
    """One rank's _with_codecs results: lossless bit-identical to uncompressed, the same raw bytes,
    and fewer wire bytes to every peer sent 16 rows or more."""
    plain, packed = out["none"], out["lossless"]
    for a, b in zip(plain[:7], packed[:7]):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), f"rank {rank}"
        else:
            assert a == b
    stats = packed[7]
    assert stats.codec == "lossless" and plain[7].codec == "none"
    assert stats.bytes_sent_raw == plain[7].bytes_sent_raw
    for peer, raw in enumerate(stats.bytes_sent_raw):
        if raw >= 16 * case.hidden * 2:
            assert stats.bytes_sent_wire[peer] < raw, (peer, stats)


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: f"R{c.world}-K{c.topk}-H{c.hidden}")
def test_lossless_on_the_wire_is_bit_identical(ranks, case):
    for rank, out in enumerate(ranks(case.world, _with_codecs, case)):
        _check_lossless_matches_plain(rank, out, case)


def _with_codecs_on_emulated_kernels(rank, world, group, case: Case, module_path):
    kernels = RecordingKernels(import_codec_module(module_path))
    with device_codecs_on_cpu(kernels):
        assert lossless.message_chunk_values("cpu") == lossless.DEVICE_MESSAGE_CHUNK_VALUES
        out = _with_codecs(rank, world, group, case)
    return out, kernels.calls


EMULATED_CASES = [c for c in BF16_CASES if c.world > 1 and c.hidden >= 200]


@pytest.mark.parametrize("case", EMULATED_CASES, ids=lambda c: f"R{c.world}-K{c.topk}-H{c.hidden}")
def test_lossless_through_the_gpu_codec_kernels_is_bit_identical(ranks, emulated_codec_module_path, case):
    """The messages coded and decoded by the CUDA codec kernels (built for the CPU through the CUDA
    emulation, driven by ep_comm._cuda's bindings, in the GPU's 8K-value message chunks): dispatch,
    combine and cached dispatch equal the uncompressed ones, bit for bit, with the raw bytes of
    the host codec's run."""
    device = ranks(case.world, _with_codecs_on_emulated_kernels, case, emulated_codec_module_path)
    for rank, (out, calls) in enumerate(device):
        # a blob per peer and message: dispatch, combine and cached dispatch, each way
        assert calls.count("encode") == calls.count("decode") == 3 * case.world, calls
        _check_lossless_matches_plain(rank, out, case)


def _fp8_codec(rank, world, group):
    idx, w = make_routing(rank, 3, 24, 8, 4, 0.0)
    x = torch.randn(24, 1024).to(torch.bfloat16)
    buf = ep_comm.Buffer(group)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, 8)
    plain, *_ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    raw = buf.last_stats.total_sent_wire
    (q, scales), *_ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                   codec="fp8")
    wire = buf.last_stats.total_sent_wire
    xg = x.float().requires_grad_()
    rx, _, _, _, handle, _ = ep_comm.dispatch(buf, xg, idx, w, 8, codec="fp8")
    out, _, _ = ep_comm.combine(buf, rx, handle)
    out.sum().backward()
    return plain, q, scales, raw, wire, xg.grad


def test_fp8_codec_on_dispatch(ranks):
    for plain, q, scales, raw, wire, grad in ranks(2, _fp8_codec):
        assert q.dtype == torch.float8_e4m3fn and scales.shape == (plain.shape[0], 8)
        assert fp8.calc_diff(fp8.dequantize(q, scales), plain) < 9e-4
        assert wire < 0.6 * raw
        assert bool((grad >= 1).all()) and bool((grad <= 2).all())  # straight-through, 1-2 ranks


def test_auto_rule():
    slow_link = AutoCodecPolicy(link_gbps=1.0, encode_gbps=10.0, decode_gbps=10.0, expected_ratio=0.7)
    fast_link = AutoCodecPolicy(link_gbps=100.0, encode_gbps=10.0, decode_gbps=10.0, expected_ratio=0.7)
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    # (1 - 0.7) / 1 = 0.3 > 0.2 ; (1 - 0.7) / 100 = 0.003 < 0.2
    assert choose_codec(x, slow_link, "gloo") == "lossless"
    assert choose_codec(x, fast_link, "gloo") == "none"
    assert choose_codec(x.float(), slow_link, "gloo") == "none"
    slow_link.observe(1000, 900)
    assert abs(slow_link.ratio() - 0.9) < 1e-9
    assert choose_codec(x, slow_link, "gloo") == "none"  # 0.1 < 0.2
    measured = AutoCodecPolicy(link_gbps=1.0)
    enc, dec = measured.throughputs()
    assert enc > 0 and dec > 0
    assert list(measured._measured) == ["cpu"]  # a CPU payload is coded on the CPU
    assert measured.throughputs("cpu") == (enc, dec)  # measured once per place
    with pytest.raises(ValueError, match="device must be a torch.device"):
        measured.throughputs(3.5)


def _auto_with_diverging_data(rank, world, group):
    """Rank 0's payload compresses, rank 1's does not: "auto" must still agree across ranks."""
    idx, w = make_routing(rank, 8, 16, 4, 2, 0.0)
    if rank == 0:
        x = (torch.randn(16, 256) * 0.01).to(torch.bfloat16)
    else:
        x = torch.randint(-32768, 32767, (16, 256), dtype=torch.int16).view(torch.bfloat16)
    buf = ep_comm.Buffer(group)
    buf.auto_codec = AutoCodecPolicy(link_gbps=1.0, encode_gbps=10.0, decode_gbps=10.0)
    per_expert = torch.zeros(4, dtype=torch.int32)
    rx, _, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                           codec="lossless")
    plain, _, _ = buf.combine(rx, handle, topk_weights=rw)
    auto, _, _ = buf.combine(rx, handle, topk_weights=rw, codec="auto")
    auto_codec = buf.last_stats.codec
    cached, *_ = buf.dispatch(x, handle=handle, codec="auto")
    return torch.equal(plain.view(torch.int16), auto.view(torch.int16)), auto_codec, torch.equal(
        cached.view(torch.int16), rx.view(torch.int16))


def test_auto_codec_is_agreed_by_all_ranks(ranks):
    outs = ranks(2, _auto_with_diverging_data)
    assert all(same and cached_same for same, _, cached_same in outs)
    assert len({codec for _, codec, _ in outs}) == 1


def _lossless_float64_weights_and_fp8_cached(rank, world, group):
    idx = torch.tensor([[0, 2]])
    w = torch.rand(1, 2, dtype=torch.float64)
    x = torch.randn(1, 128).to(torch.bfloat16)
    buf = ep_comm.Buffer(group)
    per_expert = torch.zeros(4, dtype=torch.int32)
    outs = []
    for codec in ("none", "lossless"):
        rx, _, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                               codec=codec)
        combined, cw, _ = buf.combine(rx, handle, topk_weights=rw, codec=codec)
        outs.append((rx, rw, combined, cw))
    q_first, *_ = buf.dispatch(x, topk_idx=idx, topk_weights=w.float(), num_tokens_per_expert=per_expert,
                               codec="fp8")
    _, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_tokens_per_expert=per_expert)
    q_cached, *_ = buf.dispatch(x, handle=handle, codec="fp8")
    grad_x = torch.randn(1, 128, requires_grad=True)
    rx_grad, *_ = buf.dispatch(grad_x, topk_idx=idx, num_tokens_per_expert=per_expert)  # plain Buffer call
    # rows arrive ordered by source rank: this rank's own token is row `rank`
    return outs, q_first, q_cached, rx_grad.shape == (2, 128) and torch.equal(rx_grad[rank], grad_x.detach()[0])


def test_lossless_with_float64_weights_cached_fp8_and_grad_inputs(ranks):
    for outs, q_first, q_cached, grad_ok in ranks(2, _lossless_float64_weights_and_fp8_cached):
        for a, b in zip(outs[0], outs[1]):
            assert torch.equal(a, b)
        assert isinstance(q_cached, tuple) and q_cached[0].dtype == torch.float8_e4m3fn
        assert torch.equal(q_cached[0].view(torch.uint8), q_first[0].view(torch.uint8))
        assert torch.equal(q_cached[1], q_first[1])
        assert grad_ok


def _lossless_after_masking(rank, world, group):
    buf = ep_comm.Buffer(group, timeout_s=30)
    if rank == 3:
        return None  # masked: takes no part
    buf.mask_ranks([3])
    idx, w = make_routing(rank, 13, 9, 8, 3, 0.0)
    x = (torch.randn(9, 256) * 0.02).to(torch.bfloat16)
    per_expert = torch.zeros(8, dtype=torch.int32)
    outs = {}
    for codec in ("none", "lossless", "auto"):
        rx, _, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                               codec=codec)
        combined, _, _ = buf.combine(rx, handle, codec=codec)
        cached, *_ = buf.dispatch(x, handle=handle, codec=codec)
        outs[codec] = (rx, combined, cached)
    return outs


def test_lossless_after_masking_a_rank(ranks):
    for outs in ranks(4, _lossless_after_masking)[:3]:
        for codec in ("lossless", "auto"):
            for a, b in zip(outs["none"], outs[codec]):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_lossless_message_padding_is_zero():
    """Every byte of a packed message is defined: the padding after each blob is zero, so the
    same rows always give the same message (and no stale memory goes on the wire)."""
    from ep_comm.payload import BLOB_LENGTH_BYTES, FieldSpec, RowFormat, RowSource, pack

    fmt = RowFormat((FieldSpec("x", torch.bfloat16, 200), FieldSpec("w", torch.float32, 3)))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 200, generator=g).to(torch.bfloat16)
    w = torch.rand(40, 3, generator=g)
    splits = [7, 0, 13, 20]
    garbage = torch.full((1 << 20,), 0xAB, dtype=torch.uint8)  # freed memory the allocator may reuse
    del garbage
    out = pack(fmt, {"x": RowSource(x), "w": RowSource(w)}, splits, "lossless")
    offset = 0
    for n, size in zip(splits, out.byte_splits):
        chunk = out.data[offset:offset + size]
        blob_start = ((n * 12 + 7) // 8) * 8  # the w block (n rows of 3 float32), padded to 8
        length = int(chunk[blob_start:blob_start + BLOB_LENGTH_BYTES].clone().view(torch.int64)[0])
        end = blob_start + BLOB_LENGTH_BYTES + length
        assert size == (end + 7) // 8 * 8
        assert bool((chunk[end:] == 0).all()), f"padding of the {n}-row chunk"
        if n * 12 % 8:
            assert bool((chunk[n * 12:blob_start] == 0).all())
        offset += size
    again = pack(fmt, {"x": RowSource(x), "w": RowSource(w)}, splits, "lossless")
    assert torch.equal(again.data, out.data)


@pytest.mark.parametrize("codec", ["none", "lossless"])
def test_message_padding_is_zero_whatever_the_memory_held(codec, monkeypatch):
    """pack does not zero-fill its buffer first: it writes every byte, the padding after each
    block and blob as zeros. Here every fresh buffer starts as 0xAB bytes."""
    from ep_comm.payload import FieldSpec, RowFormat, RowSource, pack

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(0xAB)
                        if k.get("dtype") == torch.uint8 else real_empty(*a, **k))
    fmt = RowFormat((FieldSpec("x", torch.bfloat16, 200), FieldSpec("src", torch.int32, 1),
                     FieldSpec("w", torch.float32, 3)))
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, 200, generator=g).to(torch.bfloat16)
    src = torch.arange(40, dtype=torch.int32).unsqueeze(1)
    w = torch.rand(40, 3, generator=g)
    splits = [7, 0, 13, 20]
    out = pack(fmt, {"x": RowSource(x), "src": RowSource(src), "w": RowSource(w)}, splits, codec)
    assert not bool((out.data == 0xAB).all())
    offset = 0
    for n, size in zip(splits, out.byte_splits):
        chunk = out.data[offset:offset + size]
        position = 0
        # field order; a lossless blob goes last
        blocks = ([("x", 400)] if codec == "none" else []) + [("src", 4), ("w", 12)]
        for _, row_bytes in blocks:
            used = n * row_bytes
            padded = (used + 7) // 8 * 8
            assert bool((chunk[position + used:position + padded] == 0).all()), f"{n}-row chunk"
            position += padded
        if codec == "lossless":
            length = int(chunk[position:position + 8].clone().view(torch.int64)[0])
            assert bool((chunk[position + 8 + length:] == 0).all())
        else:
            assert position == size
        offset += size


def test_lossless_message_damage_is_a_value_error():
    """A received lossless message whose chunk sizes, blob lengths or blobs are wrong raises
    ValueError, never reads past a chunk or writes a wrong row."""
    from ep_comm.payload import FieldSpec, RowFormat, RowSource, pack, unpack

    fmt = RowFormat((FieldSpec("x", torch.bfloat16, 64), FieldSpec("w", torch.float32, 2)))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(12, 64, generator=g).to(torch.bfloat16)
    w = torch.rand(12, 2, generator=g)
    splits = [5, 7]
    message = pack(fmt, {"x": RowSource(x), "w": RowSource(w)}, splits, "lossless")
    first = message.byte_splits[0]
    good = unpack(fmt, message.data, splits, message.byte_splits, "lossless")
    assert torch.equal(good["x"].view(torch.int16), x.view(torch.int16))

    def with_length(chunk_start: int, rows: int, length: int) -> torch.Tensor:
        data = message.data.clone()
        at = chunk_start + rows * 8  # after the w block (rows x 8 bytes)
        data[at:at + 8] = torch.tensor([length], dtype=torch.int64).view(torch.uint8)
        return data

    with pytest.raises(ValueError, match="too short to hold its blob length"):
        unpack(fmt, message.data[:5 * 8 + 4], [5], [5 * 8 + 4], "lossless")
    with pytest.raises(ValueError, match="names a blob of 100000 bytes that it does not hold"):
        unpack(fmt, with_length(0, 5, 100000), splits, message.byte_splits, "lossless")
    with pytest.raises(ValueError, match="names a blob of -1 bytes"):
        unpack(fmt, with_length(first, 7, -1), splits, message.byte_splits, "lossless")
    with pytest.raises(ValueError, match="does not fill"):
        unpack(fmt, with_length(0, 5, 20), splits, message.byte_splits, "lossless")
    damaged = message.data.clone()
    damaged[first - 9] ^= 0x08  # inside the first chunk's blob
    with pytest.raises(ValueError, match="lossless blob"):
        unpack(fmt, damaged, splits, message.byte_splits, "lossless")
    with pytest.raises(ValueError):  # row counts that do not match the chunks
        unpack(fmt, message.data, [6, 6], message.byte_splits, "lossless")


def test_messages_are_coded_with_the_process_thread_budget(monkeypatch):
    """The transport's host codec uses torch.get_num_threads() threads (what torchrun and
    ep-bench give each rank), not every hardware thread, for packing, unpacking and the "auto"
    rule's throughput sample."""
    from ep_comm.codecs import auto, lossless
    from ep_comm.payload import FieldSpec, RowFormat, RowSource, pack, unpack

    seen = []

    def recording(name):
        original = getattr(lossless, name)
        return lambda *args, **kwargs: seen.append((name, kwargs.get("threads"))) or original(*args, **kwargs)

    for name in ("encode_many", "decode_into_many", "encode"):
        monkeypatch.setattr(lossless, name, recording(name))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert lossless.message_threads() == 1
        fmt = RowFormat((FieldSpec("x", torch.bfloat16, 64),))
        x = torch.randn(12, 64).to(torch.bfloat16)
        message = pack(fmt, {"x": RowSource(x)}, [5, 7], "lossless")
        got = unpack(fmt, message.data, [5, 7], message.byte_splits, "lossless")
        assert torch.equal(got["x"].view(torch.int16), x.view(torch.int16))
        auto.AutoCodecPolicy().throughputs("cpu")
    finally:
        torch.set_num_threads(before)
    assert {name for name, _ in seen} == {"encode_many", "decode_into_many", "encode"}
    assert all(threads == 1 for _, threads in seen), seen


def test_unpack_checks_the_chunk_sizes_against_what_was_received():
    from ep_comm.payload import FieldSpec, RowFormat, unpack

    fmt = RowFormat((FieldSpec("x", torch.bfloat16, 64), FieldSpec("w", torch.float32, 2)))
    received = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="exceed the 100 bytes received"):
        unpack(fmt, received, [1, 1], [60, 60], "lossless")
    with pytest.raises(ValueError, match="non-negative, one per source"):
        unpack(fmt, received, [1, -1], [50, 50], "lossless")
    with pytest.raises(ValueError, match="non-negative, one per source"):
        unpack(fmt, received, [1], [50, 50], "none")
