"""The critic's loss: squared error to the returns, with PPO's value clipping."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rldock.runtime.algorithms.core import masked_mean


@dataclass(frozen=True)
class ValueLoss:
    loss: torch.Tensor  # () differentiable through `values`
    clip_fraction: torch.Tensor  # () detached: share of valid tokens whose clipped error was taken

    @property
    def metrics(self) -> dict[str, float]:
        return {"value_clip_fraction": float(self.clip_fraction)}


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, value_clip: float
) -> ValueLoss:
    """0.5 * max((V - R)^2, (V_clip - R)^2), token mean over the mask, with
    V_clip = V_old + clamp(V - V_old, -value_clip, value_clip) (the PPO value clipping of OpenAI
    baselines' ppo2 and of InstructGPT-style RLHF trainers).

    values: (B, T) the critic's current predictions (differentiable); old_values: (B, T) its
    predictions when the returns were computed; returns: (B, T) targets; mask: (B, T) 1 on
    response tokens. The max keeps the loss from rewarding a value that jumped past the clip.
    """
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(
            f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
            f"{tuple(returns.shape)} and mask {tuple(mask.shape)} must have the same (B, T) shape"
        )
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)  # (B, T)
    unclipped_error = (values - returns) ** 2  # (B, T)
    clipped_error = (clipped - returns) ** 2  # (B, T)
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), mask)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped_error > unclipped_error).float(), mask)
    return ValueLoss(loss, clip_fraction)
