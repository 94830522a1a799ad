"""Runs vLLM's and SGLang's DeepEP wrapper modules on ep_comm's ``deep_ep``, on 2 CPU gloo ranks.

Started by ``tools/serving_engine_tests.sh`` with the interpreter of an environment that has the
engines' wheels installed (outside this repository) and ep_comm's ``deep_ep`` provided through
``EP_COMM_PROVIDE_DEEP_EP``. The ranks are ``torch.multiprocessing`` spawn workers, as the engines'
own workers are, so ``deep_ep`` reaches them only through the startup hook, not through this
process.

Each case drives one engine class through the calls the engine makes (its own code, unmodified)
and compares what comes back with a plain computation on the same inputs: the rows each expert
receives are the tokens routed to it (FP8 / UE8M0 / NVFP4 decoded here, within the format's
error), and with every expert ``e`` multiplying its tokens by ``e + 1`` a token's combined output
is ``x * sum_k w_k (e_k + 1)`` over its valid top-k slots. A case ends as ``ok``, ``MISMATCH``
(a result differs: exit status 1), ``ERROR`` (ep_comm raised, or the engine's call failed on
ep_comm: exit status 1) or ``NEEDS GPU`` (the engine's own code needs a CUDA device at that point;
what it needs is printed).

Patches, all in the worker and none in ep_comm (each marked ``PATCH`` below):

* vLLM's ``modular_kernel.PIN_MEMORY`` is False (pinned host memory needs a CUDA driver), and
  ``deepep_ht.moe_kernel_quantize_input`` (vLLM's FP8 block quantizer before an FP8 high-throughput
  dispatch, a Triton kernel) is a torch stand-in computing the same per-128-channel e4m3 values.
* vLLM's all2all managers are built without ``__init__`` (it only reads vLLM's dp/tp groups);
  the LL manager's mask tensor is on the CPU, and ``torch.accelerator.synchronize`` is a no-op
  (see :func:`vllm_managers`).
* SGLang's ``DeepEPBuffer.get_deepep_buffer`` reads ``torch.cuda.get_device_properties("cuda")``
  only to warn about few SMs: the driver answers with a stand-in carrying ``multi_processor_count``.
* SGLang's ``deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM`` is set: without DeepGEMM SGLang's normal
  combine raises ``NotImplementedError`` (its Triton runner is disabled); with it, dispatch asks for
  ``expert_alignment=128``, which the driver checks too.
* SGLang's ``moe.utils.get_server_args`` answers None (no server published its arguments), so the
  dispatch dtype follows ``SGLANG_DEEPEP_BF16_DISPATCH`` (set per case: bf16, or SGLang's FP8
  default) and, for NVFP4, the quant config's ``input_global_scale``.
* vLLM's NVFP4 dispatch is switched on by its own ``VLLM_DEEPEPLL_NVFP4_DISPATCH=1``, set in the
  worker.
* SGLang's runtime context (server flags, forward flags, resources) is filled with the values a
  server would publish: DeepEP config unset, no two-batch overlap, ``is_extend_in_batch`` choosing
  the normal or the low-latency path.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist

RANKS = 2
EXPERTS = 8
TOPK = 3
TOKENS = 12
HIDDEN = 2048  # vLLM's low-latency path accepts only DeepEP's compiled hidden sizes (2048 ...)
MAX_TOKENS = 16
MAX_TOKENS_SGLANG = 128  # SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK's default


def routing(rank: int, tokens: int = TOKENS, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [tokens, HIDDEN] bf16, ``topk_ids`` [tokens, TOPK] int64 (some -1), ``topk_weights``
    [tokens, TOPK] fp32: rank ``rank``'s inputs, the same in every process."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)]).to(torch.int64)
    ids[torch.rand(tokens, TOPK, generator=g) < 0.15] = -1
    w = torch.rand(tokens, TOPK, generator=g)
    return x, ids, w


def expected_output(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x * sum_k w_k (ids_k + 1)`` over valid slots, fp32 [tokens, HIDDEN]."""
    factor = (w * (ids + 1).float() * (ids >= 0)).sum(1, keepdim=True)
    return x.float() * factor


