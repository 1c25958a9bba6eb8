"""TransferDock: the client that producers and consumers of every worker state use.

It is a small picklable object (actor handles and the layout) that the driver creates once and
passes into worker actors. Tensors go straight between the caller and the owning warehouses, in
parallel; controllers only ever receive indices and column names. The batch type at this API is
TensorDict; on the wire columns are numpy arrays (see wire.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import RayTaskError
from tensordict import TensorDict

from rldock.config.job import DockSpec
from rldock.runtime.dock.controller import Controller, Grant
from rldock.runtime.dock.errors import DockTimeoutError
from rldock.runtime.dock.layout import DockLayout, as_slice
from rldock.runtime.dock.placement import alive_node_ids, assign_nodes, pinned_to
from rldock.runtime.dock.warehouse import Warehouse
from rldock.runtime.dock.wire import WireColumn, from_wire, to_wire

logger = logging.getLogger(__name__)

# Dock actors only hold memory and metadata: they must not take CPUs that workers ask for.
_WarehouseActor = ray.remote(num_cpus=0)(Warehouse)
_ControllerActor = ray.remote(num_cpus=0)(Controller)

# Errors raised inside a dock actor that are the caller's fault: re-raised as themselves.
_CALLER_ERRORS = (DockTimeoutError, ValueError, IndexError, KeyError)
# A request outlives the controller's own timeout only if the controller is broken.
_RPC_GRACE_S = 60.0


class TransferDock:
    """Client of the distributed transfer dock; build it with `TransferDock.create`."""

    def __init__(
        self,
        *,
        layout: DockLayout,
        warehouses: Sequence[ActorHandle],
        controllers: Mapping[str, ActorHandle],
        state_columns: Mapping[str, Sequence[str]],
        warehouse_nodes: Sequence[str],
        timeout_s: float,
    ) -> None:
        self.layout = layout
        self._warehouses = list(warehouses)
        self._controllers = dict(controllers)
        self._state_columns = {state: tuple(cols) for state, cols in state_columns.items()}
        self._warehouse_nodes = list(warehouse_nodes)
        self._timeout_s = timeout_s
        # Seconds this copy of the client spent in `get` waiting for samples to become ready
        # (each worker holds its own copy), so callers can tell waiting from moving data.
        self.waited_s = 0.0

    @classmethod
    def create(
        cls,
        spec: DockSpec,
        *,
        states: Mapping[str, Sequence[str]],
        num_samples: int,
        group_size: int,
    ) -> TransferDock:
        """Start the warehouses and one controller per state on the connected Ray cluster.

        `states` maps each worker state to the columns it needs before it may consume a sample.
        S is `spec.num_warehouses`, or one per alive node (capped at the number of groups).
        """
        if not states:
            raise ValueError("states must name at least one worker state")
        for state, columns in states.items():
            if not columns:
                raise ValueError(f"state {state!r} must require at least one column")
        nodes = alive_node_ids()
        num_groups = num_samples // max(group_size, 1)  # DockLayout rejects a bad group size below
        num_warehouses = spec.num_warehouses
        if num_warehouses is None:
            num_warehouses = max(1, min(len(nodes), num_groups))
        elif num_warehouses > num_groups > 0:
            raise ValueError(
                f"dock.num_warehouses: {num_warehouses} warehouses for {num_groups} prompt groups "
                "would leave some warehouses empty; use at most one warehouse per prompt group"
            )
        layout = DockLayout(num_samples=num_samples, group_size=group_size, num_warehouses=num_warehouses)
        warehouses = _start_warehouses(layout, assign_nodes(num_warehouses, nodes))
        controllers = _start_controllers(layout, states, spec.timeout_s)
        # Waiting here surfaces actor start failures now rather than at the first put.
        warehouse_nodes = ray.get([wh.node_id.remote() for wh in warehouses])
        ray.get([c.stats.remote() for c in controllers.values()])
        logger.info(
            "transfer dock: %d samples in groups of %d over %d warehouses on %d node(s); states %s",
            num_samples, group_size, num_warehouses, len(set(warehouse_nodes)), sorted(states),
        )
        return cls(
            layout=layout,
            warehouses=warehouses,
            controllers=controllers,
            state_columns=states,
            warehouse_nodes=warehouse_nodes,
            timeout_s=spec.timeout_s,
        )

    @property
    def states(self) -> dict[str, tuple[str, ...]]:
        """Each worker state and the columns it requires."""
        return dict(self._state_columns)

    def put(self, indices: torch.Tensor, batch: TensorDict) -> None:
        """Write every column of `batch` (batch size [B]) for global sample `indices` (B,).

        The rows go to their owning warehouses in parallel; then every controller learns which
        (indices, columns) are now ready. When put returns, consumers can get these samples.
        """
        index_array = _index_array(indices)
        self.layout.check_indices(index_array)
        if batch.batch_size[:1] != torch.Size([index_array.size]):
            raise ValueError(f"batch has batch size {tuple(batch.batch_size)} for {index_array.size} indices")
        if np.unique(index_array).size != index_array.size:
            raise ValueError("indices of one put must be distinct")
        if index_array.size == 0:
            return
        columns = {name: to_wire(tensor) for name, tensor in _columns_of(batch).items()}
        writes = []
        for w, positions in self.layout.split(index_array).items():
            rows = as_slice(positions)
            part = {name: WireColumn(col.array[rows], col.dtype) for name, col in columns.items()}
            writes.append(self._warehouses[w].write.remote(index_array[rows], part))
        _wait(writes)
        names = list(columns)
        _wait([c.mark_ready.remote(index_array, names) for c in self._controllers.values()])

    def get(
        self,
        state: str,
        columns: Sequence[str],
        *,
        rank: int = 0,
        batch_size: int,
        whole_groups: bool = False,
        timeout_s: float | None = None,
    ) -> tuple[torch.Tensor, TensorDict] | None:
        """Take up to `batch_size` ready samples for `rank` of `state` and read `columns` of them.

        Returns (indices (B,), batch with batch size [B]) in ascending index order, or None when
        every sample of this iteration has already been handed out to this state. Blocks until
        enough samples are ready; raises DockTimeoutError after `timeout_s` (default dock.timeout_s).
        """
        if state not in self._controllers:
            raise ValueError(f"unknown dock state {state!r}; states: {sorted(self._controllers)}")
        unknown = [name for name in columns if name not in self._state_columns[state]]
        if unknown:
            # Readiness is tracked only for the state's own columns; others could be stale.
            raise ValueError(
                f"state {state!r} requires columns {list(self._state_columns[state])}; "
                f"it cannot read {unknown}"
            )
        timeout = self._timeout_s if timeout_s is None else timeout_s
        request = self._controllers[state].request.remote(rank, batch_size, whole_groups, timeout)
        grant: Grant = _wait([request], timeout=timeout + _RPC_GRACE_S)[0]
        self.waited_s += grant.waited_s
        if grant.exhausted:
            return None
        order = sorted(grant.by_warehouse)
        parts = _wait([self._warehouses[w].read.remote(grant.by_warehouse[w], list(columns)) for w in order])
        # Ownership is contiguous, so warehouse order then each warehouse's order is index order.
        index_array = np.concatenate([grant.by_warehouse[w] for w in order])
        data = {name: _concat([from_wire(part[name]) for part in parts]) for name in columns}
        return torch.tensor(index_array, dtype=torch.int64), TensorDict(data, batch_size=[index_array.size])

    def reset(self) -> None:
        """Start a new iteration: no sample ready or consumed anywhere; storage stays allocated."""
        handles = [*self._controllers.values(), *self._warehouses]
        _wait([handle.reset.remote() for handle in handles])

    def stats(self) -> dict[str, Any]:
        """Counters of every warehouse and controller (cumulative over iterations), JSON-serialisable."""
        warehouse_stats = _wait([w.stats.remote() for w in self._warehouses])
        for entry, node in zip(warehouse_stats, self._warehouse_nodes):
            entry["node_id"] = node
        controller_stats = _wait([c.stats.remote() for c in self._controllers.values()])
        return {"warehouses": warehouse_stats, "controllers": dict(zip(self._controllers, controller_stats))}

    def warehouse_nodes(self) -> list[str]:
        """The Ray node ID each warehouse runs on, by warehouse."""
        return list(self._warehouse_nodes)

    def shutdown(self) -> None:
        """Kill the dock's actors; the data is gone."""
        for handle in [*self._warehouses, *self._controllers.values()]:
            ray.kill(handle)


