"""The codecs' CUDA paths behind the public API: ``lossless.encode/decode/decode_into`` and
``fp8.quantize`` on CUDA tensors run the kernels of ``ep_comm._cuda`` (csrc/cuda_bindings/codecs.cpp).
Checked against the host build: device blobs are byte-identical to host blobs, each side decodes
the other's exactly, corrupted blobs raise the host's ValueError, FP8 is bit-identical to the
reference, and each blob of a lossless message packed on the GPU is the host encoder's blob of its
rows (at the GPU message chunk size)."""
from __future__ import annotations

import pytest
import torch

from ep_comm.codecs import fp8, lossless
from ep_comm.codecs.device_kernels import codec_kernels
from ep_comm.payload import FieldSpec, RowFormat, RowSource, pack, unpack

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and codec_kernels(torch.device("cuda")) is None,
                                 reason="ep_comm._cuda is not built with the codec kernels")]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().cpu().contiguous().view(torch.int16)


def _tensor(case: str) -> torch.Tensor:
    """bf16 CPU tensors of the shapes and value mixes the codec must handle."""
    g = torch.Generator().manual_seed(7)
    if case == "all_patterns":
        return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    if case == "empty":
        return torch.empty(0, 7168, dtype=torch.bfloat16)
    if case == "one":
        return torch.tensor([1.5], dtype=torch.bfloat16)
    if case == "odd":
        return torch.randn(1001, 3, generator=g).to(torch.bfloat16)
    if case == "tokens":  # 64 tokens of H = 7168, some rows zero (gradient-like)
        x = (torch.randn(64, 7168, generator=g) * 0.02).to(torch.bfloat16)
        x[::5] = 0
        return x
    if case == "multi_chunk":  # several chunks with a short last one, +0.0 runs and specials
        x = torch.randn(3 * 65536 + 77, generator=g).to(torch.bfloat16)
        x[1000:40000] = 0
        x[5] = float("inf")
        x[6] = float("nan")
        x[7] = -0.0
        return x
    raise ValueError(case)


CASES = ["all_patterns", "empty", "one", "odd", "tokens", "multi_chunk"]


@pytest.mark.parametrize("case", CASES)
def test_device_blob_is_the_host_blob_and_both_decode_exactly(case):
    x = _tensor(case)
    host_blob = lossless.encode(x)
    device_blob = lossless.encode(x.cuda())
    assert device_blob.is_cuda and device_blob.dtype == torch.uint8 and device_blob.dim() == 1
    assert torch.equal(device_blob.cpu(), host_blob)
    for blob in (device_blob, host_blob.cuda()):
        y = lossless.decode(blob, expected_shape=tuple(x.shape))
        assert y.is_cuda and y.shape == x.shape
        assert torch.equal(_bits(y), _bits(x))
    assert torch.equal(_bits(lossless.decode(device_blob.cpu())), _bits(x))


def test_decode_into_a_device_slice_moves_a_host_blob():
    x = _tensor("tokens")
    receive = torch.full((3 * 64, 7168), 7.0, dtype=torch.bfloat16, device="cuda")
    lossless.decode_into(lossless.encode(x), receive[64:128])  # a CPU blob, a CUDA out
    assert torch.equal(_bits(receive[64:128]), _bits(x))
    assert bool((receive[:64] == 7.0).all()) and bool((receive[128:] == 7.0).all())


def test_device_decode_rejects_another_shape_before_writing():
    blob = lossless.encode(_tensor("odd").cuda())
    with pytest.raises(ValueError, match=r"shape \(1001, 3\), expected \(3, 1001\)"):
        lossless.decode(blob, expected_shape=(3, 1001))
    out = torch.full((1000, 3), 2.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="expected"):
        lossless.decode_into(blob, out)
    assert bool((out == 2.0).all())


def _host_error(blob: torch.Tensor) -> str | None:
    try:
        lossless.decode(blob)
    except ValueError as error:
        return str(error)
    return None


def _device_error(blob: torch.Tensor) -> str | None:
    try:
        lossless.decode(blob.cuda())
    except ValueError as error:
        return str(error)
    return None


