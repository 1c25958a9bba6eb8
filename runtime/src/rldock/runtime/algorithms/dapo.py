"""DAPO's pieces as pure tensor functions (Yu et al., "DAPO", arXiv 2503.14476).

- `decoupled_clip_policy_loss`: the PPO surrogate with separate lower and upper clip ratios
  (clip-higher, sec. 3.1), averaged over every valid token of the batch (token-level loss, 3.3).
- `overlong_penalty`: the soft overlong punishment added to the rule reward (sec. 3.4).
- `informative_groups`: which prompt groups dynamic sampling keeps (sec. 3.2): those whose
  rewards are not all equal, since a group of equal rewards has advantage 0 for every response
  and so contributes no gradient.
"""

from __future__ import annotations

import torch

from rldock.runtime.algorithms.aggregation import aggregate
from rldock.runtime.algorithms.losses import PolicyLoss, clipped_token_losses, register_policy_loss


@register_policy_loss("decoupled_clip")
def decoupled_clip_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    aggregation: str = "token_mean",
    row_weights: torch.Tensor | None = None,
    norm_length: int | None = None,
    episode_share: torch.Tensor | None = None,
) -> PolicyLoss:
    """Clip-higher surrogate: the ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]
    (DAPO eq. 10). A larger upper bound lets the probability of an unlikely token with positive
    advantage grow further in one step, which keeps the policy's entropy from collapsing.

    logprobs, old_logprobs: (B, T); advantages: (B,); mask: (B, T) 1 on response tokens;
    clip_ratio_c: dual-clip's bound and aggregation, row_weights, norm_length as in
    `clipped_policy_loss`. Returns a PolicyLoss whose loss is by default the token mean over all
    valid tokens.
    """
    token_loss, stats = clipped_token_losses(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=clip_ratio_low,
        clip_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
    )
    return PolicyLoss(
        aggregate(
            token_loss, mask, aggregation, row_weights=row_weights, norm_length=norm_length, episode_share=episode_share
        ),
        **stats,
    )


def overlong_penalty(
    response_lengths: torch.Tensor, *, max_length: int, buffer_length: int, penalty_factor: float
) -> torch.Tensor:
    """Soft overlong punishment (DAPO eq. 13), to add to each response's rule reward.

    response_lengths: (B,) tokens per response; max_length: L_max, the generation limit;
    buffer_length: L_cache, the last tokens before L_max over which the penalty ramps linearly
    from 0 to -penalty_factor. Lengths past L_max get -penalty_factor. Returns (B,) float32, <= 0.
    """
    # the caller skips a buffer of 0; the config's dapo checks keep it within the response length
    assert 0 < buffer_length <= max_length, f"overlong buffer {buffer_length} outside 1..{max_length}"
    if response_lengths.dim() != 1:
        raise ValueError(f"response_lengths must have shape (B,), got {tuple(response_lengths.shape)}")
    excess = response_lengths.float() - (max_length - buffer_length)  # (B,) tokens into the buffer
    return -(excess / buffer_length).clamp(min=0.0, max=1.0) * penalty_factor  # (B,)


def informative_groups(rewards: torch.Tensor, group_size: int, tolerance: float = 1e-6) -> torch.Tensor:
    """Dynamic sampling's filter: True for each group whose rewards are not all equal.

    rewards: (B,) with B = num_groups * group_size, groups consecutive (the dock's layout).
    Returns (B/N,) bool. Rewards closer than `tolerance` count as equal, so float noise in a
    shaped reward does not make a group look informative.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    # N >= 2 is the config's bound; the dock hands out whole groups
    assert group_size >= 1 and rewards.numel() % group_size == 0, f"{rewards.numel()} rewards in groups of {group_size}"
    groups = rewards.float().view(-1, group_size)  # (B/N, N)
    spread = groups.max(dim=1).values - groups.min(dim=1).values  # (B/N,)
    return spread > tolerance