def close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 2e-2) -> str | None:
    """None if ``got`` matches ``want`` within ``rel`` of the largest value, else what differs."""
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 1.0
    if err > rel * max(scale, 1.0):
        return f"{what}: max error {err:.4g} (values up to {scale:.4g})"
    return None


def same_rows(got: torch.Tensor, want: torch.Tensor, what: str, rel: float) -> str | None:
    """None if the rows of ``got`` [n, H] are those of ``want`` [n, H] in some order, within ``rel``."""
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not got.numel():
        return None
    match = torch.cdist(got.float(), want.float()).argmin(1)
    if match.unique().numel() != match.numel():
        return f"{what}: rows are not a permutation of the ones sent"
    return close(got, want[match], what, rel)


# ---------------------------------------------------------------- vLLM

def block_quantize(a: torch.Tensor, a_scale, quant_dtype, per_act_token_quant, block_shape, **_):
    """CPU stand-in for vLLM's per-token-group FP8 quantizer (a Triton kernel): ``a`` [N, H] bf16 ->
    (e4m3 [N, H], fp32 scales [N, H / block_shape[1]]), scale = group amax / 448."""
    assert quant_dtype == torch.float8_e4m3fn and block_shape is not None and a_scale is None
    groups = a.float().view(a.shape[0], -1, block_shape[1])
    scale = groups.abs().amax(-1).clamp_min(1e-10) / 448.0
    return (groups / scale.unsqueeze(-1)).view(a.shape).to(torch.float8_e4m3fn), scale


def vllm_ht(rank: int, group, use_fp8: bool = False) -> list[str]:
    import deep_ep
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    import vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht as ht_module
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht import DeepEPHTPrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
    mk.PIN_MEMORY = False  # PATCH: pinned host memory needs a CUDA driver
    if use_fp8:  # PATCH: vLLM's block quantizer is a Triton kernel
        ht_module.moe_kernel_quantize_input = block_quantize
    local = EXPERTS // RANKS
    # vLLM's DeepEPHTAll2AllManager._make_all2all_kwargs for one node
    buffer = deep_ep.Buffer(group=group, num_nvl_bytes=1024 << 20, num_rdma_bytes=0, low_latency_mode=False,
                            num_qps_per_rank=1, explicitly_destroy=True)
    pf = DeepEPHTPrepareAndFinalize(buffer, num_dispatchers=RANKS, dp_size=RANKS, rank_expert_offset=rank * local)
    quant = (FusedMoEQuantConfig.make(torch.float8_e4m3fn, block_shape=[128, 128]) if use_fp8
             else FUSED_MOE_UNQUANTIZED_CONFIG)
    x, ids, w = routing(rank)
    problems = []
    for call in ("prepare", "prepare_async"):
        if call == "prepare":
            expert_x, scale, meta, expert_ids, expert_w = pf.prepare(x, w, ids, EXPERTS, None, False, quant)
        else:
            expert_x, scale, meta, expert_ids, expert_w = pf.prepare_async(x, w, ids, EXPERTS, None, False, quant)()
        if use_fp8:
            expert_x = (expert_x.float().view(expert_x.shape[0], -1, 128) * scale.float().unsqueeze(-1)).view(
                expert_x.shape)
        mine = (expert_ids >= rank * local) & (expert_ids < (rank + 1) * local)
        factor = (expert_w * (expert_ids + 1).float() * mine).sum(1, keepdim=True)
        fused = (expert_x.float() * factor).to(torch.bfloat16)
        counts = meta.expert_num_tokens
        want_counts = torch.stack([((expert_ids == rank * local + e) & mine).any(1).sum() for e in range(local)])
        if not torch.equal(counts.cpu().to(torch.int64), want_counts):
            problems.append(f"{call}: expert_num_tokens {counts.tolist()} != {want_counts.tolist()}")
        output = torch.empty_like(x)
        if call == "prepare":
            pf.finalize(output, fused, w, ids, False, TopKWeightAndReduceNoOP())
        else:
            pf.finalize_async(output, fused, w, ids, False, TopKWeightAndReduceNoOP())()
        problem = close(output, expected_output(x, ids, w), f"{call} + finalize", 0.07 if use_fp8 else 2e-2)
        if problem:
            problems.append(problem)
    buffer.destroy()
    return problems


