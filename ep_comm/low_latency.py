"""Low-latency mode: fixed-capacity dispatch into per-expert slots, and weighted combine.

Wire format of dispatch: every rank sends every rank one block of
``T = num_max_dispatch_tokens_per_rank`` row slots plus one header row whose first 8 bytes hold
the row count (a whole row, so the ``R * (T + 1)`` rows of a message are evenly spaced and can be
gathered with one flat index), so the exchange has fixed, equal sizes and needs no count
exchange first. A row is one token (sent once per rank, not
once per expert): its payload (bf16, or e4m3 plus scales when ``use_fp8``) and its top-k ids
renumbered to the destination's local experts. The receiver copies each row into the slot of
every local expert it selected; an expert's slots are grouped by source rank, ascending token
order within a rank.

With many ranks the fixed blocks mostly carry empty slots: a token reaches at most ``K`` of the
``R`` ranks, so a rank sends at most ``K * T`` real rows in ``R * (T + 1)`` slots (at EP 256 and
top-8, 3 % of the bytes). The *needed-rows* transfer sends only the real rows: the row counts go
first (one small exchange), then an all-to-all of ``counts[r]`` rows to each rank ``r``, with no
header rows. Both transfers deliver the same rows to the same slots. They differ in what a CUDA
graph can capture: the fixed transfer's messages have sizes fixed by ``(R, T, H)``, static shapes
that a graph can replay; the needed-rows transfer must bring the counts to the host to size its
exchange, which a graph cannot capture. :func:`choose_transfer` takes the needed rows when they
pay (``R > 2 K``: the fixed blocks would carry more than twice the largest possible real rows);
the choice depends only on values every rank agreed on in the call's header, so every rank makes
the same one.

Combine: each expert owner returns one row per (token, local expert) pair, in the order the pairs
were received; the source multiplies by the top-k weights and sums over k in float32. Its message
sizes follow from the routing both sides know (the needed rows, with no count exchange).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import row_kernels
from .codecs import fp8
from .handle import LowLatencyReceiveState
from .layout import token_rank_mask
from .payload import FieldSpec, RowFormat
from .placement import ExpertPlacement
from .plan import build_expert_slot_plan, build_send_plan, combine_pair_order
from .rows import ScratchPool, copy_rows, weighted_sum_by_token
from .stats import CommStats
from .transports.base import PendingExchange, Transport

COMBINE_BLOCK_ROWS = 128
"""Rows reduced per step in the low-latency combine's torch path (bounds its float32 temporaries)."""

TRANSFERS = ("auto", "fixed", "needed")
"""How a low-latency dispatch sends its rows (see the module docstring)."""


def choose_transfer(transfer: str, num_ranks: int, topk: int) -> str:
    """``"fixed"`` or ``"needed"`` for ``transfer`` (one of :data:`TRANSFERS`): ``"auto"`` takes
    the needed rows when ``num_ranks > 2 * topk``, the fixed blocks otherwise (where they carry at
    most about twice the real rows and save the count exchange and its host round trip). The
    result depends only on agreed values, so every rank of a call chooses alike."""
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
    if transfer != "auto":
        return transfer
    return "needed" if num_ranks > 2 * topk else "fixed"


@dataclass
class LowLatencyDispatchOutput:
    """Outputs of ``low_latency_dispatch``; the tensors are filled by ``receive()``.

    Attributes:
        recv_x: ``[L, R*T, H]`` bf16, or ``(e4m3 [L, R*T, H], scales [L, R*T, H//128]`` float32
            or packed UE8M0 ``[L, R*T, H//512]`` int32).
        recv_count: ``[L]`` int32.
        state: routing facts the combine needs.
        receive: completes the exchange and fills the tensors (idempotent).
        stats: bytes moved.
        recv_src_info: ``[L, R*T]`` int32, each filled slot's token index on its source rank, and
        layout_range: ``[L, R]`` int64, ``first slot << 32 | count`` per local expert and source
            rank: DeepEP's low-latency handle entries (filled by ``receive()``).
        kernel: engine state when the fused kernels ran it (``ep_comm.paths.fused``), else None.
    """

    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    recv_count: torch.Tensor
    state: LowLatencyReceiveState
    receive: Callable[[], None]
    stats: CommStats
    recv_src_info: torch.Tensor
    layout_range: torch.Tensor
    kernel: object | None = None


