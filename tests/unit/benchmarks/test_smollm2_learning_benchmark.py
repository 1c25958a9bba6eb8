"""The SmolLM2 learning benchmark without running jobs: its overrides make the example a valid job
that evaluates only at the start and the end, the data it prepares is the example header's, and
the summary reads gains, margin and throughput from metrics records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rldock.config.loading import load_job_config
from rldock_benchmarks.smollm2_learning import DATA_ARGS, EXAMPLE, compare, job_overrides, summarise

DATA = {"train": ["/d/train.jsonl"], "val": ["/d/val.jsonl"]}


def _parsed(overrides: list[str]) -> dict:
    return {
        key: json.loads(value) if value.startswith("[") else value
        for key, value in (o.split("=", 1) for o in overrides)
    }


def test_overrides_point_the_example_at_the_prepared_model_and_data():
    overrides = _parsed(job_overrides(Path("/m/smol"), DATA, iterations=3))
    cfg = load_job_config(
        EXAMPLE,
        overrides={**overrides, "iterations": 3, "evaluation.interval": 3, "checkpoint.interval": 3},
        check_local=False,
    )
    assert cfg.model.path == "/m/smol" and cfg.data.train_files == DATA["train"] and cfg.data.val_files == DATA["val"]
    assert overrides["iterations"] == overrides["evaluation.interval"] == "3"
    example = load_job_config(EXAMPLE, check_local=False)
    assert example.evaluation.interval == example.iterations and example.evaluation.at_start
    assert example.training.freeze_embeddings and example.algorithm.kl_coef == 0
    assert "iterations" not in _parsed(job_overrides(Path("/m"), DATA, iterations=None))


def test_the_benchmark_prepares_the_data_the_example_header_documents():
    header = " ".join(
        line.lstrip("#").strip().rstrip("\\").strip()
        for line in EXAMPLE.read_text().splitlines()
        if line.startswith("#")
    )
    assert f"rldock data generate {' '.join(DATA_ARGS)}" in header


def _record(iteration: int, reward: float, accuracy: float | None = None) -> dict:
    record = {"iteration": iteration}
    if iteration:
        record |= {
            "reward_mean": reward,
            "tokens_per_s_per_device": 10.0,
            "timing": {"iteration": 4.0, "rollout": 1.0, "update": 3.0, "idle/update": 0.5},
        }
    if accuracy is not None:
        record |= {"val/accuracy": accuracy, "val/reward": accuracy + 0.1, "val/num_prompts": 100, "val/seconds": 2.0}
    return record


def test_summary_reads_start_and_end_evaluations_and_the_margin():
    trained = summarise([_record(0, 0, 0.4), _record(1, 0.2), _record(2, 0.5, 0.6)], seconds=30.0)
    assert trained["val_accuracy_gain"] == pytest.approx(0.2) and trained["val_reward_gain"] == pytest.approx(0.2)
    assert (trained["train_reward_first"], trained["train_reward_last"], trained["iterations"]) == (0.2, 0.5, 2)
    assert trained["tokens_per_s"] == 10.0 and trained["evaluation_seconds"] == 4.0
    assert trained["stage_seconds_mean"] == {"iteration": 4.0, "rollout": 1.0, "update": 3.0}
    control = summarise([_record(0, 0, 0.4), _record(1, 0.2), _record(2, 0.2, 0.45)], seconds=30.0)
    assert compare(trained, control)["accuracy_margin"] == pytest.approx(0.15)
    with pytest.raises(ValueError, match="evaluation at iteration 0"):
        summarise([_record(1, 0.2, 0.5), _record(2, 0.2, 0.5)], seconds=1.0)
