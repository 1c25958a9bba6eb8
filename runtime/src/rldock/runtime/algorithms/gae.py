"""Generalised advantage estimation (Schulman et al., arXiv 1506.02438) over response tokens, or over
turns.

An LLM response is an episode whose actions are its tokens: the state before token t is the prompt
plus tokens < t, the rewards sit on the tokens that earned them (the outcome on the last one), and the
episode ends after its last token (no bootstrap past the end). Right-padded positions carry no reward
or value. In a multi-turn trajectory (docs/agentic.md) the tools' and the environment's tokens sit
between the model's: they are no action of the policy, so they take no step. Their values are neither
trained nor bootstrapped through: the TD error of a model token looks at the value of the next *model*
token, however many tool tokens lie between (verl's `compute_gae_advantage_return` with an observation
mask has the same recursion on the model tokens).

With `algorithm.gae_unit: turn` a turn is one step (Turn-PPO, arXiv 2512.17008; AReaL's
`gae_timestep_unit: turn`): the turn's value is the critic's value at its first model token, its reward
the sum of its rewards, gamma and lambda apply per turn, and the turn's advantage goes on every one of
its tokens. Both units are registered in GAE_UNITS by the name that field takes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rldock.runtime.algorithms.core import masked_mean
from rldock.runtime.algorithms.turns import first_turn_tokens, on_turn_tokens, turn_mask, turn_token_rewards
from rldock.runtime.registry import Registry


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 -> (B,) int64: the position of each row's last 1, -1 in a row without one."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # (B, T)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).amax(dim=1)


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each response's scalar reward on its last valid token (the model's last one, with tool
    tokens between the model's).

    rewards: (B,); mask: (B, T) 0/1. Returns (B, T) float32, zero elsewhere; a row with no valid token
    gets no reward.
    """
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards must have shape (B,)=({mask.shape[0]},), got {tuple(rewards.shape)}")
    last = last_valid_index(mask)  # (B,)
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # (B, T)
    rows = torch.nonzero(last >= 0).squeeze(1)  # (B',)
    token_rewards[rows, last[rows]] = rewards[rows].float()
    return token_rewards


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and the critic's return targets over the steps the mask marks.

    token_rewards, values, mask: (B, T). The steps of a row are its positions where the mask is 1, in
    order, t_0 < t_1 < ... < t_n (contiguous for a single-turn response; with gaps where tool tokens sit
    in a multi-turn one). With V(t_{n+1}) = 0,

        delta_i = r(t_i) + gamma * V(t_{i+1}) - V(t_i),    A(t_i) = delta_i + gamma * lam * A(t_{i+1}),

    and the returns are A + V (the lambda-returns the critic regresses to). A reward or value where the
    mask is 0 is ignored. Returns (advantages, returns), both (B, T) float32 and 0 where the mask is 0.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or values.dim() != 2:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must have the same (B, T) shape"
        )
    steps = mask.bool()
    mask = mask.float()
    rewards = token_rewards.float() * mask  # (B, T)
    values = values.float() * mask  # (B, T)
    advantages = torch.zeros_like(values)  # (B, T)
    # The next step's value and advantage, carried unchanged across positions that take no step (tool
    # tokens, right padding), so the recursion links each model token to the next model token.
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    next_advantage = torch.zeros_like(values[:, 0])  # (B,)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        advantage = delta + gamma * lam * next_advantage  # (B,)
        next_value = torch.where(steps[:, t], values[:, t], next_value)
        next_advantage = torch.where(steps[:, t], advantage, next_advantage)
        advantages[:, t] = advantage * mask[:, t]
    returns = (advantages + values) * mask  # (B, T)
    return advantages, returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the valid elements of (B, T) `values`; 0 where the mask is 0.

    The std is the population one: whitening a batch is a rescaling, not an estimate.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(variance + eps) * mask.to(values.dtype)


@dataclass(frozen=True)
class GaeInputs:
    turn_rewards: torch.Tensor  # (B, K) float32: each turn's reward (a single-turn response: K = 1)
    values: torch.Tensor  # (B, SL) float32: the critic's V(state before token t)
    response_mask: torch.Tensor  # (B, SL) 0/1: the model's tokens
    turn_index: torch.Tensor  # (B, SL) int64: the turn of each model token, -1 elsewhere


@dataclass(frozen=True)
class GaeResult:
    advantages: torch.Tensor  # (B, SL) float32, 0 off the model's tokens
    returns: torch.Tensor  # (B, SL) float32, the critic's targets where value_mask is 1
    value_mask: torch.Tensor  # (B, SL) int64, 1 where the critic's value is a step's (trained)


GaeUnit = Callable[..., GaeResult]  # (GaeInputs, *, gamma, lam) -> GaeResult
GAE_UNITS: Registry[GaeUnit] = Registry("GAE unit", field="algorithm.gae_unit")


@GAE_UNITS.register("token")
def token_gae(inputs: GaeInputs, *, gamma: float, lam: float) -> GaeResult:
    """Token-level GAE: each model token a step, each turn's reward on its last model token, the tool
    and environment tokens skipped (`gae_advantages`). The critic trains on every model token."""
    token_rewards = turn_token_rewards(inputs.turn_rewards, inputs.turn_index)  # (B, SL)
    mask = inputs.response_mask
    advantages, returns = gae_advantages(token_rewards, inputs.values, mask, gamma=gamma, lam=lam)
    return GaeResult(advantages, returns, mask.long())


@GAE_UNITS.register("turn")
def turn_gae(inputs: GaeInputs, *, gamma: float, lam: float) -> GaeResult:
    """Turn-level GAE: turn k's value V_k is the critic's value at its first model token, its reward
    r_k = turn_rewards[:, k] (already summed per turn), and with V_K = 0

        delta_k = r_k + gamma * V_{k+1} - V_k,   A_k = delta_k + gamma * lam * A_{k+1},   R_k = A_k + V_k.

    A_k goes on every model token of turn k; the critic trains only at the first token of each turn,
    towards R_k (value_mask). Returns a GaeResult (B, SL)."""
    num_turns = inputs.turn_rewards.shape[1]
    first = first_turn_tokens(inputs.turn_index, num_turns)  # (B, K) each turn's first token, -1: none
    exists = turn_mask(inputs.turn_index, num_turns)  # (B, K)
    turn_values = torch.gather(inputs.values.float(), 1, first.clamp(min=0)) * exists  # (B, K)
    turn_advantages, turn_returns = gae_advantages(inputs.turn_rewards, turn_values, exists, gamma=gamma, lam=lam)
    value_mask = torch.zeros(inputs.values.shape, dtype=torch.int64, device=inputs.values.device)  # (B, SL)
    returns = torch.zeros(inputs.values.shape, dtype=torch.float32, device=inputs.values.device)  # (B, SL)
    rows, turns = torch.nonzero(exists, as_tuple=True)
    value_mask[rows, first[rows, turns]] = 1
    returns[rows, first[rows, turns]] = turn_returns[rows, turns]
    return GaeResult(on_turn_tokens(turn_advantages, inputs.turn_index), returns, value_mask)
