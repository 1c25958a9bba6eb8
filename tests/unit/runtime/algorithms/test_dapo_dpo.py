"""DAPO and DPO tensor functions on hand-computed numbers."""

import math

import pytest
import torch

from rldock.runtime.algorithms.dapo import decoupled_clip_policy_loss, informative_groups, overlong_penalty
from rldock.runtime.algorithms.dpo import dpo_loss, sequence_logprobs, split_pairs
from rldock.runtime.algorithms.losses import get_policy_loss


def _one_token(ratio, advantage, low=0.2, high=0.28):
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)  # (1, 1); old logprob 0
    out = decoupled_clip_policy_loss(
        logprobs,
        torch.zeros(1, 1),
        torch.tensor([advantage]),
        torch.ones(1, 1),
        clip_ratio_low=low,
        clip_ratio_high=high,
    )
    out.loss.backward()
    return out, logprobs.grad.item()


@pytest.mark.parametrize(
    "ratio, advantage, loss, grad, clipped",
    [
        (1.25, 1.0, -1.25, -1.25, 0.0),  # inside 1 + 0.28: still pushed up (a symmetric 0.2 clip would stop it)
        (1.5, 1.0, -1.28, 0.0, 1.0),  # past 1 + 0.28: clipped, no gradient
        (0.85, -1.0, 0.85, 0.85, 0.0),  # inside 1 - 0.2
        (0.7, -1.0, 0.8, 0.0, 1.0),  # past 1 - 0.2: clipped
        (0.7, 1.0, -0.7, -0.7, 0.0),  # below the lower clip with a positive advantage: min keeps the unclipped term
    ],
)
def test_decoupled_clip_bounds(ratio, advantage, loss, grad, clipped):
    out, g = _one_token(ratio, advantage)
    assert out.loss.item() == pytest.approx(loss, abs=1e-6)
    assert g == pytest.approx(grad, abs=1e-6)
    assert out.clip_fraction.item() == clipped


def test_decoupled_clip_with_equal_bounds_is_the_symmetric_loss():
    out, g = _one_token(1.25, 1.0, low=0.2, high=0.2)
    assert out.loss.item() == pytest.approx(-1.2) and g == 0.0


def test_decoupled_clip_is_a_token_mean_over_the_batch():
    # ratio 1 everywhere: token losses -A. Response 0 has 3 tokens at A=1, response 1 one token
    # at A=-2: (-1 - 1 - 1 + 2) / 4 = -0.25 (a per-response mean would give (-1 + 2) / 2 = 0.5).
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    out = decoupled_clip_policy_loss(
        torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -2.0]), mask, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    assert out.loss.item() == pytest.approx(-0.25)


def test_decoupled_clip_is_registered():
    assert get_policy_loss("decoupled_clip") is decoupled_clip_policy_loss


def test_overlong_penalty_ramps_over_the_buffer():
    # L_max 10, buffer 4: no penalty up to 6 tokens, then -(L - 6) / 4 * 0.5, at most -0.5.
    lengths = torch.tensor([5, 6, 7, 10, 12])
    penalty = overlong_penalty(lengths, max_length=10, buffer_length=4, penalty_factor=0.5)
    assert torch.allclose(penalty, torch.tensor([0.0, 0.0, -0.125, -0.5, -0.5]))
    assert penalty.dtype == torch.float32


def test_informative_groups_keeps_groups_with_differing_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5 + 1e-8, 0.0, 0.0, 0.2, 0.7])
    assert informative_groups(rewards, group_size=2).tolist() == [False, True, False, False, True]


def test_sequence_logprobs_sum_response_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert sequence_logprobs(logprobs, mask).tolist() == [-3.0, -1.0]


def test_split_pairs_even_rows_are_chosen():
    chosen, rejected = split_pairs(torch.tensor([1, 2, 3, 4]))
    assert chosen.tolist() == [1, 3] and rejected.tolist() == [2, 4]
    with pytest.raises(ValueError):
        split_pairs(torch.tensor([1, 2, 3]))


