"""A warehouse: the tensors of one contiguous slice of the global batch (one Ray actor per node).

Each column is one preallocated tensor of shape (capacity, *per_sample_shape), created on the
first write of that column, so a write is a copy into place and a read of an ascending run of
samples is a view. The warehouse knows nothing about consumers; which samples are ready and who
took them is the controllers' business. It does keep, per column, which rows were written this
iteration, so a read of a row that was never written (stale data from the last iteration) fails
loudly instead of returning old values.

A driver's columns that are the same for every sample of a GRPO group (the prompt, its row) come
once per group (`group_columns`) and the warehouse expands them into the group's N sample rows,
so a prompt crosses the network once, not N times (docs/transfer-dock.md, "prompt once per group").

The actor is synchronous with one thread: reads and writes of one warehouse are serialised,
which keeps first-write allocation race-free; parallelism comes from having S warehouses.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
import torch

from rldock.runtime.dock.ownership import as_slice
from rldock.runtime.dock.wire import WireColumn, to_wire

logger = logging.getLogger(__name__)


class Warehouse:
    """Stores samples [start, start + capacity) of the global batch."""

    def __init__(self, *, warehouse_id: int, start: int, capacity: int, group_size: int = 1) -> None:
        if group_size < 1 or start % group_size or capacity % group_size:
            raise ValueError(f"warehouse {warehouse_id}: samples [{start}, {start + capacity}) are not whole "
                             f"groups of {group_size}")
        self._id = warehouse_id
        self._group_size = group_size
        self._start = start
        self._capacity = capacity
        self._storage: dict[str, torch.Tensor] = {}
        # numpy views of _storage in the wire dtype: writes and reads go through these.
        self._views: dict[str, np.ndarray] = {}
        self._written: dict[str, np.ndarray] = {}  # (capacity,) bool per column, this iteration
        self._bytes_in = 0
        self._bytes_out = 0
        self._expanded_bytes = 0  # bytes written here by expanding group columns, never sent
        self._write_requests = 0
        self._read_requests = 0

    def write(self, indices: np.ndarray, columns: Mapping[str, WireColumn],
              group_columns: Mapping[str, WireColumn] | None = None) -> None:
        """Copy `columns` (each (B, ...)) into the rows of global sample `indices` (B,).

        `group_columns` (each (B / group_size, ...), one row per group) are written to every sample
        of their group; `indices` must then be whole groups, each group's samples consecutive.
        """
        rows = as_slice(self._local_rows(indices))
        if group_columns:
            self._check_whole_groups(indices)
        for name, column in (group_columns or {}).items():
            if column.array.shape[0] * self._group_size != indices.shape[0]:
                raise ValueError(f"group column {name!r} has {column.array.shape[0]} rows for "
                                 f"{indices.shape[0] // self._group_size} groups")
            view = self._view_for(name, column)
            if isinstance(rows, slice):  # (k*N, ...) view as (k, N, ...): broadcast, no expanded copy
                view[rows].reshape(-1, self._group_size, *column.array.shape[1:])[...] = column.array[:, None]
            else:
                view[rows] = np.repeat(column.array, self._group_size, axis=0)
            self._written[name][rows] = True
            self._bytes_in += column.array.nbytes
            self._expanded_bytes += column.array.nbytes * (self._group_size - 1)
        for name, column in columns.items():
            if column.array.shape[:1] != indices.shape:
                raise ValueError(
                    f"column {name!r} has {column.array.shape[:1]} rows for {indices.shape[0]} indices"
                )
            view = self._view_for(name, column)
            view[rows] = column.array
            self._written[name][rows] = True
            self._bytes_in += column.array.nbytes
        self._write_requests += 1

    def read(self, indices: np.ndarray, columns: Sequence[str]) -> dict[str, WireColumn]:
        """Columns of global sample `indices` (B,), each (B, ...), in the order of `indices`."""
        rows = as_slice(self._local_rows(indices))
        out: dict[str, WireColumn] = {}
        for name in columns:
            if name not in self._views:
                raise KeyError(
                    f"warehouse {self._id}: column {name!r} was never written; "
                    f"stored columns: {sorted(self._views)}"
                )
            if not self._written[name][rows].all():
                raise ValueError(
                    f"warehouse {self._id}: column {name!r} is not written this iteration for some of "
                    f"samples {indices.tolist()}; a consumer read before its producer wrote"
                )
            # A slice is a view of storage: Ray copies it into the object store as it serialises
            # the reply, before this single-threaded actor can run another write.
            array = self._views[name][rows]
            out[name] = WireColumn(array, self._storage[name].dtype)
            self._bytes_out += array.nbytes
        self._read_requests += 1
        return out

    def reset(self) -> None:
        """Start a new iteration: forget what was written, keep storage and counters."""
        for written in self._written.values():
            written[:] = False

    def forget(self, indices: np.ndarray) -> None:
        """Forget what was written to samples `indices` this iteration (they will be written anew)."""
        rows = self._local_rows(indices)
        for written in self._written.values():
            written[rows] = False

    def snapshot(self) -> dict[str, Any]:
        """Copies of the rows written this iteration, per column, for a dock checkpoint."""
        columns = {}
        for name, written in self._written.items():
            rows = np.flatnonzero(written)
            columns[name] = (self._start + rows, WireColumn(self._views[name][rows].copy(), self._storage[name].dtype))
        return {"warehouse": self._id, "start": self._start, "capacity": self._capacity, "columns": columns}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Write back what `snapshot` holds (from a warehouse owning the same samples); counters stay."""
        if (snapshot["start"], snapshot["capacity"]) != (self._start, self._capacity):
            raise ValueError(
                f"warehouse {self._id} holds samples [{self._start}, {self._start + self._capacity}); "
                f"the snapshot is of [{snapshot['start']}, {snapshot['start'] + snapshot['capacity']})"
            )
        self.reset()
        for name, (indices, column) in snapshot["columns"].items():
            if len(indices):
                view = self._view_for(name, column)
                rows = self._local_rows(indices)
                view[rows] = column.array
                self._written[name][rows] = True

    def ping(self) -> None:
        """Answers at once: lets clients tell a dead warehouse from a busy one."""

    def stats(self) -> dict[str, Any]:
        return {
            "warehouse": self._id,
            "start": self._start,
            "capacity": self._capacity,
            "columns": sorted(self._storage),
            "bytes_stored": sum(t.nbytes for t in self._storage.values()),
            "bytes_in": self._bytes_in,
            "bytes_out": self._bytes_out,
            "expanded_bytes": self._expanded_bytes,
            "write_requests": self._write_requests,
            "read_requests": self._read_requests,
        }

    def node_id(self) -> str:
        """The Ray node this warehouse runs on."""
        return ray.get_runtime_context().get_node_id()

    def _local_rows(self, indices: np.ndarray) -> np.ndarray:
        local = np.asarray(indices, dtype=np.int64) - self._start
        if local.size and (local.min() < 0 or local.max() >= self._capacity):
            raise IndexError(
                f"warehouse {self._id} holds samples [{self._start}, {self._start + self._capacity}), "
                f"got indices in [{int(indices.min())}, {int(indices.max())}]"
            )
        return local

    def _check_whole_groups(self, indices: np.ndarray) -> None:
        n = self._group_size
        if indices.size % n or not np.array_equal(indices.reshape(-1, n),
                                                  indices[::n, None] + np.arange(n)) or indices[0] % n:
            raise ValueError(f"warehouse {self._id}: a write with group columns needs whole groups of {n} "
                             f"consecutive samples, got samples {indices.tolist()}")

    def _view_for(self, name: str, column: WireColumn) -> np.ndarray:
        """The storage view of column `name`, allocated on first write; later writes must match."""
        sample_shape = column.array.shape[1:]
        if name not in self._storage:
            storage = torch.empty((self._capacity, *sample_shape), dtype=column.dtype)
            self._storage[name] = storage
            self._views[name] = to_wire(storage).array
            self._written[name] = np.zeros(self._capacity, dtype=bool)
            logger.debug("warehouse %d: column %r %s %s", self._id, name, tuple(storage.shape), column.dtype)
        storage = self._storage[name]
        if storage.dtype != column.dtype or tuple(storage.shape[1:]) != sample_shape:
            raise ValueError(
                f"column {name!r} is stored as {storage.dtype} with per-sample shape "
                f"{tuple(storage.shape[1:])}, got a write of {column.dtype} {sample_shape}"
            )
        return self._views[name]
