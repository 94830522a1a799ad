"""The CUDA extension's build (CPU-only checks): ep_comm._cuda imports when built, exposes its
entry points and validates arguments before launching; build_info says what was built."""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from ep_comm import _build
from ep_comm.errors import CommTimeoutError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import cuda_build  # noqa: E402

ENTRY_POINTS = [
    "dispatch_layout", "intranode_notify", "intranode_dispatch", "intranode_combine",
    "intranode_meta_words", "low_latency_dispatch_send", "low_latency_dispatch_recv",
    "low_latency_combine_send", "low_latency_combine_recv", "nvshmem_built", "nvshmem_unique_id",
    "nvshmem_init", "nvshmem_malloc", "nvshmem_free", "nvshmem_ptr", "exchange_round",
]


def _cuda_module():
    try:
        return importlib.import_module("ep_comm._cuda")
    except ImportError as error:
        if cuda_build.find_nvcc() is None:
            pytest.skip(f"nvcc was absent, so ep_comm._cuda was not built ({error})")
        pytest.fail(f"nvcc is present but ep_comm._cuda does not import: {error}")


def test_cuda_module_imports_with_entry_points() -> None:
    cuda = _cuda_module()
    missing = [name for name in ENTRY_POINTS if not hasattr(cuda, name)]
    assert not missing, f"ep_comm._cuda lacks {missing}"
    assert cuda.max_ranks_per_launch == 8
    assert cuda.intranode_meta_words(4, 3, 5) == 4 * 3 + 5 + 1


def test_build_info_is_truthful() -> None:
    info = _build.build_info()
    assert set(info) >= {"host", "cuda", "archs", "nvshmem", "host_reason", "cuda_reason", "nvshmem_reason"}
    try:
        cuda = importlib.import_module("ep_comm._cuda")
    except ImportError:
        cuda = None
    assert info["cuda"] is (cuda is not None)
    if cuda is None:
        assert info["cuda_reason"] and not info["nvshmem"]
        return
    assert info["archs"] == str(cuda.archs).split(";") and info["archs"]
    assert info["nvshmem"] is bool(cuda.nvshmem_built())
    assert (info["nvshmem_reason"] == "") is info["nvshmem"]
    assert info["host"] is (importlib.util.find_spec("ep_comm._host") is not None)


def test_build_info_explains_a_missing_cuda_module(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _build._try_import
    monkeypatch.setattr(_build, "_try_import",
                        lambda name: (None, "ImportError: gone") if name == "ep_comm._cuda" else real(name))
    info = _build.build_info()
    assert info["cuda"] is False and "gone" in info["cuda_reason"] and info["archs"] == []
    assert info["nvshmem"] is False and info["nvshmem_reason"]


def test_launchers_validate_before_launching() -> None:
    cuda = _cuda_module()
    common = {"peers": [0] * 9}
    with pytest.raises(ValueError):
        cuda.intranode_notify(common, [{}] * 9, 0)  # more ranks than one launch holds
    with pytest.raises(ValueError, match="missing field"):
        cuda.dispatch_layout({"topk_idx": 0}, 0)


def test_nvshmem_wheel_is_found_and_linked() -> None:
    root, reason = cuda_build.find_nvshmem()
    info = _build.build_info()
    if root is None:
        assert not info["nvshmem"] or not info["cuda"], reason
        pytest.skip(reason)
    assert os.path.exists(os.path.join(root, "lib", "libnvshmem_device.a"))
    if info["cuda"]:
        assert info["nvshmem"], "the NVSHMEM wheel is installed but _cuda was built without it"


def test_build_configuration_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EP_COMM_CUDA_ARCHS", "80;sm_90")
    assert cuda_build.cuda_archs() == ["80", "90"]
    monkeypatch.setenv("EP_COMM_CUDA_ARCHS", "ninety")
    with pytest.raises(RuntimeError):
        cuda_build.cuda_archs()
    monkeypatch.setenv("EP_COMM_CUDA", "0")
    assert cuda_build.cuda_extensions() == []
    monkeypatch.setenv("EP_COMM_CUDA", "1")
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="nvcc"):
        cuda_build.cuda_extensions()


def test_timeout_record_raises_comm_timeout_naming_peer_and_phase() -> None:
    pytest.importorskip("ep_comm._host")
    from ep_comm._host import timeout_fill_record

    from ep_comm.backends.nvshmem import TimeoutRecord

    record = TimeoutRecord()
    record.check()  # a clean record is silent
    record.words.copy_(torch.tensor(timeout_fill_record(1, 2, 3, 5, 120, 0), dtype=torch.int32))
    with pytest.raises(CommTimeoutError) as caught:
        record.check(rank_names=[10, 11, 12, 13])
    assert caught.value.peers == [13] and caught.value.phase == "intranode/combine-recv"
    assert int(record.words[0]) == 0  # reset after raising
    record.words.copy_(torch.tensor(timeout_fill_record(2, 0, 1, 0, 0, 9), dtype=torch.int32))
    with pytest.raises(ValueError, match="expert 9"):
        record.check()


def test_launch_failures_surface_as_runtime_errors() -> None:
    """Without a GPU every launch fails; the binding must say so instead of returning quietly."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: launches succeed")
    cuda = _cuda_module()
    buf = torch.zeros(64, dtype=torch.int64)
    p = buf.data_ptr()
    args = {"topk_idx": p, "expert_to_rank": p, "num_tokens": 1, "num_topk": 1, "num_experts": 2,
            "num_ranks": 2, "ranks_per_node": 8, "num_tokens_per_rank": p,
            "num_tokens_per_rdma_rank": None, "num_tokens_per_expert": p, "is_token_in_rank": p}
    with pytest.raises(RuntimeError, match="dispatch_layout"):
        cuda.dispatch_layout(args, 0)


def test_nvshmem_transport_is_not_usable_without_a_gpu() -> None:
    """Buffer(backend="auto") asks this before picking NVSHMEM; on a GPU-less machine: no."""
    from ep_comm.backends.nvshmem import NvshmemTransport, available
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert NvshmemTransport.usable(object()) is False and available() is False


def test_nvshmem_transport_refuses_cpu_device() -> None:
    from ep_comm.backends.nvshmem import NvshmemTransport
    with pytest.raises(ValueError, match="needs a CUDA device"):
        NvshmemTransport(None, 1.0, torch.device("cpu"))  # type: ignore[arg-type]
