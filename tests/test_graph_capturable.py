"""Low-latency calls on the NVIDIA kernel path make no host round trip (CUDA-graph capturable).

The Buffer's low-latency calls run on 1 and 2 gloo ranks through the fused kernel path with its
real ``LowLatencyEngine``; only the kernel launches are replaced by an emulation
(:class:`EmulatedKernels`: it computes what the kernels write with ``ep_comm.reference``, and
all-gathers the ranks' inputs over gloo as the kernels read their peers' memory), and the
tensors are device tensors of ``support.host_sync``, which records every host synchronisation the
calls make (value reads, data-sized outputs, device-to-host copies, stream and event waits).
Every call must make none, eager and under capture, with and without the receive hook, bf16,
FP8 and NVFP4, and give the reference's results; bad routing is reported by a later call or
``check_low_latency_status()`` as a ValueError naming the argument, and what a kernel records (a
timeout, an overflow) by the next call. A failure lists each synchronisation with the
ep_comm source line that made it.
"""
from __future__ import annotations

import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from support.host_sync import DEVICE, to_device, to_host, watch
from support.rank_cases import make_routing, make_x

import ep_comm
from ep_comm import reference
from ep_comm.codecs import fp8, nvfp4
from ep_comm.engines import low_latency as ll_engine
from ep_comm.paths import FusedKernelPath, PathPlan
from ep_comm.placement import ExpertPlacement

MAX_TOKENS = 8


class EmulatedKernels:
    """Stands in for ``ep_comm._cuda``'s low-latency launches: writes what the kernels write
    into the tensors the engine passes (its pointer helpers are patched to pass the tensors)."""

    def __init__(self, group: dist.ProcessGroup, placement: ExpertPlacement) -> None:
        self.group, self.placement = group, placement
        self.sent: list | None = None

    @staticmethod
    def nvshmem_built() -> bool:
        return True

    def launch_counted_barrier(self, words, round_, *args) -> None:
        to_host(round_).add_(1)  # the kernel advances this PE's barrier count

    def _gather(self, value: object) -> list:
        out: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def low_latency_dispatch_send(self, common, ranks, use_fp8, round_scale, use_ue8m0, stream) -> None:
        p = ranks[0]
        self.sent = self._gather((to_host(p["x"]).clone(), to_host(p["topk_idx"]).clone()))

    def low_latency_dispatch_recv(self, common, ranks, use_fp8, round_scale, use_ue8m0, stream) -> None:
        p = ranks[0]
        rank = p["rank"]
        xs, topks = [s[0] for s in self.sent], [s[1] for s in self.sent]
        want = reference.low_latency_dispatch_to(rank, xs, topks, common["max_tokens"], self.placement)
        recv_x, count = to_host(p["recv_x"]), to_host(p["recv_count"])
        src_info, layout = to_host(p["recv_src_info"]), to_host(p["layout_range"])
        count.copy_(torch.tensor(want.count, dtype=torch.int32))
        src_info.fill_(-1)
        layout.zero_()
        for j, slots in enumerate(want.slots):
            rows = want.x[j, :len(slots)]
            if use_fp8:
                q, s = fp8.quantize(rows, round_scale=round_scale, use_ue8m0=use_ue8m0)
                recv_x[j, :len(slots)] = q
                to_host(p["recv_scales"])[j, :len(slots)] = s
            else:
                recv_x[j, :len(slots)] = rows
            for i, (src, token) in enumerate(slots):
                src_info[j, i] = token
                if layout[j, src, 1] == 0:
                    layout[j, src, 0] = i
                layout[j, src, 1] += 1

    def low_latency_combine_send(self, common, ranks, stream) -> None:
        p = ranks[0]
        self.sent_back = self._gather((to_host(p["x"]).clone(), to_host(p["topk_idx"]).clone(),
                                       to_host(p["topk_weights"]).clone()))

    def low_latency_combine_recv(self, common, ranks, stream) -> None:
        p = ranks[0]
        xs, topks = [s[0] for s in self.sent], [s[1] for s in self.sent]
        receives = reference.low_latency_dispatch(xs, topks, common["max_tokens"], self.placement)
        ys = [s[0] for s in self.sent_back]
        combined = reference.low_latency_combine(ys, receives, [s[1] for s in self.sent_back],
                                                 [s[2] for s in self.sent_back], self.placement)
        to_host(p["combined_x"]).copy_(combined[p["rank"]])


