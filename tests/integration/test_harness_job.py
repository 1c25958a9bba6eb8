"""A harness of the user's (a plain loop over `openai.AsyncOpenAI`: a draft turn, its context compacted to
the task and a summary of the draft, two more turns) trains the tiny model through `rldock train` on CPU,
served by the real vLLM engine behind the gateway; every segment of every episode is a dock row, and the
rows' trained ids are exactly the ids the engine sampled (the engine's own record,
`agent/gateway/exact_episodes`, and the dock's columns checked against it on the job's model); held-out
evaluation runs the same harness, greedily, on the held-out prompts.

The harness posts a step reward after its draft turn (0.1 when the draft holds a digit): the draft turn's, in
the draft segment's row (the `turn_rewards` that `algorithm.credit: turn` reads). A second, smaller job credits
the turns of a two-turn harness apart (`credit: turn`, one segment an episode: agent.max_segments 1).

The job runs async with partial rollout (`resume`, ROUND_TOKENS a round): iteration 2's episodes are sampled
ahead of iteration 1's update, and each one's turn under way when it has sampled ROUND_TOKENS tokens is cut
there, its HTTP request left open, and finished on the new weights: those turns straddle the update, and
still every segment is the engine's ids and no episode is dropped. The job measures the train-inference gap
(monitoring.mismatch) on the tokens the old-logprob pass's weights sampled.
"""

from __future__ import annotations

import math
from pathlib import Path

import jobs  # tests/jobs.py
import pytest
import yaml

pytestmark = pytest.mark.integration

ITERATIONS = 2
HELD_OUT = 8
ROUND_TOKENS = 8  # the run-ahead round's budget an episode: its first turn (up to 24 tokens) is cut there
STEP_REWARD = 0.1  # posted after the draft turn when the draft holds a digit
HARNESS = f"""
import httpx


async def run(task, client):
    prompt = task["prompt"]
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    draft = await client.chat.completions.create(
        model="policy", messages=[{{"role": "user", "content": text}}], max_tokens=24
    )
    step = {STEP_REWARD} if any(c.isdigit() for c in draft.choices[0].message.content or "") else 0.0
    async with httpx.AsyncClient() as http:  # the draft's step reward, to the episode's .../reward
        await http.post(
            str(client.base_url).removesuffix("/").removesuffix("/v1") + "/reward",
            json={{"reward": step}},
            headers={{"Authorization": f"Bearer {{client.api_key}}"}},
        )
    # the context compacted: the task and a summary of the draft in one message, a new segment
    summary = (draft.choices[0].message.content or "")[:6]
    messages = [{{"role": "user", "content": text + " Draft: " + summary}}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
    messages = [*messages, first.choices[0].message.model_dump(exclude_none=True)]
    messages.append({{"role": "user", "content": "Check it and give the number only."}})
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
    answer = (second.choices[0].message.content or "").strip()
    digits = [a == b for a, b in zip(answer, task["ground_truth"])]
    return {{"reward": sum(digits) / max(len(task["ground_truth"]), len(answer), 1)}}
"""


def _config(root: Path) -> dict:
    return {
        "name": "it-harness",
        "seed": 1,
        "iterations": ITERATIONS,
        "model": {"path": str(root / "model"), "builder": "tiny-qwen2"},
        "data": {
            "generator": {"name": "addition", "max_operand": 99, "num_prompts": 200, "num_val_prompts": HELD_OUT},
            "chat_template": "model",
        },
        "reward": {"terms": [{"name": "environment"}]},
        "agent": {"harness": f"{root / 'harness.py'}:run", "episode_timeout_s": 300},
        "algorithm": {
            "name": "grpo",
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 4,
            "max_prompt_length": 48,
            "max_response_length": 96,
            "learning_rate": 1e-4,
        },
        "training": {"mode": "async", "data_parallel_size": 1, "micro_batch_size": 16},
        "rollout": {
            "partial_rollout": "resume",
            "max_tokens_per_round": ROUND_TOKENS,
            "importance_correction": "behaviour",
        },
        "dock": {"timeout_s": 300, "max_staleness": 1},
        "checkpoint": {"interval": ITERATIONS},
        "evaluation": {"interval": ITERATIONS},
        "monitoring": {"mismatch": {"max_kl": 1.0, "action": "warn"}},
    }


