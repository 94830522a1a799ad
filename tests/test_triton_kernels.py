"""ep_comm.row_kernels (Triton) under Triton's interpreter, bit for bit against the CPU reference:
the float conversions on the bits, the FP8 cast (plain and fused into packing), row copies,
message packing and unpacking, the per-token sums, and the call sites in rows.py, payload.py,
codecs/fp8.py and low_latency.py that send GPU tensors to them (run on CPU tensors here by
letting ``row_kernels.usable`` accept them).

Every case runs in one spawned worker started with ``TRITON_INTERPRET=1`` (tests/support/
triton_interpreted.py says why a worker); the case functions below are what it runs.
"""
from __future__ import annotations

import contextlib
import platform
from collections import Counter

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from ep_comm.row_kernels import bits  # noqa: E402

# ---- data -------------------------------------------------------------------------------------

_TINY = {torch.bfloat16: 1e-40, torch.float16: 6e-8, torch.float32: 1e-40}  # subnormals of each dtype
_HUGE = {torch.bfloat16: 3e38, torch.float16: 6e4, torch.float32: 3e38}


def _negative_nan(dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.tensor([-0x3F], dtype=torch.int16).view(torch.bfloat16)  # 0xFFC1
    if dtype == torch.float16:
        return torch.tensor([-0x0177], dtype=torch.int16).view(torch.float16)  # 0xFE89
    return torch.tensor([-0x3EDCBA], dtype=torch.int32).view(torch.float32)  # 0xFFC12346


def _specials(dtype: torch.dtype) -> torch.Tensor:
    values = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), _TINY[dtype], -_TINY[dtype],
                           _HUGE[dtype], -_HUGE[dtype]], dtype=torch.float32).to(dtype)
    return torch.cat([values, _negative_nan(dtype)])


