"""The update's loops, the same for every loss (the policy update, DPO's preference step, the
critic's value regression) and every training backend: one optimizer step over a mini-batch split
in micro-batches (`accumulate`), and an update stage's pass over this rank's share in mini-batches
(`train_share`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from rldock.runtime.dock.stage_loop import StageResult, StageSpec
from rldock.runtime.models.pipeline_stage import pipeline_links
from rldock.runtime.training.backend import TrainingBackend
from rldock.runtime.training.pipeline import run_one_forward_one_backward

if TYPE_CHECKING:
    from rldock.runtime.dock import TransferDock

# micro-batch -> (its loss already scaled by its share of the mini-batch, its metrics already
# weighted by the same or by the rank's own share: the step reports their sums)
MicroLoss = Callable[[TensorDict], tuple[torch.Tensor, dict[str, float]]]


def accumulate(
    backend: TrainingBackend, micro_batches: Sequence[TensorDict], micro_loss: MicroLoss, *, max_grad_norm: float
) -> dict[str, float]:
    """Zero the gradients, add every micro-batch's backward to them (synchronised across ranks on
    the last one where the backend defers it), then clip and step once. Returns the metrics summed
    over the micro-batches, in the first one's key order, and `grad_norm` (before clipping).

    A model split into pipeline stages (training/pipeline.py) runs them on its 1F1B schedule; a whole
    model runs each micro-batch's forward and backward in turn."""
    backend.optimizer.zero_grad(set_to_none=True)
    if pipeline_links(backend.model) is not None:
        stats = run_one_forward_one_backward(backend.model, micro_batches, micro_loss, backend.accumulating)
    else:
        stats = {}
        for i, micro in enumerate(micro_batches):
            with backend.accumulating(last=i == len(micro_batches) - 1):
                loss, metrics = micro_loss(micro)
                loss.backward()
            for key, value in metrics.items():
                stats[key] = stats.get(key, 0.0) + value
    stats["grad_norm"] = backend.step(max_grad_norm)
    return stats


def train_share(
    backend: TrainingBackend,
    dock: TransferDock,
    spec: StageSpec,
    step: Callable[[TensorDict], dict[str, float]],
    *,
    num_mini_batches: int,
    whole_groups: bool = False,
    track: Callable[[TensorDict], None] | None = None,
) -> tuple[StageResult, dict[str, float]]:
    """Read exactly this rank's share of `spec`'s state (`backend.update_share`, token-balanced across the
    DP ranks; in whole groups with `whole_groups`) and run `step` (mini-batch -> metrics, one
    optimizer step) on each of its `num_mini_batches` mini-batches; returns the stage's timing and
    the metrics averaged over the steps. `track` sees the whole share first."""
    steps: list[dict[str, float]] = []

    def train(indices: torch.Tensor, batch: TensorDict) -> None:
        if track is not None:
            track(batch)
        for mini_batch in batch.split(len(batch) // num_mini_batches):
            steps.append(step(mini_batch))

    backend.before_update()  # the training state back on the device
    timing = backend.run_update_stage(dock, spec, train, whole_groups=whole_groups)
    assert timing.num_samples == backend.update_share, f"{spec.name} got a partial share"
    return timing, {key: sum(metrics[key] for metrics in steps) / len(steps) for key in steps[0]}
