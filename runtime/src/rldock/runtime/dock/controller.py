"""A controller: the metadata of one worker state (rollout, reference, update, ...) and its queue.

It never sees a tensor. Per sample it knows the owning warehouse, which of the columns this
state needs are ready, and which rank of this state took it. Writers tell the controllers of the
states that need what they wrote; consumers ask their state's controller for a batch and then
read the tensors straight from the warehouses. One controller per state keeps each state's
hand-out independent (the reference model and the reward function consume the same samples) and
each controller small.

The controllers of all states share one async Ray actor, the controller host (`ControllerHub`,
below; host.py), which in central mode is also the buffer. Hand-out works from an
incremental index of ready, untaken units (handout.py): a request costs O(units it takes), and
a waiting request is an entry in a queue that a write serves only when it can now be satisfied,
oldest first, so many ranks can wait without threads and every pick-and-mark is atomic. numpy
only, so the controller's process does not import torch.

Two hand-out refinements, both chosen per request:
- `prefer`: warehouses whose samples this rank should take (the client passes those on its own
  node). While enough of their samples remain unconsumed to fill the request, the rank waits for
  them rather than take samples stored elsewhere; once too few remain, it fills up with others.
  So the stages of one node keep working on the samples stored there, and cross-node reads happen
  only for the remainder (delay scheduling for locality);
- `balance_ranks`: deal the whole iteration's samples over that many ranks at once, levelled by
  token count (balance.py), once every sample is ready; each rank then only gets its own share.
  Ranks get what their node stores first (the `prefer` of their requests says where they are),
  then tokens are levelled across nodes within a stated bound (balance.balance_near_data).
  Token counts arrive with readiness as metadata (the client sums mask columns it was told are
  token columns), never as tensors.

Writers may also say which policy version generated their rows; a controller given a staleness
bound (staleness.py) drops, or holds a policy update for, samples the policy would leave too far
behind (`advance_policy`).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rldock.runtime.dock.balance import balance_by_tokens, balance_near_data
from rldock.runtime.dock.errors import DockTimeoutError
from rldock.runtime.dock.handout import ReadyIndex
from rldock.runtime.dock.ownership import DockLayout
from rldock.runtime.dock.staleness import UNVERSIONED, StalenessBound

logger = logging.getLogger(__name__)

UNTAKEN = -1  # `_consumer` of a sample no rank has taken
DROPPED = -2  # `_consumer` of a sample discarded as too stale (staleness.py)


@dataclass
class _Waiter:
    """One request waiting in a controller for enough ready samples."""

    rank: int
    batch_size: int
    whole_groups: bool
    prefer: tuple[int, ...]
    balance_ranks: int
    started: float
    future: asyncio.Future


@dataclass(frozen=True)
class Grant:
    """A controller's answer to one request: samples now owned by that rank, or exhaustion."""

    indices: np.ndarray  # (B,) int64, ascending
    by_warehouse: dict[int, np.ndarray] = field(default_factory=dict)  # warehouse -> its indices
    exhausted: bool = False
    waited_s: float = 0.0  # time the request waited for samples to become ready (not data movement)
    # Nothing is left for this rank after these samples: its next request would be exhausted, so
    # a consumer can stop without that extra round trip (unless the dock is refilled, see recycle).
    drained: bool = False


