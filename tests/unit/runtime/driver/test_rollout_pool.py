"""The driver's rollout pool (driver/rollout_pool.py) on a real local Ray and a real dock, its engines a double
of the pool's engine worker (vLLM is what the integration tier's pool job runs): the newest version is handed
to every engine before its rollout, and an engine that dies holding groups costs that engine only (its groups go
back to the dock, the other generates them, a replacement starts on the device it freed)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import ray
import torch
from ray import cloudpickle
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.config.job import DockSpec
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult, run_stage
from rldock.runtime.driver import rollout_pool
from rldock.runtime.driver.rollout_pool import RolloutPool
from rldock.runtime.driver.schedule.stages import gather_failing_fast
from rldock.runtime.engines.rank_engine import PublishedWeights, engine_batch_size
from rldock.runtime.flow.states import StageCall, WorkerContext
from rldock.runtime.workers.pool_engine import pool_rank

G, N, SL = 4, 2, 3
STATES = {"rollout": ["prompt_ids"], "check": ["response_ids"]}  # the rollout, and a state reading its output


@dataclass(frozen=True)
class _Spec:
    name: str
    consumes: tuple[str, ...]


class _Recipe:
    """What the pool and its engines read of the job's recipe: the rollout's spec and what it writes."""

    produces = {"rollout": ("response_ids",)}

    def spec(self, name: str) -> _Spec:
        return _Spec(name, tuple(STATES[name]))


class EngineDouble:
    """PoolEngineWorker's shape without vLLM: its rollout takes whole groups and writes `response_ids` (the
    version it holds in every token). Engine 0 dies holding its first batch; the others wait for that."""

    def __init__(self, cfg, *, recipe, index, num_actor_ranks, policy_dir, banks, policy_version, environment_urls):
        self.cfg, self.recipe, self.index, self.banks = cfg, recipe, index, banks
        self.rank = pool_rank(index, num_actor_ranks=num_actor_ranks)
        self.version = policy_version

    def load_weights(self, published: PublishedWeights) -> float:
        self.version = published.version
        return 0.0

    def generate(self, call: StageCall, *, version: int | None = None, batch_size: int | None = None) -> StageResult:
        assert version in (None, self.version), (version, self.version)
        assert batch_size is not None  # over the engines up now
        bank = self.banks.bank(call.iteration)
        if self.index != 0:  # wait for the state: engine 0 took its batch (a cumulative count: it may be dead since)
            while bank.stats()["controllers"]["rollout"]["samples_handed_out"] == 0:
                time.sleep(0.01)

        def rollout(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            if self.index == 0:
                os._exit(1)  # dies holding `indices`
            return TensorDict({"response_ids": torch.full((len(indices), SL), self.version)}, batch_size=[len(indices)])

        result = run_stage(
            bank, self.recipe.spec("rollout"), rollout, rank=self.rank, batch_size=batch_size, whole_groups=True
        )
        return result.with_metrics(pool_samples={f"engine{self.index}": result.num_samples})


@ray.remote
class PublisherDouble:
    """Actor rank 0's `published_weights`: version 7."""

    def published_weights(self) -> PublishedWeights:
        return PublishedWeights(version=7, weights={}, copy_s=0.0)


@pytest.fixture(scope="module")
def ray_session(start_local_ray) -> Iterator[None]:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the doubles, shipped to Ray's workers by value
    with start_local_ray(num_cpus=8, resources={"NPU": 3}):
        yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def pool_job(*, replicas: int) -> JobConfig:
    return JobConfig.model_validate(
        {
            "iterations": 2,
            "model": {"path": "unused"},
            "algorithm": {
                "name": "grpo",
                "num_prompts_per_iteration": G,
                "num_responses_per_prompt": N,
                "max_prompt_length": 2,
                "max_response_length": SL,
                "learning_rate": 1e-4,
            },
            "rollout": {"pool": {"replicas": replicas, "actors_generate": False}},
        }
    )


def context_of(cfg: JobConfig, bank: TransferDock) -> WorkerContext:
    return WorkerContext(
        cfg=cfg,
        recipe=_Recipe(),
        banks=DockBanks([bank]),
        policy_dir="unused",
        reference_dir="unused",
        adapter_dir=None,
        policy_version=6,
    )


