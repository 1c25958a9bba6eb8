"""Sequence-length balanced dispatch over DP ranks: a pure function (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from rldock.runtime.dock.balance import balance_by_tokens, imbalance


def skewed_lengths(num_samples: int, seed: int) -> np.ndarray:
    """Response lengths like an RL batch: log-normal, a long tail capped at SL = 4096."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=5.5, sigma=1.0, size=num_samples), 1, 4096).astype(np.int64)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("num_samples", "num_ranks", "group_size"), [(256, 4, 1), (512, 8, 1), (1024, 4, 8), (64, 2, 1)]
)
def test_tokens_per_rank_within_10_percent_of_the_mean(
    num_samples: int, num_ranks: int, group_size: int, seed: int
) -> None:
    lengths = skewed_lengths(num_samples, seed)
    parts = balance_by_tokens(lengths, num_ranks, group_size=group_size)
    assert imbalance(lengths, parts) <= 0.10
    assert sorted(np.concatenate(parts).tolist()) == list(range(num_samples))  # a partition
    assert {part.size for part in parts} == {num_samples // num_ranks}  # equal shares for DDP
    for part in parts:
        assert np.all(np.diff(part) > 0)
        groups = part // group_size
        assert np.all(np.bincount(groups)[np.unique(groups)] == group_size)  # whole groups only


def test_an_equal_split_by_index_misses_the_bound_on_the_same_data() -> None:
    lengths = skewed_lengths(512, seed=0)
    naive = np.array_split(np.arange(512), 8)
    assert imbalance(lengths, naive) > 0.15  # the distribution is skewed enough to matter
    assert imbalance(lengths, balance_by_tokens(lengths, 8)) < 0.01


def test_swaps_fix_what_the_greedy_pass_leaves() -> None:
    tokens = np.array([9, 5, 5, 5, 4, 4])  # greedy with 3 per rank: 18 / 14; best: 17 / 15
    loads = sorted(int(tokens[part].sum()) for part in balance_by_tokens(tokens, 2))
    assert loads == [15, 17]


def test_uneven_counts_differ_by_at_most_one_unit() -> None:
    parts = balance_by_tokens(np.arange(1, 11), 3)
    assert sorted(part.size for part in parts) == [3, 3, 4]


def test_one_sample_longer_than_a_share_is_the_best_possible() -> None:
    parts = balance_by_tokens(np.array([100, 1, 1, 1, 1, 1]), 2)
    loads = sorted(int(np.array([100, 1, 1, 1, 1, 1])[p].sum()) for p in parts)
    assert loads == [3, 102]


@pytest.mark.parametrize(
    ("tokens", "num_ranks", "group_size", "match"),
    [([1, 2, 3], 0, 1, "num_ranks"), ([1, 2, 3], 4, 1, "cannot be spread"), ([1, 2, 3], 1, 2, "whole groups"),
     ([[1, 2]], 1, 1, "1-D")],
)
def test_invalid_arguments(tokens: list, num_ranks: int, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        balance_by_tokens(np.array(tokens), num_ranks, group_size=group_size)
