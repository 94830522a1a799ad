"""The codec kernels' CUDA source (csrc/cuda/lossless_kernels.cu, fp8_kernels.cu) run on the CPU
through the CUDA emulation (csrc/emulation/, built by tests/support/emulated_cuda.py): the checks the GPU
tests make (tests/support/codec_kernel_cases.py: blobs byte-identical to the host encoder's, exact
decoding, the host's status for corrupted blobs; FP8 equal to the reference), on every build
variant of the decoder (default, register windows, L1 prefetch, early loads, 8 warps per block) and in both
schedule orders. This tests the kernels' logic and their warp/block synchronisation, not their
speed or the GPU's memory model (see csrc/emulation/cuda_runtime.h)."""
from __future__ import annotations

import ctypes
import os
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.codec_kernel_cases import (
    CASES,
    CHUNK_VALUES,
    CORRUPTION_CASES,
    MESSAGES,
    V5_CASES,
    V5_DECODE_CASES,
    V6_CASES,
    bits,
    blob_layout,
    check_blob_is_byte_identical_and_decodes,
    check_blob_is_byte_identical_and_decodes_tensor,
    check_rejects_corrupted_blobs_like_the_host,
    device_decode,
    device_fields_wanted,
    field_chunks,
    from_bits,
    gradient_like,
    host_status,
    many_tables,
    mixed_rows,
)
from support.emulated_cuda import build, build_racecheck, codec_library, load
from support.native import compiler
from test_codec_lossless_v5 import FORGERIES, _metadata_case, _mixed_message, forge, one_state_blob, with_chunk_values
from test_codec_lossless_v6 import _field_header, _payloads

from ep_comm.codecs import fp8, lossless

pytestmark = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler")

# the decoder's build options whose logic differs (bench/gpu_prepare.sh builds them for the GPU):
# the default decodes 16-byte aligned blobs into 16-byte aligned outputs on the staged decoder (the
# cases here are), the others on the per-step decoder with its options
VARIANTS = {
    "default": (),
    "per_step": ("EP_LOSSLESS_DEC_STAGED=0",),
    "window": ("EP_LOSSLESS_DEC_STAGED=0", "EP_LOSSLESS_DEC_WINDOW=1"),
    "prefetch": ("EP_LOSSLESS_DEC_STAGED=0", "EP_LOSSLESS_DEC_PREFETCH=256"),
    "early_loads": ("EP_LOSSLESS_DEC_STAGED=0", "EP_LOSSLESS_DEC_EARLY_LOADS=1"),
    "warps8": ("EP_LOSSLESS_DEC_STAGED=0", "EP_LOSSLESS_DEC_WARPS=8"),
}


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    out = tmp_path_factory.mktemp("emulated_kernels")
    built = {}
    for name, defines in VARIANTS.items():
        path = build("csrc/cuda/lossless_kernels.cu", out / f"lossless_{name}.so", defines)
        built[name] = codec_library(path)
    return built


@pytest.fixture(params=[0, 1], ids=["forward", "reverse"])
def schedule(request, libs):
    """Every library's launches resume threads in this order during the test."""
    for lib in libs.values():
        lib.ep_emu_set_schedule(request.param)
    yield request.param
    for lib in libs.values():
        lib.ep_emu_set_schedule(0)


@pytest.mark.parametrize("chunk_values", CHUNK_VALUES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_blob_is_byte_identical_and_decodes(libs, schedule, case: str, chunk_values: int) -> None:
    check_blob_is_byte_identical_and_decodes(libs["default"], "cpu", case, chunk_values)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "default"])
@pytest.mark.parametrize("case", ["normal", "sparse", "wide_exponents", "mixed", "zeros", "n33", "heavy_tails"])
@pytest.mark.parametrize("chunk_values", [32, 4096, 65536])
def test_decoder_variants_decode_exactly(libs, schedule, variant: str, case: str, chunk_values: int) -> None:
    check_blob_is_byte_identical_and_decodes(libs[variant], "cpu", case, chunk_values)