def _rows(num_rows: int, width: int, dtype: torch.dtype, seed: int, special_share: float = 0.03) -> torch.Tensor:
    """Random rows of ``dtype`` with NaNs (both signs), infinities, subnormals, zeros of both signs and
    huge values sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(num_rows, width, generator=g) * 3).to(dtype)
    flat = rows.view(-1)
    if flat.numel():
        picks = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * special_share)),), generator=g)
        specials = _specials(dtype)
        flat[picks] = specials[torch.arange(picks.numel()) % specials.numel()]
    return rows


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits, except that a NaN may be any NaN (sums of NaNs have no fixed payload)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaNs in different places"
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    canonical = torch.full_like(got, float("nan"))
    a = torch.where(torch.isnan(got), canonical, got).view(integer)
    b = torch.where(torch.isnan(want), canonical, want).view(integer)
    bad = (a != b).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} values differ, first at {bad[:4].tolist()}"


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Identical bytes (NaNs included)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    a, b = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    bad = (a != b).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[:4].tolist()}"


# ---- the worker ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def interp():
    from support.triton_interpreted import InterpreterWorker

    worker = InterpreterWorker()
    yield worker.run
    worker.close()


@contextlib.contextmanager
def _kernels_on_cpu():
    """Sends CPU tensors to ``ep_comm.row_kernels`` at every call site (its ``usable`` accepts
    them; the C++ host paths that CPU tensors take first are switched off) and counts the calls."""
    import ep_comm.codecs.fp8 as fp8_codec
    import ep_comm.row_kernels as rk
    import ep_comm.rows as rows

    calls: Counter = Counter()
    names = ("copy_rows", "pack_blocks", "zero_ranges", "concat_rows", "reduce_by_source",
             "weighted_sum_by_token", "quantize", "quantize_rows")
    saved = {name: getattr(rk, name) for name in names}
    saved_usable, saved_rows_host, saved_fp8_host = rk.usable, rows._host, fp8_codec._host

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return saved[name](*args, **kwargs)
        return call

    try:
        for name in names:
            setattr(rk, name, counted(name))
        rk.usable = lambda *ts: bool(ts) and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in ts)
        rows._host = None
        fp8_codec._host = None
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(rk, name, fn)
        rk.usable, rows._host, fp8_codec._host = saved_usable, saved_rows_host, saved_fp8_host


# ---- float conversions on the bits --------------------------------------------------------------

@triton.jit
def _e4m3_kernel(src, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    u = tl.load(src + i, mask=mask, other=0).to(tl.uint32, bitcast=True)
    tl.store(out + i, bits.f32_bits_to_e4m3(u).to(tl.uint8), mask=mask)


@triton.jit
def _bf16_kernel(src, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(out + i, bits.f32_to_bf16_bits(tl.load(src + i, mask=mask, other=0)), mask=mask)


@triton.jit
def _divide_kernel(x, s, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    r = bits.divide_x86_bits(tl.load(x + i, mask=mask, other=1), tl.load(s + i, mask=mask, other=1))
    tl.store(out + i, r.to(tl.int32, bitcast=True), mask=mask)


def _elementwise(kernel, out_dtype, *inputs):
    out = torch.empty(inputs[0].numel(), dtype=out_dtype)
    block = 4096
    kernel[(triton.cdiv(out.numel(), block),)](*inputs, out, out.numel(), BLOCK=block)
    return out


def _boundary_floats() -> torch.Tensor:
    """Floats within a few ulps of every e4m3 value, rounding midpoint and saturation edge, both signs."""
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3)].unique()
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    centers = torch.cat([e4m3, mids, torch.tensor([448.0, 464.0, 480.0, 2.0**-9, 2.0**-10, 2.0**-6])])
    near = (centers.abs().view(torch.int32)[:, None] + torch.arange(-4, 5, dtype=torch.int32)).clamp(min=0)
    near = near.view(torch.float32).reshape(-1)
    return torch.cat([near, -near])


def _case_e4m3_cast() -> None:
    every_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(1)
    random_bits = torch.randint(-2**31, 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([every_bf16, random_bits.view(torch.float32), _boundary_floats()]).contiguous()
    got = _elementwise(_e4m3_kernel, torch.uint8, x.view(torch.int32))
    _same_bits(got, x.to(torch.float8_e4m3fn).view(torch.uint8))


def _case_bf16_rounding() -> None:
    g = torch.Generator().manual_seed(2)
    random_bits = torch.randint(-2**31, 2**31 - 1, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = (torch.arange(-2000, 2000, dtype=torch.int32) << 15) | 0x8000  # exactly halfway, both parities
    x = torch.cat([random_bits.view(torch.float32), ties.view(torch.float32), _specials(torch.float32),
                   torch.tensor([3.3895314e38, 3.4028235e38, -3.4028235e38])]).contiguous()
    got = _elementwise(_bf16_kernel, torch.int16, x).view(torch.bfloat16)
    _same(got, x.to(torch.bfloat16))


def _case_divide_nan_rules(exact_nans: bool) -> None:
    specials = torch.cat([_specials(torch.float32), torch.tensor([1.0, -3.5, 448.0, 2.0**-126, 7e-45])])
    x = specials.repeat_interleave(specials.numel())
    s = specials.repeat(specials.numel())
    got = _elementwise(_divide_kernel, torch.int32, x, s).view(torch.float32)
    want = x / s  # torch's CPU division: the reference's
    if exact_nans:
        _same_bits(got, want)
    else:
        _same(got, want)


# ---- FP8 ---------------------------------------------------------------------------------------

_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
_FLAGS = [(False, False), (True, False), (True, True)]


def _fp8_rows(num_rows: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = _rows(num_rows, hidden, dtype, seed)
    if num_rows >= 3 and hidden >= 256:
        x[0, :128] = 0  # an all-zero group
        x[1, 128:256] = (x[1, 128:256].float() * 1e-6).to(dtype)  # amax below the 1e-4 floor
        x[2, :128] = _TINY[dtype]  # subnormals only
    return x


def _case_quantize(dtype_name: str, round_scale: bool, use_ue8m0: bool) -> None:
    from ep_comm.codecs import fp8 as codec
    from ep_comm.row_kernels import fp8

    dtype = _DTYPES[dtype_name]
    for num_rows, hidden, seed in [(0, 512, 0), (1, 512, 1), (7, 1024, 2), (3, 1536, 3)]:
        x = _fp8_rows(num_rows, hidden, dtype, seed)
        q, scales = fp8.quantize(x, round_scale, use_ue8m0)
        q_ref, scales_ref = codec.quantize_reference(x, round_scale, use_ue8m0)
        _same_bits(q.view(torch.uint8), q_ref.view(torch.uint8))
        _same_bits(scales, scales_ref)
    if not use_ue8m0:  # 3-D input, H = 128 (one group)
        x = _fp8_rows(6, 128, dtype, 9).reshape(2, 3, 128)
        q, scales = fp8.quantize(x, round_scale, use_ue8m0)
        q_ref, scales_ref = codec.quantize_reference(x, round_scale, use_ue8m0)
        _same_bits(q.view(torch.uint8), q_ref.view(torch.uint8))
        _same_bits(scales, scales_ref)


def _case_quantize_random_bits(round_scale: bool) -> None:
    """float32 rows of random bits: NaNs with payloads, inf / inf, huge and tiny quotients."""
    from ep_comm.codecs import fp8 as codec
    from ep_comm.row_kernels import fp8

    g = torch.Generator().manual_seed(5)
    bits_ = torch.randint(-2**31, 2**31 - 1, (16, 1024), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits_.view(torch.float32)
    x[3, :128] = float("inf")  # inf / inf
    x[4, 128:256] = -float("inf")
    q, scales = fp8.quantize(x, round_scale, False)
    q_ref, scales_ref = codec.quantize_reference(x, round_scale, False)
    _same_bits(q.view(torch.uint8), q_ref.view(torch.uint8))
    _same_bits(scales, scales_ref)


def _case_scale_rounding_edges() -> None:
    """float32 groups whose amax / 448 is a power of two or one to three ulps above one (the
    round-up of ``round_scale`` and UE8M0 turns on the last mantissa bit)."""
    from ep_comm.codecs import fp8 as codec
    from ep_comm.row_kernels import fp8

    powers = torch.tensor([448.0 * 2.0**k for k in range(-12, 12)], dtype=torch.float32)
    amax = (powers.view(torch.int32)[:, None] + torch.arange(0, 8, dtype=torch.int32)).view(torch.float32).reshape(-1)
    mantissa = (amax / 448.0).view(torch.int32) & 0x7FFFFF
    assert bool((mantissa == 0).any()) and bool((mantissa == 1).any())
    groups = torch.rand(amax.numel(), 128, generator=torch.Generator().manual_seed(6)) * amax[:, None]
    groups[:, 17] = -amax
    x = groups.reshape(-1, 512)
    for round_scale, use_ue8m0 in [(True, False), (True, True), (False, False)]:
        q, scales = fp8.quantize(x, round_scale, use_ue8m0)
        q_ref, scales_ref = codec.quantize_reference(x, round_scale, use_ue8m0)
        _same_bits(q.view(torch.uint8), q_ref.view(torch.uint8))
        _same_bits(scales, scales_ref)


def _case_quantize_into_message(round_scale: bool, use_ue8m0: bool) -> None:
    """Packing fused with the cast: tokens gathered by index into strided rows of a message
    (the low-latency row format), equal to quantizing every token and copying its rows."""
    from ep_comm.codecs import fp8 as codec
    from ep_comm.low_latency import _row_format
    from ep_comm.row_kernels import fp8

    hidden, topk, num_tokens, slots = 1024, 3, 9, 20
    x = _fp8_rows(num_tokens, hidden, torch.bfloat16, 11)
    token = torch.tensor([0, 2, 2, 5, 8, 3, 0, 7, 1, 4, 6])
    dest_row = torch.tensor([1, 0, 7, 19, 4, 12, 2, 15, 6, 9, 10])
    fmt = _row_format(hidden, topk, True, use_ue8m0)
    message = torch.full((slots, fmt.row_bytes), 0xAB, dtype=torch.uint8)
    want = message.clone()
    fields, want_fields = fmt.views(message), fmt.views(want)
    fp8.quantize_rows(x, token, fields["x"], fields["scales"], dest_row, round_scale, use_ue8m0)
    q_ref, scales_ref = codec.quantize_reference(x, round_scale, use_ue8m0)
    want_fields["x"][dest_row] = q_ref.view(torch.uint8)[token]
    want_fields["scales"][dest_row] = scales_ref[token]
    _same_bits(message, want)  # the other fields' bytes are untouched


# ---- row copies and messages --------------------------------------------------------------------

def _copy_cases() -> list[tuple]:
    """``(base, view, dst_index, src, src_index)``, the destination being ``view(base)``: dtypes
    whose rows move as 8, 4, 2 and 1-byte units, 16-byte aligned rows, a strided destination (a
    float32 field of message rows) filled from rows at an odd address, and no rows at all."""
    g = torch.Generator().manual_seed(3)
    cases = []
    for dtype, width in [(torch.bfloat16, 7), (torch.int64, 3), (torch.uint8, 5), (torch.float32, 64),
                         (torch.bfloat16, 4096)]:
        row_bytes = width * torch.empty(0, dtype=dtype).element_size()
        src = torch.randint(0, 255, (11, row_bytes), generator=g, dtype=torch.uint8).view(dtype)
        dst = torch.zeros(13, width, dtype=dtype)
        cases.append((dst, lambda t: t, torch.randperm(13, generator=g)[:9], src,
                      torch.randint(0, 11, (9,), generator=g)))
    message = torch.zeros(10, 20, dtype=torch.uint8)
    odd = torch.randint(0, 255, (8 * 12 + 1,), generator=g, dtype=torch.uint8)[1:].view(8, 12)
    cases.append((message, lambda t: t[:, 4:16].view(torch.float32), torch.tensor([9, 0, 4]), odd,
                  torch.tensor([7, 7, 0])))
    empty = torch.zeros(4, 6, dtype=torch.int16)
    cases.append((empty, lambda t: t, torch.zeros(0, dtype=torch.int64), torch.ones(2, 6, dtype=torch.int16),
                  torch.zeros(0, dtype=torch.int64)))
    return cases


def _case_copy_rows() -> None:
    from ep_comm.row_kernels import rowcopy

    for base, view, dst_index, src, src_index in _copy_cases():
        want_base = base.clone()
        want = view(want_base)
        want[dst_index] = src.view(torch.uint8).reshape(src.shape[0], -1).clone().view(want.dtype)[src_index]
        rowcopy.copy_rows(view(base), dst_index, src, src_index)
        _same_bits(base, want_base)


def _message_format(hidden: int, topk: int):
    from ep_comm.payload import FieldSpec, RowFormat

    return RowFormat((FieldSpec("x", torch.bfloat16, hidden), FieldSpec("src", torch.int32, 1),
                      FieldSpec("topk", torch.int32, topk), FieldSpec("weights", torch.float32, topk)))


def _case_pack_and_unpack(codec: str) -> dict:
    """payload.pack / unpack with the kernels (one launch per field, padding zeroed in one) and
    without: the same message bytes and the same unpacked fields."""
    from ep_comm.payload import RowSource, pack, unpack

    g = torch.Generator().manual_seed(4)
    hidden, topk, num_tokens = 37, 3, 12
    fmt = _message_format(hidden, topk)
    splits = [3, 0, 5, 2, 6]
    index = torch.randint(0, num_tokens, (sum(splits),), generator=g)
    x = _rows(num_tokens, hidden, torch.bfloat16, 6)
    values = {"x": RowSource(x, index), "src": RowSource(index.to(torch.int32).unsqueeze(1)),
              "topk": RowSource(torch.randint(-1, 8, (sum(splits), topk), generator=g).to(torch.int32)),
              "weights": RowSource(torch.rand(num_tokens, topk, generator=g), index)}
    want = pack(fmt, values, splits, codec)
    with _kernels_on_cpu() as calls:
        got = pack(fmt, values, splits, codec)
    _same_bits(got.data, want.data)
    assert got.byte_splits == want.byte_splits
    want_fields = unpack(fmt, want.data, splits, want.byte_splits, codec)
    with _kernels_on_cpu() as unpack_calls:
        got_fields = unpack(fmt, got.data, splits, got.byte_splits, codec)
    for name in want_fields:
        _same_bits(got_fields[name], want_fields[name])
    return {"pack": dict(calls), "unpack": dict(unpack_calls)}


# ---- sums ---------------------------------------------------------------------------------------

def _plain_sum(rows: torch.Tensor, token_index: torch.Tensor, num_tokens: int, bias=()) -> torch.Tensor:
    """acc[t] = ((0 + r_a) + r_b) + ... one row at a time, in row order, then biases, then cast."""
    acc = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32)
    for r in range(rows.shape[0]):
        t = int(token_index[r])
        acc[t] = acc[t] + rows[r].float()
    for b in bias:
        acc = acc + b.float()
    return acc.to(rows.dtype)


def _plain_weighted_sum(rows, order, tokens, weights, num_tokens) -> torch.Tensor:
    acc = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32)
    for i in range(order.numel()):
        t = int(tokens[i])
        acc[t] = acc[t] + rows[int(order[i])].float() * weights[i]
    return acc


def _case_reduce_by_source(dtype_name: str, num_bias: int) -> None:
    """Blocks that are views of one received message (another field's blocks between them),
    tokens without rows, and a tensor of all rows, against a per-row loop and the CPU path."""
    from ep_comm.plan import build_send_plan
    from ep_comm.row_kernels import reduce
    from ep_comm.rows import reduce_by_source as cpu_reduce

    dtype = _DTYPES[dtype_name]
    for num_tokens, num_ranks, width, seed in [(0, 3, 16, 0), (1, 1, 1, 1), (23, 4, 200, 2), (9, 3, 2500, 3)]:
        g = torch.Generator().manual_seed(seed)
        plan = build_send_plan(torch.rand(num_tokens, num_ranks, generator=g) < 0.6)
        rows = _rows(plan.num_rows, width, dtype, seed + 10)
        bias = tuple(_rows(num_tokens, width, bias_dtype, seed + 20 + i)
                     for i, bias_dtype in enumerate([dtype, torch.float32][:num_bias]))
        want = _plain_sum(rows, plan.token_index, num_tokens, bias)
        _same(cpu_reduce(rows, plan, num_tokens, bias), want)
        # the rows as they arrive: per source rank, [x block][weights block] in one buffer
        splits = plan.splits()
        row_bytes = width * rows.element_size()
        message = torch.zeros(sum(n * (row_bytes + 8) for n in splits) + 8, dtype=torch.uint8)
        blocks, position, start = [], 8, 0
        for n in splits:
            block = message[position:position + n * row_bytes].view(dtype).view(n, width)
            block.copy_(rows[start:start + n])
            blocks.append(block)
            position += n * (row_bytes + 8)
            start += n
        for given in (blocks, [rows]):
            got = reduce.reduce_by_source(given, plan.token_index, num_tokens, bias)
            _same(got, want)


def _case_weighted_sum(shuffle_tokens: bool) -> None:
    from ep_comm.row_kernels import reduce

    g = torch.Generator().manual_seed(7)
    num_tokens, topk, hidden = 13, 4, 300
    tokens = torch.arange(num_tokens).repeat_interleave(torch.randint(0, topk + 1, (num_tokens,), generator=g))
    if shuffle_tokens:  # not grouped by token: each token's entries still summed in their order
        tokens = tokens[torch.randperm(tokens.numel(), generator=g)]
    order = torch.randperm(tokens.numel(), generator=g)
    rows = _rows(tokens.numel() + 3, hidden, torch.bfloat16, 8)
    weights = torch.rand(tokens.numel(), generator=g) * 2 - 0.5
    weights[:3] = torch.tensor([0.0, -0.0, 1e-30])
    want = _plain_weighted_sum(rows, order, tokens, weights, num_tokens)
    _same(reduce.weighted_sum_by_token(rows, order, tokens, weights, num_tokens), want)


# ---- call sites --------------------------------------------------------------------------------

def _case_rows_call_sites() -> dict:
    """rows.copy_rows / reduce_by_source / weighted_sum_by_token and codecs.fp8.quantize send
    their tensors to the kernels and give the CPU paths' results."""
    from ep_comm.codecs import fp8 as codec
    from ep_comm.plan import build_send_plan
    from ep_comm.rows import copy_rows, reduce_by_source, weighted_sum_by_token

    g = torch.Generator().manual_seed(12)
    plan = build_send_plan(torch.rand(17, 4, generator=g) < 0.5)
    rows = _rows(plan.num_rows, 96, torch.bfloat16, 13)
    bias = (_rows(17, 96, torch.bfloat16, 14),)
    tokens = plan.token_index.sort(stable=True).values
    order = torch.randperm(plan.num_rows, generator=g)
    weights = torch.rand(plan.num_rows, generator=g)
    x = _fp8_rows(5, 512, torch.bfloat16, 15)
    dst, dst_index = torch.zeros(80, 96, dtype=torch.bfloat16), torch.randperm(80, generator=g)[:plan.num_rows]

    want = (reduce_by_source(list(rows.split(plan.splits())), plan, 17, bias),
            weighted_sum_by_token(rows, order, tokens, weights, 17, 8), codec.quantize(x, True, True))
    want_dst = dst.clone()
    copy_rows(want_dst, dst_index, rows, order)
    with _kernels_on_cpu() as calls:
        got = (reduce_by_source(list(rows.split(plan.splits())), plan, 17, bias),
               weighted_sum_by_token(rows, order, tokens, weights, 17, 8), codec.quantize(x, True, True))
        copy_rows(dst, dst_index, rows, order)
    _same(got[0], want[0])
    _same(got[1], want[1])
    _same_bits(got[2][0].view(torch.uint8), want[2][0].view(torch.uint8))
    _same_bits(got[2][1], want[2][1])
    _same_bits(dst, want_dst)
    return dict(calls)


class _Loopback:
    """A one-rank transport: every exchange returns what was sent."""

    name = "loopback"

    def __init__(self) -> None:
        from ep_comm.transports.base import PendingExchange

        self._pending = PendingExchange
        self.rank, self.num_ranks, self.device, self.num_collectives = 0, 1, torch.device("cpu"), 0

    def exchange_bytes(self, send, send_splits, recv_splits, phase, out=None):
        assert send_splits == recv_splits, phase
        self.num_collectives += 1
        received = send.clone() if out is None else out.copy_(send)
        return self._pending(lambda: received)

    def exchange_counts(self, counts, phase):
        self.num_collectives += 1
        return counts.clone()


def _routing(num_tokens: int, num_experts: int, topk: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    topk_idx = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(num_tokens)])
    topk_idx[torch.rand(num_tokens, topk, generator=g) < 0.2] = -1
    topk_idx[0] = -1  # a token routed nowhere
    return topk_idx, torch.rand(num_tokens, topk, generator=g)


