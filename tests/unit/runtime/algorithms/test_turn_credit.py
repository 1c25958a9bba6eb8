"""Turn-level credit of the critic-free family: discounted returns per turn, the trajectory-level
estimators recovered where the turns carry nothing apart, the reward split over turns, and the turn
baseline unbiased on a bandit where a per-turn-position baseline is not (verl RFC #7244)."""

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from rldock.config.algorithm import AlgorithmSpec
from rldock.runtime.algorithms.advantages import get_advantage_estimator
from rldock.runtime.algorithms.turn_credit import TURN_ESTIMATORS, discounted_turn_returns, rloo_turn_advantages
from rldock.runtime.algorithms.turns import reward_split_over_turns
from rldock.runtime.flow.catalogue import get_recipe

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
ATOL = 1e-5  # float32 sums of a few terms of magnitude <= 4 against exact values; no threaded reductions


def _algo(name: str, **algorithm) -> AlgorithmSpec:
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["algorithm"].update({"name": name, "num_prompts_per_iteration": 2, "num_responses_per_prompt": 2, **algorithm})
    return AlgorithmSpec.model_validate(data["algorithm"])


def test_discounted_returns_per_turn_hand_computed():
    rewards = torch.tensor([[0.5, 0.0, 1.0], [2.0, 9.0, 9.0]])
    turns = torch.tensor([[True, True, True], [True, False, False]])  # row 1 has one turn; its 9s are not its
    returns = discounted_turn_returns(rewards, turns, 0.5)
    # row 0: G_2 = 1, G_1 = 0 + 0.5 * 1 = 0.5, G_0 = 0.5 + 0.5 * 0.5 = 0.75
    torch.testing.assert_close(returns, torch.tensor([[0.75, 0.5, 1.0], [2.0, 0.0, 0.0]]), rtol=0, atol=ATOL)


def test_the_reward_is_split_over_the_turns_that_earned_it_and_sums_to_it():
    turn_index = torch.tensor([[0, -1, 1, -1, 2, 2], [0, 0, -1, -1, -1, -1]])
    environment = torch.tensor([[0.25, 0.0, 1.0], [0.5, 0.0, 0.0]])
    reward = torch.tensor([1.75, 0.5])  # the environment's steps, summed, plus 0.5 from another term in row 0
    split = reward_split_over_turns(reward, environment, turn_index)
    torch.testing.assert_close(split, torch.tensor([[0.25, 0.0, 1.5], [0.5, 0.0, 0.0]]), rtol=0, atol=ATOL)
    torch.testing.assert_close(split.sum(dim=1), reward)


TRAJECTORY_LEVEL = {
    "grpo": "grpo",
    "gspo": "grpo",
    "rloo": "rloo",
    "reinforce_plus_plus": "reinforce_plus_plus",
    "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline",
}


@pytest.mark.parametrize("name", sorted(TRAJECTORY_LEVEL))
def test_with_the_whole_reward_on_the_last_turn_and_no_discount_turn_credit_is_trajectory_credit(name):
    # 4 episodes in 2 groups of 2, of 1 to 3 turns with tool tokens between; no environment reward.
    turn_index = torch.tensor(
        [[0, 0, -1, 1, -1, 2], [0, -1, 1, 1, -1, -1], [0, 0, 0, -1, -1, -1], [0, -1, -1, 1, 1, 1]]
    )
    reward = torch.tensor([1.0, 0.0, 0.25, 2.0])
    batch = {
        "reward": reward,
        "response_mask": (turn_index >= 0).long(),
        "turn_index": turn_index,
        "turn_rewards": torch.zeros(4, 3),
    }
    out = get_recipe(name).turn_credit_stage(batch, _algo(name, credit="turn"), torch.Generator())
    estimator = get_advantage_estimator(TRAJECTORY_LEVEL[name])
    kwargs = {"token_counts": batch["response_mask"].sum(dim=1)} if "reinforce" in name else {}
    expected = estimator(reward, 2, **kwargs).unsqueeze(1) * batch["response_mask"]  # (B, SL)
    torch.testing.assert_close(out["advantage"], expected, rtol=0, atol=ATOL)


def test_a_later_turn_is_credited_with_what_followed_it_only():
    # One group of 2: episode 0 earned 1 on its first turn and 1 on its second; episode 1 earned 0.
    turn_index = torch.tensor([[0, -1, 1], [0, 0, -1]])
    batch = {
        "reward": torch.tensor([2.0, 0.0]),
        "response_mask": (turn_index >= 0).long(),
        "turn_index": turn_index,
        "turn_rewards": torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
    }
    algo = _algo("rloo", credit="turn", num_prompts_per_iteration=1)
    out = get_recipe("rloo").turn_credit_stage(batch, algo, torch.Generator())
    # G = [[2, 1], [0, 0]]; the baseline of episode 0 is episode 1's return 0, and of episode 1 it is 2.
    torch.testing.assert_close(out["advantage"], torch.tensor([[2.0, 0.0, 1.0], [-2.0, -2.0, 0.0]]))


