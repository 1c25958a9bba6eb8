"""rldock trains against an environment written with openenv-core's own server classes: the tiny model's
episodes are sessions of openenv-core's guess-the-number game (tests/unit/runtime/openenv_servers.py),
each reset with its own seed, stepped with every turn, rewarded per step by the game, closed at the end,
through `rldock train` and the dock, with an `environment` reward term. Then one short job against a
hostile server (openenv_servers.hostile_server) whose sessions answer their steps wrongly in turn: the
job finishes, the wrong answers are counted as their episodes' ends, and every reward it wrote is
finite; and the game's per-step rewards credited by turn, under GRPO (the first job itself credits
turns: the credit shapes advantages, not the rewards the first test reads) and PPO. The other two
jobs start from the first job's warmed model rather than warming up again (`_warmed`)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import jobs  # tests/jobs.py
import pytest

pytestmark = pytest.mark.integration


def _agent_test_helpers():
    """tests/unit/runtime/openenv_servers.py (the agent and env_server tests' servers), loaded by its path."""
    name = "openenv_servers"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "unit" / "runtime" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


openenv_guess_server = _agent_test_helpers().openenv_guess_server
hostile_server = _agent_test_helpers().hostile_server

ITERATIONS = 2
MAX_TURNS = 3


def _config(root: Path, url: str) -> dict:
    return {
        "name": "it-environment",
        "seed": 3,
        "iterations": ITERATIONS,
        "model": {"path": str(root / "model"), "builder": "tiny-qwen2"},
        "data": {"generator": {"name": "addition", "max_operand": 9, "num_prompts": 64}, "chat_template": "model"},
        "reward": {"terms": [{"name": "environment", "aggregate": "sum"}]},
        # The answers' format (digits, then EOS): every turn then ends and goes to the game as a step.
        "warmup": {"steps": 150, "batch_size": 32, "learning_rate": 0.003},
        "agent": {
            "environment": {"name": "openenv", "servers": {"url": url, "sessions_per_replica": 4}},
            "max_turns": MAX_TURNS,
            "max_tool_response_tokens": 24,
        },
        "algorithm": {
            "name": "grpo",
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 4,
            "max_prompt_length": 48,
            "max_response_length": 96,
            "learning_rate": 1e-4,
        },
        "training": {"data_parallel_size": 1, "micro_batch_size": 16},
        "dock": {"timeout_s": 300},
        "checkpoint": {"interval": ITERATIONS},
    }


def _train(root: Path, config: dict) -> Path:
    """`rldock train` of `config` in `root` (its job.yaml); its output folder."""
    return jobs.run(config, root / "run", max_restarts=None, progress=True, timeout_s=1200).output


# How each algorithm credits the game's per-step rewards to the turns of an episode.
TURN_CREDIT = {
    "grpo": {"credit": "turn", "turn_discount": 0.9},
    "ppo": {"gae_unit": "turn", "credit": "turn", "ppo": {"gamma": 0.9}},
}


def _turn_credit(config: dict, name: str) -> dict:
    config["algorithm"].update(name=name, **TURN_CREDIT[name])
    config["resources"] = {"device": "cpu", "devices_per_node": 2}  # PPO's critic takes a device of its own
    return config


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("environment")
    with openenv_guess_server(sessions=4, highest=10) as url:
        return _train(root, _turn_credit(_config(root, url), "grpo"))


def _warmed(config: dict, run: Path) -> dict:
    """`config` starting from the module run's warmed model (its <output>/warmup folder: the same seed,
    data and warm-up give the same weights), its own warm-up skipped: the other jobs here need the
    answers' format, not another 150 steps of learning it."""
    config["model"] = {"path": str(run / "warmup")}
    config["warmup"] = {"steps": 0}
    return config


def test_every_episode_is_a_session_of_the_openenv_core_environment(run):
    records = jobs.records(run)
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


def test_a_hostile_server_ends_episodes_with_counted_reasons_and_the_job_finishes(tmp_path, run):
    config = _warmed(_config(tmp_path, ""), run)
    config["iterations"] = 1
    config["checkpoint"] = {"interval": 1}
    with hostile_server(*HOSTILE) as url:
        config["agent"]["environment"]["servers"] = {"url": url, "sessions_per_replica": 4}
        run = _train(tmp_path, config)  # exits 0: the job went on
    (record,) = jobs.records(run)
    agent = record["agent"]
    print("hostile job:", {key: value for key, value in agent.items() if "ended/" in key or "environment/" in key})
    steps, wrong = agent["environment/steps"], agent.get("ended/environment_protocol_error", 0)
    assert steps >= 1 and wrong >= 1, agent  # some turns reached the server, and its wrong answers were counted
    assert agent["environment/errors"] == wrong and agent["environment/sessions_open"] == 0
    numbers = [record["reward_mean"], record["reward_std"], record["reward/environment"], record["loss"]]
    assert all(math.isfinite(value) for value in numbers), record


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_a_job_credits_the_turns_of_episodes_rewarded_per_step(tmp_path, run, name):
    """Crediting turns end to end (docs/algorithms/turn-credit.md, ppo.md#multi-turn-episodes): the
    game rewards each step; PPO with its GAE by turn and rewards per turn, and GRPO crediting turns
    (the module's first job). Every state, the critic's included, takes every sample once; the losses
    stay finite."""
    output = run
    if name != "grpo":
        with openenv_guess_server(sessions=4, highest=10) as url:
            output = _train(tmp_path, _turn_credit(_warmed(_config(tmp_path, url), run), name))
    records = jobs.records(output)
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
