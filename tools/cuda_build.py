"""CUDA/NVSHMEM build support for setup.py.

``cuda_extensions()`` lists the CUDA extension ``ep_comm._cuda`` (none when nvcc is absent or
EP_COMM_CUDA=0); ``CudaBuildExt`` is a build_ext mixin that builds it with nvcc:

1. every ``csrc/cuda/*.cu`` -> object with ``-rdc=true`` (in parallel, one nvcc per core),
2. ``nvcc -dlink`` of those objects against NVSHMEM's ``libnvshmem_device.a``,
3. ``csrc/cuda_bindings/*.cpp`` (pybind11, no torch/CUDA headers) -> objects with g++,
4. one ``g++ -shared`` link (see "How NVSHMEM is found" for its runtime search path).

Objects are reused when newer than their sources and every header under ``csrc/``.

How NVSHMEM is found:
    Build time: ``pip install`` builds in an isolated environment that holds only the
    ``[build-system] requires`` of pyproject.toml, which include ``NVSHMEM_BUILD_REQUIREMENT`` (the
    ``nvidia-nvshmem-cu13`` version torch depends on), so the headers and the static
    ``libnvshmem_device.a`` come from there (``find_nvshmem`` searches sys.path in order, then the
    target environment's site-packages, for ``setup.py build_ext --inplace`` without isolation).
    The device library is linked statically; the host library ``libnvshmem_host.so.3`` is linked
    by soname only.
    Run time: the isolated environment is deleted after the build, so nothing may point into it:
    the extension's runpath holds only ``$ORIGIN/../nvidia/nvshmem/lib`` and
    ``$ORIGIN/../nvidia/cu13/lib`` (the wheels' places next to a regular, non-editable install),
    ``$NVSHMEM_HOME/lib`` when NVSHMEM_HOME was used, and the toolkit's lib64. Whatever imports
    ``ep_comm`` first runs ``ep_comm._build``, which loads ``libnvshmem_host.so.3`` from the
    INSTALLED ``nvidia-nvshmem-cu13`` wheel (``nvidia.nvshmem`` package path, RTLD_GLOBAL) unless
    the process already has one (torch's CUDA build loads the same file); the dynamic linker then
    resolves the extension's ``libnvshmem_host.so.3`` to that loaded library by its soname.
    ``ep_comm._build.load_cuda()`` does the same explicitly.

Environment (read at build time only):
    EP_COMM_CUDA=0 skips the CUDA build; EP_COMM_CUDA=1 makes a missing toolkit an error.
    EP_COMM_CUDA_ARCHS="90" (default), e.g. "80;90". sm_80 objects leave out Hopper-only code.
    EP_COMM_NVSHMEM=0 builds without NVSHMEM even when the wheel is found; NVSHMEM_HOME points at
    an NVSHMEM install (include/, lib/) other than the nvidia-nvshmem-cu13 wheel (linked with an
    rpath to $NVSHMEM_HOME/lib; with pip, add --no-build-isolation or keep the pinned wheel's
    version the same, since the device and host libraries must come from one release).
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_EXT = "ep_comm._cuda"
# the NVSHMEM wheel pyproject.toml's [build-system] requires lists (tests check the two agree): the
# version torch 2.14.1 depends on, so the device library linked here matches the host library
# that torch installs and ep_comm loads at run time
NVSHMEM_BUILD_REQUIREMENT = "nvidia-nvshmem-cu13==3.4.5"
NVSHMEM_HOST_LIB = "libnvshmem_host.so.3"
# runtime search path entries relative to the extension (site-packages/ep_comm/_cuda*.so)
WHEEL_RPATHS = ["$ORIGIN/../nvidia/nvshmem/lib", "$ORIGIN/../nvidia/cu13/lib"]


def cuda_home() -> str:
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"


def find_nvcc() -> str | None:
    path = os.path.join(cuda_home(), "bin", "nvcc")
    return path if os.path.exists(path) else shutil.which("nvcc")


def cuda_archs() -> list[str]:
    raw = os.environ.get("EP_COMM_CUDA_ARCHS", "90")
    archs = [a.strip().replace("sm_", "").replace(".", "") for a in raw.replace(",", ";").split(";")]
    archs = [a for a in archs if a]
    for a in archs:
        if not a.rstrip("a").isdigit():
            raise RuntimeError(f"EP_COMM_CUDA_ARCHS: bad architecture {a!r} (expected e.g. '80;90')")
    return archs


def _site_dirs() -> list[str]:
    """Directories to search for the nvidia-* wheels, in order: sys.path (under pip's build
    isolation: the build environment with the pinned build requirements), then the target
    environment's site-packages (sys.prefix is the target environment even when pip builds in an
    isolated one, whose sys.path hides the user's packages)."""
    dirs = [d for d in sys.path if d]
    for key in ("purelib", "platlib"):
        dirs.append(sysconfig.get_paths()[key])
    for prefix in (sys.prefix, os.environ.get("VIRTUAL_ENV", ""), sys.base_prefix):
        if prefix:
            dirs += sorted(glob.glob(os.path.join(prefix, "lib", "python3*", "site-packages")))
    seen: set[str] = set()
    return [d for d in dirs if not (d in seen or seen.add(d))]


