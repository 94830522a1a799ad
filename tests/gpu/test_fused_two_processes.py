"""One process per rank on one GPU: the intranode engine over CUDA IPC peer buffers (the ring copy,
and the direct copy with its per-call exchange of tensors, also falling back to the rings when
torch's expandable segments make a tensor unexportable), and
``Buffer(group, backend="nvshmem")`` (fused normal and low-latency kernels) against the torch
backend on the same inputs, plus a missing peer turning into CommTimeoutError.

Two processes share GPU 0 over a gloo group (NCCL refuses two ranks on one GPU). What NVSHMEM did
with two PEs on one GPU is appended to ``$EP_COMM_GPU_REPORT`` (bench/gpu_check.sh prints it); if
it cannot initialise them, the Buffer test skips with that reason after trying.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.procs import arm_stack_dumps, disarm_stack_dumps, free_port, stack_summary, stop_processes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WORLD = 2
# pytest-timeout gives a test 100 s (bench/gpu_check.sh); these fire first so the parent can
# collect the children's stacks and say how far each got
INIT_LIMIT_S = 45.0  # NVSHMEM initialisation of two PEs on one GPU: longer means it hung
CASE_LIMIT_S = 75.0
DUMP_AFTER_S = CASE_LIMIT_S - 5.0  # a child's own stack dump, should the parent be interrupted first
GLOO_LIMIT_S = 30.0  # torch.distributed collectives give up instead of waiting 30 min for a hung peer


def _report(line: str) -> None:
    path = os.environ.get("EP_COMM_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _entry(rank: int, case, port: int, results, trace_dir: str) -> None:
    dumps = arm_stack_dumps(rank, trace_dir, DUMP_AFTER_S)
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=GLOO_LIMIT_S))
    try:
        results[rank] = case(rank, results)
    except Exception as error:  # noqa: BLE001 - reported to the parent
        results[rank] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    finally:
        dist.destroy_process_group()
        disarm_stack_dumps(dumps)


def _spawn(case) -> tuple[list[str], dict]:
    """Runs ``case(rank, shared)`` on two processes; kills them at the limits. Returns the
    results and the shared dict (``"{rank}/stage"`` entries say how far each got). A killed rank's
    result names its stage and carries its Python stacks. The children and the manager always end
    with the test, also when pytest-timeout interrupts it (then the stacks go to the report)."""
    manager = mp.Manager()
    trace_dir = tempfile.mkdtemp(prefix="ep_comm_stacks_")
    context = None
    results = manager.dict()
    outcome: list[str] | None = None
    waited, interrupted = 0.0, True
    try:
        context = mp.start_processes(_entry, args=(case, free_port(), results, trace_dir), nprocs=WORLD,
                                     start_method="spawn", join=False)
        started = time.monotonic()
        try:
            while not context.join(timeout=1.0):
                waited = time.monotonic() - started
                in_init = any(results.get(f"{r}/stage") == "nvshmem-init" for r in range(WORLD))
                if waited > CASE_LIMIT_S or (in_init and waited > INIT_LIMIT_S):
                    break
            else:
                outcome = [results.get(r, "no result") for r in range(WORLD)]
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            outcome = [results.get(r, f"process error: {str(error).splitlines()[-1]}") for r in range(WORLD)]
        interrupted = False
    finally:
        killed = stop_processes(context.processes, trace_dir) if context is not None else {}
        try:
            shared = dict(results)
        except Exception:  # noqa: BLE001 - the manager connection broke with the interruption
            shared = {}
        manager.shutdown()
        stacks = {r: stack_summary(trace_dir, r, start) for r, start in killed.items()}
        shutil.rmtree(trace_dir, ignore_errors=True)
        if interrupted:
            for r in killed:
                _report(f"{case.__name__} interrupted: rank {r} {_killed(r, waited, shared, stacks[r])}")
    if outcome is None:  # killed at a limit
        outcome = [shared.get(r, _killed(r, waited, shared, stacks.get(r, ""))) for r in range(WORLD)]
    return outcome, shared


def _killed(rank: int, waited: float, shared: dict, stacks: str) -> str:
    """The result of a rank killed at a limit: its last stage and, when it wrote them, its stacks."""
    why = f"killed after {waited:.0f} s at stage {shared.get(f'{rank}/stage', 'start')}"
    return why + (f"\n--- rank {rank} stacks (innermost first) ---\n{stacks}" if stacks else "")


def stage_marker(shared, rank: int):
    """``mark(what)`` records ``what`` as rank ``rank``'s ``"{rank}/stage"``."""
    def mark(what: str) -> None:
        shared[f"{rank}/stage"] = what
    return mark


