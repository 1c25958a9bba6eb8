"""A user's reward function that raises ends the job with one line naming the term (the RLJob's
failure reason). The other reward-term jobs share runs that assert more: a user's function beside
weighted rule terms, each with its metric, is test_verl_data_job's run; `on_error: zero`, which scores
the raising function 0 and counts it, is test_reward_model_job's."""

from __future__ import annotations

import textwrap
from pathlib import Path

import jobs  # tests/jobs.py
import pytest
import yaml

pytestmark = pytest.mark.integration

USER_REWARD = textwrap.dedent("""
    def broken(data_source, solution_str, ground_truth, extra_info):
        raise RuntimeError("the judge is confused")
""")


def _config(root: Path, terms: list[dict]) -> Path:
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
        "reward": {"terms": terms},
        "dock": {"timeout_s": 120},
        "checkpoint": {"interval": 2},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rewards")
    (root / "user_reward.py").write_text(USER_REWARD)
    return root


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_a_raising_function_fails_the_job_with_one_line_naming_the_term(root):
    terms = [{"name": "digit_match"}, {"name": "function", "function": f"{root}/user_reward.py:broken"}]
    done = jobs.run(_config(root, terms), root / "failed", max_restarts=None, check=False)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: reward.terms[1] (function ") and "user_reward.py:broken) failed on a sample" in last
    assert last.endswith("RuntimeError: the judge is confused (reward.on_error: zero would score it 0)")