def _case_low_latency_loopback(use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> dict:
    """A low-latency dispatch and combine on one rank: with the kernels (FP8 fused into the send
    slots, slot placement, the weighted sum) the same received slots and combined rows."""
    from ep_comm import low_latency
    from ep_comm.codecs import fp8 as codec
    from ep_comm.placement import ExpertPlacement

    placement = ExpertPlacement.contiguous(4, 1)
    num_tokens, max_tokens, hidden = 7, 8, 512
    x = _fp8_rows(num_tokens, hidden, torch.bfloat16, 21)
    topk_idx, topk_weights = _routing(num_tokens, 4, 3, 22)

    def run():
        out = low_latency.dispatch(_Loopback(), x, topk_idx, max_tokens, placement, use_fp8, round_scale, use_ue8m0)
        out.receive()
        counts = out.recv_count.tolist()
        received = out.recv_x if isinstance(out.recv_x, tuple) else (out.recv_x,)
        slots = [torch.cat([t[j, :c] for j, c in enumerate(counts)]) for t in received]
        y = torch.zeros(4, max_tokens, hidden, dtype=torch.bfloat16)
        for j, c in enumerate(counts):
            if use_fp8:
                scales = out.recv_x[1][j, :c].clone(memory_format=torch.contiguous_format)  # column-major there
                y[j, :c] = codec.dequantize(out.recv_x[0][j, :c], scales) * (j + 1)
            else:
                y[j, :c] = out.recv_x[j, :c] * (j + 1)
        finish, _ = low_latency.combine(_Loopback(), y, topk_idx, topk_weights, out.state, placement)
        return counts, slots, finish()

    want = run()
    with _kernels_on_cpu() as calls:
        got = run()
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        _same_bits(a, b)
    _same(got[2], want[2])
    return dict(calls)


def _case_normal_loopback(codec_name: str) -> dict:
    """A normal dispatch and combine (with a bias and weights) on one rank, with and without the kernels."""
    from ep_comm import normal
    from ep_comm.codecs import fp8 as codec
    from ep_comm.layout import token_rank_mask
    from ep_comm.placement import ExpertPlacement

    placement = ExpertPlacement.contiguous(4, 1)
    num_tokens, hidden = 9, 256
    x = _fp8_rows(num_tokens, hidden, torch.bfloat16, 31)
    topk_idx, topk_weights = _routing(num_tokens, 4, 2, 32)
    bias = (_rows(num_tokens, hidden, torch.bfloat16, 33),)

    def run():
        transport = _Loopback()
        out = normal.dispatch(transport, 0, x, topk_idx, topk_weights, token_rank_mask(topk_idx, placement),
                              placement, codec_name)
        recv_x = codec.dequantize(*out.x) if isinstance(out.x, tuple) else out.x
        combined, combined_w, _ = normal.combine(transport, out.handle, recv_x * 3, out.topk_weights, bias, "none")
        received = list(out.x) if isinstance(out.x, tuple) else [out.x]
        return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                for t in (*received, out.topk_idx, out.topk_weights)], (combined, combined_w)

    want = run()
    with _kernels_on_cpu() as calls:
        got = run()
    for a, b in zip(got[0], want[0]):
        _same_bits(a, b)
    for a, b in zip(got[1], want[1]):
        _same(a, b)
    return dict(calls)


