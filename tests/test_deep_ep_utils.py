"""ep_comm's ``deep_ep.utils`` helpers (ep_comm/integrations/deep_ep_utils/) on the CPU: the numeric
helpers against their definitions, the timers' results and honesty about what they measured,
``init_dist`` in fresh processes (gloo without CUDA) and the domain sizes from the ranks' hosts."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from ep_comm.integrations.deep_ep_utils import envs, gate, refs, testing
from ep_comm.integrations.deep_ep_utils import math as ep_math

# ---------------------------------------------------------------------------------------------- math


def test_calc_diff():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    assert ep_math.calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    a, b = x.double() + 1, (x + 0.01).double() + 1
    expected = 1 - 2 * float((a * b).sum()) / float((a * a + b * b).sum())
    assert ep_math.calc_diff(x, x + 0.01) == pytest.approx(expected, rel=1e-9)
    assert 0 < ep_math.calc_diff(x, x + 0.01) < 1e-3
    assert ep_math.calc_diff(torch.zeros(3), torch.zeros(3)) == pytest.approx(0.0, abs=1e-15)


def test_small_integer_helpers():
    assert ep_math.ceil_div(7, 4) == 2 and ep_math.ceil_div(8, 4) == 2
    assert ep_math.align(130, 128) == 256 and ep_math.align(128, 128) == 128
    assert ep_math.safe_div(0, 0) == 0 and ep_math.safe_div(3, 2) == 1.5
    with pytest.raises(ZeroDivisionError):
        ep_math.safe_div(1, 0)


def test_per_token_cast_to_fp8_definition():
    # row 0: block 0 has amax 896 -> scale 2; block 1 (padded: 72 of 128 channels) has amax 0 -> 1e-4
    x = torch.zeros(2, 200)
    x[0, :128] = torch.linspace(-896, 896, 128)
    x[1] = torch.randn(200, generator=torch.Generator().manual_seed(1))
    q, scales = ep_math.per_token_cast_to_fp8(x.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 200)
    assert scales.dtype == torch.float32 and scales.shape == (2, 2)
    assert scales[0, 0] == pytest.approx(2.0) and scales[0, 1] == pytest.approx(1e-4 / 448)
    blocks = x[1].to(torch.bfloat16).float()
    assert scales[1, 0] == pytest.approx(float(blocks[:128].abs().max()) / 448, rel=1e-6)
    expected = (x[0, :128].to(torch.bfloat16).float() / 2).to(torch.float8_e4m3fn)
    assert torch.equal(q[0, :128].view(torch.uint8), expected.view(torch.uint8))
    back = ep_math.per_token_cast_back(q, scales)
    assert back.dtype == torch.bfloat16 and back.shape == (2, 200)
    assert ep_math.calc_diff(back, x.to(torch.bfloat16)) < 1e-3


def test_per_token_cast_back_ue8m0_scales():
    q = torch.randn(3, 512, generator=torch.Generator().manual_seed(2)).to(torch.float8_e4m3fn)
    exponents = torch.randint(120, 135, (3, 4), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    float_scales = torch.pow(2.0, exponents.float() - 127)
    packed = exponents.view(torch.int32)  # [3, 1]: four exponents per int32, DeepEP's UE8M0 layout
    assert torch.equal(ep_math.per_token_cast_back(q, packed), ep_math.per_token_cast_back(q, float_scales))
    assert ep_math.per_token_cast_back(q[:0], float_scales[:0]).shape == (0, 512)


def test_inplace_unique():
    x = torch.tensor([[3, 1, 3, -1], [-1, -1, -1, -1], [0, 2, 1, 2]])
    ep_math.inplace_unique(x, 4)
    assert x.tolist() == [[3, 1, -1, -1], [-1, -1, -1, -1], [2, 1, 0, -1]]
    wide = torch.tensor([[0, 1, 0, 1, 1, 0]])
    ep_math.inplace_unique(wide, 2)
    assert wide.tolist() == [[1, 0, -1, -1, -1, -1]]


def test_create_grouped_scores():
    scores = torch.arange(1.0, 13.0).view(2, 6)
    out = ep_math.create_grouped_scores(scores, torch.tensor([[0], [2]]), 3)
    assert out.tolist() == [[1, 2, 0, 0, 0, 0], [0, 0, 0, 0, 11, 12]]


def test_hashes_and_byte_counts():
    t = torch.tensor([1.0, -2.5, 3.0, 0.0], dtype=torch.bfloat16)
    words = [int.from_bytes(bytes(t.view(torch.uint8)[i:i + 4].tolist()), "little", signed=True)
             for i in range(0, 8, 4)]
    assert ep_math.hash_tensor(t) == sum(words)
    u = torch.arange(4, dtype=torch.int32)
    assert ep_math.hash_tensors(t, [u, None], "text") == ep_math.hash_tensor(t) ^ ep_math.hash_tensor(u)
    assert ep_math.count_bytes(t, (u, None), None) == 8 + 16


# ---------------------------------------------------------------------------------------------- timing


def test_bench_on_cpu_times_calls_with_perf_counter():
    calls, posts = [], []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    avg, low, high = testing.bench(fn, num_warmups=2, num_tests=5, post_fn=lambda: posts.append(1))
    assert len(calls) == 7 and len(posts) == 5
    assert 0.002 <= low <= avg <= high < 1.0
    single = testing.bench(lambda: time.sleep(0.001), num_warmups=0, num_tests=1)
    assert single[0] == single[1] == single[2] >= 0.001
    with pytest.raises(ValueError, match="num_tests"):
        testing.bench(fn, num_tests=0)


def test_bench_kineto_without_kernels_reports_wall_time_and_says_so():
    def fn():
        time.sleep(0.002)

    with pytest.warns(testing.KernelTimingUnavailableWarning, match="wall time of one fn"):
        one = testing.bench_kineto(fn, "dispatch", num_tests=3)
    assert isinstance(one, float) and 0.002 <= one < 1.0
    with pytest.warns(testing.KernelTimingUnavailableWarning):
        both = testing.bench_kineto(fn, ("dispatch", "combine"), num_tests=2, suppress_kineto_output=True)
    assert isinstance(both, list) and len(both) == 2 and all(0.002 <= t < 1.0 for t in both)
    with pytest.warns(testing.KernelTimingUnavailableWarning):
        periods = testing.bench_kineto(fn, ("dispatch",), num_tests=2, num_kernels_per_period=2)
    (send, recv), = periods  # no split inside one call is known: the first entry is the call, then NaN
    assert 0.002 <= send < 1.0 and math.isnan(recv)
    with pytest.raises(ValueError, match="kernel_names"):
        testing.bench_kineto(fn, ["dispatch"])


def test_kernel_times_from_profiled_kernels():
    from types import SimpleNamespace

    def kernel(name, start, us):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, elapsed_us=lambda: us))

    # two calls, each launching dispatch twice (send, then receive) and combine once
    kernels = [kernel("ep::dispatch<1>", 0, 10.0), kernel("ep::dispatch<1>", 5, 30.0), kernel("ep::combine", 7, 4.0),
               kernel("ep::dispatch<1>", 20, 12.0), kernel("ep::dispatch<1>", 25, 34.0), kernel("ep::combine", 27, 6.0)]
    assert testing.kernel_times(kernels, ("combine",)) == [pytest.approx(5e-6)]
    (send, recv), = testing.kernel_times(kernels, ("dispatch",), num_kernels_per_period=2)
    assert send == pytest.approx(11e-6) and recv == pytest.approx(32e-6)
    combine, notify = testing.kernel_times(kernels, ("combine", "notify"))
    assert combine == pytest.approx(5e-6) and math.isnan(notify)
    assert testing.kernel_times(kernels, ("notify",)) is None
    with pytest.raises(ValueError, match="several kernels"):
        testing.kernel_times(kernels + [kernel("other_combine", 30, 1.0)], ("combine",))
    with pytest.raises(ValueError, match="periods"):
        testing.kernel_times(kernels, ("combine",), num_kernels_per_period=4)


def test_suppress_stdout_stderr_silences_file_descriptors(capfd):
    with testing.suppress_stdout_stderr():
        print("hidden")
        os.write(2, b"hidden too\n")
    print("shown")
    out, err = capfd.readouterr()
    assert out == "shown\n" and err == ""


# ---------------------------------------------------------------------------------------------- envs

_INIT_DIST_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.multiprocessing as mp

    def worker(local_rank, num_local_ranks, out_dir):
        from ep_comm.integrations.deep_ep_utils import envs
        rank, world, group = envs.init_dist(local_rank, num_local_ranks, seed=11)
        result = dict(rank=rank, world=world, group_size=group.size(),
                      backend=torch.distributed.get_backend(),
                      dtype=str(torch.get_default_dtype()), device=str(torch.get_default_device()),
                      local_seed=envs.get_local_seed(), global_seed=envs.get_global_seed(),
                      physical=envs.get_physical_domain_size(group),
                      logical=envs.get_logical_domain_size(group),
                      logical_flat=envs.get_logical_domain_size(group, allow_hybrid_mode=False))
        envs.dist_print("printed by local rank 0 only", once_in_node=True)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        torch.distributed.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1]), nprocs=2)
""")