def _row_format(hidden: int, topk: int, use_fp8: bool, use_ue8m0: bool) -> RowFormat:
    """Top-k ids first, then scales, then the payload, then padding to 8 bytes, so every field
    of every row starts aligned for its dtype whatever the hidden size."""
    fields = [FieldSpec("topk", torch.int32, topk), FieldSpec("src", torch.int32, 1)]
    if not use_fp8:
        fields.append(FieldSpec("x", torch.bfloat16, hidden))
    else:
        groups = hidden // 512 if use_ue8m0 else hidden // 128
        fields += [FieldSpec("scales", torch.int32 if use_ue8m0 else torch.float32, groups),
                   FieldSpec("x", torch.uint8, hidden)]
    used = sum(f.nbytes for f in fields)
    if used % 8:
        fields.append(FieldSpec("pad", torch.uint8, 8 - used % 8))
    return RowFormat(tuple(fields))


def receive_area_spec(num_local: int, slots_per_expert: int, hidden: int, use_fp8: bool,
                      use_ue8m0: bool) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """Shapes and dtypes of the receive tensors: ``recv_x`` (and its scales with FP8; see
    :func:`empty_receive_area` for their strides)."""
    if not use_fp8:
        return (((num_local, slots_per_expert, hidden), torch.bfloat16),)
    groups = hidden // 512 if use_ue8m0 else hidden // 128
    return (((num_local, slots_per_expert, hidden), torch.float8_e4m3fn),
            ((num_local, slots_per_expert, groups), torch.int32 if use_ue8m0 else torch.float32))


def empty_receive_area(spec: tuple[tuple[tuple[int, ...], torch.dtype], ...],
                       device: torch.device) -> tuple[torch.Tensor, ...]:
    """Fresh receive tensors of :func:`receive_area_spec`. ``recv_x`` is contiguous; the FP8
    scales ``[L, R*T, G]`` are column-major in their last two dimensions (strides
    ``(G * R*T, 1, R*T)``: storage ``[L, G, R*T]`` transposed), as DeepEP returns them so that
    DeepGEMM's TMA loads read one scale group of consecutive tokens at once. With one group the
    two layouts are the same memory, and the plain strides are kept (a last dimension of one
    element with a stride other than 1 defeats ``.contiguous()`` before a dtype view)."""
    out = [torch.empty(spec[0][0], dtype=spec[0][1], device=device)]
    for shape, dtype in spec[1:]:
        num_local, slots, groups = shape
        if groups == 1:
            out.append(torch.empty(shape, dtype=dtype, device=device))
        else:
            out.append(torch.empty(num_local, groups, slots, dtype=dtype, device=device).transpose(1, 2))
    return tuple(out)


