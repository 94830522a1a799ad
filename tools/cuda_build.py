"""CUDA/NVSHMEM build support for setup.py (filled in by the NVIDIA backend work).

``cuda_extensions()`` lists the CUDA extensions to build (none when nvcc is absent or
EP_COMM_CUDA=0); ``CudaBuildExt`` is a build_ext mixin that compiles them with nvcc.
"""
import os
import shutil


def find_nvcc():
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else shutil.which("nvcc")


def cuda_extensions():
    mode = os.environ.get("EP_COMM_CUDA", "auto")
    if mode == "0":
        return []
    if find_nvcc() is None:
        if mode == "1":
            raise RuntimeError("EP_COMM_CUDA=1 but nvcc was not found (set CUDA_HOME)")
        return []
    return []


class CudaBuildExt:
    """Mixin for setuptools' build_ext."""
