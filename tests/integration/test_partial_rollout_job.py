"""Partial rollout end to end (rollout.partial_rollout), kept short: 3 iterations of a tiny model in
async mode with dock.max_staleness 1, a response limit of 12 tokens and a round budget of 3, so the
generation that runs ahead of each update is cut and the untrained model's long responses really
are. Iteration 1 is not run ahead (nothing cut); iterations 2 and 3 are, and their cut responses are
completed after the update from their prefix (`resume`) or sampled again (`drop`), as the counters
in metrics.jsonl say. `off` runs the async pipeline unchanged, with no partial-rollout counters. The jobs
measure the train-inference gap (monitoring.mismatch) on the tokens the old-logprob pass's weights
sampled: the float32 engine's kernels' gap alone, the older prefixes left out."""

from __future__ import annotations

import math

import jobs  # tests/jobs.py
import pytest

pytestmark = pytest.mark.integration

G, N, ITERATIONS, MAX_RESPONSE, ROUND_TOKENS = 4, 4, 3, 12, 3


def run_job(tmp_path, mode: str) -> list[dict]:
    rollout = {"partial_rollout": mode, "max_tokens_per_round": ROUND_TOKENS} if mode != "off" else {}
    config = {
        "name": "it-partial",
        "seed": 1,
        "iterations": ITERATIONS,
        "model": {"path": str(tmp_path / "model"), "builder": "tiny-qwen2"},
        "algorithm": {
            "num_prompts_per_iteration": G,
            "num_responses_per_prompt": N,
            "max_prompt_length": 8,
            "max_response_length": MAX_RESPONSE,
            "learning_rate": 1e-4,
        },
        "training": {"mode": "async", "data_parallel_size": 1, "micro_batch_size": 8},
        "rollout": rollout,
        "dock": {"timeout_s": 120, "max_staleness": 1},
        "checkpoint": {"interval": ITERATIONS, "keep_last": 1},
        # the gap on the tokens the weights of the old-logprob pass sampled (a cut response's tail)
        "monitoring": {"mismatch": {"max_kl": 1.0, "action": "warn"}},
    }
    records = jobs.run(config, tmp_path / "run", max_restarts=None).records
    assert [r["iteration"] for r in records] == [1, 2, 3]
    for record in records:
        assert math.isfinite(record["reward_mean"]) and 0 <= record["reward_mean"] <= 1
        update = record["dock"]["controllers"]["update"]
        assert update["samples_handed_out"] == G * N and update["stale_dropped"] == 0, record["iteration"]
        assert record["staleness_max"] <= 1  # dock.max_staleness holds with the oldest version counted
    return records


def test_resume_completes_cut_responses_from_their_prefix(tmp_path):
    records = run_job(tmp_path, "resume")
    first, *ahead = records
    assert first["rollout/partial_cut"] == 0  # not run ahead of an update: never cut
    for record in ahead:
        cut = record["rollout/partial_cut"]
        assert cut > 0, record["iteration"]
        assert record["rollout/partial_resumed"] == cut and record["rollout/partial_dropped"] == 0
        assert record["rollout/partial_carried_tokens"] == cut * ROUND_TOKENS
        # every sample counts the version of its oldest token: one version old, as without the cut
        assert record["staleness_mean"] == 1.0
        assert record["response_length_mean"] > ROUND_TOKENS or cut < G * N  # resumed past the budget
    # measured on the newer version's tokens alone: the older prefix differs by the update too
    for record in records:
        jobs.check_float32_gap(record)


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_drop_samples_cut_responses_again_under_the_new_weights(tmp_path):
    records = run_job(tmp_path, "drop")
    assert records[0]["rollout/partial_cut"] == 0
    for record in records[1:]:
        cut = record["rollout/partial_cut"]
        assert cut > 0 and record["rollout/partial_dropped"] == cut and record["rollout/partial_resumed"] == 0
        assert record["rollout/partial_dropped_tokens"] == cut * ROUND_TOKENS
        assert record["rollout/partial_carried_tokens"] == 0
        # the dropped responses were sampled again by the policy the update starts from
        assert record["staleness_mean"] == pytest.approx(1 - cut / (G * N))


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_off_leaves_the_async_pipeline_as_it_was(tmp_path):
    records = run_job(tmp_path, "off")
    assert [r["staleness_mean"] for r in records] == [0.0, 1.0, 1.0]
    assert not any(key.startswith("rollout/partial") for r in records for key in r)