class Controller:
    """Hands out ready samples of one state to its consumer ranks, each sample at most once."""

    def __init__(
        self,
        *,
        state: str,
        columns: Sequence[str],
        layout: DockLayout,
        default_timeout_s: float,
        staleness: StalenessBound | None = None,
    ) -> None:
        if not columns:
            raise ValueError(f"state {state!r} must require at least one column")
        self._state = state
        self._columns = tuple(columns)
        self._column_pos = {name: j for j, name in enumerate(self._columns)}
        self._layout = layout
        self._default_timeout_s = default_timeout_s
        self._warehouse = layout.warehouse_of(np.arange(layout.num_samples))  # (num_samples,)
        self._ready = np.zeros((layout.num_samples, len(self._columns)), dtype=bool)
        self._consumer = np.full(layout.num_samples, UNTAKEN, dtype=np.int64)  # rank that took it
        # What is ready and untaken, per warehouse, kept current write by write (handout.py).
        self._index = ReadyIndex(layout, len(self._columns))
        # Policy version that generated each sample, and the version training now (staleness.py).
        # Only a state given a `staleness` bound acts on them.
        self._staleness = staleness
        self._version = np.full(layout.num_samples, UNVERSIONED, dtype=np.int64)
        self._policy_version = 0
        # Token count per sample and token column, as reported by writers (see mark_ready).
        self._tokens: dict[str, np.ndarray] = {}
        # Balanced mode: the rank each sample is reserved for, -1 before the deal; each rank's share.
        self._reserved = np.full(layout.num_samples, -1, dtype=np.int64)
        self._shares: dict[int, np.ndarray] = {}
        # Warehouses on each rank's node, as its requests said (`prefer`): where a balanced deal
        # looks for the rank's share first.
        self._rank_home: dict[int, tuple[int, ...]] = {}
        self._deal_moves = 0  # units a balanced deal placed off their rank's node (cumulative)
        # Request mode of this iteration (whole_groups, balance_ranks), fixed by its first request.
        self._mode: tuple[bool, int] | None = None
        # Requests waiting for samples, oldest first; a change serves only those it can satisfy.
        self._waiters: list[_Waiter] = []
        # advance_policy(on_stale=wait) calls waiting for consumers to take stale samples.
        self._policy_waiters: list[asyncio.Future] = []
        self._requests = 0
        self._samples_handed_out = 0
        self._mark_ready_calls = 0
        self._metadata_bytes = 0
        self._timeouts = 0
        self._wait_s = 0.0
        self._stale_dropped = 0
        self._stale_waits = 0
        self._stale_wait_s = 0.0

    async def mark_ready(
        self,
        indices: np.ndarray,
        columns: Sequence[str],
        tokens: dict[str, np.ndarray] | None = None,
        policy_version: int | None = None,
    ) -> None:
        """Record that `columns` of samples `indices` were written; columns this state ignores are skipped.

        `tokens` maps token columns among `columns` to each sample's token count (B,), used by
        balanced hand-out. `policy_version`, when given, is the version that generated these rows.
        Costs O(len(indices)), and wakes only the waiting requests it lets through.
        """
        indices = np.asarray(indices, dtype=np.int64)
        self._layout.check_indices(indices)
        self._mark_ready_calls += 1
        self._metadata_bytes += len(pickle.dumps((indices, list(columns), tokens, policy_version), protocol=5))
        if policy_version is not None:
            self._version[indices] = policy_version
        for name, counts in (tokens or {}).items():
            if name not in self._tokens:
                self._tokens[name] = np.zeros(self._layout.num_samples, dtype=np.int64)
            self._tokens[name][indices] = counts
        positions = [self._column_pos[name] for name in columns if name in self._column_pos]
        if not positions:
            return
        cells = np.ix_(indices, np.array(positions))
        newly = (~self._ready[cells]).sum(axis=1)  # (B,) columns of each sample ready only now
        self._ready[cells] = True
        self._index.columns_ready(indices, newly)
        self._serve()

    async def request(
        self,
        rank: int,
        batch_size: int,
        whole_groups: bool = False,
        timeout_s: float | None = None,
        *,
        prefer: Sequence[int] = (),
        balance_ranks: int = 0,
    ) -> Grant:
        """Wait for `batch_size` ready, unconsumed samples (fewer if fewer remain) and give them to `rank`.

        With `whole_groups` only complete groups are handed out and `batch_size` must be a
        multiple of the group size. Samples stored in the warehouses `prefer` go first. With
        `balance_ranks` = R > 0 the iteration's samples are dealt over ranks 0..R-1 by token
        count once all are ready, and `rank` only ever gets its own share. Returns an exhausted
        grant once every sample of this iteration (in balanced mode: of this rank's share) has
        been handed out; raises DockTimeoutError after `timeout_s`.
        """
        self._check_request(rank, batch_size, whole_groups, balance_ranks)
        self._rank_home[rank] = tuple(sorted(int(w) for w in prefer))
        timeout = self._default_timeout_s if timeout_s is None else timeout_s
        self._requests += 1
        loop = asyncio.get_running_loop()
        waiter = _Waiter(
            rank,
            batch_size,
            whole_groups,
            tuple(int(w) for w in prefer),
            balance_ranks,
            loop.time(),
            loop.create_future(),
        )
        if not self._try_serve(waiter):
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
            except asyncio.TimeoutError:
                if not waiter.future.done():  # not served in the meantime: give up
                    self._waiters.remove(waiter)
                    self._timeouts += 1
                    self._wait_s += loop.time() - waiter.started
                    message = self._timeout_message(rank, batch_size, whole_groups, timeout)
                    logger.warning("%s", message)  # also in the actor's log, for whoever reads the cluster
                    raise DockTimeoutError(message) from None
        return self._reply(waiter.future.result())

    async def advance_policy(self, version: int, timeout_s: float | None = None) -> None:
        """The policy now training is `version`: apply the staleness bound to unconsumed samples.

        `drop`: samples (whole groups) the new version leaves beyond the bound are discarded.
        `wait`: returns only once no unconsumed sample would be left beyond the bound, raising
        DockTimeoutError after `timeout_s`.
        """
        bound = self._staleness
        if bound is None:
            self._policy_version = version
            return
        group_size = self._layout.group_size
        if bound.on_stale == "wait":
            loop = asyncio.get_running_loop()
            started = loop.time()
            deadline = started + (self._default_timeout_s if timeout_s is None else timeout_s)
            counted = False
            while blocking := int((bound.too_old(self._version, version) & (self._consumer == UNTAKEN)).sum()):
                if not counted:
                    self._stale_waits += 1
                    counted = True
                if loop.time() >= deadline:
                    self._stale_wait_s += loop.time() - started
                    raise DockTimeoutError(
                        f"transfer dock: state {self._state!r} holds {blocking} unconsumed samples that policy "
                        f"version {version} would leave more than dock.max_staleness={bound.max_staleness} "
                        "versions behind (dock.on_stale=wait); their consumers did not take them in time"
                    )
                taken = loop.create_future()
                self._policy_waiters.append(taken)
                try:
                    await asyncio.wait_for(taken, deadline - loop.time())
                except asyncio.TimeoutError:
                    pass  # checked once more above, then raised
                finally:
                    if taken in self._policy_waiters:
                        self._policy_waiters.remove(taken)
            self._stale_wait_s += loop.time() - started
        else:
            stale = bound.too_old(self._version, version, group_size=group_size) & (self._consumer == UNTAKEN)
            self._consumer[stale] = DROPPED
            self._stale_dropped += int(stale.sum())
            self._rebuild()
        self._policy_version = version
        self._serve()

    async def reset(self) -> None:
        """Start a new iteration: nothing is ready and nothing is consumed."""
        self._ready[:] = False
        self._consumer[:] = UNTAKEN
        self._version[:] = UNVERSIONED
        self._reserved[:] = -1
        self._shares = {}
        for counts in self._tokens.values():
            counts[:] = 0
        self._mode = None
        self._rebuild()
        self._serve()

    async def recycle(self, indices: np.ndarray) -> None:
        """Empty samples `indices` (whole groups) for new rows within this iteration: nothing of them
        is ready or taken any more, as if never written. A balanced hand-out deals again."""
        indices = np.asarray(indices, dtype=np.int64)
        self._layout.check_indices(indices)
        group_size = self._layout.group_size
        groups = np.unique(indices // group_size)
        if indices.size != groups.size * group_size:
            raise ValueError(
                f"state {self._state!r}: recycle takes whole groups of {group_size} samples, "
                f"got {indices.size} samples over {groups.size} groups"
            )
        self._ready[indices] = False
        self._consumer[indices] = UNTAKEN
        self._version[indices] = UNVERSIONED
        self._reserved[:] = -1
        self._shares = {}
        for counts in self._tokens.values():
            counts[indices] = 0
        self._rebuild()
        self._serve()

    async def hand_back(self, rank: int, unwritten: np.ndarray) -> np.ndarray:
        """Samples `rank` took whose outputs were not written (`unwritten`, a (num_samples,) bool) go back
        untaken: `rank` died holding them, and another consumer takes them. Returns their indices."""
        if self._mode is not None and self._mode[1]:
            raise ValueError(
                f"state {self._state!r} deals its samples over ranks (balance_ranks): a rank's share is its own, "
                "and nothing hands back a dead rank's"
            )
        # A request of the dead rank still waiting would take samples nobody reads: it goes first.
        for waiter in [w for w in self._waiters if w.rank == rank]:
            self._waiters.remove(waiter)
            waiter.future.cancel()
        back = np.flatnonzero((self._consumer == rank) & unwritten)
        if back.size:
            self._consumer[back] = UNTAKEN
            self._rebuild()
            self._serve()
        return back

    def written(self, column: str) -> np.ndarray | None:
        """(num_samples,) bool: which samples' `column` was marked ready; None when this state does not read it."""
        position = self._column_pos.get(column)
        return None if position is None else self._ready[:, position].copy()

    async def snapshot(self) -> dict[str, Any]:
        """This iteration's metadata (readiness, hand-out, token counts), for a dock checkpoint."""
        return {
            "state": self._state,
            "columns": list(self._columns),
            "ready": self._ready.copy(),
            "consumer": self._consumer.copy(),
            "reserved": self._reserved.copy(),
            "tokens": {name: counts.copy() for name, counts in self._tokens.items()},
            "mode": self._mode,
            "version": self._version.copy(),
            "policy_version": self._policy_version,
        }

    async def restore(self, snapshot: dict[str, Any], requeue: np.ndarray | None = None) -> None:
        """Load `snapshot` (from a controller of the same state and layout).

        Samples in `requeue` (indices) are handed out again: they were taken by a rank whose
        outputs never reached the dock.
        """
        if snapshot["state"] != self._state or list(snapshot["columns"]) != list(self._columns):
            raise ValueError(
                f"snapshot of state {snapshot['state']!r} columns {snapshot['columns']} cannot be "
                f"restored into state {self._state!r} columns {list(self._columns)}"
            )
        if snapshot["ready"].shape != self._ready.shape:
            raise ValueError(
                f"snapshot holds {snapshot['ready'].shape[0]} samples, this dock {self._layout.num_samples}"
            )
        self._ready[:] = snapshot["ready"]
        self._consumer[:] = snapshot["consumer"]
        self._reserved[:] = snapshot["reserved"]
        self._tokens = {name: counts.copy() for name, counts in snapshot["tokens"].items()}
        self._mode = None if snapshot["mode"] is None else tuple(snapshot["mode"])
        self._version[:] = snapshot["version"]
        self._policy_version = int(snapshot["policy_version"])
        if requeue is not None and len(requeue):
            self._consumer[np.asarray(requeue, dtype=np.int64)] = UNTAKEN
        self._shares = self._shares_of(self._reserved)
        self._rebuild()
        self._serve()

    async def ping(self) -> None:
        """Answers at once: lets clients tell a dead controller from a busy one."""

    async def stats(self) -> dict[str, Any]:
        return {
            "state": self._state,
            "columns": list(self._columns),
            "requests": self._requests,
            "samples_handed_out": self._samples_handed_out,
            "mark_ready_calls": self._mark_ready_calls,
            "metadata_bytes": self._metadata_bytes,
            "timeouts": self._timeouts,
            "wait_s": round(self._wait_s, 6),
            "waiting_now": len(self._waiters),
            "ready_now": int((self._index.missing == 0).sum()),
            "handed_out_now": int((self._consumer >= 0).sum()),
            "token_columns": sorted(self._tokens),
            "policy_version": self._policy_version,
            "balance_moved_units": self._deal_moves,
            "stale_dropped": self._stale_dropped,
            "stale_waits": self._stale_waits,
            "stale_wait_s": round(self._stale_wait_s, 6),
        }

    def _check_request(self, rank: int, batch_size: int, whole_groups: bool, balance_ranks: int) -> None:
        if rank < 0:
            raise ValueError(f"state {self._state!r}: rank must be >= 0, got {rank}")
        if batch_size < 1:
            raise ValueError(f"state {self._state!r}: batch_size must be >= 1, got {batch_size}")
        group_size = self._layout.group_size
        if whole_groups and batch_size % group_size:
            raise ValueError(
                f"state {self._state!r}: batch_size {batch_size} with whole_groups=True must be a "
                f"multiple of the group size {group_size}"
            )
        if balance_ranks < 0:
            raise ValueError(f"state {self._state!r}: balance_ranks must be >= 0, got {balance_ranks}")
        if balance_ranks and rank >= balance_ranks:
            raise ValueError(
                f"state {self._state!r}: rank {rank} asked for a balanced share over {balance_ranks} ranks"
            )
        units = self._layout.num_groups if whole_groups else self._layout.num_samples
        if balance_ranks > units:
            raise ValueError(
                f"state {self._state!r}: {units} {'groups' if whole_groups else 'samples'} cannot be "
                f"balanced over {balance_ranks} ranks"
            )
        mode = (whole_groups, balance_ranks)
        if self._mode is not None and self._mode != mode:
            # Mixing modes could leave a part-consumed group that whole-group requests never take,
            # or hand a balanced rank's reserved samples to someone else.
            raise ValueError(
                f"state {self._state!r}: rank {rank} asked with whole_groups={whole_groups}, "
                f"balance_ranks={balance_ranks} but this iteration started with whole_groups="
                f"{self._mode[0]}, balance_ranks={self._mode[1]}; use one mode per state"
            )
        self._mode = mode

    def _serve(self) -> None:
        """Serve every waiting request that can be served now, oldest first; leave the rest asleep."""
        if self._waiters:
            self._waiters = [w for w in self._waiters if not w.future.done() and not self._try_serve(w)]

    def _try_serve(self, waiter: _Waiter) -> bool:
        """Hand `waiter` its samples (or exhaustion) if possible now; whether it was served."""
        picked = self._pick(waiter.rank, waiter.batch_size, waiter.whole_groups, waiter.prefer, waiter.balance_ranks)
        if picked is None:
            return False
        waited = asyncio.get_running_loop().time() - waiter.started
        self._wait_s += waited
        if picked.size == 0:
            waiter.future.set_result(Grant(indices=picked, exhausted=True, waited_s=waited))
            return True
        self._consumer[picked] = waiter.rank
        self._index.taken(picked)
        self._samples_handed_out += picked.size
        if waiter.balance_ranks:
            share = self._shares.get(waiter.rank, picked[:0])
            drained = not (self._consumer[share] == UNTAKEN).any()
        else:
            drained = self._index.remaining(1) == 0
        owners = self._warehouse[picked]
        by_warehouse = {int(w): picked[owners == w] for w in np.unique(owners)}
        waiter.future.set_result(Grant(indices=picked, by_warehouse=by_warehouse, waited_s=waited, drained=drained))
        # Others may now see the iteration exhausted, and a staleness wait may be over.
        self._wake_policy_waiters()
        if self._waiters:
            asyncio.get_running_loop().call_soon(self._serve)
        return True

    def _pick(
        self, rank: int, batch_size: int, whole_groups: bool, prefer: Sequence[int], balance_ranks: int
    ) -> np.ndarray | None:
        """Indices to hand out now (ascending), an empty array if exhausted, None if not enough ready."""
        if balance_ranks:
            if not self._shares and not self._deal(balance_ranks, whole_groups):
                return None  # the deal needs every sample of the iteration ready
            share = self._shares.get(rank, np.empty(0, dtype=np.int64))
            left = share[self._consumer[share] == UNTAKEN]  # all ready: dealt once everything was
            return left[:batch_size]
        unit = self._layout.group_size if whole_groups else 1
        remaining = self._index.remaining(unit)
        if remaining == 0:
            return np.empty(0, dtype=np.int64)
        want = min(batch_size // unit, remaining)  # in units
        warehouses = range(self._layout.num_warehouses)
        local = [w for w in prefer if 0 <= w < self._layout.num_warehouses]
        if local and self._index.remaining(unit, local) >= want:
            order: Sequence[int] = local  # enough local samples will come: wait for them, leave the rest
        elif local:
            order = [*local, *(w for w in warehouses if w not in local)]  # local first, then any
        else:
            order = warehouses
        if self._index.available(unit, order) < want:
            return None
        units = self._index.pop(unit, want, order)
        return np.sort((units[:, None] * unit + np.arange(unit)).ravel())

    def _deal(self, num_ranks: int, whole_groups: bool) -> bool:
        """Reserve every sample for one of `num_ranks` ranks, levelled by tokens; False if not all ready."""
        if self._index.unsettled:
            return False  # dropped samples never get their remaining columns: do not wait for them
        tokens = sum(self._tokens.values(), np.zeros(self._layout.num_samples, dtype=np.int64))
        group_size = self._layout.group_size if whole_groups else 1
        homes = [self._rank_home.get(r, ()) for r in range(num_ranks)]
        if any(homes):
            # Sites are the distinct homes (nodes); a warehouse belongs to the site that lists it.
            site_of_home = {home: i for i, home in enumerate(sorted({h for h in homes if h}))}
            site_of_warehouse = np.full(self._layout.num_warehouses, -1, dtype=np.int64)
            for home, site in site_of_home.items():
                site_of_warehouse[list(home)] = site
            unit_site = site_of_warehouse[self._warehouse[::group_size]]
            rank_site = [site_of_home[h] if h else -1 for h in homes]
            parts, moved = balance_near_data(
                tokens, num_ranks, group_size=group_size, unit_site=unit_site, rank_site=rank_site
            )
            self._deal_moves += moved
        else:  # one node, or ranks that did not say where they are: tokens only
            parts = balance_by_tokens(tokens, num_ranks, group_size=group_size)
        for r, part in enumerate(parts):
            self._reserved[part] = r
        self._shares = self._shares_of(self._reserved)
        return True

    @staticmethod
    def _shares_of(reserved: np.ndarray) -> dict[int, np.ndarray]:
        """Each rank's reserved samples, ascending; empty before a deal."""
        order = np.argsort(reserved, kind="stable")
        ranks, starts = np.unique(reserved[order], return_index=True)
        bounds = [*starts[1:], order.size]
        return {int(r): order[a:b] for r, a, b in zip(ranks, starts, bounds) if r >= 0}

    def _rebuild(self) -> None:
        self._index.rebuild(self._ready, self._consumer == UNTAKEN, self._consumer == DROPPED)
        self._wake_policy_waiters()

    def _wake_policy_waiters(self) -> None:
        """advance_policy(on_stale=wait) calls look again: samples were taken or forgotten."""
        for taken in self._policy_waiters:
            if not taken.done():
                taken.set_result(None)

    def _timeout_message(self, rank: int, batch_size: int, whole_groups: bool, timeout: float) -> str:
        unconsumed = self._consumer == UNTAKEN
        ready = self._ready.all(axis=1)
        remaining = int(unconsumed.sum())
        missing = {name: int((~self._ready[:, j] & unconsumed).sum()) for name, j in self._column_pos.items()}
        message = (
            f"transfer dock: state {self._state!r} rank {rank} waited {timeout:g}s for "
            f"{min(batch_size, remaining)} samples with columns {list(self._columns)}; of "
            f"{remaining} samples remaining this iteration {int((ready & unconsumed).sum())} are ready "
            f"and {int((~ready & unconsumed).sum())} are not (not yet written, per column: {missing}); "
            f"{self._layout.num_samples - remaining} of {self._layout.num_samples} already handed out"
        )
        if whole_groups:
            groups = (ready & unconsumed).reshape(-1, self._layout.group_size).all(axis=1)
            message += f"; {int(groups.sum())} complete groups of {self._layout.group_size} ready"
        if self._mode is not None and self._mode[1] and (self._reserved < 0).any():
            message += f"; a balanced hand-out over {self._mode[1]} ranks waits for every sample to be ready"
        return message + ". Check that the producers of the missing columns ran, or raise dock.timeout_s."

    def _reply(self, grant: Grant) -> Grant:
        self._metadata_bytes += len(pickle.dumps(grant, protocol=5))
        return grant


class ControllerHub:
    """The controllers of every state in one event loop.

    Each state keeps its own Controller (its own readiness, hand-out and waiters), so a write
    wakes only the waiters it can satisfy and a request costs O(ready) as before; only the
    process is shared: a write tells every state it concerns in one call and the metadata costs
    one process, not one per state. The controller host (host.py) is this hub plus the warehouses
    of its node.
    """

    def __init__(
        self,
        *,
        states: dict[str, Sequence[str]],
        layout: DockLayout,
        default_timeout_s: float,
        staleness: StalenessBound | None = None,
        bounded_states: Sequence[str] = (),
    ) -> None:
        unknown = sorted(set(bounded_states) - set(states))
        if unknown:
            raise ValueError(f"staleness bound for unknown dock states {unknown}; states: {sorted(states)}")
        self._num_samples = layout.num_samples
        self._controllers = {
            state: Controller(
                state=state,
                columns=list(columns),
                layout=layout,
                default_timeout_s=default_timeout_s,
                staleness=staleness if state in bounded_states else None,
            )
            for state, columns in states.items()
        }

    async def mark_ready(
        self,
        indices: np.ndarray,
        columns: Sequence[str],
        tokens: dict[str, np.ndarray] | None = None,
        policy_version: int | None = None,
        states: Sequence[str] | None = None,
    ) -> None:
        """Tell the controllers of `states` (default: every state) that `columns` of `indices` were written."""
        for state in self._controllers if states is None else states:
            await self._controller(state).mark_ready(indices, columns, tokens, policy_version)

    async def advance_policy(self, version: int, timeout_s: float | None = None) -> None:
        # Together, as separate controller actors would: with on_stale=wait each waits for its own consumers.
        await asyncio.gather(*(c.advance_policy(version, timeout_s) for c in self._controllers.values()))

    async def request(
        self,
        state: str,
        rank: int,
        batch_size: int,
        whole_groups: bool = False,
        timeout_s: float | None = None,
        *,
        prefer: Sequence[int] = (),
        balance_ranks: int = 0,
    ) -> Grant:
        return await self._controller(state).request(
            rank, batch_size, whole_groups, timeout_s, prefer=prefer, balance_ranks=balance_ranks
        )

    async def reset(self) -> None:
        for controller in self._controllers.values():
            await controller.reset()

    async def recycle(self, indices: np.ndarray) -> None:
        for controller in self._controllers.values():
            await controller.recycle(indices)

    async def hand_back(self, state: str, rank: int, outputs: Sequence[str]) -> np.ndarray:
        """What `rank` took of `state` and did not finish goes back to `state`'s other consumers: the
        samples whose `outputs` columns are not all marked ready in the states that read them (all it
        took when no state reads any of them). A consumer that died holding samples (a rollout pool's
        engine) costs its unfinished work, not the iteration. Returns the samples handed back."""
        unwritten: np.ndarray | None = None
        for column in outputs:
            for ready in (ready for c in self._controllers.values() if (ready := c.written(column)) is not None):
                # written only where every state reading it saw it (a write marks them all: this is a guard)
                unwritten = ~ready if unwritten is None else unwritten | ~ready
        if unwritten is None:  # nothing shows what it finished
            unwritten = np.ones(self._num_samples, dtype=bool)
        return await self._controller(state).hand_back(rank, unwritten)

    async def snapshot(self) -> dict[str, dict[str, Any]]:
        return {state: await c.snapshot() for state, c in self._controllers.items()}

    async def restore(self, snapshots: dict[str, dict[str, Any]], requeue: dict[str, np.ndarray]) -> None:
        for state, controller in self._controllers.items():
            await controller.restore(snapshots[state], requeue.get(state))

    async def stats(self) -> dict[str, dict[str, Any]]:
        return {state: await c.stats() for state, c in self._controllers.items()}

    async def ping(self) -> None:
        """Answers at once: lets clients tell a dead hub from a busy one."""

    def _controller(self, state: str) -> Controller:
        if state not in self._controllers:
            raise ValueError(f"unknown dock state {state!r}; states: {sorted(self._controllers)}")
        return self._controllers[state]