def test_init_dist_in_fresh_processes(tmp_path):
    from support.procs import free_port

    script = tmp_path / "init_dist_job.py"
    script.write_text(_INIT_DIST_SCRIPT)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0",
               CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("printed by local rank 0 only") == 1
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == dict(rank=rank, world=2, group_size=2, backend="gloo", dtype="torch.bfloat16",
                              device="cpu", local_seed=11 + rank, global_seed=11, physical=[1, 2],
                              logical=[1, 2], logical_flat=[1, 2])


def _domain_sizes(rank, world_size, group, hosts):
    from unittest import mock

    with mock.patch("socket.gethostname", return_value=hosts[rank]):
        try:
            return (envs.get_physical_domain_size(group), envs.get_logical_domain_size(group),
                    envs.get_logical_domain_size(group, allow_hybrid_mode=False))
        except ValueError as error:
            return str(error)


@pytest.mark.parametrize("hosts,expected", [
    (("a", "a", "b", "b"), ((2, 2), (2, 2), (4, 1))),
    (("a", "a", "a", "a"), ((1, 4), (1, 4), (1, 4))),
    (("a", "b", "a", "b"), "consecutive ranks"),
])
def test_domain_sizes_follow_the_ranks_hosts(ranks, hosts, expected):
    for result in ranks(4, _domain_sizes, hosts):
        if isinstance(expected, str):
            assert isinstance(result, str) and expected in result
        else:
            assert result == expected


