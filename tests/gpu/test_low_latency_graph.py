"""Low-latency dispatch + combine captured in one ``torch.cuda.CUDAGraph`` on the kernel path
(``Buffer(backend="nvshmem")``: one PE, and two processes sharing GPU 0 over a gloo group) and
replayed with new inputs written into the captured tensors: every replay must equal the
reference (bit-exact dispatch, combine within bf16 rounding of the reference's float32 sum), and
the status check must report nothing. With two PEs the replays also exercise the barrier that
counts its rounds on the device. Runs in bench/gpu_check.sh."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.procs import free_port, run_with_deadline

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOKENS, HIDDEN, EXPERTS, TOPK, MAX_TOKENS = 24, 512, 8, 4, 32


def _inputs(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from support.rank_cases import random_routing
    gen = torch.Generator().manual_seed(100 * seed + rank)
    return (torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16(), random_routing(gen, TOKENS, TOPK, EXPERTS, 0.2),
            torch.rand(TOKENS, TOPK, generator=gen))


def _graph_case(rank: int, world: int, port: int, use_fp8: bool, hook: bool, results) -> None:
    import ep_comm
    from ep_comm import reference
    from ep_comm.codecs import fp8
    from ep_comm.placement import ExpertPlacement

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    lines = []
    try:
        try:
            buf = ep_comm.Buffer(dist.group.WORLD, low_latency_mode=True, backend="nvshmem", timeout_s=20.0)
        except Exception as error:  # noqa: BLE001 - NVSHMEM could not start the PEs on this GPU
            lines.append(f"nvshmem-init-failed: {type(error).__name__}: {error}")
            return
        placement = ExpertPlacement.contiguous(EXPERTS, world)
        x, topk, w = (t.cuda() for t in _inputs(0, rank))
        local = EXPERTS // world
        scale = torch.arange(1, local + 1, device="cuda", dtype=torch.float32).view(-1, 1, 1)

        def step():
            recv_x, count, handle, _, recv_hook = buf.low_latency_dispatch(
                x, topk, MAX_TOKENS, EXPERTS, use_fp8=use_fp8, round_scale=use_fp8, return_recv_hook=hook)
            if hook:
                recv_hook()
            expert_in = fp8.dequantize(*recv_x) if use_fp8 else recv_x
            y = buf.get_next_low_latency_combine_buffer(handle)
            y.copy_((expert_in.float() * scale).to(torch.bfloat16))
            combined, _, combine_hook = buf.low_latency_combine(y, topk, w, handle, return_recv_hook=hook)
            if hook:
                combine_hook()
            return recv_x, count, combined

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: the engine and the receive areas exist before capture
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        buf.check_low_latency_status()
        lines.append(str(buf.path_plan.last.get("low_latency_dispatch")))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recv_x, count, combined = step()
        for seed in range(1, 5):
            every = [_inputs(seed, r) for r in range(world)]
            nx, ntopk, nw = every[rank]
            x.copy_(nx)
            topk.copy_(ntopk)
            w.copy_(nw)
            graph.replay()
            torch.cuda.synchronize()
            wants = reference.low_latency_dispatch([e[0] for e in every], [e[1] for e in every], MAX_TOKENS,
                                                   placement)
            want = wants[rank]
            ok = count.cpu().tolist() == want.count
            got_in = fp8.dequantize(*(t.cpu() for t in recv_x)) if use_fp8 else recv_x.cpu()
            refs_in = [fp8.dequantize(*fp8.quantize(wr.x, round_scale=True)) if use_fp8 else wr.x for wr in wants]
            for j, n in enumerate(want.count):
                ok &= torch.equal(got_in[j, :n], refs_in[rank][j, :n])
            ys = [(r_in.float() * scale.cpu()).to(torch.bfloat16) for r_in in refs_in]
            ref_out = reference.low_latency_combine(ys, wants, [e[1] for e in every], [e[2] for e in every],
                                                    placement)[rank]
            diff = (combined.cpu().float() - ref_out.float()).abs().max().item()
            ok &= diff <= 1e-2 * max(1.0, ref_out.float().abs().max().item())
            lines.append(f"replay {seed}: {'ok' if ok else 'MISMATCH'} (combine max diff {diff:.3g})")
        buf.check_low_latency_status()
        lines.append("status ok")
        buf.destroy()
    except Exception as error:  # noqa: BLE001 - reported to the parent
        lines.append(f"{type(error).__name__}: {error}")
    finally:
        results[rank] = lines
        dist.destroy_process_group()


@pytest.mark.parametrize("world,use_fp8,hook", [(1, False, False), (1, True, True), (2, False, True)])
def test_low_latency_capture_and_replay(world: int, use_fp8: bool, hook: bool) -> None:
    results = mp.Manager().dict()
    why = run_with_deadline(_graph_case, (world, free_port(), use_fp8, hook, results), world, 90.0)
    for rank in range(world):
        lines = results.get(rank, [why or "no result"])
        print(f"rank {rank}: " + "\n".join(lines))
        if world > 1 and lines and lines[0].startswith("nvshmem-init-failed"):
            pytest.skip(f"NVSHMEM could not start {world} PEs on one GPU: {lines[0]}")
        assert lines and lines[0].startswith("low_latency_dispatch: fused kernels"), lines
        assert lines[-1] == "status ok" and not any("MISMATCH" in line for line in lines), lines
