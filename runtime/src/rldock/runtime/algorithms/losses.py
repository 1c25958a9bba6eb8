"""Policy losses by name: `(logprobs, old_logprobs, advantages, mask, clip_ratio) -> PolicyLoss`.

Every loss returns a `PolicyLoss`: `loss` is the scalar to call backward on; the other fields
are detached scalars for logging, left as tensors so that computing them never forces a device
sync (`metrics` converts them to floats when the caller logs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rldock.runtime.algorithms.core import masked_mean

from rldock.runtime.registry import Registry


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor  # () differentiable through `logprobs`
    clip_fraction: torch.Tensor  # () detached: share of valid tokens whose clipped term was taken
    ratio_mean: torch.Tensor  # () detached: mean of exp(logprobs - old_logprobs) over valid tokens

    @property
    def metrics(self) -> dict[str, float]:
        return {"clip_fraction": float(self.clip_fraction), "ratio_mean": float(self.ratio_mean)}


PolicyLossFn = Callable[..., PolicyLoss]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", field="algorithm.name")
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get


def clipped_token_losses(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high):
    """Per-token PPO clipped surrogate (to minimise) with the ratio clipped to
    [1 - clip_low, 1 + clip_high], clip fraction and ratio mean; inputs as in the losses."""
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same (B, T) shape"
        )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages must have shape (B,)=({logprobs.shape[0]},) (one per response) or "
                         f"(B, T)={tuple(logprobs.shape)} (one per token), got {tuple(advantages.shape)}")
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    # (B, 1) broadcast over tokens for outcome advantages; (B, T) as is for per-token (GAE) ones.
    adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).to(ratio.dtype)
    unclipped = -adv * ratio  # (B, T)
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    # max of the two negated objectives = min of the objectives: the pessimistic bound, whose
    # gradient is zero once the ratio has moved past the clip in the advantage's direction.
    token_loss = torch.maximum(unclipped, clipped)  # (B, T)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped > unclipped).float(), mask)
        ratio_mean = masked_mean(ratio, mask)
    return token_loss, clip_fraction, ratio_mean


@register_policy_loss("clipped")
def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_ratio: float) -> PolicyLoss:
    """PPO-clip surrogate of GRPO (DeepSeekMath, arXiv 2402.03300, eq. 3), averaged over all valid
    tokens of the batch (the token mean of DAPO, arXiv 2503.14476, sec. 3.3), so long responses
    are not down-weighted per token.

    logprobs, old_logprobs: (B, T) log-probabilities of the response tokens under the current and
    the sampling policy; advantages: (B,) one per response, applied to all its tokens; mask:
    (B, T) 1 on response tokens; clip_ratio: epsilon. Returns a PolicyLoss. Advantages may also be
    (B, T), one per token (PPO's GAE).
    """
    token_loss, clip_fraction, ratio_mean = clipped_token_losses(logprobs, old_logprobs, advantages, mask,
                                                                 clip_low=clip_ratio, clip_high=clip_ratio)
    return PolicyLoss(masked_mean(token_loss, mask), clip_fraction, ratio_mean)


@register_policy_loss("clipped_sequence_mean")
def clipped_sequence_mean_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                                      advantages: torch.Tensor, mask: torch.Tensor,
                                      clip_ratio: float) -> PolicyLoss:
    """The same surrogate aggregated as written in DeepSeekMath eq. 3: the mean over each
    response's tokens, then the mean over responses. Shapes as in `clipped_policy_loss`."""
    token_loss, clip_fraction, ratio_mean = clipped_token_losses(logprobs, old_logprobs, advantages, mask,
                                                                 clip_low=clip_ratio, clip_high=clip_ratio)
    return PolicyLoss(masked_mean(token_loss, mask, dim=1).mean(), clip_fraction, ratio_mean)