def test_corrupted_and_truncated_blobs_raise_the_host_error():
    blob = lossless.encode(_tensor("multi_chunk"))
    size = blob.numel()
    positions = sorted({0, 4, 5, 8, 16, 24, 33, 60, 100, 200, 400, 1000, size // 3, size // 2, size - 5, size - 1})
    for p in positions:
        bad = blob.clone()
        bad[p] ^= 0x5A
        host = _host_error(bad)
        assert host is not None, f"byte {p}: the host decoder accepted a corrupted blob"
        assert _device_error(bad) == host, f"byte {p}"
    for cut in (0, 3, 31, 40, size // 2, size - 1):
        assert _device_error(blob[:cut]) == _host_error(blob[:cut]) is not None, f"{cut} bytes"


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_fp8_on_the_device_is_the_reference(round_scale, use_ue8m0):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(100, 1024, generator=g) * torch.logspace(-4, 2, 1024)).to(torch.bfloat16)
    x[3] = 0
    q_ref, s_ref = fp8.quantize_reference(x, round_scale, use_ue8m0)
    q, s = fp8.quantize(x.cuda(), round_scale, use_ue8m0)
    assert q.is_cuda and s.is_cuda and q.dtype == q_ref.dtype and s.dtype == s_ref.dtype
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.cpu().contiguous().view(torch.uint8), s_ref.contiguous().view(torch.uint8))


def test_lossless_message_packed_on_the_device_holds_the_host_blobs():
    """A message packed from GPU rows: each destination's blob is the host encoder's blob of those
    rows at the device message chunk size, and the message unpacks exactly on the GPU."""
    fmt = RowFormat((FieldSpec("x", torch.bfloat16, 7168), FieldSpec("w", torch.float32, 2)))
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(150, 7168, generator=g) * 0.05).to(torch.bfloat16)
    w = torch.rand(150, 2, generator=g)
    index = torch.randperm(150, generator=g)[:120]
    splits = [50, 0, 70]
    values = {"x": RowSource(x.cuda(), index.cuda()), "w": RowSource(w.cuda(), index.cuda())}
    message = pack(fmt, values, splits, "lossless")
    assert message.data.is_cuda
    data, offset, row = message.data.cpu(), 0, 0
    for n, size in zip(splits, message.byte_splits):
        length = int(data[offset + 8 * n:offset + 8 * n + 8].clone().view(torch.int64)[0])  # after n x 8 B of w
        blob = data[offset + 8 * n + 8:offset + 8 * n + 8 + length]
        rows = x[index[row:row + n]]
        assert torch.equal(blob, lossless.encode(rows, chunk_values=lossless.DEVICE_MESSAGE_CHUNK_VALUES))
        offset, row = offset + size, row + n
    received = unpack(fmt, message.data, splits, message.byte_splits, "lossless")
    assert received["x"].is_cuda
    assert torch.equal(_bits(received["x"]), _bits(x[index]))
    assert torch.equal(received["w"].cpu(), w[index])


def test_edge_inputs_on_the_device():
    with pytest.raises(ValueError, match="at most 8"):
        lossless.encode(torch.zeros((1,) * 9, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="positive multiple of 128"):  # as on the CPU
        fp8.quantize(torch.empty(4, 0, dtype=torch.bfloat16, device="cuda"))
    q, s = fp8.quantize(torch.empty(0, 256, dtype=torch.bfloat16, device="cuda"))
    assert q.shape == (0, 256) and s.shape == (0, 2) and q.is_cuda
    strided = lossless.encode(_tensor("odd")).cuda().repeat_interleave(2)[::2]  # a non-contiguous blob
    assert torch.equal(_bits(lossless.decode(strided)), _bits(_tensor("odd")))


def test_auto_rule_measures_the_device_codec():
    from ep_comm.codecs.auto import AutoCodecPolicy

    policy = AutoCodecPolicy(link_gbps=50.0)
    enc, dec = policy.throughputs(torch.device("cuda"))
    assert enc > 0 and dec > 0 and list(policy._measured) == ["cuda"]


def test_many_messages_in_one_call_on_the_device():
    xs = [_tensor(case) for case in ("tokens", "empty", "odd", "one")]
    blobs = lossless.encode_many([x.cuda() for x in xs], chunk_values=4096)
    assert all(b.is_cuda for b in blobs)
    for x, blob in zip(xs, blobs):
        assert torch.equal(blob.cpu(), lossless.encode(x, chunk_values=4096))
    outs = [torch.empty(x.shape, dtype=torch.bfloat16, device="cuda") for x in xs]
    lossless.decode_into_many(blobs, outs)
    for x, out in zip(xs, outs):
        assert torch.equal(_bits(out), _bits(x))
    bad = blobs[2].clone()  # a corrupted blob third of four: its own status slot reports it
    bad[-3] ^= 0x20
    with pytest.raises(ValueError) as error:
        lossless.decode_into_many([blobs[0], blobs[1], bad, blobs[3]], outs)
    assert str(error.value) == _host_error(bad.cpu())
