"""Ending a job's actors (rldock.runtime.workers.cluster.end_actors): once it returns, the killed actors'
processes are gone, so the placement group released next, or the driver's exit, never reaches a live
one. Ray ends a process it still finds running there with SIGTERM, which its worker turns into
SystemExit wherever the process is: the traceback a finished job printed now and then (`Exception
ignored in ... weakref_cb`, CI on a47b974)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray import cloudpickle
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rldock.runtime.dock.shared_columns import process_runs
from rldock.runtime.workers import cluster

pytestmark = pytest.mark.ray  # starts a Ray cluster of its own (tests/unit/conftest.py)


@pytest.fixture(scope="module", autouse=True)
def ray_session(start_local_ray) -> Iterator[None]:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with start_local_ray(num_cpus=4):
        yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=1, max_concurrency=2)
class SignalNoter:
    """Notes a SIGTERM in `record` before Ray's own handler runs; `busy` holds a call open, as a worker
    in the middle of a stage is when a failed iteration's workers are killed."""

    def __init__(self, record: str) -> None:
        previous = signal.getsignal(signal.SIGTERM)

        def note(signum, frame):
            Path(record).write_text(f"SIGTERM in {os.getpid()}\n")
            previous(signum, frame)

        signal.signal(signal.SIGTERM, note)

    def pid(self) -> int:
        return os.getpid()

    def busy(self) -> None:
        import time

        time.sleep(600)


def test_ended_actors_are_gone_before_their_placement_group_is_released(tmp_path: Path) -> None:
    for round_ in range(3):  # without the wait, nearly every actor here got its raylet's SIGTERM
        group = ray.util.placement_group([{"CPU": 1}] * 3)
        ray.get(group.ready())
        records = [tmp_path / f"sigterm-{round_}-{i}" for i in range(3)]
        actors = [
            SignalNoter.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote(str(record))
            for i, record in enumerate(records)
        ]
        pids = ray.get([actor.pid.remote() for actor in actors])
        stuck = actors[0].busy.remote()

        assert cluster.end_actors(actors) == []

        assert not any(process_runs(pid) for pid in pids)
        cluster.release(group)
        assert [record.name for record in records if record.exists()] == []
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(stuck)


def test_an_actor_still_running_is_named_after_the_timeout(caplog: pytest.LogCaptureFixture) -> None:
    actor = SignalNoter.remote("/dev/null")
    ray.get(actor.pid.remote())
    with caplog.at_level(logging.WARNING, logger=cluster.__name__):
        running = cluster.wait_ended([actor], timeout_s=0.2)  # never killed
    assert running == [actor._actor_id.hex()]
    assert f"actor {running[0]} still runs" in caplog.text
    assert cluster.end_actors([actor]) == []
