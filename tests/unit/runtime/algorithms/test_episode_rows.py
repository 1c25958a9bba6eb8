"""Episodes of several rows (a harness's segments): the group baselines, DAPO's filter and the loss's sequence
means count each episode once, whatever its segments; one row per episode gives today's numbers exactly."""

import pytest
import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.algorithms import get_advantage_estimator
from rldock.runtime.algorithms.aggregation import aggregate, aggregation_units
from rldock.runtime.algorithms.episode_rows import (
    at_heads,
    episode_heads,
    episode_share,
    episode_sums,
    one_per_row,
    row_episodes,
    to_rows,
)
from rldock.runtime.flow.catalogue import batch_advantage_stage, dapo_advantage_stage, group_advantage_stage

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def _algo(n: int):
    return JobConfig(
        iterations=1,
        model={"builder": "tiny-qwen2", "path": "/nonexistent"},
        algorithm={
            "name": "grpo",
            "num_responses_per_prompt": n,
            "num_prompts_per_iteration": 1,
            "max_prompt_length": 4,
            "max_response_length": 8,
            "learning_rate": 1e-3,
        },
    ).algorithm


def test_heads_and_rows_of_consecutive_episodes():
    episode = torch.tensor([4, 4, 4, 5, 6, 6])  # 3 segments, 1, 2
    assert episode_heads(episode).tolist() == [True, False, False, True, True, False]
    assert row_episodes(episode).tolist() == [0, 0, 0, 1, 2, 2]
    values = torch.tensor([1.0, 9.0, 9.0, 2.0, 3.0, 9.0])
    assert at_heads(values, episode).tolist() == [1.0, 2.0, 3.0]
    assert to_rows(torch.tensor([1.0, 2.0, 3.0]), episode).tolist() == [1.0, 1.0, 1.0, 2.0, 3.0, 3.0]
    assert episode_sums(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), episode).tolist() == [6.0, 4.0, 11.0]


