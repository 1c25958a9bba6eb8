"""A real job with held-out evaluation: local Ray, two actor ranks with vLLM engines.

The learning rate is 0, so every evaluation sees the same weights (pushed into the engines again
after each update): greedy evaluation must then give the same val/ metrics at the start, at the
interval and at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import jobs  # tests/jobs.py
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rldock.contract.progress import PREFIX, last_progress

pytestmark = pytest.mark.integration

ITERATIONS, INTERVAL, PROMPTS = 3, 2, 12


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("evaluation")
    config = {
        "name": "it-evaluation",
        "seed": 3,
        "iterations": ITERATIONS,
        "model": {"path": str(root / "model"), "builder": "tiny-qwen2"},
        "data": {
            "generator": {"name": "addition", "max_operand": 5, "num_prompts": 200, "num_val_prompts": 64},
            "chat_template": "none",
        },
        "warmup": {"steps": 20, "batch_size": 32},
        "algorithm": {
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "learning_rate": 0.0,
        },
        "training": {"data_parallel_size": 2, "micro_batch_size": 8},
        "dock": {"timeout_s": 120},
        "checkpoint": {"interval": 2},
        "evaluation": {"interval": INTERVAL, "max_prompts": PROMPTS},
    }
    output = root / "run"
    return output, jobs.run(config, output, max_restarts=None).stdout


def test_val_metrics_at_start_interval_and_end(evaluated_run):
    output, _ = evaluated_run
    records = jobs.records(output)
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    evaluated = [r for r in records if "val/reward" in r]
    assert [r["iteration"] for r in evaluated] == [0, INTERVAL, ITERATIONS]
    assert set(records[0]) == {"iteration"} | {k for k in records[0] if k.startswith("val/")}
    for record in evaluated:
        assert record["val/num_prompts"] == PROMPTS
        assert 0 <= record["val/accuracy"] <= 1 and 0 <= record["val/addition/reward"] <= 1
        assert record["val/addition/accuracy"] == record["val/accuracy"]  # one data source
        assert 1 <= record["val/response_length"] <= 6


def test_greedy_evaluation_of_the_same_weights_is_deterministic(evaluated_run):
    output, _ = evaluated_run
    evaluated = [r for r in jobs.records(output) if "val/reward" in r]
    keys = [k for k in evaluated[0] if k.startswith("val/") and k != "val/seconds"]
    assert all({k: r[k] for k in keys} == {k: evaluated[0][k] for k in keys} for r in evaluated)


def test_progress_lines_carry_the_last_evaluation(evaluated_run):
    _, log = evaluated_run
    lines = [json.loads(line[len(PREFIX) :]) for line in log.splitlines() if line.startswith(PREFIX)]
    assert [(p["iteration"], p["val_iteration"]) for p in lines] == [(1, 0), (2, 2), (3, 3)]


def test_tensorboard_events_beside_the_metrics(evaluated_run):
    output, _ = evaluated_run
    assert list(output.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(output), size_guidance={"scalars": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"reward_mean", "kl", "timing/rollout", "val/reward", "val/addition/accuracy"} <= set(scalars)
    assert [e.step for e in events.Scalars("val/reward")] == [0, INTERVAL, ITERATIONS]
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3]
    assert (output / "progress.png").stat().st_size > 0


def test_resuming_the_finished_run_reports_its_last_evaluation(evaluated_run):
    output, _ = evaluated_run
    before = (output / "metrics.jsonl").read_text()
    again = jobs.run(output.parent / "job.yaml", output, resume=True, max_restarts=None, timeout_s=300)
    assert (output / "metrics.jsonl").read_text() == before
    progress = last_progress(again.stdout.splitlines())
    assert (progress["iteration"], progress["val_iteration"]) == (ITERATIONS, ITERATIONS)