# -- intranode engine over CUDA IPC (no NVSHMEM involved) -----------------------------------------
def _ipc_engine_case(rank: int, shared) -> str:
    from support.rank_cases import random_routing

    from ep_comm import reference
    from ep_comm.engines import IntranodeEngine
    from ep_comm.placement import ExpertPlacement

    gen = torch.Generator().manual_seed(7)
    e, k, hidden = 8, 4, 512
    placement = ExpertPlacement.from_expert_to_rank(torch.randint(0, WORLD, (e,), generator=gen), WORLD)
    eng = IntranodeEngine(WORLD, placement, torch.device("cuda"), k, hidden * 2, num_channels=3,
                          ring_slots=16, timeout_s=20.0, group=dist.group.WORLD)
    assert eng.local_ranks == [rank] and all(eng.buffers.peers)
    problems = []
    # the second and third rounds reuse the rings and barrier words; in the third rank 1 has no
    # tokens (its weights pointer must still say "with weights")
    for round_, counts in enumerate(([57, 91], [57, 91], [40, 0])):
        xs = [torch.randn(n, hidden, generator=gen).bfloat16() for n in counts]
        topks = [random_routing(gen, n, k, e) for n in counts]
        weights = [torch.rand(n, k, generator=gen) for n in counts]
        w_mine = weights[rank].cuda() if counts[rank] else torch.zeros(1, k, device="cuda")
        got = eng.dispatch([xs[rank].cuda()], [topks[rank].cuda()], [w_mine])[0]
        received = reference.dispatch(xs, topks, weights, placement)
        want = received[rank]
        for key, ref_value in (("recv_x", want.x), ("recv_topk_idx", want.topk_idx),
                               ("recv_topk_weights", want.topk_weights)):
            if not torch.equal(got[key].cpu(), ref_value):
                problems.append(f"round {round_}: {key} differs")
        if not torch.equal(got["recv_src_idx"].cpu().long(), want.src_idx):
            problems.append(f"round {round_}: recv_src_idx differs")
        if got["num_recv_tokens_per_expert"] != want.counts_per_expert:
            problems.append(f"round {round_}: counts {got['num_recv_tokens_per_expert']} != {want.counts_per_expert}")
        y = (got["recv_x"].float() * (rank + 2)).bfloat16()
        gathered: list[object] = [None] * WORLD
        dist.all_gather_object(gathered, y.cpu())
        y_w = got["recv_topk_weights"] if y.shape[0] else torch.zeros(1, k, device="cuda")
        cx, _ = eng.combine([y], [got["handle"]], [y_w])[0]
        ref = reference.combine([y.float() for y in gathered], received, counts)[rank]
        if not torch.allclose(cx.cpu().float(), ref, atol=2e-2, rtol=2e-2):
            problems.append(f"round {round_}: combine differs by {(cx.cpu().float() - ref).abs().max()}")
    eng.close()
    return "ok" if not problems else "; ".join(problems)


def test_intranode_engine_over_cuda_ipc() -> None:
    results, _ = _spawn(_ipc_engine_case)
    _report(f"intranode engine, 2 processes over CUDA IPC: {results}")
    assert results == ["ok"] * WORLD, results


