"""The rule every tensor-parallel size must satisfy for a model's shapes.

Megatron-style TP splits attention heads, KV heads and the MLP width evenly over the TP ranks, so
each must be divisible by the TP size. The config checks it before a job starts (naming the
field), and the runtime applies it again when it parallelizes the model it actually loaded.
"""

from __future__ import annotations


def check_divisible(*, tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                    field: str) -> None:
    """Even shards only: every split dimension must divide by `tp_size` (raises naming `field`)."""
    for what, size in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads),
                       ("intermediate_size", intermediate_size)):
        if size % tp_size:
            raise ValueError(f"{field}={tp_size} does not divide the model's {what} ({size}); "
                             "choose a tensor-parallel size that splits every head and MLP evenly")