def test_a_group_of_equal_episode_returns_earned_at_different_turns_gets_bounded_advantages():
    # Both episodes returned 1, one on its first turn, one on its second: G = [[1, 0], [1, 1]].
    returns = discounted_turn_returns(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.ones(2, 2, dtype=torch.bool), 1.0)
    advantages = TURN_ESTIMATORS.get("grpo")(returns, torch.ones(2, 2, dtype=torch.bool), 2, token_counts=None)
    # mean G_0 = 1, std G_0 = 0: the std of the four turn returns [1, 0, 1, 1] (0.5) stands in
    torch.testing.assert_close(advantages, torch.tensor([[0.0, -2.0], [0.0, 0.0]]), rtol=0, atol=1e-4)


# --- the bandit ----------------------------------------------------------------------------------
#
# An agent whose one decision is after its first turn: go on (probability p = sigmoid(theta)) or stop.
# The first turn always earns 1 (say, for reading the right file); a second turn earns a Bernoulli(q)
# outcome. J(theta) = 1 + p q, so dJ/dtheta = q p (1 - p). Only the decision depends on theta; its score
# is d log pi / d theta = 1 - p for going on, -p for stopping. An estimator's gradient for one group of N
# episodes is g = 1/N sum_i A_i,0 * score_i, with A_i,0 the advantage on the deciding turn.
P_GO_ON, Q_RIGHT, GROUP, GROUPS = 0.5, 0.5, 4, 20_000
TRUE_GRADIENT = Q_RIGHT * P_GO_ON * (1 - P_GO_ON)  # 0.125
# Tolerance: every return lies in [1, 2], so |A_i,0| <= 1 for both estimators below, |score| <= 0.5 and
# each group's g lies in [-0.5, 0.5]. Hoeffding: P(|mean of GROUPS groups - E g| >= t) <= 2 exp(-2 GROUPS
# t^2 / 1^2) = 2 exp(-64) at t = 0.04: far below any chance of a seed failing an unbiased estimator.
# The biased one's expectation is 0 here (below), 0.125 away, so it fails by more than 2 t.
TOLERANCE = 0.04


def _bandit_episodes(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rewards (B, 2), turns (B, 2) bool, score (B,)) of GROUPS groups of GROUP episodes, drawn by numpy's
    PCG64 (the same numbers on every machine)."""
    rng = np.random.default_rng(seed)
    go_on = rng.random(GROUPS * GROUP) < P_GO_ON  # (B,)
    right = rng.random(GROUPS * GROUP) < Q_RIGHT  # (B,)
    rewards = np.stack([np.ones_like(right, dtype=np.float64), (go_on & right).astype(np.float64)], axis=1)
    turns = np.stack([np.ones_like(go_on), go_on], axis=1)
    score = np.where(go_on, 1 - P_GO_ON, -P_GO_ON)
    return torch.tensor(rewards, dtype=torch.float32), torch.tensor(turns), torch.tensor(score)


def turn_baseline(rewards: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """rldock's registered RLOO by turn: the return from turn 0 against the other episodes' returns."""
    returns = discounted_turn_returns(rewards, turns, 1.0)
    return rloo_turn_advantages(returns, turns, GROUP, token_counts=turns.long())[:, 0]


def per_position_baseline(rewards: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """The MT-GRPO-style construction (written here, not in rldock): each turn's reward less the mean
    reward of the group's other episodes at the same turn index (among those that have that turn), summed
    from the turn onwards. Its baseline has one term per turn the episode itself took."""
    groups = rewards.view(-1, GROUP, 2).double()
    has = turns.view(-1, GROUP, 2).double()
    others_sum = (groups * has).sum(dim=1, keepdim=True) - groups * has
    others_count = has.sum(dim=1, keepdim=True) - has
    # with no other episode at that turn, no contrast: the turn's own reward is its baseline
    baseline = torch.where(others_count > 0, others_sum / others_count.clamp(min=1), groups)
    centred = (groups - baseline) * has  # (G, N, 2)
    return centred.sum(dim=2).view(-1).float()  # the advantage of turn 0: the sum from turn 0 on


def _bandit_gradient(estimator) -> float:
    rewards, turns, score = _bandit_episodes(seed=0)
    gradient = (estimator(rewards, turns).double() * score).view(-1, GROUP).mean(dim=1)  # (GROUPS,)
    assert gradient.abs().max() <= 0.5 + 1e-6  # the range the tolerance's bound assumes
    return float(gradient.mean())


def test_the_turn_baseline_estimates_the_policy_gradient_without_bias():
    assert abs(_bandit_gradient(turn_baseline) - TRUE_GRADIENT) < TOLERANCE


def test_a_per_turn_position_baseline_misses_the_policy_gradient():
    """The bias verl RFC #7244 describes, shown on the same episodes: the per-position construction's
    estimate lies outside the tolerance the unbiased one meets (an assertion, not an xfail, so an
    estimator that raised could not pass for a biased one)."""
    assert abs(_bandit_gradient(per_position_baseline) - TRUE_GRADIENT) > TOLERANCE


def test_every_turn_estimator_is_registered_and_named_for_its_algorithm():
    assert list(TURN_ESTIMATORS) == ["grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"]
    with pytest.raises(ValueError, match="algorithm.name 'dapo'.*grpo"):
        TURN_ESTIMATORS.get("dapo")
