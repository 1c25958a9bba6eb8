"""TransferDock: the client that producers and consumers of every worker state use.

It is a small picklable object that the driver creates once and passes into worker actors. The
batch type at this API is TensorDict; on the wire columns are numpy arrays (see wire.py). What
stands behind it is chosen by `dock.mode`, with the same API and hand-out rules either way
(distributed.py):
- `distributed` (default): S warehouses hold the tensors, one controller per state holds
  metadata only; tensors go straight between the caller and the owning warehouses;
- `central`: one buffer actor holds every column and serves every request, the baseline the
  MindSpeed RL paper (arXiv 2507.19017) compares against.
A dock actor that dies makes the next call fail at once with DockActorDiedError naming it.
Writers may tag rows with the policy version that generated them; `set_policy_version` applies
`dock.max_staleness` / `dock.on_stale` (staleness.py) to the states the dock was told to bound.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray
import torch
from tensordict import TensorDict

from rldock.config.job import DockSpec
from rldock.runtime.dock.controller import Grant
from rldock.runtime.dock.distributed import DistributedRoute, Request
from rldock.runtime.dock.ownership import DockLayout
from rldock.runtime.dock.placement import worker_node_ids
from rldock.runtime.dock.staleness import StalenessBound
from rldock.runtime.dock.wire import WireColumn, from_wire, to_wire

logger = logging.getLogger(__name__)


class TransferDock:
    """Client of the transfer dock; build it with `TransferDock.create`."""

    def __init__(
        self,
        *,
        route: DistributedRoute,
        state_columns: Mapping[str, Sequence[str]],
        token_columns: Sequence[str],
        timeout_s: float,
    ) -> None:
        self._route = route
        self._state_columns = {state: tuple(cols) for state, cols in state_columns.items()}
        self._token_columns = tuple(token_columns)
        self._timeout_s = timeout_s
        # Seconds this copy of the client spent in `get` waiting for samples to become ready
        # (each worker holds its own copy), so callers can tell waiting from moving data.
        self.waited_s = 0.0
        # Whether the last `get` took the last samples left for its rank (Grant.drained): a
        # consumer loop may stop then instead of asking once more only to hear "exhausted".
        self.drained = False

    @classmethod
    def create(
        cls,
        spec: DockSpec,
        *,
        states: Mapping[str, Sequence[str]],
        num_samples: int,
        group_size: int,
        token_columns: Sequence[str] = (),
        node_ids: Sequence[str] | None = None,
        prefer_local: bool = True,
        colocate_controllers: bool = True,
        shared_memory: bool = True,
        bounded_states: Sequence[str] = (),
    ) -> TransferDock:
        """Start the dock's actors on the connected Ray cluster.

        `states` maps each worker state to the columns it needs before it may consume a sample.
        `token_columns` are 0/1 mask columns whose per-sample sums count a sample's tokens for
        balanced hand-out. `node_ids` are the nodes to use (default: every alive node but the Ray
        head, which runs no consumer; the head only when it is the only node): the
        distributed mode puts S = `spec.num_warehouses` (default one per node, capped at the
        number of groups) warehouses round-robin on them, the central mode its buffer on the first.
        With `prefer_local` (distributed mode) a consumer gets samples stored on its own node first;
        turning it off (for measurements) hands samples out in index order wherever they are.
        With `colocate_controllers` (distributed mode) the controllers run on the first warehouse's
        node and hold that node's warehouses, so a put or get there is one Ray call; with
        `shared_memory` the warehouses keep their columns in /dev/shm, where workers on their node
        move rows themselves. Both are on for every job; the benchmarks turn them off to measure them
        (JobConfig.ablations). The central mode does neither: it serves every byte itself.
        `bounded_states` are the states (those that train on samples) to which the staleness bound
        `spec.max_staleness` / `spec.on_stale` applies.
        """
        if not states:
            raise ValueError("states must name at least one worker state")
        for state, columns in states.items():
            if not columns:
                raise ValueError(f"state {state!r} must require at least one column")
        num_groups = num_samples // max(group_size, 1)  # DockLayout rejects a bad group size below
        unknown = sorted(set(bounded_states) - set(states))
        if unknown:
            raise ValueError(f"bounded_states {unknown} are not dock states; states: {sorted(states)}")
        staleness = StalenessBound(max_staleness=spec.max_staleness, on_stale=spec.on_stale)
        if spec.mode == "central":
            # the config's dock checks refuse more warehouses than the central buffer's one
            assert spec.num_warehouses in (None, 1), f"{spec.num_warehouses} warehouses in central mode"
            node = node_ids[0] if node_ids else ray.get_runtime_context().get_node_id()
            route = DistributedRoute.start_single_buffer(
                states=states,
                num_samples=num_samples,
                group_size=group_size,
                node_id=node,
                timeout_s=spec.timeout_s,
                staleness=staleness,
                bounded_states=bounded_states,
            )
        else:
            nodes = list(node_ids) if node_ids else worker_node_ids()
            num_warehouses = spec.num_warehouses
            if num_warehouses is None:
                num_warehouses = max(1, min(len(nodes), num_groups))
            else:  # the config's dock checks allow at most one warehouse per prompt group
                assert num_warehouses <= num_groups or num_groups == 0, (
                    f"{num_warehouses} warehouses for {num_groups} prompt groups"
                )
            route = DistributedRoute.start(
                num_warehouses=num_warehouses,
                states=states,
                num_samples=num_samples,
                group_size=group_size,
                node_ids=nodes,
                timeout_s=spec.timeout_s,
                prefer_local=prefer_local,
                colocate=colocate_controllers,
                staleness=staleness,
                bounded_states=bounded_states,
                shared_memory=shared_memory,
            )
        logger.info(
            "transfer dock (%s): %d samples in groups of %d over %d warehouse(s) on %d node(s); states %s",
            route.mode,
            num_samples,
            group_size,
            route.layout.num_warehouses,
            len(set(route.nodes)),
            sorted(states),
        )
        return cls(route=route, state_columns=states, token_columns=token_columns, timeout_s=spec.timeout_s)

    @property
    def mode(self) -> str:
        """`distributed` or `central`."""
        return self._route.mode

    @property
    def layout(self) -> DockLayout:
        """Which warehouse owns which sample (one warehouse in central mode)."""
        return self._route.layout

    @property
    def states(self) -> dict[str, tuple[str, ...]]:
        """Each worker state and the columns it requires."""
        return dict(self._state_columns)

    def put(self, indices: torch.Tensor, batch: TensorDict, *, policy_version: int | None = None) -> None:
        """Write every column of `batch` (batch size [B]) for global sample `indices` (B,).

        When put returns, the rows are stored and every state's hand-out knows which
        (indices, columns) are now ready, so consumers can get these samples. `policy_version`
        tags the rows with the version of the weights that generated them (the rollout's writes).
        """
        self._write(indices, batch, policy_version)

    def put_and_get(
        self,
        indices: torch.Tensor,
        batch: TensorDict,
        state: str,
        columns: Sequence[str],
        *,
        policy_version: int | None = None,
        rank: int = 0,
        batch_size: int,
        whole_groups: bool = False,
        balance_ranks: int = 0,
        timeout_s: float | None = None,
    ) -> tuple[torch.Tensor, TensorDict] | None:
        """`put(indices, batch)`, then `get(state, columns, ...)`, with one call to the controllers
        for both: what a stage does between two batches. Everything `put` and `get` promise holds."""
        request = self._request(state, columns, rank, batch_size, whole_groups, balance_ranks, timeout_s)
        answer = self._write(indices, batch, policy_version, then=request)
        return self._handed_out(request, *(answer or self._route.read(request)))

    def _write(
        self, indices: torch.Tensor, batch: TensorDict, policy_version: int | None, then: Request | None = None
    ) -> tuple[Grant, list[dict[str, WireColumn]]] | None:
        """`put`; with `then`, the route's answer to that request too (None: nothing was written)."""
        if policy_version is not None and policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        index_array = _index_array(indices)
        self.layout.check_indices(index_array)
        if batch.batch_size[:1] != torch.Size([index_array.size]):
            raise ValueError(f"batch has batch size {tuple(batch.batch_size)} for {index_array.size} indices")
        if np.unique(index_array).size != index_array.size:
            raise ValueError("indices of one put must be distinct")
        if index_array.size == 0:
            return None
        tensors = _columns_of(batch)
        tokens = {
            name: _token_counts(tensors[name], index_array.size) for name in self._token_columns if name in tensors
        }
        wire = {name: to_wire(t) for name, t in tensors.items()}
        return self._route.write(index_array, wire, tokens, policy_version, then=then)

    def put_groups(
        self,
        groups: torch.Tensor,
        batch: TensorDict,
        *,
        samples: TensorDict | None = None,
        policy_version: int | None = None,
    ) -> None:
        """Write whole groups: `batch` (batch size [k]) once per group slot `groups` (k,), `samples`
        (batch size [k*N], each group's N rows consecutive) per sample, in one write.

        Each row of `batch` crosses the network once, to the warehouse owning its group, which
        stores it for all N samples of the group (`split_group_columns` makes the two parts from a
        driver batch). Readers see exactly what `put` of the repeated rows would have stored.
        """
        layout = self.layout
        group_array = _index_array(groups)
        n = layout.group_size
        if group_array.size and (group_array.min() < 0 or group_array.max() >= layout.num_groups):
            raise IndexError(
                f"group slots must lie in [0, {layout.num_groups}), "
                f"got [{int(group_array.min())}, {int(group_array.max())}]"
            )
        if np.unique(group_array).size != group_array.size:
            raise ValueError("groups of one put_groups must be distinct")
        if batch.batch_size[:1] != torch.Size([group_array.size]):
            raise ValueError(f"batch has batch size {tuple(batch.batch_size)} for {group_array.size} groups")
        if samples is not None and samples.batch_size[:1] != torch.Size([group_array.size * n]):
            raise ValueError(f"samples has batch size {tuple(samples.batch_size)} for {group_array.size} groups of {n}")
        if policy_version is not None and policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        if group_array.size == 0:
            return
        index_array = (group_array[:, None] * n + np.arange(n)).reshape(-1)  # (k*N,)
        shared = _columns_of(batch)
        per_sample = _columns_of(samples) if samples is not None else {}
        both = sorted(set(shared) & set(per_sample))
        if both:
            raise ValueError(f"columns {both} are in both batch (per group) and samples (per sample)")
        tokens = {}
        for name in self._token_columns:
            if name in per_sample:
                tokens[name] = _token_counts(per_sample[name], index_array.size)
            elif name in shared:
                tokens[name] = np.repeat(_token_counts(shared[name], group_array.size), n)
        self._route.write(
            index_array,
            {name: to_wire(t) for name, t in per_sample.items()},
            tokens,
            policy_version,
            group_columns={name: to_wire(t) for name, t in shared.items()},
        )

    def get(
        self,
        state: str,
        columns: Sequence[str],
        *,
        rank: int = 0,
        batch_size: int,
        whole_groups: bool = False,
        balance_ranks: int = 0,
        timeout_s: float | None = None,
    ) -> tuple[torch.Tensor, TensorDict] | None:
        """Take up to `batch_size` ready samples for `rank` of `state` and read `columns` of them.

        Returns (indices (B,), batch with batch size [B]) in ascending index order, or None when
        every sample of this iteration has already been handed out to this state. Samples stored
        on the caller's node go first. With `balance_ranks` = R > 0 the iteration's samples are
        dealt over ranks 0..R-1 with about equal token counts (per `token_columns`) once all are
        ready, and each rank gets only its share (None once its share is handed out); every
        request of a state in one iteration must use the same `whole_groups` and `balance_ranks`.
        Blocks until enough samples are ready; raises DockTimeoutError after `timeout_s` (default
        dock.timeout_s) and DockActorDiedError at once if a dock actor is dead.
        """
        request = self._request(state, columns, rank, batch_size, whole_groups, balance_ranks, timeout_s)
        return self._handed_out(request, *self._route.read(request))

    def _request(
        self,
        state: str,
        columns: Sequence[str],
        rank: int,
        batch_size: int,
        whole_groups: bool,
        balance_ranks: int,
        timeout_s: float | None,
    ) -> Request:
        if state not in self._state_columns:
            raise ValueError(f"unknown dock state {state!r}; states: {sorted(self._state_columns)}")
        unknown = [name for name in columns if name not in self._state_columns[state]]
        if unknown:
            # Readiness is tracked only for the state's own columns; others could be stale.
            raise ValueError(
                f"state {state!r} requires columns {list(self._state_columns[state])}; it cannot read {unknown}"
            )
        timeout = self._timeout_s if timeout_s is None else timeout_s
        return Request(state, list(columns), rank, batch_size, whole_groups, timeout, balance_ranks)

    def _handed_out(
        self, request: Request, grant: Grant, parts: list[dict[str, WireColumn]]
    ) -> tuple[torch.Tensor, TensorDict] | None:
        """`get`'s answer to `request` from the route's: the indices and the rows in index order, None
        once exhausted."""
        self.waited_s += grant.waited_s
        self.drained = grant.exhausted or grant.drained
        if grant.exhausted:
            return None
        data = {name: _concat([from_wire(part[name]) for part in parts]) for name in request.columns}
        return torch.tensor(grant.indices, dtype=torch.int64), TensorDict(data, batch_size=[grant.indices.size])

    def reset(self) -> None:
        """Start a new iteration: no sample ready or consumed anywhere; storage stays allocated."""
        self._route.reset()

    def recycle(self, indices: torch.Tensor) -> None:
        """Empty samples `indices` (B,) (whole groups) within this iteration, for new rows.

        Every state forgets them (not ready, not taken) and the warehouses forget their rows, so a
        later `put` to these indices starts them over through every state. DAPO's dynamic sampling
        refills the slots of the groups it drops this way; the kept groups never leave the dock.
        """
        index_array = _index_array(indices)
        self.layout.check_indices(index_array)
        if np.unique(index_array).size != index_array.size:
            raise ValueError("indices to recycle must be distinct")
        if index_array.size:
            self._route.recycle(index_array)

    def hand_back(self, state: str, rank: int, *, outputs: Sequence[str]) -> int:
        """What consumer `rank` of `state` took and did not finish (its `outputs` columns not all written)
        goes back to `state`'s other consumers; returns how many samples. For a consumer that died
        holding samples (a rollout pool's engine: rldock.runtime.driver.rollout_pool)."""
        if state not in self._state_columns:
            raise ValueError(f"unknown dock state {state!r}; states: {sorted(self._state_columns)}")
        return len(self._route.hand_back(state, rank, outputs))

    def set_policy_version(self, version: int, *, timeout_s: float | None = None) -> None:
        """The policy now training is `version` (weight updates so far): apply the staleness bound.

        With `dock.on_stale: drop`, unconsumed samples of bounded states that `version` leaves
        more than `dock.max_staleness` versions behind are discarded (counted as `stale_dropped`);
        with `wait`, this blocks until consumers took them (counted as `stale_waits`), raising
        DockTimeoutError after `timeout_s` (default dock.timeout_s).
        """
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        self._route.advance_policy(version, self._timeout_s if timeout_s is None else timeout_s)

    def state_dict(self) -> dict[str, Any]:
        """This iteration's samples and hand-out state (numpy arrays), to save beside a checkpoint."""
        layout = self.layout
        return {
            "mode": self.mode,
            "layout": (layout.num_samples, layout.group_size, layout.num_warehouses),
            **self._route.snapshot(),
        }

    def load_state_dict(self, state: Mapping[str, Any], *, produces: Mapping[str, Sequence[str]] | None = None) -> None:
        """Restore a `state_dict` into a dock of the same mode and layout (e.g. after a restart).

        With `produces` (state -> columns it writes), a sample that a state took but whose outputs
        never reached the dock is handed out again, so no finished work is redone and no unfinished
        work is lost. A state listed with no outputs (the update) gets back everything it took:
        nothing in the dock shows that its work survived.
        """
        layout = self.layout
        if not self.can_load(state):
            raise ValueError(
                f"dock state of mode {state['mode']} layout {tuple(state['layout'])} does not fit this "
                f"{self.mode} dock of layout {(layout.num_samples, layout.group_size, layout.num_warehouses)}, "
                f"or its states {sorted(state['controllers'])} and their columns are not this dock's "
                f"{sorted(self._state_columns)}"
            )
        self._route.restore(state, _unfinished(state, produces or {}, layout.num_samples))

    def can_load(self, state: Mapping[str, Any]) -> bool:
        """Whether `state` (a state_dict) came from a dock of this mode and layout, with the same
        states requiring the same columns (a changed flow, e.g. `JobConfig.ablations.fuse_reward_advantage`
        flipped between attempts, would wait for columns no worker of this run writes)."""
        layout = self.layout
        states = {name: frozenset(snapshot["columns"]) for name, snapshot in state["controllers"].items()}
        return (
            state["mode"] == self.mode
            and tuple(state["layout"]) == (layout.num_samples, layout.group_size, layout.num_warehouses)
            and states == {name: frozenset(columns) for name, columns in self._state_columns.items()}
        )

    def stats(self) -> dict[str, Any]:
        """Counters of every warehouse (in central mode: the buffer) and controller, cumulative over
        iterations, JSON-serialisable."""
        return self._route.stats()

    def warehouse_nodes(self) -> list[str]:
        """The Ray node ID each warehouse (in central mode: the buffer) runs on, by warehouse."""
        return list(self._route.nodes)

    def actors(self) -> list:
        """The dock's Ray actors: the warehouses with actors of their own, then the controller host."""
        return [peer.handle for peer in self._route.peers()]

    def shutdown(self) -> None:
        """Kill the dock's actors, after they released their shared memory; the data is gone."""
        self._route.close()
        for peer in self._route.peers():
            ray.kill(peer.handle)


def _unfinished(
    state: Mapping[str, Any], produces: Mapping[str, Sequence[str]], num_samples: int
) -> dict[str, np.ndarray]:
    """Per state in `produces`, samples it took whose output columns are not all written in `state`
    (for a state that writes nothing: every sample it took).

    A column counts as written where a controller marked it ready (what consumers will see), and
    only for columns no state reads, where the warehouses hold it.
    """
    written: dict[str, np.ndarray] = {}
    for part in state["warehouses"]:
        for name, (indices, _) in part["columns"].items():
            written.setdefault(name, np.zeros(num_samples, dtype=bool))[indices] = True
    for snapshot in state["controllers"].values():
        for j, name in enumerate(snapshot["columns"]):
            # Every controller holding a column agrees: the snapshot is taken with no writer running
            # (the trainer kills the workers first), so no write is marked in some controllers only.
            written[name] = snapshot["ready"][:, j].copy()
    unfinished = {}
    for name, snapshot in state["controllers"].items():
        if name not in produces:
            continue
        outputs = produces[name]
        done = np.full(num_samples, bool(outputs))  # no outputs: nothing shows the work survived
        for column in outputs:
            done &= written.get(column, np.zeros(num_samples, dtype=bool))
        unfinished[name] = np.flatnonzero((snapshot["consumer"] >= 0) & ~done)
    return unfinished


def _index_array(indices: torch.Tensor) -> np.ndarray:
    if indices.ndim != 1 or indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"indices must be a 1-D integer tensor, got shape {tuple(indices.shape)} {indices.dtype}")
    return indices.detach().cpu().numpy().astype(np.int64, copy=False)


def _token_counts(mask: torch.Tensor, num_rows: int) -> np.ndarray:
    """Tokens of each row of a 0/1 mask column, (num_rows,) int64."""
    return mask.reshape(num_rows, -1).sum(dim=1).cpu().numpy().astype(np.int64)


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
