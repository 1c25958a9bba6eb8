"""Reward terms in a real job: a user's function beside rule terms reaches metrics.jsonl per term,
and a raising function ends the job with one line naming the term (the RLJob's failure reason),
or with `on_error: zero`, scores 0 and is counted."""

from __future__ import annotations

import textwrap
from pathlib import Path

import jobs  # tests/jobs.py
import pytest
import yaml

pytestmark = pytest.mark.integration

USER_REWARD = textwrap.dedent("""
    def length_bonus(data_source, solution_str, ground_truth, extra_info):
        return {"score": min(len(solution_str), 4) / 4, "chars": len(solution_str)}

    def broken(data_source, solution_str, ground_truth, extra_info):
        raise RuntimeError("the judge is confused")
""")


def _config(root: Path, terms: list[dict], on_error: str = "fail") -> Path:
    config = {
        "name": "it-rewards",
        "seed": 3,
        "iterations": 2,
        "model": {"path": str(root / "model"), "builder": "tiny-qwen2"},
        "warmup": {"steps": 5, "batch_size": 16},
        "algorithm": {
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 4,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "learning_rate": 1e-4,
        },
        "training": {"data_parallel_size": 1, "micro_batch_size": 8},
        "reward": {"terms": terms, "on_error": on_error},
        "dock": {"timeout_s": 120},
        "checkpoint": {"interval": 2},
    }
    path = root / f"job-{on_error}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rewards")
    (root / "user_reward.py").write_text(USER_REWARD)
    return root


def test_every_term_has_its_metric_and_the_reward_is_their_weighted_sum(root):
    terms = [
        {"name": "digit_match"},
        {"name": "function", "function": f"{root}/user_reward.py:length_bonus", "weight": 0.5},
        {"name": "format", "pattern": r"\d+", "weight": 0.25},
    ]
    records = jobs.run(_config(root, terms), root / "run", max_restarts=None).records
    assert len(records) == 2
    for record in records:
        weighted = record["reward/digit_match"] + 0.5 * record["reward/function"] + 0.25 * record["reward/format"]
        assert record["reward_mean"] == pytest.approx(weighted, abs=1e-5)
        assert record["reward/function/chars"] >= 0 and record["reward/errors"] == 0


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_a_raising_function_fails_the_job_with_one_line_naming_the_term(root):
    terms = [{"name": "digit_match"}, {"name": "function", "function": f"{root}/user_reward.py:broken"}]
    done = jobs.run(_config(root, terms), root / "failed", max_restarts=None, check=False)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: reward.terms[1] (function ") and "user_reward.py:broken) failed on a sample" in last
    assert last.endswith("RuntimeError: the judge is confused (reward.on_error: zero would score it 0)")


def test_on_error_zero_scores_zero_and_counts_the_errors(root):
    terms = [{"name": "digit_match"}, {"name": "function", "function": f"{root}/user_reward.py:broken"}]
    records = jobs.run(_config(root, terms, on_error="zero"), root / "zeroed", max_restarts=None).records
    assert [r["reward/errors"] for r in records] == [8, 8]  # G*N samples, each once per iteration
    assert all(r["reward/function"] == 0.0 for r in records)
