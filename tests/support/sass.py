"""Reading the machine code (SASS) of ep_comm's CUDA kernels without a GPU.

The kernel files are compiled for one architecture into relocatable cubins with the flags
tools/cuda_build.py uses for ``ep_comm._cuda`` (:func:`compile_cubin`, :func:`cached_cubin`), or an
already built binary (a cubin, or a host library that embeds a fatbin such as
``ep_comm/_cuda*.so``) is read as it is. ``nvdisasm`` turns a cubin into instructions with their
source lines (the build keeps ``-lineinfo``), ``cuobjdump -res-usage`` gives registers, stack, shared
and local memory per function. Both tools come with NVIDIA's wheels (``pip install
nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm``), with Triton's wheel (``triton/backends/nvidia/bin``)
or with a CUDA toolkit: :func:`tool` finds them.

On the instructions, :class:`Function` builds the control-flow graph (basic blocks split at branch
targets and after branches / exits) and its natural loops (:meth:`Function.loops`), so a check can
say "in this loop, this many 16-byte loads issue before the first 16-byte store" or "no L1
invalidation inside a spin loop" about the code the GPU runs.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .native import ROOT

TOOLS = ("cuobjdump", "nvdisasm")


def _tool_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("EP_SASS_TOOLS"):
        dirs.append(Path(os.environ["EP_SASS_TOOLS"]))
    for base in dict.fromkeys([sysconfig.get_paths()["purelib"], *sys.path]):
        if base:
            nvidia = Path(base) / "nvidia"
            dirs += [nvidia / "cu13" / "bin", nvidia / "cuda_nvdisasm" / "bin", nvidia / "cuda_cuobjdump" / "bin",
                     Path(base) / "triton" / "backends" / "nvidia" / "bin"]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    dirs.append(Path(home) / "bin")
    return dirs


def tool(name: str) -> Path | None:
    """``cuobjdump`` or ``nvdisasm``: from $EP_SASS_TOOLS, the NVIDIA wheels
    (nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm), Triton's wheel, $CUDA_HOME/bin, then PATH."""
    for d in _tool_dirs():
        if (d / name).is_file() and os.access(d / name, os.X_OK):
            return d / name
    found = shutil.which(name)
    return Path(found) if found else None


def nvcc() -> Path | None:
    """nvcc of $CUDA_HOME (default /usr/local/cuda), else from PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    path = Path(home) / "bin" / "nvcc"
    if path.is_file():
        return path
    found = shutil.which("nvcc")
    return Path(found) if found else None


def missing_tools() -> list[str]:
    """What :func:`compile_cubin` and :func:`disassemble` need and cannot find."""
    missing = [t for t in TOOLS if tool(t) is None]
    if nvcc() is None:
        missing.append("nvcc")
    return missing


def nvshmem_include() -> Path | None:
    """The NVSHMEM wheel's headers (the product's kernels are compiled with them when present)."""
    for base in dict.fromkeys([sysconfig.get_paths()["purelib"], *sys.path]):
        if base and (Path(base) / "nvidia" / "nvshmem" / "include" / "nvshmem.h").is_file():
            return Path(base) / "nvidia" / "nvshmem" / "include"
    return None


def compile_command(source: Path, out: Path, arch: str = "90", defines: tuple[str, ...] = (),
                    root: Path = ROOT) -> list[str]:
    """tools/cuda_build.py's nvcc command for one kernel file, to a relocatable cubin."""
    compiler = nvcc()
    if compiler is None:
        raise FileNotFoundError("nvcc not found (set CUDA_HOME)")
    cmd = [str(compiler), "-std=c++17", "-O3", "-I", str(root / "csrc"), "-rdc=true", "--expt-relaxed-constexpr",
           "-lineinfo", "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-cubin"]
    include = nvshmem_include()
    if include is not None:
        cmd += ["-DEP_COMM_WITH_NVSHMEM", "-I", str(include)]
    cmd += [f"-D{d}" for d in defines]
    return [*cmd, str(source), "-o", str(out)]


