"""The `data` section: files or a generator (exactly one), DPO's pairs, and what leaving it out means."""

from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, parse_job_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _job(data=None, algorithm="grpo") -> dict:
    job = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    job["algorithm"]["name"] = algorithm
    if algorithm == "dpo":
        job["algorithm"]["num_responses_per_prompt"] = 2
    if data is None:
        job.pop("data")
    else:
        job["data"] = data
    return job


def _problems(job: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(job)
    return [(p.path, p.message) for p in caught.value.problems]


def test_leaving_data_out_means_the_addition_generator_without_a_chat_template():
    data = parse_job_config(_job()).data
    assert data.generator.name == "addition" and data.generator.max_operand == 99
    assert data.chat_template == "none" and data.train_files == []


def test_files_with_the_defaults_are_valid():
    job = _job({"train_files": ["/d/train.parquet"], "val_files": ["/d/test.parquet"]})
    data = parse_job_config({**job, "evaluation": {"interval": 5}}).data
    assert (data.prompt_key, data.answer_key, data.chat_template, data.generator) == ("prompt", "answer", "model", None)


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({}, "neither is set"),
        ({"train_files": ["/d/a.jsonl"], "generator": {"name": "addition"}}, "both are set"),
    ],
)
def test_exactly_one_of_files_and_generator(data, fragment):
    (problem,) = _problems(_job(data))
    assert problem[0] == "data.train_files"
    assert "data.train_files and data.generator" in problem[1] and fragment in problem[1]


def test_generated_data_has_no_val_files_and_pairs_need_both_keys():
    problems = _problems(
        _job({"generator": {"name": "word_problems"}, "val_files": ["/d/v.jsonl"], "chosen_key": "good"})
    )
    assert [path for path, _ in problems] == ["data.val_files", "data.rejected_key"]


def test_dpo_needs_pairs_from_the_addition_generator_or_the_pair_columns():
    assert parse_job_config(_job({"generator": {"name": "addition"}, "chat_template": "none"}, "dpo"))
    assert parse_job_config(_job({"train_files": ["/d/p.jsonl"], "chosen_key": "c", "rejected_key": "r"}, "dpo"))
    (problem,) = _problems(_job({"train_files": ["/d/p.jsonl"]}, "dpo"))
    assert problem[0] == "data.chosen_key" and "addition" in problem[1]


def test_unknown_generators_and_fields_are_refused():
    paths = [path for path, _ in _problems(_job({"generator": {"name": "gsm8k"}}))]
    assert paths == ["data.generator.name"]
    paths = [path for path, _ in _problems(_job({"train_files": ["/d/a.jsonl"], "prompt_column": "q"}))]
    assert paths == ["data.prompt_column"]
