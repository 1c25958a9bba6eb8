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

The iteration under way needs the job's workers, which run in the worker pods; when those go at the same
time as the head (a suspended or deleted RayCluster: Kueue's preemption, `spec.suspend`), their Ray nodes
must outlive the driver's stop. So the head's hook posts a notice on the storage every pod of the job
shares while its drivers stop (`StopNotice`), and each worker pod's preStop hook (`rldock preempt
--follow`, `follow_stop`) looks for it for `NOTICE_WAIT_S` and, when it is there, waits until it is
taken down (the drivers exited) or runs out. A worker pod deleted alone sees no notice and goes after
`NOTICE_WAIT_S`: its loss is a lost worker (the attempt restarts from the last checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from rldock.contract.runtime_cli import PROGRAM, TRAIN

logger = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process SIGTERM ended
# How long a worker pod's hook looks for the head's notice: the kubelets learn of the pods' deletion from
# one watch event each, so the head's hook starts within about a second of the workers'; a worker pod
# deleted alone pays this much more before its Ray node stops.
NOTICE_WAIT_S = 10.0


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


class StopNotice:
    """The head's notice that its drivers are stopping (module docstring): a JSON file `{"until": t}` at
    `path`, the time by which the hook gives up on them, so that a notice left by a hook killed before it
    took it down holds nobody past that."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path, self._clock = path, clock

    def post(self, timeout_s: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(json.dumps({"until": self._clock() + timeout_s}))
        partial.replace(self.path)  # whole or absent to a reader in another pod

    def take_down(self) -> None:
        self.path.unlink(missing_ok=True)

    def up(self) -> bool:
        """Whether a notice is posted and not past its time (an unreadable one counts as posted: it is
        being replaced, or will be outlived by the hook's own timeout)."""
        try:
            until = float(json.loads(self.path.read_text())["until"])
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError):
            return True
        return self._clock() < until


def follow_stop(
    notice: StopNotice, timeout_s: float, *, notice_wait_s: float = NOTICE_WAIT_S, poll_s: float = 0.5
) -> bool:
    """A worker pod's preStop hook: look for the head's notice for `notice_wait_s`; once seen, wait while it
    is up, at most `timeout_s` in all. Whether a notice was seen (a stop followed)."""
    started = time.monotonic()
    seen = False
    while True:
        up = notice.up()
        seen = seen or up
        waited = time.monotonic() - started
        if (not up and (seen or waited >= notice_wait_s)) or waited >= timeout_s:
            return seen
        time.sleep(poll_s)
