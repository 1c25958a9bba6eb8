"""KL penalty to the reference policy, estimated per token from sampled tokens' logprobs.

Estimators (Schulman, "Approximating KL Divergence", 2020), with log r = ref_logprob - logprob for
a token sampled from the current policy:
- `k1`: -log r, unbiased, can be negative per token.
- `k3`: r - log r - 1, unbiased and always >= 0; the one GRPO uses (DeepSeekMath eq. 4). It grows
  like e^(log r), so one token the policy has made far less likely than the reference could
  dominate the loss: its value is clamped to `max_kl` (algorithm.kl_clamp, 10 as verl's), with
  no gradient past the bound.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rldock.runtime.algorithms.core import masked_mean
from rldock.runtime.registry import Registry

# exp() of a log-ratio past ~88 overflows float32; a token whose logprobs differ by 20 nats is
# already a maximal penalty, so clamping changes no useful gradient.
MAX_LOG_RATIO = 20.0
DEFAULT_MAX_KL = 10.0  # verl's bound on k3 ("low_var_kl")

# (log r (B, T), max_kl) -> per-token KL (B, T)
KlEstimator = Callable[..., torch.Tensor]

KL_ESTIMATORS: Registry[KlEstimator] = Registry("KL estimator", field="algorithm.kl_estimator")


@KL_ESTIMATORS.register("k1")
def k1(log_ratio: torch.Tensor, *, max_kl: float | None = None) -> torch.Tensor:
    """-log r; bounded by MAX_LOG_RATIO already, so `max_kl` does not apply."""
    return -log_ratio


@KL_ESTIMATORS.register("k3")
def k3(log_ratio: torch.Tensor, *, max_kl: float | None = DEFAULT_MAX_KL) -> torch.Tensor:
    """r - log r - 1, clamped to [-max_kl, max_kl] (None: unclamped; >= 0 anyway)."""
    kl = torch.exp(log_ratio) - log_ratio - 1.0
    return kl if max_kl is None else kl.clamp(-max_kl, max_kl)


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    estimator: str = "k3",
    max_kl: float | None = DEFAULT_MAX_KL,
) -> torch.Tensor:
    """Estimate of KL(policy || reference) from the sampled tokens' logprobs.

    logprobs: (B, T) under the current policy (differentiable); ref_logprobs: (B, T) under the
    frozen reference; mask: (B, T) 1 on response tokens; max_kl: the estimator's per-token bound
    (k3's clamp). With a mask, returns the token mean over valid tokens (a scalar); without one,
    the per-token estimates (B, T), for a caller that weights tokens itself (e.g. across
    micro-batches).
    """
    fn = KL_ESTIMATORS.get(estimator)
    log_ratio = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, T)
    per_token = fn(log_ratio, max_kl=max_kl)  # (B, T)
    return per_token if mask is None else masked_mean(per_token, mask)


def kl_clamp_fraction(per_token: torch.Tensor, mask: torch.Tensor, max_kl: float | None) -> torch.Tensor:
    """Share of valid tokens whose KL estimate sits at the clamp (detached scalar); 0 without one."""
    if max_kl is None:
        return torch.zeros(())
    with torch.no_grad():
        return masked_mean((per_token.abs() >= max_kl).float(), mask)
