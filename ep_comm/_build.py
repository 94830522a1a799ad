"""What was compiled into this installation of ep_comm, and why anything is missing; and the
loading of NVSHMEM's host library that ``ep_comm._cuda`` needs (see tools/cuda_build.py).

``ep_comm._cuda`` is linked against ``libnvshmem_host.so.3`` by soname, without a search path into
the build environment (pip deletes it after the build). Importing this module (which
``ep_comm/__init__.py`` does first) loads that library from the installed ``nvidia-nvshmem-cu13``
wheel when the extension exists, so any later ``import ep_comm._cuda`` resolves it; ``load_cuda()``
does it explicitly and is what code importing the extension should call.
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import shutil
import sys
from types import ModuleType

NVSHMEM_HOST_LIB = "libnvshmem_host.so.3"
_nvshmem_loaded: str | None = None  # path (or soname) of the host library once loaded
_nvshmem_error = ""  # why it is not loaded, when it is not


def nvshmem_wheel_lib() -> str | None:
    """``.../site-packages/nvidia/nvshmem/lib`` of the installed NVSHMEM wheel, or None."""
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return None
    for base in (list(spec.submodule_search_locations or []) if spec else []):
        lib = os.path.join(base, "lib")
        if os.path.exists(os.path.join(lib, NVSHMEM_HOST_LIB)):
            return lib
    return None


def _resident_path() -> str | None:
    """The file of the process's ``libnvshmem_host.so.3``, from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.endswith("/" + NVSHMEM_HOST_LIB):
                    return path
    except OSError:
        pass
    return None


def preload_nvshmem() -> str | None:
    """Makes ``libnvshmem_host.so.3`` resident (RTLD_GLOBAL) so that ``ep_comm._cuda``, which needs
    it by soname, imports. A library of that soname already in the process (torch's CUDA build
    loads the wheel's) is used as it is; otherwise the installed wheel's is loaded. Idempotent.

    Returns:
        the path (or soname) of the resident library, or None (the reason is kept for
        ``build_info``) when there is none: then only an extension built without NVSHMEM imports.
    """
    global _nvshmem_loaded, _nvshmem_error
    if _nvshmem_loaded is not None:
        return _nvshmem_loaded
    if not sys.platform.startswith("linux"):
        _nvshmem_error = "NVSHMEM is Linux-only"
        return None
    try:
        ctypes.CDLL(NVSHMEM_HOST_LIB, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        _nvshmem_loaded = _resident_path() or NVSHMEM_HOST_LIB  # already loaded (e.g. by torch)
        return _nvshmem_loaded
    except OSError:
        pass
    lib = nvshmem_wheel_lib()
    if lib is None:
        _nvshmem_error = f"{NVSHMEM_HOST_LIB} not found: the nvidia-nvshmem-cu13 wheel is not installed"
        return None
    path = os.path.join(lib, NVSHMEM_HOST_LIB)
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as error:
        _nvshmem_error = f"loading {path} failed: {error}"
        return None
    _nvshmem_loaded = path
    return path


def load_cuda() -> ModuleType:
    """``ep_comm._cuda``, imported after ``preload_nvshmem()``; raises ImportError as the import does
    (its message then also says why NVSHMEM's host library could not be loaded, if it could not)."""
    loaded = preload_nvshmem()
    try:
        return importlib.import_module("ep_comm._cuda")
    except ImportError as error:
        if loaded is None and NVSHMEM_HOST_LIB in str(error):
            raise ImportError(f"{error} ({_nvshmem_error})", name="ep_comm._cuda") from error
        raise


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
        "archs": list[str], "nvshmem": bool, "nvshmem_reason": str, "nvshmem_library": str}``:
        ``host`` is the CPU build of the C++ cores (``ep_comm._host``); ``cuda`` the kernels
        (``ep_comm._cuda``), built for ``archs`` (e.g. ``["90"]``) with or without NVSHMEM. A
        ``*_reason`` is empty when the part is present and says why otherwise.
        ``nvshmem_library``: with NVSHMEM, the host library in use (a path into the installed
        nvidia-nvshmem-cu13 wheel, or its soname when something else, e.g. torch, loaded it).
    """
    host, host_reason = _try_import("ep_comm._host")
    nvshmem_lib = preload_nvshmem()
    cuda, cuda_error = _try_import("ep_comm._cuda")
    info: dict = {"host": host is not None, "host_reason": host_reason, "cuda": cuda is not None,
                  "cuda_reason": "", "archs": [], "nvshmem": False, "nvshmem_reason": "",
                  "nvshmem_library": ""}
    if cuda is None:
        why = ("nvcc was not found when ep_comm was built (EP_COMM_CUDA=1 makes that an error)"
               if not _nvcc_present() else
               "not built (EP_COMM_CUDA=0, or built before nvcc was installed: rebuild)")
        if nvshmem_lib is None and NVSHMEM_HOST_LIB in cuda_error:
            why = _nvshmem_error
        info["cuda_reason"] = f"{why}; import said {cuda_error}"
        info["nvshmem_reason"] = "ep_comm._cuda is missing"
        return info
    info["archs"] = [a for a in str(getattr(cuda, "archs", "")).split(";") if a]
    info["nvshmem"] = bool(cuda.nvshmem_built())
    info["nvshmem_reason"] = "" if info["nvshmem"] else str(getattr(cuda, "nvshmem_reason", ""))
    if info["nvshmem"]:
        info["nvshmem_library"] = nvshmem_lib or ""
    return info


def _cuda_present() -> bool:
    """Whether the extension's file exists (without importing it)."""
    try:
        return bool(__package__) and importlib.util.find_spec(f"{__package__}._cuda") is not None
    except (ImportError, ValueError):
        return False


# the extension's import needs the host library first (module docstring); only when it is built
if _cuda_present():
    preload_nvshmem()