TWO_TURNS = f"""
import httpx


async def run(task, client):
    prompt = task["prompt"]
    messages = [{{"role": "user", "content": prompt if isinstance(prompt, str) else prompt[-1]["content"]}}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
    text = first.choices[0].message.content or ""
    async with httpx.AsyncClient() as http:  # the first turn's step reward
        await http.post(
            str(client.base_url).removesuffix("/").removesuffix("/v1") + "/reward",
            json={{"reward": {STEP_REWARD} if any(c.isdigit() for c in text) else 0.0}},
            headers={{"Authorization": f"Bearer {{client.api_key}}"}},
        )
    messages += [{{"role": "assistant", "content": text}}, {{"role": "user", "content": "The number only."}}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
    return float((second.choices[0].message.content or "").strip() == task["ground_truth"])
"""


@pytest.fixture(scope="module")
def turn_credit_run(tmp_path_factory) -> Path:
    """A sync job crediting the two turns of each episode apart: the posted step reward is the first turn's."""
    root = tmp_path_factory.mktemp("harness-turns")
    (root / "harness.py").write_text(TWO_TURNS)
    config = _config(root)
    config.update(
        name="it-harness-turns",
        agent={"harness": f"{root / 'harness.py'}:run", "episode_timeout_s": 300, "max_segments": 1},
        training={"data_parallel_size": 1, "micro_batch_size": 16},
        rollout={},
        dock={"timeout_s": 300},
        evaluation={"interval": 0},
        monitoring={},
    )
    config["algorithm"]["credit"] = "turn"
    return jobs.run(config, root / "run", max_restarts=None, timeout_s=1200).output


def test_a_harness_s_posted_step_rewards_credit_its_turns_apart(turn_credit_run):
    records = jobs.records(turn_credit_run)
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    for record in records:
        agent = record["agent"]
        assert agent["ended/harness_done"] == 16 and agent["turns_mean"] == 2.0, agent
        # a first turn cut at its max_tokens is not continued: the second turn opens a segment, and
        # agent.max_segments 1 trains the last (the step reward then sits in the rest, on the last turn)
        segments = agent["gateway/segments"]
        assert 16 <= segments <= 32 and agent["gateway/segments_dropped"] == segments - 16, agent
        assert agent["gateway/exact_episodes"] == 16, agent
        assert 0.0 <= record["reward_mean"] <= 1.0 + STEP_REWARD
        assert all(math.isfinite(record[key]) for key in ("loss", "kl", "entropy")), record


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("harness")
    (root / "harness.py").write_text(HARNESS)
    return jobs.run(_config(root), root / "run", max_restarts=None, progress=True, timeout_s=1200).output


def test_a_plain_openai_harness_trains_every_segment_token_exact(run):
    records = [r for r in jobs.records(run) if r["iteration"] > 0]  # iteration 0: the initial policy's evaluation
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    for record in records:
        agent = record["agent"]
        assert agent["ended/harness_done"] == 16, agent
        # every segment's model tokens, in order, are the engine's ids of the episode's turns
        assert agent["gateway/exact_episodes"] == 16 and agent.get("gateway/inexact_episodes", 0) == 0, agent
        assert agent["turns_mean"] == 3.0, agent
        assert agent["gateway/segment/message_edited"] == 16, agent  # the summary edits the first message
        # at most one more segment (a first turn cut at the harness's max_tokens): all within agent.max_segments
        assert 32 <= agent["gateway/segments"] <= 48 and agent["gateway/segments_dropped"] == 0, agent
        assert not any("untrained" in key for key in agent), agent
        assert 0.0 < agent["model_token_share"] < 1.0  # the second user turn is context, not trained
        # one reward per episode: the reward state scored 16 episodes, not their 64 rows
        assert 0.0 <= record["reward_mean"] <= 1.0 + STEP_REWARD
        assert all(math.isfinite(record[key]) for key in ("loss", "kl", "entropy")), record
        update = record["dock"]["controllers"]["update"]  # none dropped: every row of every episode trains
        assert update["samples_handed_out"] == 16 * 4 and update["stale_dropped"] == 0, update
        assert record["staleness_max"] <= 1
    first, ahead = records
    assert first["rollout/partial_cut"] == 0  # not run ahead of an update: never cut
    cut = ahead["rollout/partial_cut"]
    assert cut > 0 and ahead["rollout/partial_resumed"] == cut and ahead["rollout/partial_dropped"] == 0
    assert ahead["rollout/partial_carried_tokens"] == cut * ROUND_TOKENS  # each stopped at its budget
    assert ahead["rollout/partial_newer_tokens"] > 0  # the cut turns went on after the update


