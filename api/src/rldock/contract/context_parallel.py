"""The rules a context-parallel size must satisfy for a model, by mode (`training.context_parallel_mode`):
Ulysses (rldock.runtime.engines.ulysses) gives each CP rank 1/cp of the query heads and 1/cp of the
KV heads, so both divide by cp; ring attention (rldock.runtime.engines.ring_attention) keeps every
head on every rank and passes the keys and values around, so any cp fits the heads. Under tensor
parallelism a rank's attention holds 1/tp of the heads (TP splits them first), and Ulysses splits those:
the heads and the KV heads divide by tp x cp.

The config checks it before a job starts (naming the field), the planner before it plans, and the
runtime again on the model it loaded.
"""

from __future__ import annotations

from typing import Literal

FIELD = "training.context_parallel_size"
MODES = ("ulysses", "ring")
ContextParallelMode = Literal["ulysses", "ring"]


def check_heads_divide(
    *, cp: int, num_heads: int, num_kv_heads: int, mode: str = "ulysses", tp: int = 1, field: str = FIELD
) -> None:
    """Raise ValueError naming `field` unless `cp` fits the heads under `mode`: for Ulysses it must
    divide the heads and the KV heads of a TP rank (1/`tp` of each, module docstring); ring attention has
    no such rule."""
    if mode not in MODES:
        raise ValueError(f"training.context_parallel_mode must be one of {list(MODES)}, got {mode!r}")
    if mode == "ring" or cp == 1:  # ring keeps every head; at CP 1 nothing splits them (TP checks its own)
        return
    split = cp * tp  # the heads' parts: TP's, each split again by Ulysses
    bad = [
        f"{name}={count}"
        for name, count in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads))
        if count % split
    ]
    if bad:
        divisors = [
            size
            for size in range(1, min(num_heads, num_kv_heads) // tp + 1)
            if num_heads % (size * tp) == 0 == num_kv_heads % (size * tp)
        ]
        per_rank = f" x tensor_parallel_size {tp} (TP gives each rank 1/{tp} of them)" if tp > 1 else ""
        split_heads = "a TP rank's share of both" if tp > 1 else "both"
        raise ValueError(
            f"{field}={cp}{per_rank} must divide the model's attention heads and KV heads (Ulysses splits "
            f"{split_heads} over the CP ranks), but {', '.join(bad)} does not; choose one of {divisors}, or "
            "training.context_parallel_mode ring, which keeps every head on every rank"
        )
