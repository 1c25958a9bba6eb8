"""The reward worker writes what its recipe produces: the shaped reward, and for DAPO also the
unshaped score that dynamic sampling filters on; it reads each sample's ground truth in the sample's
train-file row, which the driver puts in the dock with the prompt (`prompt_row`)."""

from __future__ import annotations

import pytest
import torch
from dock_doubles import EOS, PAD, OneBatchDock, reward_worker_without_files
from tensordict import TensorDict

from rldock.config.job import JobConfig
from rldock.runtime.data import Columns, Row, load_rows
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.states import StageCall
from rldock.runtime.rewards import merge_reward_metrics
from rldock.runtime.workers.advantage import AdvantageWorker
from rldock.runtime.workers.reward import RewardWorker


def _worker(
    name: str, dock, rows=(Row("3+4=", "77", "addition"),), *, fuse: bool = False, num_prompts: int = 1, **sections
) -> RewardWorker:
    """`sections`: more of the job's config sections (agent)."""
    cfg = JobConfig(
        iterations=1,
        model={"path": "/nonexistent"},
        **sections,
        reward={"terms": [{"name": "exact_match"}]},
        algorithm={
            "name": name,
            "num_prompts_per_iteration": num_prompts,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 2,
            "max_response_length": 4,
            "learning_rate": 0.0,
            "dapo": {"overlong_buffer_length": 2, "overlong_penalty_factor": 1.0},
        },
    ).with_ablations(fuse_reward_advantage=fuse)
    return reward_worker_without_files(cfg, rows, dock)


@pytest.mark.parametrize("name", ["dapo", "grpo"])
def test_reward_worker_writes_the_shaped_reward_and_the_score(name):
    # Two correct answers "77": one of 2 tokens, one of 3 (with EOS), 1 token into the overlong buffer.
    response_ids = torch.tensor([[10, 10, PAD, PAD], [10, 10, EOS, PAD]])  # (B, SL)
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    batch = TensorDict(
        {"response_ids": response_ids, "response_mask": response_mask, "prompt_index": torch.tensor([0, 0])},
        batch_size=[2],
    )
    dock = OneBatchDock(batch)
    result = _worker(name, dock).compute_rewards(StageCall(1))
    assert set(dock.written.keys()) == {"reward", "score"}
    # The unshaped combined reward (the learning curve) stays in the dock, where the driver reads it
    # (sample_facts); only the per-term metrics go back in the stage's result.
    assert dock.written["score"].tolist() == [1.0, 1.0] and set(result.metrics) == {"reward_metrics"}
    assert merge_reward_metrics([result.metrics["reward_metrics"]]) == {"reward/exact_match": 1.0, "reward/errors": 0}
    if name == "dapo":
        assert dock.written["score"].tolist() == [1.0, 1.0]  # equally correct: not informative
        assert dock.written["reward"].tolist() == [1.0, 0.5]  # shaped: they differ


def test_ground_truth_comes_from_the_row_the_driver_put_with_the_prompt(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "a", "answer": 12}\n{"prompt": "b", "answer": "77"}\n{"prompt": "c", "answer": "5"}\n')
    rows = load_rows([train], Columns(prompt="prompt", answer="answer"))
    # Both responses say "77": right for row 1, wrong for rows 0 and 2.
    response_ids = torch.tensor([[10, 10, EOS], [10, 10, EOS], [10, 10, EOS]])  # (B, SL)
    batch = TensorDict(
        {
            "response_ids": response_ids,
            "response_mask": torch.ones_like(response_ids),
            "prompt_index": torch.tensor([1, 0, 2]),
        },
        batch_size=[3],
    )
    dock = OneBatchDock(batch)
    _worker("grpo", dock, rows).compute_rewards(StageCall(1))
    assert dock.written["score"].tolist() == [1.0, 0.0, 0.0]
    assert dock.written["reward"].tolist() == [1.0, 0.0, 0.0]