def dispatch(transport: Transport, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int,
             placement: ExpertPlacement, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
             receive_area: tuple[torch.Tensor, ...] | None = None,
             scratch: ScratchPool | None = None, transfer: str = "auto") -> LowLatencyDispatchOutput:
    """Sends this rank's tokens (``x [N, H]`` bf16, ``topk_idx [N, K]`` int64, ``N <= T``) and
    returns outputs whose ``receive()`` completes the exchange.

    ``receive_area``: tensors of :func:`receive_area_spec` to receive into (reused across calls by
    the Buffer, so their pages stay resident); fresh ones when None. ``scratch``: the Buffer's
    pool for the message bytes sent and received (given back once ``receive()`` has read them).
    ``transfer``: ``"fixed"`` blocks of ``T + 1`` slots per rank (static sizes: what a CUDA graph
    can capture), ``"needed"`` rows only after a count exchange (not capturable: the counts go
    through the host), or ``"auto"`` (:func:`choose_transfer`); the same on every rank.
    """
    scratch = scratch or ScratchPool(keep=0)
    rank, num_ranks = transport.rank, transport.num_ranks
    num_tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    num_local = int(placement.num_local_experts[rank])
    fmt = _row_format(hidden, topk, use_fp8, use_ue8m0)
    needed = choose_transfer(transfer, num_ranks, topk) == "needed"
    # fixed: T row slots then the header row per rank; needed: each rank's rows, back to back
    slots_per_block = max_tokens + 1
    block_bytes = slots_per_block * fmt.row_bytes
    before = transport.num_collectives

    mask = token_rank_mask(topk_idx, placement)  # [N, R]
    position = torch.cumsum(mask.to(torch.int64), 0) - 1
    token, dest = torch.nonzero(mask, as_tuple=True)
    fused_fp8 = use_fp8 and row_kernels.usable(x, token)  # GPU: quantized straight into the send slots
    if fused_fp8:
        payload = {}
    elif use_fp8:
        q, scales = fp8.quantize(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
        payload = {"x": q.view(torch.uint8), "scales": scales}
    else:
        payload = {"x": x}
    sent_topk = topk_idx[token]
    safe = sent_topk.clamp(min=0)
    here = (sent_topk >= 0) & (placement.expert_to_rank.to(x.device)[safe] == dest.unsqueeze(1))
    local = placement.expert_to_local.to(x.device)[safe]

    counts = mask.sum(0, dtype=torch.int64)
    if needed:
        # the counts first: every rank learns how many rows each source sends it
        rows_to = counts.tolist()
        rows_from_host = transport.exchange_counts(counts.cpu().unsqueeze(1), "low_latency_dispatch/counts")[:, 0]
        send_splits = [n * fmt.row_bytes for n in rows_to]
        recv_splits = [int(n) * fmt.row_bytes for n in rows_from_host.tolist()]
        first_row = torch.cumsum(counts, 0) - counts
        send_row = first_row[dest] + position[token, dest]
        num_send_rows = sum(rows_to)
    else:
        # slots beyond each block's count are never read: no need to clear them
        send_splits = recv_splits = [block_bytes] * num_ranks
        send_row = dest * slots_per_block + position[token, dest]
        num_send_rows = num_ranks * slots_per_block
    send_buffer, send_bytes = scratch.take("low_latency_dispatch/send", sum(send_splits), x.device)
    recv_buffer, recv_bytes = scratch.take("low_latency_dispatch/recv", sum(recv_splits), x.device)
    send_fields = fmt.views(send_bytes.view(num_send_rows, fmt.row_bytes))
    for name, value in payload.items():
        copy_rows(send_fields[name], send_row, value, token)
    if fused_fp8:
        row_kernels.quantize_rows(x, token, send_fields["x"], send_fields["scales"], send_row, round_scale, use_ue8m0)
    send_fields["topk"].index_copy_(0, send_row, torch.where(here, local, torch.full_like(local, -1)).to(torch.int32))
    send_fields["src"].index_copy_(0, send_row, token.to(torch.int32).unsqueeze(1))
    if not needed:
        send_bytes.view(num_ranks, slots_per_block, fmt.row_bytes)[:, max_tokens, :8] = \
            counts.unsqueeze(1).view(torch.uint8)
    pending: PendingExchange = transport.exchange_bytes(send_bytes, send_splits, recv_splits,
                                                        "low_latency_dispatch/payload", out=recv_bytes)

    # DeepEP's layout: rows past recv_count[j] of recv_x[j] hold no data and are left unwritten
    slots_per_expert = num_ranks * max_tokens
    if receive_area is None:
        receive_area = empty_receive_area(
            receive_area_spec(num_local, slots_per_expert, hidden, use_fp8, use_ue8m0), x.device)
    if use_fp8:
        recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (receive_area[0], receive_area[1])
        targets = {"x": recv_x[0].view(torch.uint8)}
    else:
        recv_x = receive_area[0]
        targets = {"x": recv_x}
    recv_count = torch.zeros(num_local, dtype=torch.int32, device=x.device)
    recv_src_info = torch.full((num_local, slots_per_expert), -1, dtype=torch.int32, device=x.device)
    layout_range = torch.zeros(num_local, num_ranks, dtype=torch.int64, device=x.device)
    state = LowLatencyReceiveState()
    raw_row = hidden * 2 + topk * 4
    stats = CommStats("low_latency_dispatch", "fp8" if use_fp8 else "none",
                      [int(c) * raw_row for c in counts.tolist()], send_splits, [0] * num_ranks, recv_splits,
                      rank=rank)

    def receive() -> None:
        if state.done:
            return
        got = pending.wait()
        if needed:
            rows_from = rows_from_host.to(x.device)
            src_rank = torch.repeat_interleave(torch.arange(num_ranks, device=x.device), rows_from)
            src_row = torch.arange(src_rank.numel(), device=x.device)
            fields = fmt.views(got.view(src_rank.numel(), fmt.row_bytes))
        else:
            received = got.view(num_ranks, slots_per_block, fmt.row_bytes)
            rows_from = received[:, max_tokens, :8].contiguous().view(torch.int64).reshape(-1)
            valid = torch.arange(max_tokens, device=x.device).unsqueeze(0) < rows_from.unsqueeze(1)
            src_rank, src_slot = torch.nonzero(valid, as_tuple=True)
            src_row = src_rank * slots_per_block + src_slot
            fields = fmt.views(received.view(num_ranks * slots_per_block, fmt.row_bytes))
        slot_plan = build_expert_slot_plan(fields["topk"].index_select(0, src_row).to(torch.int64), rows_from,
                                           num_local)
        pair_row = src_row[slot_plan.row]
        target_row = slot_plan.local_expert * slots_per_expert + slot_plan.slot
        for name, target in targets.items():
            copy_rows(target.view(num_local * slots_per_expert, target.shape[-1]), target_row, fields[name], pair_row)
        if use_fp8:  # column-major scales: a strided scatter, not a row copy
            receive_area[1][slot_plan.local_expert, slot_plan.slot] = fields["scales"].index_select(0, pair_row)
        pair_rank = src_rank[slot_plan.row]
        recv_src_info.view(-1)[target_row] = fields["src"].index_select(0, pair_row).reshape(-1)
        layout_range.copy_(pack_layout_range(slot_plan.layout_range))
        recv_count.copy_(slot_plan.recv_count.to(torch.int32))
        state.pair_rank = pair_rank
        state.pair_slot = slot_plan.slot
        state.pair_expert = slot_plan.local_expert
        state.pairs_from_rank = torch.bincount(state.pair_rank, minlength=num_ranks)
        state.layout_range = slot_plan.layout_range
        stats.bytes_recv_raw = [int(c) * raw_row for c in rows_from.tolist()]
        stats.num_collectives = transport.num_collectives - before
        scratch.give("low_latency_dispatch/send", send_buffer)
        scratch.give("low_latency_dispatch/recv", recv_buffer)
        state.done = True

    return LowLatencyDispatchOutput(recv_x, recv_count, state, receive, stats, recv_src_info, layout_range)


def combine(transport: Transport, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            state: LowLatencyReceiveState, placement: ExpertPlacement,
            out: torch.Tensor | None = None,
            scratch: ScratchPool | None = None) -> tuple[Callable[[], torch.Tensor], CommStats]:
    """Starts returning expert outputs ``x [L, R*T, H]`` bf16; the returned callable finishes
    and gives ``[N, H]`` bf16 (written into ``out`` when given). ``scratch``: as in
    :func:`dispatch`."""
    scratch = scratch or ScratchPool(keep=0)
    rank = transport.rank
    before = transport.num_collectives
    hidden = x.shape[2]
    row_bytes = hidden * x.element_size()
    slots = x.shape[1]
    pair_rows = state.pair_expert * slots + state.pair_slot
    send_buffer, send_bytes = scratch.take("low_latency_combine/send", pair_rows.numel() * row_bytes, x.device)
    back = send_bytes.view(pair_rows.numel(), row_bytes)  # [P, H] bf16 as bytes: the row each pair returns
    copy_rows(back, torch.arange(pair_rows.numel(), device=x.device), x.reshape(-1, hidden), pair_rows)
    send_splits = [int(n) * row_bytes for n in state.pairs_from_rank.tolist()]
    plan = build_send_plan(token_rank_mask(topk_idx, placement))
    pair_token, pair_k, pairs_per_rank = combine_pair_order(topk_idx, plan.token_index,
                                                            plan.send_counts, placement)
    recv_splits = [int(n) * row_bytes for n in pairs_per_rank.tolist()]
    recv_buffer, recv_bytes = scratch.take("low_latency_combine/recv", sum(recv_splits), x.device)
    pending = transport.exchange_bytes(send_bytes, send_splits, recv_splits, "low_latency_combine/payload",
                                       out=recv_bytes)
    stats = CommStats("low_latency_combine", "none", send_splits, send_splits, recv_splits,
                      recv_splits, rank=rank)

    def finish() -> torch.Tensor:
        rows = pending.wait().view(x.dtype).reshape(-1, hidden)
        num_tokens, topk = topk_idx.shape
        # the pairs sorted by (token, k): each token's terms are added in k-ascending order, the
        # reference's order
        order = torch.argsort(pair_token * topk + pair_k)
        tokens, ks = pair_token[order], pair_k[order]
        acc = weighted_sum_by_token(rows, order, tokens, topk_weights.float()[tokens, ks], num_tokens,
                                    COMBINE_BLOCK_ROWS)
        scratch.give("low_latency_combine/send", send_buffer)
        scratch.give("low_latency_combine/recv", recv_buffer)
        stats.num_collectives = transport.num_collectives - before
        result = acc.to(x.dtype)
        if out is not None:
            out.copy_(result)
            return out
        return result

    return finish, stats


def rdma_size_hint(max_tokens: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of RDMA buffer the low-latency mode needs (send + receive, dispatch + combine), as
    DeepEP's ``get_low_latency_rdma_size_hint`` sizes it."""
    # dispatch row: bf16 payload (the larger of bf16 and fp8+scales) + top-k ids + header
    dispatch_row = hidden * 2 + 16 * 4 + 16
    combine_row = hidden * 2
    slots = max_tokens * num_ranks
    local_experts = max(num_experts // num_ranks, 1)
    send = max_tokens * max(dispatch_row, combine_row)
    recv = slots * local_experts * max(dispatch_row, combine_row)
    return ((send + recv) * 2 + 128 * num_ranks + 127) // 128 * 128


class ReceiveAreas:
    """Double-buffered receive tensors, like DeepEP's: a call's ``recv_x`` stays valid until the
    call after next (clone it to keep it longer). Reusing them keeps their pages resident instead
    of faulting in a fresh ``[L, R*T, H]`` tensor on every call. One shape's pair is kept."""

    def __init__(self) -> None:
        self._areas: dict[object, list[tuple[torch.Tensor, ...]]] = {}
        self._turn = 0

    def next(self, num_local: int, slots_per_expert: int, hidden: int, use_fp8: bool, use_ue8m0: bool,
             device: torch.device) -> tuple[torch.Tensor, ...]:
        """The tensors of :func:`receive_area_spec` for the next call (the pair alternates)."""
        spec = receive_area_spec(num_local, slots_per_expert, hidden, use_fp8, use_ue8m0)
        key = (spec, device)
        areas = self._areas.get(key)
        if areas is None:
            self._areas.clear()
            areas = [empty_receive_area(spec, device) for _ in range(2)]
            self._areas[key] = areas
        self._turn ^= 1
        return areas[self._turn]

    def clear(self) -> None:
        self._areas.clear()


@contextlib.contextmanager
def timed_wait(stats: torch.Tensor | None, live: torch.Tensor):
    """Adds the nanoseconds spent in the block to the entries of ``stats [R]`` int64 (DeepEP's
    wait-cost statistics) of the live source ranks (``live [R]`` bool)."""
    started = time.perf_counter_ns()
    yield
    if stats is not None:
        stats.add_(live.to(stats.device, torch.int64) * (time.perf_counter_ns() - started))


def pack_layout_range(pairs: torch.Tensor) -> torch.Tensor:
    """DeepEP's ``[L, R]`` int64 ``begin << 32 | count`` from ``[L, R, 2]`` (first slot, count)."""
    pairs = pairs.to(torch.int64)
    return (pairs[..., 0] << 32) | pairs[..., 1]


def wait_for_expert_signals(recv_count: torch.Tensor, slots: int, packed_recv_count: torch.Tensor | None,
                            comp_signal: torch.Tensor | None, block_m: int, threshold: int,
                            src_signals: torch.Tensor | None, expect: int, timeout_s: float) -> None:
    """SGLang's single-batch overlap on a combine that waits for the whole expert GEMM: returns
    once every block of ``block_m`` slots holding received rows has its ``comp_signal`` entry at
    ``threshold`` or above, and every local expert that received rows has its ``src_signals``
    entry at ``expect`` or above (see ``Buffer.low_latency_combine``). Polls from the host; a
    ValueError after ``timeout_s`` (the GEMM never signalled)."""
    num_local = int(recv_count.shape[0])
    counts = recv_count if packed_recv_count is None else packed_recv_count
    if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != (num_local,):
        raise ValueError(f"packed_recv_count must be a [{num_local}] tensor (recv_count of the dispatch)")
    counts = counts.to("cpu", torch.int64)
    checks: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    if comp_signal is not None:
        if not isinstance(block_m, int) or isinstance(block_m, bool) or block_m <= 0:
            raise ValueError(f"block_m must be a positive int, got {block_m!r}")
        blocks = -(-slots // block_m)
        if not isinstance(comp_signal, torch.Tensor) or comp_signal.numel() != num_local * blocks:
            raise ValueError(f"comp_signal must be a tensor of {num_local} x {blocks} entries "
                             f"(local experts x blocks of block_m={block_m} slots)")
        needed = torch.arange(blocks).unsqueeze(0) * block_m < counts.unsqueeze(1)  # [L, blocks]
        checks.append((comp_signal.reshape(-1), needed.reshape(-1), int(threshold)))
    if src_signals is not None:
        if not isinstance(src_signals, torch.Tensor) or src_signals.numel() != num_local:
            raise ValueError(f"src_signals must be a tensor of {num_local} entries (one per local expert)")
        checks.append((src_signals.reshape(-1), counts > 0, int(expect)))
    deadline = time.monotonic() + timeout_s
    for signals, needed, value in checks:
        while bool((signals.to("cpu", torch.int64)[needed] < value).any()):
            if time.monotonic() > deadline:
                raise ValueError(f"the expert GEMM's signals did not reach {value} within {timeout_s} s "
                                 "(overlap=True: the combine waits for them before reading x)")
            time.sleep(1e-4)
