"""The controller host: every state's controller, and the warehouses of its own node, in one async actor.

A request to a controller and the read of what it grants are two Ray calls when the rows sit in a
warehouse actor, and a write is two as well (the warehouse, then readiness to the controllers).
Each Ray call has a fixed CPU cost (and one that carries rows a larger one, in Ray's object
store; docs/dock-benchmarks.md), so the warehouses placed on the host's own node live inside the
host (`hosted`): a grant comes back with the rows it hands out from them, and a write to them is
stored and marked ready in the same call. On one node (the demo, every single-node job) every
put and get is then one call; on S nodes, the host's node is. With shared memory
(shared_columns.py) a caller on the host's node moves those rows itself and the calls carry
metadata only (`read_here`; a write's parts are then empty), and it makes them over the host's
local socket rather than through Ray (local_socket.py: about 0.1 ms a call against 1.5-2 ms). The
other warehouses stay actors of their own on their nodes, reached directly by their consumers, as
the MindSpeed RL paper's distributed transfer dock has it (arXiv 2507.19017, section 3.1). The
central mode's buffer is this host holding the one warehouse of a one-warehouse layout.

The warehouses here share the host's event loop: a write and a read of them never interleave
(each is synchronous within its coroutine), but a reply is serialised after its coroutine
returns, when a later write may already have run, so reads hand out copies, never views of
storage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

from rldock.runtime.dock import local_socket
from rldock.runtime.dock.controller import ControllerHub, Grant
from rldock.runtime.dock.ownership import DockLayout
from rldock.runtime.dock.staleness import StalenessBound
from rldock.runtime.dock.warehouse import Warehouse
from rldock.runtime.dock.wire import WireColumn

# One hosted warehouse's part of a write: (its indices, per-sample columns, per-group columns or None).
WritePart = tuple[np.ndarray, Mapping[str, WireColumn], Mapping[str, WireColumn] | None]
# Warehouse calls the route may make on a hosted warehouse by name (the rest go through write/read).
_WAREHOUSE_CALLS = frozenset({"snapshot", "restore", "stats", "read"})


class ControllerHost(ControllerHub):
    """The controllers of every state, plus the warehouses `hosted` (ids in `layout`), in one event loop."""

    def __init__(
        self,
        *,
        states: dict[str, Sequence[str]],
        layout: DockLayout,
        default_timeout_s: float,
        hosted: Sequence[int] = (),
        staleness: StalenessBound | None = None,
        bounded_states: Sequence[str] = (),
        shared_root: str | None = None,
    ) -> None:
        super().__init__(
            states=states,
            layout=layout,
            default_timeout_s=default_timeout_s,
            staleness=staleness,
            bounded_states=bounded_states,
        )
        self._layout = layout
        self._local_server: asyncio.AbstractServer | None = None
        self._warehouses: dict[int, Warehouse] = {}
        for w in hosted:
            start, stop = layout.sample_range(w)
            self._warehouses[w] = Warehouse(
                warehouse_id=w,
                start=start,
                capacity=stop - start,
                group_size=layout.group_size,
                shared_root=shared_root,
            )

    async def write(
        self,
        parts: Mapping[int, WritePart],
        indices: np.ndarray,
        columns: Sequence[str],
        tokens: dict[str, np.ndarray] | None = None,
        policy_version: int | None = None,
        states: Sequence[str] | None = None,
    ) -> None:
        """Store `parts` in the hosted warehouses, then tell the controllers of `states` that `columns`
        of all of `indices` are ready (the caller wrote the other warehouses' parts before)."""
        for w, (part_indices, part, shared) in parts.items():
            self._hosted(w).write(part_indices, part, shared)
        if states is None or states:
            await self.mark_ready(indices, columns, tokens, policy_version, states)

    async def request_and_read(
        self,
        state: str,
        columns: Sequence[str],
        rank: int,
        batch_size: int,
        whole_groups: bool = False,
        timeout_s: float | None = None,
        *,
        prefer: Sequence[int] = (),
        balance_ranks: int = 0,
        read_here: Sequence[int] = (),
    ) -> tuple[Grant, dict[int, dict[str, WireColumn]]]:
        """`request`, and the granted rows that hosted warehouses hold: {warehouse: its columns}.

        The caller reads the grant's other warehouses itself, and the hosted ones in `read_here`
        (on its node, through shared memory)."""
        grant = await self.request(
            state, rank, batch_size, whole_groups, timeout_s, prefer=prefer, balance_ranks=balance_ranks
        )
        if grant.exhausted:
            return grant, {}
        data = {}
        for w, rows in grant.by_warehouse.items():
            if w in self._warehouses and w not in read_here:
                data[w] = self._warehouses[w].read(rows, columns, copy=True)
        return grant, data

    async def write_and_request(
        self, write: Sequence[Any], *request: Any, **options: Any
    ) -> tuple[Grant, dict[int, dict[str, WireColumn]]]:
        """`write(*write)`, then `request_and_read(*request, **options)`: a stage's write and its next
        request in one call (the write is marked ready first, as two calls would have it)."""
        await self.write(*write)
        return await self.request_and_read(*request, **options)

    async def reset(self) -> None:
        for warehouse in self._warehouses.values():
            warehouse.reset()
        await super().reset()

    async def recycle(self, indices: np.ndarray) -> None:
        """Hosted warehouses forget the rows of `indices` they own; every controller their metadata."""
        for w, positions in self._layout.split(indices).items():
            if w in self._warehouses:
                self._warehouses[w].forget(indices[positions])
        await super().recycle(indices)

    async def warehouse(self, w: int, call: str, *args: Any) -> Any:
        """`call` (snapshot, restore, stats, read) on hosted warehouse `w`."""
        if call not in _WAREHOUSE_CALLS:
            raise ValueError(f"warehouse call {call!r} is not one of {sorted(_WAREHOUSE_CALLS)}")
        if call == "read":  # the reply is serialised after a later write may have run: a copy
            return self._hosted(w).read(*args, copy=True)
        return getattr(self._hosted(w), call)(*args)

    async def shared_directories(self) -> dict[int, str | None]:
        """Where each hosted warehouse shares its columns (None: in private memory)."""
        return {w: warehouse.shared_directory() for w, warehouse in self._warehouses.items()}

    async def open_local_socket(self) -> str | None:
        """Serve local_socket.CALLS to processes on this node through a socket in the first hosted
        warehouse's shared directory; its path (None: no hosted warehouse shares memory, every call
        is a Ray call)."""
        directories = [d for w in sorted(self._warehouses) if (d := self._warehouses[w].shared_directory())]
        if not directories:
            return None
        path = str(Path(directories[0]) / local_socket.SOCKET_NAME)
        self._local_server = await local_socket.serve(path, {call: getattr(self, call) for call in local_socket.CALLS})
        return path

    async def close(self) -> None:
        """Stop serving the local socket and release the hosted warehouses' shared memory (before the
        host is killed)."""
        if self._local_server is not None:
            self._local_server.close()
        for warehouse in self._warehouses.values():
            warehouse.close()

    async def node_id(self) -> str:
        """The Ray node this host (and its hosted warehouses) runs on."""
        return ray.get_runtime_context().get_node_id()

    def _hosted(self, w: int) -> Warehouse:
        if w not in self._warehouses:
            raise ValueError(f"warehouse {w} is not hosted by the controller host (hosted: {sorted(self._warehouses)})")
        return self._warehouses[w]
