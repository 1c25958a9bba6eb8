"""A small client of the Ray Jobs REST API (the head's dashboard, port 8265), on urllib.

The operator image carries no Ray, so this speaks the four endpoints it needs directly, as Ray's
own `JobSubmissionClient` does (ray/dashboard/modules/job/job_head.py):

    POST /api/jobs/              submit {entrypoint, submission_id, metadata}
    GET  /api/jobs/<id>          status, message, start_time (ms)
    GET  /api/jobs/<id>/logs     {"logs": "..."} the driver's whole log so far (Ray 2.60 has no
                                 offset or range; `/logs/tail` is a websocket that replays the log
                                 and follows it): the reconciler parses only what is new
                                 (progress_cursor.py), the transfer stays whole
    POST /api/jobs/<id>/stop     SIGTERM, then SIGKILL, to the driver

Ray 2.60 clusters run with token authentication (RAY_AUTH_MODE=token); every request carries
`Authorization: Bearer <token>` (ray/_private/authentication/authentication_constants.py).
Any transport failure or unexpected answer raises RayJobsError: the caller skips the round rather
than reading "no answer" as "no job".
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any, Mapping, Optional
from urllib.parse import quote

log = logging.getLogger(__name__)

AUTHORIZATION_HEADER = "Authorization"
BEARER_PREFIX = "Bearer "


class RayJobsError(RuntimeError):
    """The Jobs API did not answer, refused the token, or answered something unexpected."""


class RayJobsClient:
    def __init__(self, base_url: str, *, token: Optional[str], timeout: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._timeout = timeout

    def get_job(self, submission_id: str) -> Optional[dict[str, Any]]:
        """The job's details, or None when the cluster has no job with this id."""
        status, body = self._request("GET", f"/api/jobs/{quote(submission_id, safe='')}")
        if status == 404:
            return None
        return self._json(status, body, "get job")

    def submit_job(self, request: Mapping[str, Any]) -> str:
        """Submit; a job that already has this submission id counts as submitted (idempotent).

        Ray 2.60 answers a reused id with HTTP 500 and the job manager's ValueError traceback.
        """
        status, body = self._request("POST", "/api/jobs/", request)
        if status in (400, 500) and "already exists" in body:
            return str(request["submission_id"])
        return str(self._json(status, body, "submit job")["submission_id"])

    def stop_job(self, submission_id: str) -> bool:
        """Ask the driver to stop; False when there is no such job."""
        status, body = self._request("POST", f"/api/jobs/{quote(submission_id, safe='')}/stop")
        if status == 404:
            return False
        return bool(self._json(status, body, "stop job").get("stopped", True))

    def get_logs(self, submission_id: str) -> str:
        status, body = self._request("GET", f"/api/jobs/{quote(submission_id, safe='')}/logs")
        if status == 404:
            return ""
        return str(self._json(status, body, "get logs").get("logs") or "")

    # ----------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, payload: Any = None) -> tuple[int, str]:
        headers = {"Accept": "application/json"}
        if self._token:
            headers[AUTHORIZATION_HEADER] = BEARER_PREFIX + self._token
        data = None
        if payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as response:
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as error:
            body = error.read().decode(errors="replace")
            if error.code in (401, 403):
                raise RayJobsError(f"{method} {self.base_url}{path}: {error.code}, the Ray cluster refused "
                                   f"the auth token: {body[:200]}") from None
            return error.code, body
        except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out, DNS
            raise RayJobsError(f"{method} {self.base_url}{path}: {error}") from None

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