def compile_cubin(source: str | Path, out: Path, arch: str = "90", defines: tuple[str, ...] = (),
                  root: Path = ROOT) -> Path:
    """Compiles ``source`` (relative to ``root``, e.g. "csrc/cuda/intranode.cu") into the cubin
    ``out``; raises CalledProcessError with nvcc's output if it fails. ``root`` may be another
    checkout of the repository (e.g. an older commit's files) to compare two versions."""
    cmd = compile_command(Path(root) / source, out, arch, defines, Path(root))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    return out


def cached_cubin(source: str | Path, cache_dir: Path, arch: str = "90", defines: tuple[str, ...] = (),
                 root: Path = ROOT) -> Path:
    """:func:`compile_cubin` into ``cache_dir``, reused while the command, ``source`` and every
    header under csrc/ are unchanged."""
    root = Path(root)
    digest = hashlib.sha256(" ".join(compile_command(Path(source), Path("out"), arch, defines, Path("/"))).encode())
    for path in [root / source, *sorted((root / "csrc").rglob("*.h"))]:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    out = Path(cache_dir) / f"{Path(source).stem}.{arch}.{digest.hexdigest()[:16]}.cubin"
    if not out.exists():
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=cache_dir, suffix=".cubin")
        os.close(fd)
        try:
            compile_cubin(source, Path(staging), arch, defines, root)
            os.replace(staging, out)  # atomic: a concurrent pytest run sees no half-written file
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
    return out


def _run(cmd: list[str]) -> str:
    tools_dir = str(Path(cmd[0]).parent)
    env = dict(os.environ, PATH=tools_dir + os.pathsep + os.environ.get("PATH", ""))  # cuobjdump runs nvdisasm
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, cmd, done.stdout, done.stderr)
    return done.stdout


