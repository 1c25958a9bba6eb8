"""A budget on the train-inference mismatch stops a job that passes it (monitoring.mismatch, action
`stop`; docs/algorithms/rollout-correction.md#a-budget-on-the-gap). Its own job: it fails by design.

The demo generates in bfloat16 over its float32 trainer (rollout.dtype), a gap far over a budget of
1e-9 (test_rollout_dtype_engine measures such an engine's logprobs): the first iteration passes it, is
checkpointed, and the run ends with exit 1, the reason on a failure line the operator fails the RLJob
with, and the fix named. The rollout is streamed (rollout.stream_groups 1: each prompt group written
as it finishes, its engine logprobs with it), the mode whose gap this test measures; the plain mode's
is test_verl_data_job's, the agent's test_agent_job's."""

from __future__ import annotations

import json

import jobs  # tests/jobs.py
import pytest

from rldock.contract.failure import PREFIX
from rldock.contract.progress import MISMATCH_KL, last_progress
from rldock.runtime import checkpoint as ckpt

pytestmark = pytest.mark.integration


def test_a_job_over_its_mismatch_budget_stops_after_a_checkpoint_naming_the_iteration_and_the_fix(tmp_path):
    output = tmp_path / "run"
    overrides = {
        "iterations": 3,
        "rollout.dtype": "bfloat16",
        "rollout.stream_groups": 1,
        "monitoring.mismatch.max_kl": "0.000000001",
        "monitoring.mismatch.action": "stop",
    }
    run = jobs.run(jobs.DEMO, output, overrides, check=False)
    assert run.returncode == 1, run.tail()
    (record,) = run.records  # the first iteration passed the budget: no second one ran
    assert record["iteration"] == 1 and record["mismatch/kl"] > 1e-9
    assert set(jobs.MISMATCH_MEASURES) <= set(record), record
    # bfloat16's rounding of every weight: a gap well above a float32 engine's, but that of the same tokens'
    # logprobs (another token's or a zero column would be off by whole nats on average)
    assert 1e-4 < record["mismatch/abs_diff_mean"] < 0.5, record
    latest = ckpt.latest_checkpoint(output)
    assert latest is not None and latest.iteration == 1  # checkpointed though checkpoint.interval is 5
    (line,) = [line for line in run.stdout.splitlines() if line.startswith(PREFIX)]
    failure = json.loads(line.removeprefix(PREFIX))
    assert failure["reason"] == "RolloutMismatch"
    (problem,) = failure["problems"]
    assert problem["field"] == "monitoring.mismatch.max_kl"
    assert "iteration 1: mismatch/kl" in problem["message"] and "algorithm.rollout_correction" in problem["message"]
    # what the operator reads and holds to the budget
    assert last_progress(run.stdout.splitlines())[MISMATCH_KL] == pytest.approx(record["mismatch/kl"], rel=1e-3)