def test_dist_print_needs_init_dist():
    with pytest.raises(ValueError, match="init_dist"):
        envs.dist_print("x")
    assert not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="local_rank"):
            envs.init_dist(2, 2)


# ---------------------------------------------------------------------------------------------- gate


def _rank_token_counts(topk_idx: torch.Tensor, num_ranks: int, per_rank: int) -> torch.Tensor:
    hits = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool)
    hits.scatter_(1, topk_idx // per_rank, True)
    return hits.sum(0).float()


def test_scores_by_factor_and_balanced_scores():
    torch.manual_seed(0)
    scores = gate.get_scores_by_factor(64, 16, 4, 3.0)
    assert scores.dtype == torch.float32 and scores.shape == (64, 16)
    assert 1.0 < float(scores[:, :4].max()) < 3.0 and float(scores[:, 4:].max()) < 1.0
    assert float(scores.min()) >= 0
    balanced = gate.get_unbalanced_scores(64, 16, 4, 2, 1.0, False)
    assert balanced.dtype == torch.float32 and float(balanced.max()) < 1.0  # factor 1: uniform
    with pytest.raises(ValueError, match="ratio"):
        gate.get_unbalanced_scores(8, 16, 4, 2, 0.5, False)
    with pytest.raises(ValueError, match="multiple"):
        gate.get_unbalanced_scores(8, 15, 4, 2, 1.0, False)


@pytest.mark.parametrize("precise", [False, True])
def test_unbalanced_scores_load_rank_zero_by_the_ratio(precise):
    torch.manual_seed(1)
    num_tokens, num_experts, num_ranks, num_topk, ratio = 4096, 64, 8, 6, 2.0
    scores = gate.get_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio, precise)
    assert scores.shape == (num_tokens, num_experts) and scores.dtype == torch.float32
    topk_idx = scores.topk(num_topk, dim=-1).indices
    counts = _rank_token_counts(topk_idx, num_ranks, num_experts // num_ranks)
    measured = float(counts[0] / counts[1:].mean())
    assert measured == pytest.approx(ratio, rel=0.1 if precise else 0.2)
    if precise:  # the chosen experts are exactly those scoring above 0.9
        assert int((scores > 0.9).sum(1).min()) == num_topk == int((scores > 0.9).sum(1).max())


# ---------------------------------------------------------------------------------------------- refs


def test_generate_pre_combine_data_definition(monkeypatch):
    monkeypatch.setattr(refs.dist, "get_world_size", lambda *a, **k: 2)
    src = torch.tensor([0, 5, 37], dtype=torch.int32)
    y = refs.generate_pre_combine_data(src, 32, 3, 8)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 3, 8)
    max_seed = 2 * 32 * 3
    for i, s in enumerate(src.tolist()):
        for j in range(3):
            phase = ((s * 3 + j) * 131071 % max_seed + 1) / max_seed
            for c in range(8):
                expected = torch.sin(torch.tensor(phase, dtype=torch.float32) * (c + 1)
                                     + math.sin(float(envs.get_global_seed()))).to(torch.bfloat16)
                assert abs(float(y[i, j, c]) - float(expected)) <= 2 ** -7
    assert torch.equal(y, refs.generate_pre_combine_data(src, 32, 3, 8))


def test_ordered_accumulate_adds_in_slot_order_in_float32():
    data = torch.tensor([[[1.0], [2.0 ** -8], [2.0 ** -8]]], dtype=torch.bfloat16)
    # float32 keeps 1 + 2^-8 + 2^-8 = 1 + 2^-7 (a bfloat16 value); bfloat16 steps would round to 1.0 twice
    out = refs.ordered_accumulate(data)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 1) and float(out) == 1.0 + 2.0 ** -7
    assert float(refs.ordered_accumulate(data, torch.tensor([[0.5]]))) == 1.5 + 2.0 ** -7


