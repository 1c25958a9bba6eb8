"""Generalised advantage estimation (Schulman et al., arXiv 1506.02438) over response tokens.

An LLM response is an episode whose actions are its tokens: the state before token t is the prompt
plus tokens < t, the only reward is the outcome reward on the last token, and the episode ends
after it (no bootstrap past the end). Right-padded positions (mask 0) carry no reward or value.
"""

from __future__ import annotations

import torch

from rldock.runtime.algorithms.core import masked_mean


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each response's scalar reward on its last valid token.

    rewards: (B,); mask: (B, T) right-padded 0/1. Returns (B, T) float32, zero elsewhere; a row
    with no valid token gets no reward.
    """
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards must have shape (B,)=({mask.shape[0]},), got {tuple(rewards.shape)}")
    lengths = mask.long().sum(dim=1)  # (B,)
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # (B, T)
    rows = torch.nonzero(lengths > 0).squeeze(1)  # (B',)
    token_rewards[rows, lengths[rows] - 1] = rewards[rows].float()
    return token_rewards


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and the critic's return targets.

    token_rewards, values, mask: (B, T), right-padded. With V = 0 after a response's last token,
    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}; the returns
    are A_t + V_t (the lambda-returns the critic regresses to). Returns (advantages, returns), both
    (B, T) float32 and 0 where the mask is 0.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or values.dim() != 2:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must have the same (B, T) shape"
        )
    mask = mask.float()
    # Zeroing pads makes the recursion stop at each response's end with no special case: past the
    # last token every reward, value and advantage is 0.
    rewards = token_rewards.float() * mask  # (B, T)
    values = values.float() * mask  # (B, T)
    num_tokens = values.shape[1]
    advantages = torch.zeros_like(values)  # (B, T)
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    next_advantage = torch.zeros_like(values[:, 0])  # (B,)
    for t in reversed(range(num_tokens)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    returns = (advantages + values) * mask  # (B, T)
    return advantages, returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the valid elements of (B, T) `values`; 0 where the mask is 0.

    The std is the population one: whitening a batch is a rescaling, not an estimate.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(variance + eps) * mask.to(values.dtype)
