"""The gateway's HTTP connections, each held only while it is used: a cap on how many are open, deadlines for
a request's head and body, and the reading of a body with a size and a time limit.

uvicorn (h11) closes a keep-alive connection left idle between requests (`KEEP_ALIVE_S`) and refuses a
request head past `MAX_HEADER_BYTES`, but it holds for good a connection that never completes a request's
head, or that trickles its body, and it opens as many connections as the kernel hands it: idle connections
that never authenticate would use up the actor's file descriptors. `guarded_protocol` adds what it lacks:

- a cap: a connection past `max_connections` open is answered 503 (`Connection: close`) and closed as soon
  as it is accepted, before it sends anything (an OpenAI client retries a 503);
- a head deadline: a connection waiting for a request (a new one, or one whose last answer went out) whose
  request head is not in within `header_timeout_s` is closed;
- a body deadline: the rest of a body the route answered without reading (a 401 before the body, say) must be
  in within `body_timeout_s` of the answer, or the connection is closed. A body a route reads is read by
  `read_body`, all of it within `body_timeout_s` or refused 408.

A request whose head is in and whose route is working on it (waiting for its episode's lock, or for the
engine's turn) is the route's: it is held as long as its turn takes.

The protocol is h11's, not httptools' (uvicorn's choice when it is installed, as it is in the image): uvicorn
bounds a request head under h11 only; under httptools a 4 MiB header was read whole and answered.

Each connection also gets TCP_NODELAY. asyncio sets it only on sockets whose protocol number says TCP, and
the gateway's listening socket (`socket.create_server`) says 0, so its connections kept Nagle's algorithm:
uvicorn writes an answer's head and body apart, and the body waited for the client's delayed ACK, about
45 ms on every request here (a harness's every turn).
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import socket
import time
from typing import Any, ClassVar

import h11
from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 4096  # connections open at once (at most half the process's descriptors; `connection_cap`)
HEADER_TIMEOUT_S = 10.0  # from a connection's start, or its last answer, to a whole request head
BODY_TIMEOUT_S = 30.0  # from a request's head to the last byte of its body
KEEP_ALIVE_S = 5  # an idle connection between requests (uvicorn's own default, stated here)
MAX_HEADER_BYTES = 16 << 10  # a request's head (h11's own default, stated here)

_REFUSED_TEXT = b"the gateway has too many connections open"
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_REFUSED_TEXT), _REFUSED_TEXT)
)


def connection_cap(limit: int = MAX_CONNECTIONS) -> int:
    """`limit`, or half the process's open-file limit where that is lower: connections never take the
    descriptors the rest of the actor needs (its files, Ray's sockets)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return limit if soft == resource.RLIM_INFINITY else max(1, min(limit, soft // 2))


def guarded_protocol(*, max_connections: int, header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the module's cap and deadlines (`uvicorn.Config(http=...)`)."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"max_connections": max_connections, "header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )


class GuardedH11Protocol(H11Protocol):
    """One connection; the limits are class attributes (`guarded_protocol` makes a class with them)."""

    max_connections: ClassVar[int] = MAX_CONNECTIONS
    header_timeout_s: ClassVar[float] = HEADER_TIMEOUT_S
    body_timeout_s: ClassVar[float] = BODY_TIMEOUT_S
    refused: ClassVar[int] = 0  # connections refused at the cap, logged at most once a minute
    _logged_at: ClassVar[float] = -math.inf

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting: str | None = None  # what the armed deadline waits for: "head" or "rest of body"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        full = len(self.connections) >= self.max_connections
        super().connection_made(transport)
        if full:
            cls = type(self)
            cls.refused += 1
            if time.monotonic() - cls._logged_at > 60:
                cls._logged_at = time.monotonic()
                logger.warning(
                    "gateway: %d connections open, its limit: new ones refused (%d so far)",
                    self.max_connections,
                    cls.refused,
                )
            transport.write(_REFUSED)
            transport.close()
            return
        connection = transport.get_extra_info("socket")
        if connection is not None and connection.family in (socket.AF_INET, socket.AF_INET6):
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def _watch(self) -> None:
        """Arm the deadline of what the connection waits for from the client, if anything: a request's head
        (h11's IDLE), or the rest of a body answered without it (their SEND_BODY once ours is DONE)."""
        if self.transport.is_closing():
            self._disarm()
            return
        theirs, ours = self.conn.their_state, self.conn.our_state
        if theirs is h11.IDLE:
            awaiting, timeout_s = "head", self.header_timeout_s
        elif theirs is h11.SEND_BODY and ours is h11.DONE:
            awaiting, timeout_s = "rest of body", self.body_timeout_s
        else:  # a request being answered, or closing: the route's
            self._disarm()
            return
        if self._awaiting != awaiting:
            self._disarm()
            self._awaiting = awaiting
            self._deadline = self.loop.call_later(timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._awaiting = None, None

    def _expired(self) -> None:
        logger.info("gateway: a connection's request %s did not arrive in time; closed", self._awaiting)
        self._deadline, self._awaiting = None, None
        if not self.transport.is_closing():
            self.transport.close()


class BodyUnread(Exception):
    """A body `read_body` would not take: too slow, or its client gone (BodyTooLarge: past its size); `status`
    the answer."""

    def __init__(self, message: str, *, status: int):
        super().__init__(message)
        self.status = status


class BodyTooLarge(BodyUnread):
    def __init__(self, message: str):
        super().__init__(message, status=400)


async def read_body(request: Request, *, limit: int, timeout_s: float) -> bytes:
    """The request's body: at most `limit` bytes (a declared length past it refused before any byte is read),
    all of it within `timeout_s`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the body is {declared} bytes, past the limit of {limit}")
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > limit:
                    raise BodyTooLarge(f"the body is past the limit of {limit} bytes")
    except TimeoutError as error:
        raise BodyUnread(f"the body did not arrive within {timeout_s:g} s", status=408) from error
    except ClientDisconnect as error:
        raise BodyUnread("the client went away before its body arrived", status=400) from error
    return bytes(raw)
