"""ep_comm.codecs.lossless_device (and fp8's device path) without a GPU: the Python side (workspace
and output sizing, the arguments handed to each kernel binding and their order, the blob-size and
status read-backs, error texts), run twice: against a stand-in for the ``ep_comm._cuda`` codec
bindings that has their signatures and does their work with the host codecs on CPU memory, and
against the real bindings (csrc/cuda_bindings/codecs.cpp) over the real codec kernels built for the
CPU through the CUDA emulation (tests/support/emulated_cuda.py), on the host memory of CPU tensors. The
kernels on a GPU are tested by tests/gpu/test_codecs_device.py."""
from __future__ import annotations

import contextlib
import ctypes
import math

import numpy as np
import pytest
import torch
from support.codec_kernel_cases import blob_layout
from support.emulated_cuda import RecordingKernels, import_codec_module

from ep_comm import _host
from ep_comm.codecs import device_kernels, fp8, lossless, lossless_device


class HostKernels:
    """The codec bindings of csrc/cuda_bindings/codecs.cpp (same names, parameters and order),
    done by the host codec on the memory the pointers name. Records every call."""

    def __init__(self):
        self.calls: list[str] = []

    def lossless_encode_workspace_bytes(self, num_values, chunk_values, version):
        return 64 + num_values // 7

    def lossless_decode_workspace_bytes(self, num_values, chunk_values, field_chunks=0):
        return 32 + num_values // 9 + 1000 * field_chunks

    def lossless_max_blob_bytes(self, num_values, ndim, chunk_values, version):
        return _host.lossless_max_blob_bytes(num_values, ndim, chunk_values, version)

    def lossless_encode(self, values, num_values, shape, chunk_values, version, out, out_size, workspace,
                        workspace_bytes, stream):
        self.calls.append("encode")
        assert stream == 0
        assert workspace_bytes >= self.lossless_encode_workspace_bytes(num_values, chunk_values, version)
        ctypes.memset(workspace, 0xEE, workspace_bytes)  # the workspace is the callee's to scribble on
        bits = np.ctypeslib.as_array((ctypes.c_int16 * num_values).from_address(values)) if num_values else \
            np.empty(0, np.int16)
        copy = bits.copy()  # alive for the call: the host binding reads it by address
        blob = _host.lossless_encode(copy.ctypes.data, copy.size, list(shape), chunk_values, 1, True, version)
        assert blob.size <= self.lossless_max_blob_bytes(num_values, len(shape), chunk_values, version)
        ctypes.memmove(out, blob.ctypes.data, blob.size)
        ctypes.c_int64.from_address(out_size).value = blob.size

    def lossless_decode(self, blob, blob_bytes, out, num_values, min_chunk_values, field_chunks, version, status,
                        workspace, workspace_bytes, stream):
        self.calls.append("decode")
        assert workspace_bytes >= self.lossless_decode_workspace_bytes(num_values, min_chunk_values, field_chunks)
        assert stream == 0
        data = np.frombuffer(ctypes.string_at(blob, blob_bytes), dtype=np.uint8)
        assert version == data[4]  # the caller read it from the header, as the kernels check
        code = 0
        try:
            values = _host.lossless_decode(data.ctypes.data, data.size, 1, True, None)
            if values.size != num_values:
                raise ValueError("lossless blob: shape does not match the number of values")
            ctypes.memmove(out, values.ctypes.data, 2 * num_values)
        except ValueError as error:
            text = str(error).removeprefix("lossless blob: ")
            code = next(c for c in range(1, 12) if _host.lossless_error_message(c) == text)
        ctypes.c_int32.from_address(status).value = code

    def fp8_quantize(self, x, rows, hidden, round_scale, use_ue8m0, q, scales, stream):
        self.calls.append("fp8")
        assert stream == 0
        n = rows * hidden
        src = np.ctypeslib.as_array((ctypes.c_int16 * n).from_address(x)).copy()
        q_out = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(q))
        if use_ue8m0:
            s_out = np.ctypeslib.as_array((ctypes.c_int32 * (n // 512)).from_address(scales))
        else:
            s_out = np.ctypeslib.as_array((ctypes.c_float * (n // 128)).from_address(scales))
        _host.fp8_quantize(src, rows, hidden, round_scale, use_ue8m0, q_out, s_out)


@pytest.fixture(params=["host_stand_in", "emulated_kernels"])
def kernels(request, monkeypatch) -> HostKernels | RecordingKernels:
    """CPU tensors routed through lossless_device, with HostKernels (or the real bindings over the
    emulated kernels) in place of ep_comm._cuda."""
    if request.param == "host_stand_in":
        fake = HostKernels()
    else:
        fake = RecordingKernels(import_codec_module(request.getfixturevalue("emulated_codec_module_path")))
    monkeypatch.setattr(device_kernels, "codec_kernels", lambda device: fake)
    monkeypatch.setattr(device_kernels, "launch_context", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(device_kernels, "current_stream", lambda device: 0)
    return fake


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def _host_encode(x: torch.Tensor, chunk_values: int = lossless.DEFAULT_CHUNK_VALUES) -> torch.Tensor:
    flat = x.contiguous().view(torch.int16).reshape(-1).numpy()
    return torch.from_numpy(_host.lossless_encode(flat.ctypes.data, flat.size, list(x.shape), chunk_values, 1, True))


SHAPES = [(), (0,), (1,), (7, 3), (64, 7168), (3, 0, 5), (2, 1, 3, 1, 1, 2, 1, 2)]


@pytest.mark.parametrize("shape", SHAPES)
def test_device_path_round_trip_gives_the_host_blob(kernels, shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=g).to(torch.bfloat16)
    if x.numel() > 100:
        x.view(-1)[100:5000] = 0
    blob = lossless.encode(x, chunk_values=4096)  # through lossless_device
    assert kernels.calls == ["encode"]
    assert torch.equal(blob, _host_encode(x, 4096))
    y = lossless.decode(blob, expected_shape=tuple(shape))
    assert y.shape == x.shape and torch.equal(_bits(y), _bits(x))
    out = torch.full(x.shape, 3.0, dtype=torch.bfloat16)
    assert lossless.decode_into(blob, out) is out and torch.equal(_bits(out), _bits(x))
    assert kernels.calls == ["encode", "decode", "decode"]


def test_device_path_takes_negative_and_strided_views(kernels):
    """A lazily negated view (its negative bit set) and a transposed one code as their values."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    for view in (torch._neg_view(x), x.t()):
        values = view.clone().resolve_neg()
        blob = lossless.encode(view, chunk_values=256)
        assert torch.equal(blob, _host_encode(values, 256))
        assert torch.equal(_bits(lossless.decode(blob)), _bits(values))


def test_device_path_rejects_bad_blobs_before_the_kernel(kernels):
    x = torch.randn(300, 7).to(torch.bfloat16)
    blob = lossless.encode(x, chunk_values=64)
    with pytest.raises(ValueError, match=r"shape \(300, 7\), expected \(7, 300\)"):
        lossless.decode(blob, expected_shape=(7, 300))
    with pytest.raises(ValueError, match="expected"):
        lossless.decode_into(blob, torch.empty(299, 7, dtype=torch.bfloat16))
    bad = blob.clone()
    bad[0] ^= 1
    with pytest.raises(ValueError, match="bad magic"):
        lossless.decode(bad)
    assert kernels.calls == ["encode"]  # none of these reached the decoder kernel


def test_device_path_decodes_format_5(kernels):
    """Format version 5 (a chunk may carry its own table): encode(version=5) runs the encoder
    kernel, once per tensor, and gives the host encoder's version 5 blob; decode, decode_into and
    decode_into_many of its blob run the decoder kernel, once per blob, and give the values back
    exactly; a corrupted one raises the host decoder's ValueError from the kernel's status."""
    g = torch.Generator().manual_seed(9)
    x = torch.cat([torch.randn(8, 4096, generator=g) * 1e-4, torch.randn(8, 4096, generator=g) * 30]).bfloat16()
    z = torch.randn(3, 4096, generator=g).bfloat16()
    blob, other = lossless.encode(x, chunk_values=8192, version=5), lossless.encode(z, chunk_values=4096, version=5)
    assert int(blob[4]) == 5 and int(blob[17]) >= 1 and int(other[4]) == 5  # extra tables; none
    assert kernels.calls == ["encode", "encode"]
    flat = _bits(x).reshape(-1).numpy()
    assert torch.equal(blob, torch.from_numpy(_host.lossless_encode(flat.ctypes.data, flat.size, list(x.shape), 8192,
                                                                    1, True, 5)))
    kernels.calls.clear()
    assert torch.equal(_bits(lossless.decode(blob, expected_shape=(16, 4096))), _bits(x))
    out = torch.empty_like(x)
    assert lossless.decode_into(blob, out) is out and torch.equal(_bits(out), _bits(x))
    outs = [torch.empty_like(z), torch.empty_like(x)]
    lossless.decode_into_many([other, blob], outs)
    assert torch.equal(_bits(outs[0]), _bits(z)) and torch.equal(_bits(outs[1]), _bits(x))
    assert kernels.calls == ["decode"] * 4
    last_entry = blob_layout(blob)["directory"] + 16 * 7
    assert int(blob[last_entry + 1]) != 0  # the last chunk has a table of its own
    bad = blob.clone()
    bad[-100] ^= 0x21  # a payload byte of the last chunk
    with pytest.raises(ValueError) as host_error:
        _host.lossless_decode(bad.numpy().ctypes.data, bad.numel(), 1, True, None)
    with pytest.raises(ValueError) as device_error:
        lossless.decode(bad)
    assert str(device_error.value) == str(host_error.value)
    assert kernels.calls == ["decode"] * 5


def test_device_path_reports_the_kernel_status(kernels):
    x = torch.randn(300, 7).to(torch.bfloat16)
    blob = lossless.encode(x, chunk_values=64)
    bad = blob.clone()
    bad[-2] ^= 0x10  # the last chunk's payload: found by the decoder, not the metadata checks
    with pytest.raises(ValueError) as host_error:
        lossless.shape_of(bad), _host.lossless_decode(bad.data_ptr(), bad.numel(), 1, True, None)
    with pytest.raises(ValueError) as device_error:
        lossless.decode(bad)
    assert str(device_error.value) == str(host_error.value)
    assert kernels.calls == ["encode", "decode"]


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("shape", [(5, 1024), (2, 3, 512), (0, 512)])
def test_fp8_device_path_matches_the_reference(kernels, shape, round_scale, use_ue8m0):
    if use_ue8m0 and shape[-1] % 512:
        pytest.skip("UE8M0 packs 4 groups")
    x = (torch.randn(shape) * torch.logspace(-3, 2, shape[-1])).to(torch.bfloat16)
    q, scales = fp8._quantize_device(x, round_scale, use_ue8m0)
    q_ref, scales_ref = fp8.quantize_reference(x, round_scale, use_ue8m0)
    assert q.dtype == q_ref.dtype and scales.dtype == scales_ref.dtype and scales.shape == scales_ref.shape
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), scales_ref.contiguous().view(torch.uint8))
    assert kernels.calls == (["fp8"] if x.numel() else [])


def test_without_codec_kernels_cuda_tensors_are_not_routed_to_them():
    assert not lossless_device.available(torch.device("cpu"))
    assert lossless_device.available(torch.device("meta")) is False


def test_payload_path_through_the_device_codec(kernels, monkeypatch):
    from ep_comm.payload import FieldSpec, RowFormat, RowSource, pack, unpack

    fmt = RowFormat((FieldSpec("x", torch.bfloat16, 256), FieldSpec("w", torch.float32, 2)))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, 256, generator=g).to(torch.bfloat16)
    w = torch.rand(30, 2, generator=g)
    index = torch.randperm(30, generator=g)[:25]
    splits = [10, 0, 15]
    values = {"x": RowSource(x, index), "w": RowSource(w, index)}
    message = pack(fmt, values, splits, "lossless")
    assert kernels.calls == ["encode"] * 3  # one blob per destination (an empty one too)
    received = unpack(fmt, message.data, splits, message.byte_splits, "lossless")
    assert kernels.calls == ["encode"] * 3 + ["decode"] * 3
    assert torch.equal(_bits(received["x"]), _bits(x[index])) and torch.equal(received["w"], w[index])
    blob = message.data[80 + 8:80 + 8 + int(message.data[80:88].clone().view(torch.int64)[0])]
    assert lossless_device.header(blob)[1] == lossless.DEVICE_MESSAGE_CHUNK_VALUES  # GPU messages: small chunks
    monkeypatch.setattr(device_kernels, "codec_kernels", lambda device: None)  # the host path
    host_message = pack(fmt, values, splits, "lossless")
    host_blob = host_message.data[80 + 8:80 + 8 + int(host_message.data[80:88].clone().view(torch.int64)[0])]
    host_shape, host_chunk_values = lossless_device.header(host_blob)
    assert host_chunk_values == lossless.default_chunk_values(math.prod(host_shape))  # host messages: the default
    assert torch.equal(unpack(fmt, host_message.data, splits, host_message.byte_splits, "lossless")["x"],
                       received["x"])


def test_many_blobs_with_one_read_back(kernels, monkeypatch):
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(shape, generator=g).to(torch.bfloat16) for shape in [(5, 300), (0, 8), (1000,), (2, 3)]]
    blobs = lossless.encode_many(xs, chunk_values=512)
    assert kernels.calls == ["encode"] * 4
    for x, blob in zip(xs, blobs):
        assert torch.equal(blob, _host_encode(x, 512))
    reads = []
    real_to_host = lossless_device._to_host
    monkeypatch.setattr(lossless_device, "_to_host", lambda parts: reads.append(len(parts)) or real_to_host(parts))
    outs = [torch.empty(x.shape, dtype=torch.bfloat16) for x in xs]
    lossless.decode_into_many(blobs, outs)
    assert reads == [4, 4]  # the metadata of all blobs in two copies
    assert kernels.calls == ["encode"] * 4 + ["decode"] * 4
    for x, out in zip(xs, outs):
        assert torch.equal(_bits(out), _bits(x))
    # a blob of another shape among them: found before any decoder runs
    with pytest.raises(ValueError, match="expected"):
        lossless.decode_into_many(blobs, [outs[0], outs[1], torch.empty(999, dtype=torch.bfloat16), outs[3]])
    assert kernels.calls.count("decode") == 4
    # a corrupted payload among them: the kernel's status, as the host decoder words it
    bad = blobs[2].clone()
    bad[-3] ^= 0x20
    with pytest.raises(ValueError) as error:
        lossless.decode_into_many([blobs[0], bad], [outs[0], outs[2]])
    with pytest.raises(ValueError) as host_error:
        lossless.decode(bad)
    assert str(error.value) == str(host_error.value)


def test_device_path_decodes_format_6(kernels):
    """Format version 6 (chunks whose raw fields are coded): encode(version=6) runs the encoder
    kernels and gives the host encoder's blob; beside a version 5 one, decode, decode_into and
    decode_into_many run the kernels with the workspace for its chunks with coded fields (the
    count the metadata gives), the shape still checked first; the values exact."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(16, 7168, generator=g)
    m, e = torch.frexp(x)
    x = torch.ldexp(torch.round(m * 8) / 8, e).to(torch.bfloat16)  # 2 of 6 low mantissa bits used
    blob = lossless.encode(x, chunk_values=65536, version=6)
    assert int(blob[4]) == 6 and kernels.calls == ["encode"]
    flat = _bits(x).reshape(-1).numpy()
    assert torch.equal(blob, torch.from_numpy(_host.lossless_encode(flat.ctypes.data, flat.size, list(x.shape), 65536,
                                                                    1, True, 6)))
    kernels.calls.clear()
    layout = lossless_device.layouts([blob])[0]
    assert layout.shape == (16, 7168) and layout.field_chunks == 2  # both chunks: mode 4
    assert torch.equal(_bits(lossless.decode(blob, expected_shape=(16, 7168))), _bits(x))
    with pytest.raises(ValueError, match="expected"):
        lossless.decode(blob, expected_shape=(7168, 16))
    out = torch.empty(16, 7168, dtype=torch.bfloat16)
    assert lossless.decode_into(blob, out) is out and torch.equal(_bits(out), _bits(x))
    y = torch.randn(3, 300, generator=g).to(torch.bfloat16)
    outs = [torch.empty_like(x), torch.empty_like(y)]
    lossless.decode_into_many([blob, lossless.encode(y)], outs)
    assert torch.equal(_bits(outs[0]), _bits(x)) and torch.equal(_bits(outs[1]), _bits(y))
    assert kernels.calls == ["decode", "decode", "encode", "decode", "decode"]
    # a corrupted field stream: the host decoder's error
    bad = blob.clone()
    bad[-7] ^= 0x11
    with pytest.raises(ValueError) as error:
        lossless.decode(bad)
    with pytest.raises(ValueError) as host_error:
        _host.lossless_decode(bad.numpy().ctypes.data, bad.numel(), 1, True, None)
    assert str(error.value) == str(host_error.value)
