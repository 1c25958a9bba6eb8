"""Calls to the controller host from its own node, over a Unix socket beside its shared memory.

A Ray actor call has a fixed latency, whatever it carries: 1.3-2.1 ms for a call that does nothing
on this 2-core machine (the caller's core worker, the raylet's queues, the callee's event loop and
back). A tiny iteration makes about twenty calls to the controllers (a request and a readiness per
stage and rank, the reset, the policy version), so that latency was most of its dispatch
(docs/transfer-dock.md, "Local calls"). A process on the host's node reaches the same controllers
through a Unix socket the host serves from its own event loop: about 0.1 ms a call. The same
coroutines run on the same loop either way, so a call over the socket and one through Ray see the
same controller state, in the order they arrive; a request that waits holds its connection, not
one of the host's Ray calls. Processes on other nodes keep calling through Ray.

Who can connect: the socket is a file in the host's shared-memory directory (mode 0700,
shared_columns.py) with mode 0600, so only processes of the same user on the same node (in
Kubernetes, the same pod) reach it, and those can already read and write the dock's rows in place.
A request names one of the host's calls in `CALLS`; nothing else of the host is reachable. Messages
are pickles, which is acceptable only because of who can connect: this protocol must never listen
on a network port.

Framing: an 8-byte little-endian length, then a pickle. A request is (call, args, kwargs); a reply
(True, result) or (False, the exception the call raised). A client keeps one connection per
thread (the device worker's seats call the dock from threads of one process) and per process (a
forked child opens its own).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import select
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rldock.runtime.dock import rpc
from rldock.runtime.dock.errors import DockActorDiedError, DockTimeoutError
from rldock.runtime.dock.rpc import Peer

SOCKET_NAME = "controllers.sock"
# The host's calls a local client may make (the route's; the rest of the host stays Ray's).
CALLS = frozenset(
    {
        "write",
        "request_and_read",
        "write_and_request",
        "reset",
        "recycle",
        "hand_back",
        "advance_policy",
        "snapshot",
        "restore",
        "stats",
        "warehouse",
    }
)
_LENGTH = struct.Struct("<Q")


def _frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def _reply(result: Any = None, error: BaseException | None = None) -> bytes:
    if error is None:
        return _frame((True, result))
    try:
        return _frame((False, error))
    except Exception:  # an exception that does not pickle still reaches the caller, as its text
        return _frame((False, RuntimeError(f"{type(error).__name__}: {error}")))


async def serve(path: str, calls: Mapping[str, Callable[..., Awaitable[Any]]]) -> asyncio.AbstractServer:
    """Listen at `path` (mode 0600) on the running event loop, answering requests with `calls`."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                    call, args, kwargs = pickle.loads(await reader.readexactly(length))
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client closed its connection (or its process ended)
                try:
                    if call not in calls:
                        raise ValueError(f"the dock controller host has no local call {call!r}; calls: {sorted(calls)}")
                    reply = _reply(await calls[call](*args, **kwargs))
                except Exception as err:  # the caller's to raise, as a Ray call would have
                    reply = _reply(error=err)
                writer.write(reply)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):  # the client went, or the host's loop is ending
            return
        finally:
            writer.close()

    server = await asyncio.start_unix_server(answer, path=path)
    os.chmod(path, 0o600)
    return server


class LocalHost:
    """The controller host as reached over its socket at `path` (a picklable description: each
    process and thread connects on its first call). `peer` names the host in errors."""

    def __init__(self, path: str, peer: Peer) -> None:
        self.path = path
        self.peer = peer

    def call(
        self, call: str, *args: Any, timeout: float | None = None, watch: Sequence[Peer] = (), **kwargs: Any
    ) -> Any:
        """The result of the host's `call(*args, **kwargs)`, or the exception it raised, raised here.

        With `watch`, the peers are checked for being alive every rpc.HEALTH_INTERVAL_S while the
        answer takes (a request waiting for samples); after `timeout` seconds it raises
        DockTimeoutError. A host that has died raises DockActorDiedError naming it."""
        connection = _connect(self.path, self.peer)
        try:
            connection.sendall(_frame((call, args, kwargs)))
            _wait_readable(connection, self.peer, timeout=timeout, watch=watch)
            ok, result = _read_reply(connection)
        except (DockTimeoutError, DockActorDiedError):  # no answer in time, a dead peer: a reply may still come
            _disconnect(self.path)
            raise
        except (OSError, EOFError) as err:  # (after the timeout: a TimeoutError is an OSError)
            _disconnect(self.path)
            raise rpc.died(self.peer.name, f"its local socket closed: {type(err).__name__}: {err}") from None
        except BaseException:  # an interrupt: start over on a new connection too
            _disconnect(self.path)
            raise
        if not ok:
            raise result
        return result


def _wait_readable(connection: socket.socket, peer: Peer, *, timeout: float | None, watch: Sequence[Peer]) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        interval = rpc.HEALTH_INTERVAL_S if watch else None
        if deadline is not None:
            left = max(0.0, deadline - time.monotonic())
            interval = left if interval is None else min(interval, left)
        readable, _, _ = select.select([connection], [], [], interval)
        if readable:
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise rpc.unanswered(peer.name, timeout or 0.0)
        rpc.check_alive(watch)


def _read_reply(connection: socket.socket) -> tuple[bool, Any]:
    (length,) = _LENGTH.unpack(_read_exactly(connection, _LENGTH.size))
    return pickle.loads(_read_exactly(connection, length))


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = connection.recv_into(view[got:])
        if n == 0:
            raise EOFError("the host closed the connection")
        got += n
    return bytes(buffer)


# This thread's connections by socket path, with the pid that opened them.
_CONNECTIONS = threading.local()


def _connections() -> dict[str, tuple[int, socket.socket]]:
    if not hasattr(_CONNECTIONS, "by_path"):
        _CONNECTIONS.by_path = {}
    return _CONNECTIONS.by_path


def _connect(path: str, peer: Peer) -> socket.socket:
    connections = _connections()
    held = connections.get(path)
    if held is not None and held[0] == os.getpid():
        return held[1]
    for gone in [p for p in connections if not Path(p).exists()]:  # docks shut down since
        _disconnect(gone)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError as err:
        connection.close()
        raise rpc.died(peer.name, f"its local socket {path} does not answer: {type(err).__name__}: {err}") from None
    connections[path] = (os.getpid(), connection)
    return connection


def _disconnect(path: str) -> None:
    pid, connection = _connections().pop(path, (None, None))
    if connection is not None and pid == os.getpid():
        connection.close()
