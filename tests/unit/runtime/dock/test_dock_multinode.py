"""Warehouse placement and local reads on a local multi-node Ray cluster (ray.cluster_utils.Cluster:
a head and two worker nodes on one machine)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import ray
import torch
from ray import cloudpickle
from ray.cluster_utils import Cluster
from tensordict import TensorDict
from token_balance import imbalance

from rldock.config.job import DockSpec
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.balance import LOCAL_TOLERANCE
from rldock.runtime.dock.placement import HEAD_RESOURCE, pinned_to

pytestmark = pytest.mark.ray  # starts a Ray cluster of its own (tests/unit/conftest.py)

STATES = {"reference": ["prompt_ids"], "update": ["response_mask"]}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def head_id() -> str:
    return next(node["NodeID"] for node in ray.nodes() if node["Alive"] and HEAD_RESOURCE in node["Resources"])


def worker_ids() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node["Alive"] and HEAD_RESOURCE not in node["Resources"]}


def test_default_puts_one_warehouse_on_each_worker_node_none_on_the_head(cluster: Cluster) -> None:
    dock = TransferDock.create(DockSpec(timeout_s=30), states=STATES, num_samples=8, group_size=2)
    try:
        placed = dock.warehouse_nodes()
        assert len(placed) == 2 and set(placed) == worker_ids() and head_id() not in placed
        prompt_ids = torch.arange(8 * 3).view(8, 3)  # (B, 3)
        dock.put(torch.arange(8), TensorDict({"prompt_ids": prompt_ids}, batch_size=[8]))
        indices, batch = dock.get("reference", ["prompt_ids"], batch_size=8)
        assert indices.tolist() == list(range(8))
        assert torch.equal(batch["prompt_ids"], prompt_ids)
        assert [w["read_requests"] for w in dock.stats()["warehouses"]] == [1, 1]
    finally:
        dock.shutdown()


def test_the_controller_host_holds_warehouse_0_on_its_node_and_the_others_are_actors(cluster: Cluster) -> None:
    dock = TransferDock.create(DockSpec(num_warehouses=3, timeout_s=30), states=STATES, num_samples=6, group_size=2)
    try:
        *actors, host = dock._route.peers()
        first, second, third = dock.warehouse_nodes()
        # Warehouses 0 and 2 share the first worker node, the host's: both live inside it.
        assert [peer.name.split(" (")[0] for peer in actors] == ["warehouse 1"]
        assert "with warehouse 0 (" in host.name and "warehouse 2 (" in host.name
        assert first == third != second and {first, second} == worker_ids()  # 0 and 2 report the host's node
        masks = torch.ones(6, 4, dtype=torch.int64)
        dock.put(
            torch.arange(6),
            TensorDict({"response_mask": masks, "prompt_ids": torch.arange(6)[:, None]}, batch_size=[6]),
        )
        # A rank on the second node reads its own warehouse first, then the host's rows.
        on_second = take.options(scheduling_strategy=pinned_to(second))
        assert ray.get(on_second.remote(dock, 6)) == list(range(6))
        stats = dock.stats()["warehouses"]
        assert [w["read_requests"] for w in stats] == [1, 1, 1]
        # Its own node's warehouse through shared memory; the host's by the host's reply. (The
        # nodes of a local cluster share /dev/shm: only the node check keeps these apart.)
        assert [w["shared_read_requests"] for w in stats] == [0, 1, 0]
        assert [w["shared_write_requests"] for w in stats] == [0, 0, 0]  # the driver is on the head
    finally:
        dock.shutdown()


def test_more_warehouses_than_worker_nodes_go_round_robin_over_them(cluster: Cluster) -> None:
    dock = TransferDock.create(DockSpec(num_warehouses=3), states=STATES, num_samples=6, group_size=2)
    try:
        first, second, third = dock.warehouse_nodes()
        assert first != second and third == first and {first, second} == worker_ids()
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


def test_central_buffer_serves_every_node_from_one_actor(cluster: Cluster) -> None:
    dock = TransferDock.create(DockSpec(mode="central", timeout_s=30), states=STATES, num_samples=8, group_size=2)
    try:
        assert dock.warehouse_nodes() == [ray.get_runtime_context().get_node_id()]
        dock.put(torch.arange(8), TensorDict({"prompt_ids": torch.arange(8.0)[:, None]}, batch_size=[8]))
        other = next(iter(worker_ids()))
        assert ray.get(take.options(scheduling_strategy=pinned_to(other)).remote(dock, 8)) == list(range(8))
        stats = dock.stats()
        assert len(stats["warehouses"]) == 1 and stats["warehouses"][0]["read_requests"] == 1
    finally:
        dock.shutdown()


@ray.remote(num_cpus=0)
def update_rank(dock: TransferDock, rank: int, num_ranks: int, share: int) -> tuple[str, list[int], int]:
    """One DP rank of the update: its balanced share, where it ran, and its tokens."""
    indices, batch = dock.get(
        "update", ["response_mask"], rank=rank, batch_size=share, balance_ranks=num_ranks, timeout_s=60
    )
    return ray.get_runtime_context().get_node_id(), indices.tolist(), int(batch["response_mask"].sum())


def wait_for_requests(dock: TransferDock, state: str, count: int, timeout_s: float = 60) -> None:
    """Until `count` requests of `state` reached its controller (every rank waits in it)."""
    deadline = time.monotonic() + timeout_s
    while dock.stats()["controllers"][state]["requests"] < count:
        assert time.monotonic() < deadline, f"{count} requests of {state!r} did not arrive in {timeout_s}s"
        time.sleep(0.05)


@pytest.mark.parametrize("skewed", [False, True])
def test_each_rank_reads_its_nodes_warehouse_except_the_stated_levelling(cluster: Cluster, skewed: bool) -> None:
    num_samples, group_size, ranks_per_node = 64, 4, 2
    dock = TransferDock.create(
        DockSpec(timeout_s=60),
        states=STATES,
        num_samples=num_samples,
        group_size=group_size,
        token_columns=["response_mask"],
    )
    try:
        nodes = dock.warehouse_nodes()  # warehouse w on nodes[w], two worker nodes
        num_ranks = ranks_per_node * len(nodes)
        share = num_samples // num_ranks
        ranks = [
            update_rank.options(scheduling_strategy=pinned_to(nodes[r // ranks_per_node])).remote(
                dock, r, num_ranks, share
            )
            for r in range(num_ranks)
        ]
        wait_for_requests(dock, "update", num_ranks)  # every rank said where it is before the deal
        if skewed:  # log-normal lengths: the two nodes hold different token totals
            lengths = np.clip(np.random.default_rng(3).lognormal(2.5, 0.8, num_samples), 1, 48).astype(np.int64)
        else:  # the same lengths in both halves: each node holds its ranks' fair share
            lengths = np.tile(np.arange(1, num_samples // 2 + 1) % 9 + 1, 2)
        mask = (torch.arange(48) < torch.from_numpy(lengths)[:, None]).long()  # (B, 48)
        dock.put(torch.arange(num_samples), TensorDict({"response_mask": mask}, batch_size=[num_samples]))
        results = ray.get(ranks)
        owner = dock.layout.warehouse_of(np.arange(num_samples))
        off_node = sum(sum(nodes[owner[i]] != node for i in indices) for node, indices, _ in results)
        moved_units = dock.stats()["controllers"]["update"]["balance_moved_units"]
        assert off_node == moved_units  # every read off the rank's node is a move the deal made and reports
        parts = [np.array(indices) for _, indices, _ in results]
        assert imbalance(lengths, parts) <= LOCAL_TOLERANCE  # the stated bound
        if skewed:
            assert off_node <= num_samples // 4  # a location-blind deal reads about half across nodes
        else:
            assert off_node == 0
            # every rank read its node's rows in shared memory, in one read, and nothing else
            stats = dock.stats()["warehouses"]
            assert sum(w["shared_read_requests"] for w in stats) == sum(w["read_requests"] for w in stats) == num_ranks
        assert [node for node, _, _ in results] == [nodes[r // ranks_per_node] for r in range(num_ranks)]
    finally:
        dock.shutdown()
