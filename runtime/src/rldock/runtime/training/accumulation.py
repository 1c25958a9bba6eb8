"""The micro-batch accumulation loop: one optimizer step over a mini-batch split in micro-batches,
the same for every loss (the policy update, DPO's preference step) and every training backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDict

from rldock.runtime.training.backend import TrainingBackend

# micro-batch -> (its loss already scaled by its share of the mini-batch, its metrics already
# weighted by the same or by the rank's own share: the step reports their sums)
MicroLoss = Callable[[TensorDict], tuple[torch.Tensor, dict[str, float]]]


def accumulate(
    backend: TrainingBackend, micro_batches: Sequence[TensorDict], micro_loss: MicroLoss, *, max_grad_norm: float
) -> dict[str, float]:
    """Zero the gradients, add every micro-batch's backward to them (synchronised across ranks on
    the last one where the backend defers it), then clip and step once. Returns the metrics summed
    over the micro-batches, in the first one's key order, and `grad_norm` (before clipping)."""
    backend.optimizer.zero_grad(set_to_none=True)
    stats: dict[str, float] = {}
    for i, micro in enumerate(micro_batches):
        with backend.accumulating(last=i == len(micro_batches) - 1):
            loss, metrics = micro_loss(micro)
            loss.backward()
        for key, value in metrics.items():
            stats[key] = stats.get(key, 0.0) + value
    stats["grad_norm"] = backend.step(max_grad_norm)
    return stats
