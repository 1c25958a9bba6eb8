"""Rollout correction: the train-inference mismatch of RL post-training, corrected per token. The
engine (vLLM) samples each response token and reports its logprob; the trainer recomputes the logprob
of the same token under the same weights, and the two differ (kernels, precision, MoE routing). The
update then runs off-policy by a gap nobody chose, and importance weights correct for it:

    rho_t   = pi_train(y_t) / pi_engine(y_t) = exp(logp_train_t - logp_engine_t)      token ratio
    rho_seq = prod_t rho_t = exp(sum_t log rho_t)                                      sequence ratio
    rho_geo = exp(mean_t log rho_t)                                                    geometric mean

over a response's valid tokens (the mask). Every ratio is formed in log space in float64: a product of
hundreds of token ratios leaves float32's range (e^88.7) long before it means anything.

Two operations act on a ratio, and the peers combine them:

    truncation (TIS)   w = min(rho, cap)                      keeps the token, bounds its weight
    rejection  (MIS)   w = 0 where rho is outside [low, high]  drops the token or the whole response

`correction_weight` returns the (B, T) factor the policy-gradient term is multiplied by: the weight of
`weight` ("none" 1 | "token" min(rho_t, cap) | "sequence" min(rho_seq, cap) on each of the response's
tokens), times the keep mask of `reject` ("none" | "token": rho_t in [low, high] | "sequence": rho_seq
in [low, high] | "geometric": rho_geo in [low, high], the whole response kept or dropped), times the
mask. It is a stop-gradient factor (both peers detach it): no gradient flows through it.

The peers, as read (TRL main after v1.9.0: trl/trainer/grpo_trainer.py and grpo_config.py;
verl main after v0.7.0: verl/trainer/ppo/rollout_corr_helper.py, verl/trainer/config/algorithm.py,
docs/algo/rollout_corr.md):

TRL, GRPOTrainer with vLLM: `vllm_importance_sampling_correction` (default True),
`vllm_importance_sampling_mode` (default "sequence_mask" since v0.26; v0.23-v0.25 had token truncation
only, cap 2.0), `vllm_importance_sampling_clip_max` C_max (default 3.0; `vllm_importance_sampling_cap`
before v1.6) and `..._clip_min` C_min (default None, added for IcePop). The ratio is token or sequence
(exp of the masked sum); `*_truncate` clamps it to [C_min, C_max], `*_mask` sets it to 0 outside
[C_min, C_max] and leaves it unclipped inside; the result multiplies the per-token loss, so a masked
token stays in the loss's denominator (a zeroed weight). The exact mapping (None -> low 0 / high inf):

    token_truncate     weight="token",    cap=C_max, reject="none"                        (C_min None)
    sequence_truncate  weight="sequence", cap=C_max, reject="none"                        (C_min None)
    token_mask         weight="token",    cap=C_max, reject="token",    low=C_min, high=C_max
    sequence_mask      weight="sequence", cap=C_max, reject="sequence", low=C_min, high=C_max

In the mask modes every kept ratio is <= C_max = cap, so min(rho, cap) = rho and the factor is TRL's
rho * 1[C_min <= rho <= C_max] exactly. TRL's truncate modes with a C_min (which raise small ratios to
C_min) have no counterpart here.

verl, algorithm.rollout_correction: `rollout_is` ("token" | "sequence") with `rollout_is_threshold` tau
is w = min(rho, tau), no lower truncation (weight=`rollout_is`, cap=tau); the typed config's default
and its docs' recommendation is "sequence" with tau 2.0 (preset decoupled_seq_is, Seq-TIS).
`rollout_rs` rejects outside [lower, upper] (bounds inclusive, lower defaulting to 1/upper): "token",
"sequence", "geometric" in verl v0.6.1 (reject= the same name, low=lower, high=upper); since v0.7.0
"token_k1", "seq_sum_k1", "seq_mean_k1" with "lower_upper" bounds on k1 = -log rho,
which keep rho in [1/upper, 1/lower] (reject "token", "sequence", "geometric" with low=1/upper,
high=1/lower; the same band for reciprocal pairs such as "0.5_2.0"). Its k2/k3/max criteria are not
covered here. verl's rejection is not a weight: it removes the token from response_mask, so it also
leaves the loss's denominator. `rejection_mask` is that modified mask; aggregating with it as the mask
and `correction_weight` as the factor reproduces verl (the IS weight, computed on the original mask,
times the keep mask). verl clamps log ratios to +-20 before exp (weights floored at e^-20 ~ 2e-9);
here no floor is applied: for thresholds inside (e^-20, e^20) every decision is the same.

IcePop (Ring/Ling team, Ant Group: the blog "Small Leak Can Sink a Great Ship", the Ring-1T report
arXiv 2510.18855; AReaL ships it, TRL as token_mask with both bounds):
tokens whose rho_t leaves [alpha, beta] get no gradient, the others keep the factor rho_t, i.e.
weight="token", cap=beta, reject="token", low=alpha, high=beta.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

WEIGHTS = ("none", "token", "sequence")
# The old-logprob pass's result carries its batches' `mismatch_part`s under this key (the record merges them).
MISMATCH_KEY = "mismatch"
REJECTIONS = ("none", "token", "sequence", "geometric")

# Each peer's setting as a preset of these arguments: rldock.config.rollout_correction.PRESETS.

# exp() of float64 overflows past ~709.78; ratios reported as metrics saturate at e^709 instead of inf.
_MAX_LOG = 709.0
# A weight that does not fit float32 (a sequence ratio with cap=inf) saturates instead of becoming inf.
_FLOAT32_MAX = torch.finfo(torch.float32).max
# `tokens_weighed_down` counts w < rho_t * (1 - _WEIGHED_DOWN_RTOL): a weight equal to rho_t up to float32
# rounding (2^-24), even one computed in float32 from logprobs as low as -64 (error 2^-18), is not counted.
_WEIGHED_DOWN_RTOL = 1e-5


def _check(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> None:
    if trainer.dim() != 2 or trainer.shape != engine.shape or trainer.shape != mask.shape:
        raise ValueError(
            f"trainer, engine and mask must be (B, T) of one shape, got {tuple(trainer.shape)}, "
            f"{tuple(engine.shape)}, {tuple(mask.shape)}"
        )


def _log_ratios(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log rho (B, T) float64, 0 on padding, and the valid-token mask (B, T) bool. Padding may hold any
    value (garbage, inf, NaN): it is selected away, never multiplied in."""
    _check(trainer, engine, mask)
    valid = mask.detach() != 0
    diff = trainer.detach().to(torch.float64) - engine.detach().to(torch.float64)
    return torch.where(valid, diff, torch.zeros_like(diff)), valid


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def rejection_mask(
    trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, *, reject: str, low: float, high: float
) -> torch.Tensor:
    """Keep mask (B, T) float32: 1 on the valid tokens `reject` keeps, 0 on rejected ones and padding.

    reject "none" keeps every valid token; "token" keeps a token when rho_t is in [low, high];
    "sequence" keeps a response when rho_seq is, "geometric" when rho_geo is (bounds inclusive;
    low=0 and high=inf leave that side open). The decisions compare log ratios with log bounds, so a
    product past float range is still rejected, never NaN. Used as the loss's mask it is verl's
    modified response_mask (rejected tokens leave the denominator).
    """
    if reject not in REJECTIONS:
        raise ValueError(f"reject must be one of {REJECTIONS}, got {reject!r}")
    log_rho, valid = _log_ratios(trainer, engine, mask)
    if reject == "none":
        return valid.to(torch.float32)
    if not 0 <= low <= high:
        raise ValueError(f"the band needs 0 <= low <= high, got low={low}, high={high}")
    if reject == "token":
        stat = log_rho
    else:
        stat = log_rho.sum(dim=1, keepdim=True)  # (B, 1) log rho_seq
        if reject == "geometric":
            stat = stat / valid.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1) log rho_geo
    keep = (stat >= _log(low)) & (stat <= _log(high))  # (B, T) or (B, 1)
    return (keep & valid).to(torch.float32)


