"""A job with a model of the user's must say where its prompts and rewards come from; rules that
only protect a long run are warnings that say what to set."""

import pytest
from job_examples import example, problem_paths

from rldock.config import find_warnings, parse_job_config


def _own_model(**sections) -> dict:
    data = example()
    data["model"] = {"path": "/models/SmolLM2-135M-Instruct"}
    del data["data"], data["reward"]
    data.update(sections)
    return data


DATA = {"train_files": ["/data/train.parquet"], "prompt_key": "question", "chat_template": "model"}
REWARD = {"terms": [{"name": "math_verify"}]}


@pytest.mark.parametrize(
    "sections, missing",
    [
        ({}, ["data", "reward"]),
        ({"data": DATA}, ["reward"]),
        ({"reward": REWARD}, ["data"]),
    ],
)
def test_a_real_model_without_data_or_reward_is_refused_naming_the_section(sections, missing):
    assert problem_paths(_own_model(**sections)) == missing


def test_the_messages_say_what_would_happen_and_what_to_set():
    from rldock.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        parse_job_config(_own_model())
    data, reward = caught.value.problems
    assert "addition prompts" in data.message and "set data.train_files" in data.message
    assert "digit_match" in reward.message and "set reward.terms" in reward.message


def test_a_real_model_with_both_sections_is_valid():
    assert parse_job_config(_own_model(data=DATA, reward=REWARD)).data.train_files == ["/data/train.parquet"]


def test_a_model_the_runtime_builds_keeps_the_demo_defaults():
    data = example()
    del data["data"], data["reward"]
    cfg = parse_job_config(data)  # the builder's tiny model: the demo's task is the point
    assert cfg.data.generator.name == "addition" and cfg.reward.terms[0].name == "digit_match"


def test_a_checkpoint_interval_past_the_last_iteration_is_a_warning_saying_what_to_set():
    data = example()
    data["iterations"] = 2
    cfg = parse_job_config(data)  # accepted: the run works, a crash just loses more
    (warning,) = find_warnings(cfg)
    assert warning.path == "checkpoint.interval"
    assert warning.message.endswith("set checkpoint.interval <= 2")
    data["checkpoint"]["interval"] = 2
    assert find_warnings(parse_job_config(data)) == []
