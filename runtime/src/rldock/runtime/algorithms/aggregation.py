"""Loss aggregation by name (`algorithm.loss_aggregation`): how per-token losses (B, T) become the
scalar to minimise, as verl's `agg_loss` modes.

- `token_mean`: sum over every valid token / number of valid tokens (DAPO sec. 3.3; rldock's
  default): each token counts the same, so long responses are not down-weighted per token.
- `seq_mean_token_mean`: each response's token mean, then the mean over responses (GRPO as written
  in DeepSeekMath eq. 3; GSPO's objective): each response counts the same.
- `seq_mean_token_sum`: each response's token sum, then the mean over responses.
- `seq_mean_token_sum_norm`: the sum over responses of each response's token sum, divided by a
  constant length, the generation limit (Dr. GRPO, arXiv 2503.20783, sec. 3.1: no length bias).
  As verl's mode of that name there is no division by the number of responses.

Rows with no valid token are left out of every mean over responses (they neither add 0 nor count).

An episode of several rows (a harness's segments, algorithms/episode_rows.py) is one response to the means:
`episode_share` (B,), each row's share of its episode's valid tokens, makes `seq_mean_token_mean` the mean
over episodes of each episode's token mean over all its segments, and `seq_mean_token_sum` the mean over
episodes of each episode's token sum; `token_mean` (each token once) and `seq_mean_token_sum_norm` (every
token's sum over a constant) need no episode, a segment's tokens count as they would in one long row.
A one-row episode has share 1, so without segments every mode gives today's numbers exactly.
Optional `row_weights` (B,), >= 0 (PF-PPO's filtration weights), weight each response's tokens in
both the sum and the count, so a response of weight 0 adds nothing: `token_mean` becomes
sum(w_b m_bt l_bt) / sum(w_b m_bt), the sequence means sum(w_b s_b) / sum(w_b) over non-empty rows.

A batch split into micro-batches and data-parallel ranks has the aggregate of the whole batch when
each micro-batch's `aggregate(...)` is scaled by its `units` over the mean units per rank (see
`policy_step` in training/policy_steps.py): every mode is a sum of per-micro-batch numerators over
a denominator that is either additive (tokens, rows) or constant (the length).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rldock.runtime.algorithms.core import masked_mean
from rldock.runtime.registry import Registry

# (values (B, T), mask (B, T) float, row_weights (B,) or None, norm_length, episode_share (B,) or None)
# -> (numerator (), units ())
PartsFn = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None", "int | None", "torch.Tensor | None"],
    tuple[torch.Tensor, torch.Tensor],
]


@dataclass(frozen=True)
class Aggregation:
    parts: PartsFn
    # True: the whole batch's denominator is the sum of its parts' units (tokens, rows); False: it
    # is the same constant for every part (the normalising length).
    additive_units: bool = True


LOSS_AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation", field="algorithm.loss_aggregation")


def _row_weights(mask: torch.Tensor, row_weights: torch.Tensor | None) -> torch.Tensor:
    """(B,) weight of each row, 0 for a row with no valid token."""
    nonempty = (mask.sum(dim=1) > 0).to(mask.dtype)  # (B,)
    return nonempty if row_weights is None else nonempty * row_weights.to(mask.dtype)


def _token_mean(values, mask, row_weights, norm_length, episode_share):
    weighted = mask if row_weights is None else mask * row_weights.to(mask.dtype).unsqueeze(1)  # (B, T)
    return (values * weighted).sum(), weighted.sum()


def _seq_mean(per_row: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, shared_rows: bool) -> PartsFn:
    """A mean over responses of `per_row`'s value of each row; an episode of several rows counts one unit
    (its rows' shares), and with `shared_rows` its rows' values are weighted by their shares too (a token
    mean over the episode), else summed (a token sum over the episode)."""

    def parts(values, mask, row_weights, norm_length, episode_share):
        weights = _row_weights(mask, row_weights)  # (B,)
        if episode_share is None:
            return (per_row(values, mask) * weights).sum(), weights.sum()
        shares = weights * episode_share.to(mask.dtype)  # (B,)
        return (per_row(values, mask) * (shares if shared_rows else weights)).sum(), shares.sum()

    return parts


def _token_sum_norm(values, mask, row_weights, norm_length, episode_share):
    assert norm_length is not None and norm_length >= 1, f"seq_mean_token_sum_norm needs a length, got {norm_length}"
    weights = _row_weights(mask, row_weights)  # (B,)
    return ((values * mask).sum(dim=1) * weights).sum(), torch.tensor(float(norm_length), dtype=values.dtype)


LOSS_AGGREGATIONS.register("token_mean")(Aggregation(_token_mean))
LOSS_AGGREGATIONS.register("seq_mean_token_mean")(
    Aggregation(_seq_mean(lambda values, mask: masked_mean(values, mask, dim=1), shared_rows=True))
)
LOSS_AGGREGATIONS.register("seq_mean_token_sum")(
    Aggregation(_seq_mean(lambda values, mask: (values * mask).sum(dim=1), shared_rows=False))
)
LOSS_AGGREGATIONS.register("seq_mean_token_sum_norm")(Aggregation(_token_sum_norm, additive_units=False))


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    *,
    row_weights: torch.Tensor | None = None,
    norm_length: int | None = None,
    episode_share: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scalar `mode` makes of per-token `values` (B, T) over `mask` (B, T) 1 on valid tokens;
    `row_weights` (B,) >= 0 or None; `norm_length` the constant of `seq_mean_token_sum_norm`;
    `episode_share` (B,) each row's share of its episode's tokens (None: one row per episode). An
    empty batch (no valid token, or every weight 0) gives 0."""
    mask = mask.to(values.dtype)
    if mode == "token_mean" and row_weights is None:
        return masked_mean(values, mask)  # today's loss, bit for bit
    numerator, units = LOSS_AGGREGATIONS.get(mode).parts(values, mask, row_weights, norm_length, episode_share)
    return torch.where(
        units > 0, numerator / units.clamp(min=torch.finfo(values.dtype).tiny), torch.zeros_like(numerator)
    )


def aggregation_units(
    mask: torch.Tensor,
    mode: str = "token_mean",
    *,
    row_weights: torch.Tensor | None = None,
    norm_length: int | None = None,
    episode_share: torch.Tensor | None = None,
) -> torch.Tensor:
    """The denominator `aggregate` divides by for this batch (a float scalar): weighted tokens,
    weighted non-empty rows (episodes, with `episode_share`), or the normalising length."""
    mask = mask.float()
    return LOSS_AGGREGATIONS.get(mode).parts(torch.zeros_like(mask), mask, row_weights, norm_length, episode_share)[1]


def additive_units(mode: str) -> bool:
    """Whether a split batch's denominator is the sum of its parts' (else a constant)."""
    return LOSS_AGGREGATIONS.get(mode).additive_units
