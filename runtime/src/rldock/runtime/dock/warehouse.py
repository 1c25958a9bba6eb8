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

With `shared_root` the columns live in shared memory (shared_columns.py) and workers on the
warehouse's node `attach` to them: their reads and writes run this same code in their own
process, on the same rows, written flags and counters, without a Ray call. Only the owner
allocates a column; an attached warehouse asked to write a column the owner has not allocated
says so (`can_write`) and the caller goes through the owner.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray

from rldock.runtime.dock.ownership import as_slice
from rldock.runtime.dock.shared_columns import COUNTERS, SharedColumns
from rldock.runtime.dock.wire import WireColumn, dtype_name

logger = logging.getLogger(__name__)


class Warehouse:
    """Stores samples [start, start + capacity) of the global batch."""

    def __init__(
        self,
        *,
        warehouse_id: int,
        start: int,
        capacity: int,
        group_size: int = 1,
        shared_root: str | None = None,
        _attached: SharedColumns | None = None,
    ) -> None:
        if group_size < 1 or start % group_size or capacity % group_size:
            raise ValueError(
                f"warehouse {warehouse_id}: samples [{start}, {start + capacity}) are not whole groups of {group_size}"
            )
        self._id = warehouse_id
        self._group_size = group_size
        self._start = start
        self._capacity = capacity
        self._shared = _attached or (SharedColumns.create(shared_root, capacity) if shared_root else None)
        self._attached = _attached is not None
        # Per column: rows in the wire dtype (writes and reads go through these), the torch dtype
        # they stand for (by name), and which rows were written this iteration.
        self._views: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, str] = {}
        self._written: dict[str, np.ndarray] = {}
        # Counters (COUNTERS order); in shared memory when the columns are, since attached
        # workers move bytes too. expanded_bytes: written here by expanding group columns, never sent.
        self._counts = np.zeros(len(COUNTERS), dtype=np.int64)

    @classmethod
    def attach(cls, directory: str, *, warehouse_id: int, start: int, capacity: int, group_size: int = 1) -> Warehouse:
        """The warehouse whose shared columns are at `directory`, for reads and writes from this process."""
        return cls(
            warehouse_id=warehouse_id,
            start=start,
            capacity=capacity,
            group_size=group_size,
            _attached=SharedColumns.attach(directory, capacity),
        )

    def shared_directory(self) -> str | None:
        """Where this warehouse's columns are shared (None: private memory, reachable by Ray calls only)."""
        return str(self._shared.directory) if self._shared else None

    def owner_alive(self) -> bool:
        """(Attached) whether the process that owns these shared columns still runs."""
        return self._shared is not None and self._shared.owner_alive()

    @property
    def owner_pid(self) -> int | None:
        return self._shared.owner_pid if self._shared else None

    def has_columns(self, names: Sequence[str]) -> bool:
        """Whether every one of `names` is stored here (an attached warehouse reads only those)."""
        return all(self._has_column(name) for name in names)

    def can_write(self, columns: Mapping[str, WireColumn]) -> bool:
        """Whether every one of `columns` is already stored here with its dtype and per-sample shape
        (an attached warehouse cannot allocate: the first write of a column goes to the owner)."""
        if not self.has_columns(list(columns)):
            return False
        for name, column in columns.items():
            if self._dtypes[name] != column.dtype or self._views[name].shape[1:] != column.array.shape[1:]:
                return False
        return True

    def close(self) -> None:
        """(Owner) release the shared memory; the warehouse holds nothing afterwards."""
        if self._shared and not self._attached:
            self._shared.remove()
        self._views.clear()
        self._dtypes.clear()
        self._written.clear()

    def write(
        self,
        indices: np.ndarray,
        columns: Mapping[str, WireColumn],
        group_columns: Mapping[str, WireColumn] | None = None,
    ) -> None:
        """Copy `columns` (each (B, ...)) into the rows of global sample `indices` (B,).

        `group_columns` (each (B / group_size, ...), one row per group) are written to every sample
        of their group; `indices` must then be whole groups, each group's samples consecutive.
        """
        rows = as_slice(self._local_rows(indices))
        if group_columns:
            self._check_whole_groups(indices)
        bytes_in = expanded = 0
        for name, column in (group_columns or {}).items():
            if column.array.shape[0] * self._group_size != indices.shape[0]:
                raise ValueError(
                    f"group column {name!r} has {column.array.shape[0]} rows for "
                    f"{indices.shape[0] // self._group_size} groups"
                )
            view = self._view_for(name, column)
            if isinstance(rows, slice):  # (k*N, ...) view as (k, N, ...): broadcast, no expanded copy
                view[rows].reshape(-1, self._group_size, *column.array.shape[1:])[...] = column.array[:, None]
            else:
                view[rows] = np.repeat(column.array, self._group_size, axis=0)
            self._written[name][rows] = True
            bytes_in += column.array.nbytes
            expanded += column.array.nbytes * (self._group_size - 1)
        for name, column in columns.items():
            if column.array.shape[:1] != indices.shape:
                raise ValueError(f"column {name!r} has {column.array.shape[:1]} rows for {indices.shape[0]} indices")
            view = self._view_for(name, column)
            view[rows] = column.array
            self._written[name][rows] = True
            bytes_in += column.array.nbytes
        self._count(
            bytes_in=bytes_in, expanded_bytes=expanded, write_requests=1, shared_write_requests=int(self._attached)
        )

    def read(self, indices: np.ndarray, columns: Sequence[str], *, copy: bool = False) -> dict[str, WireColumn]:
        """Columns of global sample `indices` (B,), each (B, ...), in the order of `indices`.

        A read of an ascending run is a view of storage unless `copy`: the actor may hand views out
        (Ray copies them into its object store as it serialises the reply, before this
        single-threaded actor runs another write), a process reading shared rows may not.
        """
        rows = as_slice(self._local_rows(indices))
        out: dict[str, WireColumn] = {}
        bytes_out = 0
        for name in columns:
            if not self._has_column(name):
                raise KeyError(
                    f"warehouse {self._id}: column {name!r} was never written; stored columns: {sorted(self._views)}"
                )
            if not self._written[name][rows].all():
                raise ValueError(
                    f"warehouse {self._id}: column {name!r} is not written this iteration for some of "
                    f"samples {indices.tolist()}; a consumer read before its producer wrote"
                )
            array = self._views[name][rows]
            out[name] = WireColumn(np.array(array) if copy else array, self._dtypes[name])
            bytes_out += array.nbytes
        self._count(bytes_out=bytes_out, read_requests=1, shared_read_requests=int(self._attached))
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
            columns[name] = (self._start + rows, WireColumn(self._views[name][rows].copy(), self._dtypes[name]))
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
                # A checkpoint written before the dtype travelled by name holds torch's dtype object.
                column = WireColumn(column.array, dtype_name(column.dtype))
                view = self._view_for(name, column)
                rows = self._local_rows(indices)
                view[rows] = column.array
                self._written[name][rows] = True

    def ping(self) -> None:
        """Answers at once: lets clients tell a dead warehouse from a busy one."""

    def stats(self) -> dict[str, Any]:
        counts = self._counts if self._shared is None else np.array(self._shared.counters)
        return {
            "warehouse": self._id,
            "start": self._start,
            "capacity": self._capacity,
            "columns": sorted(self._views),
            "bytes_stored": sum(view.nbytes for view in self._views.values()),
            "shared_memory": self._shared is not None,
            **{name: int(value) for name, value in zip(COUNTERS, counts)},
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
        if (
            indices.size % n
            or not np.array_equal(indices.reshape(-1, n), indices[::n, None] + np.arange(n))
            or indices[0] % n
        ):
            raise ValueError(
                f"warehouse {self._id}: a write with group columns needs whole groups of {n} "
                f"consecutive samples, got samples {indices.tolist()}"
            )

    def _has_column(self, name: str) -> bool:
        """Whether column `name` is stored (in an attached warehouse: mapped now if the owner made it)."""
        if name in self._views:
            return True
        if self._attached:
            assert self._shared is not None  # an attached warehouse's shared columns are the owner's
            shared = self._shared.column(name)
            if shared is not None:
                self._keep(name, shared.rows, shared.written, shared.dtype)
                return True
        return False

    def _view_for(self, name: str, column: WireColumn) -> np.ndarray:
        """The storage view of column `name`, allocated on first write; later writes must match."""
        sample_shape = column.array.shape[1:]
        if not self._has_column(name):
            if self._attached:  # callers check can_write first; this is the owner's job
                raise KeyError(f"warehouse {self._id}: column {name!r} is not allocated; write it through the owner")
            shared = None
            if self._shared:
                shared = self._shared.allocate(name, column.dtype, column.array.dtype, sample_shape)
            if shared is not None:
                self._keep(name, shared.rows, shared.written, shared.dtype)
            else:
                rows = np.empty((self._capacity, *sample_shape), dtype=column.array.dtype)
                self._keep(name, rows, np.zeros(self._capacity, dtype=bool), column.dtype)
            logger.debug("warehouse %d: column %r %s %s", self._id, name, (self._capacity, *sample_shape), column.dtype)
        if self._dtypes[name] != column.dtype or self._views[name].shape[1:] != sample_shape:
            raise ValueError(
                f"column {name!r} is stored as {self._dtypes[name]} with per-sample shape "
                f"{tuple(self._views[name].shape[1:])}, got a write of {column.dtype} {tuple(sample_shape)}"
            )
        return self._views[name]

    def _keep(self, name: str, rows: np.ndarray, written: np.ndarray, dtype: str) -> None:
        self._views[name], self._written[name], self._dtypes[name] = rows, written, dtype

    def _count(self, **increments: int) -> None:
        positions = [(COUNTERS.index(name), value) for name, value in increments.items() if value]
        if self._shared is None:
            for i, value in positions:
                self._counts[i] += value
            return
        with self._shared.counting() as counters:
            for i, value in positions:
                counters[i] += value
