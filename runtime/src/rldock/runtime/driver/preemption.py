"""A stop asked of the driver from outside: SIGTERM, what a pod's deletion, a node's drain, Kueue's
suspension of the workload or a plain `kill` sends. The iteration under way finishes, a checkpoint of
it is saved and the run stops (`Preempted`; `rldock train` exits 143, 128 + SIGTERM), so that
`--resume`, or the operator's next attempt, starts right after it: the device time lost is the
start-up of the next attempt, not the iterations since the last periodic checkpoint (up to
`checkpoint.interval` - 1 of them). A stop asked during the start-up, before any iteration ran,
stops before the first one.

A second SIGTERM does not wait: the handler that was installed before (Ray's, which ends the
process and, for a local Ray, its processes) takes it, and the last checkpoint saved stands.

In an RLJob the driver runs in the Ray head's pod as a Ray job, not as the container's main process: a
deleted pod's SIGTERM goes to `ray start`, which stops Ray with the driver's workers under it. The head's
preStop hook, `rldock preempt` (`stop_drivers`), runs first: it sends the drivers of the pod their SIGTERM
and waits for them to checkpoint and exit, within the pod's terminationGracePeriodSeconds
(spec.preemption.gracePeriodSeconds).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType

from rldock.contract.runtime_cli import PROGRAM, TRAIN

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


def is_driver(argv: list[str]) -> bool:
    """Whether a command line is `rldock train ...` (the console script, or `python -m rldock.runtime.cli train`)."""
    return any(
        (os.path.basename(arg) == PROGRAM or arg == "rldock.runtime.cli") and after == TRAIN
        for arg, after in zip(argv, argv[1:])
    )


def drivers_here() -> list[int]:
    """The pids of this machine's (this pod's) `rldock train` drivers, read from /proc."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            argv = [arg.decode(errors="replace") for arg in Path(entry.path, "cmdline").read_bytes().split(b"\0")]
            if _running(int(entry.name)) and is_driver([arg for arg in argv if arg]):
                found.append(int(entry.name))
    return found


def stop_drivers(
    timeout_s: float, *, pids: list[int] | None = None, poll_s: float = 0.5
) -> tuple[list[int], list[int]]:
    """SIGTERM every driver here (`pids`: those only; each finishes its iteration under way, checkpoints it and
    exits, module docstring) and wait up to `timeout_s` for them to exit: (the pids signalled, those still
    running then)."""
    pids = drivers_here() if pids is None else pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while True:
        running = [pid for pid in pids if _running(pid)]
        if not running or time.monotonic() >= deadline:
            return pids, running
        time.sleep(poll_s)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie has exited; its parent has not read its status yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
