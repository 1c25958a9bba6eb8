"""`resources.accelerator_resource: GPU` on a local Ray: the job's own Ray declares the GPUs as Ray's
built-in resource (num_gpus) and each device worker gets its share of one through its bundle, where
Ray used to refuse the start ("GPU cannot be a custom resource"). This machine has no GPU, so torch
is told it sees two (Ray's GPUs are logical: nothing here touches a device); the workers are
`GpuProbe`s, a test double scheduled exactly as the trainer schedules its workers. The same Ray shows
the job's worker set-up hook: an actor's process starts without cyclic collections, which its
constructor's end turns back on (rldock.runtime.startup)."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
import yaml
from ray import cloudpickle

from rldock.config import parse_job_config
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.workers import cluster

pytestmark = pytest.mark.ray  # starts a Ray cluster of its own (tests/unit/conftest.py)

EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[4] / "examples" / "grpo-tiny.yaml").read_text())


class GpuProbe:
    """Test double of a device worker: the GPU ids Ray assigned it."""

    def gpu_ids(self) -> list[str]:
        return ray.get_runtime_context().get_accelerator_ids()["GPU"]


class CollectorProbe:
    """Test double of any of the job's actors: whether the collector ran while it was built."""

    def __init__(self) -> None:
        self.collecting_while_built = gc.isenabled()

    def collecting(self) -> tuple[bool, bool]:
        return self.collecting_while_built, gc.isenabled()


@pytest.fixture(scope="module")
def gpu_job() -> Iterator:
    cfg = parse_job_config(
        {
            **EXAMPLE,
            "resources": {**EXAMPLE["resources"], "accelerator_resource": "GPU", "devices_per_node": 2},
            "training": {**EXAMPLE["training"], "data_parallel_size": 2},
        }
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ADDRESS", raising=False)
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "device_count", lambda: 2)
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        cluster.connect(cfg)
    yield cfg
    ray.shutdown()
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def test_a_local_ray_declares_the_gpus_and_each_worker_gets_its_share_of_one(gpu_job) -> None:
    assert ray.cluster_resources().get("GPU") == 2
    plan = cluster.job_placement(gpu_job, job_recipe(gpu_job))
    assert plan.accelerator == "GPU" and all(bundle["GPU"] == 1.0 for bundle in plan.bundles)
    group = cluster.reserve(plan, timeout_s=60)
    try:
        seats = [*plan.actors, *plan.group("reference")]
        probes = [cluster.seated(GpuProbe, group=group, plan=plan, seat=seat).remote() for seat in seats]
        ids = ray.get([probe.gpu_ids.remote() for probe in probes])
        # Actor rank i and reference rank i share device i (colocated: half a GPU each).
        assert ids[0] == ids[2] and ids[1] == ids[3] and ids[0] != ids[1] and len(ids[0]) == 1
        assert all(seat.share == 0.5 for seat in seats)
        for probe in probes:
            ray.kill(probe)
    finally:
        cluster.release(group)


def test_an_actor_s_process_starts_without_cyclic_collections_until_it_is_built(gpu_job) -> None:
    probe = cluster.remote(CollectorProbe, num_cpus=0).remote()
    try:
        assert ray.get(probe.collecting.remote()) == (False, True)
    finally:
        ray.kill(probe)