def _ipc_direct_rounds(rank: int, want_copy: str) -> str:
    """Three rounds of dispatch and combine with copy="direct" (rank 1 without tokens in the last),
    bit-exact against the reference; every call must have used ``want_copy``."""
    from support.rank_cases import random_routing

    from ep_comm import reference
    from ep_comm.engines import IntranodeEngine
    from ep_comm.placement import ExpertPlacement

    gen = torch.Generator().manual_seed(11)
    e, k, hidden = 8, 4, 512
    placement = ExpertPlacement.from_expert_to_rank(torch.randint(0, WORLD, (e,), generator=gen), WORLD)
    eng = IntranodeEngine(WORLD, placement, torch.device("cuda"), k, hidden * 2, num_channels=3,
                          ring_slots=16, timeout_s=20.0, group=dist.group.WORLD, copy="direct")
    problems = []
    for round_, counts in enumerate(([57, 91], [57, 91], [40, 0])):
        xs = [torch.randn(n, hidden, generator=gen).bfloat16() for n in counts]
        topks = [random_routing(gen, n, k, e) for n in counts]
        weights = [torch.rand(n, k, generator=gen) for n in counts]
        got = eng.dispatch([xs[rank].cuda()], [topks[rank].cuda()], [weights[rank].cuda()])[0]
        copies = [eng.last_copy]
        received = reference.dispatch(xs, topks, weights, placement)
        want = received[rank]
        for key, ref_value in (("recv_x", want.x), ("recv_topk_idx", want.topk_idx),
                               ("recv_topk_weights", want.topk_weights), ("recv_src_idx", want.src_idx)):
            value = got[key].cpu()
            if not torch.equal(value.long() if key == "recv_src_idx" else value, ref_value):
                problems.append(f"round {round_}: {key} differs")
        if got["num_recv_tokens_per_expert"] != want.counts_per_expert:
            problems.append(f"round {round_}: counts {got['num_recv_tokens_per_expert']} != {want.counts_per_expert}")
        ys = [(r.x.float() * (i + 2)).bfloat16() for i, r in enumerate(received)]
        cx, cw = eng.combine([ys[rank].cuda()], [got["handle"]], [got["recv_topk_weights"]])[0]
        copies.append(eng.last_copy)
        if not torch.equal(cx.cpu(), reference.combine(ys, received, counts)[rank]):
            problems.append(f"round {round_}: combined_x differs")
        if not torch.equal(cw.cpu(), reference.combine([r.topk_weights for r in received], received, counts)[rank]):
            problems.append(f"round {round_}: combined_topk_weights differ")
        if copies != [want_copy, want_copy]:
            problems.append(f"round {round_}: copies {copies}, expected {want_copy}")
    eng.close()
    return "ok" if not problems else "; ".join(problems)


def _ipc_direct_case(rank: int, shared) -> str:
    return _ipc_direct_rounds(rank, "direct")


def _ipc_direct_expandable_case(rank: int, shared) -> str:
    # memory of expandable segments cannot be exported (cudaIpcGetMemHandle): every call falls back
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return _ipc_direct_rounds(rank, "ring")


def test_intranode_engine_direct_copy_over_cuda_ipc() -> None:
    results, _ = _spawn(_ipc_direct_case)
    _report(f"intranode engine, direct copy, 2 processes over CUDA IPC: {results}")
    assert results == ["ok"] * WORLD, results


def test_intranode_engine_direct_copy_falls_back_with_expandable_segments() -> None:
    results, _ = _spawn(_ipc_direct_expandable_case)
    _report(f"intranode engine, direct copy under expandable segments: {results}")
    assert results == ["ok"] * WORLD, results


# -- Buffer(backend="nvshmem") against Buffer(backend="torch") --------------------------------------
def _inputs(rank: int, e: int, k: int, hidden: int, n: int):
    from support.rank_cases import random_routing

    gen = torch.Generator().manual_seed(500 + rank)
    return (torch.randn(n, hidden, generator=gen).bfloat16(), random_routing(gen, n, k, e),
            torch.rand(n, k, generator=gen))


def _compare(problems: list[str], what: str, got, want, exact: bool = True) -> None:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape:
        problems.append(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    elif exact and not torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                                   want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want):
        problems.append(f"{what} differs")
    elif not exact and not torch.allclose(got.float(), want.float(), atol=3e-2, rtol=2e-2):
        problems.append(f"{what} differs by {(got.float() - want.float()).abs().max():.3g}")


