"""A small client of a Ray head's dashboard REST API (port 8265), on http.client, with bounded reads.

The operator image carries no Ray, so this speaks the endpoints it needs directly, as Ray's own
`JobSubmissionClient` does (ray/dashboard/modules/job/job_head.py):

    POST /api/jobs/              submit {entrypoint, submission_id, metadata}
    GET  /api/jobs/<id>          status, message, start_time (ms)
    POST /api/jobs/<id>/stop     SIGTERM, then SIGKILL, to the driver
    GET  /api/v0/logs/file?node_id=<driver node>&submission_id=<id>&lines=<n>
                                 the last n lines of the job's driver log (text)
    GET  /api/jobs/<id>/logs     {"logs": "..."}: the whole driver log, only as a fallback

The driver log: Ray 2.60's Jobs API `GET /api/jobs/<id>/logs` answers the whole log (no offset or
range; `/logs/tail` is a websocket that replays the log from the start and follows it). The state
API's log endpoint does read a tail: `GET /api/v0/logs/{file|stream}` with `submission_id` resolves
the job's driver node and `job-driver-<id>.log` (ray/dashboard/modules/state/state_head.py
`get_logs`, ray/dashboard/modules/log/log_manager.py `_resolve_job_filename`), and the driver
node's log agent sends only the last `lines` lines (ray/dashboard/modules/log/log_agent.py
`StreamLog`, default 1000). In 2.60 the request must also name a node: `GetLogOptions`
(ray/util/state/common.py) refuses one with neither node_id nor node_ip unless it names an actor
or a task, answering 500. The client sends the job's `driver_node_id`, which GET /api/jobs/<id>
answers once the driver runs (checked against a real 2.60 head: tests/integration/
test_ray_jobs_api.py reads progress through it). Byte offsets are only honoured there for task
logs, so a client cannot ask for "everything after byte N" of a driver log; the tail is the
smallest read Ray 2.60 offers.
The endpoint sits behind the same token middleware as the Jobs API
(ray/_private/authentication/http_token_authentication.py). The operator only needs the last
progress record, so it reads the last LOG_TAIL_LINES lines; progress_cursor.py then parses only
what changed. When the state endpoint cannot answer (the job has no driver node yet, or ended
before it started), the whole-log endpoint is read instead, under the same cap.

Every read is bounded, because the head runs the user's image and may answer anything:
- size: at most `max_bytes` (MAX_RESPONSE_BYTES, 1 MiB) of a body are kept. A log longer than
  that keeps its last `max_bytes` (from a line start), which is not a failure; any other answer
  longer than that is a RayJobsError.
- time: `timeout` is a total deadline per request (connect, headers and body together), enforced
  by a watchdog that shuts the socket, not only a timeout per socket read: a server that trickles
  bytes cannot hold a reconcile round longer than the deadline.

Ray 2.60 clusters run with token authentication (RAY_AUTH_MODE=token); every request carries
`Authorization: Bearer <token>` (ray/_private/authentication/authentication_constants.py).
Any transport failure or unexpected answer raises RayJobsError: the caller skips the round rather
than reading "no answer" as "no job". Each request is reported to an optional recorder
(metrics.Metrics.jobs_api_request) with its endpoint, duration and outcome.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol
from urllib.parse import quote, urlencode, urlsplit

log = logging.getLogger(__name__)

AUTHORIZATION_HEADER = "Authorization"
BEARER_PREFIX = "Bearer "
MAX_RESPONSE_BYTES = 1 << 20  # 1 MiB per response body
LOG_TAIL_LINES = 1000  # lines of the driver log read per poll (Ray's own default for this endpoint)
_CHUNK = 64 * 1024


class Outcome:
    """The `outcome` label of rldock_ray_jobs_api_request_duration_seconds."""

    OK = "ok"  # an answer the client understood (a 404 "no such job" included)
    HTTP_ERROR = "http_error"  # another status, or a body that is not what the endpoint answers
    AUTH_ERROR = "auth_error"  # 401/403: the head refused the token
    TOO_LARGE = "too_large"  # a body over max_bytes that is not a log
    TIMEOUT = "timeout"  # the total deadline passed
    UNREACHABLE = "unreachable"  # refused, reset, DNS


class Endpoint:
    """The `endpoint` label: one value per operation, not per URL (ids would explode the series)."""

    SUBMIT = "submit"
    GET_JOB = "get_job"
    STOP = "stop"
    LOG_TAIL = "log_tail"
    LOGS = "logs"


class RequestRecorder(Protocol):
    def jobs_api_request(self, *, endpoint: str, seconds: float, outcome: str) -> None: ...


class RayJobsError(RuntimeError):
    """The Jobs API did not answer, refused the token, or answered something unexpected."""


class TokenRefused(RayJobsError):
    """The head answered 401/403: it holds another token than the one this RLJob's is derived as."""