@pytest.mark.parametrize("variant", ["default", "per_step", "window", "early_loads"])
@pytest.mark.parametrize("case,chunk_values", CORRUPTION_CASES)
def test_rejects_corrupted_blobs_like_the_host(libs, variant: str, case: str, chunk_values: int) -> None:
    check_rejects_corrupted_blobs_like_the_host(libs[variant], "cpu", case, chunk_values, trials=60)


@pytest.mark.parametrize("variant", ["default", "per_step", "early_loads"])
@pytest.mark.parametrize("case,chunk_values", [("small_chunks", 4096), ("message", 65536)])
def test_rejects_corrupted_blobs_with_coded_fields_like_the_host(libs, variant: str, case: str,
                                                                 chunk_values: int) -> None:
    """Random damage (states, words, directory, metadata, table, truncation) to default-format
    blobs of gradients, most of whose chunks code their fields (mode 4): the host's status."""
    _, make, _, coded = next(c for c in V6_CASES if c[0] == case)
    assert field_chunks(lossless.encode(make(), chunk_values=chunk_values)) >= coded
    check_rejects_corrupted_blobs_like_the_host(libs[variant], "cpu", case, chunk_values, trials=60)


@pytest.mark.parametrize("blob_offset,out_offset", [(0, 2), (2, 0), (1, 0), (16, 16)])
def test_default_build_decodes_at_any_alignment(libs, blob_offset, out_offset):
    """The default build takes the staged decoder only for a 16-byte aligned blob and output, the
    per-step decoder (2-byte or byte loads) otherwise: every placement decodes exactly, and a
    corrupted blob gets the host's status on either decoder."""
    import ctypes

    lib = libs["default"]
    x = CASES["heavy_tails"]()
    n, cv = x.numel(), 4096
    blob = lossless.encode(x, chunk_values=cv)
    bad = blob.clone()
    bad[blob.numel() // 2] ^= 0x10
    for b, want in ((blob, 0), (bad, host_status(bad))):
        space = torch.zeros(b.numel() + 64, dtype=torch.uint8)
        start = (-space.data_ptr()) % 16 + blob_offset
        space[start:start + b.numel()] = b
        out = torch.full((n + 32,), 0x5A5A, dtype=torch.int16)
        first = ((-out.data_ptr()) % 16 + out_offset) // 2
        ws = torch.zeros(lib.ep_lossless_decode_workspace_bytes(n, cv, 0), dtype=torch.uint8)
        status = torch.full((1,), -1, dtype=torch.int32)
        rc = lib.ep_lossless_decode_cuda(space.data_ptr() + start, b.numel(), out.data_ptr() + 2 * first, n, cv, 0,
                                         int(blob[4]), status.data_ptr(), ws.data_ptr(), ws.numel(),
                                         ctypes.c_void_p(None))
        assert rc == 0 and int(status) == want, (int(status), want)
        if want == 0:
            assert torch.equal(out[first:first + n], bits(x))


@pytest.mark.parametrize("case,chunk_values", CORRUPTION_CASES)
def test_decodes_format_version_2_like_the_host(libs, case: str, chunk_values: int) -> None:
    """Blobs of the previous format (version 2: 4-byte table entries, 11-bit probabilities) still
    decode on the kernels, and their corruptions get the host's status."""
    x = CASES[case]()
    old = lossless.encode(x, chunk_values=chunk_values, version=2)
    assert int(old[4]) == 2
    status, y = device_decode(libs["default"], old, x.numel(), chunk_values, "cpu")
    assert status == 0 and torch.equal(y, bits(x))
    check_rejects_corrupted_blobs_like_the_host(libs["default"], "cpu", case, chunk_values, trials=30, version=2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case,chunk_values,tables", V5_DECODE_CASES)
def test_decodes_format_version_5(libs, schedule, variant: str, case: str, chunk_values: int, tables: int) -> None:
    """Format version 5 blobs of the host encoder decode exactly on every decoder build: messages
    whose chunks mostly carry their own frequency tables (read from the workspace) beside chunks of
    the shared one (shared memory), and blobs without extra tables (T = 0)."""
    x = {**CASES, **V5_CASES}[case]()
    blob = lossless.encode(x, chunk_values=chunk_values, version=5)
    assert int(blob[4]) == 5 and (int(blob[17]) >= tables if tables else int(blob[17]) == 0)
    status, y = device_decode(libs[variant], blob, x.numel(), chunk_values, "cpu")
    assert status == 0, MESSAGES[status]
    assert torch.equal(y, bits(x))


@pytest.mark.parametrize("variant", ["default", "per_step"])
def test_decodes_format_version_5_with_255_extra_tables(libs, variant: str) -> None:
    """320 chunks, 255 of them with a table of their own (the format's limit, the workspace's
    room): exact; the same blob with one chunk moved to the shared table (its own table then
    unused) gets the host's status."""
    x = many_tables()
    blob = lossless.encode(x, chunk_values=4096, version=5)
    assert int(blob[17]) == 255
    status, y = device_decode(libs[variant], blob, x.numel(), 4096, "cpu")
    assert status == 0 and torch.equal(y, bits(x))
    bad = forge(blob, "unused_table")
    assert MESSAGES[host_status(bad)] == "corrupted frequency table"
    assert device_decode(libs[variant], bad, x.numel(), 4096, "cpu")[0] == host_status(bad)


@pytest.mark.parametrize("variant", ["default", "per_step"])
def test_decodes_a_format_version_5_one_state_chunk_above_4096_values(libs, variant: str) -> None:
    """A blob's only chunk of 12,288 values coded with one state (version 5 at chunk_values 65536):
    exact on the kernels; the blob claiming chunk_values 8192 (one-state limit 4096) gets the
    host's status, a corrupted chunk directory."""
    x, blob = one_state_blob(12288)
    status, y = device_decode(libs[variant], blob, x.numel(), 65536, "cpu")
    assert status == 0 and torch.equal(y, bits(x))
    bad = with_chunk_values(blob, 8192)
    assert MESSAGES[host_status(bad)] == "corrupted chunk directory"
    assert device_decode(libs[variant], bad, x.numel(), 8192, "cpu")[0] == host_status(bad)


@pytest.mark.parametrize("variant", ["default", "per_step", "window", "early_loads"])
@pytest.mark.parametrize("case,chunk_values", [("mixed_rows", 4096), ("mixed_rows_tail", 7168), ("mixed", 4096),
                                               ("normal", 4096)])
def test_rejects_corrupted_format_version_5_blobs_like_the_host(libs, variant: str, case: str,
                                                                chunk_values: int) -> None:
    check_rejects_corrupted_blobs_like_the_host(libs[variant], "cpu", case, chunk_values, trials=60, version=5)


@pytest.mark.parametrize("forgery,message", FORGERIES)
def test_forged_format_version_5_blobs_get_the_host_status(libs, forgery: str, message: str) -> None:
    """tests/test_codec_lossless_v5.py's forgeries (a valid metadata checksum over a bad table
    section or directory entry): the kernels report the host's status, on either decoder."""
    x = _mixed_message()
    blob = lossless.encode(x, version=5)
    bad = forge(blob, forgery)
    want = host_status(bad)
    assert message in MESSAGES[want]
    for variant in ("default", "per_step"):
        status, _ = device_decode(libs[variant], bad, x.numel(), lossless.default_chunk_values(x.numel()), "cpu")
        assert status == want, (variant, MESSAGES[status], MESSAGES[want])


def test_every_metadata_byte_of_a_format_version_5_blob_corrupted_gets_the_host_status(libs) -> None:
    """tests/test_codec_lossless_v5.py's blob with extra tables: each byte of its header, tables and
    directory, every 13th payload byte, flipped (no new metadata checksum), and its truncations:
    the host's status on the kernels."""
    x = _metadata_case()
    blob = lossless.encode(x, chunk_values=4096, version=5)
    layout = blob_layout(blob)
    data = layout["directory"] + 16 * layout["chunks"]
    assert int(blob[17]) >= 1
    bads = []
    for pos in [*range(data), *range(data, blob.numel(), 13)]:
        bad = blob.clone()
        bad[pos] ^= 0x5A
        bads.append(bad)
    bads += [blob[:cut].clone() for cut in (1, 5, data - 1, data, blob.numel() - 1)]
    seen = set()
    for bad in bads:
        want = host_status(bad)
        status, _ = device_decode(libs["default"], bad, x.numel(), 4096, "cpu")
        assert status == want, (MESSAGES[status], MESSAGES[want])
        seen.add(want)
    assert len(seen) >= 5 and 0 not in seen, seen


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case,make,chunk_values,coded", V6_CASES, ids=[c[0] for c in V6_CASES])
def test_decodes_format_version_6(libs, schedule, variant: str, case: str, make, chunk_values: int,
                                  coded: int) -> None:
    """Format version 6 blobs of the host encoder (chunks whose raw fields are coded: mode 4 with
    32 states, mode 5 with one) decode exactly on every decoder build, with the workspace the
    metadata's count of such chunks sizes; without that room, a corrupted directory."""
    x = make()
    blob = lossless.encode(x, chunk_values=chunk_values, version=6)
    fields = field_chunks(blob)
    assert int(blob[4]) == 6 and fields >= coded
    status, y = device_decode(libs[variant], blob, x.numel(), chunk_values, "cpu", fields)
    assert status == 0, MESSAGES[status]
    assert torch.equal(y, bits(x))
    assert MESSAGES[device_decode(libs[variant], blob, x.numel(), chunk_values, "cpu", fields - 1)[0]] == \
        "corrupted chunk directory"


@pytest.mark.parametrize("case,make,chunk_values,coded", V6_CASES, ids=[c[0] for c in V6_CASES])
def test_encodes_format_version_6_like_the_host(libs, schedule, case: str, make, chunk_values: int,
                                                 coded: int) -> None:
    """The kernels' format version 6 blob is the host encoder's, byte for byte (its chunks with coded
    fields, mode 4 or 5, among them), and decodes exactly."""
    x = make()
    blob = check_blob_is_byte_identical_and_decodes_tensor(libs["default"], "cpu", x, chunk_values, version=6)
    assert int(blob[4]) == 6 and field_chunks(blob) >= coded
    # the histogram pass found chunks whose fields may code smaller: the field-coding pass ran
    again, wanted = device_fields_wanted(libs["default"], x, chunk_values, "cpu", version=6)
    assert wanted and torch.equal(again, blob)


@pytest.mark.parametrize("case,chunk_values", [("mixed_rows", 14336), ("mixed_rows", 4096), ("normal", 4096),
                                               ("sparse", 1024), ("one_state", 4096), ("zeros", 64), ("n33", 32),
                                               ("random_bits", 4096), ("mixed", 65536)])
def test_encodes_format_version_6_of_other_tensors_like_the_host(libs, case: str, chunk_values: int) -> None:
    """Tensors whose fields stay packed (activations, weights, +0.0, random bits) and messages whose
    chunks take tables of their own: the kernels' format version 6 blob is the host's."""
    x = {**CASES, **V5_CASES}[case]()
    blob = check_blob_is_byte_identical_and_decodes_tensor(libs["default"], "cpu", x, chunk_values, version=6)
    assert field_chunks(blob) == 0
    # no chunk's fields may code smaller (their sample or all of them: near 6 bits' entropy, or too
    # few): the plain rANS pass wrote the blob, rans_fields_kernel returned at once
    again, wanted = device_fields_wanted(libs["default"], x, chunk_values, "cpu", version=6)
    assert not wanted and torch.equal(again, blob)


def test_decoder_refuses_more_field_slots_than_chunks(libs) -> None:
    """A caller's count of chunks with coded fields above the chunk count (a wrong count, which
    could overflow the workspace's size) is refused at launch; the workspace size takes at most
    one slot a chunk."""
    import ctypes

    lib = libs["default"]
    x = gradient_like(2, seed=3)
    blob = lossless.encode(x, chunk_values=4096, version=6)
    n, chunks = x.numel(), -(-x.numel() // 4096)
    assert lib.ep_lossless_decode_workspace_bytes(n, 4096, 1 << 60) == lib.ep_lossless_decode_workspace_bytes(
        n, 4096, chunks)
    ws = torch.zeros(lib.ep_lossless_decode_workspace_bytes(n, 4096, chunks), dtype=torch.uint8)
    out = torch.empty(n, dtype=torch.int16)
    status = torch.full((1,), -1, dtype=torch.int32)
    rc = lib.ep_lossless_decode_cuda(blob.data_ptr(), blob.numel(), out.data_ptr(), n, 4096, chunks + 1,
                                     int(blob[4]), status.data_ptr(), ws.data_ptr(), ws.numel(), ctypes.c_void_p(None))
    assert rc != 0


@pytest.mark.parametrize("variant", ["default", "per_step"])
def test_decoder_takes_the_version_the_blob_has(libs, variant: str) -> None:
    """The caller passes the blob's version (its header's byte 4), which picks the kernels of its
    checksum (format 7's pair checksum or the older one): versions 7 and 6 of one tensor decode
    with their own; either passed for the other is kErrHeader, not a decode with the wrong
    checksum."""
    lib = libs[variant]
    x = gradient_like(2, seed=3)
    n = x.numel()
    for version in (7, 6):
        blob = lossless.encode(x, chunk_values=4096, version=version)
        slots = field_chunks(blob)
        for passed in (7, 6):
            ws = torch.zeros(lib.ep_lossless_decode_workspace_bytes(n, 4096, slots), dtype=torch.uint8)
            out = torch.full((n,), 0x5A5A, dtype=torch.int16)
            status = torch.full((1,), -1, dtype=torch.int32)
            rc = lib.ep_lossless_decode_cuda(blob.data_ptr(), blob.numel(), out.data_ptr(), n, 4096, slots, passed,
                                             status.data_ptr(), ws.data_ptr(), ws.numel(), ctypes.c_void_p(None))
            assert rc == 0
            if passed == version:
                assert int(status) == 0 and torch.equal(out, bits(x)), (version, passed)
            else:
                assert MESSAGES[int(status)] == "corrupted header", (version, passed, int(status))


@pytest.mark.parametrize("variant", ["default", "per_step", "early_loads"])
@pytest.mark.parametrize("case", ["small_chunks", "one_state"])
def test_every_field_byte_of_a_format_version_6_chunk_corrupted_gets_the_host_status(libs, variant: str,
                                                                                      case: str) -> None:
    """The first chunk with coded fields: each byte of its states, field header and table, every
    7th byte of its words, flipped; and truncations of the blob: the host's status on the kernels
    (and the values where the host decodes it)."""
    _, make, chunk_values, _ = next(c for c in V6_CASES if c[0] == case)
    x = make()
    blob = lossless.encode(x, chunk_values=chunk_values, version=6)
    fields = field_chunks(blob)
    chunk = next(c for c in _payloads(blob) if c["mode"] in (4, 5))
    f = _field_header(blob.numpy().tobytes(), chunk)
    states = 8 if chunk["mode"] == 5 else 256
    prefix_end = chunk["at"] + states + 16 + (f["table_bytes"] + 3) // 4 * 4
    bads = []
    for pos in [*range(chunk["at"], prefix_end), *range(prefix_end, chunk["at"] + chunk["size"], 7)]:
        bad = blob.clone()
        bad[pos] ^= 0x5A
        bads.append(bad)
    bads += [blob[:cut].clone() for cut in (chunk["at"] + 100, blob.numel() - 3)]
    seen = set()
    for bad in bads:
        want = host_status(bad)
        status, y = device_decode(libs[variant], bad, x.numel(), chunk_values, "cpu", fields)
        assert status == want, (MESSAGES[status], MESSAGES[want])
        if want == 0:
            assert torch.equal(y, bits(lossless.decode(bad)))
        seen.add(want)
    assert len(seen) >= 3 and 0 not in seen, seen


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kernels_have_no_data_race_between_threads_of_a_block(tmp_path, variant: str) -> None:
    """The codec kernels under ThreadSanitizer (tests/native/emulated_racecheck.cpp): no two
    threads of a block touch the same memory, one of them writing, without a barrier between them,
    in either schedule order, and every round trip is exact, as is the decoding of a format 5 blob
    of the host encoder (extra tables built by validate_kernel's warps) and of format 6 blobs
    (chunks with coded fields, 32 states and one, rebuilt by fields_kernel), whose values the
    kernels also encode to the same bytes (rans_fields_kernel's field streams). (Checked by mutation:
    without the __syncwarp after the encoder's tile store, TSan reports the race.)"""
    try:
        exe = build_racecheck(tmp_path / "racecheck", VARIANTS[variant])
    except subprocess.CalledProcessError as error:
        if "tsan" in (error.stderr or ""):
            pytest.skip(f"no ThreadSanitizer runtime: {error.stderr.strip()[-200:]}")
        raise
    x = mixed_rows(8, 4096)
    blob = lossless.encode(x, chunk_values=4096, version=5)
    assert int(blob[17]) >= 4
    (tmp_path / "v5.blob").write_bytes(blob.numpy().tobytes())
    (tmp_path / "v5.values").write_bytes(bits(x).numpy().tobytes())
    args = [str(tmp_path / "v5.blob"), str(tmp_path / "v5.values"), "4096", "0"]
    # (1-D: the racecheck encodes its values as a 1-D tensor)
    for name, x6, cv in (("v6", gradient_like(2, seed=3).reshape(-1), 4096),
                         ("v6_one", gradient_like(1, seed=2)[0, :3000], 65536)):
        blob6 = lossless.encode(x6, chunk_values=cv, version=6)
        (tmp_path / f"{name}.blob").write_bytes(blob6.numpy().tobytes())
        (tmp_path / f"{name}.values").write_bytes(bits(x6).numpy().tobytes())
        assert field_chunks(blob6) >= 1
        args += [str(tmp_path / f"{name}.blob"), str(tmp_path / f"{name}.values"), str(cv), str(field_chunks(blob6))]
    env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66"}
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0 and "FATAL: ThreadSanitizer" in done.stderr and "WARNING:" not in done.stderr:
        pytest.skip(f"ThreadSanitizer cannot run on this machine: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "0 failure(s)" in done.stdout


@st.composite
def _bf16_tensors(draw) -> torch.Tensor:
    """bf16 bit patterns of up to 20,000 values: exponents around a drawn centre with a drawn spread
    (narrow like activations, wide like the stress case), a drawn share of +0.0, signs."""
    n = draw(st.integers(0, 20000))
    seed = draw(st.integers(0, 2**31 - 1))
    centre, spread = draw(st.integers(1, 254)), draw(st.sampled_from([0, 1, 3, 8, 40, 127]))
    zeros = draw(st.sampled_from([0.0, 0.01, 0.5, 1.0]))
    g = torch.Generator().manual_seed(seed)
    exponent = (centre + torch.randint(-spread, spread + 1, (n,), generator=g)).clamp(0, 255)
    sign = torch.randint(0, 2, (n,), generator=g)
    mantissa = torch.randint(0, 128, (n,), generator=g)
    bits = (sign << 15) | (exponent << 7) | mantissa
    bits = torch.where(torch.rand(n, generator=g) < zeros, torch.zeros_like(bits), bits)
    return from_bits(bits)


@settings(max_examples=80, deadline=None)
@given(x=_bf16_tensors(), chunk_values=st.sampled_from([32, 64, 96, 160, 4096, 65536]),
       variant=st.sampled_from(sorted(VARIANTS)), reverse=st.integers(0, 1))
def test_hypothesis_kernels_give_the_host_blob_and_decode_it(libs, x, chunk_values, variant, reverse):
    libs[variant].ep_emu_set_schedule(reverse)
    try:
        check_blob_is_byte_identical_and_decodes_tensor(libs[variant], "cpu", x, chunk_values)
    finally:
        libs[variant].ep_emu_set_schedule(0)


@settings(max_examples=40, deadline=None)
@given(x=_bf16_tensors(), drop=st.sampled_from([0, 2, 4, 5, 6]),
       chunk_values=st.sampled_from([32, 1024, 4096, 65536]), reverse=st.integers(0, 1))
def test_hypothesis_kernels_give_the_host_format_6_blob(libs, x, drop, chunk_values, reverse):
    """Format 6 with the low `drop` mantissa bits cleared (fields of 6 - drop bits, as gradients'
    are): the kernels' blob is the host's (chunks with coded fields or not) and decodes."""
    x = from_bits(bits(x) & ~((1 << drop) - 1))
    libs["default"].ep_emu_set_schedule(reverse)
    try:
        check_blob_is_byte_identical_and_decodes_tensor(libs["default"], "cpu", x, chunk_values, version=6)
    finally:
        libs["default"].ep_emu_set_schedule(0)


@settings(max_examples=80, deadline=None)
@given(x=_bf16_tensors(), chunk_values=st.sampled_from([32, 96, 4096]), variant=st.sampled_from(sorted(VARIANTS)),
       seed=st.integers(0, 2**31 - 1), damaged=st.integers(1, 3))
def test_hypothesis_damaged_blobs_get_the_host_status(libs, x, chunk_values, variant, seed, damaged):
    blob = lossless.encode(x, chunk_values=chunk_values)
    g = torch.Generator().manual_seed(seed)
    bad = blob.clone()
    at = torch.randint(0, blob.numel(), (damaged,), generator=g)
    bad[at] ^= torch.randint(1, 256, (damaged,), generator=g, dtype=torch.int32).to(torch.uint8)
    status, y = device_decode(libs[variant], bad, x.numel(), chunk_values, "cpu")
    want = host_status(bad)
    assert status == want, (MESSAGES[status], MESSAGES[want])
    if want == 0:
        assert torch.equal(y, bits(x))


@pytest.fixture(scope="module")
def fp8_lib(tmp_path_factory) -> ctypes.CDLL:
    lib = load(build("csrc/cuda/fp8_kernels.cu", tmp_path_factory.mktemp("emulated_fp8") / "fp8.so"))
    vp, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ep_fp8_quantize_cuda.argtypes = [vp, i64, i64, i, i, vp, vp, vp]
    return lib


@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_fp8_kernel_is_the_reference(fp8_lib, reverse: int, round_scale: bool, use_ue8m0: bool) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 1024, generator=g) * torch.logspace(-4, 2, 1024)).to(torch.bfloat16)
    x[3] = 0
    x[5, 7] = float("nan")
    x[6, 300] = float("inf")
    q_ref, s_ref = fp8.quantize_reference(x, round_scale, use_ue8m0)
    q = torch.full(x.shape, 0x5A, dtype=torch.uint8)
    s = torch.full((s_ref.numel() * s_ref.element_size(),), 0x5A, dtype=torch.uint8)
    fp8_lib.ep_emu_set_schedule(reverse)
    try:
        rc = fp8_lib.ep_fp8_quantize_cuda(x.view(torch.int16).data_ptr(), x.shape[0], x.shape[1], int(round_scale),
                                          int(use_ue8m0), q.data_ptr(), s.data_ptr(), None)
    finally:
        fp8_lib.ep_emu_set_schedule(0)
    assert rc == 0
    assert torch.equal(q, q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref.contiguous().view(torch.uint8).reshape(-1))


def _local_statics_outside_shared_section(path) -> list[str]:
    """Function-local statics of an emulated kernel library (its kernels' __shared__ variables)
    that lie outside the section the emulation poisons before each block."""
    lines = subprocess.run(["nm", "-C", str(path)], capture_output=True, text=True, check=True).stdout.splitlines()
    symbols = [(int(line[:16], 16), line[19:]) for line in lines if len(line) > 19 and line[17] in "bBdD"]
    bounds = {name: a for a, name in symbols if name in ("__start_ep_emu_shared", "__stop_ep_emu_shared")}
    start, stop = bounds.get("__start_ep_emu_shared", 0), bounds.get("__stop_ep_emu_shared", 0)
    generated = ("guard variable", "typeinfo", "vtable")  # the compiler's, not the kernels'
    return [name for a, name in symbols
            if ")::" in name and not name.startswith(generated) and not start <= a < stop]


def test_every_shared_variable_is_poisoned(tmp_path) -> None:
    """__shared__ variables are statics the emulation poisons before each block (as shared memory
    is undefined when a block starts); a template kernel's would escape it (GCC places them
    outside the section), so none of the kernels may be a template."""
    for source in ("csrc/cuda/lossless_kernels.cu", "csrc/cuda/fp8_kernels.cu"):
        lib = build(source, tmp_path / "check.so", ("EP_LOSSLESS_DEC_WINDOW=1",))
        assert _local_statics_outside_shared_section(lib) == [], source
