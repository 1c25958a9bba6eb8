"""The rule every context-parallel size must satisfy for a model: Ulysses (rldock.runtime.engines.ulysses)
gives each CP rank 1/cp of the query heads and 1/cp of the KV heads, so both divide by cp.

The config checks it before a job starts (naming the field), the planner before it plans, and the
runtime again on the model it loaded.
"""

from __future__ import annotations

FIELD = "training.context_parallel_size"


def check_heads_divide(*, cp: int, num_heads: int, num_kv_heads: int, field: str = FIELD) -> None:
    """Raise ValueError naming `field` unless `cp` divides the heads and the KV heads."""
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
            f"CP ranks), but {', '.join(bad)} does not; choose one of {divisors}"
        )
