"""Properties of the lossless codec kernels' machine code (csrc/cuda/lossless_kernels.cu and
fp8_kernels.cu compiled for sm_90 as ep_comm._cuda compiles them, read without a GPU through
tests/support/sass.py), the budgets of docs/gpu.md's decoder design:

- a decode step (32 values, one per lane) of the default decoder (``decode_kernel_staged``)
  issues at most DECODE_STEP_BUDGET instructions in its step loop, counted statically over the
  loop (its group of steps, the refills and stores of the group included): an H200 issues one
  instruction per cycle per scheduler, so the step's count caps the throughput (the per-step
  decoder it replaced as the default: 109 instructions per step, about 0.69 TB/s at full issue);
- no codec kernel touches local memory (``LDL`` / ``STL``: register spills);
- the staged decoder reads its streams with 16-byte loads (``LDG.E.128`` or ``cp.async``'s
  ``LDGSTS.E.*.128``), writes its values with 16-byte stores (``STG.E.128``) and keeps 40 warps
  resident on an H200; the encoder's passes read the values with 16-byte loads.

Each decoder check failed on the decoder before the staged one (commit e51c64c: 109 and 114
instructions per step, 18 and 12 local-memory instructions, no 16-byte access in either decode
kernel).
"""
from __future__ import annotations

import pytest
from support import sass
from support.native import ROOT

pytestmark = pytest.mark.skipif(bool(sass.missing_tools()), reason=f"missing {sass.missing_tools()}")

LOSSLESS = "csrc/cuda/lossless_kernels.cu"
FP8 = "csrc/cuda/fp8_kernels.cu"
STAGED = "decode_kernel_staged"
DECODERS = [STAGED, "decode_kernel_aligned", "decode_kernel_unaligned"]
# the encoder's three kernels (the second: rans_kernel, or for format 6 rans_fields_kernel)
ENCODERS = ["histogram_kernel", "rans_kernel", "rans_fields_kernel", "layout_kernel"]
# instructions per 32-value decode step (issue 28's budget)
DECODE_STEP_BUDGET = 45


def _kernel(cubins, source: str, name: str) -> sass.Function:
    found = sass.find(cubins(source)["functions"], name)
    assert len(found) == 1, list(found)
    return next(iter(found.values()))


# each decode kernel is built once per checksum: format 7's pair checksum (the default; the
# kernel's name) and the older formats' (its name with this suffix)
CHECKSUMS = {"pairs": "", "linear": "_linear"}


def _decoder(cubins, name: str, checksum: str = "pairs") -> sass.Function:
    return _kernel(cubins, LOSSLESS, name + CHECKSUMS[checksum])


def _source_line(source: str, text: str) -> int:
    """The 1-based line of ``source`` holding ``text`` (exactly once)."""
    lines = [k + 1 for k, line in enumerate((ROOT / source).read_text().splitlines()) if text in line]
    assert len(lines) == 1, (text, lines)
    return lines[0]


def _table_lookup_line() -> int:
    """The decoder's table lookup, one per lane and step (dec_state_step)."""
    return _source_line(LOSSLESS, "const uint32_t entry = table.entry[slot];")


def _staged_lookup_line() -> int:
    """The staged decoder's table lookup (staged_step)."""
    return _source_line(LOSSLESS, "const uint32_t entry = table[slot];")


def step_loop(f: sass.Function, line: int) -> tuple[sass.Loop, int]:
    """A decoder's step loop: of its innermost loops holding table lookups (shared-memory loads from
    the lookup's source ``line``), the one that decodes the most steps an iteration (the staged
    decoder's group of steps, not its loop over a chunk's last few steps); and those steps."""
    def lookups(lp: sass.Loop) -> int:
        return lp.count(lambda i: i.op == "LDS" and i.source is not None and i.source[0].endswith("lossless_kernels.cu")
                        and i.source[1] == line)

    loops = [lp for lp in f.loops() if lp.innermost and lookups(lp) > 0]
    assert loops, f"no step loop in {f.name}"
    best = max(loops, key=lookups)
    return best, lookups(best)


def _step_loop_of(cubins, name: str, checksum: str = "pairs") -> tuple[sass.Loop, int]:
    line = _staged_lookup_line() if name == STAGED else _table_lookup_line()
    return step_loop(_decoder(cubins, name, checksum), line)


