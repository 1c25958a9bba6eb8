"""Who listens on a TCP port of this machine (Linux `/proc`): whether a `{port}` server's port is held by
that server's own processes, before rldock sends it anything (local.py).

A `{port}` command gets a port found free a moment before its server binds it; another process on the
machine could bind it in between and answer `/health`, and the clients would then send it the job's token.
So rldock looks for the sockets listening on the port (`/proc/net/tcp`, `/proc/net/tcp6`, state LISTEN)
and for the sockets the server's session holds (every process whose session is the server's: the server
runs in a session of its own, and its workers inherit it): the port is the server's only when every
listening socket on it is one of those. A process of another user hides its descriptors from us, so its
socket counts as not the server's, which is the side to err on.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def listening_sockets(port: int, *, proc: Path = _PROC) -> set[int]:
    """The inodes of the sockets listening on `port` (any address, IPv4 or IPv6)."""
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in (proc / "net" / table).read_text().splitlines()[1:]:
                fields = line.split()
                # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
                if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(int(fields[9]))
    return inodes


def session_sockets(session: int, *, proc: Path = _PROC) -> set[int]:
    """The inodes of the sockets every process of `session` holds open (those we may look at)."""
    inodes: set[int] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses
            if int(stat.rsplit(")", 1)[1].split()[3]) != session:
                continue
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[len("socket:[") : -1]))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return inodes


def held_by_session(port: int, session: int, *, proc: Path = _PROC) -> bool | None:
    """None while nothing listens on `port`; True when every socket listening on it belongs to `session`;
    False when another process holds one."""
    listening = listening_sockets(port, proc=proc)
    if not listening:
        return None
    return listening <= session_sockets(session, proc=proc)
