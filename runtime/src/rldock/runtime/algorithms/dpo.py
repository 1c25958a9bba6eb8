"""Direct Preference Optimization as pure tensor functions (Rafailov et al., arXiv 2305.18290).

A preference pair is two samples at consecutive dock indexes: the chosen response at the even
index, the rejected one at the odd index (a group of two), so pairs survive every hand-out that
keeps whole groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rldock.runtime.algorithms.core import masked_mean
from rldock.runtime.algorithms.kl import kl_penalty


@dataclass(frozen=True)
class DPOLoss:
    loss: torch.Tensor  # () differentiable: mean over pairs
    reward_accuracy: torch.Tensor  # () detached: share of pairs whose implicit reward prefers chosen
    reward_margin: torch.Tensor  # () detached: mean implicit reward of chosen minus rejected
    policy_accuracy: torch.Tensor  # () detached: share of pairs the policy itself gives chosen more logprob

    @property
    def metrics(self) -> dict[str, float]:
        return {
            "preference_accuracy": float(self.reward_accuracy),
            "reward_margin": float(self.reward_margin),
            "policy_preference_accuracy": float(self.policy_accuracy),
        }


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probability of each whole response: token logprobs (B, T) summed where mask (B, T) is 1 -> (B,)."""
    if token_logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(token_logprobs.shape)} and mask {tuple(mask.shape)} differ in shape")
    return (token_logprobs * mask.to(token_logprobs.dtype)).sum(dim=1)


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2P, ...) samples in pair order -> (chosen (P, ...), rejected (P, ...))."""
    if values.shape[0] % 2:
        raise ValueError(f"{values.shape[0]} samples cannot form chosen/rejected pairs")
    return values[0::2], values[1::2]


def dpo_loss(
    policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, beta: float, label_smoothing: float = 0.0
) -> DPOLoss:
    """DPO loss (eq. 7) over pairs, from sequence logprobs in pair order.

    policy_logprobs: (2P,) log pi(y|x) of each response under the policy (differentiable);
    ref_logprobs: (2P,) the same under the frozen reference; even rows chosen, odd rows rejected.
    The implicit reward of a response is beta * (log pi - log pi_ref); the loss is
    -log sigmoid(reward_chosen - reward_rejected), mean over pairs. With label_smoothing eps the
    labels are taken as flipped with probability eps (the conservative DPO of Mitchell, 2023).
    """
    if policy_logprobs.shape != ref_logprobs.shape or policy_logprobs.dim() != 1:
        raise ValueError(
            f"policy {tuple(policy_logprobs.shape)} and reference {tuple(ref_logprobs.shape)} logprobs "
            "must both have shape (2P,)"
        )
    assert 0.0 <= label_smoothing < 0.5, f"label smoothing {label_smoothing} outside the config's [0, 0.5)"
    rewards = beta * (policy_logprobs - ref_logprobs.to(policy_logprobs.dtype))  # (2P,)
    chosen, rejected = split_pairs(rewards)  # (P,), (P,)
    logits = chosen - rejected  # (P,)
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    with torch.no_grad():
        policy_chosen, policy_rejected = split_pairs(policy_logprobs)
        accuracy = (logits > 0).float().mean()
        margin = logits.mean()
        policy_accuracy = (policy_chosen > policy_rejected).float().mean()
    return DPOLoss(losses.mean(), accuracy, margin, policy_accuracy)


@dataclass(frozen=True)
class PreferenceObjective:
    """DPO's objective of one micro-batch of whole pairs (rows 2i chosen, 2i+1 rejected): the pair
    mean of `dpo_loss` scaled by the micro-batch's share of the mini-batch's pairs, with the KL to
    the reference logged (not trained on) and the policy's entropy."""

    beta: float
    label_smoothing: float
    kl_estimator: str
    kl_clamp: float | None

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor, micro: Mapping[str, torch.Tensor], *, share: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """logprobs (b, SL) with gradients, entropy (b, SL); `micro` has response_mask and
        ref_logprobs; `share`: len(micro) / len(mini-batch)."""
        mask = micro["response_mask"].float()  # (b, SL)
        out = dpo_loss(
            sequence_logprobs(logprobs, mask),
            sequence_logprobs(micro["ref_logprobs"], mask),
            beta=self.beta,
            label_smoothing=self.label_smoothing,
        )
        with torch.no_grad():  # logged only: how far the policy drifted from the reference
            kl_tokens = kl_penalty(
                logprobs.detach(), micro["ref_logprobs"], estimator=self.kl_estimator, max_kl=self.kl_clamp
            )
            kl = masked_mean(kl_tokens, mask)
        metrics = {
            "loss": out.loss.item(),
            "policy_loss": out.loss.item(),
            "kl": kl.item(),
            "entropy": masked_mean(entropy, mask).item(),
            **out.metrics,
        }
        return out.loss * share, {key: value * share for key, value in metrics.items()}
