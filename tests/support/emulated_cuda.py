"""Builds CUDA kernel files as CPU libraries through the CUDA emulation (csrc/emulation/): the
same source that nvcc compiles for the GPU, compiled by the host C++ compiler with
-DEP_CUDA_EMULATION, its launches run by fibers on the calling thread. Tests load the result with
ctypes and call the kernels' C entry points (csrc/cuda/codec_launch.h) with host pointers.

Each emulated library also exports ``ep_emu_set_schedule(int reverse)``: 1 makes later launches
on the calling thread resume their threads from the highest index down, which exposes reads that
come before another thread's write without a barrier in between (0, from thread 0 up, exposes the
other order)."""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import sys
from pathlib import Path

from .native import (
    CSRC,
    ROOT,
    cached_extension,
    extension_path,
    import_extension,
    python_includes,
    require_compiler,
    run_compiler,
)


def build(source: str | list[str], out: Path, defines: tuple[str, ...] = ()) -> Path:
    """Compiles ``source`` (a path from the repository root, e.g. "csrc/cuda/lossless_kernels.cu",
    or a list of them) with ``defines`` (e.g. ("EP_LOSSLESS_DEC_WINDOW=1",)) into the shared
    library ``out``; raises CalledProcessError with the compiler's output if it fails."""
    cxx = require_compiler()
    sources = [source] if isinstance(source, str) else list(source)
    cmd = [cxx, "-std=c++17", "-O2", "-g0", "-fno-strict-aliasing", "-shared", "-fPIC", "-Wall", "-Wno-unknown-pragmas",
           "-x", "c++", "-DEP_CUDA_EMULATION", *(f"-D{d}" for d in defines),
           f"-I{CSRC / 'emulation'}", f"-I{CSRC}", f"-I{CSRC / 'cuda'}", *(str(ROOT / s) for s in sources),
           "-o", str(out)]
    run_compiler(cmd)
    return out


def build_racecheck(out: Path, defines: tuple[str, ...] = ()) -> Path:
    """tests/native/emulated_racecheck.cpp with the codec kernels, built through the CUDA emulation
    with ThreadSanitizer into the executable ``out`` (see that file); raises CalledProcessError
    with the compiler's output if it fails (e.g. no libtsan)."""
    cxx = require_compiler()
    cmd = [cxx, "-std=c++17", "-O1", "-g", "-fsanitize=thread", "-fPIE", "-pie", "-Wall", "-Wno-unknown-pragmas",
           "-DEP_CUDA_EMULATION", *(f"-D{d}" for d in defines), f"-I{CSRC / 'emulation'}", f"-I{CSRC}",
           f"-I{CSRC / 'cuda'}", "-x", "c++", str(CSRC / "cuda" / "lossless_kernels.cu"),
           str(CSRC / "cuda" / "fp8_kernels.cu"), str(ROOT / "tests" / "native" / "emulated_racecheck.cpp"),
           "-o", str(out)]
    run_compiler(cmd)
    return out


