"""A controller: the metadata of one worker state (rollout, reference, update, ...) and its queue.

It never sees a tensor. Per sample it knows the owning warehouse, which of the columns this
state needs are ready, and which rank of this state took it. Writers tell every controller what
they wrote; consumers ask their state's controller for a batch and then read the tensors straight
from the warehouses. One controller per state keeps each state's hand-out independent (the
reference model and the reward function consume the same samples) and each controller small.

It is an async Ray actor: waiting consumers are coroutines on one event loop, woken whenever
readiness or consumption changes, so many ranks can wait without threads and every pick-and-mark
is atomic. numpy only, so the actor's process does not import torch.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rldock.runtime.dock.errors import DockTimeoutError
from rldock.runtime.dock.layout import DockLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grant:
    """A controller's answer to one request: samples now owned by that rank, or exhaustion."""

    indices: np.ndarray  # (B,) int64, ascending
    by_warehouse: dict[int, np.ndarray] = field(default_factory=dict)  # warehouse -> its indices
    exhausted: bool = False
    waited_s: float = 0.0  # time the request waited for samples to become ready (not data movement)


class Controller:
    """Hands out ready samples of one state to its consumer ranks, each sample at most once."""

    def __init__(
        self, *, state: str, columns: Sequence[str], layout: DockLayout, default_timeout_s: float
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
        self._consumer = np.full(layout.num_samples, -1, dtype=np.int64)  # rank that took it, -1: none
        self._whole_groups: bool | None = None  # request mode of this iteration, fixed by its first
        # Waiters re-check after any change to readiness or consumption.
        self._changed = asyncio.Condition()
        self._requests = 0
        self._samples_handed_out = 0
        self._mark_ready_calls = 0
        self._metadata_bytes = 0
        self._timeouts = 0
        self._wait_s = 0.0

    async def mark_ready(self, indices: np.ndarray, columns: Sequence[str]) -> None:
        """Record that `columns` of samples `indices` were written; columns this state ignores are skipped."""
        indices = np.asarray(indices, dtype=np.int64)
        self._layout.check_indices(indices)
        self._mark_ready_calls += 1
        self._metadata_bytes += len(pickle.dumps((indices, list(columns)), protocol=5))
        positions = [self._column_pos[name] for name in columns if name in self._column_pos]
        if not positions:
            return
        async with self._changed:
            self._ready[np.ix_(indices, positions)] = True
            self._changed.notify_all()

    async def request(
        self, rank: int, batch_size: int, whole_groups: bool = False, timeout_s: float | None = None
    ) -> Grant:
        """Wait for `batch_size` ready, unconsumed samples (fewer if fewer remain) and give them to `rank`.

        With `whole_groups` only complete groups are handed out and `batch_size` must be a
        multiple of the group size. Returns an exhausted grant once every sample of this
        iteration has been handed out; raises DockTimeoutError after `timeout_s`.
        """
        self._check_request(rank, batch_size, whole_groups)
        timeout = self._default_timeout_s if timeout_s is None else timeout_s
        self._requests += 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with self._changed:
            while (picked := self._pick(batch_size, whole_groups)) is None:
                left = started + timeout - loop.time()
                if left <= 0:
                    self._timeouts += 1
                    self._wait_s += loop.time() - started
                    message = self._timeout_message(rank, batch_size, whole_groups, timeout)
                    logger.warning("%s", message)  # also in the actor's log, for whoever reads the cluster
                    raise DockTimeoutError(message)
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    pass  # the loop checks once more, then raises with the final counts
            waited = loop.time() - started
            self._wait_s += waited
            if picked.size == 0:
                return self._reply(Grant(indices=picked, exhausted=True, waited_s=waited))
            self._consumer[picked] = rank
            self._samples_handed_out += picked.size
            self._changed.notify_all()  # other ranks may now see the iteration exhausted
        owners = self._warehouse[picked]
        by_warehouse = {int(w): picked[owners == w] for w in np.unique(owners)}
        return self._reply(Grant(indices=picked, by_warehouse=by_warehouse, waited_s=waited))

    async def reset(self) -> None:
        """Start a new iteration: nothing is ready and nothing is consumed."""
        async with self._changed:
            self._ready[:] = False
            self._consumer[:] = -1
            self._whole_groups = None
            self._changed.notify_all()

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
            "ready_now": int(self._ready.all(axis=1).sum()),
            "handed_out_now": int((self._consumer >= 0).sum()),
        }

    def _check_request(self, rank: int, batch_size: int, whole_groups: bool) -> None:
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
        if self._whole_groups is not None and self._whole_groups != whole_groups:
            # Mixing modes could leave a part-consumed group that whole-group requests never take.
            raise ValueError(
                f"state {self._state!r}: rank {rank} asked with whole_groups={whole_groups} but this "
                f"iteration started with whole_groups={self._whole_groups}; use one mode per state"
            )
        self._whole_groups = whole_groups

    def _pick(self, batch_size: int, whole_groups: bool) -> np.ndarray | None:
        """Indices to hand out now (ascending), an empty array if exhausted, None if not enough ready."""
        unconsumed = self._consumer < 0
        remaining = int(unconsumed.sum())
        if remaining == 0:
            return np.empty(0, dtype=np.int64)
        want = min(batch_size, remaining)
        available = self._ready.all(axis=1) & unconsumed
        if whole_groups:
            group_size = self._layout.group_size
            # In whole-group mode every hand-out is whole groups, so `remaining` is a multiple of N.
            groups = np.flatnonzero(available.reshape(-1, group_size).all(axis=1))[: want // group_size]
            picked = (groups[:, None] * group_size + np.arange(group_size)).ravel()
        else:
            picked = np.flatnonzero(available)[:want]
        return picked.astype(np.int64) if picked.size == want else None

    def _timeout_message(self, rank: int, batch_size: int, whole_groups: bool, timeout: float) -> str:
        unconsumed = self._consumer < 0
        ready = self._ready.all(axis=1)
        remaining = int(unconsumed.sum())
        missing = {
            name: int((~self._ready[:, j] & unconsumed).sum()) for name, j in self._column_pos.items()
        }
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
        return message + ". Check that the producers of the missing columns ran, or raise dock.timeout_s."

    def _reply(self, grant: Grant) -> Grant:
        self._metadata_bytes += len(pickle.dumps(grant, protocol=5))
        return grant
