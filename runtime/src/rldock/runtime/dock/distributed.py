"""The dock's route: S warehouses and one controller per state, in distributed and central mode.

Tensors go straight between the caller and the owning warehouses, in parallel; the controllers
only ever receive indices, column names and token counts. Each state has its own controller
(its own readiness, hand-out and waiters), and all of them live in one async actor, the
controller host (host.py): a write tells the controllers of the states that need one of its
columns in one call, and a request waits in its state's controller alone, so states never queue
behind each other's waiters. One process rather than one per state because the controllers'
work is metadata of microseconds, while each process costs a Ray round trip per write and a
scheduling hop on a busy node (docs/transfer-dock.md).

Where the host runs (`colocate`, default on): on the first warehouse's node, holding that
node's warehouses in its own process, so a read there is one call (the grant carries the rows)
and a write one call (stored, then marked ready); a warehouse elsewhere is an actor on its node,
and its rows cost the consumer a second call to it, after the grant or before the readiness.
Without `colocate` every warehouse is an actor and the host runs beside the dock's creator: two
calls per put and per get everywhere (the layout before, kept for measurements). A caller on the
host's node makes its calls to the host over the host's local socket rather than through Ray
(local_socket.py), and a stage's write and its next request are one call (`write(then=...)`).

With `shared_memory` (default on) the warehouses keep their columns in /dev/shm
(shared_columns.py) and a worker on a warehouse's node reads and writes those rows itself, so
that call carries metadata only (the host leaves out the rows the caller reads itself); rows on
other nodes still travel by Ray calls. A call carrying a megabyte costs about five times the CPU
of a metadata call, nearly all of it in Ray's object store (docs/transfer-dock.md).

This is the MindSpeed RL paper's distributed transfer dock (arXiv 2507.19017, section 3.1). Its
baseline, one central buffer serving every request (`dock.mode: central`), is the same route
with one warehouse hosted by the host: every column and every request in one actor.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import ray
from ray.actor import ActorHandle

from rldock.runtime.dock import rpc, shared_columns
from rldock.runtime.dock.controller import Grant
from rldock.runtime.dock.host import ControllerHost, WritePart
from rldock.runtime.dock.local_socket import LocalHost
from rldock.runtime.dock.ownership import DockLayout, as_slice
from rldock.runtime.dock.placement import assign_nodes, pinned_to
from rldock.runtime.dock.rpc import Peer
from rldock.runtime.dock.staleness import StalenessBound
from rldock.runtime.dock.warehouse import Warehouse
from rldock.runtime.dock.wire import WireColumn
from rldock.runtime.startup import timed

logger = logging.getLogger(__name__)

# Dock actors only hold memory and metadata: they must not take CPUs that workers ask for.
_WarehouseActor = ray.remote(num_cpus=0, max_restarts=0)(timed(Warehouse))
# Every consumer's waiting request holds one of the host's concurrent calls until a write serves
# it, and writers' calls need free ones too: Ray's default cap (1000 for an async actor) would be
# shared by all states' waiters, so it is set far above any job's ranks times states.
CONTROLLER_HOST_CONCURRENCY = 100_000
# How long shutdown waits for the dock's actors to release their shared memory.
_CLOSE_TIMEOUT_S = 10.0
_ControllerHostActor = ray.remote(  # type: ignore[call-overload]  # Ray's overloads leave out actor options
    num_cpus=0, max_restarts=0, max_concurrency=CONTROLLER_HOST_CONCURRENCY
)(timed(ControllerHost))


class Request(NamedTuple):
    """A consumer's ask for samples of `state` (TransferDock.get's arguments, checked)."""

    state: str
    columns: list[str]
    rank: int
    batch_size: int
    whole_groups: bool
    timeout_s: float
    balance_ranks: int


class DistributedRoute:
    """Moves rows between a client and S warehouses; asks each state's controller what to hand out."""

    def __init__(
        self,
        *,
        layout: DockLayout,
        host: Peer,
        warehouses: Mapping[int, Peer],
        states: Mapping[str, Sequence[str]],
        warehouse_nodes: Sequence[str],
        prefer_local: bool = True,
        mode: str = "distributed",
        shared_directories: Mapping[int, str | None] | None = None,
        host_node: str | None = None,
        host_socket: str | None = None,
    ) -> None:
        """`warehouses` are the warehouse actors by id; the ids missing from it are hosted by `host`.
        `shared_directories` are where warehouses share their columns with workers on their node;
        `host_socket` is where the host, on `host_node`, answers that node's processes (local_socket.py)."""
        self.mode = mode
        self._host_node = host_node
        self._local_host = LocalHost(host_socket, host) if host_socket else None
        self._shared_directories = dict(shared_directories or {})
        self.layout = layout
        self._prefer_local = prefer_local
        self._host = host
        self._warehouses = dict(warehouses)
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
        colocate: bool = True,
        staleness: StalenessBound | None = None,
        bounded_states: Sequence[str] = (),
        mode: str = "distributed",
        shared_memory: bool = True,
    ) -> DistributedRoute:
        """Start S warehouses round-robin over `node_ids` and the controller host (a controller per state).

        With `colocate` the host runs on warehouse 0's node and holds every warehouse of that node;
        without, the host runs here (beside the creator, usually the driver) and holds none. With
        `shared_memory` the warehouses keep their columns in shared memory, and workers on their
        node read and write those rows themselves.
        """
        shared_root = shared_columns.DEFAULT_ROOT if shared_memory else None
        layout = DockLayout(num_samples=num_samples, group_size=group_size, num_warehouses=num_warehouses)
        nodes = assign_nodes(num_warehouses, list(node_ids))
        if colocate:
            host_node, soft = nodes[0], False
        else:  # the controllers serve every consumer; next to the creator is as good as any
            host_node, soft = ray.get_runtime_context().get_node_id(), True
        hosted = [w for w, node in enumerate(nodes) if colocate and node == host_node]
        host = _ControllerHostActor.options(scheduling_strategy=pinned_to(host_node, soft=soft)).remote(
            states={state: list(columns) for state, columns in states.items()},
            layout=layout,
            default_timeout_s=timeout_s,
            hosted=hosted,
            staleness=staleness,
            bounded_states=list(bounded_states),
            shared_root=shared_root,
        )
        actors: dict[int, ActorHandle] = {}
        for w, node in enumerate(nodes):
            if w not in hosted:
                start, stop = layout.sample_range(w)
                # Creating an actor gives its handle; Ray types it as handle or class.
                actors[w] = cast(
                    ActorHandle,
                    _WarehouseActor.options(scheduling_strategy=pinned_to(node)).remote(
                        warehouse_id=w,
                        start=start,
                        capacity=stop - start,
                        group_size=group_size,
                        shared_root=shared_root,
                    ),
                )
        # Waiting here surfaces actor start failures now rather than at the first put.
        host_at, directories, host_socket = ray.get(
            [host.node_id.remote(), host.shared_directories.remote(), host.open_local_socket.remote()]
        )
        remote_at: dict[int, str] = dict(zip(actors, ray.get([actor.node_id.remote() for actor in actors.values()])))
        directories.update(zip(actors, ray.get([actor.shared_directory.remote() for actor in actors.values()])))
        warehouse_nodes = [remote_at.get(w, host_at) for w in range(num_warehouses)]
        warehouses = {w: Peer(_warehouse_name(layout, w, warehouse_nodes[w]), actor) for w, actor in actors.items()}
        host_name = (
            f"central buffer (node {host_at[:12]})"
            if mode == "central"
            else _host_name(layout, hosted, host_at, states)
        )
        return cls(
            layout=layout,
            host=Peer(host_name, host),
            host_node=host_at,
            host_socket=host_socket,
            warehouses=warehouses,
            states=states,
            warehouse_nodes=warehouse_nodes,
            prefer_local=prefer_local,
            mode=mode,
            shared_directories=directories,
        )

    @classmethod
    def start_single_buffer(
        cls,
        *,
        states: Mapping[str, Sequence[str]],
        num_samples: int,
        group_size: int,
        node_id: str,
        timeout_s: float,
        staleness: StalenessBound | None = None,
        bounded_states: Sequence[str] = (),
    ) -> DistributedRoute:
        """The central buffer on `node_id`: one warehouse of every sample, hosted with the controllers.

        It shares no memory: the paper's baseline serves every byte itself, to its own node too."""
        return cls.start(
            num_warehouses=1,
            states=states,
            num_samples=num_samples,
            group_size=group_size,
            node_ids=[node_id],
            timeout_s=timeout_s,
            prefer_local=False,
            colocate=True,
            staleness=staleness,
            bounded_states=bounded_states,
            mode="central",
            shared_memory=False,
        )

    def write(
        self,
        indices: np.ndarray,
        columns: Mapping[str, WireColumn],
        tokens: Mapping[str, np.ndarray],
        policy_version: int | None = None,
        group_columns: Mapping[str, WireColumn] | None = None,
        *,
        then: Request | None = None,
    ) -> tuple[Grant, list[dict[str, WireColumn]]] | None:
        """Rows to the warehouses on this node through shared memory, to the other warehouse actors in
        parallel, then the hosted rows and the readiness (metadata) to the host, in one call.

        When this returns, every state that needs a written column knows the rows are ready.

        `group_columns` hold one row per group of `indices` (whole groups, in order); each goes
        once to the group's warehouse, which expands it to the group's samples. With `then`, the
        call that tells the host asks it for the next samples too, and this returns `read`'s answer
        to `then`: a stage's write and its next request are one call to the controllers.
        """
        group_columns = group_columns or {}
        n = self.layout.group_size
        here = ray.get_runtime_context().get_node_id()
        writes = []
        hosted_parts: dict[int, WritePart] = {}
        for w, positions in self.layout.split(indices).items():
            rows = as_slice(positions)
            part = {name: WireColumn(col.array[rows], col.dtype) for name, col in columns.items()}
            groups = as_slice(positions[::n] // n) if group_columns else slice(0, 0)
            shared = {name: WireColumn(col.array[groups], col.dtype) for name, col in group_columns.items()}
            local = self._attached(w, here)
            if local is not None and local.can_write({**part, **shared}):
                local.write(indices[rows], part, shared or None)
            elif w in self._warehouses:
                peer = self._warehouses[w]
                writes.append((peer.name, peer.handle.write.remote(indices[rows], part, shared or None)))
            else:
                hosted_parts[w] = (indices[rows], part, shared or None)
        rpc.get_all(writes)
        written = [*columns, *group_columns]
        # Only states that need a written column learn of it: the others' readiness is unchanged.
        told = [state for state, needs in self._state_columns.items() if needs & set(written)]
        readiness = (hosted_parts, indices, written, dict(tokens) or None, policy_version, told)
        if then is not None:
            return self._grant_and_rows(then, "write_and_request", (readiness,))
        if told or hosted_parts:
            self._on_host("write", *readiness)
        return None

    def read(self, request: Request) -> tuple[Grant, list[dict[str, WireColumn]]]:
        """Ask the request's state's controller for samples (the host answers with the rows it holds),
        then read the rest: from shared memory where the warehouse is on this node, else from the
        warehouse actors in parallel; the parts in index order."""
        return self._grant_and_rows(request, "request_and_read", ())

    def _grant_and_rows(
        self, request: Request, call: str, before: tuple[Any, ...]
    ) -> tuple[Grant, list[dict[str, WireColumn]]]:
        """`read`, with the host's `call`: request_and_read, or write_and_request with `before` holding
        the write's arguments as one tuple."""
        if request.state not in self._state_columns:
            raise ValueError(f"unknown dock state {request.state!r}; states: {sorted(self._state_columns)}")
        prefer: list[int] = []
        here = ray.get_runtime_context().get_node_id()
        if self._prefer_local:
            on_this_node = [w for w, node in enumerate(self.nodes) if node == here]
            prefer = on_this_node if len(on_this_node) < len(self.nodes) else []  # all local: plain ascending order
        # The warehouses on this node that share memory (their owners checked alive once per request);
        # the host sends none of its own warehouses' rows that are among them.
        attached = {w: local for w in range(self.layout.num_warehouses) if (local := self._attached(w, here))}
        read_here = [w for w in attached if w not in self._warehouses]
        grant, parts = self._on_host(
            call,
            *before,
            request.state,
            request.columns,
            request.rank,
            request.batch_size,
            request.whole_groups,
            request.timeout_s,
            prefer=prefer,
            balance_ranks=request.balance_ranks,
            read_here=read_here,
            timeout=request.timeout_s + rpc.RPC_GRACE_S,
            watch=list(self._warehouses.values()),
        )
        if grant.exhausted:
            return grant, []
        columns = request.columns
        calls: list[tuple[int, str, ray.ObjectRef]] = []
        for w, rows in grant.by_warehouse.items():
            local = attached.get(w)
            if local is not None and local.has_columns(columns):  # granted: written, so allocated
                parts[w] = local.read(rows, columns, copy=True)
            elif w in self._warehouses:
                peer = self._warehouses[w]
                calls.append((w, peer.name, peer.handle.read.remote(rows, columns)))
            elif w not in parts:  # hosted, on this node, a column kept private (no room in /dev/shm)
                calls.append((w, self._host.name, self._host.handle.warehouse.remote(w, "read", rows, columns)))
        parts.update(zip([w for w, _, _ in calls], rpc.get_all([(name, ref) for _, name, ref in calls])))
        # Ownership is contiguous, so warehouse order then each warehouse's order is index order.
        return grant, [parts[w] for w in sorted(grant.by_warehouse)]

    def reset(self) -> None:
        resets = [(peer.name, peer.handle.reset.remote()) for peer in self._warehouses.values()]
        self._on_host("reset")
        rpc.get_all(resets)

    def recycle(self, indices: np.ndarray) -> None:
        """The owning warehouse actors forget the rows, then the host: its own warehouses' rows and
        every controller's metadata of them."""
        rpc.get_all(
            [
                (self._warehouses[w].name, self._warehouses[w].handle.forget.remote(indices[positions]))
                for w, positions in self.layout.split(indices).items()
                if w in self._warehouses
            ]
        )
        self._on_host("recycle", indices)

    def hand_back(self, state: str, rank: int, outputs: Sequence[str]) -> np.ndarray:
        """Metadata only (ControllerHub.hand_back): the rows stay where they are until written again."""
        return self._on_host("hand_back", state, rank, list(outputs))

    def advance_policy(self, version: int, timeout_s: float) -> None:
        self._on_host("advance_policy", version, timeout_s, timeout=timeout_s + rpc.RPC_GRACE_S)

    def snapshot(self) -> dict[str, Any]:
        # Controllers first: a column marked ready there was stored before, so the warehouses'
        # snapshot, taken after, holds it even while writers are still running.
        controllers = self._on_host("snapshot")
        warehouses = rpc.get_all([self._on_warehouse(w, "snapshot") for w in range(self.layout.num_warehouses)])
        return {"warehouses": warehouses, "controllers": controllers}

    def restore(self, snapshot: Mapping[str, Any], requeue: Mapping[str, np.ndarray]) -> None:
        if len(snapshot["warehouses"]) != self.layout.num_warehouses:
            raise ValueError(
                f"the snapshot has {len(snapshot['warehouses'])} warehouses, this dock {self.layout.num_warehouses}"
            )
        rpc.get_all([self._on_warehouse(w, "restore", part) for w, part in enumerate(snapshot["warehouses"])])
        self._on_host("restore", snapshot["controllers"], dict(requeue))

    def stats(self) -> dict[str, Any]:
        warehouse_stats = rpc.get_all([self._on_warehouse(w, "stats") for w in range(self.layout.num_warehouses)])
        for entry, node in zip(warehouse_stats, self.nodes):
            entry["node_id"] = node
        return {"warehouses": warehouse_stats, "controllers": self._on_host("stats")}

    def close(self) -> None:
        """Ask every dock actor to release its shared memory (before they are killed); dead ones are
        skipped, and one that does not answer in time leaves its directory to the next warehouse's
        sweep of orphans (shared_columns.remove_orphans)."""
        refs: list[ray.ObjectRef] = [peer.handle.close.remote() for peer in self.peers()]
        ray.wait(refs, num_returns=len(refs), timeout=_CLOSE_TIMEOUT_S)

    def _attached(self, w: int, here: str) -> Warehouse | None:
        """Warehouse `w` attached through its shared memory, if it is on node `here` and shares it."""
        directory = self._shared_directories.get(w)
        if directory is None or self.nodes[w] != here:
            return None
        start, stop = self.layout.sample_range(w)
        local = _attach(
            directory, warehouse_id=w, start=start, capacity=stop - start, group_size=self.layout.group_size
        )
        if local is None:
            return None
        if not local.owner_alive():
            owner = self._warehouses.get(w, self._host)
            raise rpc.died(owner.name, f"its process {local.owner_pid} ended, as its shared memory shows")
        return local

    def peers(self) -> list[Peer]:
        """The dock's actors: the warehouse actors, then the controller host."""
        return [*(self._warehouses[w] for w in sorted(self._warehouses)), self._host]

    def _on_host(
        self, call: str, *args: Any, timeout: float | None = None, watch: Sequence[Peer] | None = None, **kwargs: Any
    ) -> Any:
        """The answer of `call` on the controller host: over its local socket from its own node, else
        through Ray. With `watch` (a request that may wait for samples) those peers are checked for
        being alive while it waits; after `timeout` seconds the host counts as stuck."""
        if self._local_host is not None and ray.get_runtime_context().get_node_id() == self._host_node:
            return self._local_host.call(call, *args, timeout=timeout, watch=watch or (), **kwargs)
        peer = self._host
        ref = getattr(peer.handle, call).remote(*args, **kwargs)
        if watch is not None and timeout is not None:
            return rpc.wait_for_grant(peer.name, ref, timeout=timeout, watch=watch)
        return rpc.get(peer.name, ref, timeout=timeout)

    def _on_warehouse(self, w: int, call: str, *args: Any) -> tuple[str, ray.ObjectRef]:
        """`call` started on warehouse `w`, wherever it lives: (the name errors call it by, its ObjectRef)."""
        if w in self._warehouses:
            peer = self._warehouses[w]
            return peer.name, getattr(peer.handle, call).remote(*args)
        return self._host.name, self._host.handle.warehouse.remote(w, call, *args)


# This process's attachments to warehouses' shared memory, by directory (unique per warehouse
# process); None where this process may not open it. Guarded by a lock: the device worker's seats
# read the dock from threads of one process (a seat's list of them raced another's insertion).
_ATTACHED: dict[str, Warehouse | None] = {}
_ATTACHING = threading.Lock()


def _attach(directory: str, **where: int) -> Warehouse | None:
    """The attachment to the warehouse at `directory`, made once per process (mapping files costs
    system calls; a route is unpickled anew for every task that receives it)."""
    with _ATTACHING:
        return _attach_locked(directory, **where)


def _attach_locked(directory: str, **where: int) -> Warehouse | None:
    if directory not in _ATTACHED:
        for gone in [d for d in _ATTACHED if not os.path.isdir(d)]:  # docks shut down since
            del _ATTACHED[gone]
        try:
            _ATTACHED[directory] = Warehouse.attach(directory, **where)
        except OSError as err:  # e.g. another user's /dev/shm directory: the Ray calls still work
            logger.warning(
                "transfer dock: cannot attach to warehouse %s's shared memory at %s (%s); its rows travel by Ray calls",
                where.get("warehouse_id"),
                directory,
                err,
            )
            _ATTACHED[directory] = None
    return _ATTACHED[directory]


def _warehouse_name(layout: DockLayout, warehouse: int, node: str) -> str:
    start, stop = layout.sample_range(warehouse)
    return f"warehouse {warehouse} (samples [{start}, {stop}) on node {node[:12]})"


def _host_name(layout: DockLayout, hosted: Sequence[int], node: str, states: Mapping[str, Any]) -> str:
    name = f"dock controller host (the controllers of states {sorted(states)}"
    if hosted:
        name += ", with " + ", ".join(_warehouse_name(layout, w, node) for w in hosted)
    return name + ")"