def _buffer_case(rank: int, shared) -> str:
    import ep_comm

    group = dist.group.WORLD
    shared[f"{rank}/stage"] = "nvshmem-init"
    try:
        fast = ep_comm.Buffer(group, backend="nvshmem", timeout_s=8.0)
    except Exception as error:  # noqa: BLE001 - NVSHMEM could not start two PEs on this GPU
        return f"nvshmem-init-failed: {type(error).__name__}: {error}"
    shared[f"{rank}/stage"] = "running"
    ref = ep_comm.Buffer(group, backend="torch")
    problems: list[str] = []
    fused = fast.path_plan.get("fused kernels")
    if fused.mode_unavailable("dispatch") or fused.mode_unavailable("low_latency_dispatch"):
        problems.append(f"path plan {fast.path_plan}")
    e, k, hidden = 8, 4, 1024
    x, topk, w = _inputs(rank, e, k, hidden, 61 + 30 * rank)
    xc, topkc, wc = x.cuda(), topk.cuda(), w.cuda()

    # normal mode
    for round_ in range(2):
        a = fast.dispatch(xc, topk_idx=topkc, topk_weights=wc, num_tokens_per_expert=torch.zeros(e, dtype=torch.int32))
        if fast.last_stats.extra.get("fused_kernels") != 1.0:
            problems.append("dispatch did not run the fused kernels")
        b = ref.dispatch(x, topk_idx=topk, topk_weights=w, num_tokens_per_expert=torch.zeros(e, dtype=torch.int32))
        for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
            _compare(problems, f"round {round_} {name}", a[i], b[i])
        if a[3] != b[3]:
            problems.append(f"round {round_} counts {a[3]} != {b[3]}")
        y = (a[0].float() * (rank + 1.5)).bfloat16()
        ca, wa, _ = fast.combine(y, a[4], topk_weights=a[2])
        if fast.last_stats.extra.get("fused_kernels") != 1.0:
            problems.append("combine did not run the fused kernels")
        cb, wb, _ = ref.combine(y.cpu(), b[4], topk_weights=b[2])
        _compare(problems, f"round {round_} combined_x", ca, cb)
        _compare(problems, f"round {round_} combined_topk_weights", wa, wb, exact=False)
    # a cached dispatch and a codec take the transport path with the same handle
    cached = fast.dispatch(xc, handle=a[4])[0]
    _compare(problems, "cached dispatch", cached, b[0])

    # low-latency mode, bf16 and fp8, with and without the receive hook
    t = 96
    for use_fp8, hook in ((False, False), (True, True)):
        ra = fast.low_latency_dispatch(xc, topkc, t, e, use_fp8=use_fp8, return_recv_hook=hook)
        if hook:
            ra[4]()
        rb = ref.low_latency_dispatch(x, topk, t, e, use_fp8=use_fp8)
        _compare(problems, f"ll fp8={use_fp8} recv_count", ra[1], rb[1])
        for j, n in enumerate(rb[1].tolist()):
            if use_fp8:
                _compare(problems, f"ll fp8 expert {j} values", ra[0][0][j, :n], rb[0][0][j, :n])
                _compare(problems, f"ll fp8 expert {j} scales", ra[0][1][j, :n], rb[0][1][j, :n])
            else:
                _compare(problems, f"ll expert {j} rows", ra[0][j, :n], rb[0][j, :n])
        if not use_fp8:
            out_a = fast.low_latency_combine(ra[0], topkc, wc, ra[2], return_recv_hook=True)
            out_a[2]()
            out_b = ref.low_latency_combine(rb[0], topk, w, rb[2])
            _compare(problems, "ll combine", out_a[0], out_b[0], exact=False)
            if fast.last_stats.extra.get("fused_kernels") != 1.0:
                problems.append("low-latency combine did not run the fused kernels")

    # a peer that never calls: the kernels give up and name it
    if rank == 0:
        try:
            fast.dispatch(xc, topk_idx=topkc, topk_weights=wc, num_tokens_per_expert=torch.zeros(e, dtype=torch.int32))
            problems.append("no CommTimeoutError when rank 1 stayed away")
        except ep_comm.CommTimeoutError as error:
            if error.peers != [1] or "intranode" not in error.phase:
                problems.append(f"timeout named peers {error.peers}, phase {error.phase!r}")
    dist.barrier()
    return "ok" if not problems else "; ".join(problems)


def skip_unless_nvshmem_started(results: list[str]) -> None:
    """Skips (with NVSHMEM's reason) when it could not start 2 PEs on one GPU, or hung doing so."""
    init_failed = [r for r in results if r.startswith("nvshmem-init-failed")]
    hung = [r for r in results if r.startswith("killed") and "stage nvshmem-init" in r]
    if init_failed or hung:
        pytest.skip(f"NVSHMEM could not run 2 PEs on one GPU: {(init_failed or hung)[0][:300]}")


def test_buffer_nvshmem_two_processes_match_torch_backend() -> None:
    results, shared = _spawn(_buffer_case)
    _report(f"Buffer(backend='nvshmem'), 2 processes on one GPU: {results}")
    skip_unless_nvshmem_started(results)
    assert results == ["ok"] * WORLD, results
