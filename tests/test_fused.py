"""Choice of the fused NVIDIA kernel path (ep_comm/fused.py), decided without a GPU: which engines
a Buffer may use given its capabilities, and which calls may take them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ep_comm.fused import (
    FusedNormalHandle,
    KernelCapabilities,
    _nonnull,
    low_latency_dispatch_reason,
    normal_combine_reason,
    normal_dispatch_reason,
    plan_kernels,
)
from ep_comm.handle import DispatchHandle
from ep_comm.plan import SendPlan

GOOD = KernelCapabilities(transport="nvshmem", cuda_built=True, nvshmem_built=True, device_type="cuda",
                          hostnames=("node0",) * 4)


def test_plan_uses_both_engines_on_one_node() -> None:
    plan = plan_kernels(GOOD)
    assert plan.intranode and plan.low_latency and plan.reason == ""


@pytest.mark.parametrize("change,match", [
    (dict(transport="torch"), "torch transport"),
    (dict(cuda_built=False), "not built"),
    (dict(device_type="cpu"), "device is cpu"),
    (dict(hostnames=("node0",) * 9), "at most 8"),
    (dict(hostnames=("node0", "node0", "node1", "node1")), "span 2 hosts"),
])
def test_plan_refuses(change: dict, match: str) -> None:
    plan = plan_kernels(dataclasses.replace(GOOD, **change))
    assert not plan.intranode and not plan.low_latency
    assert match in plan.reason


def test_plan_without_nvshmem_keeps_the_intranode_engine_only() -> None:
    plan = plan_kernels(dataclasses.replace(GOOD, nvshmem_built=False))
    assert plan.intranode and not plan.low_latency and "NVSHMEM" in plan.reason


def _topk(n: int = 5, k: int = 2) -> torch.Tensor:
    return torch.zeros(n, k, dtype=torch.int64)


def test_normal_dispatch_takes_the_kernels_for_plain_payloads() -> None:
    x = torch.zeros(5, 128, dtype=torch.bfloat16)
    assert normal_dispatch_reason(x, _topk(), torch.zeros(5, 2), "none", False) is None
    assert normal_dispatch_reason(x, _topk(), None, "none", False) is None
    fp8 = (torch.zeros(5, 128, dtype=torch.float8_e4m3fn), torch.ones(5, 1))
    assert normal_dispatch_reason(fp8, _topk(), None, "none", False) is None


@pytest.mark.parametrize("x,topk,weights,codec,masked,match", [
    (torch.zeros(5, 128, dtype=torch.bfloat16), _topk(), None, "fp8", False, "codec 'fp8'"),
    (torch.zeros(5, 128, dtype=torch.bfloat16), _topk(), None, "lossless", False, "codec 'lossless'"),
    (torch.zeros(5, 128, dtype=torch.bfloat16), _topk(), None, "none", True, "masked"),
    (torch.zeros(5, 128, dtype=torch.bfloat16), None, None, "none", False, "no topk_idx"),
    (torch.zeros(5, 128, dtype=torch.bfloat16), _topk(k=33), None, "none", False, "num_topk 33"),
    (torch.zeros(5, 128, dtype=torch.bfloat16), _topk(), torch.zeros(5, 2, dtype=torch.float64), "none",
     False, "float64"),
    (torch.zeros(5, 4, dtype=torch.bfloat16), _topk(), None, "none", False, "16 bytes"),
])
def test_normal_dispatch_falls_back(x, topk, weights, codec, masked, match) -> None:
    reason = normal_dispatch_reason(x, topk, weights, codec, masked)
    assert reason is not None and match in reason


def _handle(kernel=None) -> DispatchHandle:
    return DispatchHandle(buffer_id=1, send_plan=SendPlan(torch.zeros(0, dtype=torch.int64),
                                                          torch.zeros(2, dtype=torch.int64)),
                          recv_counts=torch.zeros(2, dtype=torch.int64),
                          is_token_in_rank=torch.zeros(5, 2, dtype=torch.bool), num_tokens=5,
                          num_recv_tokens=3, num_worst_tokens=0, hidden=128, num_experts=4,
                          recv_src_token_index=torch.zeros(3, dtype=torch.int64), kernel=kernel)


def test_combine_takes_the_kernels_only_for_its_own_engine() -> None:
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    fused = _handle(FusedNormalHandle(generation=2, inner=None, num_topk=2))
    assert normal_combine_reason(fused, x, torch.zeros(3, 2), 0, "none", False, 2, 512) is None
    assert "did not run" in normal_combine_reason(_handle(), x, None, 0, "none", False, 2, 512)
    assert "did not run" in normal_combine_reason(fused, x, None, 0, "none", False, 3, 512)
    assert "bias" in normal_combine_reason(fused, x, None, 1, "none", False, 2, 512)
    assert "codec" in normal_combine_reason(fused, x, None, 0, "lossless", False, 2, 512)
    assert "float16" in normal_combine_reason(fused, x.half(), None, 0, "none", False, 2, 512)
    assert "do not fit" in normal_combine_reason(fused, x.float(), None, 0, "none", False, 2, 256)
    assert "K" in normal_combine_reason(fused, x, torch.zeros(3, 3), 0, "none", False, 2, 512)
    assert "masked" in normal_combine_reason(fused, x, None, 0, "none", True, 2, 512)


def test_low_latency_reason() -> None:
    assert low_latency_dispatch_reason(1024, False) is None
    assert "multiple of 128" in low_latency_dispatch_reason(100, False)
    assert "masked" in low_latency_dispatch_reason(1024, True)


def test_empty_tensors_still_get_an_address() -> None:
    """The kernels read 'no weights' from a null pointer; a rank with no rows must still look like
    a rank with weights, so every rank agrees on the row format."""
    empty = torch.empty(0, 4)
    assert empty.data_ptr() == 0  # why the stand-in is needed
    fixed = _nonnull(empty)
    assert fixed.shape == (1, 4) and fixed.dtype == empty.dtype and fixed.data_ptr() != 0
    full = torch.ones(2, 4)
    assert _nonnull(full) is full and _nonnull(None) is None


def _plan_on_gloo(rank, world, group):
    import ep_comm

    buf = ep_comm.Buffer(group, backend="auto")
    return buf.backend, buf.kernel_plan.intranode, buf.kernel_plan.low_latency, buf.kernel_plan.reason


def test_a_gloo_buffer_stays_on_the_transport_path(ranks) -> None:
    for backend, intranode, low_latency, reason in ranks(2, _plan_on_gloo):
        assert backend == "torch" and not intranode and not low_latency and "torch transport" in reason
