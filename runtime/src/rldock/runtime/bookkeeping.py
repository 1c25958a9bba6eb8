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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

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
