"""Where the dock's actors go: one warehouse per worker node, round-robin when S > nodes.

A warehouse on every node that runs consumers keeps each node's share of the batch in that
node's memory, so the traffic a node's workers make mostly stays on the node and the rest spreads
over all links. The Ray head runs no consumer in the operator's RayCluster (it has no devices),
so a warehouse there would only hold samples every read of which crosses the network: the head
gets one only when it is the only node.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rldock.contract.pool_nodes import POOL_NODE_LABEL, POOL_NODE_VALUE

HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node only


def worker_node_ids() -> list[str]:
    """The alive nodes that may run consumers: every node but the head and an RLJob's rollout pool nodes (their
    engines write groups, which belong to the trainer's nodes: rldock.contract.pool_nodes), or the head if it is
    alone."""
    alive = [node for node in ray.nodes() if node["Alive"]]
    workers = sorted(
        node["NodeID"]
        for node in alive
        if HEAD_RESOURCE not in node["Resources"] and (node.get("Labels") or {}).get(POOL_NODE_LABEL) != POOL_NODE_VALUE
    )
    return workers or sorted(node["NodeID"] for node in alive)


def assign_nodes(num_warehouses: int, node_ids: list[str]) -> list[str]:
    """Node of each warehouse, round-robin over `node_ids`."""
    if not node_ids:
        raise RuntimeError("the Ray cluster has no alive nodes to place dock warehouses on")
    return [node_ids[w % len(node_ids)] for w in range(num_warehouses)]


def pinned_to(node_id: str, *, soft: bool = False) -> NodeAffinitySchedulingStrategy:
    """Schedule on `node_id`; with soft=False the actor fails rather than land elsewhere."""
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)
