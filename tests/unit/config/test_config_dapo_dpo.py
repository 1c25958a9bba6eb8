"""DAPO and DPO job configs: the examples are valid, cross-field problems name the field to fix."""

from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, parse_job_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def problem_paths(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    return sorted(p.path for p in caught.value.problems)


def test_examples_are_valid():
    dapo = parse_job_config(_example("dapo-tiny.yaml"))
    assert dapo.algorithm.name == "dapo" and dapo.algorithm.dapo.clip_ratio_high == 0.28
    dpo = parse_job_config(_example("dpo-tiny.yaml"))
    assert dpo.algorithm.name == "dpo" and dpo.algorithm.num_responses_per_prompt == 2


def test_overlong_buffer_must_fit_the_response_length():
    data = _example("dapo-tiny.yaml")
    data["algorithm"]["dapo"]["overlong_buffer_length"] = 7  # max_response_length 6
    assert problem_paths(data) == ["algorithm.dapo.overlong_buffer_length"]


def test_dapo_has_no_kl_by_default_and_a_kl_set_on_purpose_is_a_problem_quoting_the_paper():
    data = _example("dapo-tiny.yaml")
    del data["algorithm"]["kl_coef"]
    assert parse_job_config(data).algorithm.kl_coef == 0.0
    data["algorithm"]["name"] = "grpo"
    data["algorithm"].pop("dapo")
    assert parse_job_config(data).algorithm.kl_coef == 0.04  # every other algorithm keeps 0.04
    data = _example("dapo-tiny.yaml")
    data["algorithm"]["kl_coef"] = 0.04
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    [problem] = caught.value.problems
    assert problem.path == "algorithm.kl_coef"
    assert "the model distribution can diverge significantly from the initial model" in problem.message
    data["algorithm"]["kl_coef"] = 0
    assert parse_job_config(data).algorithm.kl_coef == 0


def test_dapo_knobs_have_bounds():
    data = _example("dapo-tiny.yaml")
    data["algorithm"]["dapo"]["max_sampling_rounds"] = 0
    assert problem_paths(data) == ["algorithm.dapo.max_sampling_rounds"]


def test_dpo_needs_pairs():
    data = _example("dpo-tiny.yaml")
    data["algorithm"]["num_responses_per_prompt"] = 4
    assert problem_paths(data) == ["algorithm.num_responses_per_prompt"]


def test_dpo_pairs_must_split_evenly_over_ranks_and_mini_batches():
    data = _example("dpo-tiny.yaml")
    data["algorithm"]["num_prompts_per_iteration"] = 33  # 66 samples: 33 per rank, but a pair cannot split
    assert problem_paths(data) == ["algorithm.num_prompts_per_iteration"]
    data = _example("dpo-tiny.yaml")
    data["algorithm"]["num_updates_per_iteration"] = 32  # 16 pairs per rank into 32 mini-batches
    assert "algorithm.num_updates_per_iteration" in problem_paths(data)
    data = _example("dpo-tiny.yaml")
    data["training"]["micro_batch_size"] = 7
    assert problem_paths(data) == ["training.micro_batch_size"]


def test_dpo_label_smoothing_bound():
    data = _example("dpo-tiny.yaml")
    data["algorithm"]["dpo"]["label_smoothing"] = 0.5
    assert problem_paths(data) == ["algorithm.dpo.label_smoothing"]
