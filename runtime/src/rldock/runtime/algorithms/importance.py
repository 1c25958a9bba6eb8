"""The decoupled importance correction of partial rollout (rollout.importance_correction `decoupled`;
decoupled PPO, Hilton et al. arXiv 2110.00641, as AReaL applies it to interruptible generation): the
PPO ratio is taken against the policy that starts the update (proximal, the trainer's own logprobs),
and each token's advantage is weighted by the truncated importance weight

    w_t = min(pi_prox(y_t) / pi_behav(y_t), cap)

of that policy against the one that sampled the token (the engine's logprob, kept by the rollout).
On tokens the current version sampled the two are the same policy and w_t is 1 (up to the engine's and
the trainer's numerics, which the weight then also corrects, as truncated importance sampling does).
"""

from __future__ import annotations

import math

import torch

IMPORTANCE_WEIGHT = "importance_weight"  # (B, SL) float32 dock column: w_t


def truncated_importance_weight(proximal: torch.Tensor, behaviour: torch.Tensor, *, cap: float) -> torch.Tensor:
    """w (B, SL) = min(exp(proximal - behaviour), cap) from logprobs (B, SL), computed in log space so
    that a large gap cannot overflow."""
    return torch.exp(torch.clamp(proximal - behaviour, max=math.log(cap)))


def weighted_advantage(advantage: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each token's advantage times its importance weight (b, SL): `advantage` (b,) per response or
    (b, SL) per token, `weight` (b, SL)."""
    return (advantage[:, None] if advantage.dim() == 1 else advantage) * weight