def _case_gpu_benchmark_dry_run() -> int:
    """bench/triton_rows.py's operations and checks on tiny CPU inputs (its --device cpu run)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "triton_rows.py"
    spec = importlib.util.spec_from_file_location("triton_rows_bench", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclass looks its module up
    spec.loader.exec_module(bench)
    return bench.main(["--device", "cpu", "--tokens", "24", "--hidden", "512", "--ranks", "4", "--topk", "3"])


# ---- tests -------------------------------------------------------------------------------------

def test_e4m3_cast_on_the_bits(interp):
    interp(_case_e4m3_cast)


def test_bf16_rounding_on_the_bits(interp):
    interp(_case_bf16_rounding)


def test_division_keeps_the_cpus_nan_rules(interp):
    interp(_case_divide_nan_rules, platform.machine().lower() in ("x86_64", "amd64"))


@pytest.mark.parametrize("dtype_name", list(_DTYPES))
@pytest.mark.parametrize("round_scale,use_ue8m0", _FLAGS)
def test_quantize_equals_reference(interp, dtype_name, round_scale, use_ue8m0):
    interp(_case_quantize, dtype_name, round_scale, use_ue8m0)


@pytest.mark.parametrize("round_scale", [False, True])
def test_quantize_random_float32_bits(interp, round_scale):
    interp(_case_quantize_random_bits, round_scale)


def test_scale_rounding_edges(interp):
    interp(_case_scale_rounding_edges)


@pytest.mark.parametrize("round_scale,use_ue8m0", _FLAGS)
def test_quantize_fused_into_message_rows(interp, round_scale, use_ue8m0):
    interp(_case_quantize_into_message, round_scale, use_ue8m0)


def test_copy_rows(interp):
    interp(_case_copy_rows)


@pytest.mark.parametrize("codec", ["none", "lossless"])
def test_pack_and_unpack_messages(interp, codec):
    calls = interp(_case_pack_and_unpack, codec)
    assert calls["pack"]["pack_blocks"] == (4 if codec == "none" else 3)
    assert calls["pack"]["zero_ranges"] == 1
    assert calls["unpack"]["concat_rows"] == (4 if codec == "none" else 3)  # a lossless payload is decoded in place


@pytest.mark.parametrize("dtype_name", list(_DTYPES))
@pytest.mark.parametrize("num_bias", [0, 1, 2])
def test_reduce_by_source(interp, dtype_name, num_bias):
    interp(_case_reduce_by_source, dtype_name, num_bias)


@pytest.mark.parametrize("shuffle_tokens", [False, True])
def test_weighted_sum_by_token(interp, shuffle_tokens):
    interp(_case_weighted_sum, shuffle_tokens)


def test_rows_and_fp8_call_sites_use_the_kernels(interp):
    calls = interp(_case_rows_call_sites)
    assert calls == {"reduce_by_source": 1, "weighted_sum_by_token": 1, "quantize": 1, "copy_rows": 1}


@pytest.mark.parametrize("use_fp8,round_scale,use_ue8m0", [(False, False, False), *[(True, *f) for f in _FLAGS]])
def test_low_latency_with_the_kernels(interp, use_fp8, round_scale, use_ue8m0):
    calls = interp(_case_low_latency_loopback, use_fp8, round_scale, use_ue8m0)
    assert calls.get("quantize_rows", 0) == (1 if use_fp8 else 0)
    assert calls["weighted_sum_by_token"] == 1
    # sending: the payload (bf16 only) and the combine rows; receiving: each field into the slots
    # at least the received payload rows into their slots and the combine's rows (bf16: also the
    # payload into the send slots, which FP8 quantizes into them instead)
    assert calls["copy_rows"] >= (3 if not use_fp8 else 2)


@pytest.mark.parametrize("codec_name", ["none", "fp8"])
def test_normal_mode_with_the_kernels(interp, codec_name):
    calls = interp(_case_normal_loopback, codec_name)
    assert calls["pack_blocks"] == (5 if codec_name == "fp8" else 4) + 2  # dispatch's fields, combine's x and weights
    assert calls["reduce_by_source"] == 2
    assert calls.get("quantize", 0) == (1 if codec_name == "fp8" else 0)


def test_cpu_tensors_and_the_switch_keep_torch(monkeypatch):
    """The kernels take GPU tensors only, and never with EP_COMM_TRITON=0."""
    from ep_comm import row_kernels

    assert not row_kernels.usable(torch.zeros(2))
    assert not row_kernels.usable()
    if torch.cuda.is_available():
        assert row_kernels.usable(torch.zeros(2, device="cuda"))
        monkeypatch.setenv("EP_COMM_TRITON", "0")
        assert not row_kernels.usable(torch.zeros(2, device="cuda"))


def test_gpu_benchmark_runs_its_checks(interp):
    """bench/triton_rows.py (run by bench/gpu_check.sh on a lent GPU) works: every operation runs
    and matches the CPU reference."""
    assert interp(_case_gpu_benchmark_dry_run) == 0
