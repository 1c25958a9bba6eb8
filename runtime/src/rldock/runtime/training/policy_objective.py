"""The policy-gradient objective of one micro-batch: the recipe's policy loss plus the KL penalty
against the reference, scaled by the micro-batch's share of the mini-batch, with the metrics the
update reports. Tensors in, (loss, metrics) out: the actor's update wires it to the model's scores
and the training backend's accumulation (training/accumulation.py).

The scale makes the update the same however samples are split between ranks and micro-batches:
each micro-batch's aggregate (algorithm.loss_aggregation) is weighted by its units (tokens,
responses or the constant length) over the mini-batch's mean units per rank, and the backend
averages gradients over ranks. The metrics are this rank's token means.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rldock.runtime.algorithms.aggregation import aggregate, aggregation_units
from rldock.runtime.algorithms.core import masked_mean
from rldock.runtime.algorithms.importance import IMPORTANCE_WEIGHT, weighted_advantage
from rldock.runtime.algorithms.kl import kl_clamp_fraction, kl_penalty
from rldock.runtime.algorithms.losses import PolicyLoss, get_policy_loss

if TYPE_CHECKING:
    from rldock.config import JobConfig
    from rldock.runtime.flow.recipe import Recipe

# the share of tokens each bound touched: the ratio clip, dual-clip, the log ratio's clamp before exp()
CLIP_KEYS = ("clip_fraction", "dual_clip_fraction", "log_ratio_clamp_fraction")


@dataclass(frozen=True)
class PolicyObjective:
    """One recipe's objective, fixed at start: which loss, how it aggregates, and which of the
    optional columns (`old_logprobs`, `ref_logprobs`, `loss_weight`) the update's samples carry."""

    policy_loss: Callable[..., PolicyLoss]  # a registered policy loss (algorithms/losses.py)
    aggregation: str  # algorithm.loss_aggregation
    norm_length: int  # algorithm.max_response_length, the constant of the seq-mean-token-sum-norm modes
    kl_coef: float
    kl_estimator: str
    kl_clamp: float | None
    columns: frozenset[str]  # the update state's input columns
    loss_kwargs: Mapping[str, Any] = field(default_factory=dict)  # the loss's hyper-parameters

    def row_weights(self, batch: Mapping[str, Tensor]) -> Tensor | None:
        """Each response's weight in the aggregation (b,): PF-PPO's filtration weights; None (every
        response 1) where the flow carries none."""
        return batch["loss_weight"] if "loss_weight" in self.columns else None

    def episode_share(self, batch: Mapping[str, Tensor]) -> Tensor | None:
        """Each row's share of its episode's tokens (b,), which the advantage stage writes where an episode
        is several rows (a harness's segments); None (one row per episode) where the flow carries none."""
        return batch["episode_share"] if "episode_share" in self.columns else None

    def shape(self, batch: Mapping[str, Tensor]) -> dict[str, Any]:
        """How `batch`'s token losses aggregate besides the mode (aggregation.py's keyword arguments)."""
        return {
            "row_weights": self.row_weights(batch),
            "norm_length": self.norm_length,
            "episode_share": self.episode_share(batch),
        }

    def units(self, batch: Mapping[str, Tensor]) -> Tensor:
        """The aggregation's units of `batch` (a scalar): what a mini-batch's units per rank add up."""
        return aggregation_units(batch["response_mask"], self.aggregation, **self.shape(batch))

    def __call__(
        self,
        logprobs: Tensor,
        entropy: Tensor,
        micro: Mapping[str, Tensor],
        *,
        units_per_rank: Tensor,
        rank_tokens: Tensor,
    ) -> tuple[Tensor, dict[str, float]]:
        """The micro-batch's scaled loss and its metrics (weighted by its share of `rank_tokens`, the
        rank's scored tokens in the mini-batch, so they sum to the rank's token means).

        logprobs (b, SL) with gradients, entropy (b, SL), both 0 where `response_mask` is 0; `micro`
        the batch's columns: response_mask, advantage and those of `columns`."""
        mask = micro["response_mask"].float()  # (b, SL)
        shape = self.shape(micro)
        # The sampling policy's logprobs: the flow's when it computes them, else this pass's own,
        # detached (job_recipe drops that pass only when the sampling policy is the one training).
        old_logprobs = micro["old_logprobs"] if "old_logprobs" in self.columns else logprobs.detach()
        advantage = micro["advantage"]
        if IMPORTANCE_WEIGHT in self.columns:  # rollout.importance_correction decoupled
            advantage = weighted_advantage(advantage, micro[IMPORTANCE_WEIGHT])
        policy = self.policy_loss(
            logprobs, old_logprobs, advantage, mask, aggregation=self.aggregation, **shape, **self.loss_kwargs
        )
        kl, kl_clamped = torch.zeros(()), torch.zeros(())  # no reference with kl_coef 0
        if "ref_logprobs" in self.columns:
            kl_tokens = kl_penalty(
                logprobs, micro["ref_logprobs"], estimator=self.kl_estimator, max_kl=self.kl_clamp
            )  # (b, SL)
            kl = aggregate(kl_tokens, mask, self.aggregation, **shape)
            kl_clamped = kl_clamp_fraction(kl_tokens, mask, self.kl_clamp)
        loss = policy.loss + self.kl_coef * kl
        scale = self.units(micro) / units_per_rank
        share = (mask.sum() / rank_tokens).item()  # this rank's metrics: its own token mean
        return loss * scale, {
            "loss": loss.item() * share,
            "policy_loss": policy.loss.item() * share,
            "kl": kl.item() * share,
            **{key: getattr(policy, key).item() * share for key in CLIP_KEYS},
            "kl_clamp_fraction": kl_clamped.item() * share,
            "entropy": masked_mean(entropy, mask).item() * share,  # nats
        }


def job_objective(cfg: JobConfig, recipe: Recipe) -> PolicyObjective | None:
    """The objective of a job's `update` state; None for a recipe without a policy loss (DPO's
    preference step has its own)."""
    if recipe.policy_loss is None:
        return None
    algo = cfg.algorithm
    return PolicyObjective(
        policy_loss=get_policy_loss(recipe.policy_loss),
        aggregation=algo.loss_aggregation,
        norm_length=algo.max_response_length,
        kl_coef=algo.kl_coef,
        kl_estimator=algo.kl_estimator,
        kl_clamp=algo.kl_clamp,
        columns=frozenset(recipe.consumes[recipe.update_state]),
        loss_kwargs=recipe.policy_loss_kwargs(algo),
    )
