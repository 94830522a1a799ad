"""Autograd: gradcheck of dispatch and combine (float64, 2 ranks), and gradients of a
dispatch -> expert -> combine chain against the same chain computed in one process."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from support.rank_cases import make_routing

import ep_comm
from ep_comm import reference
from ep_comm.placement import ExpertPlacement

FORWARD, BACKWARD, STOP = 1, 2, 3
TOKENS, EXPERTS, TOPK, HIDDEN = 4, 4, 2, 3


def _chain(buf, x, w, idx, expert_scale):
    """dispatch -> a per-local-expert linear map weighted by the routing -> combine."""
    recv_x, recv_idx, recv_w, _, handle, _ = ep_comm.dispatch(buf, x, idx, w, EXPERTS)
    gate = torch.zeros(recv_x.shape[0], dtype=recv_x.dtype)
    for k in range(recv_idx.shape[1]):
        local = recv_idx[:, k]
        gate = gate + recv_w[:, k] * torch.where(local >= 0, expert_scale[local.clamp(min=0)],
                                                 torch.zeros_like(gate))
    y = recv_x * gate[:, None] + recv_x.pow(2) * 0.1
    out, out_w, _ = ep_comm.combine(buf, y, handle, topk_weights=recv_w)
    return out + out_w.sum(1, keepdim=True)


def _gradcheck_lockstep(rank, world, group):
    """Rank 0 runs gradcheck; the others replay each forward/backward it announces, with their
    inputs fixed and zero output gradients, so rank 0's Jacobian is d out_0 / d (x_0, w_0)."""
    torch.manual_seed(100 + rank)
    buf = ep_comm.Buffer(group)
    idx, w = make_routing(rank, 4, TOKENS, EXPERTS, TOPK, 0.0)
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.float64)
    w = w.double()
    expert_scale = torch.linspace(0.5, 1.5, EXPERTS // world, dtype=torch.float64)
    command = torch.zeros(2, dtype=torch.int64)

    def announce(code: int, forward_id: int) -> None:
        command.copy_(torch.tensor([code, forward_id]))
        dist.broadcast(command, src=0, group=group)

    if rank == 0:
        forward_ids = iter(range(1, 10**6))

        def f(x_in, w_in):
            forward_id = next(forward_ids)
            announce(FORWARD, forward_id)
            out = _chain(buf, x_in, w_in, idx, expert_scale)
            if out.requires_grad:
                out.register_hook(lambda g: announce(BACKWARD, forward_id))
            return out

        try:
            return torch.autograd.gradcheck(f, (x.requires_grad_(), w.requires_grad_()), atol=1e-6,
                                            check_undefined_grad=False)
        finally:
            announce(STOP, 0)
    outputs = {}
    while True:
        dist.broadcast(command, src=0, group=group)
        code, forward_id = command.tolist()
        if code == STOP:
            return True
        if code == FORWARD:
            outputs[forward_id] = _chain(buf, x.clone().requires_grad_(), w.clone().requires_grad_(),
                                         idx, expert_scale)
        else:
            out = outputs[forward_id]
            torch.autograd.backward(out, torch.zeros_like(out), retain_graph=True)


def test_gradcheck_dispatch_combine_float64(ranks):
    assert all(ranks(2, _gradcheck_lockstep))


def _grads_vs_single_process(rank, world, group):
    torch.manual_seed(7 + rank)
    buf = ep_comm.Buffer(group)
    idx, w = make_routing(rank, 9, 5 + rank, 8, 3, 0.2)
    x = torch.randn(5 + rank, 16, requires_grad=True)
    upstream = torch.randn(5 + rank, 16)
    recv_x, recv_idx, recv_w, _, handle, _ = ep_comm.dispatch(buf, x, idx, w, 8)
    y = torch.tanh(recv_x) * (rank + 1)
    out, _, _ = ep_comm.combine(buf, y, handle)
    (out * upstream).sum().backward()
    return x.detach(), idx, w, upstream, out.detach(), x.grad


def test_gradients_match_single_process_chain(ranks):
    results = ranks(2, _grads_vs_single_process)
    placement = ExpertPlacement.contiguous(8, 2)
    xs = [r[0].clone().requires_grad_() for r in results]
    received = reference.dispatch(xs, [r[1] for r in results], [r[2] for r in results], placement)
    ys = [torch.tanh(rec.x) * (rank + 1) for rank, rec in enumerate(received)]
    outs = reference.combine(ys, received, [x.shape[0] for x in xs])
    sum((o * r[3]).sum() for o, r in zip(outs, results)).backward()
    for rank, r in enumerate(results):
        torch.testing.assert_close(r[4], outs[rank].detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r[5], xs[rank].grad, rtol=1e-5, atol=1e-6)


def test_custom_ops_are_registered_for_torch_compile():
    for name in ("dispatch", "combine", "scatter"):
        assert hasattr(torch.ops.ep_comm, name)


def _rows_unused(rank, world, group):
    """Rank 1's combine input does not depend on the rows it received (an expert that outputs
    zeros); every rank's x requires grad."""
    buf = ep_comm.Buffer(group, timeout_s=30)
    idx, w = make_routing(rank, 13, 6, 4, 2, 0.0)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    recv_x, _, _, _, handle, _ = ep_comm.dispatch(buf, x, idx, w, 4)
    y = recv_x * 2 if rank == 0 else torch.zeros(recv_x.shape)
    out, _, _ = ep_comm.combine(buf, y, handle)
    out.sum().backward()
    return x.detach(), idx, w, x.grad


def test_a_combine_input_that_ignores_the_received_rows_still_runs_the_dispatch_backward(ranks):
    """The dispatch's handle links the combine to it, so rank 1's backward reaches its dispatch's
    backward (whose calls rank 0's waits for) although its combine input used no received row."""
    results = ranks(2, _rows_unused)
    xs = [r[0].clone().requires_grad_() for r in results]
    received = reference.dispatch(xs, [r[1] for r in results], [r[2] for r in results],
                                  ExpertPlacement.contiguous(4, 2))
    ys = [received[0].x * 2, torch.zeros(received[1].x.shape)]
    sum(o.sum() for o in reference.combine(ys, received, [6, 6])).backward()
    for rank, r in enumerate(results):
        torch.testing.assert_close(r[3], xs[rank].grad)


def _compiled_chain(rank, world, group, follows, backend):
    """dispatch -> combine compiled whole (fullgraph=True) and eager; with ``follows``, rank 1's
    inputs require no grad, and its compiled output still joins rank 0's backward. Then rank 1
    calls the compiled chain under no_grad: the vote traced into its graph (grad mode off) meets
    rank 0's in the call header."""
    buf = ep_comm.Buffer(group, timeout_s=30)
    idx, w = make_routing(rank, 17, 5, 4, 2, 0.0)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    grads = not (follows and rank == 1)
    x.requires_grad_(grads)

    def chain(x_in, w_in):
        recv_x, _, recv_w, _, handle, _ = ep_comm.dispatch(buf, x_in, idx, w_in, 4)
        out, _, _ = ep_comm.combine(buf, recv_x * recv_w.sum(1, keepdim=True), handle)
        return out

    def run(fn):
        out = fn(x, w)
        assert out.requires_grad  # on rank 1 too, with follows: it joins rank 0's backward
        out.sum().backward()
        grad, x.grad = x.grad, None
        return out.detach(), grad

    eager = run(chain)
    no_cache = torch._inductor.config.patch(force_disable_caches=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True), no_cache:
        compiled_chain = torch.compile(chain, backend=backend, fullgraph=True)
        compiled = run(compiled_chain)
        error = None
        try:
            with torch.no_grad() if rank == 1 else contextlib.nullcontext():
                compiled_chain(x, w)
        except ValueError as e:
            error = str(e)
    same = torch.equal(eager[0], compiled[0]) and (torch.equal(eager[1], compiled[1]) if grads
                                                   else eager[1] is None and compiled[1] is None)
    return same, error


@pytest.mark.parametrize("follows,backend", [(False, "aot_eager"), (True, "aot_eager"), (True, "inductor")])
def test_torch_compile_traces_the_ops_whole(ranks, follows, backend):
    """The custom ops' fake implementations let dynamo/AOTAutograd trace dispatch and combine in
    one graph (fullgraph=True, with capture_scalar_outputs for the counts list), with the same
    outputs and gradients as eager, and the call header still carries each rank's vote. Inductor
    keeps every backward collective of a rank that needs none of their results (rank 1 with
    ``follows``), which its peer waits for."""
    for same, error in ranks(2, _compiled_chain, follows, backend):
        assert same
        assert error is not None and "disagree on backward" in error, error


def _compiled_worst_tokens(rank, world, group):
    """dispatch with num_worst_tokens (padded rows) -> combine, compiled whole and eager."""
    buf = ep_comm.Buffer(group, timeout_s=30)
    idx, w = make_routing(rank, 17, 5, 4, 2, 0.0)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)

    def chain(x_in):
        recv_x, recv_idx, _, counts, handle, _ = ep_comm.dispatch(buf, x_in, idx, w, 4, num_worst_tokens=16)
        out, _, _ = ep_comm.combine(buf, recv_x * 2, handle)
        return out, recv_x.shape[0], (recv_idx[:, 0] >= 0).sum(), counts

    results = []
    for fn in (chain, torch.compile(chain, backend="aot_eager", fullgraph=True)):
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            out, rows, real, counts = fn(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
        results.append((out.detach(), int(rows), int(real), counts, grad))
    return results


def test_torch_compile_traces_num_worst_tokens(ranks):
    """num_worst_tokens pads the received rows to a fixed count: under torch.compile the check that
    the rows fit is made when the graph runs, and the results equal eager's."""
    for eager, compiled in ranks(2, _compiled_worst_tokens):
        assert eager[1] == compiled[1] == 16 and eager[2] == compiled[2] and eager[3] == compiled[3] == []
        assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[4], compiled[4])


