"""An RLJob's rollout pool nodes (rldock.contract.pool_nodes) on a local three-node Ray (ray.cluster_utils.Cluster):
a head without devices, a trainer node with two emulated NPUs, a pool node with two labelled for the pool. With
the operator's variable set, the pool's engines land on the pool node only, the trainer's placement group never
does, the dock's warehouses skip it, and the pool's size is the devices it holds. The actors are probes (test
doubles reporting where Ray put them), scheduled through rldock.runtime.workers.cluster as the job's are."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import ray
from ray import cloudpickle
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rldock.contract.placement import plan_placement
from rldock.contract.pool_nodes import POOL_NODE_LABEL, POOL_NODE_VALUE, POOL_NODES_ENV
from rldock.runtime.dock.placement import worker_node_ids
from rldock.runtime.workers import cluster as placement

pytestmark = pytest.mark.ray  # starts a Ray cluster of its own (tests/unit/conftest.py)


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, str]]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    trainer = cluster.add_node(num_cpus=4, resources={"NPU": 2})
    pool = cluster.add_node(num_cpus=4, resources={"NPU": 2}, labels={POOL_NODE_LABEL: POOL_NODE_VALUE})
    cluster.wait_for_nodes()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address=cluster.address, log_to_driver=False)
    yield {"trainer": trainer.node_id, "pool": pool.node_id}
    ray.shutdown()
    cluster.shutdown()
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class Probe:
    """Test double of a worker: reports its node."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_the_pools_size_is_its_nodes_devices_and_the_dock_skips_them(nodes):
    assert placement.pool_node_devices("NPU") == 2
    assert worker_node_ids() == [nodes["trainer"]]  # not the head, not the pool node


def test_the_pools_engines_go_to_its_nodes_and_the_trainers_devices_never_do(nodes, monkeypatch):
    monkeypatch.setenv(POOL_NODES_ENV, POOL_NODE_VALUE)
    assert placement.pool_nodes_managed()
    engines = [placement.on_a_device_of_its_own(Probe, accelerator="NPU", on_pool_nodes=True).remote() for _ in (0, 1)]
    assert {ray.get(engine.node.remote(), timeout=60) for engine in engines} == {nodes["pool"]}
    for engine in engines:
        ray.kill(engine)
    # Three devices for the trainer: the trainer node has two and the pool node two free now, but the
    # placement group keeps off the pool node, so it cannot be had.
    plan = plan_placement(accelerator="NPU", num_actor_ranks=3, mode="separate")
    with pytest.raises(placement.PlacementTimeout):
        placement.reserve(plan, timeout_s=3)
    group = placement.reserve(plan_placement(accelerator="NPU", num_actor_ranks=2, mode="separate"), timeout_s=60)
    try:
        probes = [
            ray.remote(Probe)
            .options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(group, bundle))
            .remote()
            for bundle in (0, 1)
        ]
        assert {ray.get(probe.node.remote(), timeout=60) for probe in probes} == {nodes["trainer"]}
    finally:
        placement.release(group)
