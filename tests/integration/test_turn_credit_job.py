"""Crediting turns end to end (docs/algorithms/turn-credit.md, ppo.md#multi-turn-episodes): the tiny
model's episodes against openenv-core's guess-the-number game, which rewards each step, through
`rldock train` and the dock, 2 iterations each: PPO with its GAE by turn and rewards per turn, and GRPO
crediting turns. Every state, the critic's included, takes every sample once; the losses stay finite."""

from __future__ import annotations

import json
import math

import pytest
from test_environment_job import ITERATIONS, _config, _train, openenv_guess_server

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("name", "algorithm"),
    [
        ("ppo", {"gae_unit": "turn", "credit": "turn", "ppo": {"gamma": 0.9}}),
        ("grpo", {"credit": "turn", "turn_discount": 0.9}),
    ],
)
def test_a_job_credits_the_turns_of_episodes_rewarded_per_step(tmp_path, name, algorithm):
    with openenv_guess_server(sessions=4, highest=10) as url:
        config = _config(tmp_path, url)
        config["algorithm"].update(name=name, **algorithm)
        config["resources"] = {"device": "cpu", "devices_per_node": 2}  # PPO's critic takes a device of its own
        run = _train(tmp_path, config)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    for record in records:
        controllers = record["dock"]["controllers"]
        assert "advantage" in controllers  # the turns come from the rollout: no advantage in the reward state
        for state, counters in controllers.items():
            assert counters["samples_handed_out"] == 16, state
        assert record["agent"]["environment/steps"] >= 16
        assert math.isfinite(record["loss"]) and math.isfinite(record["policy_loss"])
        if name == "ppo":
            assert math.isfinite(record["value_loss"]) and record["value_loss"] >= 0
