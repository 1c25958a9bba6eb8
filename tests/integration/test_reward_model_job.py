"""A learned reward model in a real job (classic RLHF): the `model` term's reward_model worker
scores every sample through the dock, and its rm_score reaches the reward. The reward model is
built with a constant head (every text scores RM_SCORE), so `reward/model` must be exactly that
and the reward the weighted sum with the rule term.

The same job carries a user's function that raises, under `reward.on_error: zero`: it scores 0 (so
the sum above is unchanged) and every error is counted (the raising function's failure without
`on_error: zero` is test_reward_terms_job's)."""

from __future__ import annotations

from pathlib import Path

import jobs  # tests/jobs.py
import pytest
from reward_model_builder import build_tiny_reward_model  # tests/reward_model_builder.py

pytestmark = pytest.mark.integration

G, N, RM_SCORE, DIGIT_WEIGHT = 2, 4, 0.75, 0.5


BROKEN = """
def broken(data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError("the judge is confused")
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reward-model")
    build_tiny_reward_model(root / "rm", texts=["0123456789+= abcdefghijklmnopqrstuvwxyz"], constant=RM_SCORE)
    (root / "user_reward.py").write_text(BROKEN)
    return root


def run_job(root: Path, algorithm: str) -> list[dict]:
    config = {
        "name": f"it-rm-{algorithm}",
        "seed": 2,
        "iterations": 2,
        "model": {"path": str(root / "model"), "builder": "tiny-qwen2"},
        "algorithm": {
            "name": algorithm,
            "num_prompts_per_iteration": G,
            "num_responses_per_prompt": N,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "learning_rate": 1e-4,
        },
        "reward": {
            "terms": [
                {"name": "model", "path": str(root / "rm")},
                {"name": "digit_match", "weight": DIGIT_WEIGHT},
                {"name": "function", "function": f"{root}/user_reward.py:broken"},
            ],
            "on_error": "zero",
        },
        "training": {"data_parallel_size": 1, "micro_batch_size": 8},
        "dock": {"timeout_s": 120},
        "checkpoint": {"interval": 2, "keep_last": 1},
    }
    return jobs.run(config, root / algorithm, max_restarts=None).records


@pytest.fixture(scope="module")
def grpo_records(root) -> list[dict]:
    return run_job(root, "grpo")


# grpo in `make test`; ppo and dapo opt-in (`make test-slow`: .ci/run's budget; README, "slow")
@pytest.mark.parametrize(
    "algorithm", [pytest.param("ppo", marks=pytest.mark.slow), "grpo", pytest.param("dapo", marks=pytest.mark.slow)]
)
def test_the_reward_models_score_reaches_the_reward(request, root, algorithm):
    records = request.getfixturevalue("grpo_records") if algorithm == "grpo" else run_job(root, algorithm)
    assert [r["iteration"] for r in records] == [1, 2]
    for record in records:
        assert record["reward/model"] == pytest.approx(RM_SCORE, abs=1e-5)
        assert record["reward_mean"] == pytest.approx(RM_SCORE + DIGIT_WEIGHT * record["reward/digit_match"], abs=1e-5)
        assert record["timing"]["reward_model"] >= 0
        handed_out = record["dock"]["controllers"]["reward_model"]["samples_handed_out"]
        # DAPO's sampling rounds may score more groups than it keeps; every kept sample was scored.
        assert handed_out == G * N if algorithm != "dapo" else handed_out >= G * N


def test_on_error_zero_scores_zero_and_counts_the_errors(grpo_records):
    assert [r["reward/errors"] for r in grpo_records] == [G * N, G * N]  # every sample, once per iteration
    assert all(r["reward/function"] == 0.0 for r in grpo_records)
