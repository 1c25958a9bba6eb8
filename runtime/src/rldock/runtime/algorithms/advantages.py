"""Advantage estimators by name: `(rewards (B,), group_size) -> advantages (B,)`.

Samples of one prompt sit at consecutive indexes (sample i is in group i // group_size), which is
the dock's layout (docs/architecture.md), so a group is a row after `view(-1, group_size)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rldock.runtime.registry import Registry

AdvantageFn = Callable[..., torch.Tensor]

ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator", field="algorithm.name")
register_advantage = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get


def reward_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    # N >= 2 is the config's bound; the dock hands out whole groups
    assert group_size >= 2 and rewards.numel() % group_size == 0, f"{rewards.numel()} rewards in groups of {group_size}"
    return rewards.float().view(-1, group_size)  # (B/N, N)


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages (DeepSeekMath, arXiv 2402.03300, sec. 4.1.2): each response's
    reward minus its group's mean, divided by the group's standard deviation.

    rewards: (B,) with B = num_groups * group_size, groups consecutive. Returns (B,) float32.
    The standard deviation is the unbiased one (Bessel's correction), as in TRL and verl; `eps`
    keeps a group whose rewards are all equal at advantage 0 instead of NaN.
    """
    groups = reward_groups(rewards, group_size)  # (B/N, N)
    mean = groups.mean(dim=1, keepdim=True)  # (B/N, 1)
    std = groups.std(dim=1, keepdim=True)  # (B/N, 1)
    return ((groups - mean) / (std + eps)).view(-1)  # (B,)


@register_advantage("grpo_mean_only")
def grpo_mean_only_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group-mean-centred rewards without the std division (Dr. GRPO, arXiv 2503.20783, sec. 3.1),
    which avoids up-weighting groups whose rewards barely differ. rewards (B,) -> (B,)."""
    groups = reward_groups(rewards, group_size)  # (B/N, N)
    return (groups - groups.mean(dim=1, keepdim=True)).view(-1)  # (B,)


@register_advantage("rloo")
def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al., "Back to Basics", arXiv 2402.14740, sec. 3.3;
    Kool et al. 2019): each response's reward minus the mean reward of the *other* N - 1
    responses of its group, an unbiased baseline that does not depend on the response itself:

        A_i = r_i - 1/(N-1) sum_{j != i} r_j = N/(N-1) (r_i - mean_j r_j)

    rewards: (B,) in consecutive groups of `group_size` >= 2. Returns (B,) float32; no std division.
    """
    groups = reward_groups(rewards, group_size)  # (B/N, N)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)  # (B/N, N)
    return (groups - others_mean).view(-1)  # (B,)


def batch_whiten(values: torch.Tensor, token_counts: torch.Tensor | None, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the batch, each response weighted by its tokens when
    `token_counts` (B,) is given (a response's advantage is the same on each of its tokens, so this
    is the whitening over every valid token of the batch, as verl's `masked_whiten`), with the
    unbiased (Bessel-corrected) variance over those tokens. values (B,) -> (B,)."""
    weights = torch.ones_like(values) if token_counts is None else token_counts.to(values.dtype)  # (B,)
    total = weights.sum()
    if total <= 1:  # one token (or none): nothing to whiten against
        return torch.zeros_like(values)
    mean = (values * weights).sum() / total
    variance = ((values - mean) ** 2 * weights).sum() / (total - 1)
    return (values - mean) * torch.rsqrt(variance + eps)


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    rewards: torch.Tensor, group_size: int, token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++ (Hu et al., arXiv 2501.03262, sec. 3): no critic and no group baseline; the
    advantage is the return normalised over the whole global batch,

        A = (R - mean_batch R) / std_batch R

    With outcome rewards and gamma 1 every token of a response has return R = its reward (rldock
    keeps the KL as a loss term, as verl's REINFORCE++ examples do, not in the reward), so the
    batch statistics are over every valid token: `token_counts` (B,) weights each response by its
    tokens (None: by response). rewards: (B,); `group_size` only checks the layout. Returns (B,).
    """
    return batch_whiten(reward_groups(rewards, group_size).view(-1), token_counts)


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor, group_size: int, token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al., arXiv 2501.03262, the variant for several responses per
    prompt): subtract the group's mean reward (the prompt's baseline), then normalise over the
    global batch as REINFORCE++ (no per-group std division, which GRPO has):

        A'_i = r_i - mean_group r,   A_i = (A'_i - mean_batch A') / std_batch A'

    Shapes and `token_counts` as in `reinforce_plus_plus_advantages`. Returns (B,)."""
    groups = reward_groups(rewards, group_size)  # (B/N, N)
    return batch_whiten((groups - groups.mean(dim=1, keepdim=True)).view(-1), token_counts)
