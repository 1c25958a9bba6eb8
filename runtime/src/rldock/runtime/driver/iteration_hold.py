"""Test tooling, not a user setting: the driver waits before an iteration while a file says so.

The e2e scenarios interrupt a running job (a suspend, a lost worker pod, a killed worker process)
and need it still running, at a known iteration, when the interruption lands; a small job on a
quiet machine can otherwise finish first (`assert 60 < 60`). With `RLDOCK_TEST_HOLD_FILE` set (the
scenarios put it in the RLJob's `spec.env`, which the job driver on the head inherits), the driver
reads that file before each iteration: while it exists and holds a number N, iteration N and every
later one wait; any other content (an empty file) holds the next iteration. The test moves the
hold by rewriting the file (atomically) and releases it by deleting it. Unset, as in every real
job, nothing is read. It is an environment variable and not a job config field because only tests
set it: the job config is the user's API (the benchmarks' switches stay out of it for the same
reason, JobConfig.ablations).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

HOLD_FILE_ENV = "RLDOCK_TEST_HOLD_FILE"
POLL_S = 0.5


class IterationHold:
    """Waits before an iteration while the hold file holds it; a no-op without a file."""

    def __init__(
        self, path: Path | None, *, poll_s: float = POLL_S, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.path, self._poll_s, self._sleep = path, poll_s, sleep

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> IterationHold:
        value = environ.get(HOLD_FILE_ENV)
        return cls(Path(value) if value else None)

    def holds(self, iteration: int) -> bool:
        """Whether the file, as it reads now, holds `iteration`."""
        if self.path is None:
            return False
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return False
        try:
            return iteration >= int(text.strip())
        except ValueError:  # empty, or not a number: hold whatever comes next
            return True

    def wait_before(self, iteration: int) -> None:
        """Return once the file no longer holds `iteration` (at once when it never did)."""
        if not self.holds(iteration):
            return
        logger.info("test hold: iteration %d waits while %s holds it (%s)", iteration, self.path, HOLD_FILE_ENV)
        while self.holds(iteration):
            self._sleep(self._poll_s)
        logger.info("test hold: released, iteration %d starts", iteration)
