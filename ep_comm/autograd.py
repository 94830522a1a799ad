"""Differentiable dispatch and combine, registered as torch.library custom ops.

The ops take tensors and plain scalars only (so ``torch.compile`` treats them as opaque calls);
a Buffer is passed by its id, looked up in a registry of live Buffers. Gradients:

* dispatch: ``recv_x = S x`` where ``S`` copies each token to the ranks it goes to, so
  ``grad_x = S^T grad_recv_x``, a combine (sum over ranks) of the gradients; likewise for
  ``topk_weights`` (entries of non-local experts were zeroed, so their gradient is masked).
* combine: ``out = S^T x`` so ``grad_x = S grad_out``, a cached dispatch.
"""
from __future__ import annotations

import torch

from .agreement import BackwardVote
from .buffer import Buffer
from .handle import DispatchHandle, DispatchState, OwnDispatchHandle
from .plan import SendPlan
from .validation import PAYLOAD_DTYPES, check_codec, check_nonneg_int, check_num_experts, require_tensor


def _buffer(buffer_id: int) -> Buffer:
    return Buffer._live(int(buffer_id))  # (a SymInt where torch.compile made the id dynamic: int() pins it)


def _handle(buffer: Buffer, token_index: torch.Tensor, send_counts: torch.Tensor,
            recv_counts: torch.Tensor, num_tokens: int, hidden: int) -> DispatchHandle:
    num_recv = int(recv_counts.sum())
    return OwnDispatchHandle((), DispatchState(
        buffer_id=buffer.buffer_id, send_plan=SendPlan(token_index, send_counts),
        recv_counts=recv_counts.cpu(), is_token_in_rank=torch.empty(0, 0, dtype=torch.bool),
        num_tokens=num_tokens, num_recv_tokens=num_recv, num_worst_tokens=0, hidden=hidden,
        num_experts=0, recv_src_token_index=torch.empty(0, dtype=torch.int64),
        mask_epoch=buffer.mask_epoch))


# -- ep_comm::dispatch --------------------------------------------------------------------------
@torch.library.custom_op("ep_comm::dispatch", mutates_args=())
def _dispatch_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, buffer_id: int,
                 num_experts: int, codec: str, vote: int, anchor: torch.Tensor) -> tuple[
                     torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                     torch.Tensor, torch.Tensor]:
    buffer = _buffer(buffer_id)
    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    with buffer._backward_call(BackwardVote(vote)):
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_expert=num_tokens_per_expert,
            codec=codec)
    if isinstance(recv_x, tuple):  # codec="fp8": dequantize; the gradient passes straight through
        from .codecs import fp8

        recv_x = fp8.dequantize(*recv_x, dtype=x.dtype)
    counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=buffer._num_local_experts(num_experts))
    return (recv_x, recv_idx, recv_w.to(topk_weights.dtype), handle.send_plan.token_index.clone(),
            handle.send_plan.send_counts.clone(), handle.recv_counts.clone(), counts,
            torch.zeros(1, dtype=torch.float32))


@_dispatch_op.register_fake
def _(x, topk_idx, topk_weights, buffer_id, num_experts, codec, vote, anchor):
    ctx = torch.library.get_ctx()
    rows, sent = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    buffer = _buffer(buffer_id)
    num_ranks = buffer.group_size
    local = buffer._num_local_experts(num_experts)  # the counts' length
    k = topk_idx.shape[1]
    return (x.new_empty(rows, x.shape[1]), topk_idx.new_empty(rows, k), topk_weights.new_empty(rows, k),
            topk_idx.new_empty(sent), topk_idx.new_empty(num_ranks),
            torch.empty(num_ranks, dtype=torch.int64, device="cpu"), topk_idx.new_empty(local),
            torch.empty(1, dtype=torch.float32))


def _dispatch_setup(ctx, inputs, output):
    x, _, w, buffer_id, _, codec, _, _ = inputs
    recv_x, recv_idx, _, token_index, send_counts, recv_counts, _, _ = output
    ctx.save_for_backward(recv_idx, token_index, send_counts, recv_counts)
    ctx.buffer_id, ctx.codec, ctx.num_tokens = buffer_id, codec, x.shape[0]
    ctx.recv_x_like, ctx.w_dtype = recv_x.new_empty(0, recv_x.shape[1]), w.dtype


