"""Warehouse placement on a two-node local Ray cluster (ray.cluster_utils.Cluster, one machine)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import ray
import torch
from ray import cloudpickle
from ray.cluster_utils import Cluster
from tensordict import TensorDict

from rldock.config.job import DockSpec
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.placement import pinned_to

STATES = {"reference": ["prompt_ids"]}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


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


@ray.remote(num_cpus=0)
def take(dock: TransferDock, batch_size: int) -> list[int]:
    indices, _ = dock.get("reference", ["prompt_ids"], batch_size=batch_size, timeout_s=30)
    return indices.tolist()


def test_consumers_take_samples_stored_on_their_own_node_first(cluster: Cluster) -> None:
    dock = TransferDock.create(DockSpec(timeout_s=30), states=STATES, num_samples=8, group_size=2)
    try:
        dock.put(torch.arange(8), TensorDict({"prompt_ids": torch.zeros(8, 3)}, batch_size=[8]))
        second_node = dock.warehouse_nodes()[1]  # warehouse 1 holds samples 4..7
        on_second = take.options(scheduling_strategy=pinned_to(second_node))
        assert ray.get(on_second.remote(dock, 2)) == [4, 5]
        assert ray.get(on_second.remote(dock, 4)) == [0, 1, 6, 7]  # local first, then remote
    finally:
        dock.shutdown()


def test_central_buffer_serves_both_nodes_from_one_actor(cluster: Cluster) -> None:
    dock = TransferDock.create(DockSpec(mode="central", timeout_s=30), states=STATES, num_samples=8, group_size=2)
    try:
        assert dock.warehouse_nodes() == [ray.get_runtime_context().get_node_id()]
        dock.put(torch.arange(8), TensorDict({"prompt_ids": torch.arange(8.0)[:, None]}, batch_size=[8]))
        other = next(node for node in node_ids() if node != dock.warehouse_nodes()[0])
        assert ray.get(take.options(scheduling_strategy=pinned_to(other)).remote(dock, 8)) == list(range(8))
        stats = dock.stats()
        assert len(stats["warehouses"]) == 1 and stats["warehouses"][0]["read_requests"] == 1
    finally:
        dock.shutdown()