def test_a_model_term_scores_the_rm_score_column_the_reward_model_wrote():
    cfg = JobConfig(
        iterations=1,
        model={"path": "/nonexistent"},
        reward={"terms": [{"name": "exact_match"}, {"name": "model", "path": "/rm", "weight": 0.5}]},
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": 1,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 2,
            "max_response_length": 4,
            "learning_rate": 0.0,
        },
    ).with_ablations(fuse_reward_advantage=False)
    response_ids = torch.tensor([[10, 10, EOS], [9, 10, EOS]])  # "77" (right), "67" (wrong)
    batch = TensorDict(
        {
            "response_ids": response_ids,
            "response_mask": torch.ones_like(response_ids),
            "prompt_index": torch.tensor([0, 0]),
            "rm_score": torch.tensor([-1.0, 3.0]),
        },
        batch_size=[2],
    )
    dock = OneBatchDock(batch)
    worker = reward_worker_without_files(cfg, [Row("3+4=", "77", "addition")], dock)
    assert "rm_score" in worker.spec.consumes and worker.model_term == 1
    result = worker.compute_rewards(StageCall(1))
    assert dock.written["score"].tolist() == [0.5, 1.5]  # exact_match + 0.5 * rm_score
    assert dock.written["reward"].tolist() == [0.5, 1.5]
    assert merge_reward_metrics([result.metrics["reward_metrics"]])["reward/model"] == 1.0


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_fused_advantages_are_the_advantage_workers_bit_for_bit(name):
    # Two groups of 2 for row 0 ("77"): right and wrong; right in 2 tokens and in 3 (DAPO's overlong
    # shaping makes their rewards differ, and the advantage must use the shaped reward).
    response_ids = torch.tensor([[10, 10, PAD, PAD], [9, 10, EOS, PAD], [10, 10, PAD, PAD], [10, 10, EOS, PAD]])
    response_mask = (response_ids != PAD).long()  # (B, SL)
    batch = TensorDict(
        {
            "response_ids": response_ids,
            "response_mask": response_mask,
            "prompt_index": torch.zeros(4, dtype=torch.int64),
        },
        batch_size=[4],
    )
    unfused_dock = OneBatchDock(batch)
    unfused = _worker(name, unfused_dock, num_prompts=2)
    unfused.compute_rewards(StageCall(3))
    # the advantage state reads what the reward state wrote (DAPO's unshaped score too)
    columns = job_recipe(unfused.cfg.with_ablations(fuse_reward_advantage=False)).consumes["advantage"]
    advantage_dock = OneBatchDock(TensorDict({c: unfused_dock.written[c] for c in columns}, batch_size=[4]))
    advantage_dock.states = {"advantage": columns}
    AdvantageWorker(unfused.cfg, recipe=job_recipe(unfused.cfg), banks=advantage_dock).compute_advantages(StageCall(3))

    fused_dock = OneBatchDock(batch)
    fused = _worker(name, fused_dock, num_prompts=2, fuse=True)
    result = fused.compute_rewards(StageCall(3))
    assert fused.whole_groups and fused.batch_size % 2 == 0
    # One write: the advantages and the score (the driver's sample_facts, DAPO's filter); no state
    # reads the reward any more.
    assert set(fused_dock.written.keys()) == {"advantage", "score"}
    assert torch.equal(fused_dock.written["advantage"], advantage_dock.written["advantage"])
    assert fused_dock.written["advantage"].abs().sum() > 0  # a group with different rewards: not all zero
    assert fused_dock.written["score"].tolist() == [1.0, 0.0, 1.0, 1.0] and "rewards" not in result.metrics


@pytest.mark.parametrize("fuse", [False, True])
def test_an_episode_of_several_rows_is_scored_once_and_its_reward_written_on_each_row(fuse):
    """A harness's episodes of 2 rows (agent.max_segments): episode 0 is its right final segment "77" and an
    earlier segment "7" (which exact_match would score 0), episode 1 a wrong answer and an empty row. Each
    episode's first row is scored, its reward written on both rows; the metrics count 2 episodes."""
    response_ids = torch.tensor([[10, 10, EOS, PAD], [10, EOS, PAD, PAD], [10, EOS, PAD, PAD], [PAD] * 4])
    batch = TensorDict(
        {
            "response_ids": response_ids,
            "response_mask": (response_ids != PAD).to(torch.int64),
            "prompt_index": torch.zeros(4, dtype=torch.int64),
            "episode": torch.tensor([0, 0, 1, 1]),
            # a harness's trajectory columns (what the reward sees besides the text)
            "response_attention_mask": (response_ids != PAD).to(torch.int64),
            "num_turns": torch.ones(4, dtype=torch.int64),
            "num_tool_calls": torch.zeros(4, dtype=torch.int64),
            "num_tool_errors": torch.zeros(4, dtype=torch.int64),
            "environment_rewards": torch.zeros(4, 4),
            "num_environment_steps": torch.zeros(4, dtype=torch.int64),
        },
        batch_size=[4],
    )
    dock = OneBatchDock(batch)
    worker = _worker("grpo", dock, fuse=fuse, agent={"harness": "my_agent:run", "max_segments": 2})
    result = worker.compute_rewards(StageCall(1))
    assert dock.written["score"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert merge_reward_metrics([result.metrics["reward_metrics"]])["reward/exact_match"] == 0.5
    if fuse:  # the group's baseline: two episodes, one right, one wrong, whatever their rows
        advantage = dock.written["advantage"].tolist()
        assert advantage[0] == advantage[1] > 0 > advantage[2] == advantage[3]
        assert dock.written["episode_share"].tolist() == pytest.approx([3 / 5, 2 / 5, 1.0, 0.0])


@pytest.mark.parametrize(("name", "fuse", "rows"), [("grpo", True, 4), ("reinforce_plus_plus", False, 4)])
def test_a_request_of_episodes_is_whole_groups_not_the_whole_iteration(name, fuse, rows):
    """With segments the reward state asks for whole episodes (whole groups); REINFORCE++, whose
    advantage whitens over the iteration and never runs fused, must not wait for all 16 rows."""
    worker = _worker(
        name,
        None,
        fuse=fuse,
        num_prompts=4,
        agent={"harness": "my_agent:run", "max_segments": 2},
        training={"micro_batch_size": 4},
    )
    assert worker.whole_groups and (worker.advantage_stage is not None) == fuse
    assert worker.batch_size == rows  # a group: 2 episodes of 2 rows; the micro-batch holds one
