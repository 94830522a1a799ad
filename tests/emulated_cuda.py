"""Builds CUDA kernel files as CPU libraries through the CUDA emulation (csrc/emulation/): the
same source that nvcc compiles for the GPU, compiled by the host C++ compiler with
-DEP_CUDA_EMULATION, its launches run by fibers on the calling thread. Tests load the result with
ctypes and call the kernels' C entry points (csrc/cuda/codec_launch.h) with host pointers.

Each emulated library also exports ``ep_emu_set_schedule(int reverse)``: 1 makes later launches
on the calling thread resume their threads from the highest index down, which exposes reads that
come before another thread's write without a barrier in between (0, from thread 0 up, exposes the
other order)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"


def compiler() -> str | None:
    """The host C++ compiler the emulation builds with (CXX, else g++), or None if absent."""
    return shutil.which(os.environ.get("CXX", "g++"))


def build(source: str, out: Path, defines: tuple[str, ...] = ()) -> Path:
    """Compiles ``source`` (a path from the repository root, e.g. "csrc/cuda/lossless_kernels.cu")
    with ``defines`` (e.g. ("EP_LOSSLESS_DEC_WINDOW=1",)) into the shared library ``out``; raises
    CalledProcessError with the compiler's output if it fails."""
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("no host C++ compiler (set CXX)")
    cmd = [cxx, "-std=c++17", "-O2", "-g0", "-shared", "-fPIC", "-Wall", "-Wno-unknown-pragmas",
           "-x", "c++", "-DEP_CUDA_EMULATION", *(f"-D{d}" for d in defines),
           f"-I{CSRC / 'emulation'}", f"-I{CSRC}", f"-I{CSRC / 'cuda'}", str(ROOT / source), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    return out


def load(path: Path) -> ctypes.CDLL:
    """An emulated library, with ``ep_emu_set_schedule`` typed."""
    lib = ctypes.CDLL(str(path))
    lib.ep_emu_set_schedule.argtypes = [ctypes.c_int]
    lib.ep_emu_set_schedule.restype = None
    return lib
