"""Node-aware (two-hop) normal-mode dispatch and combine, on any pair of transports.

Ranks form nodes of ``P`` consecutive ranks (``G = R / P`` nodes). Dispatch sends every token
once to each node that holds at least one of its target ranks, to that node's *forwarding peer*
(the rank with the sender's local index), over the sender's rail; the forwarder then sends it over
the node group to each target rank of its node. So a token crosses the network once per
destination node, not once per destination rank. The receiver reorders what its ``P`` forwarders
sent into the contract order (source rank, then source token): recv_x, recv_topk_idx, weights,
counts and the handle's flat fields are bit-identical to ``normal.dispatch``.

Combine runs the reverse: every rank returns its rows to their forwarders, each forwarder sums the
rows of each token over the ranks of its node (float32, local rank ascending) and sends one row per
token back over the rail in the payload dtype, and the source sums those per node (float32, node
ascending). With one node, or one rank per node, this is the same sum in the same order as the
flat combine (bit-identical); otherwise the per-node partial sums are rounded to the payload dtype
once more than the flat sum is, a difference of the order of that dtype's rounding step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import CommTimeoutError
from .handle import DispatchState
from .layout import count_per_local_expert, localize_rows, token_node_mask
from .normal import (
    DispatchOutput,
    payload_fields,
    payload_values,
    quantize_for_codec,
    receive_byte_counts,
    row_rank,
    start_count_exchange,
)
from .payload import FieldSpec, Payload, RowFormat, RowSource, pack, unpack
from .placement import ExpertPlacement
from .plan import NodePlan, build_send_plan, forward_counts, node_receive_order
from .rows import reduce_by_source
from .stats import CommStats
from .transports.base import Transport
from .transports.node_groups import NodeTransports


@dataclass
class _Hop:
    """One all-to-all over a sub-transport: received fields and per-peer byte counts."""

    fields: dict[str, torch.Tensor]
    rows_from: list[int]
    sent_raw: list[int]
    sent_wire: list[int]
    recv_raw: list[int]
    recv_wire: list[int]


class _Ledger:
    """Per-peer bytes of a call, in Buffer ranks, summed over its hops."""

    def __init__(self, num_ranks: int) -> None:
        self.sent_raw = [0] * num_ranks
        self.sent_wire = [0] * num_ranks
        self.recv_raw = [0] * num_ranks
        self.recv_wire = [0] * num_ranks

    def add(self, hop: _Hop, members: list[int]) -> None:
        for i, peer in enumerate(members):
            self.sent_raw[peer] += hop.sent_raw[i]
            self.sent_wire[peer] += hop.sent_wire[i]
            self.recv_raw[peer] += hop.recv_raw[i]
            self.recv_wire[peer] += hop.recv_wire[i]

    def stats(self, op: str, codec: str, rank: int, collectives: int) -> CommStats:
        return CommStats(op, codec, self.sent_raw, self.sent_wire, self.recv_raw, self.recv_wire,
                         rank=rank, num_collectives=collectives)


def _hop(groups: NodeTransports, on_rail: bool, fmt: RowFormat, values: dict[str, RowSource],
         row_splits: list[int], codec: str, phase: str, rows_from: list[int] | None,
         raw_delta: int = 0) -> _Hop:
    """Packs, sends and unpacks one hop; ``rows_from`` None: learn the row counts first.
    ``raw_delta``: raw bytes per row beyond ``fmt`` (FP8-quantized rows, see pack)."""
    transport: Transport = groups.rail if on_rail else groups.node
    try:
        outbox = pack(fmt, values, row_splits, codec, raw_row_delta=raw_delta)
        if rows_from is None:
            table = start_count_exchange(transport, row_splits, outbox.byte_splits, f"{phase}/counts").wait()
            table = table.view(torch.int64).view(transport.num_ranks, 2).cpu()
            rows_from, bytes_from = table[:, 0].tolist(), table[:, 1].tolist()
        else:
            bytes_from = receive_byte_counts(transport, outbox, rows_from, fmt, codec, f"{phase}/counts")
        received = transport.exchange_bytes(outbox.data, outbox.byte_splits, bytes_from,
                                            f"{phase}/payload").wait()
    except CommTimeoutError as error:
        raise groups.map_timeout(error, on_rail) from error
    fields = unpack(fmt, received, rows_from, bytes_from, codec)
    return _Hop(fields, rows_from, outbox.raw_byte_splits, outbox.byte_splits,
                [n * (fmt.row_bytes + raw_delta) for n in rows_from], bytes_from)


def _payload(fields: dict[str, torch.Tensor], like: Payload) -> Payload:
    if isinstance(like, tuple):
        return fields["x"].view(torch.float8_e4m3fn), fields["scales"]
    return fields["x"]


def _take(fields: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: t[index] for name, t in fields.items()}


def _forward_mask(target_ranks: torch.Tensor) -> torch.Tensor:
    """``[S, P]`` uint8 of 0/1 as carried on the rail -> bool."""
    return target_ranks != 0


def dispatch(groups: NodeTransports, buffer_id: int, x: Payload, topk_idx: torch.Tensor | None,
             topk_weights: torch.Tensor | None, is_token_in_rank: torch.Tensor,
             placement: ExpertPlacement, codec: str) -> DispatchOutput:
    """Two-hop normal dispatch of this rank's tokens (same arguments and results as
    ``normal.dispatch``; the handle also carries the ``NodePlan``).

    Args:
        x: ``[N, H]`` payload, or DeepEP's FP8 tuple ``(e4m3 [N, H], scales [N, G])``.
        topk_idx: ``[N, K]`` int64 global ids or None. topk_weights: ``[N, K]`` float or None.
        is_token_in_rank: ``[N, R]`` bool.
        codec: ``"none"``, ``"fp8"`` (quantized once, on the source) or ``"lossless"`` (coded
            per hop).
    """
    topo = groups.topology
    before = groups.num_collectives
    x, raw_delta = quantize_for_codec(x, codec)
    me = groups.rank
    nodes, per_node = topo.num_nodes, topo.ranks_per_node
    ledger = _Ledger(topo.num_ranks)

    # hop 1 (rail): each token once to the forwarding peer of every node it goes to
    rail_plan = build_send_plan(token_node_mask(is_token_in_rank, per_node))
    row_node = row_rank(rail_plan.send_counts, rail_plan.num_rows)
    fields = list(payload_fields(x)) + [FieldSpec("src", torch.int32, 1),
                                         FieldSpec("targets", torch.uint8, per_node)]
    values = payload_values(x, rail_plan.token_index)
    values["src"] = RowSource(rail_plan.token_index.to(torch.int32).unsqueeze(1))
    sent_in_rank = is_token_in_rank[rail_plan.token_index].view(-1, nodes, per_node)
    targets = sent_in_rank[torch.arange(rail_plan.num_rows), row_node]
    values["targets"] = RowSource(targets.to(torch.uint8))
    if topk_idx is not None:
        fields.append(FieldSpec("topk", torch.int32, topk_idx.shape[1]))  # global expert ids
        values["topk"] = RowSource(topk_idx.to(torch.int32), rail_plan.token_index)
        if topk_weights is not None:
            fields.append(FieldSpec("weights", topk_weights.dtype, topk_weights.shape[1]))
            values["weights"] = RowSource(topk_weights, rail_plan.token_index)
    rail_fmt = RowFormat(tuple(fields))
    hop1 = _hop(groups, True, rail_fmt, values, rail_plan.splits(), codec, "dispatch/rail", None, raw_delta)
    ledger.add(hop1, groups.rail_members)
    got = hop1.fields
    rail_recv_counts = torch.tensor(hop1.rows_from, dtype=torch.int64)

    # hop 2 (node): forward every received row to its target ranks on this node
    target_mask = _forward_mask(got["targets"])
    forward_plan = build_send_plan(target_mask)
    table = forward_counts(target_mask, rail_recv_counts)
    fwd = forward_plan.token_index
    # the target bits travel on so every receiver knows which ranks of its node got each row
    fields2 = list(payload_fields(x)) + [FieldSpec("src", torch.int32, 1), FieldSpec("targets", torch.uint8, per_node)]
    values2 = {"x": RowSource(got["x"], fwd), "src": RowSource(got["src"], fwd),
               "targets": RowSource(got["targets"], fwd)}
    if isinstance(x, tuple):
        values2["scales"] = RowSource(got["scales"], fwd)
    if topk_idx is not None:
        node = topo.node_of(me)
        dest = node * per_node + row_rank(forward_plan.send_counts, forward_plan.num_rows)
        sent_w = got["weights"][fwd] if topk_weights is not None else None
        local, local_w = localize_rows(got["topk"][fwd].to(torch.int64), sent_w, dest, placement)
        fields2.append(FieldSpec("topk", torch.int32, topk_idx.shape[1]))
        values2["topk"] = RowSource(local.to(torch.int32))
        if local_w is not None:
            fields2.append(FieldSpec("weights", local_w.dtype, local_w.shape[1]))
            values2["weights"] = RowSource(local_w)
    node_fmt = RowFormat(tuple(fields2))
    try:
        # counts per (target, source node), so the receiver can restore the contract order
        node_table = groups.node.exchange_counts(table, "dispatch/node/counts")
    except CommTimeoutError as error:
        raise groups.map_timeout(error, False) from error
    hop2 = _hop(groups, False, node_fmt, values2, forward_plan.splits(), codec, "dispatch/node",
                node_table.sum(1).tolist(), raw_delta)
    ledger.add(hop2, groups.node_members)

    order = node_receive_order(node_table)
    final = _take(hop2.fields, order.order)
    recv_x = _payload(final, x)
    hidden = x[0].shape[1] if isinstance(x, tuple) else x.shape[1]
    recv_topk = recv_w = counts = None
    if topk_idx is not None:
        recv_topk = final["topk"].to(torch.int64)
        recv_w = final.get("weights")
        counts = count_per_local_expert(recv_topk, int(placement.num_local_experts[me]))
    node_plan = NodePlan(per_node, rail_plan, rail_recv_counts, forward_plan, node_table, order.order)
    handle = DispatchState(
        buffer_id=buffer_id, send_plan=build_send_plan(is_token_in_rank), recv_counts=order.recv_counts,
        is_token_in_rank=is_token_in_rank, num_tokens=int(is_token_in_rank.shape[0]),
        num_recv_tokens=int(order.recv_counts.sum()), num_worst_tokens=0, hidden=hidden,
        num_experts=placement.num_experts, recv_src_token_index=final["src"].reshape(-1).to(torch.int64),
        node_plan=node_plan, rail_src_index=got["src"].reshape(-1).to(torch.int64),
        rail_targets=got["targets"].bool(), recv_targets=final["targets"].bool())
    stats = ledger.stats("dispatch", codec, me, groups.num_collectives - before)
    return DispatchOutput(recv_x, recv_topk, recv_w, counts, handle, stats)


def _forwarded(groups: NodeTransports, plan: NodePlan, fmt: RowFormat, rail_values: dict[str, RowSource],
               codec: str, phase: str, ledger: _Ledger, raw_delta: int = 0) -> dict[str, torch.Tensor]:
    """Cached two-hop send of fields that need no per-destination rewrite; returns them in
    contract order on the receiver."""
    hop1 = _hop(groups, True, fmt, rail_values, plan.rail_plan.splits(), codec, f"{phase}/rail",
                plan.rail_recv_counts.tolist(), raw_delta)
    ledger.add(hop1, groups.rail_members)
    fwd = plan.forward_plan.token_index
    values = {name: RowSource(t, fwd) for name, t in hop1.fields.items()}
    hop2 = _hop(groups, False, fmt, values, plan.forward_plan.splits(), codec, f"{phase}/node",
                plan.node_recv_counts.sum(1).tolist(), raw_delta)
    ledger.add(hop2, groups.node_members)
    return _take(hop2.fields, plan.recv_order)


def cached_dispatch(groups: NodeTransports, handle: DispatchState, x: Payload,
                    codec: str) -> tuple[Payload, CommStats]:
    """Re-sends ``x [N, H]`` (or an FP8 tuple) along the two-hop plan of ``handle``; no layout
    exchange. Returns ``([M, H]`` rows in contract order, stats)."""
    plan = handle.node_plan
    if plan is None:
        raise ValueError("handle was made by a flat dispatch: it has no node plan")
    before = groups.num_collectives
    x, raw_delta = quantize_for_codec(x, codec)
    ledger = _Ledger(groups.topology.num_ranks)
    fmt = RowFormat(payload_fields(x))
    final = _forwarded(groups, plan, fmt, payload_values(x, plan.rail_plan.token_index), codec,
                       "cached_dispatch", ledger, raw_delta)
    stats = ledger.stats("cached_dispatch", codec, groups.rank, groups.num_collectives - before)
    return _payload(final, x), stats


def combine(groups: NodeTransports, handle: DispatchState, x: torch.Tensor,
            topk_weights: torch.Tensor | None, bias: tuple[torch.Tensor, ...],
            codec: str) -> tuple[torch.Tensor, torch.Tensor | None, CommStats]:
    """Two-hop combine: the reverse of :func:`dispatch`, reducing at the forwarder first.

    Args:
        x: ``[M', H]`` rows in the received order (``M' >= M``; padding rows are ignored).
        topk_weights: ``[M', K]`` float or None, summed the same way.
        bias: up to two ``[N, H]`` tensors added to the sum on the source.
    Returns:
        ``(combined [N, H]`` x's dtype, ``combined_weights [N, K]`` or None, stats).
    """
    plan = handle.node_plan
    if plan is None:
        raise ValueError("handle was made by a flat dispatch: it has no node plan")
    before = groups.num_collectives
    ledger = _Ledger(groups.topology.num_ranks)
    num_rows = handle.num_recv_tokens
    fields = [FieldSpec("x", x.dtype, x.shape[1])]
    rows = {"x": x[:num_rows]}
    if topk_weights is not None:
        fields.append(FieldSpec("weights", topk_weights.dtype, topk_weights.shape[1]))
        rows["weights"] = topk_weights[:num_rows]
    fmt = RowFormat(tuple(fields))
    # back to the forwarders: contract order -> arrival order (grouped by forwarder)
    arrival = torch.empty_like(plan.recv_order)
    arrival[plan.recv_order] = torch.arange(num_rows, dtype=torch.int64)
    values = {name: RowSource(t, arrival.to(t.device)) for name, t in rows.items()}
    hop1 = _hop(groups, False, fmt, values, plan.node_recv_counts.sum(1).tolist(), codec,
                "combine/node", plan.forward_plan.splits())
    ledger.add(hop1, groups.node_members)
    # forwarder: one partial sum per rail-received row, local ranks ascending, float32
    num_rail_rows = int(plan.rail_recv_counts.sum())
    partial = {name: reduce_by_source(t, plan.forward_plan, num_rail_rows, ())
               for name, t in hop1.fields.items()}
    hop2 = _hop(groups, True, fmt, {name: RowSource(t) for name, t in partial.items()},
                plan.rail_recv_counts.tolist(), codec, "combine/rail", plan.rail_plan.splits())
    ledger.add(hop2, groups.rail_members)
    # source: sum the partial sums per token, nodes ascending
    combined = reduce_by_source(hop2.fields["x"], plan.rail_plan, handle.num_tokens, bias)
    combined_w = None
    if topk_weights is not None:
        combined_w = reduce_by_source(hop2.fields["weights"], plan.rail_plan, handle.num_tokens, ())
    stats = ledger.stats("combine", codec, groups.rank, groups.num_collectives - before)
    return combined, combined_w, stats


@dataclass(frozen=True)
class ExchangedNodePlan:
    """This rank's two-hop plan, learnt through the count exchanges, for a kernel engine that
    runs one rank per process (``engines.two_hop.TwoHopEngine`` with one PE per process).

    Attributes:
        plan: the rank's ``NodePlan``, identical to what :func:`dispatch` builds (and to
            :func:`virtual_node_plans` for this rank).
        recv_counts: ``[R]`` int64 rows received from each source rank (contract order).
        tokens_per_rank: ``[R]`` int64, every rank's ``N`` (the engines size their stages by
            the largest, so every rank makes the same engine).
        rail_src_index / rail_targets: as a forwarder, the source token index ``[S1]`` int64 and
            the target ranks on this node ``[S1, P]`` bool of every rail row, in arrival order.
    """

    plan: NodePlan
    recv_counts: torch.Tensor
    tokens_per_rank: torch.Tensor
    rail_src_index: torch.Tensor
    rail_targets: torch.Tensor


def exchange_node_plan(flat: Transport, groups: NodeTransports,
                       is_token_in_rank: torch.Tensor) -> ExchangedNodePlan:
    """Builds this rank's ``NodePlan`` without moving any payload, from the same routing maths as
    :func:`dispatch` (``build_send_plan``, ``token_node_mask``, ``forward_counts``,
    ``node_receive_order``). Three small host-synchronous collectives:

    1. ``flat`` (the whole group): ``[R, 2]`` int64, this rank's ``N`` to everyone and, to the
       forwarding peer of every node, the rows sent there (the forwarder's ``rail_recv_counts``);
    2. ``groups.rail``: the ``[S1, P]`` target masks of the sent rows (the forwarder's
       ``forward_plan``; :func:`dispatch` carries them inside the payload instead);
    3. ``groups.node``: the forwarders' ``[P, G]`` tables (the receiver's ``node_recv_counts``).

    Args:
        is_token_in_rank: ``[N, R]`` bool, this rank's layout.
    Raises:
        CommTimeoutError: a peer did not answer (naming Buffer ranks and the phase).
    """
    topo = groups.topology
    nodes, per_node, me = topo.num_nodes, topo.ranks_per_node, groups.rank
    mask = is_token_in_rank.cpu()
    rail_plan = build_send_plan(token_node_mask(mask, per_node))
    table = torch.zeros(topo.num_ranks, 2, dtype=torch.int64)
    table[:, 0] = int(mask.shape[0])
    peers = [g * per_node + topo.local_of(me) for g in range(nodes)]
    table[peers, 1] = rail_plan.send_counts
    counts = flat.exchange_counts(table, "two_hop_plan/counts")
    tokens_per_rank = counts[:, 0].clone()
    rail_recv_counts = counts[peers, 1].clone()
    # target bits of every sent row on its destination node, as the rail payload would carry them,
    # then the row's source token index (4 bytes)
    row_node = row_rank(rail_plan.send_counts, rail_plan.num_rows)
    sent = mask[rail_plan.token_index].view(-1, nodes, per_node)
    targets = sent[torch.arange(rail_plan.num_rows), row_node].to(torch.uint8)
    src = rail_plan.token_index.to(torch.int32).unsqueeze(1).view(torch.uint8)
    rows = torch.cat([targets, src], dim=1).contiguous()
    width = per_node + 4
    try:
        got = groups.rail.exchange_bytes(rows.view(-1).to(groups.rail.device),
                                         (rail_plan.send_counts * width).tolist(),
                                         (rail_recv_counts * width).tolist(), "two_hop_plan/rail_masks").wait()
    except CommTimeoutError as error:
        raise groups.map_timeout(error, True) from error
    got = got.cpu().view(-1, width)
    target_mask = _forward_mask(got[:, :per_node])
    rail_src_index = got[:, per_node:].contiguous().view(torch.int32).reshape(-1).to(torch.int64)
    forward_plan = build_send_plan(target_mask)
    try:
        node_table = groups.node.exchange_counts(forward_counts(target_mask, rail_recv_counts),
                                                 "two_hop_plan/node_counts")
    except CommTimeoutError as error:
        raise groups.map_timeout(error, False) from error
    order = node_receive_order(node_table)
    plan = NodePlan(per_node, rail_plan, rail_recv_counts, forward_plan, node_table, order.order)
    return ExchangedNodePlan(plan, order.recv_counts, tokens_per_rank, rail_src_index, target_mask)


def exchange_recv_targets(groups: NodeTransports, plan: NodePlan, rail_targets: torch.Tensor) -> torch.Tensor:
    """``[M, P]`` bool: the ranks of this node that received each row this rank received (in
    contract order), from the forwarders' ``rail_targets [S1, P]`` bool: one exchange over the
    node transport (:func:`dispatch` carries the bits in its payload instead)."""
    per_node = plan.ranks_per_node
    rows = rail_targets[plan.forward_plan.token_index].to(torch.uint8).contiguous()
    try:
        got = groups.node.exchange_bytes(rows.view(-1).to(groups.node.device),
                                         (plan.forward_plan.send_counts * per_node).tolist(),
                                         (plan.node_recv_counts.sum(1) * per_node).tolist(),
                                         "two_hop_plan/recv_targets").wait()
    except CommTimeoutError as error:
        raise groups.map_timeout(error, False) from error
    return got.cpu().view(-1, per_node)[plan.recv_order].bool()
