"""Combine's per-token reduction (ep_comm/row_sum.py): the C++ host sum of CPU bf16/float32 row
blocks against a plain per-row float32 loop, bit for bit, and the same result as the torch path."""
from __future__ import annotations

import ast
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from ep_comm import _host
from ep_comm.plan import SendPlan, build_send_plan
from ep_comm.rows import _host_can_sum, reduce_by_source, weighted_sum_by_token

ROOT = Path(__file__).resolve().parent.parent


def _plain_sum(rows: torch.Tensor, token_index: torch.Tensor, num_tokens: int,
               bias: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """acc[t] = ((0 + r_a) + r_b) + ... one row at a time, in row order, then biases, then cast."""
    acc = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32)
    for r in range(rows.shape[0]):
        t = int(token_index[r])
        acc[t] = acc[t] + rows[r].float()
    for b in bias:
        acc = acc + b.float()
    return acc.to(rows.dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns, every NaN one pattern (NaN payloads of a sum depend on operand order)."""
    x = torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x)
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def _plan(num_tokens: int, num_ranks: int, seed: int) -> SendPlan:
    g = torch.Generator().manual_seed(seed)
    return build_send_plan(torch.rand(num_tokens, num_ranks, generator=g) < 0.6)


def _special_rows(num_rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(num_rows, width, generator=g) * 4).to(dtype)
    flat = rows.view(-1)
    if flat.numel() == 0:
        return rows
    picks = torch.randint(0, flat.numel(), (max(1, flat.numel() // 20),), generator=g)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3e38],
                            dtype=torch.float32).to(dtype)
    flat[picks] = specials[torch.arange(picks.numel()) % specials.numel()]
    return rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens,num_ranks,width", [(0, 3, 16), (1, 1, 1), (37, 4, 200), (64, 3, 7168)])
def test_host_sum_equals_plain_loop(dtype, num_tokens, num_ranks, width):
    plan = _plan(num_tokens, num_ranks, seed=num_tokens * 7 + width)
    rows = _special_rows(plan.num_rows, width, dtype, seed=width)
    bias = (_special_rows(num_tokens, width, dtype, seed=3),)
    blocks = list(rows.split(plan.splits()))
    assert _host_can_sum(blocks, plan)
    want = _plain_sum(rows, plan.token_index, num_tokens, bias)
    got = reduce_by_source(blocks, plan, num_tokens, bias)
    assert got.dtype == dtype and got.shape == (num_tokens, width)
    assert torch.equal(_bits(got), _bits(want))


def test_host_sum_equals_torch_path_on_any_blocking():
    """One tensor, the plan's blocks, uneven blocks, blocks with 0 rows: one result, the torch
    path's (a float16 copy of the check forces that path through the same function)."""
    plan = _plan(50, 4, seed=5)
    rows = _special_rows(plan.num_rows, 96, torch.bfloat16, seed=9)
    cuts = [0, 3, 3, 40, plan.num_rows]
    uneven = [rows[a:b] for a, b in zip(cuts, cuts[1:])]
    results = [reduce_by_source(r, plan, 50, ()) for r in (rows, list(rows.split(plan.splits())), uneven)]
    for r in results[1:]:
        assert torch.equal(_bits(r), _bits(results[0]))
    # the torch path (index_add_ per destination rank) on values exact in float16
    small = torch.randint(-64, 64, (plan.num_rows, 96)).to(torch.bfloat16)
    host = reduce_by_source(small, plan, 50, ())
    torch_path = reduce_by_source(small.to(torch.float16), plan, 50, ()).to(torch.bfloat16)
    assert torch.equal(host, torch_path)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_and_duplicate_tokens(threads, monkeypatch):
    """A token may appear several times in a block (index_add_ adds each); any thread count."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(threads)
    index = torch.randint(0, 9, (40,), generator=g)
    plan = SendPlan(token_index=index, send_counts=torch.tensor([25, 15]))
    rows = _special_rows(40, 33, torch.float32, seed=11)
    got = reduce_by_source(list(rows.split([25, 15])), plan, 9, ())
    assert torch.equal(_bits(got), _bits(_plain_sum(rows, index, 9)))


def test_bad_token_index_raises():
    acc = torch.empty(4, 8)
    rows = torch.zeros(2, 8, dtype=torch.bfloat16)
    index = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="token_index holds 4"):
        _host.sum_rows_by_token(acc.data_ptr(), 4, 8, [rows.data_ptr()], [2], index.data_ptr(), 2, 0, 1)
    with pytest.raises(ValueError, match="block_rows must add up"):
        _host.sum_rows_by_token(acc.data_ptr(), 4, 8, [rows.data_ptr()], [1], index.data_ptr(), 2, 0, 1)
    with pytest.raises(ValueError, match="dtype"):
        _host.sum_rows_by_token(acc.data_ptr(), 4, 8, [rows.data_ptr()], [2], index.data_ptr(), 2, 5, 1)


def test_other_dtypes_and_layouts_take_the_torch_path():
    plan = _plan(10, 2, seed=1)
    rows = torch.randn(plan.num_rows, 8, dtype=torch.float64)
    assert not _host_can_sum([rows], plan)
    assert not _host_can_sum([torch.randn(8, plan.num_rows).t()], plan)  # not contiguous
    got = reduce_by_source(rows, plan, 10, ())
    want = torch.zeros(10, 8, dtype=torch.float64).index_add_(0, plan.token_index, rows)
    assert torch.equal(got, want)


@pytest.mark.parametrize("threads", [1, 2])
def test_weighted_sum_equals_the_torch_path(threads, monkeypatch):
    """Low-latency combine's sum: the host path against the blockwise index_add_ path (float16
    rows force it), bit for bit, with specials in rows and weights and any row order."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(threads)
    rows = _special_rows(300, 72, torch.bfloat16, seed=13)
    order = torch.randperm(300, generator=g)[:250]
    tokens = torch.randint(0, 40, (250,), generator=g)
    weights = torch.rand(250, generator=g) * 3 - 1
    weights[::17] = 0.0
    weights[5] = float("inf")
    host = weighted_sum_by_token(rows, order, tokens, weights, 40, 64)
    plain = torch.zeros(40, 72)
    for i in range(250):
        t = int(tokens[i])
        plain[t] = plain[t] + rows[order[i]].float() * weights[i]
    assert torch.equal(_bits(host), _bits(plain))
    # the torch path on values exact in float16 (float16 rows take it)
    small = torch.randint(-64, 64, (300, 72)).to(torch.bfloat16)
    want = weighted_sum_by_token(small.to(torch.float16), order, tokens, weights.round(), 40, 64)
    got = weighted_sum_by_token(small, order, tokens, weights.round(), 40, 64)
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None or shutil.which("objdump") is None,
                    reason="needs g++ and objdump on x86-64")
