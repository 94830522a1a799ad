"""The two-hop kernel path of a node-aware ``Buffer`` on NVIDIA (``ranks_per_node=P`` with the
NVSHMEM transport): normal dispatch/combine through ``engines.two_hop.TwoHopEngine``, one NVSHMEM
PE per process, each process driving its own rank.

:meth:`TwoHopKernelPath.build` decides once, at ``Buffer`` construction (collectively), whether
the engine may run at all: kernels built with NVSHMEM, a CUDA device, ``P <= 8`` and every rank's
node peers load/store reachable through NVSHMEM. The ``*_reason`` methods decide per call.
Everything else (codecs, FP8 tuple input, no ``topk_idx``, float64 weights, biases, cached
dispatches, a combine of a handle from an older engine) goes to the node-aware path
(``hierarchical.py`` over ``torch.distributed`` subgroups): the same two-hop routing and results,
without the kernels. Masked ranks make the Buffer flat.

Counts before the kernels: the kernels' index arrays need this rank's ``NodePlan`` on the host, so
``hierarchical.exchange_node_plan`` runs three small host-synchronous collectives first: one over
the Buffer's flat transport (every rank's ``N``, which sizes the engine identically everywhere, and
the forwarders' rail counts) and two over the rail and node subgroups (target masks, forward
tables). The subgroups already exist for the node-aware path and their exchanges need no symmetric
memory of their own; the flat one must reach every rank, because ``nvshmem_malloc`` is collective
over all PEs and every rank must make the same engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..handle import DispatchState
from ..normal import DispatchOutput
from ..placement import ExpertPlacement
from ..plan import build_send_plan
from ..stats import CommStats
from ..transports.base import Transport
from ..transports.node_groups import NodeTransports
from .base import CombineCall, DispatchCall, Path
from .node_aware import MASKED

MAX_TWO_HOP_RANKS_PER_NODE = 8
"""``kMaxNodeRanks`` of csrc/cuda_bindings/two_hop_launch.h."""
MIN_TWO_HOP_CAPACITY = 64
"""Smallest per-rank token capacity an engine is made with (capacities grow in powers of two)."""


@dataclass(frozen=True)
class TwoHopKernelHandle:
    """Rides in ``DispatchState.kernel`` of a dispatch that ran on the two-hop kernels.

    Attributes:
        generation: the engine that made it. inner: the engine's ``TwoHopHandle`` (device index
        arrays). num_topk: ``K``.
    """

    generation: int
    inner: object
    num_topk: int


def two_hop_capacity(max_tokens: int) -> int:
    """Per-rank token capacity of an engine for calls of up to ``max_tokens`` tokens per rank."""
    return max(MIN_TWO_HOP_CAPACITY, 1 << max(int(max_tokens) - 1, 0).bit_length())


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


class TwoHopKernelPath(Path):
    """The two-hop engine of one Buffer, made on first use and remade (collectively, on every
    rank at once) when a call needs more tokens, wider rows, another ``K`` or placement.
    ``generation`` counts remakes; handles of an older engine combine on the node-aware path.

    Args:
        groups: the Buffer's node transports; transport: its flat transport (NVSHMEM).
        unavailable: why the engine cannot run on this Buffer (None: it can).
    """

    name = "two-hop kernels"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, transport: Transport | None,
                 groups: NodeTransports | None, ranks_per_node: int, timeout_s: float, buffer_id: int,
                 unavailable: str | None = None) -> None:
        super().__init__(unavailable)
        self.group, self.device, self.transport, self.groups = group, device, transport, groups
        self.ranks_per_node, self.timeout_s, self.buffer_id = ranks_per_node, timeout_s, buffer_id
        self.rank = dist.get_rank(group) if group is not None else 0
        self.num_ranks = dist.get_world_size(group) if group is not None else ranks_per_node
        self.engine = None
        self.key: tuple = ()
        self.generation = 0

    @staticmethod
    def decide(nvshmem_built: bool, device_type: str, ranks_per_node: int, reachable: list[bool]) -> str | None:
        """Why the engine cannot run (None: it can), from the construction-time facts
        (``reachable``: every rank's node peers load/store reachable, in rank order)."""
        if not nvshmem_built:
            return "ep_comm._cuda was built without NVSHMEM"
        if device_type != "cuda":
            return f"the Buffer's device is {device_type}, not cuda"
        if not 1 <= ranks_per_node <= MAX_TWO_HOP_RANKS_PER_NODE:
            return (f"ranks_per_node={ranks_per_node}: the two-hop kernels address at most "
                    f"{MAX_TWO_HOP_RANKS_PER_NODE} ranks per node")
        missing = [r for r, ok in enumerate(reachable) if not ok]
        if missing:
            return f"ranks {missing} cannot reach their node peers' NVSHMEM memory (nvshmem_ptr is null)"
        return None

    @classmethod
    def build(cls, group: dist.ProcessGroup, device: torch.device, transport: Transport, groups: NodeTransports,
              ranks_per_node: int, timeout_s: float, buffer_id: int) -> TwoHopKernelPath:
        """Decides whether the engine may run here (collective over ``group``: all-gathers whether
        each rank reaches its node peers through the flat transport's symmetric buffer)."""
        if transport.name != "nvshmem":
            return cls(group, device, transport, groups, ranks_per_node, timeout_s, buffer_id,
                       f"the {transport.name} transport moves bytes only")
        from ..engines.runtime import cuda_module

        rank = dist.get_rank(group)
        cuda = cuda_module()
        built = bool(cuda.nvshmem_built())
        mine = False
        if built and device.type == "cuda":
            first = rank // ranks_per_node * ranks_per_node
            base = int(getattr(transport, "symmetric", 0))
            mine = bool(base) and all(int(cuda.nvshmem_ptr(base, pe)) != 0
                                      for pe in range(first, first + ranks_per_node))
        gathered: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        why = cls.decide(built, device.type, ranks_per_node, [bool(v) for v in gathered])
        return cls(group, device, transport, groups, ranks_per_node, timeout_s, buffer_id, why)

    # -- engine ----------------------------------------------------------------------------------
    def _engine(self, placement: ExpertPlacement, num_topk: int, x_bytes: int, max_tokens: int):
        from ..engines import TwoHopEngine

        capacity = two_hop_capacity(max_tokens)
        e2r = tuple(placement.expert_to_rank.tolist())
        if (self.engine is not None and self.key[0] == e2r and self.key[1] == num_topk
                and self.key[2] >= x_bytes and self.key[3] >= capacity):
            return self.engine
        self.close()
        self.engine = TwoHopEngine(self.num_ranks, self.ranks_per_node, placement, self.device, self.group,
                                   capacity, x_bytes, num_topk, timeout_s=self.timeout_s)
        self.key = (e2r, num_topk, x_bytes, capacity)
        self.generation += 1
        return self.engine

    @property
    def row_bytes(self) -> int:
        """The current engine's row capacity in bytes (0: no engine)."""
        return int(self.engine.row_bytes) if self.engine is not None else 0

    def close(self) -> None:
        """Frees the engine's symmetric memory (collective)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def ranks_changed(self, transport: Transport) -> None:
        self.unavailable = self.unavailable or MASKED

    # -- per-call choice -------------------------------------------------------------------------
    def dispatch_reason(self, call: DispatchCall) -> str | None:
        if call.masked:
            return "ranks are masked"
        if call.codec != "none":
            return f"codec {call.codec!r} runs on the node-aware path"
        if isinstance(call.x, tuple):
            return "FP8 tuple input (scales) runs on the node-aware path"
        if call.topk_idx is None:
            return "no topk_idx"
        if call.topk_idx.shape[1] < 1:
            return "num_topk is 0"
        if call.topk_weights is not None and call.topk_weights.dtype != torch.float32:
            return f"topk_weights is {call.topk_weights.dtype}; the kernels carry float32"
        return None

    def combine_reason(self, call: CombineCall) -> str | None:
        kernel, x, topk_weights = call.handle.kernel, call.x, call.topk_weights
        if call.masked:
            return "ranks are masked"
        if not isinstance(kernel, TwoHopKernelHandle) or kernel.generation != self.generation or self.row_bytes == 0:
            return "the dispatch did not run on the current two-hop engine"
        if call.codec != "none":
            return f"codec {call.codec!r} runs on the node-aware path"
        if call.biases:
            return "bias is added on the node-aware path (one rounding, as there)"
        if x.dtype not in (torch.bfloat16, torch.float32):
            return f"the combine kernel sums bfloat16 or float32, x is {x.dtype}"
        num_w = 0
        if topk_weights is not None:
            if topk_weights.dtype != torch.float32:
                return f"topk_weights is {topk_weights.dtype}; the kernels sum float32"
            num_w = int(topk_weights.shape[1])
        payload = _align16(_align16(x.shape[1] * x.element_size()) + 4 * num_w)
        if payload > self.row_bytes:
            return f"combine rows of {payload} bytes exceed the engine's {self.row_bytes}"
        return None

    # -- calls -----------------------------------------------------------------------------------
    def dispatch(self, call: DispatchCall) -> DispatchOutput:
        """A node-aware dispatch on the kernels (``dispatch_reason`` said yes); same results and
        handle fields as ``hierarchical.dispatch`` (see there for shapes), plus ``kernel``."""
        from ..hierarchical import exchange_node_plan, exchange_recv_targets

        x, topk_idx, topk_weights = call.x, call.topk_idx, call.topk_weights
        is_token_in_rank, placement = call.is_token_in_rank, call.placement
        exchanged = exchange_node_plan(self.transport, self.groups, is_token_in_rank)  # type: ignore[arg-type]
        plan = exchanged.plan
        payload = x.to(self.device).contiguous()
        topk = topk_idx.to(self.device, torch.int64).contiguous()
        weights = None if topk_weights is None else topk_weights.to(self.device).contiguous()
        x_bytes = payload.shape[1] * payload.element_size()
        engine = self._engine(placement, int(topk.shape[1]), x_bytes, int(exchanged.tokens_per_rank.max()))
        res = engine.dispatch_rank(payload, topk, weights, plan)
        counts = torch.tensor(res.num_recv_tokens_per_expert, dtype=torch.int64)
        handle = DispatchState(
            buffer_id=self.buffer_id, send_plan=build_send_plan(is_token_in_rank), recv_counts=exchanged.recv_counts,
            is_token_in_rank=is_token_in_rank, num_tokens=int(payload.shape[0]),
            num_recv_tokens=int(exchanged.recv_counts.sum()), num_worst_tokens=0, hidden=int(payload.shape[1]),
            num_experts=placement.num_experts, recv_src_token_index=res.recv_src_idx, node_plan=plan,
            tokens_per_rank=exchanged.tokens_per_rank, rail_src_index=exchanged.rail_src_index,
            rail_targets=exchanged.rail_targets,
            recv_targets=exchange_recv_targets(self.groups, plan, exchanged.rail_targets),
            kernel=TwoHopKernelHandle(self.generation, res.handle, int(topk.shape[1])))
        row = res.recv_x.shape[1] * res.recv_x.element_size()
        from ..engines import TwoHopRows

        stats = self._stats("dispatch", plan, TwoHopRows(row, int(topk.shape[1])).payload_bytes, forward=True)
        return DispatchOutput(res.recv_x, res.recv_topk_idx, res.recv_topk_weights, counts, handle, stats)

    def combine(self, call: CombineCall) -> tuple[torch.Tensor, torch.Tensor | None, CommStats]:
        """A node-aware combine on the kernels (``combine_reason`` said yes): ``x [M, H]`` bf16 or
        float32, ``topk_weights [M, K]`` float32 or None; returns ``(combined [N, H]`` x's dtype,
        ``combined_weights [N, K]`` float32 or None, stats)."""
        handle, x, topk_weights = call.handle, call.x, call.topk_weights
        kernel = handle.kernel
        assert isinstance(kernel, TwoHopKernelHandle) and self.engine is not None
        m = handle.num_recv_tokens
        rows = x[:m].to(self.device).contiguous()
        weights = None if topk_weights is None else topk_weights[:m].to(self.device).contiguous()
        combined, combined_w = self.engine.combine_rank(rows, kernel.inner, weights)
        num_w = 0 if weights is None else int(weights.shape[1])
        payload = _align16(_align16(rows.shape[1] * rows.element_size()) + 4 * num_w)
        return combined, combined_w, self._stats("combine", handle.node_plan, payload, forward=False)

    def _stats(self, op: str, plan: object, row: int, forward: bool) -> CommStats:
        """Per-peer bytes of the two hops (``row`` bytes per row), in Buffer ranks."""
        per_node = self.ranks_per_node
        node, local = divmod(self.rank, per_node)
        sent, recv = [0] * self.num_ranks, [0] * self.num_ranks
        rail_out = plan.rail_plan.send_counts.tolist()  # type: ignore[attr-defined]
        rail_in = plan.rail_recv_counts.tolist()  # type: ignore[attr-defined]
        node_out = plan.forward_plan.send_counts.tolist()  # type: ignore[attr-defined]
        node_in = plan.node_recv_counts.sum(1).tolist()  # type: ignore[attr-defined]
        if not forward:  # the combine runs the same hops backwards
            rail_out, rail_in, node_out, node_in = rail_in, rail_out, node_in, node_out
        for g in range(self.num_ranks // per_node):
            sent[g * per_node + local] += int(rail_out[g]) * row
            recv[g * per_node + local] += int(rail_in[g]) * row
        for j in range(per_node):
            sent[node * per_node + j] += int(node_out[j]) * row
            recv[node * per_node + j] += int(node_in[j]) * row
        return CommStats(op, "none", sent, list(sent), recv, list(recv), rank=self.rank,
                         num_collectives=4 if forward else 0, extra={"two_hop_kernels": 1.0})