class _PeerBuffers:
    def __init__(self, nbytes, num_ranks, device, group, settings) -> None:
        self.peers, self.symmetric, self.local_ranks = [0] * num_ranks, 1, [dist.get_rank(group)]

    def close(self) -> None:
        pass


def kernel_path_buffer(group: dist.ProcessGroup, placement: ExpertPlacement):
    """A Buffer whose low-latency calls take the fused kernel path on :data:`DEVICE`, as a
    Buffer over NVSHMEM does (no opening header exchange), and the patches that run its engine
    on :class:`EmulatedKernels`."""
    buf = ep_comm.Buffer(group, low_latency_mode=True, backend="torch")
    buf.device = DEVICE
    buf.transport = types.SimpleNamespace(name="nvshmem", rank=buf.rank, num_ranks=buf.group_size)
    fused = FusedKernelPath(group, DEVICE, buf.timeout_s, buf.buffer_id,
                            unavailable="normal mode is not emulated", low_latency_unavailable=None)
    buf.path_plan = PathPlan([fused], "nvshmem (emulated kernels)")
    kernels = EmulatedKernels(group, placement)
    patches = [mock.patch.object(ll_engine, "cuda_module", lambda: kernels),
               mock.patch.object(ll_engine, "PeerBuffers", _PeerBuffers),
               mock.patch.object(ll_engine, "aligned_ptr", lambda t, name, alignment=16: t),
               mock.patch.object(ll_engine, "ptr_or_none", lambda t: t)]
    return buf, patches


GLOBAL_SCALE = torch.tensor(448.0 * 6 / 5.0)


