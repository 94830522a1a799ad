"""ep_comm's Megatron token dispatcher inside megatron-core's real ``MoELayer``, on CPU/gloo.

On 2 and 4 ranks, a Megatron MoE layer (TopKRouter, SequentialMLP experts) is switched to
``EpCommTokenDispatcher`` (with ``EpCommMoELayer`` or with ``patch_megatron``) and run with expert
parallelism over all ranks. Every rank also builds the same layer with all experts on a 1-rank
group, with Megatron's own all-gather dispatcher, and runs it on every rank's tokens. Outputs, input
gradients, expert weight gradients and the (all-reduced) router gradient must agree in float32
to max |diff| <= 1e-5 + 1e-5 * max |reference| per tensor (only summation orders differ).

Megatron's router moves its weight to CUDA and uses a TE GEMM in ``gating``; the test router below
overrides ``gating`` with a plain float32 linear so that the layer runs on a CPU.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed (optional dependency)")

HIDDEN, FFN, EXPERTS, TOP_K, SEQ, BATCH = 16, 12, 8, 2, 6, 2
_groups: dict[tuple[int, int], dist.ProcessGroup] = {}


def _own_group(rank: int, world_size: int) -> dist.ProcessGroup:
    """This rank alone, as a process group (every rank creates all of them, in the same order)."""
    if (world_size, 0) not in _groups:
        for r in range(world_size):
            _groups[(world_size, r)] = dist.new_group([r])
    return _groups[(world_size, rank)]


def _pg_collection(ep: dist.ProcessGroup, own: dist.ProcessGroup):
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg = ProcessGroupCollection()
    for name in ("tp", "cp", "expt_tp", "expt_dp", "tp_cp", "tp_dp_cp", "pp", "dp"):
        setattr(pg, name, own)
    pg.ep = pg.tp_ep = ep
    return pg


def _config(dispatcher_type: str, dtype: torch.dtype = torch.float32, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN, add_bias_linear=False,
        use_cpu_initialization=True, gradient_accumulation_fusion=False,
        moe_token_dispatcher_type=dispatcher_type, moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16, **extra)


def _submodules():
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.router import TopKRouter

    class CpuTopKRouter(TopKRouter):
        def gating(self, input: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(input.float(), self.weight.float())

    submodules = get_moe_module_spec(use_te=False, num_experts=EXPERTS).submodules
    submodules.router = CpuTopKRouter
    return submodules


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``x [SEQ, BATCH, H]`` and output cotangent, float32."""
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=g), torch.randn(SEQ, BATCH, HIDDEN, generator=g)


def _megatron_case(rank: int, world_size: int, group: dist.ProcessGroup, how: str):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from ep_comm.integrations import megatron as ep_megatron

    own = _own_group(rank, world_size)
    ref = MoELayer(_config("allgather"), _submodules(), pg_collection=_pg_collection(own, own))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(ref.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    if how == "subclass":
        layer = ep_megatron.EpCommMoELayer(_config("alltoall"), _submodules(),
                                           pg_collection=_pg_collection(group, own))
    else:
        ep_megatron.patch_megatron()
        try:
            layer = MoELayer(_config("alltoall"), _submodules(), pg_collection=_pg_collection(group, own))
        finally:
            ep_megatron.unpatch_megatron()
    assert isinstance(layer.token_dispatcher, ep_megatron.EpCommTokenDispatcher)
    local = layer.local_expert_indices
    with torch.no_grad():
        layer.router.weight.copy_(ref.router.weight)
        for j, g in enumerate(local):
            layer.experts.local_experts[j].load_state_dict(ref.experts.local_experts[g].state_dict())

    xs, grads = zip(*(_inputs(r) for r in range(world_size)))
    x = xs[rank].clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    out.backward(grads[rank])
    dist.all_reduce(layer.router.weight.grad, group=group)

    x_all = torch.cat(xs, dim=0).requires_grad_()
    ref_out, _ = ref(x_all)
    ref_out.backward(torch.cat(grads, dim=0))
    rows = slice(rank * SEQ, (rank + 1) * SEQ)

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / (1e-5 + 1e-5 * b.abs().max()))

    errors = {"output": err(out.detach(), ref_out.detach()[rows]),
              "grad_x": err(x.grad, x_all.grad[rows]),
              "grad_router": err(layer.router.weight.grad, ref.router.weight.grad)}
    for j, g in enumerate(local):
        mine, theirs = layer.experts.local_experts[j], ref.experts.local_experts[g]
        for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
            errors[f"grad_expert{g}.{name}"] = err(p.grad, q.grad)
    return errors, float(ref_out.abs().max())