def _one_rank_rejects(rank, world, group, case, codec):
    """Rank 1 passes an argument the wrappers' own checks reject (before the Buffer's call); then
    every rank makes the next, valid dispatch and combine."""
    buf = ep_comm.Buffer(group, timeout_s=30)
    idx, w = make_routing(rank, 9, 6, EXPERTS, TOPK, 0.0)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank)).bfloat16()
    error = None
    try:
        if case == "dispatch":
            ep_comm.dispatch(buf, x, idx.int() if rank == 1 else idx, w, EXPERTS, codec=codec)
        else:
            recv_x, _, _, _, handle, _ = ep_comm.dispatch(buf, x, idx, w, EXPERTS, codec=codec)
            ep_comm.combine(buf, recv_x[:-1] if rank == 1 else recv_x, handle, codec=codec)
    except ValueError as e:
        error = str(e)
    recv_x, _, _, _, handle, _ = ep_comm.dispatch(buf, x + 100 * (rank + 1), idx, w, EXPERTS, codec=codec)
    out, _, _ = ep_comm.combine(buf, recv_x, handle, codec=codec)
    return error, x + 100 * (rank + 1), idx, w, out


@pytest.mark.parametrize("case,codec", [("dispatch", None), ("dispatch", "auto"), ("combine", None),
                                        ("combine", "lossless")])
