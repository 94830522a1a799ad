"""Every Triton kernel of ep_comm.row_kernels compiled ahead of time, without a GPU, for AMD
MI300 (gfx942), MI350 (gfx950), Hopper (sm_90) and Blackwell (sm_100), so that a change that
breaks one vendor's or generation's compile is a red CI.

Each case gives the argument types and the specializations the JIT makes at run time for the
usual shapes (16-byte aligned pointers, strides and widths divisible by 16: ``tt.divisibility``),
and checks what the kernels' bit-exactness and bandwidth depend on in the generated code:
divisions correctly rounded (Triton's ``/`` is approximate on NVIDIA; ``div_rn`` is not), no
fused multiply-add in the weighted sum (the product must be rounded), and 16-byte row accesses.
The same kernels run on the CPU under the interpreter in tests/test_triton_kernels.py.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from ep_comm.row_kernels import bits, fp8, reduce, rowcopy  # noqa: E402

TARGETS = {
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx950": GPUTarget("hip", "gfx950", 64),
    "sm_90": GPUTarget("cuda", 90, 32),
    "sm_100": GPUTarget("cuda", 100, 32),
}
_BACKENDS = {"hip": "amd", "cuda": "nvidia"}

# what the generated code must (not) contain; NVIDIA PTX, AMD GCN assembly
_VECTOR_16 = {"cuda": r"ld\.global(\.[a-z]+)*\.v(2\.b64|4\.b32)", "hip": r"(global|buffer)_load_dwordx4"}
_PRECISE_DIV = {"cuda": r"div\.rn\.f32", "hip": r"v_div_fixup_f32"}
_APPROX_DIV = {"cuda": r"div\.(full|approx)\.f32", "hip": None}
_FUSED_MUL_ADD = {"cuda": r"fma\.rn(\.ftz)?\.f32", "hip": r"v_(pk_)?fmac?_f32|v_ma[cd]_f32"}


@dataclass
class Case:
    kernel: JITFunction
    signature: dict[str, str]
    constexprs: dict[str, object]
    aligned: tuple[str, ...]  # arguments the JIT specializes as divisible by 16
    vector_16: bool = False  # row loads are 16-byte accesses
    precise_division: bool = False
    no_fused_multiply_add: bool = False


_COPY = {"dst_index": "*i64", "dst_stride": "i32", "src_index": "*i64", "src_stride": "i32", "width": "i32"}
_QUANTIZE = {"src_index": "*i64", "src_stride": "i32", "q": "*u8", "q_index": "*i64", "q_stride": "i32",
             "scales_stride": "i32", "num_groups": "i32"}
_SUM = {"out_stride": "i32", "row_index": "*i64", "row_stride": "i32", "starts": "*i64", "bias0_stride": "i32",
        "bias1_stride": "i32", "width": "i32"}


def _copy(unit: str, dst_indexed: bool, src_indexed: bool, align: int, block: int, aligned: tuple[str, ...],
          vector_16: bool = False) -> Case:
    return Case(rowcopy.copy_rows_kernel, {"dst": unit, "src": unit, **_COPY},
                {"DST_INDEXED": dst_indexed, "SRC_INDEXED": src_indexed, "ALIGN": align, "BLOCK": block},
                aligned, vector_16=vector_16)


def _quantize(src: str, scales: str, kind: int, indexed: bool, round_scale: bool, ue8m0: bool) -> Case:
    return Case(fp8.quantize_rows_kernel, {"src": src, "scales": scales, **_QUANTIZE},
                {"SRC_KIND": kind, "SRC_INDEXED": indexed, "DST_INDEXED": indexed, "ROUND_SCALE": round_scale,
                 "UE8M0": ue8m0, "GROUPS": 8},
                ("src", "src_index", "q", "q_index", "scales", "src_stride"), precise_division=True)


def _sum(out: str, rows: str, weights: str, bias: tuple[str, str], kinds: dict[str, object], block: int | None,
         aligned: tuple[str, ...], **checks: bool) -> Case:
    """``block`` None: the launcher's block for the target's backend (``reduce.BLOCK_ELEMENTS``)."""
    return Case(reduce.sum_rows_kernel,
                {"out": out, "rows": rows, "weights": weights, "bias0": bias[0], "bias1": bias[1], **_SUM},
                {**kinds, "BLOCK": block}, aligned, **checks)


_ROWS_ALIGNED = ("out", "rows", "row_index", "starts", "weights", "bias0", "bias1", "out_stride", "row_stride",
                 "bias0_stride", "bias1_stride", "width")

CASES = {
    # rows.copy_rows: both sides indexed, 8-byte units, rows 16-byte aligned (the hint)
    "copy_indexed": _copy("*i64", True, True, 2, 1024, ("dst", "src", "dst_index", "src_index", "width"), True),
    # a message's blocks: rows at offsets (stride 1) gathered from an indexed source, 2-byte units
    "copy_pack": _copy("*i16", True, True, 1, 4096, ("dst", "src", "dst_index", "src_index", "src_stride")),
    # unpack: received blocks at offsets concatenated, 1-byte units, 8-byte aligned
    "copy_unpack": _copy("*u8", False, True, 8, 8192, ("dst", "src", "src_index", "dst_stride", "width")),
    # low-latency dispatch: tokens quantized straight into message rows
    "fp8_bf16_fused": _quantize("*i16", "*fp32", bits.BF16, True, False, False),
    "fp8_bf16_ue8m0": _quantize("*i16", "*u8", bits.BF16, False, True, True),
    "fp8_f16": _quantize("*fp16", "*fp32", bits.F16, False, False, False),
    "fp8_f32_round": _quantize("*fp32", "*fp32", bits.F32, True, True, False),
    # normal combine: bf16 rows from message blocks (8-byte aligned), a bf16 and a float32 bias
    "sum_bf16_bias": _sum("*i16", "*i16", "*i16", ("*i16", "*fp32"),
                          {"ROW_KIND": bits.BF16, "OUT_KIND": bits.BF16, "WEIGHTED": False, "NUM_BIAS": 2,
                           "BIAS0_KIND": bits.BF16, "BIAS1_KIND": bits.F32, "ROW_ALIGN": 4}, None, _ROWS_ALIGNED),
    "sum_f16": _sum("*fp16", "*fp16", "*fp16", ("*fp16", "*fp16"),
                    {"ROW_KIND": bits.F16, "OUT_KIND": bits.F16, "WEIGHTED": False, "NUM_BIAS": 1,
                     "BIAS0_KIND": bits.F16, "BIAS1_KIND": bits.F16, "ROW_ALIGN": 1}, None, ("out", "rows")),
    # the top-k weights' sum: float32 rows of K values
    "sum_f32_weights": _sum("*fp32", "*fp32", "*fp32", ("*fp32", "*fp32"),
                            {"ROW_KIND": bits.F32, "OUT_KIND": bits.F32, "WEIGHTED": False, "NUM_BIAS": 0,
                             "BIAS0_KIND": bits.F32, "BIAS1_KIND": bits.F32, "ROW_ALIGN": 1}, 16, ()),
    # low-latency combine: bf16 rows times their top-k weights, float32 out
    "sum_weighted": _sum("*fp32", "*i16", "*fp32", ("*fp32", "*fp32"),
                         {"ROW_KIND": bits.BF16, "OUT_KIND": bits.F32, "WEIGHTED": True, "NUM_BIAS": 0,
                          "BIAS0_KIND": bits.F32, "BIAS1_KIND": bits.F32, "ROW_ALIGN": 8}, None, _ROWS_ALIGNED,
                         vector_16=True, no_fused_multiply_add=True),
}


def _compile(case: Case, target: GPUTarget):
    kernel = case.kernel
    constexprs = dict(case.constexprs)
    if constexprs.get("BLOCK", 0) is None:
        constexprs["BLOCK"] = reduce.BLOCK_ELEMENTS[target.backend]
    signature = {**case.signature, **{name: "constexpr" for name in constexprs}}
    missing = [a for a in kernel.arg_names if a not in signature]
    assert not missing, f"{kernel.__name__}: no type for {missing}"
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in case.aligned}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = sys.modules[kernel.fn.__module__].COMPILE_OPTIONS  # the launcher's own options
    return triton.compile(source, target=target, options=dict(options))


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("case_name", list(CASES))
def test_kernel_compiles(case_name, target_name, tmp_path, monkeypatch):
    target = TARGETS[target_name]
    if _BACKENDS[target.backend] not in triton.backends.backends:
        pytest.skip(f"this Triton has no {_BACKENDS[target.backend]} backend")
    case = CASES[case_name]
    if not isinstance(case.kernel, JITFunction):
        pytest.skip("TRITON_INTERPRET is set in this process: the kernels are the interpreter's")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a real compile, not a cached one
    compiled = _compile(case, target)
    backend = target.backend
    binary = compiled.asm["cubin" if backend == "cuda" else "hsaco"]
    assert isinstance(binary, bytes) and len(binary) > 0
    code = compiled.asm["ptx" if backend == "cuda" else "amdgcn"]
    if case.vector_16:
        assert re.search(_VECTOR_16[backend], code), "row loads are not 16-byte accesses"
    if case.precise_division:
        assert re.search(_PRECISE_DIV[backend], code), "no correctly rounded division"
        if _APPROX_DIV[backend]:
            assert not re.search(_APPROX_DIV[backend], code), "an approximate division"
    if case.no_fused_multiply_add:
        assert not re.search(_FUSED_MUL_ADD[backend], code), "a fused multiply-add skips the product's rounding"


def test_every_kernel_has_a_case():
    kernels = {getattr(module, name) for module in (bits, rowcopy, fp8, reduce) for name in dir(module)
               if name.endswith("_kernel") and isinstance(getattr(module, name), JITFunction)}
    if not kernels:
        pytest.skip("TRITON_INTERPRET is set in this process: the kernels are the interpreter's")
    assert kernels == {case.kernel for case in CASES.values()}