def ue8m0_scales(packed: torch.Tensor) -> torch.Tensor:
    """DeepEP's packed UE8M0 scales [..., H / 512] int32 -> fp32 [..., H / 128] (byte j of word k: block 4k + j)."""
    exps = packed.contiguous().view(torch.uint8).view(*packed.shape[:-1], -1).to(torch.int32)
    return torch.exp2((exps - 127).float())


def vllm_ll(rank: int, group, use_fp8: bool, ue8m0: bool = False) -> list[str]:
    import deep_ep
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import DeepEPLLPrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    local = EXPERTS // RANKS
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                                         num_ranks=RANKS, num_experts=EXPERTS)
    # vLLM's DeepEPLLAll2AllManager._make_all2all_kwargs
    buffer = deep_ep.Buffer(group=group, num_nvl_bytes=1024 << 20, num_rdma_bytes=rdma, low_latency_mode=True,
                            num_qps_per_rank=local, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                            explicitly_destroy=True, enable_shrink=False)
    pf = DeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=MAX_TOKENS, num_dispatchers=RANKS,
                                    use_fp8_dispatch=use_fp8)
    pf.use_ue8m0_dispatch = ue8m0  # what post_init_setup sets for experts taking packed UE8M0 scales
    quant = (FusedMoEQuantConfig.make(torch.float8_e4m3fn, block_shape=[128, 128]) if use_fp8
             else FUSED_MOE_UNQUANTIZED_CONFIG)
    x, ids, w = routing(rank)
    problems = []
    for call in ("prepare", "prepare_async"):
        if call == "prepare":
            expert_x, scale, meta, _, _ = pf.prepare(x, w, ids, EXPERTS, None, False, quant)
        else:
            hook, receiver = pf.prepare_async(x, w, ids, EXPERTS, None, False, quant)
            hook()
            expert_x, scale, meta, _, _ = receiver()
        counts = meta.expert_num_tokens
        if use_fp8:
            blocks = HIDDEN // 512 if ue8m0 else HIDDEN // 128
            if scale is None or scale.shape[-1] != blocks or scale.dtype != (torch.int32 if ue8m0 else torch.float32):
                problems.append(f"{call}: fp8 scales {None if scale is None else (tuple(scale.shape), scale.dtype)}")
                continue
            if scale.stride()[-2:] != (1, scale.shape[-2]):
                problems.append(f"{call}: fp8 scales strides {scale.stride()} are not DeepEP's column-major")
            scale = ue8m0_scales(scale) if ue8m0 else scale
            deq = (expert_x.float().view(*expert_x.shape[:2], -1, 128) * scale.unsqueeze(-1)).view(expert_x.shape)
        else:
            deq = expert_x.float()
        # plain check of what arrived: every received row is some rank's token routed to that expert
        sources = [routing(r) for r in range(RANKS)]
        for e in range(local):
            g = rank * local + e
            want_rows = torch.cat([s[0][(s[1] == g).any(1)] for s in sources]).float()
            n = int(counts[e])
            if n != want_rows.shape[0]:
                problems.append(f"{call}: expert {g} got {n} rows, {want_rows.shape[0]} were sent")
                continue
            problem = same_rows(deq[e, :n], want_rows, f"{call}: expert {g} rows", 0.07 if use_fp8 else 1e-6)
            if problem:
                problems.append(problem)
        fused = torch.stack([deq[e] * (rank * local + e + 1) for e in range(local)]).to(torch.bfloat16)
        output = torch.empty_like(x)
        if call == "prepare":
            pf.finalize(output, fused, w, ids, False, TopKWeightAndReduceDelegate())
        else:
            hook, receiver = pf.finalize_async(output, fused, w, ids, False, TopKWeightAndReduceDelegate())
            hook()
            receiver()
        problem = close(output, expected_output(x, ids, w), f"{call} + finalize", 0.07 if use_fp8 else 2e-2)
        if problem:
            problems.append(problem)
    buffer.destroy()
    return problems


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_GLOBAL_SCALE = 448.0 * 6.0 / 8.0  # e4m3 max * e2m1 max / an amax above every test value


