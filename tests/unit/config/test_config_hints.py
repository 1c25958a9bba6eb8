"""A mistyped field name gets the field it was probably meant to be, without the "required field is
missing" of that same field; a wrong value for a field of fixed choices lists them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, parse_job_config

EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[3] / "examples" / "grpo-tiny.yaml").read_text())


def _problems(job: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(job)
    return [str(problem) for problem in caught.value.problems]


def test_a_misspelt_required_field_is_one_did_you_mean_and_no_missing_field():
    job = {**EXAMPLE, "iteratons": EXAMPLE["iterations"]}
    del job["iterations"]
    assert _problems(job) == ["iteratons: unknown field (did you mean iterations? see docs/config-reference.md)"]


@pytest.mark.parametrize(
    "section, typo, meant",
    [
        ("algorithm", "learnig_rate", "learning_rate"),
        ("resources", "devise", "device"),
        ("rollout", "temprature", "temperature"),
    ],
)
def test_a_misspelt_field_in_a_section_names_the_sections_field(section, typo, meant):
    job = {**EXAMPLE, section: {**EXAMPLE.get(section, {}), typo: 1}}
    assert f"{section}.{typo}: unknown field (did you mean {meant}? see docs/config-reference.md)" in _problems(job)


def test_an_unknown_field_like_no_field_gets_no_guess():
    (problem,) = _problems({**EXAMPLE, "zzzz": 1})
    assert problem == "zzzz: unknown field (check spelling; see docs/config-reference.md)"


def test_a_required_field_that_is_just_missing_is_still_reported():
    job = dict(EXAMPLE)
    del job["iterations"]
    assert _problems(job) == ["iterations: required field is missing"]


def test_a_word_for_a_list_of_choices_lists_them_and_shows_the_list():
    (problem,) = _problems({**EXAMPLE, "tracking": "wandb"})
    assert problem == (
        "tracking: Input should be a valid list (got 'wandb'); give a list of: tensorboard, wandb "
        "(e.g. [wandb]; on the command line --set tracking=[wandb])"
    )


@pytest.mark.parametrize(
    "section, field, value, listed",
    [
        ("resources", "device", "gpu", "'auto', 'npu', 'cuda' or 'cpu'"),
        ("algorithm", "kl_estimator", "k2", "'k1' or 'k3'"),
    ],
)
def test_a_wrong_choice_lists_the_allowed_values(section, field, value, listed):
    job = {**EXAMPLE, section: {**EXAMPLE[section], field: value}}
    assert f"{section}.{field}: Input should be {listed} (got {value!r})" in _problems(job)