def test_reference_combine_reduction_levels():
    # one token, 4 slots: experts 0 and 1 on rank 0, expert 5 on rank 2, slot 3 unused (y is zero there)
    topk_idx = torch.tensor([[0, 5, 1, -1]])
    y = torch.tensor([[[1.0], [3.0], [2.0 ** -8], [0.0]]], dtype=torch.bfloat16)
    bias = torch.tensor([[2.0 ** -8]], dtype=torch.bfloat16)
    # (False, False): bias and all slots in one float32 sum, rounded once
    flat = refs.combine(y, topk_idx, 1, 4, 8, bias, False, False)
    assert float(flat) == float(torch.tensor(2.0 ** -8 + 1 + 3 + 2.0 ** -8).to(torch.bfloat16))
    # (True, False): rank 0's slots 0 and 2 first become bf16(1 + 2^-8) = 1.0, so the bias is all that is left
    local = refs.combine(y, topk_idx, 1, 4, 8, bias, True, False)
    assert float(local) == float(torch.tensor(2.0 ** -8 + 3 + 1.0).to(torch.bfloat16))
    # two bias tensors are summed first; no bias at all
    assert torch.equal(refs.combine(y, topk_idx, 1, 4, 8, (bias, bias), False, False),
                       torch.tensor(2 * 2.0 ** -8 + 1 + 3 + 2.0 ** -8).to(torch.bfloat16).view(1, 1))
    assert float(refs.combine(y, topk_idx, 1, 4, 8, None, True, False)) == 4.0
    # scale-up level: 2 x 2 ranks, experts 0-3 in scale-up domain 0, 4-7 in domain 1
    assert float(refs.combine(y, topk_idx, 2, 2, 8, None, True, True)) == 4.0
    with pytest.raises(ValueError, match="reduce_in_local"):
        refs.combine(y, topk_idx, 1, 4, 8, None, False, True)


def _reference_dispatch_job(rank, world_size, group):
    g = torch.Generator().manual_seed(100 + rank)
    num_tokens, hidden, num_experts = 6 - rank, 256, 8
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    topk_idx = torch.randint(0, num_experts, (num_tokens, 2), generator=g)
    topk_idx[0, 1] = -1
    weights = torch.rand(num_tokens, 2, generator=g)
    fp8 = ep_math.per_token_cast_to_fp8(x)
    out = refs.dispatch(x, topk_idx, weights, 8, num_experts)
    out_fp8 = refs.dispatch(fp8, topk_idx, weights, 8, num_experts)
    recv_x, recv_topk, recv_w, recv_src, per_rank = out
    fp8_here = ep_math.per_token_cast_to_fp8(recv_x)[0]
    return dict(recv_x=recv_x, recv_topk=recv_topk, recv_w=recv_w, recv_src=recv_src, per_rank=per_rank,
                fp8=torch.equal(out_fp8[0][0].view(torch.uint8), fp8_here.view(torch.uint8)),
                sf_shape=tuple(out_fp8[0][1].shape))


def test_reference_dispatch_on_two_ranks(ranks):
    results = ranks(2, _reference_dispatch_job)
    inputs = []
    for rank in range(2):
        g = torch.Generator().manual_seed(100 + rank)
        n = 6 - rank
        x = torch.randn(n, 256, generator=g).to(torch.bfloat16)
        topk_idx = torch.randint(0, 8, (n, 2), generator=g)
        topk_idx[0, 1] = -1
        inputs.append((x, topk_idx, torch.rand(n, 2, generator=g)))
    for rank, result in enumerate(results):
        rows = [(src, t) for src in range(2) for t in range(inputs[src][0].shape[0])
                if ((inputs[src][1][t] // 4) == rank).any()]
        assert result["per_rank"].tolist() == [sum(1 for s, _ in rows if s == src) for src in range(2)]
        assert result["recv_src"].tolist() == [s * 8 + t for s, t in rows]
        assert result["recv_src"].dtype == torch.int32
        assert torch.equal(result["recv_x"], torch.stack([inputs[s][0][t] for s, t in rows]))
        assert torch.equal(result["recv_w"], torch.stack([inputs[s][2][t] for s, t in rows]))
        expected_topk = torch.stack([inputs[s][1][t] for s, t in rows])
        here = (expected_topk // 4 == rank) & (expected_topk >= 0)
        assert torch.equal(result["recv_topk"], torch.where(here, expected_topk - 4 * rank, -1))
        assert result["fp8"] and result["sf_shape"] == (len(rows), 2)