@pytest.mark.parametrize("world_size,how", [(2, "subclass"), (4, "subclass"), (2, "patch")])
def test_megatron_layer_matches_single_process(ranks, world_size, how):
    for rank, (errors, scale) in enumerate(ranks(world_size, _megatron_case, how)):
        assert scale > 0.1
        bad = {k: v for k, v in errors.items() if not v <= 1.0}
        assert not bad, f"rank {rank}: max |diff| / (1e-5 + 1e-5 * max|ref|) above 1: {bad}"


def _codec_case(rank: int, world_size: int, group: dist.ProcessGroup):
    from ep_comm.integrations.megatron import EpCommMoELayer

    own = _own_group(rank, world_size)
    outputs, codecs = [], []
    for codec in (None, "lossless"):
        torch.manual_seed(3)
        layer = EpCommMoELayer(_config("alltoall", torch.bfloat16), _submodules(),
                               pg_collection=_pg_collection(group, own), codec=codec)
        x = _inputs(rank)[0].to(torch.bfloat16)
        with torch.no_grad():
            outputs.append(layer(x)[0])
        codecs.append(layer.token_dispatcher.buffer.last_stats.codec)
    return outputs, codecs


def test_lossless_codec_option_is_used_and_bit_exact(ranks):
    for (plain, coded), codecs in ranks(2, _codec_case):
        assert codecs == ["none", "lossless"]
        assert torch.equal(plain.view(torch.int16), coded.view(torch.int16))


def test_patch_and_unpatch():
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    from ep_comm.integrations import megatron as ep_megatron

    ep_megatron.patch_megatron(codec="lossless")
    try:
        assert moe_layer.MoEAlltoAllTokenDispatcher is not token_dispatcher.MoEAlltoAllTokenDispatcher
        assert moe_layer.MoEAllGatherTokenDispatcher is token_dispatcher.MoEAllGatherTokenDispatcher
    finally:
        ep_megatron.unpatch_megatron()
    assert moe_layer.MoEAlltoAllTokenDispatcher is token_dispatcher.MoEAlltoAllTokenDispatcher
    with pytest.raises(ValueError, match="dispatcher_type"):
        ep_megatron.patch_megatron(dispatcher_type="nccl")


def test_routing_map_to_topk():
    from ep_comm.integrations.megatron import routing_map_to_topk

    routing_map = torch.tensor([[False, True, False, True], [False, False, False, False],
                                [True, False, False, False]])
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7], [0.0, 0.0, 0.0, 0.0], [0.9, 0.0, 0.0, 0.0]],
                         requires_grad=True)
    idx, w = routing_map_to_topk(routing_map, probs, 2)
    assert idx.tolist() == [[1, 3], [-1, -1], [0, -1]]
    torch.testing.assert_close(w, torch.tensor([[0.3, 0.7], [0.0, 0.0], [0.9, 0.0]]))
    w.sum().backward()
    assert probs.grad.tolist() == routing_map.float().tolist()
    with pytest.raises(ValueError, match="more than moe_router_topk"):
        routing_map_to_topk(routing_map, probs, 1)


def _graph_config(impl: str, scope: list[str]):
    return _config("alltoall", cuda_graph_impl=impl, cuda_graph_scope=scope)


def _partial_graph_replays(rank: int, world_size: int, group: dist.ProcessGroup):
    """Megatron's TE partial graph (scope moe_router + moe_preprocess), simulated on the CPU: a
    capture run that stops after ``dispatch_preprocess`` and returns the graph outputs, then two
    replays that skip router and preprocess, set the ``cudagraph_attrs`` outputs back on the
    dispatcher and resume the forward, as ``TransformerLayer._te_cuda_graph_replay`` does."""
    from unittest import mock

    from megatron.core.transformer.moe import moe_utils

    from ep_comm.integrations.megatron import EpCommMoELayer

    own = _own_group(rank, world_size)
    torch.manual_seed(7)
    layer = EpCommMoELayer(_graph_config("transformer_engine", ["moe_router", "moe_preprocess"]),
                           _submodules(), pg_collection=_pg_collection(group, own))
    dispatcher = layer.token_dispatcher
    x = _inputs(rank)[0]
    with torch.no_grad():
        eager, _ = layer(x)
        with mock.patch.object(moe_utils, "is_graph_capturing", return_value=True):
            graph_outputs = layer(x)
        attr_names = list(dispatcher.valid_cudagraph_attrs)
        replays = []
        for _ in range(2):
            hidden, probs, *attrs = [t.clone() for t in graph_outputs]
            for name, value in zip(attr_names, attrs):
                *parents, last = name.split(".")
                owner = dispatcher
                for part in parents:
                    owner = getattr(owner, part)
                setattr(owner, last, value)
            layer.cudagraph_tensor_store.set(hidden_states=hidden, probs=probs, routing_map=None,
                                             shared_expert_output=None)
            try:
                out, _ = layer(x)
            finally:
                layer.cudagraph_tensor_store.clear()
            replays.append(out)
    return attr_names, len(graph_outputs), [torch.equal(out, eager) for out in replays], eager.shape == x.shape


