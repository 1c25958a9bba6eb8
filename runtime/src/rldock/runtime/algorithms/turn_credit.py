"""Turn-level credit for the critic-free family (`algorithm.credit: turn`): each model turn of an
episode gets the discounted return from that turn onwards, normalised against a baseline of the group's
whole-episode returns, and that advantage goes on every token of the turn.

    G_k = sum_{j >= k} gamma^(j - k) r_j          (gamma = algorithm.turn_discount; r_j: turn j's reward)

The return from turn k leaves out the rewards of the turns before it, which no action of turn k can
change (reward-to-go), so each turn is credited with what followed it (MT-GRPO, arXiv 2505.11821; GiGPO,
arXiv 2505.10978, for turn-level groups).

**The baseline does not index by turn position.** MT-GRPO-style estimators normalise each turn's reward
among the group's rewards at the same turn index and sum the normalised rewards from turn k on; the sum
then subtracts one per-index baseline for every turn the episode itself took, a baseline whose number of
terms the episode's own stopping turn decides. Where the policy decides when to stop (every agent does),
that baseline depends on the action it is the baseline of, and the gradient is biased: each "take
another turn" decision is charged the group's mean reward of the turns it adds (verl RFC #7244). Here
every turn of every episode of a group is compared with the same statistics, those of the group's
whole-episode returns G_0, which no single turn's action of the episode in question changes beyond its
own share of the group mean (the share GRPO's trajectory-level mean has too; RLOO's leave-one-out
baseline removes it, and with it any bias: tests/unit/runtime/algorithms/test_turn_credit.py measures both
on a bandit where the per-position baseline's bias is plain).

Estimators are registered in TURN_ESTIMATORS by the algorithm's trajectory-level name:
`(returns (B, K), turns (B, K) bool, group_size, *, token_counts (B, K)) -> advantages (B, K)`.
With turn_discount 1 and the whole reward on the last turn each estimator is its trajectory-level self.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rldock.runtime.algorithms.advantages import batch_whiten, reward_groups
from rldock.runtime.algorithms.turns import on_turn_tokens, rewards_per_turn, turn_mask, turn_token_counts
from rldock.runtime.registry import Registry

TurnEstimator = Callable[..., torch.Tensor]
TURN_ESTIMATORS: Registry[TurnEstimator] = Registry("turn-level estimator", field="algorithm.name")


def discounted_turn_returns(turn_rewards: torch.Tensor, turns: torch.Tensor, discount: float) -> torch.Tensor:
    """G_k = sum_{j >= k} discount^(j - k) r_j over the turns the episode has: turn_rewards, turns (B, K).
    Returns (B, K) float32, 0 on turns the episode lacks."""
    rewards = turn_rewards.float() * turns  # (B, K)
    returns = torch.zeros_like(rewards)  # (B, K)
    following = torch.zeros_like(rewards[:, 0])  # (B,) G_{k+1}
    for k in reversed(range(rewards.shape[1])):
        following = rewards[:, k] + discount * following
        returns[:, k] = following
    return returns * turns


def _episode_returns(returns: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each group's whole-episode returns G_0: (B/N, N)."""
    return reward_groups(returns[:, 0], group_size)