def _segments_batch() -> TensorDict:
    """One group of N=4 episodes, S=3 rows each: episode 0 has 3 segments, the others 1 (then 2 empty rows).
    Every row of an episode carries its reward (the reward state writes it so); rewards 1, 0, 0, 0."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0]).repeat_interleave(3)  # (12,)
    tokens = torch.tensor([2, 3, 1, 4, 0, 0, 5, 0, 0, 6, 0, 0])  # (12,) model tokens per row
    mask = (torch.arange(8) < tokens.unsqueeze(1)).to(torch.int64)  # (12, 8)
    return TensorDict(
        {
            "reward": rewards,
            "score": rewards.clone(),
            "episode": torch.arange(4).repeat_interleave(3),
            "response_mask": mask,
        },
        batch_size=[12],
    )


@pytest.mark.parametrize("estimator", ["grpo", "grpo_mean_only", "rloo"])
def test_an_episode_of_three_segments_weighs_as_one_episode_in_the_baseline(estimator):
    batch = _segments_batch()
    columns = group_advantage_stage(estimator)(batch, _algo(4), None)
    per_episode = get_advantage_estimator(estimator)(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)  # (4,)
    assert torch.equal(columns["advantage"], per_episode.repeat_interleave(3))
    # counted per row, the 3-segment episode's reward would sit three times in its group's mean
    per_row = get_advantage_estimator(estimator)(batch["reward"][:8], 4)  # rows 0..7 as if they were samples
    assert not torch.allclose(columns["advantage"][:8], per_row)
    assert columns["episode_share"].tolist()[:3] == pytest.approx([2 / 6, 3 / 6, 1 / 6])
    assert columns["episode_share"].tolist()[3:6] == [1.0, 0.0, 0.0]  # one segment: share 1; empty rows 0


def test_the_batch_estimator_weighs_an_episode_by_all_its_segments_tokens():
    batch = _segments_batch()
    columns = batch_advantage_stage("reinforce_plus_plus")(batch, _algo(4), None)
    expected = get_advantage_estimator("reinforce_plus_plus")(
        torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, token_counts=torch.tensor([6, 4, 5, 6])
    )
    assert torch.equal(columns["advantage"], expected.repeat_interleave(3))


def test_dapo_filters_groups_by_episodes():
    """A group whose episodes all score alike is zeroed, however many segment rows (with scores that differ,
    as rows the reward never judged could) each holds."""
    batch = _segments_batch()
    columns = dapo_advantage_stage(batch, _algo(4), None)
    assert columns["advantage"].abs().sum() > 0
    batch["score"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0])  # heads all 1
    assert columns["advantage"].shape == (12,)
    assert dapo_advantage_stage(batch, _algo(4), None)["advantage"].abs().sum() == 0


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_one_row_per_episode_gives_todays_advantages_exactly(estimator):
    rewards = torch.rand(8, generator=torch.Generator().manual_seed(0))
    batch = TensorDict({"reward": rewards}, batch_size=[8])  # no episode column: a job without segments
    columns = group_advantage_stage(estimator)(batch, _algo(4), None)
    assert set(columns) == {"advantage"}
    assert torch.equal(columns["advantage"], get_advantage_estimator(estimator)(rewards, 4))
    batch["episode"] = one_per_row(8)
    batch["response_mask"] = torch.ones(8, 3, dtype=torch.int64)
    with_column = group_advantage_stage(estimator)(batch, _algo(4), None)
    assert torch.equal(with_column["advantage"], columns["advantage"])
    assert torch.equal(with_column["episode_share"], torch.ones(8))


def _values(rows=6, tokens=8):
    return torch.randn(rows, tokens, generator=torch.Generator().manual_seed(1))  # (B, T)


def test_the_sequence_means_count_an_episode_once_as_its_segments_joined():
    """Episode 0 split over rows 0..2 aggregates as the one row holding all its tokens would."""
    batch = _segments_batch()
    mask = batch["response_mask"].float()[:6]  # episodes 0 (3 segments) and 1 (1 segment, 2 empty rows)
    values = _values()
    share = episode_share(mask, batch["episode"][:6])
    # the joined rows: episode 0's 6 tokens in one row, episode 1's 4 in another
    joined_values = torch.zeros(2, 12)
    joined_mask = torch.zeros(2, 12)
    joined_values[0, :6] = values[:3][mask[:3].bool()]
    joined_mask[0, :6] = 1
    joined_values[1, :4] = values[3, :4]
    joined_mask[1, :4] = 1
    for mode in MODES:
        segmented = aggregate(values, mask, mode, norm_length=8, episode_share=share)
        joined = aggregate(joined_values, joined_mask, mode, norm_length=8)
        assert segmented.item() == pytest.approx(joined.item(), abs=1e-6), mode
    # seq-mean modes count episodes, not rows: 2 units
    assert aggregation_units(mask, "seq_mean_token_mean", episode_share=share).item() == pytest.approx(2.0)
    # without the shares a 3-segment episode would count as three responses
    assert aggregation_units(mask, "seq_mean_token_mean").item() == 4.0


@pytest.mark.parametrize("mode", MODES)
def test_shares_of_one_give_todays_aggregate_bit_for_bit(mode):
    values = _values()
    mask = (torch.arange(8) < torch.tensor([3, 8, 0, 5, 1, 2]).unsqueeze(1)).float()  # an empty row
    share = episode_share(mask, one_per_row(6))
    today = aggregate(values, mask, mode, norm_length=8)
    assert torch.equal(aggregate(values, mask, mode, norm_length=8, episode_share=share), today)
    assert torch.equal(
        aggregation_units(mask, mode, norm_length=8, episode_share=share), aggregation_units(mask, mode, norm_length=8)
    )


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum"])
def test_an_episode_split_over_micro_batches_aggregates_as_the_whole(mode):
    """The shares are the whole episode's (the advantage stage sees whole episodes), so a micro-batch that
    holds part of an episode adds its part of the unit."""
    batch = _segments_batch()
    mask, values = batch["response_mask"].float(), _values(rows=12)
    share = episode_share(mask, batch["episode"])
    whole = aggregate(values, mask, mode, episode_share=share)
    parts = [slice(0, 2), slice(2, 7), slice(7, 12)]  # episode 0 cut between the first two parts
    units = aggregation_units(mask, mode, episode_share=share)
    summed = sum(
        aggregate(values[p], mask[p], mode, episode_share=share[p])
        * aggregation_units(mask[p], mode, episode_share=share[p])
        / units
        for p in parts
    )
    assert summed.item() == pytest.approx(whole.item(), abs=1e-6)
