"""Where the dock's actors go: one warehouse per alive Ray node, round-robin when S > nodes.

A warehouse on every node keeps each node's share of the batch in that node's memory, so the
traffic a node's workers make mostly stays on the node and the rest spreads over all links.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def alive_node_ids() -> list[str]:
    """IDs of the alive nodes of the connected Ray cluster, sorted so placement is repeatable."""
    return sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])


def assign_nodes(num_warehouses: int, node_ids: list[str]) -> list[str]:
    """Node of each warehouse, round-robin over `node_ids`."""
    if not node_ids:
        raise RuntimeError("the Ray cluster has no alive nodes to place dock warehouses on")
    return [node_ids[w % len(node_ids)] for w in range(num_warehouses)]


def pinned_to(node_id: str, *, soft: bool = False) -> NodeAffinitySchedulingStrategy:
    """Schedule on `node_id`; with soft=False the actor fails rather than land elsewhere."""
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)
