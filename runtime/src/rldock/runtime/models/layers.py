"""The decoder layers of a Hugging Face model, and activation checkpointing applied to them from outside.

FSDP shards and activation checkpointing both work per decoder layer. The layers are found by the
class names the model itself declares unsplittable (`_no_split_modules`, e.g. `LlamaDecoderLayer`),
so Llama, Qwen2, Qwen3 and the critic's body (a bare `LlamaModel`) need no table here.

Checkpointing is not HF's `gradient_checkpointing_enable`: that one only acts while a layer is in
training mode, and the actor's model stays in eval mode (no dropout, so the update's logprobs equal
the old-logprob pass's). Here a layer's forward is recomputed in backward whenever gradients are
being recorded, whatever the mode.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers in order; raises when the model declares none."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} declares no decoder layer class (_no_split_modules); "
            "FSDP and gradient checkpointing need one per layer"
        )
    return layers


def _checkpointed_forward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # inference: nothing to save, nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Recompute every decoder layer in backward instead of keeping its activations; returns how
    many layers. Call before FSDP wraps the layers, so FSDP's hooks sit outside the checkpoint
    (its pre-backward unshards a layer before the recompute runs)."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = partial(_checkpointed_forward, layer.forward)
    return len(layers)
