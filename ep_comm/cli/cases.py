"""The measured methods: ep_comm (normal and low-latency), the naive all-to-all, the transport floor.

A case runs ``dispatch()`` and ``combine()`` (each timed), ``between()`` (untimed: plays the
experts, turning dispatch outputs into combine inputs) and ``verify()`` (``--check``). After a
call, ``wire[op]`` holds the bytes this rank sent to / received from each peer, and with
``ranks_per_node`` set also ``sent_off_node``: the bytes it sent to other (virtual) nodes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from . import check as ck
from .baselines import NaiveAllToAll, TransportFloor

OPS = ("dispatch", "combine")


class Case(ABC):
    """One method on one (mode, codec); subclasses fill in the four steps."""

    method = "abstract"

    def __init__(self, mode: str, codec: str, ranks_per_node: int | None = None) -> None:
        self.mode = mode
        self.codec = codec
        self.ranks_per_node = ranks_per_node
        self.wire: dict[str, dict[str, list[int]]] = {}
        self.out: Any = None
        self.combined: Any = None

    @property
    def name(self) -> str:
        return f"{self.method}/{self.mode}/{self.codec}"

    @abstractmethod
    def dispatch(self) -> None:
        """Timed: one dispatch (or the baseline's equivalent)."""

    def between(self) -> None:  # noqa: B027 - optional hook, most cases need nothing here
        """Untimed: builds the combine input from the dispatch output (default: nothing)."""

    @abstractmethod
    def combine(self) -> None:
        """Timed: one combine (or the baseline's equivalent)."""

    def verify(self, g: ck.GlobalInputs, rank: int) -> list[str]:
        """Problems found in the last dispatch and combine (empty when correct)."""
        return []

    def _record(self, op: str, stats: Any) -> None:
        self.wire[op] = {"sent_wire": list(stats.bytes_sent_wire), "recv_wire": list(stats.bytes_recv_wire),
                         "sent_raw": list(stats.bytes_sent_raw), "recv_raw": list(stats.bytes_recv_raw),
                         "codec": str(stats.codec)}
        if self.ranks_per_node:
            self.wire[op]["sent_off_node"] = stats.bytes_sent_off_node(self.ranks_per_node)


class Inputs:
    """This rank's inputs on the benchmark device."""

    def __init__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, rank: int, num_ranks: int) -> None:
        self.x, self.topk_idx, self.topk_weights = x, topk_idx, topk_weights
        self.num_experts, self.rank, self.num_ranks = num_experts, rank, num_ranks
        self.num_local = num_experts // num_ranks


class EpNormalCase(Case):
    """``get_dispatch_layout`` + ``dispatch`` (timed together), then ``combine``.

    ``ranks_per_node`` (``--node-aware``) only makes ``_record`` count the bytes sent off node;
    whether the exchange is node-aware is up to ``buf``."""

    method = "ep_comm"

    def __init__(self, buf: Any, inp: Inputs, codec: str, ranks_per_node: int | None = None) -> None:
        super().__init__("normal", codec, ranks_per_node)
        self.buf, self.inp = buf, inp
        self.combine_codec = {"fp8": "none"}.get(codec, codec)

    def dispatch(self) -> None:
        i = self.inp
        per_rank, per_rdma, per_expert, in_rank, _ = self.buf.get_dispatch_layout(i.topk_idx, i.num_experts)
        self.out = self.buf.dispatch(i.x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                                     is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                     topk_idx=i.topk_idx, topk_weights=i.topk_weights, codec=self.codec)
        self._record("dispatch", self.buf.last_stats)

    def between(self) -> None:
        y = ck.as_bf16(self.out[0]).float() * ck.rank_factor(self.inp.rank)
        self.y = y.to(torch.bfloat16)

    def combine(self) -> None:
        self.combined = self.buf.combine(self.y, self.out[4], topk_weights=self.out[2],
                                         codec=self.combine_codec)
        self._record("combine", self.buf.last_stats)

    def verify(self, g: ck.GlobalInputs, rank: int) -> list[str]:
        fp8 = self.codec == "fp8" or isinstance(self.out[0], tuple)
        want_x, want_idx, want_w, want_counts = ck.ref_dispatch(g, rank)
        got_x = ck.as_bf16(self.out[0])
        errs = ck.compare("dispatch recv_x", got_x, want_x, fp8)
        errs += ck.compare("dispatch recv_topk_idx", self.out[1], want_idx, False)
        errs += ck.compare("dispatch recv_topk_weights", self.out[2], want_w, False)
        if list(self.out[3]) != want_counts:
            errs.append(f"dispatch num_recv_tokens_per_expert_list {list(self.out[3])} != {want_counts}")
        want, coef = ck.ref_normal_combine(g, rank)
        x = g.x[rank]
        errs += ck.compare("combine combined_x", self.combined[0], want, fp8,
                           scale=coef.unsqueeze(1) * x.float().abs(),
                           amax=coef.unsqueeze(1) * ck.block_amax(x))
        want_w = torch.where(g.topk_idx[rank] >= 0, g.topk_weights[rank], torch.zeros(()))
        errs += ck.compare("combine combined_topk_weights", self.combined[1], want_w, False,
                           scale=want_w.abs())
        return errs


class FlatNormalCase(EpNormalCase):
    """``--node-aware``'s comparison: the same calls on a flat Buffer (no ``ranks_per_node``),
    same data, its bytes sent off node counted with the same virtual nodes."""

    method = "flat"


