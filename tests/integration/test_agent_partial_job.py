"""Agent episodes across a weight update end to end (rollout.partial_rollout resume with `agent`), kept
short: the untrained tiny model in async mode with dock.max_staleness 1. Iteration 1 is not run ahead
(nothing cut); the later ones are: every episode that has not ended after the round budget is stopped at
the update, its turn cut, and finished on the new weights, so its tokens come from two policy versions.
None is dropped: the update trains on all G x N episodes, none stale, each token's ratio against the
logprob it was sampled with (importance_correction behaviour).

Two episode sources: rldock's own loop (3 iterations, episodes with the `feedback` environment, one session
each, in the actor's process, at most 24 tokens, 6 a round), and a harness of the user's (2 iterations, a
plain `openai.AsyncOpenAI` loop of two turns through the gateway, its first turn cut at the update while its
HTTP request stays open), whose every segment is still the engine's ids exactly."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.integration

G, N, ITERATIONS, MAX_RESPONSE, ROUND_TOKENS = 4, 4, 3, 24, 6


def test_episodes_cut_at_a_weight_update_end_on_the_new_weights_and_all_train(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
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
            }
        )
    )
    records = _train(config, tmp_path / "run")
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


def _train(config, output) -> list[dict]:
    """`rldock train` of `config` into `output`: the job's metric records."""
    job = subprocess.run(
        [sys.executable, "-m", "rldock.runtime.cli", "train", str(config), "--output", str(output), "--no-progress"],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line]


HARNESS_TOKENS = 12  # the harness's first turn: cut after ROUND_TOKENS when it has not ended by then
HARNESS = f"""
async def run(task, client):
    messages = [{{"role": "user", "content": task["prompt"]}}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens={HARNESS_TOKENS})
    messages += [first.choices[0].message.model_dump(exclude_none=True), {{"role": "user", "content": "Sure?"}}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    answer = (second.choices[0].message.content or "").strip()
    digits = [a == b for a, b in zip(answer, task["ground_truth"])]
    return {{"reward": sum(digits) / max(len(task["ground_truth"]), len(answer), 1)}}
"""


def test_a_harnesss_turns_cut_at_a_weight_update_end_on_the_new_weights_token_exact(tmp_path):
    g, n, segments = 2, 4, 2  # a first turn ended by its length opens a second segment (no end-of-turn token)
    (tmp_path / "harness.py").write_text(HARNESS)
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": "it-harness-partial",
                "seed": 1,
                "iterations": 2,
                "model": {"path": str(tmp_path / "model"), "builder": "tiny-qwen2"},
                "data": {"generator": {"name": "addition", "num_prompts": 200}, "chat_template": "model"},
                "reward": {"terms": [{"name": "environment"}]},
                "agent": {"harness": f"{tmp_path / 'harness.py'}:run", "max_segments": segments},
                "algorithm": {
                    "num_prompts_per_iteration": g,
                    "num_responses_per_prompt": n,
                    "max_prompt_length": 48,
                    "max_response_length": 64,
                    "learning_rate": 1e-4,
                },
                "training": {"mode": "async", "data_parallel_size": 1, "micro_batch_size": 8},
                "rollout": {
                    "partial_rollout": "resume",
                    "max_tokens_per_round": ROUND_TOKENS,
                    "importance_correction": "behaviour",
                },
                "dock": {"timeout_s": 120, "max_staleness": 1},
            }
        )
    )
    first, ahead = _train(config, tmp_path / "run")
    for record in (first, ahead):
        agent = record["agent"]
        assert agent["ended/harness_done"] == g * n and agent["turns_mean"] == 2.0, agent  # every episode ended
        # every segment's model tokens, in order, are the engine's ids of the episode's turns, cut or not
        assert agent["gateway/exact_episodes"] == g * n and agent.get("gateway/inexact_episodes", 0) == 0, agent
        assert agent["gateway/segments_dropped"] == 0, agent
        update = record["dock"]["controllers"]["update"]
        assert update["samples_handed_out"] == g * n * segments and update["stale_dropped"] == 0, record
        assert record["staleness_max"] <= 1 and math.isfinite(record["loss"])
    assert first["rollout/partial_cut"] == 0  # not run ahead of an update: never cut
    cut = ahead["rollout/partial_cut"]
    assert cut > 0 and ahead["rollout/partial_resumed"] == cut and ahead["rollout/partial_dropped"] == 0
    assert ahead["rollout/partial_carried_tokens"] == cut * ROUND_TOKENS  # each stopped at its budget
    assert ahead["rollout/partial_newer_tokens"] > 0  # the cut turns went on after the update
