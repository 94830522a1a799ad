"""The CUDA extension's build (CPU-only checks): ep_comm._cuda imports when built, exposes its
entry points and validates arguments before launching; build_info says what was built."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib

import pytest
import torch

from ep_comm import _build
from ep_comm.errors import CommTimeoutError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import cuda_build  # noqa: E402

ENTRY_POINTS = [
    "dispatch_layout", "intranode_notify", "intranode_dispatch", "intranode_combine",
    "intranode_meta_words", "low_latency_dispatch_send", "low_latency_dispatch_recv",
    "low_latency_combine_send", "low_latency_combine_recv", "nvshmem_built", "nvshmem_unique_id",
    "nvshmem_init", "nvshmem_malloc", "nvshmem_free", "nvshmem_ptr", "exchange_round", "launch_counted_barrier",
]


def _cuda_module():
    try:
        return _build.load_cuda()
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


def test_nvshmem_build_requirement_is_declared_for_isolated_builds() -> None:
    """pip builds in an environment holding only [build-system] requires: NVSHMEM must be there."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    pinned = [r.split(";")[0].strip().replace(" ", "") for r in requires]
    assert cuda_build.NVSHMEM_BUILD_REQUIREMENT in pinned, requires
    assert "torch" not in " ".join(pinned)  # 5 GB, and not needed to build
    # the device library linked at build time and the host library torch installs for run time
    # come from one NVSHMEM release when torch is the version the pin was taken from
    name = cuda_build.NVSHMEM_BUILD_REQUIREMENT.partition("==")[0]
    if torch.__version__.split("+")[0] == "2.14.1":
        torch_pins = [r.split(";")[0].replace(" ", "") for r in importlib.metadata.requires("torch") or []
                      if r.startswith(name)]
        assert torch_pins in ([], [cuda_build.NVSHMEM_BUILD_REQUIREMENT]), torch_pins


def _elf_dynamic(path: str) -> str:
    if shutil.which("readelf") is None:
        pytest.skip("readelf is not installed")
    return subprocess.run(["readelf", "-d", path], check=True, capture_output=True, text=True).stdout


def test_extension_search_path_never_points_into_the_build_environment() -> None:
    """pip deletes its isolated build environment: the runpath may hold only $ORIGIN-relative
    entries and directories that exist (the toolkit, NVSHMEM_HOME), and NVSHMEM's host library is
    needed by soname (ep_comm._build loads it from the installed wheel)."""
    cuda = _cuda_module()
    dynamic = _elf_dynamic(cuda.__file__)
    paths = [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines()
             if "(RUNPATH)" in line or "(RPATH)" in line]
    entries = [e for p in paths for e in p.split(":") if e]
    assert entries, dynamic
    for entry in entries:
        assert "pip-build-env" not in entry and "build-env" not in entry, entry
        assert entry.startswith("$ORIGIN") or os.path.isdir(entry), f"{entry} does not exist"
    if cuda.nvshmem_built():
        assert f"[{_build.NVSHMEM_HOST_LIB}]" in dynamic


def test_nvshmem_host_library_comes_from_the_installed_wheel() -> None:
    info = _build.build_info()
    if not info["nvshmem"]:
        pytest.skip(f"ep_comm._cuda is not built with NVSHMEM ({info['nvshmem_reason']})")
    loaded = info["nvshmem_library"]
    assert loaded and os.path.exists(loaded), info
    wheel = _build.nvshmem_wheel_lib()
    assert wheel is not None, "NVSHMEM is linked but no nvidia-nvshmem wheel is installed"
    assert os.path.samefile(loaded, os.path.join(wheel, _build.NVSHMEM_HOST_LIB))


def test_preloaded_wheel_library_lets_the_extension_load_without_torch() -> None:
    """The mechanism on its own, in a fresh interpreter that never imports torch or the ep_comm
    package (torch's CUDA build would load the same library and hide a failure):
    ``_build.preload_nvshmem()`` then the extension file."""
    cuda = _cuda_module()
    if not cuda.nvshmem_built():
        pytest.skip(f"ep_comm._cuda is built without NVSHMEM ({cuda.nvshmem_reason})")
    code = f"""
import importlib.util, sys
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
build = load("ep_comm_build", {_build.__file__!r})
print(build.preload_nvshmem())
cuda = load("ep_comm._cuda", {cuda.__file__!r})
assert cuda.nvshmem_built() and "torch" not in sys.modules
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = out.stdout.strip().splitlines()[-1]
    assert os.path.samefile(loaded, os.path.join(_build.nvshmem_wheel_lib(), _build.NVSHMEM_HOST_LIB))


def test_runtime_library_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("NVSHMEM_HOME", raising=False)
    wheel_root = str(tmp_path / "pip-build-env-x" / "site-packages" / "nvidia" / "nvshmem")
    dirs = cuda_build.runtime_library_dirs(wheel_root, "/usr/local/cuda")
    assert dirs == [*cuda_build.WHEEL_RPATHS, "/usr/local/cuda/lib64"]
    assert not any("pip-build-env" in d for d in dirs)
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path))
    assert os.path.join(str(tmp_path), "lib") in cuda_build.runtime_library_dirs(str(tmp_path), "/cuda")


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


def test_timeout_record_raises_comm_timeout_naming_peer_and_phase(host_test_module) -> None:
    """A record as the kernels write it (csrc/common/timeout.h's fill_record, through the test-only
    bindings) read back by TimeoutRecord, whose field offsets come from ep_comm._host."""
    pytest.importorskip("ep_comm._host")
    from ep_comm.engines import TimeoutRecord

    timeout_fill_record = host_test_module.timeout_fill_record

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
    from ep_comm.engines import available
    from ep_comm.transports.nvshmem import NvshmemTransport
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert NvshmemTransport.usable(object()) is False and available() is False


def test_nvshmem_transport_refuses_cpu_device() -> None:
    from ep_comm.transports.nvshmem import NvshmemTransport
    with pytest.raises(ValueError, match="needs a CUDA device"):
        NvshmemTransport(None, 1.0, torch.device("cpu"))  # type: ignore[arg-type]
