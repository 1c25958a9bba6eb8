"""Warehouse placement on a two-node local Ray cluster (ray.cluster_utils.Cluster, one machine)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from tensordict import TensorDict

from rldock.config.job import DockSpec
from rldock.runtime.dock import TransferDock

STATES = {"reference": ["prompt_ids"]}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def node_ids() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}


def test_default_puts_one_warehouse_on_each_node_and_reads_across_them(cluster: Cluster) -> None:
    dock = TransferDock.create(DockSpec(timeout_s=30), states=STATES, num_samples=8, group_size=2)
    try:
        placed = dock.warehouse_nodes()
        assert len(placed) == 2 and set(placed) == node_ids()
        prompt_ids = torch.arange(8 * 3).view(8, 3)  # (B, 3)
        dock.put(torch.arange(8), TensorDict({"prompt_ids": prompt_ids}, batch_size=[8]))
        indices, batch = dock.get("reference", ["prompt_ids"], batch_size=8)
        assert indices.tolist() == list(range(8))
        assert torch.equal(batch["prompt_ids"], prompt_ids)
        assert [w["read_requests"] for w in dock.stats()["warehouses"]] == [1, 1]
    finally:
        dock.shutdown()


def test_more_warehouses_than_nodes_go_round_robin(cluster: Cluster) -> None:
    dock = TransferDock.create(DockSpec(num_warehouses=3), states=STATES, num_samples=6, group_size=2)
    try:
        first, second, third = dock.warehouse_nodes()
        assert first != second and third == first
    finally:
        dock.shutdown()
