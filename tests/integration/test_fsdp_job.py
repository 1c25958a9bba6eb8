"""`training.strategy: fsdp` in a real job: the demo config on two actor ranks (each its own vLLM
replica) with FSDP2, gradient checkpointing and allgather-swap. The ledger must show each rank's
shards (half the model) on the device after the update and none of them while generating; the
checkpoint (gathered weights and optimizer state, written by rank 0) must resume."""

from __future__ import annotations

from pathlib import Path

import pytest
from jobs import train_demo  # tests/jobs.py

pytestmark = pytest.mark.integration

TRAIN_STATE = ("train_params", "grads", "optimizer_state")


def run_job(output: Path, model: Path, *, iterations: int, resume: bool = False) -> list[dict]:
    overrides = {
        "iterations": iterations,
        "model.path": str(model),
        "warmup.steps": 0,
        "algorithm.num_prompts_per_iteration": 4,
        "algorithm.num_responses_per_prompt": 4,
        "training.data_parallel_size": 2,
        "training.strategy": "fsdp",
        "training.resharding": "allgather_swap",
        "training.gradient_checkpointing": "true",
        "rollout.cpu_kv_cache_gib": 0.25,
        "dock.timeout_s": 120,
        "checkpoint.interval": 1,
        "evaluation.interval": 0,
    }
    return train_demo(output, overrides, resume=resume)


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_fsdp_job_trains_swaps_and_resumes(tmp_path):
    output, model = tmp_path / "run", tmp_path / "model"
    first = run_job(output, model, iterations=1)
    assert (output / "checkpoints" / "iter-000001" / "optimizer.pt").is_file()
    records = run_job(output, model, iterations=2, resume=True)
    assert [r["iteration"] for r in records] == [1, 2] and records[0] == first[0]
    for record in records:
        ledger = record["ledger"]
        for rank in (0, 1):
            prefix = f"memory/rank{rank}"
            after = sum(ledger[f"{prefix}/after_update/{c}"] for c in TRAIN_STATE)
            assert after > 0 and ledger[f"{prefix}/generation/host_swap"] == after
            assert sum(ledger[f"{prefix}/generation/{c}"] for c in TRAIN_STATE) == 0
        # Two ranks' parameter shards add up to one model: each holds about half.
        shards = [ledger[f"memory/rank{r}/after_update/train_params"] for r in (0, 1)]
        assert abs(shards[0] - shards[1]) <= 0.05 * shards[0]
        assert record["loss"] == record["loss"]  # finite, not NaN
