"""Short DAPO and DPO jobs end to end on local Ray: the recipes' flows through the dock, their
metrics, and resume. Learning itself is checked by test_learning.py."""

from __future__ import annotations

from pathlib import Path

import jobs  # tests/jobs.py
import pytest

pytestmark = pytest.mark.integration

G = 4


def job_config(algorithm: dict, *, warmup_steps: int, root: Path) -> dict:
    """The job, its tiny model built under `root` (not the user's ~/.cache, where whichever job built it
    first would decide the model)."""
    return {
        "name": f"it-{algorithm['name']}",
        "seed": 2,
        "iterations": 2,
        "model": {"path": str(root / "model"), "builder": "tiny-qwen2"},
        "data": {"generator": {"name": "addition", "max_operand": 5}, "chat_template": "none"},
        "warmup": {"steps": warmup_steps, "batch_size": 32},
        "algorithm": {
            "num_prompts_per_iteration": G,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "learning_rate": 1e-4,
            **algorithm,
        },
        "training": {"data_parallel_size": 2, "micro_batch_size": 8},
        "dock": {"timeout_s": 120},
        "checkpoint": {"interval": 1, "keep_last": 2},
    }


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_dapo_samples_in_rounds_and_resumes(tmp_path):
    n = 4
    config = job_config(
        {
            "name": "dapo",
            "num_responses_per_prompt": n,
            "dapo": {"max_sampling_rounds": 3, "overlong_buffer_length": 2},
        },
        warmup_steps=20,
        root=tmp_path,
    )
    jobs.run(config, tmp_path / "run", max_restarts=None, timeout_s=1200)
    records = jobs.run(
        config, tmp_path / "run", {"iterations": 3}, resume=True, max_restarts=None, timeout_s=1200
    ).records
    assert [r["iteration"] for r in records] == [1, 2, 3]
    for record in records:
        rounds = record["dynamic_sampling/rounds"]
        assert 1 <= rounds <= 3
        assert record["dynamic_sampling/padded_groups"] == max(0, G - record["dynamic_sampling/kept_groups"])
        assert record["dynamic_sampling/kept_groups"] <= G
        # Round 0 samples G groups, later rounds only the slots of dropped groups; the driver reads
        # the score and length of every sampled response (and nothing else) through sample_facts,
        # once (the filter's read is the record's), and the update trains on the G groups left in the dock.
        controllers = record["dock"]["controllers"]
        sampled = controllers["rollout"]["samples_handed_out"]
        assert controllers["reward"]["samples_handed_out"] == sampled
        assert controllers["sample_facts"]["samples_handed_out"] == sampled
        assert G * n <= sampled <= rounds * G * n and (rounds > 1) == (sampled > G * n)
        assert controllers["update"]["samples_handed_out"] == G * n
        assert 0.0 <= record["reward_mean"] <= 1.0
        assert record["entropy"] > 0.0


def test_dpo_trains_on_pairs_without_rollout(tmp_path):
    config = job_config({"name": "dpo", "num_responses_per_prompt": 2}, warmup_steps=0, root=tmp_path)
    records = jobs.run(config, tmp_path / "run", max_restarts=None, timeout_s=1200).records
    assert [r["iteration"] for r in records] == [1, 2]
    first = records[0]
    assert set(first["dock"]["controllers"]) == {"reference", "preference_update", "sample_facts"}
    assert first["dock"]["controllers"]["sample_facts"]["samples_handed_out"] == 2 * G  # the driver's pairs
    assert "reward_mean" not in first and first["response_length_mean"] > 1  # an answer and its EOS
    # Before the first step the policy is the reference: every implicit reward is 0 up to float
    # rounding (the reference and the update run their passes on differently shaped micro-batches,
    # so the two logprobs of a sample may differ in the last bits; a cold run here gave a margin of
    # 1.2e-8, which also made 1 of 4 pairs count as "accurate": accuracy is not asserted here).
    assert abs(first["reward_margin"]) <= 1e-6
    assert first["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert 0.0 <= first["policy_preference_accuracy"] <= 1.0
    assert records[1]["kl"] > 0.0  # the step moved the policy
    assert first["entropy"] > 0.0