def test_partial_cuda_graph_replays_twice(ranks):
    for attr_names, num_outputs, same, shape_ok in ranks(2, _partial_graph_replays):
        assert attr_names == ["topk_idx"] and num_outputs == 3
        assert same == [True, True] and shape_ok


def _graphed_dispatch_configs(rank: int, world_size: int, group: dist.ProcessGroup):
    from ep_comm.integrations.megatron import EpCommMoELayer

    own = _own_group(rank, world_size)
    errors = {}
    for impl, scope in (("local", []), ("transformer_engine", []), ("local", ["full_iteration"]),
                        ("local", ["attn"])):
        try:
            EpCommMoELayer(_graph_config(impl, scope), _submodules(), pg_collection=_pg_collection(group, own))
            errors[(impl, tuple(scope))] = None
        except ValueError as error:
            errors[(impl, tuple(scope))] = str(error)
    for scope in (["moe_router"], ["attn", "moe_router", "moe_preprocess"]):
        EpCommMoELayer(_graph_config("local", scope), _submodules(), pg_collection=_pg_collection(group, own))
    return errors


def test_cuda_graph_scopes_that_capture_the_dispatch_fail_at_construction(ranks):
    for errors in ranks(2, _graphed_dispatch_configs):
        assert errors.pop(("local", ("attn",))) is None  # the MoE layer runs eagerly
        assert set(errors) == {("local", ()), ("transformer_engine", ()), ("local", ("full_iteration",))}
        for key, text in errors.items():
            assert text is not None, key
            assert "CUDA graph" in text and "moe_pad_experts_for_cuda_graph_inference" in text


def _decode_padding(rank: int, world_size: int, group: dist.ProcessGroup):
    """Megatron inference's ``set_decode_expert_padding`` (moe_pad_experts_for_cuda_graph_inference)
    around partial graphs: the router then pads every expert to capacity ``N`` (all tokens)."""
    from megatron.core.inference import utils as inference_utils

    from ep_comm.integrations.megatron import EpCommMoELayer

    own = _own_group(rank, world_size)
    torch.manual_seed(5)
    layer = EpCommMoELayer(_graph_config("local", ["moe_router"]), _submodules(),
                           pg_collection=_pg_collection(group, own))
    x = _inputs(rank)[0]
    inference_utils.moe_layer_cache = None
    try:
        with torch.no_grad():
            plain, _ = layer(x)
            plain_pairs = sum(layer.token_dispatcher.tokens_per_expert)
            inference_utils.set_decode_expert_padding(layer, True, capacity_factor=EXPERTS / TOP_K)
            padded_on = layer.token_dispatcher.drop_and_pad
            padded, _ = layer(x)
            padded_pairs = sum(layer.token_dispatcher.tokens_per_expert)
            inference_utils.set_decode_expert_padding(layer, False)
            again, _ = layer(x)
    finally:
        inference_utils.moe_layer_cache = None
    scale = float(plain.abs().max())
    return padded_on, float((padded - plain).abs().max()) / scale, torch.equal(again, plain), (
        plain_pairs, padded_pairs)


def test_decode_expert_padding_dispatches_the_padded_map(ranks):
    world_size = 2
    for padded_on, rel_err, again_same, (plain_pairs, padded_pairs) in ranks(world_size, _decode_padding):
        assert padded_on and again_same
        assert rel_err <= 1e-5
        # padded to capacity N = all tokens: every local expert gets every rank's every token
        assert padded_pairs == EXPERTS // world_size * world_size * SEQ * BATCH > plain_pairs
