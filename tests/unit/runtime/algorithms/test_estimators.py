"""RLOO, REINFORCE++ (and its baseline variant) and GSPO on examples computed by hand from each
paper's formula; their recipes."""

import math

import pytest
import torch

from rldock.config import JobConfig
from rldock.runtime.algorithms import (
    get_advantage_estimator,
    get_policy_loss,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from rldock.runtime.flow.catalogue import get_recipe
from rldock.runtime.flow.job_recipe import job_recipe


def test_rloo_subtracts_the_mean_of_the_other_responses():
    """RLOO (arXiv 2402.14740, eq. 7 / sec. 3.3): A_i = r_i - 1/(k-1) sum_{j != i} r_j. Group
    [1, 0, 0.5, 0.5]: A_1 = 1 - (0 + 0.5 + 0.5)/3 = 2/3; A_2 = 0 - (1 + 0.5 + 0.5)/3 = -2/3;
    A_3 = A_4 = 0.5 - (1 + 0 + 0.5)/3 = 0. Group [1, 1, 1, 0]: A = 1 - 2/3 (x3), 0 - 1 = -1."""
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.0, 0.0]), group_size=4)
    expected = torch.tensor([2 / 3, -2 / 3, 0.0, 0.0, 1 / 3, 1 / 3, 1 / 3, -1.0])
    assert torch.allclose(adv, expected, atol=1e-6)
    # = N/(N-1) times GRPO's mean-only advantage
    mean_only = get_advantage_estimator("grpo_mean_only")(torch.tensor([1.0, 0.0, 0.5, 0.5]), 4)
    assert torch.allclose(adv[:4], mean_only * 4 / 3, atol=1e-6)


def test_reinforce_plus_plus_normalises_over_the_batch():
    """REINFORCE++ (arXiv 2501.03262): A = (r - mean_batch r) / std_batch r. Rewards [1, 0, 1, 1]:
    mean 0.75, unbiased variance (3 * 0.25^2 + 0.75^2) / 3 = 0.25, std 0.5, so A = [0.5, -1.5, 0.5, 0.5]."""
    adv = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
    assert torch.allclose(adv, torch.tensor([0.5, -1.5, 0.5, 0.5]), atol=1e-5)


def test_reinforce_plus_plus_weights_each_response_by_its_tokens():
    """Over tokens (verl's masked_whiten): responses of 3, 1, 1, 1 tokens with rewards 1, 0, 0, 1
    are 6 tokens, 4 of reward 1: mean 4/6 = 2/3; unbiased variance (4 (1/3)^2 + 2 (2/3)^2) / 5
    = (4/9 + 8/9) / 5 = 4/15; A(1) = (1/3) / sqrt(4/15), A(0) = -(2/3) / sqrt(4/15). (By response
    the mean would be 1/2.)"""
    adv = reinforce_plus_plus_advantages(
        torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2, token_counts=torch.tensor([3, 1, 1, 1])
    )
    std = math.sqrt(4 / 15)
    assert torch.allclose(adv, torch.tensor([1 / 3 / std, -2 / 3 / std, -2 / 3 / std, 1 / 3 / std]), atol=1e-5)


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_then_normalises_over_the_batch():
    """REINFORCE++-baseline: A' = r - mean_group r, then (A' - mean_batch A') / std_batch A'.
    Rewards [1, 0 | 1, 1]: A' = [0.5, -0.5, 0, 0], batch mean 0, unbiased variance 0.5 / 3 = 1/6,
    so A = [0.5, -0.5, 0, 0] / sqrt(1/6) = [sqrt(1.5), -sqrt(1.5), 0, 0]."""
    adv = reinforce_plus_plus_baseline_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
    assert torch.allclose(adv, torch.tensor([math.sqrt(1.5), -math.sqrt(1.5), 0.0, 0.0]), atol=1e-5)


def test_batch_normalised_estimators_of_one_token_or_equal_rewards_are_zero_not_nan():
    assert torch.equal(reinforce_plus_plus_advantages(torch.ones(4), 2), torch.zeros(4))
    assert torch.equal(reinforce_plus_plus_baseline_advantages(torch.ones(4), 2), torch.zeros(4))


def _gspo(logprobs, advantages, mask, low, high, **kw):
    logprobs = logprobs.clone().requires_grad_(True)
    out = get_policy_loss("gspo")(
        logprobs, torch.zeros_like(logprobs), advantages, mask, clip_ratio_low=low, clip_ratio_high=high, **kw
    )
    out.loss.backward()
    return out, logprobs.grad


