"""A stop asked of the driver from outside: SIGTERM, what a pod's deletion, a node's drain, Kueue's
suspension of the workload or a plain `kill` sends. The iteration under way finishes, a checkpoint of
it is saved and the run stops (`Preempted`; `rldock train` exits 143, 128 + SIGTERM), so that
`--resume`, or the operator's next attempt, starts right after it: the device time lost is the
start-up of the next attempt, not the iterations since the last periodic checkpoint (up to
`checkpoint.interval` - 1 of them). A stop asked during the start-up, before any iteration ran,
stops before the first one.

A second SIGTERM does not wait: the handler that was installed before (Ray's, which ends the
process and, for a local Ray, its processes) takes it, and the last checkpoint saved stands.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

logger = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process SIGTERM ended


class Preempted(Exception):
    """The run stopped on request after `iteration` (0: before the first), whose checkpoint holds it."""

    def __init__(self, iteration: int) -> None:
        super().__init__(
            f"stopped by SIGTERM after iteration {iteration}, which the last checkpoint holds: "
            "rerun the same command with --resume to continue from it"
        )
        self.iteration = iteration


class StopRequest:
    """Whether a SIGTERM asked the run to stop; `install` makes this process's SIGTERM set it."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: signal._HANDLER = signal.SIG_DFL

    def install(self) -> None:
        """Take SIGTERM from here on (after Ray's own handler is installed, which `ray.init` does).
        Signal handlers live in the main thread only: elsewhere (a test's thread) nothing changes."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # the second: stop now, as before the first
            signal.signal(signal.SIGTERM, self._previous)
            if callable(self._previous):
                self._previous(signum, frame)
            raise SystemExit(EXIT_CODE)
        self.requested = True
        logger.warning("SIGTERM: the iteration under way finishes, then a checkpoint, then the run stops")
