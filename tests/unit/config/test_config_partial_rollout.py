"""Config rules for partial rollout (rollout.partial_rollout, rollout.max_tokens_per_round)."""

from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, parse_job_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture
def partial_data() -> dict:
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["training"]["mode"] = "async"
    data["dock"]["max_staleness"] = 1
    data["algorithm"]["max_response_length"] = 16
    data.setdefault("rollout", {}).update(partial_rollout="resume", max_tokens_per_round=4)
    return data


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    return [p.path for p in caught.value.problems]


def test_off_is_the_default_and_needs_no_budget():
    cfg = parse_job_config(yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text()))
    assert cfg.rollout.partial_rollout == "off" and cfg.rollout.max_tokens_per_round is None


@pytest.mark.parametrize("mode", ["resume", "drop"])
def test_async_running_ahead_with_a_budget_is_valid(partial_data, mode):
    partial_data["rollout"]["partial_rollout"] = mode
    cfg = parse_job_config(partial_data)
    assert (cfg.rollout.partial_rollout, cfg.rollout.max_tokens_per_round) == (mode, 4)


@pytest.mark.parametrize(
    "change, path",
    [
        # no weight update ever interrupts a generation: sync, or async that never runs ahead
        ({"training": {"mode": "sync"}}, "rollout.partial_rollout"),
        ({"dock": {"max_staleness": 0}}, "rollout.partial_rollout"),
        ({"rollout": {"max_tokens_per_round": None}}, "rollout.max_tokens_per_round"),
        # a budget at or past the response limit cuts nothing
        ({"rollout": {"max_tokens_per_round": 16}}, "rollout.max_tokens_per_round"),
    ],
)
def test_what_partial_rollout_cannot_run_is_named(partial_data, change, path):
    for section, values in change.items():
        partial_data[section].update(values)
    assert path in problems(partial_data)


def test_partial_rollout_refuses_dpo(partial_data):
    partial_data["algorithm"]["name"] = "dpo"  # async running ahead, so only the missing rollout is named
    with pytest.raises(ConfigError) as caught:
        parse_job_config(partial_data)
    named = [p.message for p in caught.value.problems if p.path == "rollout.partial_rollout"]
    assert len(named) == 1 and "generates nothing" in named[0]


def test_the_budget_is_bounded(partial_data):
    partial_data["rollout"]["max_tokens_per_round"] = 0
    assert "rollout.max_tokens_per_round" in problems(partial_data)