def test_host_build_flags_keep_fused_multiply_adds_out(tmp_path):
    """setup.py's flags compile row_reduce.cpp without FMA even for an FMA-capable target (GCC's
    C++ default would fuse `v * w` into the add there and change the low bits of the sums)."""
    import pybind11

    tree = ast.parse((ROOT / "setup.py").read_text())
    flags = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", "") == "HOST_COMPILE_ARGS" for t in node.targets))
    assert "-ffp-contract=off" in flags

    def fma_count(extra: list[str]) -> int:
        obj = tmp_path / "row_reduce.o"
        subprocess.run(["g++", "-std=c++17", "-fPIC", "-march=haswell", *extra, "-I", str(ROOT / "csrc"),
                        "-I", pybind11.get_include(), "-I", sysconfig.get_paths()["include"], "-c",
                        str(ROOT / "csrc" / "host" / "row_reduce.cpp"), "-o", str(obj)], check=True, timeout=300)
        listing = subprocess.run(["objdump", "-d", str(obj)], check=True, capture_output=True, text=True).stdout
        return listing.count("vfmadd") + listing.count("vfmsub") + listing.count("vfnmadd")

    assert fma_count(flags) == 0
    assert fma_count([f for f in flags if f != "-ffp-contract=off"]) > 0  # the check can see them
