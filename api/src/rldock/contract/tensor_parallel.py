"""The rules every tensor-parallel size must satisfy for a model: a known architecture, even shapes.

Megatron-style TP splits attention heads, KV heads and the MLP width evenly over the TP ranks, so
each must be divisible by the TP size. The config checks it before a job starts (naming the
field), and the runtime applies it again when it parallelizes the model it actually loaded.
"""

from __future__ import annotations

# config.json `model_type`s whose decoder layers the TP plan (rldock.runtime.resharding.parallel_layout)
# names correctly: the same q/k/v/o and gate/up/down linears, attention that reshapes with -1 heads
# (so it runs on the local heads), and Qwen3's per-head q/k norms, which need no split.
TP_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# The split dimensions of the tiny demo models (rldock.runtime.models.tiny's defaults), for the
# config checks of a job whose tiny model is still to be built: TP 1 or 2 splits them.
TINY_MODEL_SHAPES = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2,
                     "intermediate_size": 512}


def check_architecture(*, tp_size: int, model_type: str | None, field: str) -> None:
    """TP > 1 only for architectures the plan covers (raises naming `field` and the architecture)."""
    if tp_size > 1 and model_type not in TP_ARCHITECTURES:
        raise ValueError(f"{field}={tp_size} needs a tensor-parallel plan for the model's architecture "
                         f"(model_type {model_type!r}); plans exist for {list(TP_ARCHITECTURES)}: "
                         "use tensor_parallel_size 1 for this model")


def check_divisible(*, tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                    field: str) -> None:
    """Even shards only: every split dimension must divide by `tp_size` (raises naming `field`)."""
    for what, size in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads),
                       ("intermediate_size", intermediate_size)):
        if size % tp_size:
            raise ValueError(f"{field}={tp_size} does not divide the model's {what} ({size}); "
                             "choose a tensor-parallel size that splits every head and MLP evenly")
