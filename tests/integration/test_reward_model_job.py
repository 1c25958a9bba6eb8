"""A learned reward model in a real job (classic RLHF): the `model` term's reward_model worker
scores every sample through the dock, and its rm_score reaches the reward. The reward model is
built with a constant head (every text scores RM_SCORE), so `reward/model` must be exactly that
and the reward the weighted sum with the rule term."""

from __future__ import annotations

from pathlib import Path

import jobs  # tests/jobs.py
import pytest
import yaml
from reward_model_builder import build_tiny_reward_model  # tests/reward_model_builder.py

pytestmark = pytest.mark.integration

G, N, RM_SCORE, DIGIT_WEIGHT = 2, 4, 0.75, 0.5


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reward-model")
    build_tiny_reward_model(root / "rm", texts=["0123456789+= abcdefghijklmnopqrstuvwxyz"], constant=RM_SCORE)
    return root


# grpo in `make test`; ppo and dapo opt-in (`make test-slow`: .ci/run's budget; README, "slow")
@pytest.mark.parametrize(
    "algorithm", [pytest.param("ppo", marks=pytest.mark.slow), "grpo", pytest.param("dapo", marks=pytest.mark.slow)]
)
def test_the_reward_models_score_reaches_the_reward(root, algorithm):
    output = root / algorithm
    config = root / f"{algorithm}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
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
                    ]
                },
                "training": {"data_parallel_size": 1, "micro_batch_size": 8},
                "dock": {"timeout_s": 120},
                "checkpoint": {"interval": 2, "keep_last": 1},
            }
        )
    )
    records = jobs.run(config, output, max_restarts=None).records
    assert [r["iteration"] for r in records] == [1, 2]
    for record in records:
        assert record["reward/model"] == pytest.approx(RM_SCORE, abs=1e-5)
        assert record["reward_mean"] == pytest.approx(RM_SCORE + DIGIT_WEIGHT * record["reward/digit_match"], abs=1e-5)
        assert record["timing"]["reward_model"] >= 0
        handed_out = record["dock"]["controllers"]["reward_model"]["samples_handed_out"]
        # DAPO's sampling rounds may score more groups than it keeps; every kept sample was scored.
        assert handed_out == G * N if algorithm != "dapo" else handed_out >= G * N