def _build_module(out_dir: Path, sources: tuple[str, ...], name: str, defines: tuple[str, ...] = ()) -> Path:
    """Compiles ``sources`` through the CUDA emulation (the bindings with the host compiler as they
    are) with ``defines`` and links them into the extension module ``name`` in ``out_dir``; returns
    its path. Objects compile two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    cxx = require_compiler()
    includes = [f"-I{CSRC / 'emulation'}", f"-I{CSRC}", f"-I{CSRC / 'cuda'}", f"-I{CSRC / 'cuda_bindings'}",
                *python_includes()]

    # -fno-strict-aliasing: kernels read and write 16-byte vectors through other types (an int4 as
    # bfloat16 pairs), which nvcc compiles as meant and GCC's aliasing rules would not
    def compile_one(source: str) -> str:
        obj = out_dir / (Path(source).name + ".o")
        run_compiler([cxx, "-std=c++17", "-O2", "-g0", "-fno-strict-aliasing", "-fPIC", "-fvisibility=hidden", "-Wall",
                      "-Wno-unknown-pragmas", "-DEP_CUDA_EMULATION", *(f"-D{d}" for d in defines), *includes,
                      "-c", "-x", "c++",
                      str(ROOT / source), "-o", str(obj)])
        return str(obj)

    with ThreadPoolExecutor(2) as pool:
        objects = list(pool.map(compile_one, sources))
    module = extension_path(out_dir, name)
    run_compiler([cxx, "-shared", *objects, "-o", str(module)])
    return module


PEER_MODULE = "ep_emulated_peer"
PEER_SOURCES = ("csrc/cuda/layout.cu", "csrc/cuda/intranode.cu", "csrc/cuda/low_latency.cu",
                "csrc/cuda_bindings/peer_kernels.cpp", "tests/native/emulated_peer_module.cpp")


def build_peer_module(out_dir: Path) -> Path:
    """ep_comm._cuda's peer-buffer bindings (csrc/cuda_bindings/peer_kernels.cpp, unchanged) over the
    emulated layout, intranode and low-latency kernels, built into ``out_dir``: the path of an
    extension module (import it with :func:`import_peer_module`) with the binding functions
    ``dispatch_layout``, ``intranode_notify`` ... ``low_latency_combine_recv`` taking host pointers,
    and the emulation's controls ``set_schedule``, ``set_device``, ``set_resident_limit``,
    ``set_stall_failure`` and ``set_external_peers`` (ranks in other processes sharing memory: an
    idle launch waits for them in real time; tests/native/emulated_peer_module.cpp)."""
    return _build_module(out_dir, PEER_SOURCES, PEER_MODULE)


def import_peer_module(path: Path):
    """The module :func:`build_peer_module` built at ``path``, imported."""
    return import_extension(path, PEER_MODULE)


def cached_peer_module(cache_dir: Path):
    """:func:`build_peer_module`'s module, imported: built into ``cache_dir`` under a key of its
    sources, the headers they can include and this file, so later pytest runs reuse it until one
    changes."""
    return _cached_module(cache_dir, PEER_SOURCES, PEER_MODULE, build_peer_module)


TWO_HOP_MODULE = "ep_emulated_two_hop"
TWO_HOP_SOURCES = ("csrc/cuda/layout.cu", "csrc/cuda/internode.cu", "csrc/cuda/internode_two_hop.cu",
                   "csrc/cuda/internode_two_hop_combine.cu", "csrc/cuda_bindings/two_hop.cpp",
                   "tests/native/emulated_two_hop_module.cpp")


def build_two_hop_module(out_dir: Path) -> Path:
    """ep_comm._cuda's two-hop bindings (csrc/cuda_bindings/two_hop.cpp, unchanged) over the emulated
    two-hop kernels and the emulated NVSHMEM of one PE (csrc/emulation/nvshmem.h), built into
    ``out_dir``: the path of an extension module with ``two_hop_dispatch``, ``two_hop_combine``,
    ``nvshmem_malloc`` / ``nvshmem_free`` / ``nvshmem_ptr`` (host memory) and the emulation's
    controls (tests/native/emulated_two_hop_module.cpp)."""
    return _build_module(out_dir, TWO_HOP_SOURCES, TWO_HOP_MODULE, ("EP_COMM_WITH_NVSHMEM",))


def cached_two_hop_module(cache_dir: Path):
    """:func:`build_two_hop_module`'s module, imported, cached as :func:`cached_peer_module`'s."""
    return _cached_module(cache_dir, TWO_HOP_SOURCES, TWO_HOP_MODULE, build_two_hop_module)


def _cached_module(cache_dir: Path, sources: tuple[str, ...], name: str, build_into):
    """The module ``build_into(dir)`` builds from ``sources``, imported: built into ``cache_dir``
    under a key of its sources, the headers they can include and this file."""
    digest = hashlib.sha256()
    headers = [p for d in ("common", "emulation", "cuda", "cuda_bindings", "codec")
               for p in sorted((CSRC / d).glob("*.h"))]
    for path in [Path(__file__), *(ROOT / s for s in sources), *headers]:
        if path.is_file():
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return cached_extension(cache_dir, digest.hexdigest()[:16], name, build_into)


def build_codec_module(out_dir: Path) -> Path:
    """ep_comm._cuda's codec bindings (csrc/cuda_bindings/codecs.cpp, unchanged) over the emulated
    codec kernels, built into ``out_dir``: the path of an extension module (import it with
    :func:`import_codec_module`) with the binding functions ``lossless_encode`` ... ``fp8_quantize``,
    which take host pointers (tests/native/emulated_codec_module.cpp)."""
    cxx = require_compiler()
    includes = [f"-I{CSRC / 'emulation'}", f"-I{CSRC}", f"-I{CSRC / 'cuda'}", f"-I{CSRC / 'cuda_bindings'}",
                *python_includes()]
    objects = []
    for source in ("csrc/cuda/lossless_kernels.cu", "csrc/cuda/fp8_kernels.cu", "csrc/cuda/codec_launchers.cu",
                   "csrc/cuda_bindings/codecs.cpp", "tests/native/emulated_codec_module.cpp"):
        obj = out_dir / (Path(source).name + ".o")
        run_compiler([cxx, "-std=c++17", "-O2", "-g0", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas",
                      "-DEP_CUDA_EMULATION", *includes, "-c", "-x", "c++", str(ROOT / source), "-o", str(obj)])
        objects.append(str(obj))
    module = extension_path(out_dir, "ep_emulated_codecs")
    run_compiler([cxx, "-shared", *objects, "-o", str(module)])
    return module


def import_codec_module(path: Path):
    """The module :func:`build_codec_module` built at ``path``, imported (also in a rank process)."""
    return import_extension(path, "ep_emulated_codecs")


class RecordingKernels:
    """A codec bindings module (e.g. :func:`import_codec_module`'s) that records its kernel calls:
    ``calls`` lists "encode", "decode" and "fp8" in call order."""

    _recorded = {"lossless_encode": "encode", "lossless_decode": "decode", "fp8_quantize": "fp8"}

    def __init__(self, module):
        self.module = module
        self.calls: list[str] = []

    def __getattr__(self, name):
        binding = getattr(self.module, name)
        if name not in self._recorded:
            return binding

        def call(*args, **kwargs):
            self.calls.append(self._recorded[name])
            return binding(*args, **kwargs)
        return call


@contextlib.contextmanager
def device_codecs_on_cpu(module):
    """Within the block, CPU tensors take the device codec path (ep_comm/codecs/device_kernels.py)
    with ``module``'s bindings as their kernels: messages are coded by the emulated GPU kernels,
    in the GPU's message chunks."""
    from ep_comm.codecs import device_kernels

    saved = device_kernels.codec_kernels, device_kernels.launch_context, device_kernels.current_stream
    device_kernels.codec_kernels = lambda device: module
    device_kernels.launch_context = lambda device: contextlib.nullcontext()
    device_kernels.current_stream = lambda device: 0
    try:
        yield
    finally:
        device_kernels.codec_kernels, device_kernels.launch_context, device_kernels.current_stream = saved


def load(path: Path) -> ctypes.CDLL:
    """An emulated library, with ``ep_emu_set_schedule`` typed."""
    lib = ctypes.CDLL(str(path))
    lib.ep_emu_set_schedule.argtypes = [ctypes.c_int]
    lib.ep_emu_set_schedule.restype = None
    return lib


def with_device_controls(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (an emulated library) with the emulated device's controls typed: schedule order,
    device shape, resident-block limit, stall failure, launch and memset counts."""
    lib.ep_emu_set_schedule.argtypes = [ctypes.c_int]
    lib.ep_emu_set_device.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.ep_emu_set_resident_limit.argtypes = [ctypes.c_int]
    lib.ep_emu_set_stall_failure.argtypes = [ctypes.c_int]
    lib.ep_emu_launch_count.restype = ctypes.c_ulonglong
    lib.ep_emu_memset_count.restype = ctypes.c_ulonglong
    return lib


def default_device(lib: ctypes.CDLL) -> None:
    """Back to the emulation's defaults: threads resumed from 0 up, one multiprocessor of one block
    (blocks one at a time), no resident-block cap, a stalled grid ended by the bounded waits'
    timeouts rather than failing the launch."""
    lib.ep_emu_set_schedule(0)
    lib.ep_emu_set_device(1, 1)
    lib.ep_emu_set_resident_limit(0)
    lib.ep_emu_set_stall_failure(0)


def codec_library(path: Path) -> ctypes.CDLL:
    """The emulated build of csrc/cuda/lossless_kernels.cu at ``path`` (from :func:`build`), loaded
    with the kernels' ctypes signatures (bench/codec_gpu.py's ``gpu_library``, which the GPU runs
    use too) and the emulated device's controls typed (:func:`with_device_controls`)."""
    codec_gpu = sys.modules.get("codec_gpu")
    if codec_gpu is None:  # imported as `import codec_gpu` would, from bench/
        spec = importlib.util.spec_from_file_location("codec_gpu", ROOT / "bench" / "codec_gpu.py")
        codec_gpu = importlib.util.module_from_spec(spec)
        sys.modules["codec_gpu"] = codec_gpu
        spec.loader.exec_module(codec_gpu)
    return with_device_controls(codec_gpu.gpu_library(path))
