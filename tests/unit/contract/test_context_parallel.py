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


@pytest.mark.parametrize(("cp", "tp", "heads", "kv_heads"), [(2, 2, 8, 4), (2, 2, 4, 4), (3, 2, 12, 6)])
def test_under_tp_ulysses_splits_a_tp_rank_s_heads(cp, tp, heads, kv_heads):
    check_heads_divide(cp=cp, tp=tp, num_heads=heads, num_kv_heads=kv_heads)


def test_under_tp_a_size_that_divides_the_heads_but_not_a_tp_rank_s_names_both_sizes():
    check_heads_divide(cp=2, num_heads=4, num_kv_heads=2)  # alone, CP 2 divides 2 KV heads
    with pytest.raises(ValueError) as raised:  # but TP 2 leaves one KV head per rank
        check_heads_divide(cp=2, tp=2, num_heads=4, num_kv_heads=2)
    message = str(raised.value)
    assert message.startswith("training.context_parallel_size=2 x tensor_parallel_size 2 ")
    assert "num_key_value_heads=2" in message and "choose one of [1]" in message
    check_heads_divide(cp=2, tp=2, num_heads=4, num_kv_heads=2, mode="ring")  # ring has no such rule
    check_heads_divide(cp=1, tp=2, num_heads=4, num_kv_heads=1)  # no CP: TP's own check names its field
