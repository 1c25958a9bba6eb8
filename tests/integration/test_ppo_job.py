"""A PPO job end to end, kept short (2 iterations): the critic worker's states run through the
transfer dock like every other state, and its metrics and checkpoint come out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.integration

G, N, ITERATIONS = 4, 4, 2


@pytest.mark.parametrize("algorithm", ["ppo", "pf_ppo"])
def test_ppo_job_runs_every_state_through_the_dock(tmp_path, algorithm):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "name": f"it-{algorithm}", "seed": 1, "iterations": ITERATIONS,
        "model": {"path": str(tmp_path / "model"), "builder": "tiny-qwen2"},
        "algorithm": {"name": algorithm, "num_prompts_per_iteration": G, "num_responses_per_prompt": N,
                      "max_prompt_length": 8, "max_response_length": 6, "learning_rate": 1e-4,
                      "pf_ppo": {"mode": "best_random"}},
        "training": {"data_parallel_size": 1, "micro_batch_size": 8},
        "dock": {"timeout_s": 120},
        "checkpoint": {"interval": 1, "keep_last": 1},
    }))
    output = tmp_path / "run"
    job = subprocess.run([sys.executable, "-m", "rldock.runtime.cli", "train", str(config), "--output", str(output),
                          "--no-progress"], capture_output=True, text=True, timeout=900)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["iteration"] for r in records] == [1, 2]
    for record in records:
        assert record["value_loss"] >= 0 and 0 <= record["value_clip_fraction"] <= 1
        for stage in ("critic_inference", "critic_update", "advantage", "update"):
            assert record["timing"][stage] >= 0, stage
        controllers = record["dock"]["controllers"]
        assert set(controllers) >= {"critic_inference", "critic_update"}
        for state, counters in controllers.items():
            assert counters["samples_handed_out"] == G * N, state
    # The zero-initialised value head predicts 0 until the critic's first update.
    assert records[0]["value_mean"] == 0.0 and records[1]["value_mean"] != 0.0
    assert (output / "checkpoints" / "iter-000002" / "critic.pt").is_file()
