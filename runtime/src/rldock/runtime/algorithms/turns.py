"""A trajectory's turns as tensors: where each model turn's tokens are, and the rewards per turn that the
turn-level estimators (GAE by turn, turn credit) read.

The dock holds a multi-turn sample's turns in two columns (rldock.runtime.flow.columns.TURNS): `turn_index`
(B, SL), per response token the model turn k it was sampled in and -1 on tool, environment and padding
tokens, and `turn_rewards` (B, K), the environment's reward for each turn's step (K = agent.max_turns). A
single-turn batch has neither; `batch_turns` reads it as one turn of the model's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from rldock.runtime.registry import Registry


def _one_hot_turns(turn_index: torch.Tensor, num_turns: int) -> torch.Tensor:
    """(B, SL) turn ids -> (B, SL, K) bool, True where token t is of turn k."""
    return turn_index.unsqueeze(-1) == torch.arange(num_turns, device=turn_index.device)


def turn_mask(turn_index: torch.Tensor, num_turns: int) -> torch.Tensor:
    """(B, K) bool: which turns the trajectory has (a turn with at least one token)."""
    return _one_hot_turns(turn_index, num_turns).any(dim=1)


def turn_token_counts(turn_index: torch.Tensor, num_turns: int) -> torch.Tensor:
    """(B, K) int64: the model tokens of each turn."""
    return _one_hot_turns(turn_index, num_turns).sum(dim=1)


def first_turn_tokens(turn_index: torch.Tensor, num_turns: int) -> torch.Tensor:
    """(B, K) int64: the position of each turn's first token, -1 for a turn the trajectory lacks."""
    return _turn_positions(turn_index, num_turns, first=True)


def last_turn_tokens(turn_index: torch.Tensor, num_turns: int) -> torch.Tensor:
    """(B, K) int64: the position of each turn's last token, -1 for a turn the trajectory lacks."""
    return _turn_positions(turn_index, num_turns, first=False)


def _turn_positions(turn_index: torch.Tensor, num_turns: int, *, first: bool) -> torch.Tensor:
    hot = _one_hot_turns(turn_index, num_turns)  # (B, SL, K)
    length = turn_index.shape[1]
    positions = torch.arange(length, device=turn_index.device).view(1, -1, 1).expand_as(hot)  # (B, SL, K)
    if first:
        found = torch.where(hot, positions, torch.full_like(positions, length)).amin(dim=1)  # (B, K)
        return torch.where(found < length, found, torch.full_like(found, -1))
    return torch.where(hot, positions, torch.full_like(positions, -1)).amax(dim=1)  # (B, K)


def on_turn_tokens(per_turn: torch.Tensor, turn_index: torch.Tensor) -> torch.Tensor:
    """Spread (B, K) per-turn values over each turn's tokens: (B, SL) float32, 0 where turn_index is -1."""
    picked = torch.gather(per_turn.float(), 1, turn_index.clamp(min=0))  # (B, SL)
    return picked * (turn_index >= 0)


def turn_token_rewards(turn_rewards: torch.Tensor, turn_index: torch.Tensor) -> torch.Tensor:
    """Each turn's reward (B, K) on its last model token: (B, SL) float32, 0 elsewhere."""
    last = last_turn_tokens(turn_index, turn_rewards.shape[1])  # (B, K)
    rows, turns = torch.nonzero(last >= 0, as_tuple=True)
    token_rewards = torch.zeros(turn_index.shape, dtype=torch.float32, device=turn_index.device)  # (B, SL)
    token_rewards[rows, last[rows, turns]] = turn_rewards[rows, turns].float()
    return token_rewards


def last_turns(turn_index: torch.Tensor) -> torch.Tensor:
    """(B,) int64: each trajectory's last model turn (-1 without one)."""
    return turn_index.amax(dim=1)


# (reward (B,), the environment's turn_rewards (B, K), turn_index (B, SL)) -> the rewards per turn (B, K)
# the estimators discount and credit; algorithm.credit names one.
TurnRewardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
TURN_REWARDS: Registry[TurnRewardFn] = Registry("credit unit", field="algorithm.credit")


@TURN_REWARDS.register("trajectory")
def reward_on_last_turn(reward: torch.Tensor, turn_rewards: torch.Tensor, turn_index: torch.Tensor) -> torch.Tensor:
    """The whole reward (B,) on the trajectory's last turn: (B, K), 0 on the others."""
    per_turn = torch.zeros(turn_rewards.shape, dtype=torch.float32, device=reward.device)  # (B, K)
    last = last_turns(turn_index)  # (B,)
    rows = torch.nonzero(last >= 0).squeeze(1)
    per_turn[rows, last[rows]] = reward[rows].float()
    return per_turn


@TURN_REWARDS.register("turn")
def reward_split_over_turns(reward: torch.Tensor, turn_rewards: torch.Tensor, turn_index: torch.Tensor) -> torch.Tensor:
    """The reward (B,) split over the turns that earned it: each turn keeps the environment's reward for
    its step (turn_rewards (B, K)), and the rest of the sample's reward (its other reward terms' scores,
    any shaping) goes on the last turn, so the turns' rewards sum to `reward`. With an `environment`
    reward term of weight 1 that sums the steps, every step's reward lands on the turn whose step earned
    it. (B, K) float32."""
    turn_rewards = turn_rewards.float() * turn_mask(turn_index, turn_rewards.shape[1])  # (B, K)
    rest = reward.float() - turn_rewards.sum(dim=1)  # (B,)
    return turn_rewards + reward_on_last_turn(rest, turn_rewards, turn_index)


def batch_turns(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's `turn_index` (B, SL) and the environment's `turn_rewards` (B, K): the dock's turn columns
    where the rollout wrote them (an agent job), else the model's tokens as one turn without step rewards."""
    if "turn_index" in batch.keys():
        return batch["turn_index"], batch["turn_rewards"]
    mask = batch["response_mask"]  # (B, SL)
    single = torch.where(mask.bool(), torch.zeros_like(mask), torch.full_like(mask, -1)).long()  # (B, SL)
    return single, torch.zeros((mask.shape[0], 1), dtype=torch.float32, device=mask.device)


def rewards_per_turn(batch: Mapping[str, torch.Tensor], credit: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's rewards per turn (B, K) under algorithm.credit, with its turn_index (B, SL)."""
    turn_index, turn_rewards = batch_turns(batch)
    return TURN_REWARDS.get(credit)(batch["reward"], turn_rewards, turn_index), turn_index
