"""The index a controller hands samples out from: what is ready and untaken, per warehouse, kept current.

A request used to scan every sample of the iteration (which columns are ready, who took what) and
every write woke every waiting request to scan again: O(all samples) per request and per waiter.
At 100k samples per iteration that is the controller's whole cost. This index keeps, per
warehouse, a min-heap of the units (samples, or whole groups) that are ready and untaken, plus
exact counts, and updates them only for the samples a write or a hand-out touches. A request
then costs O(units it takes x log) and a waiter that cannot be served yet costs O(1) to check.

Units of both sizes are indexed at once (single samples and whole groups of N), because a
state's request mode (`whole_groups`) is only known at its first request. Heap entries are
removed lazily: an entry is valid while `_pooled` says so. Events that touch many samples at
once and are rare (reset, recycle, restore, a staleness drop) rebuild the index from the arrays.
numpy and heapq only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from rldock.runtime.dock.ownership import DockLayout


class _Units:
    """The index for one unit size (1: samples; N: whole groups)."""

    def __init__(self, layout: DockLayout, size: int) -> None:
        self.size = size
        self.num_units = layout.num_samples // size
        self.owner = layout.warehouse_of(np.arange(self.num_units) * size)  # (num_units,) warehouse
        num_warehouses = layout.num_warehouses
        self.heaps: list[list[int]] = [[] for _ in range(num_warehouses)]
        self.pooled: np.ndarray = np.zeros(self.num_units, dtype=bool)  # ready and untaken: in its heap
        self.available = np.zeros(num_warehouses, dtype=np.int64)  # pooled units per warehouse
        self.untaken = np.zeros(num_warehouses, dtype=np.int64)  # units none of whose samples is taken

    def rebuild(self, complete: np.ndarray, untaken: np.ndarray) -> None:
        """From (num_samples,) bool arrays: every sample ready / not taken (nor dropped)."""
        unit_complete = complete.reshape(-1, self.size).all(axis=1)
        unit_untaken = untaken.reshape(-1, self.size).all(axis=1)
        self.pooled = np.asarray(unit_complete & unit_untaken)
        self.available = np.bincount(self.owner[self.pooled], minlength=len(self.heaps))
        self.untaken = np.bincount(self.owner[unit_untaken], minlength=len(self.heaps))
        self.heaps = [np.flatnonzero(self.pooled & (self.owner == w)).tolist() for w in range(len(self.heaps))]
        # ascending lists are valid heaps

    def add(self, units: np.ndarray) -> None:
        """Units that just became ready and are untaken."""
        units = units[~self.pooled[units]]
        self.pooled[units] = True
        np.add.at(self.available, self.owner[units], 1)
        for unit in units.tolist():
            heapq.heappush(self.heaps[self.owner[unit]], unit)

    def take(self, units: np.ndarray, was_untaken: np.ndarray) -> None:
        """`units` lose a sample to a rank (or a drop); `was_untaken` (same shape) says which were
        untaken before."""
        pooled = units[self.pooled[units]]
        self.pooled[pooled] = False
        np.subtract.at(self.available, self.owner[pooled], 1)
        np.subtract.at(self.untaken, self.owner[units[was_untaken]], 1)

    def pop(self, warehouse: int, count: int) -> list[int]:
        """The `count` smallest pooled units of `warehouse` (it holds at least that many)."""
        heap = self.heaps[warehouse]
        out: list[int] = []
        while len(out) < count:
            unit = heapq.heappop(heap)
            if self.pooled[unit]:
                self.pooled[unit] = False
                out.append(unit)
        self.available[warehouse] -= count
        return out


class ReadyIndex:
    """Ready, untaken units per warehouse for samples and for whole groups of a DockLayout."""

    def __init__(self, layout: DockLayout, num_columns: int) -> None:
        self._layout = layout
        self._num_columns = num_columns
        self._units = {1: _Units(layout, 1)}
        if layout.group_size > 1:
            self._units[layout.group_size] = _Units(layout, layout.group_size)
        self.missing = np.full(layout.num_samples, num_columns, dtype=np.int64)  # columns not ready yet
        self._untaken = np.ones(layout.num_samples, dtype=bool)  # mirror of consumer == UNTAKEN
        self._dropped = np.zeros(layout.num_samples, dtype=bool)  # mirror of consumer == DROPPED
        self.unsettled = layout.num_samples  # samples neither complete nor dropped (balanced deals wait)
        nothing = np.zeros(layout.num_samples, dtype=bool)
        self.rebuild(np.zeros((layout.num_samples, num_columns), dtype=bool), ~nothing, nothing)

    def rebuild(self, ready: np.ndarray, consumer_untaken: np.ndarray, dropped: np.ndarray) -> None:
        """From the controller's arrays: ready (num_samples, C), untaken and dropped (num_samples,)."""
        self.missing = self._num_columns - ready.sum(axis=1)
        complete = self.missing == 0
        self._untaken = consumer_untaken.copy()
        self._dropped = dropped.copy()
        self.unsettled = int((~complete & ~dropped).sum())
        for units in self._units.values():
            units.rebuild(complete, self._untaken)

    def columns_ready(self, indices: np.ndarray, newly: np.ndarray) -> None:
        """`newly[i]` more of the state's columns of sample `indices[i]` became ready."""
        self.missing[indices] -= newly
        became = indices[(newly > 0) & (self.missing[indices] == 0)]
        if became.size == 0:
            return
        self.unsettled -= int((~self._dropped[became]).sum())  # a dropped sample was settled already
        ready_untaken = became[self._untaken[became]]
        self._units[1].add(ready_untaken)
        if self._layout.group_size > 1:
            n = self._layout.group_size
            groups = np.unique(ready_untaken // n)
            whole = (self.missing[(groups[:, None] * n + np.arange(n))] == 0).all(axis=1)
            whole &= self._untaken[(groups[:, None] * n + np.arange(n))].all(axis=1)
            self._units[n].add(groups[whole])

    def taken(self, samples: np.ndarray) -> None:
        """`samples` went to a rank or were dropped."""
        was = self._untaken[samples]
        self._untaken[samples] = False
        self._units[1].take(samples, was)
        if self._layout.group_size > 1:
            n = self._layout.group_size
            groups = np.unique(samples // n)
            # A group was untaken before iff every one of its samples was (those taken now included).
            members = groups[:, None] * n + np.arange(n)
            before = self._untaken[members] | np.isin(members, samples[was])
            self._units[n].take(groups, before.all(axis=1))

    def remaining(self, unit: int, warehouses: Sequence[int] | None = None) -> int:
        """Untaken units of size `unit` (on `warehouses`, default all)."""
        counts = self._units[unit].untaken
        return int(counts.sum() if warehouses is None else counts[list(warehouses)].sum())

    def available(self, unit: int, warehouses: Sequence[int] | None = None) -> int:
        """Ready, untaken units of size `unit` (on `warehouses`, default all)."""
        counts = self._units[unit].available
        return int(counts.sum() if warehouses is None else counts[list(warehouses)].sum())

    def pop(self, unit: int, count: int, warehouses: Sequence[int]) -> np.ndarray:
        """The `count` first available units of size `unit` on `warehouses`, in that order of
        warehouses and ascending within each (the caller checked there are enough)."""
        units = self._units[unit]
        out: list[int] = []
        for w in warehouses:
            if len(out) == count:
                break
            out += units.pop(w, min(count - len(out), int(units.available[w])))
        return np.asarray(out, dtype=np.int64)
