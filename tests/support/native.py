"""Building the tests' native code with the host C++ compiler: shared pieces, and the test-only
bindings of ep_comm's C++ cores (tests/native/host_test_bindings.cpp), which ep_comm._host leaves
out because the product does not call them. The module compiles from the same csrc/ headers as
ep_comm._host, so the tests that use it test the product's code."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"


def compiler() -> str | None:
    """The host C++ compiler (CXX, else g++), or None if absent."""
    return shutil.which(os.environ.get("CXX", "g++"))


def require_compiler() -> str:
    """:func:`compiler`, or FileNotFoundError when there is none."""
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("no host C++ compiler (set CXX)")
    return cxx


def run_compiler(cmd: list[str]) -> None:
    """Runs a compiler command; raises CalledProcessError with the compiler's output if it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)


def python_includes() -> list[str]:
    """The include flags of an extension module: pybind11's and Python's headers."""
    import pybind11

    return [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]


def extension_path(out_dir: Path, name: str) -> Path:
    """Where an extension module ``name`` built into ``out_dir`` goes (this Python's suffix)."""
    return out_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"


def import_extension(path: Path, name: str) -> ModuleType:
    """The extension module ``name`` at ``path``, imported (also in a rank process)."""
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


HOST_TEST_MODULE = "ep_host_test"
HOST_TEST_SOURCE = ROOT / "tests" / "native" / "host_test_bindings.cpp"


def _host_test_command(out: Path) -> list[str]:
    # setup.py's flags for ep_comm._host (C++17, no fused multiply-adds), less its -O3: the
    # module is small and a test session builds it
    return [require_compiler(), "-std=c++17", "-O1", "-g0", "-shared", "-fPIC", "-fvisibility=hidden",
            "-ffp-contract=off", "-Wall", f"-I{CSRC}", *python_includes(), str(HOST_TEST_SOURCE), "-o", str(out)]


def build_host_test_module(out_dir: Path) -> Path:
    """tests/native/host_test_bindings.cpp built into ``out_dir``: the path of the extension module
    ``ep_host_test`` (import it with :func:`import_extension`)."""
    module = extension_path(out_dir, HOST_TEST_MODULE)
    run_compiler(_host_test_command(module))
    return module


def cached_host_test_module(cache_dir: Path) -> ModuleType:
    """The module ``ep_host_test``, imported: built into ``cache_dir`` under a key of its source,
    every csrc/ header and the compiler command, so a later pytest run reuses it until one changes."""
    digest = hashlib.sha256(" ".join(_host_test_command(Path("out"))).encode())
    for path in [HOST_TEST_SOURCE, *sorted(CSRC.rglob("*.h"))]:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return cached_extension(cache_dir, digest.hexdigest()[:16], HOST_TEST_MODULE, build_host_test_module)


def cached_extension(cache_dir: Path, key: str, name: str, build_into) -> ModuleType:
    """The extension module ``name`` that ``build_into(dir)`` builds (returning its path),
    imported: built once into ``cache_dir/key`` and reused while ``key`` (a digest of what it is
    built from) is unchanged; other keys' builds are removed."""
    module = extension_path(cache_dir / key, name)
    if not module.exists():
        staging = Path(tempfile.mkdtemp(dir=cache_dir))
        try:
            built = build_into(staging)
            module.parent.mkdir(exist_ok=True)
            os.replace(built, module)  # atomic: a concurrent pytest run sees no half-written file
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        for old in cache_dir.iterdir():  # earlier keys' builds (not another run's staging)
            if len(old.name) == len(key) and old.name != key and not old.name.startswith("tmp"):
                shutil.rmtree(old, ignore_errors=True)
    return import_extension(module, name)