def correction_weight(
    trainer: torch.Tensor,
    engine: torch.Tensor,
    mask: torch.Tensor,
    *,
    weight: str,
    cap: float,
    reject: str,
    low: float,
    high: float,
) -> torch.Tensor:
    """The per-token factor (B, T) float32 of the policy-gradient term, 0 on padding.

    trainer, engine: (B, T) logprobs of the sampled tokens under the trainer and the engine; mask:
    (B, T) 1 on valid response tokens (tokens the engine did not sample, e.g. tool output, belong
    outside it). weight: "none" (1), "token" min(rho_t, cap) or "sequence" min(rho_seq, cap) on each
    of the response's tokens; cap > 0 (inf: no truncation). reject, low, high: as `rejection_mask`,
    whose rejected tokens get 0 and the kept ones keep their weight. The module docstring maps TRL's,
    verl's and IcePop's settings onto these arguments (PRESETS holds their defaults).
    """
    if weight not in WEIGHTS:
        raise ValueError(f"weight must be one of {WEIGHTS}, got {weight!r}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    keep = rejection_mask(trainer, engine, mask, reject=reject, low=low, high=high).to(torch.float64)
    log_rho, _ = _log_ratios(trainer, engine, mask)
    if weight == "none":
        log_w = torch.zeros_like(log_rho)
    elif weight == "token":
        log_w = log_rho
    else:
        log_w = log_rho.sum(dim=1, keepdim=True).expand_as(log_rho)  # log rho_seq on every token
    # min(rho, cap) taken in log space: exp() then never sees a log ratio above log(cap)
    w = torch.exp(log_w.clamp(max=math.log(cap))).clamp(max=_FLOAT32_MAX)
    return (w * keep).to(torch.float32)


def mismatch_metrics(
    trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor | None = None
) -> dict[str, float]:
    """How far the engine's and the trainer's logprobs are apart, over one whole batch (B, T).

    mismatch/kl: token mean of k3 = rho - 1 - log rho over the valid tokens, the estimator of
        KL(engine || trainer) from tokens the engine sampled (>= 0 token by token; expm1 keeps it
        exact near rho = 1).
    mismatch/kl_seq: each response's sum of k3, averaged over the responses with a valid token.
    mismatch/abs_diff_mean, mismatch/abs_diff_max: of |logp_train - logp_engine| over valid tokens.
    mismatch/seq_ratio_p50, mismatch/seq_ratio_p99: quantiles of rho_seq over the responses with a
        valid token, taken on log rho_seq (linear interpolation between order statistics) and then
        exponentiated: exactly the ratio's quantile at an order statistic, the geometric interpolation
        between two otherwise; saturated at e^709.
    With `weight` (B, T), the factor the update applies (e.g. `correction_weight`'s):
    mismatch/tokens_weighed_down: share of valid tokens with 0 < w < rho_t (by more than a relative
        1e-5, float rounding): weighed below the token's own ratio, by truncation or by a sequence
        weight under it.
    mismatch/tokens_dropped: share of valid tokens with w = 0.
    mismatch/sequences_dropped: share of the responses with a valid token whose valid tokens all have
        w = 0.
    mismatch/tokens: how many tokens the gap was measured on (0: none, and every other metric 0, not a gap
        of 0; a partial rollout's iteration whose tokens an older version all sampled).
    An empty mask gives zeros. The same as `merge_mismatch` of the batch's one `mismatch_part`.
    """
    return merge_mismatch([mismatch_part(trainer, engine, mask, weight)])


def mismatch_part(
    trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor | None = None
) -> dict[str, Any]:
    """One batch's sums behind `mismatch_metrics` (plain numbers and a list, so a worker can send them):
    the metrics of several batches, on several ranks, are `merge_mismatch` of their parts, exactly as
    if they had been one batch."""
    log_rho, valid = _log_ratios(trainer, engine, mask)
    if weight is not None and weight.shape != log_rho.shape:
        raise ValueError(f"weight must be {tuple(log_rho.shape)}, got {tuple(weight.shape)}")
    rows = valid.any(dim=1)  # (B,) responses with a valid token
    x = log_rho[valid]  # (N,) valid tokens' log ratios
    # k3 = expm1(x) - x: no cancellation of 1 + tiny - 1; >= 0 exactly, the clamp absorbs a last-ulp miss
    k3 = (torch.expm1(log_rho.clamp(max=_MAX_LOG)) - log_rho).clamp(min=0) * valid  # (B, T)
    part: dict[str, Any] = {
        "tokens": int(valid.sum()),
        "sequences": int(rows.sum()),
        "k3": float(k3.sum()),
        "k3_per_sequence": float(k3.sum(dim=1)[rows].sum()),
        "abs_diff": float(x.abs().sum()),
        "abs_diff_max": float(x.abs().max()) if x.numel() else 0.0,
        "sequence_log_ratios": log_rho.sum(dim=1)[rows].tolist(),  # (S,) log rho_seq
    }
    if weight is not None:
        w = weight.detach().to(torch.float64)
        rho = torch.exp(log_rho)
        zero = (w == 0) & valid
        down = (w > 0) & (w < rho * (1 - _WEIGHED_DOWN_RTOL)) & valid
        part["tokens_weighed_down"] = int(down.sum())
        part["tokens_dropped"] = int(zero.sum())
        part["sequences_dropped"] = int((zero.sum(dim=1) == valid.sum(dim=1))[rows].sum())
    return part


def merge_mismatch(parts: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The `mismatch/` metrics (see `mismatch_metrics`) of the batches whose `mismatch_part`s these are;
    the weight's shares only when every part has them. No part, or no valid token, gives zeros."""
    keys = ["kl", "kl_seq", "abs_diff_mean", "abs_diff_max", "seq_ratio_p50", "seq_ratio_p99"]
    weighed = bool(parts) and all("tokens_dropped" in part for part in parts)
    if weighed:
        keys += ["tokens_weighed_down", "tokens_dropped", "sequences_dropped"]
    tokens = sum(part["tokens"] for part in parts)
    if tokens == 0:
        return {**{f"mismatch/{key}": 0.0 for key in keys}, "mismatch/tokens": 0}
    sequences = sum(part["sequences"] for part in parts)
    seq_log = torch.tensor([r for part in parts for r in part["sequence_log_ratios"]], dtype=torch.float64)
    q = torch.quantile(seq_log, torch.tensor([0.5, 0.99], dtype=torch.float64))
    p50, p99 = torch.exp(q.clamp(-_MAX_LOG, _MAX_LOG)).tolist()
    out = {
        "kl": sum(part["k3"] for part in parts) / tokens,
        "kl_seq": sum(part["k3_per_sequence"] for part in parts) / sequences,
        "abs_diff_mean": sum(part["abs_diff"] for part in parts) / tokens,
        "abs_diff_max": max(part["abs_diff_max"] for part in parts),
        "seq_ratio_p50": p50,
        "seq_ratio_p99": p99,
    }
    if weighed:
        out["tokens_weighed_down"] = sum(part["tokens_weighed_down"] for part in parts) / tokens
        out["tokens_dropped"] = sum(part["tokens_dropped"] for part in parts) / tokens
        out["sequences_dropped"] = sum(part["sequences_dropped"] for part in parts) / sequences
    return {**{f"mismatch/{key}": value for key, value in out.items()}, "mismatch/tokens": tokens}
