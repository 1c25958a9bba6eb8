"""The rules a context-parallel size must satisfy for a model, by mode (`training.context_parallel_mode`):
Ulysses (rldock.runtime.engines.ulysses) gives each CP rank 1/cp of the query heads and 1/cp of the
KV heads, so both divide by cp; ring attention (rldock.runtime.engines.ring_attention) keeps every
head on every rank and passes the keys and values around, so any cp fits the heads.

The config checks it before a job starts (naming the field), the planner before it plans, and the
runtime again on the model it loaded.
"""

from __future__ import annotations

from typing import Literal

FIELD = "training.context_parallel_size"
MODES = ("ulysses", "ring")
ContextParallelMode = Literal["ulysses", "ring"]


def check_heads_divide(
    *, cp: int, num_heads: int, num_kv_heads: int, mode: str = "ulysses", field: str = FIELD
) -> None:
    """Raise ValueError naming `field` unless `cp` fits the heads under `mode`: for Ulysses it must
    divide the heads and the KV heads; ring attention has no such rule."""
    if mode not in MODES:
        raise ValueError(f"training.context_parallel_mode must be one of {list(MODES)}, got {mode!r}")
    if mode == "ring":
        return
    bad = [
        f"{name}={count}"
        for name, count in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads))
        if count % cp
    ]
    if bad:
        divisors = [
            size for size in range(1, min(num_heads, num_kv_heads) + 1) if num_heads % size == 0 == num_kv_heads % size
        ]
        raise ValueError(
            f"{field}={cp} must divide the model's attention heads and KV heads (Ulysses splits both over the "
            f"CP ranks), but {', '.join(bad)} does not; choose one of {divisors}, or "
            "training.context_parallel_mode ring, which keeps every head on every rank"
        )
