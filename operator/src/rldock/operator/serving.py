"""The operator's HTTP endpoints, served by one small module: the admission webhook (admission.py,
over TLS) and the metrics and health probes (metrics.py) are each a table of routes that a `Server`
serves in a daemon thread.

A route answers a `Request` (method, path, body) with a `Reply`; an unknown path is answered 404,
a known one asked with another method 405. One request per connection (HTTP/1.0), so the bounds of
a connection bound its request. A POST's body is read whole before any answer but 411 (no
Content-Length) and 413 (over `max_body_bytes`): a socket closed with unread data is reset, and the
reset can overtake the answer.

With a `Certificate`, what is read comes from whoever can reach the port, so each connection is
bounded: its TLS handshake runs in its own thread (in `accept` it would stall every other client),
one total deadline covers the handshake, the headers and the body, and at most `max_connections`
are served at once (more are closed at once; the API server retries).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Request:
    method: str  # GET or POST
    path: str  # without the query
    body: bytes = b""


class Reply(NamedTuple):
    code: int
    body: bytes
    content_type: str = TEXT


Route = Callable[[Request], Reply]
Routes = Mapping[tuple[str, str], Route]  # (method, path) -> route


class Certificate:
    """The TLS context of a certificate and key file pair, loaded at start (bad files fail it) and
    again whenever either file changes, so a rotated certificate (the kubelet updates a mounted
    Secret in place) is served without a restart."""

    def __init__(self, cert_file: str, key_file: str, *, what: str) -> None:
        self._files, self._what = (cert_file, key_file), what
        self._lock = threading.Lock()
        self._stamp: tuple[tuple[int, int, int], ...] | None = self._read_stamp()
        self._context = self._load()

    def _read_stamp(self) -> tuple[tuple[int, int, int], ...]:
        # A mounted Secret's files are links into a folder the kubelet swaps: stat follows them.
        return tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in map(os.stat, self._files))

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(*self._files)
        return context

    def context(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = self._read_stamp()
                if stamp != self._stamp:
                    self._context, self._stamp = self._load(), stamp
                    log.info("%s: serving the certificate %s as changed", self._what, self._files[0])
            except (OSError, ssl.SSLError) as error:  # e.g. a key that does not match yet
                log.warning(
                    "%s: cannot load %s and %s (%s); serving the previous certificate", self._what, *self._files, error
                )
            return self._context


@dataclass(frozen=True)
class Bounds:
    """What one connection of a TLS server may hold."""

    deadline_s: float  # the handshake, the headers and the body together
    max_connections: int  # served at once


class Server:
    """`routes` on `host:port` (0: any free port, see `.port`), in a daemon thread named `name`;
    over TLS with `certificate`, each connection within `bounds`. `what` names the server in logs;
    `log_requests` logs each request at debug level (probes every few seconds are not logged)."""

    def __init__(
        self,
        routes: Routes,
        *,
        name: str,
        what: str,
        port: int,
        host: str = "0.0.0.0",
        max_body_bytes: int = 0,
        certificate: Certificate | None = None,
        bounds: Bounds | None = None,
        log_requests: bool = False,
    ) -> None:
        handler = _handler(routes, max_body_bytes=max_body_bytes, what=what if log_requests else None)
        if certificate is not None:
            assert bounds is not None, "a TLS server's connections are bounded"
            self._server: ThreadingHTTPServer = _TLSServer((host, port), handler, certificate, bounds, what=what)
        else:
            self._server = ThreadingHTTPServer((host, port), handler)
            self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def in_flight(self) -> int:
        """Connections a TLS server holds now (their slots taken); 0 for a plain one, which does not
        count them."""
        return self._server.in_flight() if isinstance(self._server, _TLSServer) else 0

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _TLSServer(ThreadingHTTPServer):
    """Each accepted connection's TLS handshake runs in its own thread, under a deadline that closes
    the connection wherever it stands."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        certificate: Certificate,
        bounds: Bounds,
        *,
        what: str,
    ) -> None:
        super().__init__(address, handler)
        self.certificate, self.bounds, self.what = certificate, bounds, what
        self._slots = threading.BoundedSemaphore(bounds.max_connections)

    def in_flight(self) -> int:
        return self.bounds.max_connections - self._slots._value  # a semaphore has no public count

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            log.warning(
                "%s: %d connections in flight; closing one from %s",
                self.what,
                self.bounds.max_connections,
                client_address[0],
            )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:  # a TCP server's request is its socket
        request.settimeout(self.bounds.deadline_s)
        connection = [request]  # what the deadline shuts down: the raw socket, then its TLS wrapper
        # socket.socket.shutdown, not SSLSocket.shutdown: the handler's thread may be reading, and
        # only the descriptor is shut (its read returns at once), the TLS state left to that thread.
        timer = threading.Timer(self.bounds.deadline_s, _shut, args=(connection,))
        timer.daemon = True
        timer.start()
        try:
            try:
                tls = self.certificate.context().wrap_socket(request, server_side=True)
            except (OSError, ValueError) as error:  # a failed handshake closes the socket
                log.debug("%s: TLS handshake with %s failed: %s", self.what, client_address[0], error)
                return
            connection[0] = tls
            try:
                self.RequestHandlerClass(tls, client_address, self)  # type: ignore[arg-type]  # typeshed's Self
            finally:
                tls.close()
        finally:
            timer.cancel()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away or ran past the deadline: not the operator's error.
        log.debug("%s: connection from %s ended badly", self.what, client_address[0], exc_info=True)


def _shut(connection: list[socket.socket]) -> None:
    with contextlib.suppress(OSError):  # already closed
        socket.socket.shutdown(connection[0], socket.SHUT_RDWR)


def _handler(routes: Routes, *, max_body_bytes: int, what: str | None) -> type[BaseHTTPRequestHandler]:
    paths = {path for _, path in routes}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            if what is not None:
                log.debug("%s: %s " + format, what, self.address_string(), *args)

        def _reply(self, reply: Reply) -> None:
            self.send_response(reply.code)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)

        def _answer(self, request: Request) -> None:
            route = routes.get((request.method, request.path))
            if route is not None:
                self._reply(route(request))
            elif request.path in paths:
                allowed = " or ".join(sorted(method for method, path in routes if path == request.path))
                self._reply(Reply(405, f"{allowed} only\n".encode()))
            else:
                self._reply(Reply(404, b"not found\n"))

        def do_GET(self) -> None:
            self._answer(Request("GET", self.path.split("?", 1)[0]))

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._reply(Reply(411, b"Content-Length required\n"))
                return
            if not 0 <= length <= max_body_bytes:
                self._reply(Reply(413, f"at most {max_body_bytes} bytes\n".encode()))
                return
            body = self.rfile.read(length)
            if len(body) < length:  # the client closed, or the deadline shut the connection
                return
            self._answer(Request("POST", self.path.split("?", 1)[0], body))

    return Handler
