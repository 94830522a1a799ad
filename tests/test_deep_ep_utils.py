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

from ep_comm.integrations.deep_ep_utils import envs, testing
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
