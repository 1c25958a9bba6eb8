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
taken down (the drivers exited) or runs out.

A worker pod deleted alone (a node drained, an eviction) asks for a checkpoint: its hook posts a request
in `drain-requests/<pod>.json` beside the notice (`drain_request`), which the driver watches
(`StopRequest.install`). The driver acknowledges it, finishes the iteration under way on that worker,
saves it and takes the request down (`StopRequest.between_iterations`); the hook keeps the worker's Ray
node up until then. The run goes on and meets the lost worker as any lost worker (the runtime's restart
under `--max-restarts`, else the operator's retry), resuming right after the saved iteration instead of
the last periodic checkpoint. A request nobody acknowledges within `NOTICE_WAIT_S` (no driver runs) is
taken down by its hook, and the pod goes; one past its `until` is ignored, so a stale one asks nothing
of a later run.
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

from rldock.contract.runtime_cli import DRAIN_REQUESTS_DIR, PROGRAM, TRAIN

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
    """Whether a SIGTERM asked the run to stop, and which worker pods being deleted asked for a checkpoint;
    `install` makes this process's SIGTERM set the first and watches the requests' folder for the second
    (module docstring)."""

    def __init__(self, *, poll_s: float = 1.0) -> None:
        self.requested = False
        self.drains: list[StopNotice] = []  # the requests taken up and not answered yet
        self._drains_lock = threading.Lock()  # the watcher appends, the loop's boundary answers
        self._previous: signal._HANDLER = signal.SIG_DFL
        self._output_dir: Path | None = None
        self._poll_s = poll_s

    def install(self, output_dir: Path | None = None) -> None:
        """Take SIGTERM from here on (after Ray's own handler is installed, which `ray.init` does), and the
        worker pods' requests in the run's `output_dir` (None: none). Signal handlers live in the main
        thread only: elsewhere (a test's thread) SIGTERM is left as it was."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        if output_dir is not None:
            self._output_dir = output_dir
            threading.Thread(target=self._watch, name="drain-requests", daemon=True).start()

    def between_iterations(self, done: int, *, first: int, save: Callable[[int], None]) -> None:
        """At the boundary after iteration `done` (this attempt started at `first`): when a stop or a checkpoint
        was asked, `done` is saved by `save` (unless the run's newest checkpoint holds it, or none ran yet);
        then a stop raises `Preempted`, and the drained pods' requests are answered (taken down: their pods
        go)."""
        with self._drains_lock:  # a request taken up from here on waits for the next boundary
            drains, self.drains = self.drains, []
        if not (self.requested or drains):
            return
        from rldock.runtime.checkpoint import latest_checkpoint  # torch: not in the pods' hooks, which import this

        latest = latest_checkpoint(self._output_dir) if self._output_dir is not None else None
        if done >= first and (latest is None or latest.iteration < done):
            save(done)
        for request in self._pending() if self.requested else drains:
            request.take_down()
        if self.requested:
            raise Preempted(done)

    def _pending(self) -> list[StopNotice]:
        requests = None if self._output_dir is None else self._output_dir / DRAIN_REQUESTS_DIR
        if requests is None or not requests.is_dir():
            return []
        return [StopNotice(path) for path in sorted(requests.glob("*.json"))]

    def answer_requests(self) -> None:
        """Take up every request posted and not past its time: acknowledged, a checkpoint asked for."""
        for request in self._pending():
            if request.up() and not request.acknowledged():
                request.acknowledge()
                with self._drains_lock:
                    self.drains.append(request)
                logger.warning(
                    "%s is being deleted and asks for a checkpoint: the iteration under way finishes on it and "
                    "is saved, then its pod goes",
                    request.path.stem,
                )

    def _watch(self) -> None:
        while True:
            self.answer_requests()
            time.sleep(self._poll_s)

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
    """The head's notice that its drivers are stopping, or a worker pod's request for a checkpoint (module
    docstring): a JSON file `{"until": t}` at `path`, the time by which the hook gives up on them, so that
    a notice left by a hook killed before it took it down holds nobody past that; a request the driver took
    up says `"acknowledged": true` too."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path, self._clock = path, clock

    def post(self, timeout_s: float) -> None:
        self._write({"until": self._clock() + timeout_s})

    def _write(self, fields: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(json.dumps(fields))
        partial.replace(self.path)  # whole or absent to a reader in another pod

    def acknowledge(self) -> None:
        """The driver took the request up (its until kept)."""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # taken down meanwhile
            self._write({**json.loads(self.path.read_text()), "acknowledged": True})

    def acknowledged(self) -> bool:
        try:
            return bool(json.loads(self.path.read_text()).get("acknowledged"))
        except (OSError, ValueError, AttributeError):
            return False

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


def drain_request(notice: StopNotice, pod: str) -> StopNotice:
    """The request a worker pod `pod` posts beside the head's `notice` (module docstring)."""
    return StopNotice(notice.path.parent / DRAIN_REQUESTS_DIR / f"{pod}.json")


def follow_stop(
    notice: StopNotice,
    timeout_s: float,
    *,
    request: StopNotice | None = None,
    notice_wait_s: float = NOTICE_WAIT_S,
    poll_s: float = 0.5,
) -> bool:
    """A worker pod's preStop hook: post `request` (the pod's ask for a checkpoint, None: none) and look for the
    head's notice or the driver's acknowledgement for `notice_wait_s`; then wait while the notice is up or
    the acknowledged request is (the driver takes it down once saved), at most `timeout_s` in all; the
    request taken down on the way out. Whether a stop was followed."""
    started = time.monotonic()
    seen = acknowledged = False
    if request is not None:
        request.post(timeout_s)
    try:
        while True:
            up = notice.up()
            seen = seen or up
            acknowledged = acknowledged or (request is not None and request.acknowledged())
            asked = acknowledged and request is not None and request.up()
            waited = time.monotonic() - started
            if waited >= timeout_s or not (up or asked or (not (seen or acknowledged) and waited < notice_wait_s)):
                return seen or acknowledged
            time.sleep(poll_s)
    finally:
        if request is not None:
            request.take_down()
