"""The context-parallel group a model runs in, as the model's own modules know it: `apply_ulysses`
(engines/ulysses.py) sets it on each attention module, and the model-side code that must see the whole
sequence (the MoE router's load-balancing statistics, the routing record) finds it there and sums its
rank's share over the group. Here, below the engines, so that models/ never imports engines/."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

GROUP_ATTRIBUTE = "ulysses_group"  # set on each attention module: the CP group its all-to-alls run over


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum whose backward is the identity: every rank of the group computes the same loss
    from the sum, so each rank's share of it gets the loss's gradient as is (torch's autograd
    all-reduce would sum the cp identical gradients)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def sum_over_group(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Each rank's part (zero where another rank computed) summed over the CP group, on every rank."""
    return _SumOverGroup.apply(x, group)


def context_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The CP group `apply_ulysses` gave `model`, or None: the model runs whole sequences (so does a
    plain function standing in for a model)."""
    if not isinstance(model, nn.Module):
        return None
    for module in model.modules():
        group = getattr(module, GROUP_ATTRIBUTE, None)
        if group is not None:
            return group
    return None
