"""Advantage estimators by name: `(rewards (B,), group_size) -> advantages (B,)`.

Samples of one prompt sit at consecutive indexes (sample i is in group i // group_size), which is
the dock's layout (docs/architecture.md), so a group is a row after `view(-1, group_size)`.
"""

from __future__ import annotations

from typing import Callable

import torch

from rldock.runtime.registry import Registry

AdvantageFn = Callable[..., torch.Tensor]

ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator", field="algorithm.name")
register_advantage = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards cannot form groups of algorithm.num_responses_per_prompt="
            f"{group_size} (it must be >= 2 and divide the batch)"
        )
    return rewards.float().view(-1, group_size)  # (B/N, N)


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages (DeepSeekMath, arXiv 2402.03300, sec. 4.1.2): each response's
    reward minus its group's mean, divided by the group's standard deviation.

    rewards: (B,) with B = num_groups * group_size, groups consecutive. Returns (B,) float32.
    The standard deviation is the unbiased one (Bessel's correction), as in TRL and verl; `eps`
    keeps a group whose rewards are all equal at advantage 0 instead of NaN.
    """
    groups = _groups(rewards, group_size)  # (B/N, N)
    mean = groups.mean(dim=1, keepdim=True)  # (B/N, 1)
    std = groups.std(dim=1, keepdim=True)  # (B/N, 1)
    return ((groups - mean) / (std + eps)).view(-1)  # (B,)


@register_advantage("grpo_mean_only")
def grpo_mean_only_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group-mean-centred rewards without the std division (Dr. GRPO, arXiv 2503.20783, sec. 3.1),
    which avoids up-weighting groups whose rewards barely differ. rewards (B,) -> (B,)."""
    groups = _groups(rewards, group_size)  # (B/N, N)
    return (groups - groups.mean(dim=1, keepdim=True)).view(-1)  # (B,)