class _Failed(RayJobsError):
    def __init__(self, message: str, outcome: str) -> None:
        super().__init__(message)
        self.outcome = outcome


class RayJobsClient:
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None,
        timeout: float = 5.0,
        max_bytes: int = MAX_RESPONSE_BYTES,
        tail_lines: int = LOG_TAIL_LINES,
        metrics: RequestRecorder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout <= 0 or max_bytes <= 0 or tail_lines <= 0:
            raise ValueError(
                f"timeout, max_bytes and tail_lines must be positive, got {timeout}, {max_bytes}, {tail_lines}"
            )
        self.base_url = base_url.rstrip("/")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._https = parts.scheme == "https"
        self._host, self._port, self._prefix = parts.hostname, parts.port, parts.path
        self._token = token
        self._timeout = timeout
        self._max_bytes = max_bytes
        self._tail_lines = tail_lines
        self._metrics = metrics
        self._clock = clock
        self._driver_nodes: dict[str, str] = {}  # submission id -> driver_node_id, from get_job

    def get_job(self, submission_id: str) -> dict[str, Any] | None:
        """The job's details, or None when the cluster has no job with this id."""
        status, body, _ = self._request(
            Endpoint.GET_JOB, "GET", f"/api/jobs/{quote(submission_id, safe='')}", expect=(200, 404)
        )
        if status == 404:
            return None
        details = self._json(status, body, "get job")
        if details.get("driver_node_id"):
            self._driver_nodes[submission_id] = str(details["driver_node_id"])
        return details

    def submit_job(self, request: Mapping[str, Any]) -> str:
        """Submit; a job that already has this submission id counts as submitted (idempotent).

        Ray 2.60 answers a reused id with HTTP 500 and the job manager's ValueError traceback.
        """
        status, body, _ = self._request(
            Endpoint.SUBMIT,
            "POST",
            "/api/jobs/",
            request,
            expect=(200, 400, 500),
            accept=lambda s, b: s == 200 or "already exists" in b,
        )
        if status in (400, 500) and "already exists" in body:
            return str(request["submission_id"])
        return str(self._json(status, body, "submit job")["submission_id"])

    def stop_job(self, submission_id: str) -> bool:
        """Ask the driver to stop; False when there is no such job."""
        status, body, _ = self._request(
            Endpoint.STOP, "POST", f"/api/jobs/{quote(submission_id, safe='')}/stop", expect=(200, 404)
        )
        if status == 404:
            return False
        return bool(self._json(status, body, "stop job").get("stopped", True))

    def get_logs(self, submission_id: str) -> str:
        """The end of the job's driver log: its last `tail_lines` lines and at most `max_bytes`,
        starting at a line start; "" when the cluster has no such job. The tail needs the job's
        driver node: from this client's last `get_job` of the job, else from one made here."""
        if submission_id not in self._driver_nodes:
            self.get_job(submission_id)
        node = self._driver_nodes.get(submission_id)
        if node is not None:
            query = urlencode(
                {
                    "node_id": node,
                    "submission_id": submission_id,
                    "lines": self._tail_lines,
                    "timeout": max(1, int(self._timeout)),
                }
            )
            status, body, _ = self._request(
                Endpoint.LOG_TAIL, "GET", f"/api/v0/logs/file?{query}", expect=(200,), keep_tail=True
            )
            if status == 200:
                return body
            log.debug(
                "log tail of %s unavailable (HTTP %s: %s); reading the whole log", submission_id, status, body[:200]
            )
        # No driver node (a job whose driver never started, or no such job), or a state API that
        # cannot answer: the Jobs API's whole log, under the same cap.
        status, body, cut = self._request(
            Endpoint.LOGS, "GET", f"/api/jobs/{quote(submission_id, safe='')}/logs", expect=(200, 404), keep_tail=True
        )
        if status == 404:
            return ""
        return _logs_from_json(body, truncated=cut, what=f"logs at {self.base_url}")

    # ----------------------------------------------------------------------------------------

    def _request(
        self,
        endpoint: str,
        method: str,
        path: str,
        payload: Any = None,
        *,
        expect: tuple[int, ...],
        accept: Callable[[int, str], bool] | None = None,
        keep_tail: bool = False,
    ) -> tuple[int, str, bool]:
        """(status, body, cut) of one request, the body cut to its last `max_bytes` when `keep_tail`
        (a text body then starts at a line start). The request is recorded with its outcome:
        ok when the status is in `expect` and `accept`, if given, takes the answer."""
        started = self._clock()
        try:
            status, body, truncated = self._exchange(method, path, payload, keep_tail=keep_tail)
        except _Failed as failed:
            self._record(endpoint, started, failed.outcome)
            raise RayJobsError(f"{method} {self.base_url}{path}: {failed}") from None
        if status in (401, 403):
            self._record(endpoint, started, Outcome.AUTH_ERROR)
            raise TokenRefused(
                f"{method} {self.base_url}{path}: {status}, the Ray cluster refused the auth token: {body[:200]}"
            )
        ok = status in expect and (accept is None or accept(status, body))
        self._record(endpoint, started, Outcome.OK if ok else Outcome.HTTP_ERROR)
        return status, body, truncated

    def _record(self, endpoint: str, started: float, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.jobs_api_request(endpoint=endpoint, seconds=self._clock() - started, outcome=outcome)

    def _exchange(self, method: str, path: str, payload: Any, *, keep_tail: bool) -> tuple[int, str, bool]:
        headers = {"Accept": "application/json"}
        if self._token:
            headers[AUTHORIZATION_HEADER] = BEARER_PREFIX + self._token
        data = None
        if payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        connection_type = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        connection = connection_type(self._host, self._port, timeout=self._timeout)
        expired = threading.Event()

        def expire() -> None:  # the total deadline: wake any blocked connect, send or recv
            expired.set()
            sock = connection.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(self._timeout, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.request(method, self._prefix + path, body=data, headers=headers)
            response = connection.getresponse()
            body, truncated = self._read(response, keep_tail=keep_tail, expired=expired)
            return response.status, body, truncated
        except _Failed:
            raise
        except (http.client.HTTPException, OSError) as error:  # refused, reset, timed out, DNS
            if expired.is_set() or isinstance(error, socket.timeout):
                raise _Failed(f"no complete answer within {self._timeout:g} s", Outcome.TIMEOUT) from None
            raise _Failed(str(error) or type(error).__name__, Outcome.UNREACHABLE) from None
        finally:
            watchdog.cancel()
            connection.close()

    def _read(
        self, response: http.client.HTTPResponse, *, keep_tail: bool, expired: threading.Event
    ) -> tuple[str, bool]:
        kept = bytearray()
        truncated = False
        while True:
            chunk = response.read1(_CHUNK)  # at most one recv: the watchdog's shutdown ends it
            if expired.is_set():
                raise _Failed(f"no complete answer within {self._timeout:g} s", Outcome.TIMEOUT)
            if not chunk:
                break
            kept += chunk
            if len(kept) > self._max_bytes:
                if not keep_tail:
                    raise _Failed(f"answer larger than {self._max_bytes} bytes", Outcome.TOO_LARGE)
                del kept[: len(kept) - self._max_bytes]
                truncated = True
        text = kept.decode(errors="replace")
        if truncated and response.status == 200 and "json" not in (response.getheader("Content-Type") or ""):
            text = _from_second_line(text)
        return text, truncated

    def _json(self, status: int, body: str, what: str) -> dict[str, Any]:
        if status != 200:
            raise RayJobsError(f"{what} at {self.base_url}: HTTP {status}: {body[-300:]}")
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            raise RayJobsError(f"{what} at {self.base_url}: not JSON: {body[:200]}") from None
        if not isinstance(value, dict):
            raise RayJobsError(f"{what} at {self.base_url}: expected an object, got {body[:200]}")
        return value


# Characters that can be part of a JSON string escape (\" \\ \/ \b \f \n \r \t \uXXXX).
_ESCAPE_CHARACTERS = frozenset('"\\/bfnrtu0123456789abcdefABCDEF')
_LONGEST_ESCAPE = 6  # \uXXXX


def _logs_from_json(body: str, *, truncated: bool, what: str) -> str:
    """The "logs" string of a Jobs API answer; of an answer cut to its end (`truncated`), the end
    of the string from its first whole line (a cut JSON string is decoded from the first character
    that cannot be inside an escape)."""
    if not truncated:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            raise RayJobsError(f"{what}: not JSON: {body[:200]}") from None
        if not isinstance(value, dict):
            raise RayJobsError(f"{what}: expected an object, got {body[:200]}")
        return str(value.get("logs") or "")
    end = body.rstrip().rstrip("}").rstrip()
    if not end.endswith('"'):
        raise RayJobsError(f"{what}: the end of the answer is not the end of the logs string: {body[-200:]}")
    # A literal character (outside the escape alphabet) ends whatever came before it; without one
    # (a run of escapes), the first offsets are tried: only a start on an escape's first character
    # decodes, except inside the first line, which is dropped anyway.
    safe = next((i + 1 for i, c in enumerate(end[:-1]) if c not in _ESCAPE_CHARACTERS), None)
    for start in [*([safe] if safe is not None else []), *range(_LONGEST_ESCAPE)]:
        try:
            text = json.loads('"' + end[start:])
            break
        except json.JSONDecodeError:
            continue
    else:
        raise RayJobsError(f"{what}: the end of the answer is not a JSON string: {body[-200:]}")
    return _from_second_line(text)


def _from_second_line(text: str) -> str:
    """A text whose first line was cut, without it (nothing when it has one line only)."""
    newline = text.find("\n")
    return text[newline + 1 :] if newline >= 0 else ""
