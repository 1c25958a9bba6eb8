"""GSPO's policy loss (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071): the
importance ratio and its clip are per response, not per token.

    s_i = (pi(y_i | x) / pi_old(y_i | x)) ^ (1 / |y_i|) = exp(1/|y_i| sum_t (log pi - log pi_old))
    J   = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)          (eq. 5)

A token ratio's noise grows with the length of the response under it; the length-normalised
sequence ratio does not, and a response is clipped (and so left out of the gradient) as a whole.
The loss is written in the paper's GSPO-token form (eq. 13), s_i,t = sg[s_i] pi(y_i,t) / sg[pi(y_i,t)],
which has the value s_i on every token and gives each token the gradient s_i A_i grad log pi; with
one advantage per response and the `seq_mean_token_mean` aggregation (GSPO's default in rldock)
it is eq. 5 exactly. The paper's clip ranges are tiny (3e-4 and 4e-4, sec. 5.1) because s_i is a
geometric mean over the response's tokens.
"""

from __future__ import annotations

import torch

from rldock.runtime.algorithms.aggregation import aggregate
from rldock.runtime.algorithms.core import masked_mean
from rldock.runtime.algorithms.losses import MAX_LOG_RATIO, PolicyLoss, check_shapes, register_policy_loss


@register_policy_loss("gspo")
def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    aggregation: str = "seq_mean_token_mean",
    row_weights: torch.Tensor | None = None,
    norm_length: int | None = None,
    episode_share: torch.Tensor | None = None,
) -> PolicyLoss:
    """GSPO(-token) surrogate to minimise.

    logprobs, old_logprobs: (B, T) response tokens' logprobs under the current and the sampling
    policy; advantages: (B,) one per response (or (B, T), GSPO-token's per-token advantages);
    mask: (B, T) 1 on response tokens; clip_ratio_low/high: the sequence ratio's clip
    [1 - low, 1 + high]; aggregation, row_weights, norm_length as in `clipped_policy_loss`.
    The mean log ratio of a response is clamped to +-MAX_LOG_RATIO before exp(), so the loss and
    its gradients stay finite for any log ratio. Returns a PolicyLoss.
    """
    check_shapes(logprobs, old_logprobs, advantages, mask)
    mask = mask.to(logprobs.dtype)
    lengths = mask.sum(dim=1).clamp(min=1)  # (B,)
    seq_log_ratio = ((logprobs - old_logprobs) * mask).sum(dim=1).detach() / lengths  # (B,) log s_i, sg
    clamped = seq_log_ratio.abs() > MAX_LOG_RATIO  # (B,)
    seq_log_ratio = seq_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    # value s_i on every token; gradient s_i * grad log pi(y_i,t)
    log_token_ratio = seq_log_ratio.unsqueeze(1) + logprobs - logprobs.detach()  # (B, T)
    ratio = torch.exp(log_token_ratio)  # (B, T)
    adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).to(ratio.dtype)
    unclipped = -adv * ratio  # (B, T)
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # (B, T)
    token_loss = torch.maximum(unclipped, clipped)  # (B, T)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).float(), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "log_ratio_clamp_fraction": masked_mean(clamped.unsqueeze(1).expand_as(mask).float(), mask),
        }
    return PolicyLoss(
        aggregate(
            token_loss, mask, aggregation, row_weights=row_weights, norm_length=norm_length, episode_share=episode_share
        ),
        **stats,
    )
