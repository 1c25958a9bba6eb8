"""Context parallelism's attention, by mode (`training.context_parallel_mode`): `ulysses` exchanges
heads by all-to-all (engines/ulysses.py), `ring` passes keys and values around the CP group
(engines/ring_attention.py). Both run on the same sequence slices and 4D masks (ulysses.py's
`shard_forward`), so the passes, the gradients' sum over CP and FSDP over dp x cp are the same for
either; only the attention function the model's config names differs.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from rldock.contract.context_parallel import check_heads_divide
from rldock.runtime.engines.ring_attention import RING_IMPLEMENTATIONS
from rldock.runtime.engines.ulysses import ULYSSES_IMPLEMENTATIONS
from rldock.runtime.models.context_group import GROUP_ATTRIBUTE

# Per mode: the attention implementation a model ran without CP -> the one that mode gives it.
IMPLEMENTATIONS = {"ulysses": ULYSSES_IMPLEMENTATIONS, "ring": RING_IMPLEMENTATIONS}
# The 4D mask each CP implementation reads: that of the implementation it wraps.
MASK_KINDS = {
    wrapped: {"sdpa": "boolean", "eager": "additive"}[base]
    for implementations in IMPLEMENTATIONS.values()
    for base, wrapped in implementations.items()
}


def apply_context_attention(
    model: nn.Module, group: dist.ProcessGroup, mode: str = "ulysses", *, tp: int = 1
) -> nn.Module:
    """Make `model` (a Hugging Face causal LM or its body, possibly wrapped by DDP/PEFT/FSDP) attend
    over `group` in `mode`; returns it. Its passes must then give it sequence shards
    (`shard_forward`). `tp`: the TP size its layers are split over, whose ranks each attend with 1/tp
    of the heads (the attention reshapes to the local heads; Ulysses splits those again)."""
    assert mode in IMPLEMENTATIONS, f"context-parallel mode {mode!r} is none of {sorted(IMPLEMENTATIONS)}"
    config = _hf_config(model)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in IMPLEMENTATIONS[mode]:
        raise ValueError(
            f"context parallelism runs the model's attention on a 4D mask (sdpa or eager), "
            f"not {implementation!r}: load the model with attn_implementation sdpa"
        )
    if getattr(config, "layer_types", None) and any(kind != "full_attention" for kind in config.layer_types):
        raise ValueError("context parallelism needs full attention in every layer (no sliding window)")
    cp = dist.get_world_size(group)
    check_heads_divide(
        cp=cp, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, mode=mode, tp=tp
    )
    attention_modules = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    if not attention_modules:
        raise TypeError(f"{type(model).__name__}: no attention module with num_key_value_groups")
    for module in attention_modules:
        setattr(module, GROUP_ATTRIBUTE, group)
    config._attn_implementation = IMPLEMENTATIONS[mode][implementation]
    return model


def _hf_config(model: nn.Module) -> Any:
    """The Hugging Face config of `model`: its own, or its first submodule's that has one (through
    DDP's `module`, the critic's value model's `body`)."""
    config = next((m.config for m in model.modules() if hasattr(m, "config")), None)
    if config is None:
        raise TypeError(f"{type(model).__name__}: no Hugging Face config on it or any submodule")
    return config
