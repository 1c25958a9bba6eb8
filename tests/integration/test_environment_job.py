"""rldock trains against an environment written with openenv-core's own server classes: the tiny model's
episodes are sessions of openenv-core's guess-the-number game (tests/unit/runtime/agent/openenv_servers.py),
each reset with its own seed, stepped with every turn, rewarded per step by the game, closed at the end,
through `rldock train` and the dock, with an `environment` reward term. Then one short job, from the first
job's warmed-up model, against a hostile server (openenv_servers.hostile_server) whose sessions answer their
steps wrongly in turn: the job finishes, the wrong answers are counted as their episodes' ends, and every
reward it wrote is finite."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from guess_game_job import ITERATIONS, MAX_TURNS, from_warmed_model, hostile_server, job_config, train

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(guess_game_run) -> Path:
    return guess_game_run


def test_every_episode_is_a_session_of_the_openenv_core_environment(run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    for record in records:
        environment = {
            key.removeprefix("environment/"): v for key, v in record["agent"].items() if "environment/" in key
        }
        assert environment["resets"] == 16  # one session per episode, 16 episodes an iteration
        assert 16 <= environment["steps"] <= 16 * MAX_TURNS
        assert environment["errors"] == 0 and environment["sessions_open"] == 0
        assert 1 <= environment["sessions_open_max"] <= 4  # the one replica's 4 sessions, never more
        assert environment["step_p50_s"] <= environment["step_p95_s"]
        # The game's per-step rewards are 0 or 1; the episode's reward is their sum, at most one 1 (done).
        assert 0 <= environment["reward/turn_1"] <= 1
        assert 0 <= record["reward/environment"] <= 1
        assert record["reward_mean"] == pytest.approx(record["reward/environment"])  # the only term, weight 1


# The hostile server's sessions take these in turn (each a step's answer; "good" is a right one).
HOSTILE = [
    "good",
    "nan_reward",
    "reward_1e39",
    "error_data_not_object",
    "deep_json",
    "not_utf8_text",
    "huge_observation",
]


def test_a_hostile_server_ends_episodes_with_counted_reasons_and_the_job_finishes(run, tmp_path):
    config = from_warmed_model(job_config(tmp_path, ""), run)
    config["iterations"] = 1
    config["checkpoint"] = {"interval": 1}
    with hostile_server(*HOSTILE) as url:
        config["agent"]["environment"]["servers"] = {"url": url, "sessions_per_replica": 4}
        run = train(tmp_path, config)  # exits 0: the job went on
    (record,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    agent = record["agent"]
    print("hostile job:", {key: value for key, value in agent.items() if "ended/" in key or "environment/" in key})
    steps, wrong = agent["environment/steps"], agent.get("ended/environment_protocol_error", 0)
    assert steps >= 1 and wrong >= 1, agent  # some turns reached the server, and its wrong answers were counted
    assert agent["environment/errors"] == wrong and agent["environment/sessions_open"] == 0
    numbers = [record["reward_mean"], record["reward_std"], record["reward/environment"], record["loss"]]
    assert all(math.isfinite(value) for value in numbers), record
