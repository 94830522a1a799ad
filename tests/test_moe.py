"""The reference MoE layer (ep_comm.moe): expert-parallel training equals the single-process run.

A toy regression model (linear -> tanh -> residual MoE -> linear head) trains with SGD in float32
with expert parallelism over 1 rank (each rank of the 2-rank pool on its own group) and over 2
ranks, each rank holding a shard of the batch and ``E / R`` experts; the replicated parameters'
gradients are summed over the ranks. The same model trains on the whole batch in this process
with the communication-free layer (``group=None``). Tolerance: losses and final parameters agree
to rtol 1e-5 / atol 1e-6 (float32; only summation orders differ and the routing makes the same
choices), and the loss must fall by at least half.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ep_comm
from ep_comm.moe import MoE, apply_experts, route

D_IN, HIDDEN, FFN, EXPERTS, TOP_K = 6, 16, 24, 4, 2
TOKENS_PER_RANK, STEPS, LR = 24, 6, 0.05
_groups: dict[tuple[int, int], dist.ProcessGroup] = {}


class ToyModel(nn.Module):
    """``x [N, D_IN]`` float32 -> ``[N, 1]``."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.inp = nn.Linear(D_IN, HIDDEN, dtype=torch.float32)
        self.head = nn.Linear(HIDDEN, 1, dtype=torch.float32)
        with torch.no_grad():
            for p in (*self.inp.parameters(), *self.head.parameters()):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.5)
        self.moe = MoE(HIDDEN, FFN, EXPERTS, TOP_K, group=group, init_seed=5, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(h + self.moe(h))

    def replicated_parameters(self) -> list[nn.Parameter]:
        return [*self.inp.parameters(), *self.head.parameters(), *self.moe.replicated_parameters()]


def _data(num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: ``x [R * T, D_IN]``, ``y [R * T, 1]`` float32."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_ranks * TOKENS_PER_RANK, D_IN, generator=gen, dtype=torch.float32)
    y = torch.sin(x @ torch.linspace(-1, 1, D_IN, dtype=torch.float32)).unsqueeze(-1)
    return x, y


def _train(model: ToyModel, x: torch.Tensor, y: torch.Tensor, total: int,
           group: dist.ProcessGroup | None) -> list[float]:
    """SGD on ``sum((model(x) - y)^2) / total``; returns the global loss before each step."""
    losses = []
    for _ in range(STEPS):
        model.zero_grad()
        loss = ((model(x) - y) ** 2).sum() / total
        loss.backward()
        value = loss.detach().clone()
        if group is not None:
            dist.all_reduce(value, group=group)
            for p in model.replicated_parameters():
                dist.all_reduce(p.grad, group=group)
        losses.append(float(value))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return losses


def _own_group(rank: int, world_size: int) -> dist.ProcessGroup:
    """This rank alone, as a process group (every rank creates all of them, in the same order)."""
    if (world_size, 0) not in _groups:
        for r in range(world_size):
            _groups[(world_size, r)] = dist.new_group([r])
    return _groups[(world_size, rank)]


def _train_case(rank: int, world_size: int, group: dist.ProcessGroup, ep_size: int):
    """Trains on ``ep_size`` ranks: the whole pool, or (``ep_size == 1``) each rank on its own."""
    if ep_size == 1:
        group, rank = _own_group(rank, world_size), 0
    torch.manual_seed(0)
    x, y = _data(ep_size)
    shard = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
    model = ToyModel(group)
    losses = _train(model, x[shard], y[shard], x.shape[0], group)
    experts = {g: {k: v.clone() for k, v in e.state_dict().items()}
               for g, e in zip(model.moe.global_expert_ids, model.moe.experts)}
    return losses, model.moe.router_weight.detach().clone(), experts


@pytest.mark.parametrize("ep_size", [1, 2])
def test_training_matches_single_process(ranks, ep_size):
    results = ranks(2, _train_case, ep_size)
    x, y = _data(ep_size)
    ref = ToyModel(None)
    ref_losses = _train(ref, x, y, x.shape[0], None)

    assert ref_losses[-1] < ref_losses[0] / 2, ref_losses
    experts_seen = {}
    for losses, router, experts in results:
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float32),
                                   torch.tensor(ref_losses, dtype=torch.float32), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(router, ref.moe.router_weight.detach(), rtol=1e-5, atol=1e-6)
        experts_seen.update(experts)
    assert sorted(experts_seen) == list(range(EXPERTS))
    for g, state in experts_seen.items():
        for name, value in state.items():
            torch.testing.assert_close(value, ref.moe.experts[g].state_dict()[name], rtol=1e-5, atol=1e-6)


def _codec_case(rank: int, world_size: int, group: dist.ProcessGroup):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(32, HIDDEN, generator=gen).to(torch.bfloat16)
    plain = MoE(HIDDEN, FFN, EXPERTS, TOP_K, group=group, init_seed=1, dtype=torch.bfloat16)
    coded = MoE(HIDDEN, FFN, EXPERTS, TOP_K, buffer=plain.buffer, codec="lossless", init_seed=1,
                dtype=torch.bfloat16)
    with torch.no_grad():
        return plain(x), coded(x)


def test_lossless_codec_is_bit_exact(ranks):
    for plain, coded in ranks(2, _codec_case):
        assert torch.equal(plain.view(torch.int16), coded.view(torch.int16))


def test_apply_experts_matches_a_token_loop():
    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, EXPERTS, TOP_K, init_seed=2)
    x = torch.randn(10, HIDDEN)
    idx, w = route(x, moe.router_weight, TOP_K)
    assert torch.allclose(w.sum(-1), torch.ones(10))
    want = torch.stack([sum(w[n, k] * moe.experts[int(idx[n, k])](x[n:n + 1])[0] for k in range(TOP_K))
                        for n in range(10)])
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-6)
    masked = idx.masked_fill(torch.arange(TOP_K) == 1, -1)
    half = apply_experts(moe.experts, x, masked, w)
    torch.testing.assert_close(half[3], w[3, 0] * moe.experts[int(idx[3, 0])](x[3:4])[0])


