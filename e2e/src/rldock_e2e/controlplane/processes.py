"""Child processes that cannot outlive the test run: own process group, killed on every exit path.

Each server runs in a new session (its own process group, so one `killpg` also takes anything it
forked) and under `setpriv --pdeathsig KILL`, so the kernel kills it if the Python process dies
without running any cleanup (SIGKILL, OOM). On the normal paths -- `stop()`, interpreter exit
(atexit), SIGTERM/SIGHUP -- the groups still alive are terminated first, then killed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

# pgid -> name of every group started here and not yet stopped.
_LIVE_GROUPS: dict[int, str] = {}
_LOCK = threading.Lock()
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_handlers_installed = False


def free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1 (all held open until chosen, then released)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _kill_group(pgid: int, sig: int) -> None:
    # Already gone (PermissionError: the pgid was reused by someone else's group).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_all_groups() -> None:
    """SIGKILL every group still registered; for atexit and signal handlers, so no waiting."""
    with _LOCK:
        groups = list(_LIVE_GROUPS)
        _LIVE_GROUPS.clear()
    for pgid in groups:
        _kill_group(pgid, signal.SIGKILL)


def _on_signal(signum: int, frame) -> None:
    kill_all_groups()
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    # Die of the same signal, as if we had never handled it.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


_previous_handlers: dict[int, object] = {}


def _install_handlers() -> None:
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(kill_all_groups)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; pdeathsig still applies
    for signum in _HANDLED_SIGNALS:
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:
            continue
        _previous_handlers[signum] = previous
        signal.signal(signum, _on_signal)


class ManagedProcess:
    """One server process, its output appended to `log_path`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        _install_handlers()
        self.name = name
        self.log_path = log_path
        setpriv = shutil.which("setpriv")
        # pdeathsig is bound to the thread that forks; the test run's main thread outlives the
        # servers, which is all we need.
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        with open(log_path, "ab") as out:
            self._popen = subprocess.Popen(
                [*prefix, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        self.pid = self._popen.pid  # also its pgid (new session)
        with _LOCK:
            _LIVE_GROUPS[self.pid] = name
        log.debug("started %s (pid %d): %s", name, self.pid, " ".join(argv))

    def poll(self) -> int | None:
        return self._popen.poll()

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-num_lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the group, then SIGKILL it after `timeout` seconds; reaps the process."""
        if self._popen.poll() is None:
            _kill_group(self.pid, signal.SIGTERM)
            try:
                self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM for %.0f s; killing", self.name, self.pid, timeout)
        # Always SIGKILL the group too: the leader exiting does not take children it forked.
        _kill_group(self.pid, signal.SIGKILL)
        self._popen.wait()
        with _LOCK:
            _LIVE_GROUPS.pop(self.pid, None)


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie (a container's init may never reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")
