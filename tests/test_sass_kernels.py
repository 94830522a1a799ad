"""Properties of the communication kernels' machine code (sm_90 SASS, nvcc's output for the source
as it stands), checked without a GPU (tests/support/sass.py):

- copy loops keep >= 8 independent 16-byte loads in flight before their first 16-byte store;
- the loops that move rows call no function (e.g. a 64-bit ``%`` becomes ``__cuda_sm20_rem_s64``)
  and read no kernel-parameter array through a register index (a peer table per iteration); the
  combine receivers load nothing but the rows themselves in their inner loop;
- spin-waits invalidate no L1 per iteration (``ld.acquire.sys`` emits ``CCTL.IVALL``): they spin
  on relaxed loads and acquire once after success;
- a publish (system-scope release store) is preceded by one system fence, not two;
- no local memory (``LDL`` / ``STL``: spills, or a kernel-parameter struct copied to the stack);
- the low-latency combine's weighted sum has no fused multiply-add (the reference rounds twice);
- every grid the engines launch for the benchmark's configurations fits on an H200 at once
  (the sender and receiver blocks of a launch wait for each other).
"""
from __future__ import annotations

import pytest
from support import sass

pytestmark = pytest.mark.skipif(bool(sass.missing_tools()), reason=f"missing {sass.missing_tools()}")

INTRANODE = "csrc/cuda/intranode.cu"
LOW_LATENCY = "csrc/cuda/low_latency.cu"
BF16 = "13__nv_bfloat16"

# (file, kernel, template argument or None)
COPY_KERNELS = [
    (INTRANODE, "dispatch_kernel", None),
    (INTRANODE, "combine_kernel_bf16", None),
    (INTRANODE, "combine_kernel_f32", None),
    (INTRANODE, "dispatch_direct_kernel", None),
    (INTRANODE, "combine_direct_kernel_bf16", None),
    (INTRANODE, "combine_direct_kernel_f32", None),
    (LOW_LATENCY, "dispatch_send_kernel", None),
    (LOW_LATENCY, "dispatch_recv_kernel", None),
    (LOW_LATENCY, "combine_send_kernel", None),
    (LOW_LATENCY, "combine_recv_kernel", None),
]
SPIN_FILES = [INTRANODE, LOW_LATENCY]
REDUCE_KERNELS = [(INTRANODE, "combine_kernel_bf16", None), (INTRANODE, "combine_kernel_f32", None),
                  (INTRANODE, "combine_direct_kernel_bf16", None), (INTRANODE, "combine_direct_kernel_f32", None),
                  (LOW_LATENCY, "combine_recv_kernel", None)]
MIN_LOADS_IN_FLIGHT = 8


def _kernel(cubins, source: str, name: str, template_arg: str | None) -> sass.Function:
    found = sass.find(cubins(source)["functions"], name, template_arg)
    assert len(found) == 1, list(found)
    return next(iter(found.values()))


def _ours(functions: dict) -> dict:
    """The kernels of ep_comm (not NVSHMEM's or the compiler's helper functions)."""
    return {k: v for k, v in functions.items() if "ep_comm" in k}


def vector_loops(f: sass.Function) -> list[sass.Loop]:
    """The innermost loops that load 16-byte vectors and do not spin (no global-timer read): the row
    copies and the reductions' inner loops."""
    return [lp for lp in f.loops() if lp.innermost and lp.count(lambda i: i.is_global_load_128())
            and not lp.count(lambda i: i.reads_global_timer())]


def loads_before_store(lp: sass.Loop) -> int:
    """16-byte loads an iteration issues before its first 16-byte store (all of them if it stores none)."""
    before = lp.count_before_first(lambda i: i.is_global_load_128(), lambda i: i.is_global_store_128())
    return lp.count(lambda i: i.is_global_load_128()) if before is None else before


def spin_loops(f: sass.Function) -> list[sass.Loop]:
    """The innermost loops that read the global timer: every bounded wait of csrc/common/device_sync.h."""
    return [lp for lp in f.loops() if lp.innermost and lp.count(lambda i: i.reads_global_timer())]


@pytest.mark.parametrize("source,name,template_arg", COPY_KERNELS)
def test_copy_loops_keep_eight_loads_in_flight(cubins, source, name, template_arg):
    f = _kernel(cubins, source, name, template_arg)
    loops = vector_loops(f)
    assert loops, f"{name}: no loop that loads 16-byte vectors"
    for lp in loops:
        before = loads_before_store(lp)
        assert before >= MIN_LOADS_IN_FLIGHT, (
            f"{name}: the loop at {lp.header_address:#x} issues {before} 16-byte loads before its first "
            f"16-byte store (want >= {MIN_LOADS_IN_FLIGHT}):\n{lp}")