def test_the_harness_jobs_train_inference_gap_is_its_float32_kernels(run):
    """monitoring.mismatch on a harness job: the gateway keeps every sampled token's engine logprob, and the gap
    is measured on the tokens the old-logprob pass's weights sampled (the run-ahead iteration's turns cut at
    the update are measured on their tokens after it): float32 on both sides, only the kernels differ."""
    records = [r for r in jobs.records(run) if r["iteration"] > 0]
    assert len(records) == ITERATIONS
    for record in records:  # the older version's tokens of the cut turns would show as a gap of 1e-3 and more
        jobs.check_float32_gap(record)


def test_every_segment_is_a_trained_dock_row_of_the_engines_ids(run):
    """The job's model's episodes through the gateway and the harness rollout's columns, on the real engine:
    each episode's rows hold every one of its segments, their trained ids the engine's own record of the
    episode's turns, each segment's row with tokens to train."""
    from rldock.config import JobConfig
    from rldock.runtime.data import columns_of, load_rows
    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
    from rldock.runtime.gateway.episodes import GatewayEpisodes
    from rldock.runtime.models.loading import load_tokenizer
    from rldock.runtime.rollout.harness import harness_columns, task_of

    root = run.parent
    cfg = JobConfig(**yaml.safe_load((root / "job.yaml").read_text()))
    tokenizer = load_tokenizer(root / "model")
    rows = load_rows([str(run / "data" / "train.jsonl")], columns_of(cfg.data))[:4]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": row.prompt}], add_generation_prompt=True)
        for row in rows
    ]
    engine = VllmRolloutEngine(
        root / "model",
        rollout=cfg.rollout,
        dtype="float32",
        seed=cfg.seed,
        max_model_len=cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length,
        device=detect_device("cpu"),
    )
    episodes = GatewayEpisodes(cfg, tokenizer=tokenizer, prompt_capacity=cfg.algorithm.max_prompt_length)
    try:
        results = episodes.run(
            engine, tasks=[task_of(row, i) for i, row in enumerate(rows)], prompts=prompts, keys=[0, 1, 2, 3], seed=5
        )
        sampled = {key: list(turns) for key, turns in episodes.turns.sampled.items()}
    finally:
        episodes.close()
        engine.shutdown()
    per_episode = cfg.rows_per_episode
    columns = harness_columns(
        results,
        rows_per_episode=per_episode,
        prompt_capacity=cfg.algorithm.max_prompt_length,
        response_capacity=cfg.algorithm.max_response_length,
        max_steps=cfg.agent.max_turns,
        pad_token_id=tokenizer.pad_token_id,
        policy_version=0,
    )
    assert columns.batch_size == (4 * per_episode,)
    trained = [ids[mask.bool()].tolist() for ids, mask in zip(columns["response_ids"], columns["response_mask"])]
    for e, result in enumerate(results):
        segments = len(result.segments)
        assert 2 <= segments <= per_episode and result.segments[1] == "message_edited", result.segments
        episode = trained[e * per_episode : (e + 1) * per_episode]
        # rows: the last segment, the earlier ones in order, then empty rows
        assert all(episode[:segments]) and not any(episode[segments:]), episode
        in_order = [token for row in [*episode[1:segments], episode[0]] for token in row]
        assert in_order == [token for turn in sampled[e] for token in turn]
        assert len(sampled[e]) == 3
        # the draft's step reward, posted after the draft turn: that turn's in the draft segment's row (the
        # episode's second), nothing on the other rows' turns (the returned reward is the last turn's rest)
        assert result.rewards[0] in (0.0, STEP_REWARD) and result.reward_turns == [(0, 0), None]
        turn_rewards = columns["turn_rewards"][e * per_episode : (e + 1) * per_episode]
        assert turn_rewards[1].tolist() == [pytest.approx(result.rewards[0]), 0.0, 0.0, 0.0]
        assert turn_rewards[0].eq(0).all() and turn_rewards[2:].eq(0).all()


def test_held_out_evaluation_runs_the_harness(run):
    # before any rollout (iteration 0) and after the last update
    evaluated = [r for r in jobs.records(run) if "val/accuracy" in r]
    assert [r["iteration"] for r in evaluated] == [0, ITERATIONS]
    for record in evaluated:  # every held-out episode was the harness's, three turns each, exact
        assert record["val/agent/ended/harness_done"] == HELD_OUT, record
        assert record["val/agent/turns_mean"] == 3.0
        assert record["val/agent/gateway/exact_episodes"] == HELD_OUT
        assert 0.0 <= record["val/reward"] <= 1.0 + STEP_REWARD
