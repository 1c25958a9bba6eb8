"""The cabinet learning benchmark without running jobs: each arm's overrides make the example a valid job
whose environment runs as `rldock env serve` processes of the cabinet class, the data it prepares is the
example header's, and the summary reads turns, ends and the sampled reward."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rldock.config.loading import load_job_config
from rldock_benchmarks.cabinet_learning import (
    ARMS,
    DATA_ARGS,
    EXAMPLE,
    control_overrides,
    episodes,
    gateway_exactness,
    read_reward_overrides,
)
from rldock_benchmarks.smollm2_learning import job_overrides

DATA = {"train": ["/d/train.jsonl"], "val": ["/d/val.jsonl"]}


def _config(arm: str, read_reward: float | None = None):
    overrides = dict(
        o.split("=", 1)
        for o in [*job_overrides(Path("/m/smol"), DATA, iterations=3), *read_reward_overrides(read_reward), *ARMS[arm]]
    )
    parsed = {key: yaml.safe_load(value) for key, value in overrides.items()}  # as `--set` reads them
    parsed["data.train_files"], parsed["data.val_files"] = DATA["train"], DATA["val"]
    return load_job_config(EXAMPLE, overrides=parsed, check_local=False)


def test_each_arm_is_the_example_with_one_change():
    trained, control = _config("trained"), _config("learning_rate_0")
    environment = trained.agent.environment
    assert environment.name == "openenv" and environment.servers.replicas == 2
    assert environment.servers.command[:4] == [
        "rldock",
        "env",
        "serve",
        "rldock.runtime.agent.examples.cabinet:Cabinet",
    ]
    assert [term.name for term in trained.reward.terms] == ["environment"] and not trained.agent.tools
    assert trained.data.demonstration_key == "demonstration" and trained.data.extra_info_key == "extra_info"
    assert trained.warmup.steps > 0 and trained.algorithm.learning_rate > 0 and trained.evaluation.at_start
    assert control.algorithm.learning_rate == 0 and control.agent == trained.agent
    assert trained.iterations == trained.evaluation.interval == 3


def test_each_control_starts_from_its_trained_arms_warmup():
    extra = control_overrides("learning_rate_0", Path("/o"), {"trained": {}})
    assert extra == [*ARMS["learning_rate_0"], "model.path=/o/trained/warmup", "warmup.steps=0"]
    assert control_overrides("learning_rate_0", Path("/o"), {}) == ARMS["learning_rate_0"]
    extra = control_overrides("langgraph_learning_rate_0", Path("/o"), {"trained": {}, "langgraph": {}})
    assert extra == [*ARMS["langgraph_learning_rate_0"], "model.path=/o/langgraph/warmup", "warmup.steps=0"]
    assert control_overrides("grpo_turn", Path("/o"), {"trained": {}}) == ARMS["grpo_turn"]


def test_the_langgraph_arms_are_the_example_with_the_users_graph_in_place_of_the_environment():
    from rldock.config.problems import find_problems

    trained, example, control = _config("langgraph"), _config("trained"), _config("langgraph_learning_rate_0")
    assert trained.agent.environment is None and trained.agent.harness.endswith("harnesses/langgraph_cabinet.py:run")
    assert Path(trained.agent.harness.rsplit(":", 1)[0]).is_file()
    assert trained.agent.max_segments == 1 and find_problems(trained) == []
    assert trained.algorithm == example.algorithm and trained.warmup == example.warmup
    assert control.algorithm.learning_rate == 0 and control.agent == trained.agent


def test_gateway_exactness_sums_sampled_and_held_out_episodes():
    records = [
        {"iteration": 0, "val/accuracy": 0.1, "val/agent/gateway/exact_episodes": 8.0},
        {"iteration": 1, "agent": {"gateway/exact_episodes": 32.0, "gateway/rerender_drifted": 2.0}},
        {"iteration": 2, "agent": {"gateway/exact_episodes": 31.0, "gateway/inexact_episodes": 1.0}},
    ]
    totals = gateway_exactness(records)
    assert totals["exact_episodes"] == 71.0 and totals["inexact_episodes"] == 1.0
    assert totals["rerender_drifted"] == 2.0 and totals["rerender_drift_tokens"] == 0.0


def test_the_benchmark_prepares_the_data_the_example_header_documents():
    header_words = " ".join(EXAMPLE.read_text().replace("\\\n#", " ").split())
    assert f"rldock data generate {' '.join(DATA_ARGS)}" in header_words


def test_episodes_reads_turns_ends_and_the_sampled_reward():
    records = [
        {"iteration": 0, "val/accuracy": 0.4, "val/reward": 0.5, "val/agent/turns_mean": 2.5},
        {"iteration": 1, "timing": {}, "reward_mean": 0.25, "agent": {"turns_mean": 2.8}},
        {"iteration": 2, "timing": {}, "reward_mean": 0.5, "agent": {"turns_mean": 3.0}},
        {
            "iteration": 2,
            "val/accuracy": 0.6,
            "val/agent/turns_mean": 3.0,
            "val/agent/ended/answer": 3.0,
            "val/agent/ended/max_turns": 1.0,
        },
    ]
    summary = episodes(records)
    assert summary["val_ended_end"] == pytest.approx({"answer": 0.75, "max_turns": 0.25, "length": 0.0})
    assert (summary["val_turns_start"], summary["val_turns_end"]) == (2.5, 3.0)
    assert (summary["train_turns_first"], summary["train_turns_last"]) == (2.8, 3.0)
    assert summary["train_reward_by_iteration"] == [0.25, 0.5]
    assert summary["val_accuracy_by_iteration"] == {0: 0.4, 2: 0.6}  # the held-out curve
    assert summary["val_reward_by_iteration"] == {0: 0.5, 2: None}


def test_episodes_counts_a_harness_arms_ends():
    records = [
        {"iteration": 0, "val/accuracy": 0.25},
        {"iteration": 1, "timing": {}, "reward_mean": 0.3},
        {"iteration": 1, "val/accuracy": 0.4, "val/agent/ended/harness_done": 9.0, "val/agent/ended/harness_error": 1},
    ]
    assert episodes(records)["val_ended_end"] == pytest.approx(
        {"answer": 0.0, "max_turns": 0.0, "length": 0.0, "harness_done": 0.9, "harness_error": 0.1}
    )


@pytest.mark.parametrize("arm", ["trained", "grpo_turn", "ppo_turn_gae", "learning_rate_0"])
def test_the_turn_arms_are_valid_jobs_against_a_cabinet_that_rewards_reading(arm):
    cfg = _config(arm, read_reward=0.2)
    assert cfg.agent.environment.servers.command[-2:] == ["--option", "read_reward=0.2"]
    expected = {"trained": ("grpo", "trajectory"), "grpo_turn": ("grpo", "turn"), "ppo_turn_gae": ("ppo", "turn")}
    if arm in expected:
        assert (cfg.algorithm.name, cfg.algorithm.credit) == expected[arm]
    assert cfg.algorithm.gae_unit == ("turn" if arm == "ppo_turn_gae" else "token")
