"""The evaluation section: off by default, its bounds, and the cross-field rules naming the fields."""

from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, parse_job_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture
def demo_data() -> dict:
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["data"]["generator"]["num_val_prompts"] = 64  # held-out prompts to evaluate on
    return data


def _problems(data: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    return {p.path: p.message for p in caught.value.problems}


def test_evaluation_is_off_by_default_and_greedy_once_enabled(demo_data):
    evaluation = parse_job_config(demo_data).evaluation
    assert evaluation.interval == 0
    demo_data["evaluation"] = {"interval": 5}
    evaluation = parse_job_config(demo_data).evaluation
    assert (
        evaluation.at_start,
        evaluation.greedy,
        evaluation.num_samples,
        evaluation.max_prompts,
        evaluation.correct_threshold,
    ) == (True, True, 1, None, 1.0)


@pytest.mark.parametrize("field, value", [("interval", -1), ("max_prompts", 0), ("num_samples", 0)])
def test_out_of_bounds_values_name_the_field(demo_data, field, value):
    demo_data["evaluation"] = {field: value}
    assert list(_problems(demo_data)) == [f"evaluation.{field}"]


def test_greedy_with_several_samples_names_both_fields(demo_data):
    demo_data["evaluation"] = {"interval": 2, "num_samples": 4}
    message = _problems(demo_data)["evaluation.num_samples"]
    assert "evaluation.greedy" in message and "evaluation.num_samples to 1" in message
    demo_data["evaluation"]["greedy"] = False
    assert parse_job_config(demo_data).evaluation.num_samples == 4


def test_an_algorithm_without_rollout_cannot_evaluate(demo_data):
    demo_data["algorithm"].update(name="dpo", num_responses_per_prompt=2)
    demo_data["evaluation"] = {"interval": 2}
    assert "no rollout engine" in _problems(demo_data)["evaluation.interval"]
    demo_data["evaluation"] = {"interval": 0}
    assert parse_job_config(demo_data).evaluation.interval == 0


def test_evaluation_needs_held_out_prompts(demo_data):
    demo_data["data"]["generator"]["num_val_prompts"] = 0
    demo_data["evaluation"] = {"interval": 2}
    message = _problems(demo_data)["evaluation.interval"]
    assert "data.val_files" in message and "data.generator.num_val_prompts" in message


def test_held_out_files_with_evaluation_off_are_refused_naming_both_fields():
    job = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    job["model"].pop("builder")
    job["data"] = {"train_files": ["/d/train.jsonl"], "val_files": ["/d/val.jsonl"]}
    with pytest.raises(ConfigError) as caught:
        parse_job_config(job)
    (problem,) = caught.value.problems
    assert problem.path == "evaluation.interval"
    assert "data.val_files lists 1 held-out file(s), but evaluation.interval is 0" in problem.message
    assert "set evaluation.interval" in problem.message and "or remove data.val_files" in problem.message
    assert parse_job_config({**job, "evaluation": {"interval": 20}}).evaluation.interval == 20
