"""Ownership math of the transfer dock: whole groups, contiguous, balanced (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from rldock.runtime.dock.ownership import DockLayout, as_slice

# (groups G, group size N, warehouses S)
SHAPES = [(1, 4, 1), (2, 2, 2), (5, 4, 2), (7, 3, 3), (8, 8, 3), (10, 2, 4), (16, 5, 16), (33, 1, 5)]


def make_layout(num_groups: int, group_size: int, num_warehouses: int) -> DockLayout:
    num_samples = num_groups * group_size
    return DockLayout(num_samples=num_samples, group_size=group_size, num_warehouses=num_warehouses)


@pytest.mark.parametrize(("num_groups", "group_size", "num_warehouses"), SHAPES)
def test_ranges_are_contiguous_whole_groups_and_cover_the_batch(
    num_groups: int, group_size: int, num_warehouses: int
) -> None:
    layout = make_layout(num_groups, group_size, num_warehouses)
    ranges = [layout.sample_range(w) for w in range(num_warehouses)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.num_samples
    for (_, stop), (next_start, _) in zip(ranges, ranges[1:]):
        assert stop == next_start  # contiguous, no gap or overlap
    for start, stop in ranges:
        assert start % group_size == 0 and stop % group_size == 0  # no group split
        assert stop > start  # no empty warehouse


@pytest.mark.parametrize(("num_groups", "group_size", "num_warehouses"), SHAPES)
def test_warehouses_are_balanced(num_groups: int, group_size: int, num_warehouses: int) -> None:
    layout = make_layout(num_groups, group_size, num_warehouses)
    groups_per_warehouse = [stop - first for first, stop in map(layout.group_range, range(num_warehouses))]
    assert sum(groups_per_warehouse) == num_groups
    assert set(groups_per_warehouse) <= {num_groups // num_warehouses, -(-num_groups // num_warehouses)}


@pytest.mark.parametrize(("num_groups", "group_size", "num_warehouses"), SHAPES)
def test_owner_of_each_sample_matches_the_ranges_and_the_formula(
    num_groups: int, group_size: int, num_warehouses: int
) -> None:
    layout = make_layout(num_groups, group_size, num_warehouses)
    owners = layout.warehouse_of(np.arange(layout.num_samples))
    for w in range(num_warehouses):
        start, stop = layout.sample_range(w)
        assert (owners[start:stop] == w).all()
    for i in range(layout.num_samples):
        g = i // group_size
        assert owners[i] == g * num_warehouses // num_groups
    # every sample of a group has the same owner
    assert (owners.reshape(num_groups, group_size) == owners[::group_size, None]).all()


def test_example_five_groups_over_two_warehouses() -> None:
    layout = DockLayout(num_samples=20, group_size=4, num_warehouses=2)
    assert [layout.group_range(w) for w in range(2)] == [(0, 3), (3, 5)]
    assert [layout.sample_range(w) for w in range(2)] == [(0, 12), (12, 20)]
    assert [layout.capacity(w) for w in range(2)] == [12, 8]


def test_split_gives_positions_per_owner_in_order() -> None:
    layout = DockLayout(num_samples=16, group_size=4, num_warehouses=2)
    indices = np.array([9, 0, 15, 3, 8])
    split = layout.split(indices)
    assert list(split) == [0, 1]
    assert split[0].tolist() == [1, 3] and split[1].tolist() == [0, 2, 4]


@pytest.mark.parametrize(
    ("num_samples", "group_size", "num_warehouses", "match"),
    [
        (10, 4, 1, "multiple of group_size"),
        (0, 4, 1, "multiple of group_size"),
        (8, 0, 1, "group_size"),
        (8, 4, 3, "num_warehouses"),
        (8, 4, 0, "num_warehouses"),
    ],
)
def test_invalid_layouts_are_refused(num_samples: int, group_size: int, num_warehouses: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DockLayout(num_samples=num_samples, group_size=group_size, num_warehouses=num_warehouses)


def test_check_indices() -> None:
    layout = DockLayout(num_samples=8, group_size=2, num_warehouses=2)
    layout.check_indices(np.array([0, 7]))
    with pytest.raises(IndexError, match=r"\[0, 8\)"):
        layout.check_indices(np.array([3, 8]))
    with pytest.raises(IndexError):
        layout.check_indices(np.array([-1]))
    with pytest.raises(ValueError, match="1-D integer"):
        layout.check_indices(np.array([1.0]))


@pytest.mark.parametrize(
    ("positions", "expected"),
    [([3, 4, 5], slice(3, 6)), ([7], slice(7, 8)), ([1, 3], None), ([2, 1, 0], None), ([0, 0, 1], None)],
)
def test_as_slice(positions: list[int], expected: slice | None) -> None:
    array = np.array(positions)
    result = as_slice(array)
    if expected is None:
        assert result is array
    else:
        assert result == expected
