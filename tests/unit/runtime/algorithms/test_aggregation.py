"""Loss aggregation equals verl's `agg_loss` on the same inputs (empty rows left out), PF-PPO's
weights apply per token, and a batch split into micro-batches and ranks aggregates as the whole."""

import pytest
import torch

from rldock.runtime.algorithms import get_policy_loss
from rldock.runtime.algorithms.aggregation import LOSS_AGGREGATIONS, additive_units, aggregate, aggregation_units

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def _verl_agg_loss(loss_mat, loss_mask, mode):
    """verl's `agg_loss` written out from its definition (mask (B, T) 0/1, T = the mask's width):
    token-mean:              sum(l m) / sum(m)
    seq-mean-token-mean:     mean_b [ sum_t(l m) / sum_t(m) ]
    seq-mean-token-sum:      mean_b [ sum_t(l m) ]
    seq-mean-token-sum-norm: sum_b [ sum_t(l m) ] / T
    """
    seq_sums = (loss_mat * loss_mask).sum(dim=-1)  # (B,)
    if mode == "token_mean":
        return seq_sums.sum() / loss_mask.sum()
    if mode == "seq_mean_token_mean":
        return (seq_sums / loss_mask.sum(dim=-1)).mean()
    if mode == "seq_mean_token_sum":
        return seq_sums.mean()
    return seq_sums.sum() / loss_mask.shape[-1]


def _batch(seed=0, rows=6, tokens=5):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, tokens, generator=generator)  # (B, T)
    lengths = torch.randint(1, tokens + 1, (rows,), generator=generator)
    mask = (torch.arange(tokens) < lengths.unsqueeze(1)).float()  # (B, T) right-padded, no empty row
    return values, mask


def test_the_registry_holds_exactly_the_config_modes():
    assert list(LOSS_AGGREGATIONS) == sorted(MODES)


@pytest.mark.parametrize("mode", MODES)
def test_equals_verls_agg_loss(mode):
    values, mask = _batch()
    ours = aggregate(values, mask, mode, norm_length=mask.shape[1])
    assert ours.item() == pytest.approx(_verl_agg_loss(values, mask, mode).item(), abs=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_rows_with_no_tokens_are_left_out(mode):
    values, mask = _batch(seed=1)
    with_empty = torch.cat([mask[:3], torch.zeros(2, mask.shape[1]), mask[3:]])  # two empty responses
    padded_values = torch.cat([values[:3], torch.full((2, mask.shape[1]), 7.0), values[3:]])
    ours = aggregate(padded_values, with_empty, mode, norm_length=mask.shape[1])
    assert ours.item() == pytest.approx(_verl_agg_loss(values, mask, mode).item(), abs=1e-6)


def test_token_mean_without_weights_is_todays_masked_mean_bit_for_bit():
    values, mask = _batch(seed=2)
    assert torch.equal(aggregate(values, mask), (values * mask).sum() / mask.sum())


@pytest.mark.parametrize("mode", MODES)
def test_a_weight_0_response_adds_nothing(mode):
    """PF-PPO: weights (0 for filtered responses) apply to each response's tokens; with the kept
    responses' weights equal, the aggregate is that of the kept responses alone."""
    values, mask = _batch(seed=3)
    weights = torch.tensor([0.0, 2.0, 0.0, 2.0, 2.0, 0.0])
    kept = weights > 0
    ours = aggregate(values, mask, mode, row_weights=weights, norm_length=5)
    alone = aggregate(values[kept], mask[kept], mode, norm_length=5)
    scale = 2.0 if mode == "seq_mean_token_sum_norm" else 1.0  # a sum, not a mean: the weight stays
    assert ours.item() == pytest.approx(scale * alone.item(), abs=1e-6)


def test_pf_ppo_weights_weight_tokens_in_sum_and_count():
    values = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # token mean: (0.5 * 3 * 1 + 1.5 * 4) / (0.5 * 3 + 1.5 * 1) = 7.5 / 3 = 2.5
    assert aggregate(values, mask, row_weights=torch.tensor([0.5, 1.5])).item() == pytest.approx(2.5)
    # the sequence mean: (0.5 * 1 + 1.5 * 4) / (0.5 + 1.5) = 3.25
    assert aggregate(values, mask, "seq_mean_token_mean", row_weights=torch.tensor([0.5, 1.5])).item() == pytest.approx(
        3.25
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_split_batch_aggregates_as_the_whole(mode):
    """What the actor does: each part's aggregate scaled by its units over the mean units per rank,
    then averaged over ranks (DDP), equals the aggregate of the whole batch."""
    values, mask = _batch(seed=4, rows=8)
    mask[5] = 0  # an empty response in one part
    weights = torch.rand(8, generator=torch.Generator().manual_seed(5))
    whole = aggregate(values, mask, mode, row_weights=weights, norm_length=5)
    ranks = [slice(0, 4), slice(4, 8)]
    total_units = sum(aggregation_units(mask[r], mode, row_weights=weights[r], norm_length=5) for r in ranks)
    if not additive_units(mode):
        total_units = aggregation_units(mask, mode, norm_length=5)
    per_rank = total_units / len(ranks)
    rank_losses = []
    for r in ranks:
        parts = [slice(r.start, r.start + 2), slice(r.start + 2, r.stop)]  # two micro-batches
        rank_losses.append(
            sum(
                aggregate(values[p], mask[p], mode, row_weights=weights[p], norm_length=5)
                * aggregation_units(mask[p], mode, row_weights=weights[p], norm_length=5)
                / per_rank
                for p in parts
            )
        )
    assert (sum(rank_losses) / len(ranks)).item() == pytest.approx(whole.item(), abs=1e-6)


@pytest.mark.parametrize(
    "name, kwargs",
    [("clipped", {"clip_ratio": 0.2}), ("decoupled_clip", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28})],
)
@pytest.mark.parametrize("mode", MODES)
def test_policy_losses_aggregate_their_token_losses_by_the_mode(name, kwargs, mode):
    generator = torch.Generator().manual_seed(6)
    old = -torch.rand(4, 3, generator=generator)
    logprobs = old + torch.randn(4, 3, generator=generator) * 0.3
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([1.0, -1.0, 2.0, -0.5])
    ratio = torch.exp(logprobs - old)
    token_loss = torch.maximum(
        -advantages[:, None] * ratio, -advantages[:, None] * ratio.clamp(0.8, 1 + kwargs.get("clip_ratio_high", 0.2))
    )
    out = get_policy_loss(name)(logprobs, old, advantages, mask, aggregation=mode, norm_length=3, **kwargs)
    keep = mask.sum(dim=1) > 0
    assert out.loss.item() == pytest.approx(_verl_agg_loss(token_loss[keep], mask[keep], mode).item(), abs=1e-6)


def test_unknown_mode_names_the_field():
    with pytest.raises(ValueError, match="algorithm.loss_aggregation"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "seq_sum")