@pytest.mark.parametrize("source,name,template_arg", COPY_KERNELS)
def test_inner_loops_call_nothing_and_index_no_parameter_array(cubins, source, name, template_arg):
    f = _kernel(cubins, source, name, template_arg)
    for lp in vector_loops(f):
        calls = [str(i) for i in lp.instructions if i.op == "CALL"]
        indexed = [str(i) for i in lp.instructions if i.is_indexed_constant_load()]
        assert not calls, f"{name}: calls in the inner loop at {lp.header_address:#x}: {calls}"
        assert not indexed, f"{name}: indexed constant loads in the inner loop at {lp.header_address:#x}: {indexed}"


@pytest.mark.parametrize("source,name,template_arg", REDUCE_KERNELS)
def test_combine_inner_loop_loads_only_rows(cubins, source, name, template_arg):
    """Top-k ids, weights, slots and peer addresses are read once per token, not per 16 bytes."""
    f = _kernel(cubins, source, name, template_arg)
    for lp in vector_loops(f):
        other = [str(i) for i in lp.instructions if i.is_global_load() and not i.is_global_load_128()]
        assert not other, f"{name}: the inner loop at {lp.header_address:#x} also loads {other}"


def test_low_latency_combine_does_not_fuse_multiply_add(cubins):
    """The weighted sum rounds each product, then each sum, as the reference's float32 operations
    do: an FFMA (nvcc contracts ``acc += w * x`` by default) would give other bits."""
    f = _kernel(cubins, LOW_LATENCY, "combine_recv_kernel", None)
    fused = [str(i) for i in f.instructions if i.opcode.startswith("FFMA")]
    assert not fused, f"combine_recv_kernel: fused multiply-adds {fused[:4]}"
    assert any(i.opcode.startswith("FMUL") for i in f.instructions), "combine_recv_kernel: no FMUL found"


@pytest.mark.parametrize("source", SPIN_FILES)
def test_spin_loops_do_not_invalidate_l1(cubins, source):
    seen = 0
    for mangled, f in _ours(cubins(source)["functions"]).items():
        for lp in spin_loops(f):
            seen += 1
            ivall = [str(i) for i in lp.instructions if i.opcode.startswith("CCTL") and "IVALL" in i.opcode]
            assert not ivall, f"{mangled}: L1 invalidation in the spin loop at {lp.header_address:#x}: {ivall}"
    assert seen, f"{source}: no spin loop found"


@pytest.mark.parametrize("source", SPIN_FILES)
def test_one_system_fence_per_publish(cubins, source):
    publishes = 0
    for mangled, f in _ours(cubins(source)["functions"]).items():
        for k, ins in enumerate(f.instructions):
            if not ins.is_system_release_store():
                continue
            publishes += 1
            window = f.window_before(k, lambda i: i.is_store())
            fences = [str(i) for i in window if i.is_system_fence()]
            assert len(fences) <= 1, f"{mangled}: {ins} is preceded by {len(fences)} system fences: {fences}"
    assert publishes, f"{source}: no system-scope publish found"


@pytest.mark.parametrize("source", SPIN_FILES)
def test_no_local_memory(cubins, source):
    built = cubins(source)
    for mangled, f in _ours(built["functions"]).items():
        local = [str(i) for i in f.instructions if i.is_local_memory()]
        assert not local, f"{mangled}: {len(local)} local-memory accesses, e.g. {local[:4]}"
        res = built["resources"].get(mangled)
        assert res is None or res.local == 0, f"{mangled}: {res}"


# The benchmark's intranode launches (bench/gpu_bench.py, bench/gpu_check.sh): 8 virtual ranks on
# one GPU, 2 * channels blocks per rank; blocks of 32 * ranks * warps per peer threads, at least 256
# (combine: its receivers' 8 warps): 256 threads at 8 and 16 channels with a warp per peer, 512 at 8
# channels with 2 (ring_w2).
BENCH_RANKS = 8
BENCH_LAUNCHES = [(name, threads, channels)
                  for name in ("dispatch_kernel", "combine_kernel_bf16", "combine_kernel_f32")
                  for threads, channels in ((256, 8), (256, 16), (512, 8))]


@pytest.mark.parametrize("name,threads,channels", BENCH_LAUNCHES)
def test_bench_grids_fit_on_an_h200_at_once(cubins, name, threads, channels):
    res = next(iter(sass.find(cubins(INTRANODE)["resources"], name).values()))
    per_sm = sass.blocks_per_sm(res.registers, threads, res.shared)
    blocks = 2 * channels * BENCH_RANKS
    assert blocks <= per_sm * sass.H200.num_sms, (
        f"{name}: {res.registers} registers x {threads} threads: {per_sm} blocks per SM, "
        f"{per_sm * sass.H200.num_sms} on an H200; {channels} channels x {BENCH_RANKS} ranks launch {blocks}")


def test_occupancy_arithmetic():
    # the figures: 78 registers x 256 threads -> 3 blocks per SM, 396 on 132 SMs
    assert sass.blocks_per_sm(78, 256) == 3
    assert sass.blocks_per_sm(64, 256) == 4
    assert sass.blocks_per_sm(128, 256) == 2
    assert sass.blocks_per_sm(32, 1024) == 2
    assert sass.blocks_per_sm(16, 32, 100 * 1024) == 2  # shared memory bound
