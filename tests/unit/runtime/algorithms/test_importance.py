"""The decoupled importance correction of partial rollout (algorithms/importance.py): the truncated
weight, and the update's objective weighting each token's advantage with it."""

from __future__ import annotations

import math

import pytest
import torch

from rldock.config.job import JobConfig
from rldock.runtime.algorithms.importance import IMPORTANCE_WEIGHT, truncated_importance_weight, weighted_advantage
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.training.policy_objective import job_objective


def test_the_weight_is_the_truncated_ratio_and_one_where_the_same_policy_sampled():
    proximal = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])  # (B, SL)
    behaviour = torch.tensor([[-1.0, -1.5, -3.0, -103.0]])  # the last: a gap that would overflow exp in float32
    weight = truncated_importance_weight(proximal, behaviour, cap=2.0)
    assert weight[0].tolist() == pytest.approx([1.0, math.exp(-0.5), 2.0, 2.0])


def test_weighted_advantages_per_response_and_per_token():
    weight = torch.tensor([[1.0, 0.5], [2.0, 1.0]])  # (b, SL)
    assert weighted_advantage(torch.tensor([1.0, -1.0]), weight).tolist() == [[1.0, 0.5], [-2.0, -1.0]]
    assert weighted_advantage(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), weight).tolist() == [[1.0, 1.0], [6.0, 4.0]]


def _cfg(correction: str) -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": "unused"},
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 4,
            "max_response_length": 4,
            "learning_rate": 1e-3,
        },
        training={"mode": "async"},
        dock={"max_staleness": 1},
        rollout={"partial_rollout": "resume", "max_tokens_per_round": 2, "importance_correction": correction},
        agent={"tools": [{"name": "calculator"}]},
    )


def test_decoupled_weights_each_tokens_advantage_in_the_update_and_behaviour_does_not():
    decoupled, behaviour = job_recipe(_cfg("decoupled")), job_recipe(_cfg("behaviour"))
    assert IMPORTANCE_WEIGHT in decoupled.produces["actor_inference"]
    assert IMPORTANCE_WEIGHT in decoupled.consumes["update"]
    assert IMPORTANCE_WEIGHT not in behaviour.consumes["update"] + behaviour.produces["actor_inference"]
    torch.manual_seed(0)
    logprobs = (torch.randn(2, 4) - 1).requires_grad_()  # (b, SL)
    old = logprobs.detach() + 0.1 * torch.randn(2, 4)
    weight = torch.tensor([[1.0, 1.0, 0.5, 2.0], [1.0, 1.5, 1.0, 1.0]])  # (b, SL)
    micro = {
        "response_mask": torch.ones(2, 4),
        "advantage": torch.tensor([1.0, -1.0]),
        "old_logprobs": old,
        "ref_logprobs": old,
        IMPORTANCE_WEIGHT: weight,
    }
    common = {"units_per_rank": torch.tensor(8.0), "rank_tokens": torch.tensor(8.0)}
    entropy = torch.zeros(2, 4)
    weighted, _ = job_objective(_cfg("decoupled"), decoupled)(logprobs, entropy, micro, **common)
    plain, _ = job_objective(_cfg("behaviour"), behaviour)(logprobs, entropy, micro, **common)
    by_hand, _ = job_objective(_cfg("behaviour"), behaviour)(
        logprobs, entropy, {**micro, "advantage": micro["advantage"][:, None] * weight}, **common
    )
    assert weighted.item() == pytest.approx(by_hand.item()) and weighted.item() != pytest.approx(plain.item())