def test_dpo_loss_two_pairs():
    # Pair 1: implicit rewards 0.1 * (-1 + 1.5) = 0.05 and 0.1 * (-2 + 1.5) = -0.05, logit 0.1,
    # loss log(1 + e^-0.1) = 0.644397. Pair 2: policy = reference, logit 0, loss log 2.
    policy = torch.tensor([-1.0, -2.0, -3.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.5, -3.0, -1.0])
    out = dpo_loss(policy, ref, beta=0.1)
    assert out.loss.item() == pytest.approx((0.6443967 + math.log(2)) / 2, abs=1e-6)
    assert out.reward_accuracy.item() == 0.5  # a tie is not a win
    assert out.reward_margin.item() == pytest.approx(0.05)
    assert out.policy_accuracy.item() == 0.5  # pair 1: -1 > -2; pair 2: -3 < -1
    out.loss.backward()
    # d/d chosen of -log sigmoid(beta (c - r) + ...) = -beta * sigmoid(-logit), over 2 pairs
    assert policy.grad[0].item() == pytest.approx(-0.1 * (1 / (1 + math.exp(0.1))) / 2, abs=1e-7)
    assert policy.grad[1].item() == pytest.approx(0.1 * (1 / (1 + math.exp(0.1))) / 2, abs=1e-7)
    assert policy.grad[2].item() == pytest.approx(-0.1 * 0.5 / 2, abs=1e-7)


def test_dpo_label_smoothing():
    # logit 0.1: 0.9 * log(1 + e^-0.1) + 0.1 * log(1 + e^0.1) = 0.9 * 0.644397 + 0.1 * 0.744397
    out = dpo_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.5]), beta=0.1, label_smoothing=0.1)
    assert out.loss.item() == pytest.approx(0.6543967, abs=1e-6)


def test_dpo_loss_refuses_bad_inputs():
    with pytest.raises(ValueError, match="shape"):
        dpo_loss(torch.zeros(4), torch.zeros(2), beta=0.1)


def _dapo_spec(**kw):
    from rldock.config.algorithm import AlgorithmSpec

    return AlgorithmSpec(
        name="dapo",
        num_prompts_per_iteration=3,
        num_responses_per_prompt=4,
        max_prompt_length=4,
        max_response_length=6,
        learning_rate=0.0,
        **kw,
    )


@pytest.mark.parametrize("dynamic_sampling", [True, False])
def test_dapo_groups_of_equal_scores_get_advantage_exactly_zero(dynamic_sampling):
    """A padded group (all correct, one response 0.01 into the overlong ramp) trains with advantage
    0, not GRPO's std-amplified length signal (+0.35 x3, -1.5 here); so does every equal-score group
    with dynamic sampling off. The informative group keeps GRPO's advantages on the shaped reward."""
    from rldock.runtime.algorithms.advantages import grpo_advantages
    from rldock.runtime.flow.catalogue import get_recipe

    score = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])  # (B,) unshaped
    reward = score - torch.tensor([0.0, 0.0, 0.0, 0.01, 0.0, 0.01, 0.0, 0.0, 0.0, 0.0, 0.01, 0.0])  # shaped
    assert grpo_advantages(reward[:4], 4).abs().max() > 1  # what the group would have trained on
    stage = get_recipe("dapo").advantage_stage
    out = stage(
        {"reward": reward, "score": score}, _dapo_spec(dapo={"dynamic_sampling": dynamic_sampling}), torch.Generator()
    )["advantage"]
    assert out[:8].tolist() == [0.0] * 8 and not torch.signbit(out[:8]).any()  # +0.0 exactly
    assert torch.equal(out[8:], grpo_advantages(reward[8:], 4))


def test_dapo_advantage_reads_the_unshaped_score_fused_or_not():
    from rldock.config import JobConfig
    from rldock.runtime.flow.job_recipe import job_recipe

    for fuse in (True, False):
        cfg = JobConfig(
            iterations=1,
            model={"path": "m"},
            training={"micro_batch_size": 4},
            algorithm={
                "name": "dapo",
                "num_prompts_per_iteration": 2,
                "num_responses_per_prompt": 2,
                "max_prompt_length": 4,
                "max_response_length": 4,
                "learning_rate": 0.0,
            },
        ).with_ablations(fuse_reward_advantage=fuse)
        recipe = job_recipe(cfg)
        assert cfg.algorithm.kl_coef == 0 and "reference" not in recipe.consumes
        reads = recipe.consumes["reward" if fuse else "advantage"]
        assert ("score" in recipe.produces["reward"]) and (fuse or "score" in reads)