def test_moe_is_an_attribute_of_the_package():
    """The README's `ep_comm.moe.MoE` after a plain `import ep_comm` (a fresh interpreter: no other
    test has imported the submodule)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import ep_comm; print(ep_comm.moe.MoE.__name__)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "MoE", done.stderr[-500:]


def _zero_expert_case(rank: int, world_size: int, group: dist.ProcessGroup):
    """Every expert on rank 0; rank 1 owns none. The loss is the layer's output alone (no residual
    that would keep rank 1's graph connected)."""
    buf = ep_comm.Buffer(group, expert_placement=torch.zeros(EXPERTS, dtype=torch.int64), timeout_s=30)
    layer = MoE(HIDDEN, FFN, EXPERTS, TOP_K, buffer=buf, init_seed=1)
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    out = layer(x)
    (out * (rank + 1)).sum().backward()
    return len(layer.experts), x.detach(), out.detach(), x.grad


def test_a_rank_without_experts_takes_part_in_the_backward(ranks):
    """The rank's output still depends on its tokens through dispatch and combine, so its backward
    runs the exchanges rank 0's backward waits for; gradients equal the single-process layer's."""
    results = ranks(2, _zero_expert_case)
    assert [r[0] for r in results] == [EXPERTS, 0]
    x = torch.cat([r[1] for r in results]).requires_grad_()
    ref = MoE(HIDDEN, FFN, EXPERTS, TOP_K, init_seed=1)
    out = ref(x)
    scale = torch.cat([torch.full((8, 1), float(rank + 1)) for rank in range(2)])
    (out * scale).sum().backward()
    torch.testing.assert_close(torch.cat([r[2] for r in results]), out.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r[3] for r in results]), x.grad, rtol=1e-5, atol=1e-6)


def _frozen_router_case(rank: int, world_size: int, group: dist.ProcessGroup, compiled: bool):
    """As _zero_expert_case, with the router frozen and tokens that do not require grad: only rank
    0's experts have gradients, which rank 1's tokens reach through its combine's backward."""
    buf = ep_comm.Buffer(group, expert_placement=torch.zeros(EXPERTS, dtype=torch.int64), timeout_s=60)
    layer = MoE(HIDDEN, FFN, EXPERTS, TOP_K, buffer=buf, init_seed=1)
    layer.router_weight.requires_grad_(False)
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(rank))
    out = (torch.compile(layer, backend="aot_eager") if compiled else layer)(x)
    (out * (rank + 1)).sum().backward()
    return out.detach(), [p.grad for p in layer.expert_parameters()]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_rank_without_experts_follows_the_backward_with_a_frozen_router(ranks, compiled):
    """Rank 1's inputs to dispatch and combine require no grad, rank 0's expert outputs do: rank
    1's output still requires grad and its backward sends its share of rank 0's expert gradients,
    which equal the single-process layer's (eager, and the layer under torch.compile)."""
    results = ranks(2, _frozen_router_case, compiled)
    x = torch.cat([torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(rank)) for rank in range(2)])
    ref = MoE(HIDDEN, FFN, EXPERTS, TOP_K, init_seed=1)
    ref.router_weight.requires_grad_(False)
    out = ref(x)
    scale = torch.cat([torch.full((8, 1), float(rank + 1)) for rank in range(2)])
    (out * scale).sum().backward()
    torch.testing.assert_close(torch.cat([r[0] for r in results]), out.detach(), rtol=1e-5, atol=1e-6)
    assert results[1][1] == []
    for got, want in zip(results[0][1], ref.expert_parameters(), strict=True):
        torch.testing.assert_close(got, want.grad, rtol=1e-5, atol=1e-6)


