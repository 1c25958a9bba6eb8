"""Context parallelism for a trained model (`training.context_parallel_size`): the CP groups, the
model's attention switched to Ulysses (engines/ulysses.py), and its gradients summed over CP.

Ranks: the default group's world is dp x cp ranks, CP innermost: rank `d cp + c` is CP rank c of
data-parallel rank d, and the cp consecutive ranks of one data-parallel rank share their rows (each
computes 1/cp of every sequence). The CP group sits inside the data-parallel dimension: FSDP shards
over all dp x cp ranks, so the parameters, gradients and optimizer state per rank fall by dp x cp.

Gradients: a CP rank's gradient is its positions' share of its data-parallel rank's gradient (every
rank of the group computes the same loss), so the step's gradient is the sum over each CP group
averaged over the dp groups: a reduction over all ranks divided by dp, not by dp x cp
(`sum_over_context`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rldock.runtime.engines.ulysses import apply_ulysses


def context_group(cp: int) -> dist.ProcessGroup:
    """This rank's CP group: the cp consecutive ranks of its data-parallel rank (module docstring).
    Collective: every rank of the default group creates every CP group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % cp:
        raise ValueError(f"training.context_parallel_size={cp} must divide the {world} training ranks")
    mine = None
    for start in range(0, world, cp):
        group = dist.new_group(list(range(start, start + cp)))
        if start <= rank < start + cp:
            mine = group
    assert mine is not None
    return mine


def apply_context_parallel(model: nn.Module, cp: int) -> dist.ProcessGroup | None:
    """Give `model` Ulysses attention over this rank's CP group (None and nothing done at cp 1).
    Collective over the default group; call before the training backend wraps the model."""
    if cp == 1:
        return None
    group = context_group(cp)
    apply_ulysses(model, group)
    return group


def sum_over_context(model: nn.Module, *, dp: int) -> None:
    """Make FSDP's gradient reduction over the dp x cp ranks divide by dp: a sum over each CP group,
    a mean over the data-parallel ranks (module docstring). Call after `fully_shard`."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(dp))
