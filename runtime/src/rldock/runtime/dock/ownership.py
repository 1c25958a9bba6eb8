"""Which warehouse owns which sample: the pure ownership math of the transfer dock.

The global batch of G*N samples is split along whole prompt groups (sample i is in group i // N)
into S contiguous, balanced ranges, so a GRPO group never straddles two warehouses and a consumer
that takes whole groups reads each group from one place. Group g belongs to warehouse g*S // G,
which gives every warehouse floor(G/S) or ceil(G/S) groups. numpy only (no torch), because the
metadata controllers import this module too and should stay light.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DockLayout:
    """Ownership of `num_samples` samples, in groups of `group_size`, by `num_warehouses` warehouses."""

    num_samples: int
    group_size: int
    num_warehouses: int

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.num_samples < 1 or self.num_samples % self.group_size:
            raise ValueError(
                f"num_samples must be a positive multiple of group_size {self.group_size}, got {self.num_samples}"
            )
        if not 1 <= self.num_warehouses <= self.num_groups:
            raise ValueError(
                f"num_warehouses must be between 1 and the number of groups {self.num_groups} "
                f"(more would leave warehouses empty), got {self.num_warehouses}"
            )

    @property
    def num_groups(self) -> int:
        return self.num_samples // self.group_size

    def group_range(self, warehouse: int) -> tuple[int, int]:
        """[first, stop) groups of `warehouse`: the first group g with g*S // G >= w is ceil(w*G/S)."""
        if not 0 <= warehouse < self.num_warehouses:
            raise IndexError(f"warehouse {warehouse} out of range [0, {self.num_warehouses})")
        return self._first_group(warehouse), self._first_group(warehouse + 1)

    def sample_range(self, warehouse: int) -> tuple[int, int]:
        """[first, stop) sample indices stored by `warehouse`."""
        first, stop = self.group_range(warehouse)
        return first * self.group_size, stop * self.group_size

    def capacity(self, warehouse: int) -> int:
        first, stop = self.sample_range(warehouse)
        return stop - first

    def warehouse_of(self, indices: np.ndarray) -> np.ndarray:
        """Owning warehouse of each sample index, (B,) int64."""
        groups = np.asarray(indices, dtype=np.int64) // self.group_size
        return groups * self.num_warehouses // self.num_groups

    def check_indices(self, indices: np.ndarray) -> None:
        """Raise if `indices` is not a 1-D integer array of in-range sample indices."""
        if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
            raise ValueError(f"indices must be a 1-D integer array, got shape {indices.shape} {indices.dtype}")
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_samples):
            raise IndexError(
                f"sample indices must lie in [0, {self.num_samples}), got [{int(indices.min())}, {int(indices.max())}]"
            )

    def split(self, indices: np.ndarray) -> dict[int, np.ndarray]:
        """Positions into `indices` per owning warehouse (only warehouses that own some), in order."""
        owners = self.warehouse_of(indices)
        return {int(w): np.flatnonzero(owners == w) for w in np.unique(owners)}

    def _first_group(self, warehouse: int) -> int:
        return -(-warehouse * self.num_groups // self.num_warehouses)


def as_slice(positions: np.ndarray) -> slice | np.ndarray:
    """A slice when `positions` is a run of consecutive integers, else `positions` itself.

    Indexing with a slice gives a view, fancy indexing a copy; dock traffic is mostly ascending
    runs, so this drops one copy of every column on the common path.
    """
    if positions.size == 0:
        return positions
    first, last = int(positions[0]), int(positions[-1])
    if last - first + 1 == positions.size and (positions.size == 1 or bool(np.all(np.diff(positions) == 1))):
        return slice(first, last + 1)
    return positions
