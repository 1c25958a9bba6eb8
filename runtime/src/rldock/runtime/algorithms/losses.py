"""Policy losses by name: `(logprobs, old_logprobs, advantages, mask, **knobs) -> PolicyLoss`.

Every loss returns a `PolicyLoss`: `loss` is the scalar to call backward on; the other fields
are detached scalars for logging, left as tensors so that computing them never forces a device
sync (`metrics` converts them to floats when the caller logs).

Off-policy data (several updates per iteration, `dock.max_staleness > 0`, partial rollout, old
logprobs from the engine) can put a token's log ratio anywhere, so every loss here stays finite
for any log ratio: the log ratio is clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO] before the
exponential, and the PPO-family losses add dual-clip (Ye et al., "Mastering Complex Control in
MOBA Games with Deep Reinforcement Learning", arXiv 1912.09729), which bounds a negative
advantage's loss by -A * clip_ratio_c however large the ratio grows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rldock.runtime.algorithms.aggregation import aggregate
from rldock.runtime.algorithms.core import masked_mean
from rldock.runtime.registry import Registry

# Bound of |log pi - log pi_old| before exp(): e^20 ~ 4.9e8 is far past any clip, so no token whose
# clipped term could still matter is changed, and exp() stays far from float32's overflow (~e^88).
# Tokens past it get no gradient from the ratio (clamp's gradient is 0 outside), as in verl.
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class PolicyLoss:
    loss: torch.Tensor  # () differentiable through `logprobs`
    clip_fraction: torch.Tensor  # () detached: share of valid tokens whose clipped term was taken
    ratio_mean: torch.Tensor  # () detached: mean of the (clamped) ratio over valid tokens
    # () detached: share of valid tokens whose loss dual-clip bounded (advantage < 0, ratio past c)
    dual_clip_fraction: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    # () detached: share of valid tokens whose log ratio was past +-MAX_LOG_RATIO before exp()
    log_ratio_clamp_fraction: torch.Tensor = field(default_factory=lambda: torch.zeros(()))

    @property
    def metrics(self) -> dict[str, float]:
        return {
            "clip_fraction": float(self.clip_fraction),
            "ratio_mean": float(self.ratio_mean),
            "dual_clip_fraction": float(self.dual_clip_fraction),
            "log_ratio_clamp_fraction": float(self.log_ratio_clamp_fraction),
        }


PolicyLossFn = Callable[..., PolicyLoss]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", field="algorithm.name")
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get


def check_shapes(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> None:
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same (B, T) shape"
        )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must have shape (B,)=({logprobs.shape[0]},) (one per response) or "
            f"(B, T)={tuple(logprobs.shape)} (one per token), got {tuple(advantages.shape)}"
        )


def clamped_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi - log pi_old clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO], (B, T), and the share of
    valid tokens the clamp changed (detached)."""
    log_ratio = logprobs - old_logprobs  # (B, T)
    with torch.no_grad():
        clamped_share = masked_mean((log_ratio.abs() > MAX_LOG_RATIO).float(), mask)
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), clamped_share


def clipped_token_losses(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, clip_ratio_c=None):
    """Per-token PPO clipped surrogate (to minimise) with the ratio clipped to
    [1 - clip_low, 1 + clip_high] and, where the advantage is negative and `clip_ratio_c` is set,
    bounded by -A * clip_ratio_c (dual-clip). Inputs as in the losses. Returns
    (token_loss (B, T), PolicyLoss fields but `loss` as a dict of detached scalars)."""
    check_shapes(logprobs, old_logprobs, advantages, mask)
    assert clip_ratio_c is None or clip_ratio_c > 1, f"dual-clip bound {clip_ratio_c} must exceed 1 (the config's gt=1)"
    log_ratio, clamped_share = clamped_log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)  # (B, T), in [e^-20, e^20]
    # (B, 1) broadcast over tokens for outcome advantages; (B, T) as is for per-token (GAE) ones.
    adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).to(ratio.dtype)
    unclipped = -adv * ratio  # (B, T)
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    # max of the two negated objectives = min of the objectives: the pessimistic bound, whose
    # gradient is zero once the ratio has moved past the clip in the advantage's direction.
    token_loss = torch.maximum(unclipped, clipped)  # (B, T)
    dual_clipped = torch.zeros_like(token_loss, dtype=torch.bool)  # (B, T)
    if clip_ratio_c is not None:
        # With A < 0 the pessimistic bound grows with the ratio without limit (-A * ratio): one
        # token the policy now likes far more than the sampler did could dominate the batch.
        # Dual-clip caps it at -A * c, with zero gradient past it.
        bound = -adv * clip_ratio_c  # (B, T) where A broadcasts
        negative = (adv < 0).expand_as(token_loss)  # (B, T)
        dual_clipped = negative & (token_loss > bound)
        token_loss = torch.where(negative, torch.minimum(token_loss, bound), token_loss)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).float(), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "dual_clip_fraction": masked_mean(dual_clipped.float(), mask),
            "log_ratio_clamp_fraction": clamped_share,
        }
    return token_loss, stats


@register_policy_loss("clipped")
def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float,
    clip_ratio_c: float | None = None,
    *,
    aggregation: str = "token_mean",
    row_weights: torch.Tensor | None = None,
    norm_length: int | None = None,
    episode_share: torch.Tensor | None = None,
) -> PolicyLoss:
    """PPO-clip surrogate of GRPO (DeepSeekMath, arXiv 2402.03300, eq. 3), by default averaged over
    all valid tokens of the batch (the token mean of DAPO, arXiv 2503.14476, sec. 3.3), so long
    responses are not down-weighted per token.

    logprobs, old_logprobs: (B, T) log-probabilities of the response tokens under the current and
    the sampling policy; advantages: (B,) one per response, applied to all its tokens; mask:
    (B, T) 1 on response tokens; clip_ratio: epsilon; clip_ratio_c: dual-clip's bound (> 1) on the
    ratio of a token with negative advantage, None for none; aggregation, row_weights (B,),
    norm_length, episode_share (B,): how the token losses become the scalar (aggregation.py). Returns a PolicyLoss.
    Advantages may also be (B, T), one per token (PPO's GAE).
    """
    token_loss, stats = clipped_token_losses(
        logprobs, old_logprobs, advantages, mask, clip_low=clip_ratio, clip_high=clip_ratio, clip_ratio_c=clip_ratio_c
    )
    return PolicyLoss(
        aggregate(
            token_loss, mask, aggregation, row_weights=row_weights, norm_length=norm_length, episode_share=episode_share
        ),
        **stats,
    )


@register_policy_loss("clipped_sequence_mean")
def clipped_sequence_mean_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float,
    clip_ratio_c: float | None = None,
    *,
    row_weights: torch.Tensor | None = None,
    episode_share: torch.Tensor | None = None,
    **_: object,
) -> PolicyLoss:
    """The same surrogate aggregated as written in DeepSeekMath eq. 3: the mean over each
    response's tokens, then the mean over responses with no valid token left out (`clipped` with
    aggregation `seq_mean_token_mean`, whatever `aggregation` says). Shapes as in `clipped_policy_loss`."""
    return clipped_policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_ratio,
        clip_ratio_c,
        aggregation="seq_mean_token_mean",
        row_weights=row_weights,
        episode_share=episode_share,
    )
