"""What an environment server checks before a request reaches its routes (docs/security.md): the job's
token on every route but `/health` (a kubelet's readiness probe cannot carry a Secret), and an HTTP
body's size. A pure ASGI middleware, so that a refused request is answered before FastAPI reads or parses
anything of it. WebSocket frames are bounded by uvicorn's `ws_max_size` (decompressed), set by serve().
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from rldock.runtime.agent.service.auth import authorized

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
# WebSocket close code of a handshake refused for its token (before accept: the client sees HTTP 403).
POLICY_VIOLATION = 1008


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _answer(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"detail": {"message": message, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """The token (None: none asked) and the body limit in front of `app`."""

    def __init__(self, app: ASGIApp, *, token: str | None, max_body_bytes: int):
        self.app, self.token, self.max_body_bytes = app, token, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if not self._admitted(scope):
            if kind == "websocket":
                await send({"type": "websocket.close", "code": POLICY_VIOLATION})
            else:
                await _answer(send, 401, "UNAUTHORIZED", "this server wants the job's token (Authorization: Bearer)")
            return None
        if kind == "websocket":
            return await self.app(scope, receive, send)
        return await self._bounded(scope, receive, send)

    def _admitted(self, scope: Scope) -> bool:
        """Whether the request may go on: no token asked, an open path, or the token given."""
        if self.token is None or scope["path"] in OPEN_PATHS:
            return True
        return authorized(_header(scope, b"authorization"), self.token)

    async def _bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body here, within the limit, then hand it to the app whole (a refused body is never
        passed on, and the app's own error handling cannot turn the refusal into a 500)."""
        limit = self.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _answer(send, 413, "BODY_TOO_LARGE", f"a body of at most {limit} bytes")
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _answer(send, 413, "BODY_TOO_LARGE", f"a body of at most {limit} bytes")
            chunks.append(chunk)
            more = message.get("more_body", False)
        whole: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return whole.pop() if whole else await receive()

        return await self.app(scope, replay, send)
