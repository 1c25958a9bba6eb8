"""TensorBoard event files: every numeric metric becomes a scalar, read back with TensorBoard's
own EventAccumulator, and a resumed attempt's redone steps replace the earlier attempt's."""

from __future__ import annotations

import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rldock.runtime.driver.tracking import TensorBoardLog, scalars


def _read(logdir) -> EventAccumulator:
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    accumulator.Reload()
    return accumulator


def _steps(accumulator: EventAccumulator, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in accumulator.Scalars(tag)}


def test_scalars_flatten_nested_metrics_and_skip_what_is_not_a_number():
    record = {
        "iteration": 3,
        "reward_mean": 0.5,
        "timing": {"rollout": 1.5, "dispatch": 0.25},
        "dock": {"warehouses": [{"bytes_in": 10}], "controllers": {"reward": {"requests": 4}}},
        "val/addition/reward": 0.75,
        "flag": True,
        "name": "x",
        "bad": math.nan,
    }
    assert dict(scalars(record)) == {
        "reward_mean": 0.5,
        "timing/rollout": 1.5,
        "timing/dispatch": 0.25,
        "dock/controllers/reward/requests": 4.0,
        "val/addition/reward": 0.75,
    }


def test_event_file_holds_one_scalar_per_metric_per_iteration(tmp_path):
    log = TensorBoardLog(tmp_path, first_step=0)
    log.append({"iteration": 0, "val/reward": 0.1})
    log.append({"iteration": 1, "reward_mean": 0.3, "timing": {"rollout": 2.0}})
    log.append({"iteration": 2, "reward_mean": 0.4, "timing": {"rollout": 1.0}, "val/reward": 0.2})
    # flushed each iteration: readable before close, as from a run still going (or killed)
    accumulator = _read(tmp_path)
    assert set(accumulator.Tags()["scalars"]) == {"val/reward", "reward_mean", "timing/rollout"}
    assert _steps(accumulator, "reward_mean") == pytest.approx({1: 0.3, 2: 0.4})
    assert _steps(accumulator, "val/reward") == pytest.approx({0: 0.1, 2: 0.2})
    log.close()


def test_resumed_attempt_appends_and_its_redone_steps_replace_the_old_ones(tmp_path):
    first = TensorBoardLog(tmp_path, first_step=0)
    for iteration in (1, 2, 3):  # checkpoint after 2; 3 is logged, then the process dies
        first.append({"iteration": iteration, "reward_mean": iteration / 10})
    first.close()
    resumed = TensorBoardLog(tmp_path, first_step=3)  # redoes 3, then goes on
    for iteration in (3, 4):
        resumed.append({"iteration": iteration, "reward_mean": iteration / 10 + 0.5})
    resumed.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2  # one file per attempt, one run
    events = [(e.step, e.value) for e in _read(tmp_path).Scalars("reward_mean")]
    assert [step for step, _ in events] == [1, 2, 3, 4]  # step 3 once: the first attempt's is purged
    assert [value for _, value in events] == pytest.approx([0.1, 0.2, 0.8, 0.9])