def _start_warehouses(layout: DockLayout, nodes: Sequence[str]) -> list[ActorHandle]:
    warehouses = []
    for w, node in enumerate(nodes):
        start, stop = layout.sample_range(w)
        warehouses.append(
            _WarehouseActor.options(scheduling_strategy=pinned_to(node)).remote(
                warehouse_id=w, start=start, capacity=stop - start
            )
        )
    return warehouses


def _start_controllers(
    layout: DockLayout, states: Mapping[str, Sequence[str]], timeout_s: float
) -> dict[str, ActorHandle]:
    # Controllers serve every consumer; next to the creator (usually the driver) is as good as any.
    here = ray.get_runtime_context().get_node_id()
    return {
        state: _ControllerActor.options(scheduling_strategy=pinned_to(here, soft=True)).remote(
            state=state, columns=list(columns), layout=layout, default_timeout_s=timeout_s
        )
        for state, columns in states.items()
    }


def _index_array(indices: torch.Tensor) -> np.ndarray:
    if indices.ndim != 1 or indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(
            f"indices must be a 1-D integer tensor, got shape {tuple(indices.shape)} {indices.dtype}"
        )
    return indices.detach().cpu().numpy().astype(np.int64, copy=False)


def _columns_of(batch: TensorDict) -> dict[str, torch.Tensor]:
    columns = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):  # nested TensorDicts and non-tensor data
            raise ValueError(f"dock column {key!r} must be a tensor, got {type(value).__name__}")
        columns[key] = value
    if not columns:
        raise ValueError("batch has no columns")
    return columns


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _wait(refs: list[ray.ObjectRef], timeout: float | None = None) -> list[Any]:
    """ray.get, re-raising the caller's own errors from inside an actor as themselves."""
    try:
        return ray.get(refs, timeout=timeout)
    except RayTaskError as err:
        if isinstance(err.cause, _CALLER_ERRORS):
            raise err.cause from None
        raise
