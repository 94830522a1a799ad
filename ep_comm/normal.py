"""Normal-mode dispatch and combine: the algorithm, on any transport.

Dispatch sends every token once to each rank that holds at least one of its experts, with its
top-k ids already renumbered to the destination's local experts (``-1`` elsewhere) and its weights
(``0`` elsewhere). Combine returns one row per received token and sums them at the source in a
fixed order (source rank ascending), in float32, so results are deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .handle import DispatchState
from .layout import count_per_local_expert, localize_rows
from .payload import FieldSpec, Payload, RowFormat, RowSource, chunk_bytes, fp8_raw_row_delta, pack, unpack
from .placement import ExpertPlacement
from .plan import build_send_plan
from .rows import reduce_by_source
from .stats import CommStats
from .transports.base import Transport


@dataclass
class DispatchOutput:
    """Received tensors of a normal dispatch (before padding to ``num_worst_tokens``).

    Attributes:
        x: ``[M, H]`` received rows (input dtype) or, for FP8 input/codec, ``(q [M, H]`` e4m3,
            ``scales [M, G])``.
        topk_idx: ``[M, K]`` int64 local expert ids or None. topk_weights: ``[M, K]`` float32 or None.
        counts_per_expert: ``[L]`` int64 received tokens per local expert (None without topk_idx).
        handle: the dispatch handle. stats: bytes moved.
    """

    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    counts_per_expert: torch.Tensor | None
    handle: DispatchState
    stats: CommStats


def row_rank(send_counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    ranks = torch.arange(send_counts.numel(), device=send_counts.device)
    return torch.repeat_interleave(ranks, send_counts, output_size=num_rows)


def payload_fields(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[FieldSpec, ...]:
    if isinstance(x, tuple):
        q, scales = x
        return (FieldSpec("x", torch.uint8, q.shape[1]),
                FieldSpec("scales", scales.dtype, scales.shape[1]))
    return (FieldSpec("x", x.dtype, x.shape[1]),)


def payload_values(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    rows: torch.Tensor) -> dict[str, RowSource]:
    if isinstance(x, tuple):
        q, scales = x
        return {"x": RowSource(q.view(torch.uint8), rows), "scales": RowSource(scales, rows)}
    return {"x": RowSource(x, rows)}


def _stats(op: str, codec: str, transport: Transport, sent_raw: list[int], sent_wire: list[int],
           recv_raw: list[int], recv_wire: list[int], collectives_before: int) -> CommStats:
    return CommStats(op, codec, sent_raw, sent_wire, recv_raw, recv_wire, rank=transport.rank,
                     num_collectives=transport.num_collectives - collectives_before)


def dispatch(transport: Transport, buffer_id: int, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
             topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
             is_token_in_rank: torch.Tensor, placement: ExpertPlacement, codec: str) -> DispatchOutput:
    """Runs a normal-mode dispatch of this rank's tokens.

    Args:
        x: ``[N, H]`` bf16/fp16/fp32/fp64, or DeepEP's FP8 tuple ``(e4m3 [N, H], scales [N, G])``.
        topk_idx: ``[N, K]`` int64 global ids or None; topk_weights: ``[N, K]`` float or None.
        is_token_in_rank: ``[N, R]`` bool.
        codec: ``"none"``, ``"fp8"`` (quantized on the sender) or ``"lossless"``.
    """
    before = transport.num_collectives
    rank = transport.rank
    x, raw_delta = quantize_for_codec(x, codec)
    plan = build_send_plan(is_token_in_rank)
    row_splits = plan.splits()
    fields = list(payload_fields(x))
    fields.append(FieldSpec("src", torch.int32, 1))
    if topk_idx is not None:
        fields.append(FieldSpec("topk", torch.int32, topk_idx.shape[1]))
        if topk_weights is not None:
            fields.append(FieldSpec("weights", topk_weights.dtype, topk_weights.shape[1]))
    fmt = RowFormat(tuple(fields))
    pending_counts = None
    # every rank also learns every rank's N and send counts (DeepEP's rank prefix matrix)
    also = [int(is_token_in_rank.shape[0]), *row_splits]
    if codec != "lossless":
        # sizes are known before packing: exchange them while the rows are being packed
        pending_counts = start_count_exchange(transport, row_splits, [chunk_bytes(fmt, n) for n in row_splits],
                                              also=also)
    values = payload_values(x, plan.token_index)
    values["src"] = RowSource(plan.token_index.to(torch.int32).unsqueeze(1))
    if topk_idx is not None:
        dest_rank = row_rank(plan.send_counts, plan.num_rows)
        sent_w = topk_weights[plan.token_index] if topk_weights is not None else None
        local, local_w = localize_rows(topk_idx[plan.token_index], sent_w, dest_rank, placement)
        values["topk"] = RowSource(local.to(torch.int32))
        if local_w is not None:
            values["weights"] = RowSource(local_w)
    outbox = pack(fmt, values, row_splits, codec, raw_row_delta=raw_delta)
    if pending_counts is None:
        pending_counts = start_count_exchange(transport, row_splits, outbox.byte_splits, also=also)
    received_table = pending_counts.wait().view(torch.int64).view(transport.num_ranks, -1).cpu()
    rows_from = received_table[:, 0].tolist()
    bytes_from = received_table[:, 1].tolist()
    received = transport.exchange_bytes(outbox.data, outbox.byte_splits, bytes_from,
                                        "dispatch/payload").wait()
    fields_in = unpack(fmt, received, rows_from, bytes_from, codec)

    recv_counts = torch.tensor(rows_from, dtype=torch.int64)
    if isinstance(x, tuple):
        recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (
            fields_in["x"].view(torch.float8_e4m3fn), fields_in["scales"])
        hidden = x[0].shape[1]
    else:
        recv_x = fields_in["x"]
        hidden = x.shape[1]
    recv_topk = recv_w = counts = None
    num_local = int(placement.num_local_experts[rank])
    if topk_idx is not None:
        recv_topk = fields_in["topk"].to(torch.int64)
        recv_w = fields_in.get("weights")
        counts = count_per_local_expert(recv_topk, num_local)
    handle = DispatchState(
        buffer_id=buffer_id, send_plan=plan, recv_counts=recv_counts,
        is_token_in_rank=is_token_in_rank, num_tokens=int(is_token_in_rank.shape[0]),
        num_recv_tokens=int(recv_counts.sum()), num_worst_tokens=0, hidden=hidden,
        num_experts=placement.num_experts,
        recv_src_token_index=fields_in["src"].reshape(-1).to(torch.int64),
        count_matrix=received_table[:, 3:].clone(), tokens_per_rank=received_table[:, 2].clone())
    recv_raw = [n * (fmt.row_bytes + raw_delta) for n in rows_from]
    stats = _stats("dispatch", codec, transport, outbox.raw_byte_splits, outbox.byte_splits,
                   recv_raw, bytes_from, before)
    return DispatchOutput(recv_x, recv_topk, recv_w, counts, handle, stats)


def cached_dispatch(transport: Transport, handle: DispatchState,
                    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    codec: str) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], CommStats]:
    """Re-sends ``x [N, H]`` (or an FP8 tuple) along the plan of ``handle``; no layout exchange.

    Returns ``([M, H]`` rows ordered like the original dispatch, stats).
    """
    before = transport.num_collectives
    x, raw_delta = quantize_for_codec(x, codec)
    plan = handle.send_plan
    fmt = RowFormat(payload_fields(x))
    outbox = pack(fmt, payload_values(x, plan.token_index), plan.splits(), codec, raw_row_delta=raw_delta)
    rows_from = handle.recv_counts.tolist()
    bytes_from = receive_byte_counts(transport, outbox, rows_from, fmt, codec, "cached_dispatch/counts")
    received = transport.exchange_bytes(outbox.data, outbox.byte_splits, bytes_from,
                                        "cached_dispatch/payload").wait()
    fields_in = unpack(fmt, received, rows_from, bytes_from, codec)
    recv_x = ((fields_in["x"].view(torch.float8_e4m3fn), fields_in["scales"])
              if isinstance(x, tuple) else fields_in["x"])
    stats = _stats("cached_dispatch", codec, transport, outbox.raw_byte_splits, outbox.byte_splits,
                   [n * (fmt.row_bytes + raw_delta) for n in rows_from], bytes_from, before)
    return recv_x, stats


def quantize_for_codec(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], codec: str):
    """``(payload to send, raw_row_delta)``: with codec="fp8", ``x [N, H]`` quantized to
    ``(e4m3 [N, H], scales [N, H // 128])`` and the bytes per row it saves (reported as raw);
    otherwise ``(x, 0)``."""
    if codec != "fp8":
        return x, 0
    from .codecs import fp8

    quantized = fp8.quantize(x)
    return quantized, fp8_raw_row_delta(x, quantized)


def start_count_exchange(transport: Transport, rows: list[int], nbytes: list[int],
                          phase: str = "dispatch/counts", also: list[int] = ()):
    """Starts sending every rank its ``(rows, bytes)`` pair followed by the values ``also`` (the
    same to every rank); ``wait()`` gives ``[R * 8 * (2 + len(also))]`` uint8."""
    table = torch.tensor([[n, b, *also] for n, b in zip(rows, nbytes)], dtype=torch.int64)
    splits = [8 * table.shape[1]] * transport.num_ranks
    return transport.exchange_bytes(table.view(torch.uint8).reshape(-1), splits, splits, phase)


def receive_byte_counts(transport: Transport, outbox, rows_from: list[int], fmt: RowFormat, codec: str,
                phase: str) -> list[int]:
    """Bytes each source sends here: known from row counts unless the codec is variable-size."""
    if codec != "lossless":
        return [chunk_bytes(fmt, n) for n in rows_from]
    table = torch.tensor(outbox.byte_splits, dtype=torch.int64).unsqueeze(1)
    return transport.exchange_counts(table, phase)[:, 0].tolist()


def combine(transport: Transport, handle: DispatchState, x: torch.Tensor,
            topk_weights: torch.Tensor | None, bias: tuple[torch.Tensor, ...],
            codec: str) -> tuple[torch.Tensor, torch.Tensor | None, CommStats]:
    """Returns every received row to its source and sums per token.

    Args:
        x: ``[M', H]`` rows in the received order (``M' >= M``; padding rows are ignored).
        topk_weights: ``[M', K]`` float or None, summed the same way.
        bias: up to two ``[N, H]`` tensors added to the sum.
    Returns:
        ``(combined [N, H]`` x's dtype, ``combined_weights [N, K]`` or None, stats).
    """
    before = transport.num_collectives
    num_rows = handle.num_recv_tokens
    fields = [FieldSpec("x", x.dtype, x.shape[1])]
    values = {"x": RowSource(x[:num_rows])}
    if topk_weights is not None:
        fields.append(FieldSpec("weights", topk_weights.dtype, topk_weights.shape[1]))
        values["weights"] = RowSource(topk_weights[:num_rows])
    fmt = RowFormat(tuple(fields))
    send_rows = handle.recv_counts.tolist()
    outbox = pack(fmt, values, send_rows, codec)
    rows_from = handle.send_plan.splits()
    bytes_from = receive_byte_counts(transport, outbox, rows_from, fmt, codec, "combine/counts")
    received = transport.exchange_bytes(outbox.data, outbox.byte_splits, bytes_from,
                                        "combine/payload").wait()
    fields_in = unpack(fmt, received, rows_from, bytes_from, codec, as_blocks=("x",))
    combined = reduce_by_source(fields_in["x"], handle.send_plan, handle.num_tokens, bias)
    combined_w = None
    if topk_weights is not None:
        combined_w = reduce_by_source(fields_in["weights"], handle.send_plan, handle.num_tokens, ())
    stats = _stats("combine", codec, transport, outbox.raw_byte_splits, outbox.byte_splits,
                   [n * fmt.row_bytes for n in rows_from], bytes_from, before)
    return combined, combined_w, stats


def pad_rows(x: Payload | None, rows: int, value: float = 0) -> Payload | None:
    """``x`` (a tensor or an FP8 ``(values, scales)`` tuple) extended to ``rows`` rows filled with
    ``value`` (``num_worst_tokens``'s padding); ``x`` itself when ``rows <= 0`` or it is None."""
    if x is None or rows <= 0:
        return x
    if isinstance(x, tuple):
        q, scales = x
        return (pad_rows(q.view(torch.uint8), rows, value).view(torch.float8_e4m3fn), pad_rows(scales, rows, value))
    out = torch.full((rows, *x.shape[1:]), value, dtype=x.dtype, device=x.device)
    out[: x.shape[0]] = x
    return out


def exchange_expert_counts(transport: Transport, placement: ExpertPlacement, num_tokens_per_expert: torch.Tensor,
                           masked: frozenset[int] = frozenset()) -> torch.Tensor:
    """Every rank's ``num_tokens_per_expert [E]`` for this rank's experts, summed over the live
    ranks: ``[L]`` int64, the per-expert counts of a dispatch made from the layout alone. One
    count exchange (rank ``r`` is sent the counts of its own experts, rows padded to the largest
    expert count)."""
    per_rank = [placement.local_experts(r) for r in range(transport.num_ranks)]
    width = max(1, max(e.numel() for e in per_rank))
    table = torch.zeros(transport.num_ranks, width, dtype=torch.int64)
    counts = num_tokens_per_expert.to("cpu", torch.int64)
    for r, experts in enumerate(per_rank):
        table[r, :experts.numel()] = counts[experts]
    received = transport.exchange_counts(table, "dispatch/expert_counts")
    live = [r for r in range(transport.num_ranks) if r not in masked]
    return received[live].sum(0)[:per_rank[transport.rank].numel()]
