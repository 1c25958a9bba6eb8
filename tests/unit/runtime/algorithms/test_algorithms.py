"""Tests of the RL tensor functions on hand-computed numbers."""

import math

import pytest
import torch

from rldock.runtime.algorithms import (
    clipped_policy_loss,
    clipped_sequence_mean_policy_loss,
    get_advantage_estimator,
    get_policy_loss,
    grpo_advantages,
    grpo_mean_only_advantages,
    kl_penalty,
    masked_mean,
)

S = 1 / math.sqrt(2)  # (1 - 0.5) / unbiased std of [1, 0] (= sqrt(0.5))


def test_grpo_advantages_two_groups_of_two():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    assert torch.allclose(adv, torch.tensor([S, -S, -S, S]), atol=1e-5)


def test_grpo_advantages_group_of_four():
    # mean 0.25; unbiased std = sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)


def test_grpo_advantages_equal_rewards_give_zero_not_nan():
    adv = grpo_advantages(torch.tensor([0.3, 0.3, 1.0, 0.0]), group_size=2)
    assert torch.equal(adv[:2], torch.zeros(2))
    assert adv.dtype == torch.float32


def test_grpo_advantages_refuse_rewards_that_are_not_one_per_sample():
    # N >= 2 and whole groups are the config's bound and the dock's layout, asserted (issue 65)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        grpo_advantages(torch.zeros(2, 2), 2)


def test_mean_only_advantages():
    adv = grpo_mean_only_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2)
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def _one_token(ratio, advantage, fn=clipped_policy_loss):
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)  # (1, 1); old logprob 0
    out = fn(logprobs, torch.zeros(1, 1), torch.tensor([advantage]), torch.ones(1, 1), clip_ratio=0.2)
    out.loss.backward()
    return out, logprobs.grad.item()


@pytest.mark.parametrize(
    "ratio, advantage, loss, clipped",
    [
        (1.5, +1.0, -1.2, True),  # pushed past 1 + eps in the advantage's direction: clipped, no gradient
        (1.5, -1.0, 1.5, False),  # moved against a negative advantage: unclipped, full penalty
        (0.5, +1.0, -0.5, False),  # moved against a positive advantage: unclipped
        (0.5, -1.0, 0.8, True),  # pushed below 1 - eps with a negative advantage: clipped
    ],
)
def test_clipped_loss_one_token(ratio, advantage, loss, clipped):
    out, grad = _one_token(ratio, advantage)
    assert out.loss.item() == pytest.approx(loss, abs=1e-6)
    assert out.metrics["clip_fraction"] == (1.0 if clipped else 0.0)
    assert out.metrics["ratio_mean"] == pytest.approx(ratio)
    if clipped:
        assert grad == 0.0
    else:
        assert grad == pytest.approx(-advantage * ratio)  # d(-A * exp(lp)) / d lp


def test_clipped_loss_is_a_token_mean_over_valid_tokens():
    logprobs = torch.zeros(2, 3, requires_grad=True)  # ratio 1 everywhere
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    old = torch.zeros(2, 3)
    old[1, 1:] = 50.0  # garbage in padded positions must not matter
    out = clipped_policy_loss(logprobs, old, torch.tensor([1.0, -2.0]), mask, clip_ratio=0.2)
    # token losses: three of -1 and one of +2 -> (-3 + 2) / 4
    assert out.loss.item() == pytest.approx(-0.25)
    out.loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-0.25, -0.25, -0.25], [0.5, 0.0, 0.0]]))


def test_sequence_mean_loss_weights_each_response_equally():
    logprobs = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = clipped_sequence_mean_policy_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -2.0]), mask, 0.2)
    assert out.loss.item() == pytest.approx((-1.0 + 2.0) / 2)


def test_clipped_loss_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\(B,\)"):
        clipped_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), 0.2)


def test_kl_k3_and_k1_for_a_known_pair():
    logprobs = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    mask = torch.ones(1, 1)
    # log r = log(0.25 / 0.5) = -ln 2; k3 = r - log r - 1 = 0.5 + ln 2 - 1
    assert kl_penalty(logprobs, ref, mask, "k3").item() == pytest.approx(0.5 + math.log(2) - 1)
    assert kl_penalty(logprobs, ref, mask, "k1").item() == pytest.approx(math.log(2))


def test_kl_is_zero_for_equal_policies_and_masks_padding():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    ref = logprobs.clone()
    ref[1, 1] = 10.0  # padded position
    mask = torch.tensor([[1, 1], [1, 0]])
    assert kl_penalty(logprobs, ref, mask).item() == 0.0


def test_kl_unknown_estimator_lists_valid_ones():
    with pytest.raises(ValueError, match=r"'k9'.*\['k1', 'k3'\]"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "k9")


def test_masked_mean_total_and_per_row():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(1.5)
    assert torch.allclose(masked_mean(values, mask, dim=1), torch.tensor([1.5, 0.0]))


def test_registries_resolve_names_and_list_valid_ones():
    assert get_advantage_estimator("grpo") is grpo_advantages
    assert get_policy_loss("clipped") is clipped_policy_loss
    with pytest.raises(ValueError, match=r"'ppo'.*grpo"):
        get_advantage_estimator("ppo")
    with pytest.raises(ValueError, match=r"'vanilla'.*clipped"):
        get_policy_loss("vanilla")


def test_kl_without_mask_gives_per_token_estimates():
    logprobs = torch.tensor([[math.log(0.5), 0.0]])
    ref = torch.tensor([[math.log(0.25), 0.0]])
    per_token = kl_penalty(logprobs, ref, estimator="k1")
    assert per_token.shape == (1, 2)
    assert torch.allclose(per_token, torch.tensor([[math.log(2), 0.0]]))


def test_policy_loss_metrics_are_detached_scalars():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    out = clipped_policy_loss(logprobs, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), 0.2)
    assert not out.clip_fraction.requires_grad and not out.ratio_mean.requires_grad
    assert out.metrics == {
        "clip_fraction": 0.0,
        "ratio_mean": 1.0,
        "dual_clip_fraction": 0.0,
        "log_ratio_clamp_fraction": 0.0,
    }