def test_step_loop_is_found(cubins):
    """The step loop is identified in every decoder build, and it holds the step's work (a ballot
    and the state's update): the budget checks below measure the right loop."""
    for name in DECODERS:
        for checksum in CHECKSUMS:
            lp, steps = _step_loop_of(cubins, name, checksum)
            assert steps == (8 if name == STAGED else 1), (name, checksum, steps)
            assert lp.count(lambda i: i.op == "VOTE") >= steps and lp.count(lambda i: i.op in ("IMAD", "IMUL")) >= steps


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_decode_step_is_within_its_instruction_budget(cubins, checksum):
    """The default decoder's step loop (of each checksum's build: a group's checksum is taken in
    the loop, from the values it stores), and no divergent-ballot fallback in it
    (WARPSYNC.COLLECTIVE: the compiler could not prove the warp converged, which adds instructions
    to every ballot)."""
    lp, steps = _step_loop_of(cubins, STAGED, checksum)
    per_step = len(lp.instructions) / steps
    assert per_step <= DECODE_STEP_BUDGET, f"{per_step:.1f} instructions per step\n{lp}"
    assert not lp.count(lambda i: i.op == "WARPSYNC"), str(lp)


def _spills(f: sass.Function) -> list[str]:
    return [str(i) for i in f.instructions if i.is_local_memory()]


def _codec_kernels(cubins, source: str) -> dict[str, sass.Function]:
    """The kernels of a codec file (not the compiler's helper functions such as __cuda_sm20_div_u64)."""
    return {k: v for k, v in cubins(source)["functions"].items() if "_kernel" in k}


@pytest.mark.parametrize("name", ENCODERS)
def test_encoder_kernels_do_not_spill(cubins, name):
    assert not _spills(_kernel(cubins, LOSSLESS, name))


def test_fp8_kernels_do_not_spill(cubins):
    kernels = _codec_kernels(cubins, FP8)
    assert kernels
    for name, f in kernels.items():
        assert not _spills(f), name


@pytest.mark.parametrize("checksum", CHECKSUMS)
@pytest.mark.parametrize("name", DECODERS)
def test_decoders_do_not_spill(cubins, name, checksum):
    spills = _spills(_decoder(cubins, name, checksum))
    assert not spills, "\n".join(spills)


@pytest.mark.parametrize("name", ["fields_kernel_aligned", "fields_kernel_unaligned"])
def test_format_6_field_kernels_do_not_spill(cubins, name):
    """The kernels that decode format 6's field streams before the decoder runs (a decode step of
    their own, a table read and built per chunk) keep to registers too."""
    spills = _spills(_kernel(cubins, LOSSLESS, name))
    assert not spills, "\n".join(spills)


def _is_async_copy_128(i: sass.Instruction) -> bool:
    """cp.async of 16 bytes from global to shared memory (``LDGSTS.E.BYPASS.128`` and kin)."""
    return i.op == "LDGSTS" and "128" in i.modifiers


def test_decoder_moves_16_bytes_per_access(cubins):
    """The default decoder stages its streams with 16-byte loads and stores its values 16 bytes at
    a time: in its step loop every global access is 16 bytes wide."""
    lp, _ = _step_loop_of(cubins, STAGED)  # (the default format's build)
    assert lp.count(lambda i: i.is_global_load_128() or _is_async_copy_128(i)) >= 2  # both streams
    assert lp.count(lambda i: i.is_global_store_128()) >= 1
    narrow = [str(i) for i in lp.instructions if i.op in ("LDG", "LD", "STG", "ST")
              and not (i.is_global_load_128() or i.is_global_store_128())]
    assert not narrow, "\n".join(narrow)


def test_staged_decoder_keeps_40_warps_per_sm(cubins):
    """Its registers (launch bounds: 5 blocks of 8 warps) and shared memory (the 16 KiB table and
    8 warps' rings and staging) let an H200 SM hold 5 blocks."""
    for suffix in CHECKSUMS.values():
        (usage,) = sass.find(cubins(LOSSLESS)["resources"], STAGED + suffix).values()
        assert sass.blocks_per_sm(usage.registers, 256, usage.shared) >= 5, usage


def test_encoder_first_pass_reads_16_bytes_per_load(cubins):
    """The encoder's first pass over the values (``histogram_kernel``: histogram, +0.0 count,
    checksum) reads them with 16-byte loads in its value loop (the loop of its histogram's shared
    atomics, 8 values per lane and load), and so does its rANS pass."""
    f = _kernel(cubins, LOSSLESS, "histogram_kernel")
    value_loops = [lp for lp in f.loops() if lp.innermost and lp.count(lambda i: i.op == "ATOMS") >= 8]
    assert len(value_loops) == 1, [str(lp) for lp in value_loops]
    assert value_loops[0].count(lambda i: i.is_global_load_128()) >= 1, str(value_loops[0])
    for name in ("rans_kernel", "rans_fields_kernel"):
        assert _kernel(cubins, LOSSLESS, name).count(lambda i: i.is_global_load_128()) > 0, name
