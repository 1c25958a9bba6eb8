"""Agent episodes across a weight update end to end (rollout.partial_rollout resume with `agent`), kept
short: 3 iterations of the untrained tiny model in async mode with dock.max_staleness 1, episodes with the
`feedback` environment (one session each, in the actor's process) of at most 24 tokens, and a round budget
of 6 tokens. Iteration 1 is not run ahead (nothing cut); iterations 2 and 3 are: every episode that has not
ended after 6 tokens is stopped at the update, its turn cut, and finished on the new weights, so its tokens
come from two policy versions. None is dropped: the update trains on all G x N episodes, none stale, each
token's ratio against the logprob it was sampled with (importance_correction behaviour). The job measures
the train-inference gap (monitoring.mismatch) on the tokens the old-logprob pass's weights sampled."""

from __future__ import annotations

import math

import jobs  # tests/jobs.py
import pytest

pytestmark = pytest.mark.integration

G, N, ITERATIONS, MAX_RESPONSE, ROUND_TOKENS = 4, 4, 3, 24, 6


def test_episodes_cut_at_a_weight_update_end_on_the_new_weights_and_all_train(tmp_path):
    config = {
        "name": "it-agent-partial",
        "seed": 1,
        "iterations": ITERATIONS,
        "model": {"path": str(tmp_path / "model"), "builder": "tiny-qwen2"},
        "data": {"generator": {"name": "addition", "num_prompts": 200}, "chat_template": "model"},
        "agent": {"environment": {"name": "feedback"}, "max_turns": 3, "max_tool_response_tokens": 8},
        "algorithm": {
            "num_prompts_per_iteration": G,
            "num_responses_per_prompt": N,
            "max_prompt_length": 48,
            "max_response_length": MAX_RESPONSE,
            "learning_rate": 1e-4,
        },
        "training": {"mode": "async", "data_parallel_size": 1, "micro_batch_size": 8},
        "rollout": {
            "partial_rollout": "resume",
            "max_tokens_per_round": ROUND_TOKENS,
            "importance_correction": "behaviour",
        },
        "dock": {"timeout_s": 120, "max_staleness": 1},
        "checkpoint": {"interval": ITERATIONS, "keep_last": 1},
        # the gap on the tokens the weights of the old-logprob pass sampled (a cut episode's later tokens)
        "monitoring": {"mismatch": {"max_kl": 1.0, "action": "warn"}},
    }
    records = jobs.run(config, tmp_path / "run", max_restarts=None).records
    assert [r["iteration"] for r in records] == [1, 2, 3]
    for record in records:
        assert math.isfinite(record["reward_mean"])
        update = record["dock"]["controllers"]["update"]
        assert update["samples_handed_out"] == G * N and update["stale_dropped"] == 0, record["iteration"]
        assert record["staleness_max"] <= 1
        assert sum(v for k, v in record["agent"].items() if k.startswith("ended/")) == G * N  # all ended
    first, *ahead = records
    assert first["rollout/partial_cut"] == 0  # not run ahead of an update: never cut
    for record in ahead:
        cut = record["rollout/partial_cut"]
        assert cut > 0 and record["rollout/partial_resumed"] == cut, record["iteration"]
        assert record["rollout/partial_dropped"] == 0
        assert record["rollout/partial_carried_tokens"] == cut * ROUND_TOKENS  # each stopped at its budget
        # the cut episodes went on after the update: their later tokens are the newer version's
        assert record["rollout/partial_newer_tokens"] > 0, record["iteration"]
    # The gap is there and on the right tokens. The untrained model earns no reward here, so its updates
    # leave the weights as they were and an older version's tokens would pass too: that they are left
    # out is test_partial_rollout_job's check (its updates move the logprobs by 1e-2) and the unit tests'.
    for record in records:
        jobs.check_float32_gap(record)
