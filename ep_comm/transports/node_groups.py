"""The two sub-transports of node-aware (two-hop) exchanges: this rank's rail and its node.

With nodes of ``P`` consecutive ranks, the *rail* of local index ``l`` links the ranks
``l, P + l, 2P + l, ...`` (one per node: the only traffic that crosses nodes) and the *node*
group links the ``P`` ranks of one node. Both are ``TorchDistTransport`` over ``dist.new_group``
subgroups, created collectively when the Buffer is made.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError
from ..plan import NodeTopology
from .base import Transport
from .torch_dist import TorchDistTransport


@dataclass
class NodeTransports:
    """This rank's sub-transports.

    Attributes:
        rank: this rank in the Buffer's group. topology: the node layout.
        rail: transport over ``topology.rail_ranks(local)`` (its rank ``g`` is on node ``g``).
        node: transport over ``topology.node_ranks(node)`` (its rank ``j`` is local rank ``j``).
        rail_members / node_members: the Buffer ranks of each sub-transport's ranks, in order.
    """

    rank: int
    topology: NodeTopology
    rail: Transport
    node: Transport
    rail_members: list[int]
    node_members: list[int]

    @property
    def num_collectives(self) -> int:
        return self.rail.num_collectives + self.node.num_collectives

    def map_timeout(self, error: CommTimeoutError, on_rail: bool) -> CommTimeoutError:
        """The same error with its peers renamed from sub-group ranks to Buffer ranks."""
        members = self.rail_members if on_rail else self.node_members
        peers = [members[p] for p in error.peers if 0 <= p < len(members)]
        hop = "rail" if on_rail else "node"
        mapped = CommTimeoutError(f"ep_comm two-hop ({hop} hop, phase {error.phase}): no answer from Buffer "
                                  f"rank(s) {peers}. Sub-group error, in sub-group ranks: {error}",
                                  peers=peers, phase=error.phase)
        return mapped


def create_node_transports(group: dist.ProcessGroup, ranks_per_node: int, timeout_s: float,
                           device: torch.device, instance_id: str) -> NodeTransports:
    """Creates every rail and node subgroup of ``group`` (collective: every rank of ``group``
    calls it, in the same order) and returns this rank's two transports.

    When ``group`` spans the whole job the subgroups are made with the usual collective
    ``dist.new_group``; for a smaller group only its members take part
    (``use_local_synchronization``), which needs every member to have created the same number of
    process groups before.
    """
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    topology = NodeTopology(num_ranks, ranks_per_node)
    spans_world = num_ranks == dist.get_world_size()
    backend = str(dist.get_backend(group))
    made: dict[tuple[str, int], dist.ProcessGroup] = {}
    lists = [("rail", local, topology.rail_ranks(local)) for local in range(ranks_per_node)]
    lists += [("node", node, topology.node_ranks(node)) for node in range(topology.num_nodes)]
    for kind, index, members in lists:
        sub = dist.new_group(ranks=[dist.get_global_rank(group, r) for r in members],
                             timeout=timedelta(seconds=timeout_s), backend=backend,
                             use_local_synchronization=not spans_world)
        if rank in members:
            made[(kind, index)] = sub
    local, node = topology.local_of(rank), topology.node_of(rank)
    rail = TorchDistTransport(made[("rail", local)], timeout_s, device, f"{instance_id}/rail{local}")
    node_t = TorchDistTransport(made[("node", node)], timeout_s, device, f"{instance_id}/node{node}")
    return NodeTransports(rank, topology, rail, node_t, topology.rail_ranks(local), topology.node_ranks(node))