def nvfp4_rows(packed: torch.Tensor, swizzled: torch.Tensor, expert: int, rows: int) -> torch.Tensor:
    """Plain NVFP4 decode of local expert ``expert``'s first ``rows`` rows, fp32 [rows, H].

    ``packed`` [L, R*T, H/2] uint8 (low nibble first; bit 3 the sign), ``swizzled``
    [32, 4, rm, 4, rk, L] e4m3: the scale of (row m, 16-block k) at [m % 32, m // 32 % 4, m // 128,
    k % 4, k // 4]; value = e2m1 * scale / global scale."""
    codes = torch.stack((packed[expert, :rows] & 15, packed[expert, :rows] >> 4), -1).flatten(-2).long()
    values = torch.tensor(E2M1)[codes & 7] * (1 - 2 * (codes >> 3)).float()
    m = torch.arange(rows).unsqueeze(1)
    k = torch.arange(values.shape[1] // 16).unsqueeze(0)
    scales = swizzled[..., expert].float()[m % 32, m // 32 % 4, m // 128, k % 4, k // 4]
    return values * scales.repeat_interleave(16, -1) / NVFP4_GLOBAL_SCALE


def vllm_ll_nvfp4(rank: int, group) -> list[str]:
    """vLLM's NVFP4 low-latency dispatch (``VLLM_DEEPEPLL_NVFP4_DISPATCH=1``, an NVFP4 model's
    quant config): vLLM hands the packed values and swizzled scales to its FlashInfer experts
    as they come."""
    os.environ["VLLM_DEEPEPLL_NVFP4_DISPATCH"] = "1"
    import deep_ep
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ll import DeepEPLLPrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    local = EXPERTS // RANKS
    buffer = deep_ep.Buffer(group=group, num_nvl_bytes=1024 << 20, low_latency_mode=True, num_qps_per_rank=local,
                            num_rdma_bytes=deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, RANKS,
                                                                                          EXPERTS),
                            allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True)
    pf = DeepEPLLPrepareAndFinalize(buffer, max_tokens_per_rank=MAX_TOKENS, num_dispatchers=RANKS)
    quant = FusedMoEQuantConfig.make("nvfp4", a1_gscale=torch.tensor([NVFP4_GLOBAL_SCALE]))
    x, ids, w = routing(rank)
    expert_x, scale, meta, _, _ = pf.prepare(x, w, ids, EXPERTS, None, False, quant)
    problems = []
    if expert_x.dtype != torch.uint8 or expert_x.shape != (local, RANKS * MAX_TOKENS, HIDDEN // 2):
        return [f"packed values {expert_x.dtype} {tuple(expert_x.shape)}"]
    counts = meta.expert_num_tokens
    sources = [routing(r) for r in range(RANKS)]
    fused = torch.zeros(local, RANKS * MAX_TOKENS, HIDDEN)
    for e in range(local):
        want_rows = torch.cat([s[0][(s[1] == rank * local + e).any(1)] for s in sources]).float()
        n = int(counts[e])
        got = nvfp4_rows(expert_x, scale, e, n)
        problem = same_rows(got, want_rows, f"expert {rank * local + e} rows", 0.25)
        if problem:
            problems.append(problem)
        fused[e, :n] = got * (rank * local + e + 1)
    output = torch.empty_like(x)
    pf.finalize(output, fused.to(torch.bfloat16), w, ids, False, TopKWeightAndReduceDelegate())
    problem = close(output, expected_output(x, ids, w), "prepare + finalize", 0.25)
    if problem:
        problems.append(problem)
    buffer.destroy()
    return problems


def vllm_managers(rank: int, group) -> list[str]:
    """vLLM's DeepEP all2all managers: ``get_handle``, ``set_num_sms``, and the elastic-EP mask calls.

    PATCH: the managers are built without ``__init__``, whose only work is reading vLLM's dp/tp
    groups and the engine config (``init_distributed_environment`` of a running engine); the
    attributes it sets are set here to what one node of 2 EP ranks gives. The LL manager's mask
    tensor is made on the CPU (vLLM makes it on ``"cuda"``) and ``torch.accelerator.synchronize``,
    which needs a device, is a no-op.
    """
    import deep_ep
    from vllm.distributed.device_communicators.all2all import DeepEPHTAll2AllManager, DeepEPLLAll2AllManager
    from vllm.distributed.device_communicators.base_device_communicator import Cache

    def build(cls):
        manager = object.__new__(cls)
        manager.cpu_group, manager.tcp_store_group = group, None
        manager.rank, manager.world_size, manager.internode = rank, RANKS, False
        manager.handle_cache, manager.num_sms, manager.support_fault_tolerance = Cache(), 20, True
        return manager

    problems = []
    ht = build(DeepEPHTAll2AllManager)
    buffer = ht.get_handle({})
    if not isinstance(buffer, deep_ep.Buffer) or buffer is not ht.get_handle({}):
        problems.append("HT get_handle did not give one cached deep_ep.Buffer")
    before = deep_ep.Buffer.num_sms
    ht.set_num_sms(12)
    if deep_ep.Buffer.get_dispatch_config(RANKS).num_sms != 12:
        problems.append("HT set_num_sms(12) did not reach get_dispatch_config")
    deep_ep.Buffer.set_num_sms(before)
    ht.destroy()

    ll = build(DeepEPLLAll2AllManager)
    DeepEPLLAll2AllManager._mask = torch.zeros(RANKS, dtype=torch.int32)
    torch.accelerator.synchronize = lambda *a, **k: None
    buffer = ll.get_handle(dict(max_num_tokens_per_dp_rank=MAX_TOKENS, token_hidden_size=HIDDEN, num_ep_ranks=RANKS,
                                num_global_experts=EXPERTS, num_local_experts=EXPERTS // RANKS))
    if ll.query_fault().item():
        problems.append(f"LL query_fault on a healthy group: mask {ll.query_active_mask().tolist()}")
    buffer.low_latency_update_mask_buffer(1 - rank, True)  # each rank marks the other one failed
    mask = ll.query_active_mask().tolist()
    if mask != [int(r != rank) for r in range(RANKS)] or not ll.query_fault().item():
        problems.append(f"LL mask after marking rank {1 - rank} failed: {mask}")
    ll.clean_buffers()
    if ll.query_active_mask().tolist() != [0] * RANKS:
        problems.append(f"LL mask after clean_buffers: {ll.query_active_mask().tolist()}")
    ll.destroy()
    return problems


# ---------------------------------------------------------------- SGLang

def sglang_setup(extend: bool) -> None:
    from sglang.srt import runtime_context as rc
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.moe import utils as moe_utils

    moe_utils.get_server_args = lambda: None  # PATCH: no server published its args; the dtype follows the env

    deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True  # PATCH: see the module docstring
    torch.cuda.get_device_properties = lambda *a, **k: SimpleNamespace(multi_processor_count=132)  # PATCH
    ctx = rc._CONTEXT
    ctx.flags.moe.deepep_config = ""
    ctx.flags.moe.tbo_enabled = False
    ctx.forward.set("is_extend_in_batch", extend)


def sglang_dispatcher(rank: int, group, mode_name: str, return_recv_hook: bool = True, fp8: bool = False,
                      nvfp4: bool = False) -> list[str]:
    """SGLang's ``DeepEPDispatcher`` in ``mode_name``; ``auto`` runs a normal then a low-latency round
    on the one Buffer (SGLang cleans the low-latency buffer when it switches)."""
    from sglang.srt.layers.moe.token_dispatcher.deepep import (
        DeepEPDispatcher,
        DeepEPLLCombineInput,
        DeepEPNormalCombineInput,
    )
    from sglang.srt.layers.moe.utils import DeepEPMode
    from sglang.srt.runtime_context import get_resources

    mode = DeepEPMode(mode_name)
    sglang_setup(extend=True)
    get_resources().buffers.pop("deepep_ep_state", None)  # one DeepEP Buffer per case, as per server process
    local = EXPERTS // RANKS
    os.environ["SGLANG_DEEPEP_BF16_DISPATCH"] = "0" if fp8 or nvfp4 else "1"  # SGLang's default dtype is FP8
    dispatcher = DeepEPDispatcher(group, router_topk=TOPK, num_experts=EXPERTS, num_local_experts=local,
                                  hidden_size=HIDDEN, params_dtype=torch.bfloat16, deepep_mode=mode,
                                  async_finish=True, return_recv_hook=return_recv_hook)
    if nvfp4:  # an NVFP4 model's MoE runner publishes its input global scale
        dispatcher.set_quant_config({"input_global_scale": torch.tensor([NVFP4_GLOBAL_SCALE])})
    os.environ["SGLANG_DEEPEP_BF16_DISPATCH"] = "1"
    impl = dispatcher._get_impl()
    if (impl.use_fp8, impl.use_nvfp4) != (fp8, nvfp4):
        return [f"SGLang chose use_fp8={impl.use_fp8}, use_nvfp4={impl.use_nvfp4}"]
    problems = []
    rounds = {DeepEPMode.NORMAL: [True], DeepEPMode.LOW_LATENCY: [False], DeepEPMode.AUTO: [True, False, True]}[mode]
    for step, extend in enumerate(rounds):
        sglang_setup(extend=extend)
        x, ids, w = routing(rank, seed=step + 1)
        topk = SimpleNamespace(topk_weights=w, topk_ids=ids, router_logits=None)
        out = dispatcher.dispatch(x, topk)
        if extend:  # normal: received tokens with their local top-k ids (-1 elsewhere)
            mine = out.topk_ids >= 0
            factor = (out.topk_weights * (out.topk_ids + rank * local + 1).float() * mine).sum(1, keepdim=True)
            if any(n % 128 for n in out.num_recv_tokens_per_expert):
                problems.append(f"num_recv_tokens_per_expert {out.num_recv_tokens_per_expert} not aligned to 128")
            y = (out.hidden_states.float() * factor).to(torch.bfloat16)
            combined = dispatcher.combine(DeepEPNormalCombineInput(y, out.topk_ids, out.topk_weights))
        else:  # low latency: [local, R * max tokens, H] per expert, masked_m rows valid
            sent = [((routing(r, seed=step + 1)[1] == rank * local + e).any(1)).sum() for r in range(RANKS)
                    for e in range(local)]
            want_m = torch.stack(sent).view(RANKS, local).sum(0)
            if not torch.equal(out.masked_m.to(torch.int64), want_m):
                problems.append(f"masked_m {out.masked_m.tolist()} != {want_m.tolist()}")
            if nvfp4:  # DeepEP's NVFP4 layout: packed [R*T, H/2, L] (a permuted view), swizzled scales
                packed = out.hidden_states.permute(2, 0, 1)
                hidden = torch.zeros(local, RANKS * MAX_TOKENS_SGLANG, HIDDEN)
                for e in range(local):
                    n = int(out.masked_m[e])
                    hidden[e, :n] = nvfp4_rows(packed, out.hidden_states_scale, e, n)
            else:
                hidden = out.hidden_states.float()
            if fp8:  # per-128-channel fp32 scales [local, R * max tokens, H / 128], DeepEP's column-major strides
                scale = out.hidden_states_scale
                if scale.stride()[-2:] != (1, scale.shape[-2]):
                    problems.append(f"fp8 scales strides {scale.stride()} are not DeepEP's column-major")
                hidden = (hidden.view(*hidden.shape[:2], -1, 128) * scale.unsqueeze(-1)).view(hidden.shape)
            y = torch.stack([hidden[e] * (rank * local + e + 1) for e in range(local)])
            combined = dispatcher.combine(DeepEPLLCombineInput(y.to(torch.bfloat16), ids, w))
        problem = close(combined, expected_output(x, ids, w), f"round {step} ({'normal' if extend else 'll'})",
                        0.25 if nvfp4 else 0.07 if fp8 else 2e-2)
        if problem:
            problems.append(problem)
    return problems


CASES = {
    "vllm deepep_ht.DeepEPHTPrepareAndFinalize (bf16)": lambda r, g: vllm_ht(r, g),
    "vllm deepep_ll.DeepEPLLPrepareAndFinalize (bf16)": lambda r, g: vllm_ll(r, g, use_fp8=False),
    "vllm deepep_ll.DeepEPLLPrepareAndFinalize (fp8 block 128)": lambda r, g: vllm_ll(r, g, use_fp8=True),
    "vllm deepep_ll.DeepEPLLPrepareAndFinalize (fp8, packed UE8M0 scales)":
        lambda r, g: vllm_ll(r, g, use_fp8=True, ue8m0=True),
    "vllm deepep_ll.DeepEPLLPrepareAndFinalize (nvfp4)": lambda r, g: vllm_ll_nvfp4(r, g),
    "vllm deepep_ht.DeepEPHTPrepareAndFinalize (fp8 block 128)": lambda r, g: vllm_ht(r, g, use_fp8=True),
    "vllm all2all.DeepEPHTAll2AllManager / DeepEPLLAll2AllManager (mask calls)": lambda r, g: vllm_managers(r, g),
    "sglang token_dispatcher.deepep.DeepEPDispatcher (normal, async_finish)":
        lambda r, g: sglang_dispatcher(r, g, "normal"),
    "sglang token_dispatcher.deepep.DeepEPDispatcher (low_latency, return_recv_hook)":
        lambda r, g: sglang_dispatcher(r, g, "low_latency"),
    "sglang token_dispatcher.deepep.DeepEPDispatcher (low_latency, async_finish)":
        lambda r, g: sglang_dispatcher(r, g, "low_latency", return_recv_hook=False),
    "sglang token_dispatcher.deepep.DeepEPDispatcher (low_latency, fp8)":
        lambda r, g: sglang_dispatcher(r, g, "low_latency", fp8=True),
    "sglang token_dispatcher.deepep.DeepEPDispatcher (low_latency, nvfp4)":
        lambda r, g: sglang_dispatcher(r, g, "low_latency", nvfp4=True),
    "sglang token_dispatcher.deepep.DeepEPDispatcher (auto: normal, low_latency, normal)":
        lambda r, g: sglang_dispatcher(r, g, "auto"),
}

GPU_MARKERS = ("Torch not compiled with CUDA", "No CUDA GPUs", "cuda", "CUDA", "nvidia")


def worker(rank: int, port: int, names: list[str], results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    group = dist.new_group(list(range(RANKS)), backend="gloo")
    import deep_ep

    from ep_comm.integrations.deep_ep import is_provided
    out = {"deep_ep": f"{deep_ep.__version__} from {deep_ep.__file__} (ep_comm's: {is_provided(deep_ep)})"}
    for name in names:
        try:
            problems = CASES[name](rank, group)
            out[name] = ("MISMATCH", "; ".join(problems)) if problems else ("ok", "")
        except Exception as error:  # one case failing must not stop the others
            text = "".join(traceback.format_exception_only(type(error), error)).strip()
            where = traceback.extract_tb(error.__traceback__)[-1]
            kind = "NEEDS GPU" if any(m in text for m in GPU_MARKERS) and "ep_comm" not in where.filename \
                else "ERROR"
            out[name] = (kind, f"{text} (at {where.filename}:{where.lineno})")
        dist.barrier(group)
    results[rank] = out
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("cases", nargs="*", help="substrings of the case names (default: all)")
    args = parser.parse_args(argv)
    names = [n for n in CASES if not args.cases or any(c.lower() in n.lower() for c in args.cases)]
    if not names:
        parser.error(f"no case name contains any of {args.cases}; the cases: {list(CASES)}")
    import torch.multiprocessing as mp
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(worker, args=(args.port, names, results), nprocs=RANKS, start_method="spawn")
    print(f"deep_ep in the workers: {results[0]['deep_ep']}")
    failed = 0
    for name in names:
        kinds = {results[r][name][0] for r in range(RANKS)}
        kind = "ok" if kinds == {"ok"} else next(k for k in ("ERROR", "MISMATCH", "NEEDS GPU") if k in kinds)
        detail = next((results[r][name][1] for r in range(RANKS) if results[r][name][0] == kind), "")
        print(f"{kind:9} {name}{': ' + detail if detail else ''}")
        failed += kind in ("ERROR", "MISMATCH")
    print(f"{len(names) - failed} of {len(names)} cases without an error or a mismatch")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