def _dispatch_backward(ctx, grad_x, grad_idx, grad_w, *unused):
    recv_idx, token_index, send_counts, recv_counts = ctx.saved_tensors
    if grad_x is None:  # the backward came through the link alone (the expert output used no row)
        grad_x = ctx.recv_x_like.new_zeros(recv_idx.shape[0], ctx.recv_x_like.shape[1])
    if grad_w is None:
        grad_w = torch.zeros(recv_idx.shape, dtype=ctx.w_dtype, device=recv_idx.device)
    grad_w = grad_w * (recv_idx >= 0).to(grad_w.dtype)
    gx, gw = _combine_op(grad_x.contiguous(), grad_w.contiguous(), token_index, send_counts,
                         recv_counts, ctx.num_tokens, ctx.buffer_id,
                         "none" if ctx.codec == "fp8" else ctx.codec, int(BackwardVote.OFF), grad_x.new_empty(0),
                         torch.zeros(1, dtype=torch.float32))
    return gx, None, gw, None, None, None, None, _anchor_grad([gx, gw])


torch.library.register_autograd("ep_comm::dispatch", _dispatch_backward, setup_context=_dispatch_setup)


# -- ep_comm::combine ---------------------------------------------------------------------------
@torch.library.custom_op("ep_comm::combine", mutates_args=())
def _combine_op(x: torch.Tensor, topk_weights: torch.Tensor, token_index: torch.Tensor,
                send_counts: torch.Tensor, recv_counts: torch.Tensor, num_tokens: int, buffer_id: int,
                codec: str, vote: int, anchor: torch.Tensor, link: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = _buffer(buffer_id)
    handle = _handle(buffer, token_index, send_counts, recv_counts, num_tokens, x.shape[1])
    weights = topk_weights if topk_weights.shape[1] > 0 else None
    with buffer._backward_call(BackwardVote(vote)):
        combined, combined_w, _ = buffer.combine(x, handle, topk_weights=weights, codec=codec)
    if combined_w is None:
        combined_w = topk_weights.new_empty(num_tokens, topk_weights.shape[1])
    return combined, combined_w.to(topk_weights.dtype)


@_combine_op.register_fake
def _(x, topk_weights, token_index, send_counts, recv_counts, num_tokens, buffer_id, codec, vote, anchor, link):
    return x.new_empty(num_tokens, x.shape[1]), topk_weights.new_empty(num_tokens, topk_weights.shape[1])


def _combine_setup(ctx, inputs, output):
    x, _, token_index, send_counts, recv_counts, _, buffer_id, codec, _, _, _ = inputs
    ctx.save_for_backward(token_index, send_counts, recv_counts)
    ctx.buffer_id, ctx.codec, ctx.num_tokens = buffer_id, codec, x.shape[0]


def _combine_backward(ctx, grad_out, grad_w):
    token_index, send_counts, recv_counts = ctx.saved_tensors
    gx = _scatter_op(grad_out.contiguous(), token_index, send_counts, recv_counts, ctx.buffer_id, ctx.codec)
    if grad_w.shape[1] == 0:  # combine was called without weights
        gw = grad_w.new_zeros(gx.shape[0], 0)
    else:
        gw = _scatter_op(grad_w.contiguous(), token_index, send_counts, recv_counts, ctx.buffer_id, "none")
    kept = _anchor_grad([gx, gw])
    return gx, gw, None, None, None, None, None, None, None, kept, kept


torch.library.register_autograd("ep_comm::combine", _combine_backward, setup_context=_combine_setup)


# -- ep_comm::scatter (cached dispatch) ---------------------------------------------------------
@torch.library.custom_op("ep_comm::scatter", mutates_args=())
def _scatter_op(x: torch.Tensor, token_index: torch.Tensor, send_counts: torch.Tensor,
                recv_counts: torch.Tensor, buffer_id: int, codec: str) -> torch.Tensor:
    buffer = _buffer(buffer_id)
    handle = _handle(buffer, token_index, send_counts, recv_counts, x.shape[0], x.shape[1])
    if x.dtype != torch.bfloat16 and codec == "lossless":
        codec = "none"
    recv_x, *_ = buffer.dispatch(x, handle=handle, codec=codec)
    return recv_x


@_scatter_op.register_fake
def _(x, token_index, send_counts, recv_counts, buffer_id, codec):
    return x.new_empty(torch.library.get_ctx().new_dynamic_size(), x.shape[1])


def _scatter_setup(ctx, inputs, output):
    x, token_index, send_counts, recv_counts, buffer_id, codec = inputs
    ctx.save_for_backward(token_index, send_counts, recv_counts)
    ctx.buffer_id, ctx.codec, ctx.num_tokens = buffer_id, codec, x.shape[0]


def _scatter_backward(ctx, grad):
    token_index, send_counts, recv_counts = ctx.saved_tensors
    empty = grad.new_empty(grad.shape[0], 0)
    gx, _ = _combine_op(grad.contiguous(), empty, token_index, send_counts, recv_counts,
                        ctx.num_tokens, ctx.buffer_id, ctx.codec, int(BackwardVote.OFF), grad.new_empty(0),
                        torch.zeros(1, dtype=torch.float32))
    return gx, None, None, None, None, None


torch.library.register_autograd("ep_comm::scatter", _scatter_backward, setup_context=_scatter_setup)


# -- public functions ---------------------------------------------------------------------------
def _vote(*inputs: torch.Tensor) -> BackwardVote:
    """This rank's backward vote for a call on ``inputs``."""
    if not torch.is_grad_enabled():
        return BackwardVote.OFF
    return BackwardVote.REQUIRES if any(t.requires_grad for t in inputs) else BackwardVote.FOLLOWS


def _anchor(buffer: Buffer, vote: BackwardVote, like: torch.Tensor) -> torch.Tensor:
    """The op's ``anchor`` input, which it ignores: in grad mode the Buffer's ``[1]`` leaf that
    requires grad, so that autograd records the op also where no other input requires grad (for a
    ``FOLLOWS`` vote: its outputs require grad and its backward runs where a peer's inputs require
    grad; the wrapper detaches them again when none does); else an empty tensor without grad (only
    the op's schema needs one)."""
    return like.new_empty(0) if vote == BackwardVote.OFF else buffer._grad_anchor


# -- ep_comm::anchor_grad -----------------------------------------------------------------------
@torch.library.custom_op("ep_comm::anchor_grad", mutates_args=())
def _anchor_grad(grads: list[torch.Tensor]) -> torch.Tensor:
    """The anchor's gradient (``[1]`` float32 zeros on the CPU) from every gradient a backward
    computed: an opaque op that uses each, so ``torch.compile`` never drops one of the backward's
    collective calls as dead code on a rank that needs none of its results (its peers make the
    call and wait for this rank). (Inductor replaces any empty result by an allocation, and would
    fold a gradient computed from the values.)"""
    return torch.zeros(1, dtype=torch.float32)


@_anchor_grad.register_fake
def _(grads):
    return torch.empty(1, dtype=torch.float32)


def _detach(buffer: Buffer, vote: BackwardVote) -> bool:
    """Whether a ``FOLLOWS`` call's outputs leave the graph: no rank's inputs required grad (the
    call just made says so). Under ``torch.compile`` the outputs stay in the graph (what the
    call's opening exchange found is not known when the graph is traced): a rank that then never
    runs the backward keeps the graph of these outputs alive until they are freed."""
    if vote != BackwardVote.FOLLOWS or torch.compiler.is_compiling():
        return False
    last = buffer._last_backward
    return last is not None and not last.runs


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int, expert_alignment: int = 1, num_worst_tokens: int = 0, *,
             codec: str | None = None):
    """Differentiable ``Buffer.dispatch`` (gradients flow to ``x`` and ``topk_weights``).

    The backward runs on every rank or on none: where any rank's ``x`` or ``topk_weights``
    require grad (in grad mode), every rank's outputs do, also where this rank's inputs do not
    (its backward then makes the calls its peers' backward waits for, and drops its gradients);
    where none does, the outputs are detached (in eager mode; under ``torch.compile`` they stay
    in the graph). On the portable transport a rank under ``torch.no_grad`` while another's
    inputs require grad is refused on every rank (``ValueError``); on the NVSHMEM transport,
    which exchanges no header, each rank goes by its own inputs.

    With ``codec="fp8"`` the payload travels as e4m3 + scales and is dequantized to ``x``'s dtype
    on arrival; the backward treats the quantization as identity (straight-through) and returns
    the gradients uncompressed.

    Args:
        buffer: the ``Buffer``. x: ``[N, H]`` float tensor. topk_idx: ``[N, K]`` int64.
        topk_weights: ``[N, K]`` float32/float64. num_experts: ``E``.
    Returns:
        the same ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)`` as ``Buffer.dispatch``.
    """
    if not isinstance(buffer, Buffer):
        raise ValueError(f"buffer must be an ep_comm.Buffer, got {type(buffer).__name__}")
    try:
        if not isinstance(x, torch.Tensor):
            raise ValueError("x must be a tensor (FP8 tuples are not differentiable)")
        if not isinstance(topk_weights, torch.Tensor):
            raise ValueError("topk_weights must be a [N, K] float tensor")
        require_tensor("x", x, dtypes=PAYLOAD_DTYPES, dim=2)
        require_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), dim=2)
        check_num_experts(num_experts, buffer.group_size, buffer._placement is not None)
        check_nonneg_int("expert_alignment", expert_alignment, positive=True)
        check_nonneg_int("num_worst_tokens", num_worst_tokens)
        check_codec(codec, ("none", "fp8", "lossless", "auto"))
    except ValueError as error:
        buffer._refuse("dispatch", error)
    codec_name = "none" if codec is None else codec  # "auto": voted inside the Buffer's call, after it opened
    # the backward runs on every rank or on none (a rank without it would skip its peers' calls)
    vote = _vote(x, topk_weights)
    recv_x, recv_idx, recv_w, token_index, send_counts, recv_counts, counts, link = _dispatch_op(
        x, topk_idx, topk_weights, buffer.buffer_id, num_experts, codec_name, int(vote), _anchor(buffer, vote, x))
    if _detach(buffer, vote):
        recv_x, recv_w, link = recv_x.detach(), recv_w.detach(), link.detach()
    from .layout import align_up

    num_recv = recv_x.shape[0]  # == recv_counts.sum(), a size torch.compile traces without reading it
    handle = OwnDispatchHandle((), DispatchState(
        buffer_id=buffer.buffer_id, send_plan=SendPlan(token_index, send_counts),
        recv_counts=recv_counts, is_token_in_rank=torch.empty(0, 0, dtype=torch.bool),
        num_tokens=x.shape[0], num_recv_tokens=num_recv, num_worst_tokens=0,
        hidden=x.shape[1], num_experts=num_experts,
        recv_src_token_index=torch.empty(0, dtype=torch.int64), mask_epoch=buffer.mask_epoch, grad_link=link))
    counts_list = align_up(counts.tolist(), expert_alignment)
    if num_worst_tokens > 0:
        rows = handle.num_recv_tokens
        if torch.compiler.is_compiling():  # rows is a size known when the graph runs: a check there
            torch._check(rows <= num_worst_tokens, lambda: f"num_worst_tokens ({num_worst_tokens}) is smaller "
                         f"than the tokens this rank received")
        else:
            buffer._check_num_worst_tokens(rows, num_worst_tokens)
        pad = num_worst_tokens - rows
        recv_x = torch.nn.functional.pad(recv_x, (0, 0, 0, pad))
        recv_w = torch.nn.functional.pad(recv_w, (0, 0, 0, pad))
        recv_idx = torch.nn.functional.pad(recv_idx, (0, 0, 0, pad), value=-1)
        handle = handle.with_state(num_worst_tokens=num_worst_tokens)
        counts_list = []
    from .event import EventOverlap

    return recv_x, recv_idx, recv_w, counts_list, handle, EventOverlap(None)