def find_nvshmem() -> tuple[str | None, str]:
    """Returns (NVSHMEM root with include/ and lib/, reason when missing)."""
    if os.environ.get("EP_COMM_NVSHMEM", "auto") == "0":
        return None, "disabled by EP_COMM_NVSHMEM=0"
    candidates = [os.environ.get("NVSHMEM_HOME", "")]
    candidates += [os.path.join(base, "nvidia", "nvshmem") for base in _site_dirs()]
    for root in candidates:
        if not root:
            continue
        lib = os.path.join(root, "lib")
        if (os.path.exists(os.path.join(root, "include", "nvshmem.h"))
                and os.path.exists(os.path.join(lib, "libnvshmem_device.a"))
                and os.path.exists(os.path.join(lib, NVSHMEM_HOST_LIB))):
            return root, ""
    return None, f"NVSHMEM headers/libraries not found (pip install {NVSHMEM_BUILD_REQUIREMENT})"


def runtime_library_dirs(nvshmem: str | None, cuda_home_dir: str) -> list[str]:
    """The extension's runpath: never a directory of pip's temporary build environment (see the
    module docstring); the wheels' libraries are found relative to the installed extension or
    loaded by ep_comm._build before the extension is imported."""
    rpaths = list(WHEEL_RPATHS)
    home = os.environ.get("NVSHMEM_HOME", "")
    if nvshmem and home and os.path.abspath(nvshmem) == os.path.abspath(home):
        rpaths.append(os.path.join(os.path.abspath(home), "lib"))
    rpaths.append(os.path.join(cuda_home_dir, "lib64"))
    return rpaths


def cuda_extensions() -> list[Extension]:
    mode = os.environ.get("EP_COMM_CUDA", "auto")
    if mode == "0":
        return []
    if find_nvcc() is None:
        if mode == "1":
            raise RuntimeError("EP_COMM_CUDA=1 but nvcc was not found (set CUDA_HOME)")
        print("ep_comm: nvcc not found, skipping ep_comm._cuda (set CUDA_HOME or EP_COMM_CUDA=1)")
        return []
    sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    sources += sorted(glob.glob(os.path.join("csrc", "cuda_bindings", "*.cpp")))
    return [Extension(CUDA_EXT, sources)]


def _newer(target: str, deps: list[str]) -> bool:
    if not os.path.exists(target):
        return False
    t = os.path.getmtime(target)
    return all(os.path.getmtime(d) <= t for d in deps)


def _run(cmd: list[str], env: dict[str, str]) -> None:
    print(" ".join(cmd), flush=True)
    result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.stdout:
        print(result.stdout, flush=True)
    if result.returncode != 0:
        raise RuntimeError(f"command failed ({result.returncode}): {' '.join(cmd[:3])} ...")


