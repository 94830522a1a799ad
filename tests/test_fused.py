"""Choice of the fused NVIDIA kernel path (ep_comm/paths/fused.py), decided without a GPU: which
modes a Buffer may run on it given its capabilities, and which calls it takes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ep_comm.handle import DispatchState
from ep_comm.paths import CombineCall, DispatchCall, FusedKernelPath, LowLatencyDispatchCall
from ep_comm.paths.fused import FusedNormalHandle, KernelCapabilities, _nonnull
from ep_comm.placement import ExpertPlacement
from ep_comm.plan import SendPlan

GOOD = KernelCapabilities(transport="nvshmem", cuda_built=True, nvshmem_built=True, device_type="cuda",
                          hostnames=("node0",) * 4)


def _path(generation: int = 0, row_bytes: int = 0) -> FusedKernelPath:
    """A path that may run both modes, its intranode engine at ``generation`` with rows of up to
    ``row_bytes`` (0: no engine made yet); no GPU needed until a call runs."""
    path = FusedKernelPath(None, torch.device("cpu"), 1.0, 1)
    path.intranode_generation, path.intranode_row_bytes = generation, row_bytes
    return path


def _dispatch(x, topk, weights=None, codec="none", masked=False) -> DispatchCall:
    mask = torch.zeros(5, 2, dtype=torch.bool)
    return DispatchCall(x, topk, weights, mask, ExpertPlacement.contiguous(4, 2), codec, masked, 20)


def test_plan_uses_both_engines_on_one_node() -> None:
    assert FusedKernelPath.decide(GOOD) == (None, None)


@pytest.mark.parametrize("change,match", [
    (dict(transport="torch"), "torch transport"),
    (dict(cuda_built=False), "not built"),
    (dict(device_type="cpu"), "device is cpu"),
    (dict(hostnames=("node0",) * 9), "at most 8"),
    (dict(hostnames=("node0", "node0", "node1", "node1")), "span 2 hosts"),
])
def test_plan_refuses(change: dict, match: str) -> None:
    normal_no, low_latency_no = FusedKernelPath.decide(dataclasses.replace(GOOD, **change))
    assert match in normal_no and match in low_latency_no


def test_plan_without_nvshmem_keeps_the_intranode_engine_only() -> None:
    normal_no, low_latency_no = FusedKernelPath.decide(dataclasses.replace(GOOD, nvshmem_built=False))
    assert normal_no is None and "NVSHMEM" in low_latency_no
    path = FusedKernelPath(None, torch.device("cpu"), 1.0, 1, normal_no, low_latency_no)
    assert path.unavailable is None
    assert path.mode_unavailable("dispatch") is None and "NVSHMEM" in path.mode_unavailable("low_latency_dispatch")


def _topk(n: int = 5, k: int = 2) -> torch.Tensor:
    return torch.zeros(n, k, dtype=torch.int64)


def test_normal_dispatch_takes_the_kernels_for_plain_payloads() -> None:
    x = torch.zeros(5, 128, dtype=torch.bfloat16)
    assert _path().dispatch_reason(_dispatch(x, _topk(), torch.zeros(5, 2))) is None
    assert _path().dispatch_reason(_dispatch(x, _topk())) is None
    fp8 = (torch.zeros(5, 128, dtype=torch.float8_e4m3fn), torch.ones(5, 1))
    assert _path().dispatch_reason(_dispatch(fp8, _topk())) is None


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
    reason = _path().dispatch_reason(_dispatch(x, topk, weights, codec, masked))
    assert reason is not None and match in reason


def _handle(kernel=None) -> DispatchState:
    return DispatchState(buffer_id=1, send_plan=SendPlan(torch.zeros(0, dtype=torch.int64),
                                                          torch.zeros(2, dtype=torch.int64)),
                          recv_counts=torch.zeros(2, dtype=torch.int64),
                          is_token_in_rank=torch.zeros(5, 2, dtype=torch.bool), num_tokens=5,
                          num_recv_tokens=3, num_worst_tokens=0, hidden=128, num_experts=4,
                          recv_src_token_index=torch.zeros(3, dtype=torch.int64), kernel=kernel)


def test_combine_takes_the_kernels_only_for_its_own_engine() -> None:
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    fused = _handle(FusedNormalHandle(generation=2, inner=None, num_topk=2))

    def reason(handle, rows, weights=None, biases=(), codec="none", masked=False, generation=2, row_bytes=512):
        return _path(generation, row_bytes).combine_reason(CombineCall(handle, rows, weights, biases, codec, masked))

    assert reason(fused, x, torch.zeros(3, 2)) is None
    assert "did not run" in reason(_handle(), x)
    assert "did not run" in reason(fused, x, generation=3)
    assert "did not run" in reason(fused, x, row_bytes=0)  # the engine was closed
    assert "bias" in reason(fused, x, biases=(x,))
    assert "codec" in reason(fused, x, codec="lossless")
    assert "float16" in reason(fused, x.half())
    assert "do not fit" in reason(fused, x.float(), row_bytes=256)
    assert "K" in reason(fused, x, torch.zeros(3, 3))
    assert "masked" in reason(fused, x, masked=True)


def test_low_latency_reason() -> None:

    def reason(hidden: int, masked: bool) -> str | None:
        x = torch.zeros(2, hidden, dtype=torch.bfloat16)
        call = LowLatencyDispatchCall(x, torch.zeros(2, 1, dtype=torch.int64), 4, ExpertPlacement.contiguous(4, 2),
                                      False, False, False, (), masked)
        return _path().low_latency_dispatch_reason(call)

    assert reason(1024, False) is None
    assert "multiple of 128" in reason(100, False)
    assert "masked" in reason(1024, True)


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
    return buf.backend, buf.path_plan.describe(), str(buf.path_plan)


def test_a_gloo_buffer_stays_on_the_flat_path(ranks) -> None:
    for backend, described, text in ranks(2, _plan_on_gloo):
        assert backend == "torch"
        for mode, rows in described.items():
            runnable = [name for name, why in rows if why is None]
            assert runnable == ["flat"], (mode, rows)
            if mode != "cached_dispatch":
                assert "torch transport" in dict(rows)["fused kernels"]
        assert "ranks_per_node is not set" in text


def _buffer_with_bad_copy(rank, world, group):
    import ep_comm

    try:
        ep_comm.Buffer(group, intranode_copy="fast")
    except ValueError as error:
        return str(error)
    return "no error"


def test_intranode_copy_is_checked_and_reaches_the_engine(ranks, monkeypatch) -> None:
    """``Buffer(intranode_copy=...)``: anything but "ring" / "direct" is a ValueError naming the
    argument; the fused path builds its intranode engine with the chosen copy."""
    from ep_comm import engines

    for message in ranks(2, _buffer_with_bad_copy):
        assert "intranode_copy must be 'ring' or 'direct'" in message and "'fast'" in message
    made = []

    class Engine:
        def __init__(self, *args, **kwargs):
            made.append(kwargs["copy"])

    monkeypatch.setattr(engines, "IntranodeEngine", Engine)
    for copy in ("ring", "direct"):
        path = FusedKernelPath(None, torch.device("cpu"), 1.0, 1, intranode_copy=copy)
        path._intranode_engine(ExpertPlacement.contiguous(4, 2), 2, 64, 0, 4)
    assert made == ["ring", "direct"]


def _engines_with_copies(rank, world, group):
    from ep_comm.engines.intranode import IntranodeEngine

    try:
        IntranodeEngine(world, ExpertPlacement.contiguous(2 * world, world), torch.device("cpu"), 2, 64,
                        group=group, kernels=object(), copy="direct" if rank == 1 else "ring",
                        ipc_api=object())
    except ValueError as error:
        return str(error)
    return "no error"


def test_ranks_that_choose_different_copies_fail_together(ranks) -> None:
    """An engine whose ranks chose different copies raises on every rank, naming each rank's
    choice, before any buffer is allocated."""
    for message in ranks(2, _engines_with_copies):
        assert "copy must be the same on every rank" in message
        assert "rank 0 'ring'" in message and "rank 1 'direct'" in message