def test_a_rank_rejecting_its_arguments_fails_every_rank_and_the_next_call_is_right(ranks, case, codec):
    """ep_comm.dispatch / ep_comm.combine check their arguments before the Buffer's call: a rank
    that rejects its own fails the call on every rank (its peers naming it), as Buffer.dispatch
    does, instead of skipping it (the peers' call would pair with that rank's next one and take its
    rows). The next call on every rank then gets the right rows."""
    results = ranks(2, _one_rank_rejects, case, codec)
    assert "topk_idx" in results[1][0] if case == "dispatch" else "x must be" in results[1][0]
    assert "rank(s) [1] rejected their arguments" in results[0][0]
    placement = ExpertPlacement.contiguous(EXPERTS, 2)
    received = reference.dispatch([r[1] for r in results], [r[2] for r in results], [r[3] for r in results],
                                  placement)
    outs = reference.combine([rec.x for rec in received], received, [r[1].shape[0] for r in results])
    for rank, r in enumerate(results):
        assert torch.equal(r[4], outs[rank]), rank


def _grad_mode_differs(rank, world, group):
    """Rank 0's inputs require grad; rank 1 calls under no_grad."""
    buf = ep_comm.Buffer(group, timeout_s=30)
    idx, w = make_routing(rank, 9, 6, EXPERTS, TOPK, 0.0)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    error = None
    try:
        with torch.no_grad() if rank == 1 else contextlib.nullcontext():
            ep_comm.dispatch(buf, x, idx, w, EXPERTS)
    except ValueError as e:
        error = str(e)
    x = x.detach().requires_grad_()
    recv_x, _, _, _, handle, _ = ep_comm.dispatch(buf, x, idx, w, EXPERTS)
    out, _, _ = ep_comm.combine(buf, recv_x * 2, handle)
    out.sum().backward()
    return error, x.grad


