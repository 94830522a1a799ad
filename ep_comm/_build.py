"""What was compiled into this installation of ep_comm, and why anything is missing."""
from __future__ import annotations

import importlib
import os
import shutil


def _try_import(name: str) -> tuple[object | None, str]:
    try:
        return importlib.import_module(name), ""
    except ImportError as error:
        return None, f"{type(error).__name__}: {error}"


def _nvcc_present() -> bool:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return os.path.exists(os.path.join(home, "bin", "nvcc")) or shutil.which("nvcc") is not None


def build_info() -> dict:
    """Describes the compiled parts.

    Returns:
        ``{"host": bool, "host_reason": str, "cuda": bool, "cuda_reason": str,
        "archs": list[str], "nvshmem": bool, "nvshmem_reason": str}``: ``host`` is the CPU build of
        the C++ cores (``ep_comm._host``); ``cuda`` the kernels (``ep_comm._cuda``), built for
        ``archs`` (e.g. ``["90"]``) with or without NVSHMEM. A ``*_reason`` is empty when the
        part is present and says why otherwise.
    """
    host, host_reason = _try_import("ep_comm._host")
    cuda, cuda_error = _try_import("ep_comm._cuda")
    info: dict = {"host": host is not None, "host_reason": host_reason, "cuda": cuda is not None,
                  "cuda_reason": "", "archs": [], "nvshmem": False, "nvshmem_reason": ""}
    if cuda is None:
        why = ("nvcc was not found when ep_comm was built (EP_COMM_CUDA=1 makes that an error)"
               if not _nvcc_present() else
               "not built (EP_COMM_CUDA=0, or built before nvcc was installed: rebuild)")
        info["cuda_reason"] = f"{why}; import said {cuda_error}"
        info["nvshmem_reason"] = "ep_comm._cuda is missing"
        return info
    info["archs"] = [a for a in str(getattr(cuda, "archs", "")).split(";") if a]
    info["nvshmem"] = bool(cuda.nvshmem_built())
    info["nvshmem_reason"] = "" if info["nvshmem"] else str(getattr(cuda, "nvshmem_reason", ""))
    return info
