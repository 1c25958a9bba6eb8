"""The job's placement group on a two-node local Ray (ray.cluster_utils.Cluster, one machine), each
node with two emulated NPUs: which worker lands on which node, bundle and device.

The workers here are `PlacementProbe`s (a test double: the real ActorWorker loads a model and a
vLLM engine, which would take minutes on this machine), scheduled exactly as the trainer schedules
its workers, through rldock.runtime.workers.cluster."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import yaml
from ray import cloudpickle
from ray.cluster_utils import Cluster

from rldock.config import parse_job_config
from rldock.contract.placement import plan_placement
from rldock.runtime.engines.replica_devices import RankDevice, engine_environments, seat_of_this_actor
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.workers import cluster as placement

pytestmark = pytest.mark.ray  # starts a Ray cluster of its own (tests/unit/conftest.py)

EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[4] / "examples" / "grpo-tiny.yaml").read_text())
NPUS_PER_NODE = 2


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Cluster]:
    node = {"num_cpus": 4, "resources": {"NPU": NPUS_PER_NODE}}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    cluster.wait_for_nodes()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class PlacementProbe:
    """Test double of a device worker: reports where Ray put it."""

    def where(self) -> tuple[str, str, str]:
        """(node id, device id, placement group id) of this actor."""
        context = ray.get_runtime_context()
        (device,) = context.get_accelerator_ids()["NPU"]
        return context.get_node_id(), device, context.get_placement_group_id()

    def seat(self) -> RankDevice:
        """What ActorWorker.device_seat reports (the product's function, run in this actor)."""
        return seat_of_this_actor(accelerator_resource="NPU", device_kind="npu")


def _job(**overrides):
    data = {
        **EXAMPLE,
        "algorithm": {**EXAMPLE["algorithm"], **overrides.pop("algorithm", {})},
        "resources": {
            **EXAMPLE["resources"],
            "num_nodes": 2,
            "devices_per_node": NPUS_PER_NODE,
            **overrides.pop("resources", {}),
        },
        "training": {**EXAMPLE["training"], **overrides.pop("training", {})},
        **overrides,
    }
    return parse_job_config(data)


def _place(cfg, seats_out: dict[str, RankDevice] | None = None) -> dict[str, tuple[str, str]]:
    """Seat a probe for every device worker of `cfg`'s plan; (node, device) of each by worker name,
    after checking that each landed in the job's placement group on its bundle's node. `seats_out`
    collects what each probe's `seat` reports."""
    plan = placement.job_placement(cfg, job_recipe(cfg))
    group = placement.reserve(plan, timeout_s=60)
    try:
        seats = {
            **{f"actor {i}": s for i, s in enumerate(plan.actors)},
            **{f"reference {i}": s for i, s in enumerate(plan.group("reference"))},
            **{f"critic {i}": s for i, s in enumerate(plan.group("critic"))},
        }
        probes = {
            name: placement.seated(PlacementProbe, group=group, plan=plan, seat=seat).remote()
            for name, seat in seats.items()
        }
        placed = dict(zip(probes, ray.get([p.where.remote() for p in probes.values()])))
        if seats_out is not None:
            seats_out.update(zip(probes, ray.get([p.seat.remote() for p in probes.values()])))
        bundle_nodes = ray.util.placement_group_table(group)["bundles_to_node_id"]
        for name, (node, _, group_id) in placed.items():
            assert group_id == group.id.hex() and node == bundle_nodes[seats[name].bundle], name
        for probe in probes.values():
            ray.kill(probe)
        return {name: (node, device) for name, (node, device, _) in placed.items()}
    finally:
        placement.release(group)


def test_tensor_parallel_ranks_get_distinct_devices_and_references_share_them(two_nodes: Cluster) -> None:
    # DP 2 x TP 2 = 4 actor ranks on the 4 NPUs of two nodes; a reference rank beside each of the
    # first two; the two critic ranks (PPO, one per DP rank) take the halves left on the other two.
    cfg = _job(training={"data_parallel_size": 2, "tensor_parallel_size": 2}, algorithm={"name": "ppo"})
    placed = _place(cfg)
    actors = [placed[f"actor {i}"] for i in range(4)]
    assert len(set(actors)) == 4  # one actor (one generation engine) per device
    assert Counter(node for node, _ in actors) == Counter({node["NodeID"]: 2 for node in ray.nodes()})
    assert placed["reference 0"] == placed["actor 0"] and placed["reference 1"] == placed["actor 1"]
    assert placed["critic 0"] == placed["actor 2"] and placed["critic 1"] == placed["actor 3"]


def test_separate_placement_gives_references_their_own_devices(two_nodes: Cluster) -> None:
    cfg = _job(training={"data_parallel_size": 2}, resources={"placement": "separate"})
    placed = _place(cfg)
    assert len(set(placed.values())) == 4  # actor 0, actor 1, reference 0, reference 1: a device each


def test_a_plan_the_cluster_cannot_hold_fails_naming_the_fields(two_nodes: Cluster) -> None:
    plan = plan_placement(accelerator="NPU", num_actor_ranks=5, mode="colocated")
    with pytest.raises(placement.PlacementTimeout, match=r"reserve 5 devices .* the cluster has 4 NPU"):
        placement.reserve(plan, timeout_s=3)


def test_each_generation_tp_engine_spans_distinct_devices_of_one_node(two_nodes: Cluster) -> None:
    # 4 actor ranks in generation replicas of 2 (rollout.tensor_parallel_size 2): two engines, each
    # on its replica's first rank, its TP workers' devices being its two ranks' devices.
    cfg = _job(training={"data_parallel_size": 4}, rollout={"tensor_parallel_size": 2})
    plan = placement.job_placement(cfg, job_recipe(cfg))
    engines = plan.engine_devices(cfg.rollout.tensor_parallel_size)
    assert engines == ((0, 1), (2, 3))
    seats: dict[str, RankDevice] = {}
    placed = _place(cfg, seats)
    for bundles in engines:
        devices = [placed[f"actor {b}"] for b in bundles]
        assert len(set(devices)) == len(bundles)  # TP peers on distinct devices
        assert len({node for node, _ in devices}) == 1  # one engine's workers on one node
    # What the trainer hands each engine rank: its replica's Ray devices, its own first.
    ranks = [seats[f"actor {r}"] for r in range(4)]
    assert [(s.node_id, s.device_ids) for s in ranks] == [
        (node, (device,)) for node, device in (placed[f"actor {r}"] for r in range(4))
    ]
    envs = engine_environments(ranks, generation_tp=2)
    assert envs == {
        first: {"ASCEND_RT_VISIBLE_DEVICES": f"{placed[f'actor {first}'][1]},{placed[f'actor {first + 1}'][1]}"}
        for first in (0, 2)
    }