@contextlib.contextmanager
def pool_on_a_dock(cfg: JobConfig) -> Iterator[tuple[TransferDock, RolloutPool]]:
    """A dock of one iteration's prompts and a started pool of `cfg`'s engines (doubles) on it; ended after."""
    bank = TransferDock.create(DockSpec(timeout_s=30), states=STATES, num_samples=G * N, group_size=N)
    pool = None
    try:
        bank.put(torch.arange(G * N), TensorDict({"prompt_ids": torch.zeros(G * N, 2)}, batch_size=[G * N]))
        pool = RolloutPool(cfg, context_of(cfg, bank), num_actor_ranks=2, publisher=PublisherDouble.remote())
        pool.wait_up()
        yield bank, pool
    finally:
        if pool is not None:
            pool.kill()
        bank.shutdown()


def test_the_last_engine_lost_waits_for_another_and_its_groups_are_generated_there(ray_session, monkeypatch):
    """A pool of one whose engine dies holding its batch: no survivor, so the driver starts an engine on the freed
    device, waits for it to be up and runs the call there (the attempt goes on)."""
    monkeypatch.setattr(rollout_pool, "PoolEngineWorker", EngineDouble)
    monkeypatch.setattr(rollout_pool, "WATCH_INTERVAL_S", 3600)
    with pool_on_a_dock(pool_job(replicas=1)) as (bank, pool):
        results = gather_failing_fast({"rollout": pool.launch_rollout(StageCall(1))}, recover=pool.recover)["rollout"]
        assert [r.metrics["pool_samples"] for r in results] == [{"engine1": G * N}]
        indices, _ = bank.get("check", ["response_ids"], batch_size=G * N)
        assert indices.tolist() == list(range(G * N))
        assert pool.lost == 1 and sorted(pool.engines) == [1]


@pytest.mark.parametrize("watch", ["at the next rollout", "by the watch"])
def test_a_dead_engines_groups_are_generated_by_the_other_and_a_replacement_starts(ray_session, monkeypatch, watch):
    """The replacement starts at the next rollout's launch or, before it, from the pool's watch (its own thread:
    a device that appears is taken at once, not at an iteration's pace)."""
    monkeypatch.setattr(rollout_pool, "PoolEngineWorker", EngineDouble)
    monkeypatch.setattr(rollout_pool, "WATCH_INTERVAL_S", 0.05 if watch == "by the watch" else 3600)
    cfg = pool_job(replicas=2)
    assert engine_batch_size(cfg, num_actor_ranks=2) == G * N // 2  # the pool alone: half each
    assert engine_batch_size(cfg, num_actor_ranks=2, pool_engines=1) == G * N  # one up: all of it a request
    with pool_on_a_dock(cfg) as (bank, pool):
        assert sorted(pool.engines) == [0, 1]
        pool.update_launched()  # an update made version 7: the next rollout's engines load it first
        pool.publish()
        results = gather_failing_fast({"rollout": pool.launch_rollout(StageCall(1))}, recover=pool.recover)["rollout"]
        # Engine 1's own call and the one that replaced engine 0's: every sample written once, by version 7.
        assert [r.metrics["pool_samples"] for r in results] == [{"engine1": 4}, {"engine1": 4}]
        assert sum(r.num_samples for r in results) == G * N
        indices, written = bank.get("check", ["response_ids"], batch_size=G * N)
        assert indices.tolist() == list(range(G * N)) and bool((written["response_ids"] == 7).all())
        assert pool.lost == 1 and sorted(pool.engines) == [1]
        if watch == "by the watch":  # no rollout launched: the watch starts one on the freed device
            deadline = time.monotonic() + 60
            while 2 not in pool.starting and 2 not in pool.engines:
                assert time.monotonic() < deadline, "the watch started no replacement"
                time.sleep(0.05)
        else:  # the next rollout starts a replacement on the freed device; it generates once it is up
            pool.launch_rollout(StageCall(2))
            assert list(pool.starting) == [2]


def test_an_engine_whose_load_failed_refuses_to_generate_with_older_weights():
    """PoolEngineWorker.generate with the version the driver expects after its newest publish: an engine still at
    an older one (its load failed) raises, naming both, before it takes any group from the dock."""
    from rldock.runtime.workers.pool_engine import PoolEngineWorker

    engine = PoolEngineWorker.__new__(PoolEngineWorker)  # no vLLM: the check comes first
    engine.index, engine.policy_version = 1, 4
    with pytest.raises(RuntimeError, match="rollout pool engine 1 holds policy version 4, not 5"):
        engine.generate(StageCall(6), version=5)