def _expert_input(recv_x, payload: str, hidden: int) -> torch.Tensor:
    if payload == "fp8":
        return fp8.dequantize(*to_host(recv_x))
    if payload == "nvfp4":
        packed, scales = to_host(recv_x)
        rows = packed.permute(2, 0, 1)
        return nvfp4.dequantize(rows, nvfp4.unswizzle_scales(scales, rows.shape[1], hidden // 16), GLOBAL_SCALE)
    return to_host(recv_x)


def _calls(rank, world, group, experts, topk, hidden, tokens, payload, hook, capturing):
    """Two dispatch + combine rounds on the kernel path under the sync watcher; returns the
    syncs found and the results."""
    placement = ExpertPlacement.contiguous(experts, world)
    buf, patches = kernel_path_buffer(group, placement)
    results, found = [], []
    with patches[0], patches[1], patches[2], patches[3]:
        for round_ in range(2):
            idx, w = make_routing(rank, 30 + round_, tokens[rank], experts, topk, 0.2)
            x = make_x(rank, 30 + round_, tokens[rank], hidden, torch.bfloat16)
            dx, didx, dw = to_device(x), to_device(idx), to_device(w)
            stats = to_device(torch.zeros(experts // world, dtype=torch.int32))
            use_fp8 = payload == "fp8"
            extra = dict(use_nvfp4=True, x_global_scale=to_device(GLOBAL_SCALE)) if payload == "nvfp4" else {}
            with watch(capturing) as log:
                recv_x, count, handle, _, recv_hook = buf.low_latency_dispatch(
                    dx, didx, MAX_TOKENS, experts, cumulative_local_expert_recv_stats=stats,
                    use_fp8=use_fp8, round_scale=use_fp8, return_recv_hook=hook, **extra)
                if hook:
                    recv_hook()
                y_in = buf.get_next_low_latency_combine_buffer(handle)
            expert_in = _expert_input(recv_x, payload, hidden)
            y = (expert_in.float() * 2).to(torch.bfloat16)
            to_host(y_in).copy_(y)
            with watch(capturing) as log2:
                combined, _, combine_hook = buf.low_latency_combine(y_in, didx, dw, handle, return_recv_hook=hook)
                if hook:
                    combine_hook()
            found += log.found + log2.found
            results.append(dict(x=x, idx=idx, w=w, expert_in=expert_in, count=to_host(count).clone(),
                                stats=to_host(stats).clone(), y=y, combined=to_host(combined).clone(),
                                src_info=to_host(handle[0]).clone(), layout=to_host(handle[1]).clone()))
        with watch(capturing) as log3:
            buf.clean_low_latency_buffer(MAX_TOKENS, hidden, experts)
        found += log3.found
    rounds = int(to_host(buf.path_plan.get("fused kernels").low_latency.barrier_round))
    return found, results, str(buf.path_plan.last.get("low_latency_dispatch")), rounds


@pytest.mark.parametrize("world,experts,topk,hidden,tokens,payload,hook,capturing", [
    (1, 4, 2, 128, (6,), "bf16", False, False),
    (1, 8, 3, 256, (8,), "fp8", True, True),
    (2, 8, 3, 128, (5, 8), "bf16", True, True),
    (2, 4, 2, 512, (0, 7), "fp8", False, False),
    (2, 4, 2, 256, (6, 3), "nvfp4", True, True),
])
def test_low_latency_calls_make_no_host_round_trip(ranks, world, experts, topk, hidden, tokens, payload, hook,
                                                   capturing):
    out = ranks(world, _calls, experts, topk, hidden, tokens, payload, hook, capturing)
    for rank, (found, _, choice, rounds) in enumerate(out):
        assert choice.startswith("low_latency_dispatch: fused kernels"), choice
        assert rounds == 4  # one barrier before each send, counted on the device
        assert not found, f"rank {rank}: host synchronisations inside the low-latency calls:\n" + "\n".join(
            f"  {what} at {where}" for what, where in found)
    placement = ExpertPlacement.contiguous(experts, world)
    for round_ in range(2):
        per_rank = [r[1][round_] for r in out]
        xs, idxs = [r["x"] for r in per_rank], [r["idx"] for r in per_rank]
        want = reference.low_latency_dispatch(xs, idxs, MAX_TOKENS, placement)
        for got, ref in zip(per_rank, want):
            assert got["count"].tolist() == ref.count
            assert torch.equal(got["stats"], got["count"])
            for j, slots in enumerate(ref.slots):
                n = len(slots)
                if payload == "fp8":
                    want_in = fp8.dequantize(*fp8.quantize(ref.x[j, :n], round_scale=True))
                elif payload == "nvfp4":
                    want_in = nvfp4.dequantize(*nvfp4.quantize(ref.x[j, :n], GLOBAL_SCALE), GLOBAL_SCALE)
                else:
                    want_in = ref.x[j, :n]
                assert torch.equal(got["expert_in"][j, :n], want_in)
                assert got["src_info"][j, :n].tolist() == [t for _, t in slots]
        combined = reference.low_latency_combine([r["y"] for r in per_rank], want, idxs,
                                                 [r["w"] for r in per_rank], placement)
        for rank, got in enumerate(per_rank):
            assert torch.equal(got["combined"], combined[rank]), f"round {round_} rank {rank}"


def _bad_routing(rank, world, group, case):
    placement = ExpertPlacement.contiguous(8, world)
    buf, patches = kernel_path_buffer(group, placement)
    idx, w = make_routing(rank, 5, 4, 8, 2, 0.0)
    x = make_x(rank, 5, 4, 128, torch.bfloat16)
    bad = idx.clone()
    if case == "range":
        bad[1, 0] = 8
    elif case == "duplicate":
        bad[2, 1] = bad[2, 0]
    else:
        bad[0, :] = -1
    first = idx if case == "combine" else bad
    with patches[0], patches[1], patches[2], patches[3]:
        with watch(True) as log:
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(to_device(x), to_device(first), MAX_TOKENS, 8,
                                                                   use_fp8=False)
        syncs = list(log.found)
        try:
            buf.check_low_latency_status()
            error = None
        except ValueError as e:
            error = str(e)
        # reported once; the Buffer then works again
        buf.check_low_latency_status()
        with watch(True) as log:
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(to_device(x), to_device(idx), MAX_TOKENS, 8,
                                                                   use_fp8=False)
            y = buf.get_next_low_latency_combine_buffer(handle)
            buf.low_latency_combine(y, to_device(bad if case == "combine" else idx), to_device(w), handle)
        syncs += log.found
        try:
            buf.check_low_latency_status()
            later = None
        except ValueError as e:
            later = str(e)
    return syncs, error, later, to_host(count).tolist()


@pytest.mark.parametrize("case", ["range", "duplicate"])
def test_bad_routing_is_reported_by_the_status_check(ranks, case):
    (syncs, error, later, count), = ranks(1, _bad_routing, case)
    assert not syncs, syncs
    assert error is not None and "topk_idx" in error and "low_latency_dispatch" in error
    assert ("[-1, 8)" in error) if case == "range" else ("same expert twice" in error)
    assert later is None


def test_combine_routing_mismatch_is_reported(ranks):
    (syncs, error, later, _), = ranks(1, _bad_routing, "combine")
    assert not syncs, syncs
    assert error is None
    assert later is not None and "topk_idx" in later and "low_latency_combine" in later


def _kernel_records(rank, world, group, status):
    """A kernel records a failure (as the CUDA kernels write the pinned record) after a call that
    returned: the next call, and the status check, report it."""
    from ep_comm.errors import CommTimeoutError

    placement = ExpertPlacement.contiguous(4, world)
    buf, patches = kernel_path_buffer(group, placement)
    idx, _ = make_routing(rank, 8, 4, 4, 2, 0.0)
    x = make_x(rank, 8, 4, 128, torch.bfloat16)
    seen = []
    with patches[0], patches[1], patches[2], patches[3]:
        with watch(True) as log:
            buf.low_latency_dispatch(to_device(x), to_device(idx), MAX_TOKENS, 4, use_fp8=False)
        engine = buf.path_plan.get("fused kernels").low_latency
        syncs = list(log.found)
        for call in ("next call", "status check"):
            words, fields = engine.records[0].words, engine.records[0].fields
            words[fields["status"]], words[fields["rank"]], words[fields["peer"]] = status, rank, 1
            words[fields["phase"]], words[fields["detail"]] = 6, 2
            with watch(True) as log:
                try:
                    if call == "next call":
                        buf.low_latency_dispatch(to_device(x), to_device(idx), MAX_TOKENS, 4, use_fp8=False)
                    else:
                        buf.check_low_latency_status()
                    seen.append((call, None, None))
                except (CommTimeoutError, ValueError) as error:
                    seen.append((call, type(error).__name__, str(error)))
            if call == "next call":
                syncs += log.found
    return syncs, seen, buf._broken


def test_kernel_timeout_is_reported_by_the_next_call(ranks):
    ((syncs, seen, broken),) = ranks(1, _kernel_records, 1)
    assert not syncs
    for call, kind, text in seen:
        assert kind == "CommTimeoutError" and "low_latency/dispatch-recv" in text and "rank 1" in text, (call, text)
    assert broken is not None  # the group is out of step until reset()


def test_kernel_overflow_is_reported_as_a_value_error(ranks):
    ((_, seen, _),) = ranks(1, _kernel_records, 2)
    assert [kind for _, kind, _ in seen] == ["ValueError", "ValueError"]
    assert all("num_max_dispatch_tokens_per_rank" in text for _, _, text in seen)


def test_the_watcher_sees_every_kind_of_host_synchronisation():
    t = to_device(torch.tensor([3, -1, 2, 0]))
    with watch() as log:
        int(t.sum())
        bool((t > 0).any())
        t.tolist()
        t.nonzero()
        t[t > 0]
        t.cpu()
        torch.equal(t, t)
        torch.bincount(t.clamp(min=0))
        t.masked_select(t > 0)
        torch.cuda.synchronize()
        host = torch.zeros(4, dtype=t.dtype)
        host.copy_(t)
    kinds = [what for what, _ in log.found]
    assert len(kinds) == 11, kinds
    with watch() as log:  # device work that needs no wait
        u = (t * 2 + 1).masked_fill(t < 0, -1)
        u.index_add_(0, to_device(torch.tensor([0, 0])), to_device(torch.tensor([5, 5])))
        u[to_device(torch.tensor([1, 2]))]
        torch.zeros(3, device=DEVICE).add_(1)
        host.copy_(u, non_blocking=True)  # into pinned memory on a GPU: asynchronous
    assert not log.found, log.found
    assert host.tolist() == [17, -1, 5, 1]
