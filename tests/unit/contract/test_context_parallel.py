"""The rule each context-parallel mode sets for a CP size (rldock.contract.context_parallel)."""

from __future__ import annotations

import pytest

from rldock.contract.context_parallel import check_heads_divide


@pytest.mark.parametrize(("cp", "heads", "kv_heads"), [(1, 9, 3), (2, 4, 2), (4, 8, 4), (3, 12, 3)])
def test_sizes_that_divide_both_head_counts_pass(cp, heads, kv_heads):
    check_heads_divide(cp=cp, num_heads=heads, num_kv_heads=kv_heads)


@pytest.mark.parametrize(
    ("cp", "heads", "kv_heads", "named"),
    [
        (4, 4, 2, "num_key_value_heads=2"),
        (3, 4, 2, "num_attention_heads=4, num_key_value_heads=2"),
        (2, 6, 3, "num_key_value_heads=3"),
    ],
)
def test_a_size_that_does_not_divide_names_the_field_the_counts_and_the_choices(cp, heads, kv_heads, named):
    with pytest.raises(ValueError) as raised:
        check_heads_divide(cp=cp, num_heads=heads, num_kv_heads=kv_heads)
    message = str(raised.value)
    assert message.startswith(f"training.context_parallel_size={cp} ")
    assert named in message and "choose one of [1" in message
    assert "context_parallel_mode ring" in message  # the mode without the rule


@pytest.mark.parametrize(("cp", "heads", "kv_heads"), [(4, 4, 2), (3, 4, 2), (2, 6, 3), (8, 14, 2)])
def test_ring_attention_keeps_every_head_so_any_size_fits(cp, heads, kv_heads):
    check_heads_divide(cp=cp, num_heads=heads, num_kv_heads=kv_heads, mode="ring")


def test_an_unknown_mode_names_the_field():
    with pytest.raises(ValueError, match=r"training.context_parallel_mode must be one of \['ulysses', 'ring'\]"):
        check_heads_divide(cp=2, num_heads=4, num_kv_heads=2, mode="allgather")