class EpLowLatencyCase(Case):
    """``low_latency_dispatch`` then ``low_latency_combine`` (capacity = tokens per rank)."""

    method = "ep_comm"

    def __init__(self, buf: Any, inp: Inputs, codec: str) -> None:
        super().__init__("low-latency", codec)
        self.buf, self.inp = buf, inp

    def dispatch(self) -> None:
        i = self.inp
        self.out = self.buf.low_latency_dispatch(i.x, i.topk_idx, i.x.shape[0], i.num_experts,
                                                 use_fp8=self.codec == "fp8")
        self._record("dispatch", self.buf.last_stats)

    def between(self) -> None:
        """Scales expert ``j``'s valid rows by ``expert_factor``; only those rows are touched (the
        ``[L, R*T, H]`` layout is mostly empty slots), in a buffer reused across iterations (every
        iteration has the same routing, hence the same valid slots)."""
        i = self.inp
        recv_x, recv_count = self.out[0], self.out[1]
        q = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        if getattr(self, "y", None) is None or self.y.shape != q.shape:
            self.y = torch.zeros(q.shape, dtype=torch.bfloat16, device=q.device)
        valid = torch.arange(q.shape[1], device=q.device)[None, :] < recv_count.to(q.device)[:, None]
        j, slot = torch.nonzero(valid, as_tuple=True)
        rows = ck.as_bf16((recv_x[0][j, slot], recv_x[1][j, slot]) if isinstance(recv_x, tuple)
                          else recv_x[j, slot])
        factor = ck.expert_factor(j + i.rank * i.num_local).to(q.device)
        self.y[j, slot] = (rows.float() * factor[:, None]).to(torch.bfloat16)

    def combine(self) -> None:
        i = self.inp
        self.combined = self.buf.low_latency_combine(self.y, i.topk_idx, i.topk_weights, self.out[2])
        self._record("combine", self.buf.last_stats)

    def verify(self, g: ck.GlobalInputs, rank: int) -> list[str]:
        fp8 = self.codec == "fp8"
        recv_x, recv_count = self.out[0], self.out[1].cpu()
        errs: list[str] = []
        for j in range(g.num_local):
            per_src = ck.ref_expert_rows(g, rank, j)
            want_count = sum(r.shape[0] for r in per_src)
            if int(recv_count[j]) != want_count:
                errs.append(f"dispatch recv_count[{j}] = {int(recv_count[j])}, expected {want_count}")
                continue
            start = 0
            for src, rows in enumerate(per_src):
                end = start + rows.shape[0]
                got = ck.as_bf16((recv_x[0][j, start:end], recv_x[1][j, start:end]) if fp8
                                 else recv_x[j, start:end]).cpu()
                errs += ck.match_rows(f"dispatch expert {j} rows from rank {src}", got, rows, fp8)
                start = end
        want, coef = ck.ref_weighted_combine(g, rank)
        x = g.x[rank]
        errs += ck.compare("combine combined_x", self.combined[0], want, fp8,
                           scale=coef.unsqueeze(1) * x.float().abs(),
                           amax=coef.unsqueeze(1) * ck.block_amax(x))
        return errs[:8]


class NaiveCase(Case):
    """Megatron-style per-expert all-to-all (bf16)."""

    method = "naive"

    def __init__(self, naive: NaiveAllToAll, inp: Inputs) -> None:
        super().__init__("-", "none")
        self.naive, self.inp = naive, inp
        self.row_bytes = inp.x.shape[1] * inp.x.element_size()

    def dispatch(self) -> None:
        self.out = self.naive.dispatch(self.inp.x, self.inp.topk_idx)
        d, c = self.naive.wire_bytes(self.out[1], self.row_bytes)
        self.wire["dispatch"] = {"sent_wire": d}
        self.wire["combine"] = {"sent_wire": c}

    def between(self) -> None:
        i = self.inp
        rows, state = self.out
        experts = torch.arange(i.num_local) + i.rank * i.num_local
        row_expert = torch.repeat_interleave(experts, state.tokens_per_expert.cpu()).to(rows.device)
        factor = ck.expert_factor(row_expert).to(rows.device)
        self.y = (rows.float() * factor[:, None]).to(torch.bfloat16)

    def combine(self) -> None:
        self.combined = self.naive.combine(self.y, self.out[1], self.inp.topk_weights)

    def verify(self, g: ck.GlobalInputs, rank: int) -> list[str]:
        rows, state = self.out
        want = torch.cat([torch.cat(ck.ref_expert_rows(g, rank, j)) for j in range(g.num_local)])
        errs = ck.compare("naive dispatch rows", rows.cpu(), want, False)
        want_c, coef = ck.ref_weighted_combine(g, rank)
        # bf16 products and a bf16 running sum over K terms: (K + 1) roundings of 2**-9
        errs += ck.compare("naive combine", self.combined.cpu(), want_c, False,
                           scale=coef.unsqueeze(1) * g.x[rank].float().abs(),
                           rel=(g.topk_idx.shape[2] + 1) * 2.0 ** -8)
        return errs


class FloorCase(Case):
    """Bare ``all_to_all_single`` of the per-peer wire bytes another case measured."""

    method = "floor"

    def __init__(self, of: Case, group: Any, device: torch.device) -> None:
        super().__init__(of.mode, of.codec)
        self.floors = {op: TransportFloor(group, of.wire[op]["sent_wire"], of.wire[op]["recv_wire"], device)
                       for op in OPS}
        self.wire = {op: {"sent_wire": list(of.wire[op]["sent_wire"])} for op in OPS}

    def dispatch(self) -> None:
        self.floors["dispatch"].run()

    def combine(self) -> None:
        self.floors["combine"].run()
