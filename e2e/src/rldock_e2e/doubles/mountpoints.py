"""Mount points the node agent double has to create on the host, and when to remove them again.

A pod's volume is bind-mounted at its mountPath inside the pod's mount namespace, and a mount
needs an existing directory: `/etc/rldock` or `/checkpoints` are created (empty) on the host. They
are removed again when no node agent uses them any more -- not before: removing a directory that
is a mount point in another mount namespace detaches that mount there, which would pull a volume
from under the pods of another test run on the same machine. A registry (one line `<pid> <path>`
per user, under a lock) tracks who uses what, so a run that was SIGKILLed before cleaning up is
cleaned up by the next one.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from rldock_e2e.controlplane.binaries import cache_dir
from rldock_e2e.controlplane.processes import pid_alive


def _registry() -> Path:
    return cache_dir().parent / "e2e-mountpoints"


@contextmanager
def _locked() -> Iterator[list[tuple[int, str]]]:
    path = _registry()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = []
        if path.exists():
            for line in path.read_text().splitlines():
                pid, _, where = line.partition(" ")
                if pid.isdigit() and where:
                    entries.append((int(pid), where))
        yield entries
        path.write_text("".join(f"{pid} {where}\n" for pid, where in entries))


def claim(targets: Iterable[str]) -> None:
    """Create the targets missing on the host and register this process as a user of every
    target that an agent created (now or earlier)."""
    me = os.getpid()
    with _locked() as entries:
        known = {where for _, where in entries}
        for target in targets:
            path = Path(target)
            missing = [p for p in (path, *path.parents) if not p.exists()]
            if missing:
                path.mkdir(parents=True)
            for created in (*missing, *([path] if str(path) in known else [])):
                if (me, str(created)) not in entries:
                    entries.append((me, str(created)))


def release(*, mine: bool = True) -> None:
    """Drop the entries of dead processes, and with `mine` this process's; remove every directory
    no live process uses any more (only if empty: nothing that holds files is deleted)."""
    me = os.getpid()
    with _locked() as entries:
        keep = [(p, w) for p, w in entries if pid_alive(p) and not (mine and p == me)]
        unused = {w for _, w in entries} - {w for _, w in keep}
        for where in sorted(unused, key=lambda w: -len(Path(w).parts)):  # children first
            with suppress(OSError):  # not empty, or already gone
                Path(where).rmdir()
        entries[:] = keep
