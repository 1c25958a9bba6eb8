"""The driver's bookkeeping off an iteration's critical path (JobConfig.ablations.background_bookkeeping).

After an iteration's stages return, the driver reads the dock's counters (a Ray call to every
warehouse and the controller host) and appends the record to metrics.jsonl (with an fsync) and
TensorBoard: a few milliseconds in which no worker has anything to do. With `background` on, these
(and in synchronous training the staleness call before them) run in one background thread, in the order they were
asked for, while the driver draws, resets
and starts the next iteration; the driver waits for them only where it must (the counters before
its next write to the dock, every record before a checkpoint commits and when the loop ends, also
on failure), so every metric is written exactly as before, only later. Without it each call runs
at once, on the caller's thread (the ablation's baseline).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from rldock.runtime.driver.records import dock_traffic

T = TypeVar("T")
logger = logging.getLogger(__name__)


class Bookkeeper:
    """Runs bookkeeping calls in submission order, in one background thread or at once."""

    def __init__(self, *, background: bool):
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="rldock-bookkeeping") if background else None
        )
        self._pending: list[Future] = []

    @property
    def background(self) -> bool:
        return self._executor is not None

    def later(self, fn: Callable[..., T], *args: Any) -> Future:
        """`fn(*args)` after every call asked for before it; its future. At once (an error raises
        here) when not in the background."""
        if self._executor is None:
            done: Future = Future()
            done.set_result(fn(*args))
            return done
        future = self._executor.submit(fn, *args)
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None] + [future]
        return future

    def wait(self) -> None:
        """Block until every call asked for so far has run; raise the first one's error, if any."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self, *, raise_errors: bool = True) -> None:
        """`wait`, then stop the thread (also when a call failed). With `raise_errors` off (the
        caller is already failing with its own error) a call's error is logged instead."""
        try:
            self.wait()
        except Exception:
            if raise_errors:
                raise
            logger.exception("a bookkeeping call failed while the loop was failing too")
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)


class DockCounters:
    """Each iteration's dock traffic (metrics.dock_traffic), read in the bookkeeping's order: `read`
    returns the Future of a bank's traffic since its own last read, and `wait` (before the driver's
    next put into the dock) blocks until the last read is in, so the counters hold exactly that
    iteration's traffic. One per attempt: a new attempt's banks count from zero."""

    def __init__(self, bookkeeper: Bookkeeper, docks: Sequence[Any]):
        self.bookkeeper, self.docks = bookkeeper, list(docks)
        self._last_stats: dict[int, dict] = {}  # per bank: its cumulative stats when last read
        self._last_read: Future | None = None

    def read(self, dock: Any) -> Future:
        self._last_read = self.bookkeeper.later(self._traffic, dock)
        return self._last_read

    def wait(self) -> None:
        if self._last_read is not None:  # the last iteration's counters, read before this write counts
            self._last_read.result()

    def _traffic(self, dock: Any) -> dict:
        bank = self.docks.index(dock)  # each bank's counters advance only with its iterations
        stats = dock.stats()
        traffic = dock_traffic(self._last_stats.get(bank), stats)
        self._last_stats[bank] = stats
        return traffic