@TURN_ESTIMATORS.register("grpo")
def grpo_turn_advantages(
    returns: torch.Tensor, turns: torch.Tensor, group_size: int, *, token_counts: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """A_k = (G_k - mean_group G_0) / (std_group G_0 + eps): GRPO's statistics, of the group's episode
    returns, for every turn. returns, turns: (B, K). Returns (B, K), 0 on turns the episode lacks.

    A group whose episodes all returned the same G_0 may still differ turn by turn (one earned its reward
    a turn earlier): there the std of all the group's turn returns stands in for the zero one (Bessel's,
    each turn of each episode once), which is 0 only where every G_k equals the mean, so no advantage is
    ever divided by eps alone."""
    episodes = _episode_returns(returns, group_size)  # (B/N, N)
    std = episodes.std(dim=1)  # (B/N,)
    std = torch.where(std > 0, std, _pooled_std(returns, turns, group_size))
    mean = episodes.mean(dim=1).repeat_interleave(group_size).unsqueeze(1)  # (B, 1)
    return (returns - mean) / (std.repeat_interleave(group_size).unsqueeze(1) + eps) * turns


def _pooled_std(returns: torch.Tensor, turns: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each group's std (Bessel's) of all its episodes' turn returns, each turn once: (B/N,)."""
    values = returns.reshape(-1, group_size * returns.shape[1])  # (B/N, N*K)
    present = turns.reshape(-1, group_size * turns.shape[1]).float()  # (B/N, N*K)
    count = present.sum(dim=1).clamp(min=2)  # (B/N,)
    mean = (values * present).sum(dim=1, keepdim=True) / count.unsqueeze(1)  # (B/N, 1)
    return (((values - mean) ** 2 * present).sum(dim=1) / (count - 1)).sqrt()


@TURN_ESTIMATORS.register("rloo")
def rloo_turn_advantages(
    returns: torch.Tensor, turns: torch.Tensor, group_size: int, *, token_counts: torch.Tensor
) -> torch.Tensor:
    """A_k = G_k - mean of the other N - 1 episodes' returns G_0: a baseline free of the episode's own
    actions, so the estimator is unbiased. returns, turns: (B, K). Returns (B, K)."""
    episodes = _episode_returns(returns, group_size)  # (B/N, N)
    others = ((episodes.sum(dim=1, keepdim=True) - episodes) / (group_size - 1)).view(-1, 1)  # (B, 1)
    return (returns - others) * turns


@TURN_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus_turn_advantages(
    returns: torch.Tensor, turns: torch.Tensor, group_size: int, *, token_counts: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++ by turn: the turns' returns G_k whitened over every model token of the batch (each
    turn weighted by its tokens; one mean and std for all turns). returns, turns, token_counts (B, K)."""
    reward_groups(returns[:, 0], group_size)  # checks the layout
    weights = token_counts * turns  # (B, K)
    return batch_whiten(returns.reshape(-1), weights.reshape(-1)).view_as(returns) * turns


@TURN_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_turn_advantages(
    returns: torch.Tensor, turns: torch.Tensor, group_size: int, *, token_counts: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++-baseline by turn: G_k less the group's mean episode return, then whitened over every
    model token of the batch. returns, turns, token_counts (B, K). Returns (B, K)."""
    episodes = _episode_returns(returns, group_size)  # (B/N, N)
    centred = returns - episodes.mean(dim=1).repeat_interleave(group_size).unsqueeze(1)  # (B, K)
    weights = token_counts * turns  # (B, K)
    return batch_whiten(centred.reshape(-1), weights.reshape(-1)).view_as(returns) * turns


def turn_credit_stage(estimator: str) -> Callable:
    """The advantage stage of `credit: turn` for a registered turn-level estimator: the batch's rewards
    per turn (turns.rewards_per_turn), their discounted returns, the estimator's advantage per turn, and
    that on each token of its turn. Writes `advantage` (B, SL) float32, 0 off the model's tokens."""
    fn = TURN_ESTIMATORS.get(estimator)

    def stage(batch, algo, generator):
        per_turn, turn_index = rewards_per_turn(batch, algo.credit)  # (B, K), (B, SL)
        num_turns = per_turn.shape[1]
        turns = turn_mask(turn_index, num_turns)  # (B, K)
        returns = discounted_turn_returns(per_turn, turns, algo.turn_discount)  # (B, K)
        counts = turn_token_counts(turn_index, num_turns)  # (B, K)
        advantages = fn(returns, turns, algo.num_responses_per_prompt, token_counts=counts)  # (B, K)
        return {"advantage": on_turn_tokens(advantages, turn_index)}  # (B, SL)

    return stage
