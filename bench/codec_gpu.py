"""The lossless codec on the GPU: loads (or builds) csrc/cuda/lossless_kernels.cu as a small
shared library and measures device encode/decode throughput against the device's copy bandwidth
in the same run, on real BF16 tensors.

Used by bench/codec_bench.py (GPU rows of its report), by tests/gpu/test_codec_lossless_gpu.py
(the library) and alone on a lent GPU, where the model and zipnn are not installed:

    python bench/codec_bench.py --save-tensors T.pt          # here: the real tensors, capped
    python bench/codec_gpu.py --build-lib LIB.so --arch 90   # here: the kernels, no GPU needed
    python bench/codec_gpu.py --tensors T.pt --lib LIB.so    # there: the GPU table (+ --json)

Encode runs in format version 7 (the default: gradients' raw fields coded as a second stream
where that pays, the pair checksum) and, for comparison, 5 (``--versions``; 4 and 6 too); each row
names its version.
Throughput counts raw bf16 bytes (2 per value) per second of the whole encode (resp. decode)
call, every kernel of it included, timed with CUDA events over ``reps`` calls after a warm-up.
The copy bandwidth counts bytes read plus bytes written (a device-to-device copy of the same
tensor), the convention of KINDS.md's 4.3 TB/s; ``*_of_copy`` is GB/s over that figure.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ep_comm.codecs import lossless, lossless_device  # noqa: E402

KINDS = ("activations", "weights", "gradients")


def build_library(out: Path, arch: str | None = None, defines: tuple[str, ...] = ()) -> Path:
    """Compiles lossless_kernels.cu into ``out`` (a shared library with the static CUDA runtime).
    ``arch``: e.g. "90"; default the current device's. ``defines``: e.g. ("EP_LOSSLESS_DEC_WARPS=8",),
    the kernel file's tuning knobs. ptxas's register and spill report of each kernel goes to
    ``<out>.ptxas.txt``."""
    if arch is None:
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}"
    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    done = subprocess.run([nvcc, "-std=c++17", "-O3", f"-arch=sm_{arch}", "-shared", "-Xcompiler", "-fPIC",
                           "-Xptxas", "-v", *(f"-D{d}" for d in defines),
                           f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'csrc' / 'cuda'}",
                           str(ROOT / "csrc" / "cuda" / "lossless_kernels.cu"), "-o", str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise subprocess.CalledProcessError(done.returncode, done.args)
    report = [line for line in done.stderr.splitlines()
              if "Compiling entry function" in line or "registers" in line or "spill" in line]
    Path(f"{out}.ptxas.txt").write_text(f"{out.name} ({' '.join(defines) or 'default'}):\n" + "\n".join(report) + "\n")
    return out


def gpu_library(prebuilt: str | os.PathLike | None = None) -> ctypes.CDLL:
    """The codec kernels as a ctypes library: ``prebuilt`` when given and present, else built
    now into a temporary directory."""
    path = Path(prebuilt) if prebuilt and Path(prebuilt).exists() else None
    if path is None:
        path = build_library(Path(tempfile.mkdtemp()) / "libep_codec.so")
    lib = ctypes.CDLL(str(path))
    u64, vp = ctypes.c_uint64, ctypes.c_void_p
    lib.ep_lossless_encode_workspace_bytes.restype = ctypes.c_size_t
    lib.ep_lossless_encode_workspace_bytes.argtypes = [u64, ctypes.c_uint32, ctypes.c_uint32]
    lib.ep_lossless_decode_workspace_bytes.restype = ctypes.c_size_t
    lib.ep_lossless_decode_workspace_bytes.argtypes = [u64, ctypes.c_uint32, u64]
    lib.ep_lossless_max_blob_bytes.restype = ctypes.c_size_t
    lib.ep_lossless_max_blob_bytes.argtypes = [u64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32]
    # (values, num_values, shape, ndim, chunk_values, version, out, out_size, workspace, workspace_bytes, stream)
    lib.ep_lossless_encode_cuda.argtypes = [vp, u64, vp, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, vp, vp,
                                            vp, ctypes.c_size_t, vp]
    # (blob, blob_bytes, out, num_values, min_chunk_values, field_chunks, version, status, workspace,
    #  workspace_bytes, stream)
    lib.ep_lossless_decode_cuda.argtypes = [vp, u64, vp, u64, ctypes.c_uint32, u64, ctypes.c_uint32, vp, vp,
                                            ctypes.c_size_t, vp]
    return lib


def cuda_time(fn: Callable[[], None], reps: int) -> float:
    """Mean seconds per call of ``fn`` over ``reps`` calls after one warm-up (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


class DeviceCodec:
    """Encode/decode of one flat bf16 CUDA tensor with preallocated workspaces.

    x: [n] bf16 (or int16) on the GPU; the blob (format ``version``, 4 to 7) lands in
    ``self.out[:self.blob_bytes()]`` (uint8) and the decoded values in ``self.y`` ([n], x's dtype).
    Format 6: the decoder's workspace has a slot for every chunk (each may have coded fields);
    blob_bytes() counts those that do from the blob's metadata, which decode() passes."""

    def __init__(self, lib: ctypes.CDLL, x: torch.Tensor, chunk_values: int, version: int = 5):
        self.lib, self.x, self.cv, self.version = lib, x, chunk_values, version
        n = self.n = x.numel()
        self.shape = (ctypes.c_int64 * 1)(n)
        slots = -(-n // chunk_values) if version >= 6 else 0
        self.field_chunks = 0
        self.ws = torch.empty(max(lib.ep_lossless_encode_workspace_bytes(n, chunk_values, version),
                                  lib.ep_lossless_decode_workspace_bytes(n, chunk_values, slots)),
                              dtype=torch.uint8, device=x.device)
        self.out = torch.empty(lib.ep_lossless_max_blob_bytes(n, 1, chunk_values, version), dtype=torch.uint8,
                               device=x.device)
        self.size = torch.zeros(1, dtype=torch.int64, device=x.device)
        self.status = torch.zeros(1, dtype=torch.int32, device=x.device)
        self.y = torch.empty_like(x)
        self.stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._blob_bytes = 0

    def encode(self) -> None:
        rc = self.lib.ep_lossless_encode_cuda(self.x.data_ptr(), self.n, self.shape, 1, self.cv, self.version,
                                              self.out.data_ptr(), self.size.data_ptr(), self.ws.data_ptr(),
                                              self.ws.numel(), self.stream)
        if rc:
            raise RuntimeError(f"encode launch failed: CUDA error {rc}")

    def blob_bytes(self) -> int:
        torch.cuda.synchronize()
        self._blob_bytes = int(self.size.item())
        if self.version >= 6:
            self.field_chunks = lossless_device.layouts([self.out[:self._blob_bytes]])[0].field_chunks
        return self._blob_bytes

    def decode(self) -> None:
        rc = self.lib.ep_lossless_decode_cuda(self.out.data_ptr(), self._blob_bytes, self.y.data_ptr(), self.n,
                                              self.cv, self.field_chunks, self.version, self.status.data_ptr(),
                                              self.ws.data_ptr(), self.ws.numel(), self.stream)
        if rc:
            raise RuntimeError(f"decode launch failed: CUDA error {rc}")


@dataclass
class GpuRow:
    """One kind at one chunk size. GB/s are of raw bf16 bytes; copy_gbs counts read + write."""

    kind: str
    chunk_values: int
    mb: float                 # raw MB coded per call (the real values, tiled)
    ratio: float              # blob bytes / raw bytes of the tiled data
    enc_gbs: float
    dec_gbs: float
    copy_gbs: float
    enc_of_copy: float
    dec_of_copy: float
    identical_to_host: bool   # device blob of the untiled real values == host encoder's blob
    exact: bool               # device decode of the tiled data is bit-exact, status 0
    kernels_us: dict[str, float]  # per-kernel device time of one encode + one decode (profiler)
    version: int = 4          # the blob's format version (a report saved without it: 4)


def kernel_times(codec: DeviceCodec) -> dict[str, float]:
    """Device microseconds per kernel name for one encode and one decode (torch.profiler); an
    empty dict with an "error" key when the profiler is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            codec.encode()
            codec.decode()
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for evt in prof.key_averages():
            us = getattr(evt, "device_time_total", None)
            if us is None:
                us = getattr(evt, "cuda_time_total", 0.0)
            if us:
                out[evt.key[:60]] = round(float(us), 1)
        return out
    except Exception as error:  # the figures above stand without the breakdown
        return {"error": f"{type(error).__name__}: {error}"[:200]}  # type: ignore[dict-item]


def tile(values: torch.Tensor, target_bytes: int) -> torch.Tensor:
    """``values`` ([n] bf16) repeated and cut to target_bytes / 2 values (at least n)."""
    want = max(target_bytes // 2, values.numel())
    reps = -(-want // values.numel())
    return values.repeat(reps)[:want]


def measure_kind(lib: ctypes.CDLL, kind: str, values: torch.Tensor, chunk_values: int, target_bytes: int,
                 reps: int, version: int = 5) -> GpuRow:
    """values: [n] bf16 CPU tensor of one kind's real values."""
    real = DeviceCodec(lib, values.cuda(), chunk_values, version)
    real.encode()
    host_blob = lossless.encode(values, chunk_values=chunk_values, version=version)
    identical = bool(torch.equal(real.out[:real.blob_bytes()].cpu(), host_blob))
    del real
    codec = DeviceCodec(lib, tile(values, target_bytes).cuda(), chunk_values, version)
    enc_s = cuda_time(codec.encode, reps)
    blob = codec.blob_bytes()
    dec_s = cuda_time(codec.decode, reps)
    exact = int(codec.status.item()) == 0 and bool(torch.equal(codec.y.view(torch.int16),
                                                               codec.x.view(torch.int16)))
    dst = torch.empty_like(codec.x)
    copy_s = cuda_time(lambda: dst.copy_(codec.x), reps)
    raw = 2 * codec.n
    copy_gbs = 2 * raw / copy_s / 1e9
    enc_gbs, dec_gbs = raw / enc_s / 1e9, raw / dec_s / 1e9
    row = GpuRow(kind, chunk_values, raw / 1e6, blob / raw, enc_gbs, dec_gbs, copy_gbs, enc_gbs / copy_gbs,
                 dec_gbs / copy_gbs, identical, exact, kernel_times(codec), version)
    return row


def measure(data: dict[str, torch.Tensor], reps: int = 10,
            chunk_values: tuple[int, ...] = (lossless.DEFAULT_CHUNK_VALUES,), target_bytes: int = 1 << 30,
            lib: ctypes.CDLL | None = None, versions: tuple[int, ...] = (6, 5)) -> list[GpuRow]:
    """data: kind -> [n] bf16 CPU tensor of real values. One row per kind, chunk size and version."""
    lib = lib or gpu_library()
    rows = []
    for cv in chunk_values:
        for kind in data:
            for version in versions:
                rows.append(measure_kind(lib, kind, data[kind], cv, target_bytes, reps, version))
                torch.cuda.empty_cache()
    return rows


MESSAGE_SHAPE = (64, 7168)  # one dispatch message: 64 tokens of a 7,168-wide hidden state


@dataclass
class MessageRow:
    """One kind's 64x7168 message at one chunk size: the latency of one call, alone on the GPU."""

    kind: str
    chunk_values: int
    chunks: int
    ratio: float              # blob bytes / raw bytes
    enc_us: float             # median of isolated encode calls (CUDA events around each call)
    dec_us: float             # median of isolated decode calls
    exact: bool               # decode bit-exact, status 0
    identical_to_host: bool   # device blob == host encoder's blob
    version: int = 4          # the blob's format version (a report saved without it: 4)


def isolated_us(fn: Callable[[], None], reps: int) -> float:
    """Median microseconds of ``reps`` single calls of ``fn``, each timed alone (events around
    it, the device idle before it): what one message waits, launch gaps included."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def measure_message(lib: ctypes.CDLL, kind: str, values: torch.Tensor, chunk_values: int,
                    reps: int, version: int = 5) -> MessageRow:
    """values: [n] bf16 CPU tensor of one kind's real values; the message is its first 64x7168
    values (tiled when fewer)."""
    n = MESSAGE_SHAPE[0] * MESSAGE_SHAPE[1]
    x = tile(values, 2 * n)[:n].contiguous()
    codec = DeviceCodec(lib, x.cuda(), chunk_values, version)
    codec.encode()
    blob = codec.blob_bytes()
    identical = bool(torch.equal(codec.out[:blob].cpu(), lossless.encode(x, chunk_values=chunk_values,
                                                                         version=version)))
    enc_us = isolated_us(codec.encode, reps)
    dec_us = isolated_us(codec.decode, reps)
    exact = int(codec.status.item()) == 0 and bool(torch.equal(codec.y.view(torch.int16), codec.x.view(torch.int16)))
    return MessageRow(kind, chunk_values, -(-n // chunk_values), blob / (2 * n), enc_us, dec_us, exact, identical,
                      version)


def print_message_rows(rows: list[MessageRow], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one {MESSAGE_SHAPE[0]}x{MESSAGE_SHAPE[1]} bf16 message on the GPU: {device} "
                        "(target: encode and decode < 20 us each)")
    for col in ("kind", "chunk", "version", "chunks", "ratio", "encode us", "decode us", "== host", "exact"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.kind, str(r.chunk_values), str(r.version), str(r.chunks), f"{r.ratio:.4f}",
                      f"{r.enc_us:.1f}",
                      f"{r.dec_us:.1f}", str(r.identical_to_host), str(r.exact))
    Console(width=160).print(table)


def print_rows(rows: list[GpuRow], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lossless bf16 on the GPU: {device}")
    for col in ("kind", "chunk", "version", "MB", "ratio", "enc GB/s", "dec GB/s", "copy GB/s (r+w)", "enc/copy",
                "dec/copy", "== host", "exact"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.kind, str(r.chunk_values), str(r.version), f"{r.mb:.0f}", f"{r.ratio:.4f}",
                      f"{r.enc_gbs:.0f}",
                      f"{r.dec_gbs:.0f}", f"{r.copy_gbs:.0f}", f"{r.enc_of_copy:.3f}", f"{r.dec_of_copy:.3f}",
                      str(r.identical_to_host), str(r.exact))
    console = Console(width=160)
    console.print(table)
    for r in rows:
        console.print(f"{r.kind} chunk {r.chunk_values} version {r.version} kernels (us, one encode + one decode): "
                      f"{r.kernels_us}")


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A file of bench/codec_bench.py --save-tensors: kind -> [n] bf16."""
    data = torch.load(path, map_location="cpu")
    return {k: data[k].reshape(-1).to(torch.bfloat16) for k in KINDS if k in data}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-lib", type=Path, help="only build the kernel library here and stop")
    parser.add_argument("--arch", help="with --build-lib: target, e.g. 90 (default: this device's)")
    parser.add_argument("--define", action="append", default=[],
                        help="with --build-lib: a tuning knob of the kernel file, e.g. EP_LOSSLESS_DEC_WARPS=8")
    parser.add_argument("--lib", action="append", default=[],
                        help="a prebuilt library (else one is built now); repeat to compare builds in one run")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated tensor kinds to measure")
    parser.add_argument("--tensors", type=Path, help="real tensors from codec_bench.py --save-tensors")
    parser.add_argument("--chunk-values", default=str(lossless.DEFAULT_CHUNK_VALUES),
                        help="comma-separated chunk sizes in values")
    parser.add_argument("--versions", default="7,5",
                        help="comma-separated format versions to encode (4 to 7); the first for --once")
    parser.add_argument("--gpu-mb", type=int, default=1024, help="raw MB coded per call (real data tiled)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--message", action="store_true",
                        help="latency of one 64x7168 message per kind and chunk size (isolated calls), "
                             "instead of the throughput of --gpu-mb calls")
    parser.add_argument("--once", action="store_true",
                        help="one encode and one decode of the first kind, nothing timed (for a profiler such as ncu)")
    args = parser.parse_args(argv)
    if args.build_lib:
        build_library(args.build_lib, args.arch, tuple(args.define))
        return 0
    if args.tensors is None:
        parser.error("--tensors is required (or --build-lib)")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 1
    data = {k: v for k, v in load_tensors(args.tensors).items() if k in args.kinds.split(",")}
    cvs = tuple(int(c) for c in args.chunk_values.split(","))
    versions = tuple(int(v) for v in args.versions.split(","))
    if args.once:
        codec = DeviceCodec(gpu_library(args.lib[0] if args.lib else None),
                            tile(next(iter(data.values())), args.gpu_mb << 20).cuda(), cvs[0], versions[0])
        codec.encode()
        codec.blob_bytes()
        codec.decode()
        torch.cuda.synchronize()
        print(f"once: status {int(codec.status.item())}")
        return 0
    if args.message:
        messages = {}
        for lib in args.lib or [None]:
            name = Path(lib).name if lib else "built now"
            library = gpu_library(lib)
            rows = [measure_message(library, kind, data[kind], cv, max(args.reps, 50), version)
                    for cv in cvs for kind in data for version in versions]
            print_message_rows(rows, f"{torch.cuda.get_device_name()}, {name}")
            messages[name] = [asdict(r) for r in rows]
        if args.json:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "messages": messages}, indent=2))
        return 0
    results = {}
    for lib in args.lib or [None]:
        name = Path(lib).name if lib else "built now"
        rows = measure(data, args.reps, cvs, args.gpu_mb << 20, gpu_library(lib), versions)
        print_rows(rows, f"{torch.cuda.get_device_name()}, {name}")
        results[name] = [asdict(r) for r in rows]
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "libs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