def test_ranks_that_disagree_on_grad_mode_fail_alike(ranks):
    """A differentiable dispatch whose inputs require grad on one rank while another calls under
    no_grad (the second could never run the backward's calls, which the first would wait for until
    its timeout): the same ValueError on both, naming each rank's vote, before any payload moves;
    the next forward and backward work."""
    results = ranks(2, _grad_mode_differs)
    for error, grad in results:
        assert error is not None and "disagree on backward" in error, error
        assert "rank 0: inputs require grad, rank 1: grad mode off" in error, error
        assert grad is not None and torch.isfinite(grad).all()


def _some_ranks_require_grad(rank, world, group, requiring, inference):
    """The chain of _grads_vs_single_process, with inputs (x and the routing weights) that require
    grad on the ranks in ``requiring`` only (with ``inference``, the others' are inference tensors);
    every rank runs its backward when its output requires grad."""
    buf = ep_comm.Buffer(group, timeout_s=30)
    idx, w = make_routing(rank, 11, 5 + rank, 8, 3, 0.2)
    g = torch.Generator().manual_seed(3 + rank)
    x = torch.randn(5 + rank, 16, generator=g).requires_grad_(rank in requiring)
    w = w.requires_grad_(rank in requiring)
    if inference and rank not in requiring:
        with torch.inference_mode():
            x, w = x.clone(), w.clone()
    upstream = torch.randn(5 + rank, 16, generator=g)
    recv_x, recv_idx, recv_w, _, handle, _ = ep_comm.dispatch(buf, x, idx, w, 8)
    forward_grads = (recv_x.requires_grad, recv_w.requires_grad)
    y = torch.tanh(recv_x) * (rank + 1)
    out, out_w, _ = ep_comm.combine(buf, y, handle, topk_weights=recv_w)
    out = out + out_w.sum(1, keepdim=True)
    if out.requires_grad:
        (out * upstream).sum().backward()
    return (x.detach(), idx, w.detach(), upstream, out.detach(), x.grad, w.grad, forward_grads, out.requires_grad)


@pytest.mark.parametrize("world,requiring,inference", [(2, (0,), False), (2, (1,), False), (4, (2,), False),
                                                       (4, (0, 3), False), (2, (), False), (2, (0,), True),
                                                       (2, (), True)])
def test_ranks_whose_inputs_need_no_grad_follow_their_peers_backward(ranks, world, requiring, inference):
    """The outputs depend on every rank's inputs, so where any rank's inputs require grad every
    rank's outputs do, and each rank's backward runs the calls its peers' backward waits for: the
    gradients of the ranks that asked equal the single-process chain's. Where none does, no output
    requires grad (no graph is kept). Inference tensors as the inputs that need no grad alike."""
    results = ranks(world, _some_ranks_require_grad, requiring, inference)
    placement = ExpertPlacement.contiguous(8, world)
    xs = [r[0].clone().requires_grad_(rank in requiring) for rank, r in enumerate(results)]
    ws = [r[2].clone().requires_grad_(rank in requiring) for rank, r in enumerate(results)]
    received = reference.dispatch(xs, [r[1] for r in results], ws, placement)
    ys = [torch.tanh(rec.x) * (rank + 1) for rank, rec in enumerate(received)]
    counts = [x.shape[0] for x in xs]
    outs = [o + o_w.sum(1, keepdim=True) for o, o_w in zip(
        reference.combine(ys, received, counts), reference.combine([rec.topk_weights for rec in received],
                                                                   received, counts))]
    for rank, r in enumerate(results):
        assert r[7] == (bool(requiring), bool(requiring)) and r[8] == bool(requiring), rank
        torch.testing.assert_close(r[4], outs[rank].detach(), rtol=1e-6, atol=1e-6)
    if not requiring:
        return
    sum((o * r[3]).sum() for o, r in zip(outs, results)).backward()
    for rank, r in enumerate(results):
        if rank in requiring:
            torch.testing.assert_close(r[5], xs[rank].grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r[6], ws[rank].grad, rtol=1e-5, atol=1e-6)
        else:
            assert r[5] is None and r[6] is None, rank