def _require(name: str) -> str:
    path = tool(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    return str(path)


def cubins_of(binary: Path, workdir: Path) -> list[Path]:
    """The cubins of ``binary``: itself when it is one, else those ``cuobjdump -xelf all`` extracts
    (a host library or object with an embedded fatbin) into ``workdir``."""
    binary = Path(binary)
    if binary.suffix == ".cubin":
        return [binary]
    workdir.mkdir(parents=True, exist_ok=True)
    subprocess.run([_require("cuobjdump"), "-xelf", "all", str(binary.resolve())], cwd=workdir,
                   capture_output=True, text=True, check=True)
    return sorted(workdir.glob("*.cubin"))


# ---- instructions -------------------------------------------------------------------------------
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+|[A-Za-z_.$][\w.$]*):\s*$")
_FILE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Instruction:
    """One SASS instruction: ``opcode`` with its modifiers (``LDG.E.128.CONSTANT``), its predicate
    (``@!P0``, or ""), operands as text, and the innermost source line it came from (file, line)."""

    address: int
    predicate: str
    opcode: str
    operands: str
    source: tuple[str, int] | None = None
    target: str | None = None  # branch target label

    @property
    def op(self) -> str:
        """The opcode without modifiers (``LDG``)."""
        return self.opcode.split(".")[0]

    @property
    def modifiers(self) -> tuple[str, ...]:
        return tuple(self.opcode.split(".")[1:])

    def __str__(self) -> str:
        pred = f"{self.predicate} " if self.predicate else ""
        return f"/*{self.address:04x}*/ {pred}{self.opcode} {self.operands}".rstrip()

    # classes of instructions the checks count
    def is_global_load_128(self) -> bool:
        """A 16-byte load from global memory (``LDG.E.128`` with any caching modifier), or a
        generic one (``LD.E.128``)."""
        return self.op in ("LDG", "LD") and "128" in self.modifiers

    def is_global_store_128(self) -> bool:
        return self.op in ("STG", "ST") and "128" in self.modifiers

    def is_global_load(self) -> bool:
        return self.op in ("LDG", "LD")

    def is_store(self) -> bool:
        """Any store or atomic to memory (global, generic, shared or local)."""
        return self.op in ("STG", "ST", "STS", "STL", "RED", "REDG", "ATOM", "ATOMG", "ATOMS")

    def is_system_fence(self) -> bool:
        return self.op == "MEMBAR" and "SYS" in self.modifiers

    def is_system_release_store(self) -> bool:
        """A strong system-scope store or atomic (``st.release.sys``, ``atomicExch_system``...)."""
        return self.op in ("STG", "ST", "RED", "REDG", "ATOM", "ATOMG") and "SYS" in self.modifiers

    def is_indexed_constant_load(self) -> bool:
        """``LDC`` with a register in its address (``c[0x0][R36+0x230]``): an array kernel parameter
        indexed by a value the compiler cannot fold (a peer table read per iteration)."""
        return self.op == "LDC" and re.search(r"c\[0x[0-9a-f]+\]\[R\d+", self.operands) is not None

    def is_local_memory(self) -> bool:
        return self.op in ("LDL", "STL")

    def reads_global_timer(self) -> bool:
        return "SR_GLOBALTIMER" in self.operands

    def is_branch(self) -> bool:
        return self.op in ("BRA", "BRX", "JMP", "JMX")

    def ends_flow(self) -> bool:
        """Control does not fall through (unpredicated branch, exit or return)."""
        return not self.predicate and self.op in ("BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "KILL")


@dataclass
class Block:
    index: int
    start: int  # first instruction index
    end: int  # one past the last
    successors: list[int] = field(default_factory=list)
    predecessors: list[int] = field(default_factory=list)


@dataclass
class Loop:
    """A natural loop: its header block, the blocks of its body and their instructions in address
    order. ``innermost``: no other loop's header lies inside it."""

    header: int
    header_address: int
    blocks: frozenset[int]
    instructions: list[Instruction]
    innermost: bool = True

    @property
    def start(self) -> int:
        return min(i.address for i in self.instructions)

    @property
    def end(self) -> int:
        return max(i.address for i in self.instructions)

    def count(self, predicate) -> int:
        return sum(1 for i in self.instructions if predicate(i))

    def count_before_first(self, counted, first) -> int | None:
        """How many instructions satisfying ``counted`` come (in address order) before the first one
        satisfying ``first``; None when no instruction satisfies ``first``. Counted from the loop's
        header, so the loads a loop issues before its first store on each iteration."""
        ordered = sorted(self.instructions, key=lambda i: i.address)
        head = next(k for k, i in enumerate(ordered) if i.address >= self.header_address)
        ordered = ordered[head:] + ordered[:head]
        n = 0
        for i in ordered:
            if first(i):
                return n
            if counted(i):
                n += 1
        return None

    def sources(self) -> set[tuple[str, int]]:
        return {i.source for i in self.instructions if i.source}

    def __str__(self) -> str:
        return "\n".join(str(i) for i in sorted(self.instructions, key=lambda i: i.address))


class Function:
    """One function of a cubin: its name (mangled) and instructions, with the control-flow graph
    and natural loops built on demand."""

    def __init__(self, name: str, instructions: list[Instruction], labels: dict[str, int]):
        self.name = name
        self.instructions = instructions
        self.labels = labels  # label -> instruction index

    def __repr__(self) -> str:
        return f"Function({self.name!r}, {len(self.instructions)} instructions)"

    @cached_property
    def blocks(self) -> list[Block]:
        n = len(self.instructions)
        leaders = {0}
        for k, ins in enumerate(self.instructions):
            if ins.target is not None and ins.target in self.labels:
                leaders.add(self.labels[ins.target])
            if ins.is_branch() or ins.op in ("EXIT", "RET"):
                if k + 1 < n:
                    leaders.add(k + 1)
        starts = sorted(s for s in leaders if s < n)
        blocks = [Block(b, s, starts[b + 1] if b + 1 < len(starts) else n) for b, s in enumerate(starts)]
        block_of = {s: b for b, s in enumerate(starts)}
        for blk in blocks:
            last = self.instructions[blk.end - 1]
            succ = []
            if last.target is not None and last.target in self.labels:
                succ.append(block_of[self.labels[last.target]])
            if not last.ends_flow() and blk.end < n:
                succ.append(blk.index + 1)
            blk.successors = list(dict.fromkeys(succ))
        for blk in blocks:
            for s in blk.successors:
                blocks[s].predecessors.append(blk.index)
        return blocks

    @cached_property
    def dominators(self) -> list[set[int]]:
        """For each block, the blocks that dominate it (every path from the entry passes them)."""
        blocks = self.blocks
        reachable, stack = set(), [0]
        while stack:
            b = stack.pop()
            if b not in reachable:
                reachable.add(b)
                stack.extend(blocks[b].successors)
        dom = [set(reachable) if b in reachable else {b} for b in range(len(blocks))]
        dom[0] = {0}
        changed = True
        while changed:
            changed = False
            for blk in blocks[1:]:
                if blk.index not in reachable:
                    continue
                preds = [dom[p] for p in blk.predecessors if p in reachable]
                new = (set.intersection(*preds) if preds else set()) | {blk.index}
                if new != dom[blk.index]:
                    dom[blk.index] = new
                    changed = True
        return dom

    def loops(self) -> list[Loop]:
        """The natural loops, one per loop header (back edges u -> h where h dominates u; the
        bodies of back edges to one header are merged)."""
        blocks = self.blocks
        dom = self.dominators
        bodies: dict[int, set[int]] = {}
        for blk in blocks:
            for h in blk.successors:
                if h in dom[blk.index]:
                    body = bodies.setdefault(h, {h})
                    stack = [blk.index]
                    while stack:
                        b = stack.pop()
                        if b in body:
                            continue
                        body.add(b)
                        stack.extend(blocks[b].predecessors)
        loops = []
        for h, body in sorted(bodies.items()):
            ins = [i for b in sorted(body) for i in self.instructions[blocks[b].start:blocks[b].end]]
            loops.append(Loop(h, self.instructions[blocks[h].start].address, frozenset(body), ins))
        for loop in loops:
            loop.innermost = not any(o.header != loop.header and o.header in loop.blocks for o in loops)
        return loops

    def count(self, predicate) -> int:
        return sum(1 for i in self.instructions if predicate(i))

    def window_before(self, index: int, stop) -> list[Instruction]:
        """The instructions before instruction ``index`` back to (not including) the nearest earlier
        one that satisfies ``stop``, following single predecessors across block boundaries."""
        blocks = self.blocks
        block_of = [0] * len(self.instructions)
        for blk in blocks:
            for k in range(blk.start, blk.end):
                block_of[k] = blk.index
        out: list[Instruction] = []
        k = index - 1
        b = block_of[index]
        seen = {b}
        while True:
            while k >= blocks[b].start:
                if stop(self.instructions[k]):
                    return out
                out.append(self.instructions[k])
                k -= 1
            preds = blocks[b].predecessors
            if not preds:
                return out
            # several predecessors: follow the one that falls through (the straight-line path)
            nxt = b - 1 if (b - 1) in preds else preds[0]
            if nxt in seen:
                return out
            seen.add(nxt)
            b = nxt
            k = blocks[b].end - 1


def parse_nvdisasm(text: str) -> dict[str, Function]:
    """Functions of ``nvdisasm -c [-gi]`` output, by (mangled) name."""
    functions: dict[str, Function] = {}
    name = None
    instructions: list[Instruction] = []
    labels: dict[str, int] = {}
    source: tuple[str, int] | None = None
    pending_source = False

    def finish() -> None:
        if name is not None:
            functions[name] = Function(name, instructions, labels)

    for line in text.splitlines():
        if line.startswith("//----") and ".text." in line:
            finish()
            name = line.split(".text.", 1)[1].split()[0]
            instructions, labels, source = [], {}, None
            continue
        if name is None:
            continue
        m = _FILE.match(line)
        if m:
            if not pending_source:  # the first line of a group is the innermost location
                source = (m.group(1), int(m.group(2)))
                pending_source = True
            continue
        pending_source = False
        m = _LABEL.match(line.strip())
        if m and not line.lstrip().startswith("/*"):
            labels[m.group(1)] = len(instructions)
            continue
        m = _INSTR.match(line)
        if m:
            target = _TARGET.search(m.group(4))
            instructions.append(Instruction(int(m.group(1), 16), (m.group(2) or "").strip(), m.group(3),
                                            m.group(4), source, target.group(1) if target else None))
    finish()
    return functions


def disassemble(binary: Path, workdir: Path | None = None) -> dict[str, Function]:
    """Every function of ``binary`` (a cubin, or a host library / object with an embedded fatbin),
    by mangled name, with source lines where the binary has line info."""
    functions: dict[str, Function] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cubin in cubins_of(Path(binary), Path(workdir or tmp)):
            functions.update(parse_nvdisasm(_run([_require("nvdisasm"), "-c", "-gi", str(cubin)])))
    return functions


@dataclass(frozen=True)
class Resources:
    """``cuobjdump -res-usage`` of one function: registers per thread, stack frame, static shared
    memory and local memory in bytes."""

    registers: int
    stack: int
    shared: int
    local: int


def resource_usage(binary: Path) -> dict[str, Resources]:
    """Per function (mangled name) of ``binary``."""
    out: dict[str, Resources] = {}
    name = None
    for line in _run([_require("cuobjdump"), "-res-usage", str(binary)]).splitlines():
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            fields = dict(re.findall(r"(\w+):(\d+)", line))
            out[name] = Resources(int(fields["REG"]), int(fields["STACK"]), int(fields["SHARED"]), int(fields["LOCAL"]))
            name = None
    return out


def kernel_name_matches(mangled: str, name: str) -> bool:
    """Whether the mangled ``mangled`` names a function (or template instance) called ``name``
    (Itanium mangling spells it as its length, then the name, then ``E`` or ``I``)."""
    return re.search(rf"{len(name)}{re.escape(name)}(?=[EI])", mangled) is not None


def find(functions: dict, name: str, template_arg: str | None = None):
    """The entries of ``functions`` (from :func:`disassemble` or :func:`resource_usage`) for the
    function called ``name``; with ``template_arg``, only the instances whose mangled name contains
    it (e.g. "13__nv_bfloat16"). Raises KeyError when there is none."""
    found = {k: v for k, v in functions.items() if kernel_name_matches(k, name)
             and (template_arg is None or f"I{template_arg}" in k)}
    if not found:
        raise KeyError(f"no function {name!r} among {len(functions)}")
    return found


# ---- occupancy ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SmLimits:
    """Per-SM limits of one GPU for the occupancy arithmetic (defaults: Hopper, sm_90)."""

    registers: int = 65536
    register_unit: int = 256  # registers are allocated per warp in units of this many
    max_warps: int = 64
    max_blocks: int = 32
    shared_bytes: int = 233472  # 228 KiB
    shared_reserved_per_block: int = 1024
    num_sms: int = 132  # H100 SXM / H200


H200 = SmLimits()


def blocks_per_sm(regs_per_thread: int, threads: int, shared_bytes: int = 0, limits: SmLimits = H200) -> int:
    """How many blocks of ``threads`` threads using ``regs_per_thread`` registers and
    ``shared_bytes`` of shared memory one SM holds at once (the CUDA occupancy calculator's rules)."""
    warps = -(-threads // 32)
    per_warp = -(-max(regs_per_thread, 1) * 32 // limits.register_unit) * limits.register_unit
    by_regs = (limits.registers // per_warp) // warps
    by_warps = limits.max_warps // warps
    by_shared = limits.max_blocks
    if shared_bytes:
        by_shared = limits.shared_bytes // (shared_bytes + limits.shared_reserved_per_block)
    return min(by_regs, by_warps, by_shared, limits.max_blocks)