def combine(buffer: Buffer, x: torch.Tensor, handle: DispatchHandle,
            topk_weights: torch.Tensor | None = None, *, codec: str | None = None):
    """Differentiable ``Buffer.combine`` (gradients flow to ``x`` and ``topk_weights``); its
    backward runs on every rank or on none, as :func:`dispatch`'s.

    Args:
        x: ``[M, H]`` rows in the received order (or ``[num_worst_tokens, H]``).
        handle: the dispatch's handle. topk_weights: ``[M, K]`` float or None.
    Returns:
        ``(combined_x [N, H], combined_topk_weights [N, K]`` or None, ``event)``.
    """
    if not isinstance(buffer, Buffer):
        raise ValueError(f"buffer must be an ep_comm.Buffer, got {type(buffer).__name__}")
    try:
        buffer._check_handle(handle, "handle")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] != handle.num_recv_rows:
            raise ValueError(f"x must be [{handle.num_recv_rows}, H] to match the handle")
        if topk_weights is not None:
            require_tensor("topk_weights", topk_weights, dtypes=(torch.float32, torch.float64), dim=2)
            if topk_weights.shape[0] != x.shape[0]:
                raise ValueError(f"topk_weights has {topk_weights.shape[0]} rows, x has {x.shape[0]}")
        check_codec(codec, ("none", "lossless", "auto"))
    except ValueError as error:
        buffer._refuse("combine", error)
    rows = handle.num_recv_tokens
    codec_name = "none" if codec is None else codec  # "auto": voted inside the Buffer's call, after it opened
    weights = (topk_weights[:rows] if topk_weights is not None
               else x.new_empty(rows, 0, dtype=torch.float32))
    # a handle of ep_comm.dispatch links this call to it (see DispatchState.grad_link)
    link = handle.grad_link if handle.grad_link is not None else torch.zeros(1, dtype=torch.float32)
    vote = _vote(x, weights, link)
    combined, combined_w = _combine_op(x[:rows].contiguous(), weights.contiguous(), handle.send_plan.token_index,
                                       handle.send_plan.send_counts, handle.recv_counts, handle.num_tokens,
                                       buffer.buffer_id, codec_name, int(vote), _anchor(buffer, vote, x), link)
    if _detach(buffer, vote):
        combined, combined_w = combined.detach(), combined_w.detach()
    from .event import EventOverlap

    return combined, (combined_w if topk_weights is not None else None), EventOverlap(None)
