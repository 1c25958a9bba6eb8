"""The distributed route of the dock (the default mode): S warehouses and one controller per state.

Tensors go straight between the caller and the owning warehouses, in parallel; the controllers
only ever receive indices, column names and token counts. Each state has its own controller
(its own readiness, hand-out and waiters), and all of them live in one async actor, the
controller host (`ControllerHost`, host.py): a write tells the controllers of the states that need
one of its columns in one call, and a request waits in its state's controller alone, so states
never queue behind each other's waiters. A read is two calls of the consumer (the host's grant,
then the warehouses), a write too (the warehouses, then readiness to the host); a host that
starts the reads of what it grants (host.py, `host_starts_reads`) was measured slower per get and is kept
for measurements only (docs/dock-benchmarks.md). One process rather than one per state because the
controllers' work is metadata of microseconds, while each process costs a Ray round trip per
write and a scheduling hop on a busy node (docs/transfer-dock.md). This is the MindSpeed RL
paper's distributed transfer dock (arXiv 2507.19017, section 3.1); `central.py` is its baseline.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle

from rldock.runtime.dock import rpc
from rldock.runtime.dock.controller import Grant
from rldock.runtime.dock.host import ControllerHost
from rldock.runtime.dock.ownership import DockLayout, as_slice
from rldock.runtime.dock.placement import assign_nodes, pinned_to
from rldock.runtime.dock.rpc import Peer
from rldock.runtime.dock.staleness import StalenessBound
from rldock.runtime.dock.warehouse import Warehouse
from rldock.runtime.dock.wire import WireColumn

logger = logging.getLogger(__name__)

# Dock actors only hold memory and metadata: they must not take CPUs that workers ask for.
_WarehouseActor = ray.remote(num_cpus=0, max_restarts=0)(Warehouse)
# Every consumer's waiting request holds one of the host's concurrent calls until a write serves
# it, and writers' calls need free ones too: Ray's default cap (1000 for an async actor) would be
# shared by all states' waiters, so it is set far above any job's ranks times states.
CONTROLLER_HOST_CONCURRENCY = 100_000
_ControllerHostActor = ray.remote(num_cpus=0, max_restarts=0,
                                  max_concurrency=CONTROLLER_HOST_CONCURRENCY)(ControllerHost)


class DistributedRoute:
    """Moves rows between a client and S warehouses; asks each state's controller what to hand out."""

    mode = "distributed"

    def __init__(
        self,
        *,
        layout: DockLayout,
        warehouses: Sequence[ActorHandle],
        controllers: ActorHandle,
        states: Mapping[str, Sequence[str]],
        warehouse_nodes: Sequence[str],
        prefer_local: bool = True,
        host_starts_reads: bool = False,
    ) -> None:
        self.layout = layout
        self._prefer_local = prefer_local
        self._host_starts_reads = host_starts_reads
        self._warehouses = [
            Peer(_warehouse_name(layout, w, node), handle)
            for w, (handle, node) in enumerate(zip(warehouses, warehouse_nodes))
        ]
        self._controllers = Peer(f"dock controller host (the controllers of states {sorted(states)})", controllers)
        self._state_columns = {state: frozenset(columns) for state, columns in states.items()}
        self.nodes = list(warehouse_nodes)

    @classmethod
    def start(
        cls,
        *,
        num_warehouses: int,
        states: Mapping[str, Sequence[str]],
        num_samples: int,
        group_size: int,
        node_ids: Sequence[str],
        timeout_s: float,
        prefer_local: bool = True,
        staleness: StalenessBound | None = None,
        bounded_states: Sequence[str] = (),
        host_starts_reads: bool = False,
    ) -> DistributedRoute:
        """Start S warehouses round-robin over `node_ids` and the controller host (a controller per state) here.

        `host_starts_reads` (for measurements only) has the host start the warehouse reads of what
        it grants and the consumer only fetch them (host.py); measured slower per get than the consumer
        reading the warehouses itself (docs/dock-benchmarks.md), so off by default.
        """
        layout = DockLayout(num_samples=num_samples, group_size=group_size, num_warehouses=num_warehouses)
        warehouses = []
        for w, node in enumerate(assign_nodes(num_warehouses, list(node_ids))):
            start, stop = layout.sample_range(w)
            warehouses.append(
                _WarehouseActor.options(scheduling_strategy=pinned_to(node)).remote(
                    warehouse_id=w, start=start, capacity=stop - start, group_size=group_size
                )
            )
        # The controllers serve every consumer; next to the creator (usually the driver) is as good as any.
        here = ray.get_runtime_context().get_node_id()
        controllers = _ControllerHostActor.options(scheduling_strategy=pinned_to(here, soft=True)).remote(
            states={state: list(columns) for state, columns in states.items()}, layout=layout,
            default_timeout_s=timeout_s, warehouses=warehouses, staleness=staleness,
            bounded_states=list(bounded_states))
        # Waiting here surfaces actor start failures now rather than at the first put.
        warehouse_nodes = ray.get([wh.node_id.remote() for wh in warehouses])
        ray.get(controllers.ping.remote())
        return cls(layout=layout, warehouses=warehouses, controllers=controllers, states=states,
                   warehouse_nodes=warehouse_nodes, prefer_local=prefer_local, host_starts_reads=host_starts_reads)

    def write(self, indices: np.ndarray, columns: Mapping[str, WireColumn], tokens: Mapping[str, np.ndarray],
              policy_version: int | None = None, group_columns: Mapping[str, WireColumn] | None = None) -> None:
        """Rows to their owning warehouses in parallel, then readiness (metadata) to the controllers, in one call.

        When this returns, every state that needs a written column knows the rows are ready.

        `group_columns` hold one row per group of `indices` (whole groups, in order); each goes
        once to the group's warehouse, which expands it to the group's samples.
        """
        group_columns = group_columns or {}
        n = self.layout.group_size
        writes = []
        for w, positions in self.layout.split(indices).items():
            rows = as_slice(positions)
            part = {name: WireColumn(col.array[rows], col.dtype) for name, col in columns.items()}
            groups = as_slice(positions[::n] // n) if group_columns else slice(0, 0)
            shared = {name: WireColumn(col.array[groups], col.dtype) for name, col in group_columns.items()}
            peer = self._warehouses[w]
            writes.append((peer.name, peer.handle.write.remote(indices[rows], part, shared or None)))
        rpc.get_all(writes)
        written = [*columns, *group_columns]
        # Only states that need a written column learn of it: the others' readiness is unchanged.
        told = [state for state, needs in self._state_columns.items() if needs & set(written)]
        if told:
            peer = self._controllers
            rpc.get(peer.name, peer.handle.mark_ready.remote(indices, written, dict(tokens) or None,
                                                             policy_version, told))

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
        """Ask `state`'s controller for samples and fetch them from their warehouses, in index order.

        With `host_starts_reads` the host starts the warehouse reads as it grants (host.py) and
        this only fetches their results, straight from the warehouses' nodes.
        """
        prefer: list[int] = []
        if self._prefer_local:
            here = ray.get_runtime_context().get_node_id()
            local = [w for w, node in enumerate(self.nodes) if node == here]
            prefer = local if len(local) < len(self.nodes) else []  # all local: plain ascending order
        if state not in self._state_columns:
            raise ValueError(f"unknown dock state {state!r}; states: {sorted(self._state_columns)}")
        controller = self._controllers
        if self._host_starts_reads:
            request = controller.handle.request_and_read.remote(
                state, list(columns), rank, batch_size, whole_groups, timeout_s, prefer=prefer,
                balance_ranks=balance_ranks,
            )
        else:
            request = controller.handle.request.remote(
                state, rank, batch_size, whole_groups, timeout_s, prefer=prefer, balance_ranks=balance_ranks
            )
        grant: Grant = rpc.wait_for_grant(
            controller.name, request, timeout=timeout_s + rpc.RPC_GRACE_S, watch=self._warehouses
        )
        if grant.exhausted:
            return grant, []
        # Ownership is contiguous, so warehouse order then each warehouse's order is index order.
        if grant.reads:
            return grant, rpc.get_all([(self._warehouses[w].name, ref) for w, ref in sorted(grant.reads.items())])
        reads = []
        for w in sorted(grant.by_warehouse):
            peer = self._warehouses[w]
            reads.append((peer.name, peer.handle.read.remote(grant.by_warehouse[w], list(columns))))
        return grant, rpc.get_all(reads)

    def reset(self) -> None:
        rpc.get_all([(peer.name, peer.handle.reset.remote()) for peer in self.peers()])

    def _each_controller(self, call: str, *args: Any) -> Any:
        """`call` on every state's controller (the host's answer is by state where there is one)."""
        peer = self._controllers
        return rpc.get(peer.name, getattr(peer.handle, call).remote(*args))

    def recycle(self, indices: np.ndarray) -> None:
        """The owning warehouses forget the rows, then every controller forgets their metadata."""
        rpc.get_all([(self._warehouses[w].name, self._warehouses[w].handle.forget.remote(indices[positions]))
                     for w, positions in self.layout.split(indices).items()])
        self._each_controller("recycle", indices)

    def advance_policy(self, version: int, timeout_s: float) -> None:
        peer = self._controllers
        rpc.get(peer.name, peer.handle.advance_policy.remote(version, timeout_s), timeout=timeout_s + rpc.RPC_GRACE_S)

    def snapshot(self) -> dict[str, Any]:
        # Controllers first: a column marked ready there was stored before, so the warehouses'
        # snapshot, taken after, holds it even while writers are still running.
        controllers = self._each_controller("snapshot")
        warehouses = rpc.get_all([(p.name, p.handle.snapshot.remote()) for p in self._warehouses])
        return {"warehouses": warehouses, "controllers": controllers}

    def restore(self, snapshot: Mapping[str, Any], requeue: Mapping[str, np.ndarray]) -> None:
        if len(snapshot["warehouses"]) != len(self._warehouses):
            raise ValueError(
                f"the snapshot has {len(snapshot['warehouses'])} warehouses, this dock {len(self._warehouses)}"
            )
        rpc.get_all([
            (peer.name, peer.handle.restore.remote(part))
            for peer, part in zip(self._warehouses, snapshot["warehouses"])
        ])
        self._each_controller("restore", snapshot["controllers"], dict(requeue))

    def stats(self) -> dict[str, Any]:
        warehouse_stats = rpc.get_all([(p.name, p.handle.stats.remote()) for p in self._warehouses])
        for entry, node in zip(warehouse_stats, self.nodes):
            entry["node_id"] = node
        return {"warehouses": warehouse_stats, "controllers": self._each_controller("stats")}

    def peers(self) -> list[Peer]:
        return [*self._warehouses, self._controllers]


def _warehouse_name(layout: DockLayout, warehouse: int, node: str) -> str:
    start, stop = layout.sample_range(warehouse)
    return f"warehouse {warehouse} (samples [{start}, {stop}) on node {node[:12]})"