def _state_dict_case(rank: int, world_size: int, group: dist.ProcessGroup):
    default = MoE(HIDDEN, FFN, EXPERTS, TOP_K, group=group, init_seed=1)
    state = default.state_dict()
    same = MoE(HIDDEN, FFN, EXPERTS, TOP_K, buffer=default.buffer, init_seed=2)
    same.load_state_dict(state)  # strict: every key, expert_ids among them, matches
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        equal = torch.equal(same(x), default(x))
    interleaved = ep_comm.Buffer(group, expert_placement=torch.arange(EXPERTS) % world_size)
    other = MoE(HIDDEN, FFN, EXPERTS, TOP_K, buffer=interleaved, init_seed=2)
    try:
        other.load_state_dict(state)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    return state["expert_ids"].tolist(), equal, refused


def test_state_dict_names_its_experts_and_another_placement_refuses_it(ranks):
    """A rank's state dict holds the global ids of its experts; it loads into a layer with the same
    experts, and a layer under another expert placement (other experts at the same positions)
    refuses it instead of loading the wrong weights."""
    results = ranks(2, _state_dict_case)
    per_rank = EXPERTS // 2
    for rank, (ids, equal, refused) in enumerate(results):
        assert ids == list(range(rank * per_rank, (rank + 1) * per_rank)) and equal
        assert refused is not None and "expert_ids" in refused and "another expert placement" in refused


def test_bad_arguments_are_refused_when_the_layer_is_built_or_called():
    """Arguments the layer cannot run with fail at construction (dtype, codec, the codec's needs),
    and an input of another dtype fails at the call, each naming what is wrong."""
    bad = [({"dtype": torch.int32}, "dtype must be a floating-point"), ({"codec": "zstd"}, "codec must be one of"),
           ({"codec": "fp8", "dtype": torch.bfloat16}, "divisible by 128")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            MoE(HIDDEN, FFN, EXPERTS, TOP_K, **kwargs)
    layer = MoE(HIDDEN, FFN, EXPERTS, TOP_K, init_seed=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x is torch.float32, this layer's experts are torch.bfloat16"):
        layer(torch.randn(3, HIDDEN))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(3, HIDDEN)).shape == (3, HIDDEN)
    # a layer cast after it was built takes inputs of its new dtype
    cast = MoE(HIDDEN, FFN, EXPERTS, TOP_K, init_seed=1).to(torch.bfloat16)
    assert cast(torch.randn(3, HIDDEN).bfloat16()).dtype == torch.bfloat16


def _one_rank_passes_bad_input(rank: int, world_size: int, group: dist.ProcessGroup, bad: str):
    """Rank 0 calls the layer with an input it refuses, rank 1 with a good one; then both make a
    valid call."""
    layer = MoE(HIDDEN, FFN, EXPERTS, TOP_K, buffer=ep_comm.Buffer(group, timeout_s=30), init_seed=1)
    good = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(rank))
    x = good
    if rank == 0:
        x = torch.randn(6, HIDDEN + 1) if bad == "hidden" else good.double()
    start = time.monotonic()
    try:
        layer(x)
        error = None
    except ValueError as e:
        error = str(e)
    waited = time.monotonic() - start
    with torch.no_grad():
        return error, waited, layer(good)


@pytest.mark.parametrize("bad", ["hidden", "dtype"])
def test_a_rank_refusing_its_input_fails_its_peers_without_a_timeout(ranks, bad):
    """The layer's own checks of ``x`` open the call with a failed status, as Buffer's do: the
    peers raise a ValueError naming the rank at once (not a timeout, nor pairing with its next
    call), and the next call is right on every rank."""
    results = ranks(2, _one_rank_passes_bad_input, bad)
    assert (f"x must be [..., {HIDDEN}]" if bad == "hidden" else "x is torch.float64") in results[0][0]
    assert "rank(s) [0] rejected their arguments" in results[1][0], results[1][0]
    assert max(r[1] for r in results) < 10
    ref = MoE(HIDDEN, FFN, EXPERTS, TOP_K, init_seed=1)
    with torch.no_grad():
        want = ref(torch.cat([torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(r)) for r in range(2)]))
    torch.testing.assert_close(torch.cat([r[2] for r in results]), want, rtol=1e-5, atol=1e-6)