class CudaBuildExt:
    """Mixin for setuptools' build_ext: builds ``ep_comm._cuda`` with nvcc, the rest as usual."""

    def build_extension(self, ext: Extension) -> None:  # type: ignore[override]
        if ext.name != CUDA_EXT:
            super().build_extension(ext)  # type: ignore[misc]
            return
        self._build_cuda(ext)

    def _build_cuda(self, ext: Extension) -> None:
        import pybind11

        nvcc = find_nvcc()
        if nvcc is None:
            raise RuntimeError("nvcc vanished between configuration and build")
        home = os.path.dirname(os.path.dirname(nvcc))
        env = dict(os.environ)  # the build's subprocess env only, never the user's os.environ
        env.setdefault("CUDA_HOME", home)
        archs = cuda_archs()
        nvshmem, nvshmem_reason = find_nvshmem()
        temp = os.path.join(self.build_temp, "ep_comm_cuda")  # type: ignore[attr-defined]
        os.makedirs(temp, exist_ok=True)
        headers = glob.glob(os.path.join(HERE, "csrc", "**", "*.h"), recursive=True)
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        common = ["-std=c++17", "-O3", "-I", os.path.join(HERE, "csrc")]
        nv_flags = [*common, "-rdc=true", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr",
                    "-lineinfo", *gencode]
        if nvshmem:
            nv_flags += ["-DEP_COMM_WITH_NVSHMEM", "-I", os.path.join(nvshmem, "include")]
        cu_sources = [s for s in ext.sources if s.endswith(".cu")]
        cpp_sources = [s for s in ext.sources if s.endswith(".cpp")]
        stamp = "_".join(archs) + ("_nvshmem" if nvshmem else "")

        def obj_of(src: str) -> str:
            return os.path.join(temp, os.path.basename(src) + f".{stamp}.o")

        archs_str = ";".join(archs)
        defines = [f'-DEP_COMM_CUDA_ARCHS="{archs_str}"', f"-DEP_COMM_NVSHMEM={1 if nvshmem else 0}",
                   f'-DEP_COMM_NVSHMEM_REASON="{nvshmem_reason}"']
        cxx = os.environ.get("CXX", "g++")
        py_inc = sysconfig.get_paths()["include"]

        def compile_one(src: str) -> str:
            obj = obj_of(src)
            if _newer(obj, [src, *headers]):
                return obj
            if src.endswith(".cu"):
                _run([nvcc, *nv_flags, "-c", src, "-o", obj], env)
            else:
                _run([cxx, "-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-I",
                      os.path.join(HERE, "csrc"), "-I", pybind11.get_include(), "-I", py_inc,
                      *defines, "-c", src, "-o", obj], env)
            return obj

        # .cu files first (the slow ones start earliest), one job per core
        jobs = sorted(cu_sources, key=os.path.getsize, reverse=True) + cpp_sources
        with ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 1)) as pool:
            objs = list(pool.map(compile_one, jobs))
        cu_objs = [obj_of(s) for s in cu_sources]
        cpp_objs = [obj_of(s) for s in cpp_sources]

        dlink = os.path.join(temp, f"dlink.{stamp}.o")
        if not _newer(dlink, cu_objs):
            cmd = [nvcc, "-dlink", "-Xcompiler", "-fPIC", *gencode, *cu_objs, "-o", dlink]
            if nvshmem:
                cmd[2:2] = ["-L", os.path.join(nvshmem, "lib"), "-lnvshmem_device"]
            _run(cmd, env)

        out = self.get_ext_fullpath(ext.name)  # type: ignore[attr-defined]
        os.makedirs(os.path.dirname(out), exist_ok=True)
        link = [cxx, "-shared", "-o", out, *cu_objs, dlink, *cpp_objs]
        if nvshmem:
            # device library statically; host library by soname (DT_NEEDED libnvshmem_host.so.3)
            link += ["-L", os.path.join(nvshmem, "lib"), "-l:libnvshmem_device.a", f"-l:{NVSHMEM_HOST_LIB}"]
        link += ["-L", os.path.join(home, "lib64"), "-lcudart", "-lcudadevrt"]
        link += [f"-Wl,-rpath,{r}" for r in runtime_library_dirs(nvshmem, home)]
        _run(link, env)
        del objs