def test_gspo_sequence_ratio_on_a_hand_computed_response():
    """GSPO eq. 5: s = exp(mean_t log ratio). One response of 2 tokens with log ratios 0.2 and 0:
    s = e^0.1 = 1.10517. A = 1 and the clip [0.8, 1.2]: loss -s, each token's gradient -s / 2 (the
    response's mean over its tokens). The paper's clip [1 - 3e-4, 1 + 4e-4]: s is past 1 + 4e-4
    with A > 0, so the loss is -(1 + 4e-4) with no gradient. A = -1: the unclipped term s is the
    larger, loss s, gradient +s / 2."""
    logprobs, mask = torch.tensor([[0.2, 0.0]]), torch.ones(1, 2)
    s = math.exp(0.1)
    out, grad = _gspo(logprobs, torch.tensor([1.0]), mask, 0.2, 0.2)
    assert out.loss.item() == pytest.approx(-s, rel=1e-6)
    assert torch.allclose(grad, torch.tensor([[-s / 2, -s / 2]]))
    out, grad = _gspo(logprobs, torch.tensor([1.0]), mask, 3e-4, 4e-4)
    assert out.loss.item() == pytest.approx(-(1 + 4e-4), rel=1e-6) and torch.equal(grad, torch.zeros(1, 2))
    assert out.clip_fraction.item() == 1.0
    out, grad = _gspo(logprobs, torch.tensor([-1.0]), mask, 3e-4, 4e-4)
    assert out.loss.item() == pytest.approx(s, rel=1e-6)
    assert torch.allclose(grad, torch.tensor([[s / 2, s / 2]]))


def test_gspo_token_form_equals_the_sequence_objective_and_its_gradient():
    """With one advantage per response, the GSPO-token loss under seq_mean_token_mean has the value
    and the gradient of eq. 5 written with the sequence ratio itself:
    -1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(sum_t m (log pi - log pi_old) / |y_i|)."""
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(5, 4, generator=generator)
    logprobs = old + torch.randn(5, 4, generator=generator) * 0.05
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.3, 2.0])
    ours_lp = logprobs.clone().requires_grad_(True)
    ours = get_policy_loss("gspo")(ours_lp, old, advantages, mask, clip_ratio_low=0.01, clip_ratio_high=0.02)
    ours.loss.backward()
    theirs_lp = logprobs.clone().requires_grad_(True)
    s = torch.exp(((theirs_lp - old) * mask).sum(dim=1) / mask.sum(dim=1))  # (B,)
    theirs = -torch.minimum(s * advantages, s.clamp(0.99, 1.02) * advantages).mean()
    theirs.backward()
    assert ours.loss.item() == pytest.approx(theirs.item(), abs=1e-6)
    assert torch.allclose(ours_lp.grad, theirs_lp.grad, atol=1e-6)
    assert 0 < ours.clip_fraction.item() < 1  # both branches covered


def _cfg(name, **algorithm):
    return JobConfig(
        iterations=1,
        model={"path": "m"},
        training={"micro_batch_size": 4},
        algorithm={
            "name": name,
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 4,
            "max_response_length": 4,
            "learning_rate": 0.0,
            **algorithm,
        },
    )


@pytest.mark.parametrize(
    "name, estimator, scope, fused",
    [
        ("rloo", "rloo", "groups", True),
        ("reinforce_plus_plus", "reinforce_plus_plus", "iteration", False),
        ("reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline", "iteration", False),
        ("gspo", "grpo", "groups", True),
    ],
)
def test_recipes_of_the_new_estimators(name, estimator, scope, fused):
    recipe = get_recipe(name)
    assert recipe.advantage_scope == scope and not recipe.needs_critic
    assert job_recipe(_cfg(name)).advantage_in_reward is fused
    batch = {
        "reward": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "response_mask": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]]),
    }
    out = recipe.advantage_stage(batch, _cfg(name).algorithm, torch.Generator())["advantage"]
    kwargs = {"token_counts": batch["response_mask"].sum(dim=1)} if scope == "iteration" else {}
    assert torch.equal(out, get_advantage_estimator(estimator)(batch["reward"], 2, **kwargs))


def test_gspo_defaults_to_the_sequence_mean_and_its_own_clip():
    algo = _cfg("gspo").algorithm
    assert algo.loss_aggregation == "seq_mean_token_mean"
    assert get_recipe("gspo").policy_loss_kwargs(algo) == {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
    assert _cfg("gspo", loss_aggregation="token_mean").algorithm.loss_aggregation == "token_mean"
    assert _cfg("grpo").algorithm.loss_aggregation == "token_mean"


@pytest.mark.parametrize(
    "example, name",
    [
        ("rloo-tiny.yaml", "rloo"),
        ("reinforce-plus-plus-tiny.yaml", "reinforce_plus_plus"),
        ("reinforce-plus-plus-baseline-tiny.yaml", "reinforce_plus_plus_baseline"),
        ("gspo-tiny.yaml", "gspo"),
    ],
)
def test_examples_are_the_demo_with_only_the_algorithm_changed(example, name):
    from pathlib import Path

    from rldock.config import load_job_config

    examples = Path(__file__).resolve().parents[4] / "examples"
    cfg, demo = load_job_config(examples / example), load_job_config(examples / "grpo-tiny.yaml")
    assert cfg.algorithm.name == name
    own = {"name", "gspo", "clip_ratio", "loss_aggregation"}
    assert cfg.algorithm.model_dump(exclude=own) == demo.algorithm.model_dump(exclude=own)
    assert cfg.model_dump(exclude={"name", "algorithm"}) == demo.model_dump(exclude={"name", "algorithm"})
