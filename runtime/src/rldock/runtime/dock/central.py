"""The central route of the dock (`dock.mode: central`): one buffer actor holds every column.

Every request, metadata and tensors alike, goes through this one actor: the conventional replay
buffer that the MindSpeed RL paper (arXiv 2507.19017) measures its distributed transfer dock
against. It reuses the same pieces in one process: a Warehouse that owns all samples and the
ControllerHub (one Controller per state), so hand-out rules (readiness, whole groups, balanced shares, timeouts) are
identical in both modes and only the data path differs. It exists as a baseline for benchmarks
and as a fallback; the distributed route is the default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray

from rldock.runtime.dock import rpc
from rldock.runtime.dock.controller import ControllerHub, Grant
from rldock.runtime.dock.ownership import DockLayout
from rldock.runtime.dock.placement import pinned_to
from rldock.runtime.dock.rpc import Peer
from rldock.runtime.dock.staleness import StalenessBound
from rldock.runtime.dock.warehouse import Warehouse
from rldock.runtime.dock.wire import WireColumn

_NAME = "central buffer"


class CentralBuffer:
    """One async actor: a warehouse of every sample plus the controllers of every state."""

    def __init__(self, *, layout: DockLayout, states: Mapping[str, Sequence[str]], default_timeout_s: float,
                 staleness: StalenessBound | None = None, bounded_states: Sequence[str] = ()) -> None:
        if layout.num_warehouses != 1:
            raise ValueError(f"a central buffer is one warehouse, got a layout of {layout.num_warehouses}")
        self._warehouse = Warehouse(warehouse_id=0, start=0, capacity=layout.num_samples,
                                    group_size=layout.group_size)
        self._hub = ControllerHub(states=dict(states), layout=layout, default_timeout_s=default_timeout_s,
                                  staleness=staleness, bounded_states=bounded_states)

    async def write(
        self, indices: np.ndarray, columns: Mapping[str, WireColumn], tokens: Mapping[str, np.ndarray] | None,
        policy_version: int | None = None, group_columns: Mapping[str, WireColumn] | None = None,
    ) -> None:
        self._warehouse.write(indices, columns, group_columns)
        await self._hub.mark_ready(indices, [*columns, *(group_columns or {})], dict(tokens) if tokens else None,
                                   policy_version)

    async def advance_policy(self, version: int, timeout_s: float) -> None:
        await self._hub.advance_policy(version, timeout_s)

    async def read(
        self,
        state: str,
        columns: Sequence[str],
        rank: int,
        batch_size: int,
        whole_groups: bool,
        timeout_s: float,
        balance_ranks: int,
    ) -> tuple[Grant, dict[str, WireColumn]]:
        grant = await self._hub.request(state, rank, batch_size, whole_groups, timeout_s, balance_ranks=balance_ranks)
        if grant.exhausted:
            return grant, {}
        data = self._warehouse.read(grant.indices, columns)
        # Unlike the single-threaded warehouse actor, this event loop may run a write while Ray
        # serialises the reply, so the reply must not be a view of storage.
        return grant, {name: WireColumn(np.array(col.array), col.dtype) for name, col in data.items()}

    async def reset(self) -> None:
        self._warehouse.reset()
        await self._hub.reset()

    async def recycle(self, indices: np.ndarray) -> None:
        self._warehouse.forget(indices)
        await self._hub.recycle(indices)

    async def snapshot(self) -> dict[str, Any]:
        return {"warehouses": [self._warehouse.snapshot()], "controllers": await self._hub.snapshot()}

    async def restore(self, snapshot: Mapping[str, Any], requeue: Mapping[str, np.ndarray]) -> None:
        if len(snapshot["warehouses"]) != 1:
            raise ValueError(f"the snapshot has {len(snapshot['warehouses'])} warehouses, a central buffer 1")
        self._warehouse.restore(snapshot["warehouses"][0])
        await self._hub.restore(snapshot["controllers"], dict(requeue))

    async def stats(self) -> dict[str, Any]:
        return {"warehouses": [self._warehouse.stats()], "controllers": await self._hub.stats()}

    async def ping(self) -> None:
        """Answers at once unless the event loop is busy copying."""

    async def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


# Waiting requests of every state hold concurrent calls of the one buffer (distributed.py says why).
_CentralActor = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=100_000)(CentralBuffer)


class CentralRoute:
    """Every put and get of every client is one call to the central buffer."""

    mode = "central"

    def __init__(self, *, layout: DockLayout, buffer: Peer, node: str) -> None:
        self.layout = layout
        self._buffer = buffer
        self.nodes = [node]

    @classmethod
    def start(
        cls,
        *,
        states: Mapping[str, Sequence[str]],
        num_samples: int,
        group_size: int,
        node_id: str,
        timeout_s: float,
        staleness: StalenessBound | None = None,
        bounded_states: Sequence[str] = (),
    ) -> CentralRoute:
        layout = DockLayout(num_samples=num_samples, group_size=group_size, num_warehouses=1)
        handle = _CentralActor.options(scheduling_strategy=pinned_to(node_id)).remote(
            layout=layout, states=dict(states), default_timeout_s=timeout_s, staleness=staleness,
            bounded_states=list(bounded_states),
        )
        node = ray.get(handle.node_id.remote())  # surfaces a start failure now
        return cls(layout=layout, buffer=Peer(f"{_NAME} (node {node[:12]})", handle), node=node)

    def write(self, indices: np.ndarray, columns: Mapping[str, WireColumn], tokens: Mapping[str, np.ndarray],
              policy_version: int | None = None, group_columns: Mapping[str, WireColumn] | None = None) -> None:
        rpc.get(self._buffer.name, self._buffer.handle.write.remote(
            indices, dict(columns), dict(tokens) or None, policy_version, dict(group_columns or {})))

    def read(
        self,
        state: str,
        columns: Sequence[str],
        *,
        rank: int,
        batch_size: int,
        whole_groups: bool,
        timeout_s: float,
        balance_ranks: int,
    ) -> tuple[Grant, list[dict[str, WireColumn]]]:
        request = self._buffer.handle.read.remote(
            state, list(columns), rank, batch_size, whole_groups, timeout_s, balance_ranks
        )
        grant, data = rpc.wait_for_grant(self._buffer.name, request, timeout=timeout_s + rpc.RPC_GRACE_S, watch=[])
        return grant, ([] if grant.exhausted else [data])

    def reset(self) -> None:
        rpc.get(self._buffer.name, self._buffer.handle.reset.remote())

    def recycle(self, indices: np.ndarray) -> None:
        rpc.get(self._buffer.name, self._buffer.handle.recycle.remote(indices))

    def advance_policy(self, version: int, timeout_s: float) -> None:
        request = self._buffer.handle.advance_policy.remote(version, timeout_s)
        rpc.get(self._buffer.name, request, timeout=timeout_s + rpc.RPC_GRACE_S)

    def snapshot(self) -> dict[str, Any]:
        return rpc.get(self._buffer.name, self._buffer.handle.snapshot.remote())

    def restore(self, snapshot: Mapping[str, Any], requeue: Mapping[str, np.ndarray]) -> None:
        rpc.get(self._buffer.name, self._buffer.handle.restore.remote(snapshot, dict(requeue)))

    def stats(self) -> dict[str, Any]:
        stats = rpc.get(self._buffer.name, self._buffer.handle.stats.remote())
        stats["warehouses"][0]["node_id"] = self.nodes[0]
        return stats

    def peers(self) -> list[Peer]:
        return [self._buffer]
