"""RayJobsDouble: a TEST DOUBLE of Ray heads' Jobs API (the dashboard's REST endpoints).

A real Ray head costs ~10 s and ~1.5 GB here; operator tests only need what the operator talks to.
Each fake head is an HTTP server on the pod's own loopback IP (KubeletDouble hands one to each pod)
and the dashboard port, serving, as Ray 2.60 does (ray/dashboard/modules/job/job_head.py):

    POST /api/jobs/            -> {"submission_id", "job_id"}; 500 "... already exists" on a reused id
    GET  /api/jobs/<id>        -> {"status", "message", "start_time", "end_time", ...}; 404 unknown
    GET  /api/jobs/<id>/logs   -> {"logs": "..."}
    POST /api/jobs/<id>/stop   -> {"stopped": bool}
    GET  /api/v0/logs/file?node_id=<node>&submission_id=<id>&lines=<n>
                               -> the last n lines of the driver log (text/plain); 500 with the
                                  reason without a node_id or node_ip, or while the job has no
                                  driver (unknown or PENDING), as the state API's log endpoint
                                  (ray/dashboard/modules/state/state_head.py, GetLogOptions)

With token auth (the head pod's RAY_AUTH_MODE=token and RAY_AUTH_TOKEN), a request without
`Authorization: Bearer <token>` gets 401 and a wrong token 403, like Ray's middleware. A submitted
job is PENDING, then RUNNING `start_delay` seconds later (its driver started); the test writes its
log lines and ends it. A head's jobs vanish with its pod, as a real head's job table does without
GCS fault tolerance.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# The head's node id (hex, as Ray's): every fake job's driver runs on its head.
DRIVER_NODE_ID = "d8dd83b288d876975071a6b58cba519e18a087a142a359490576e9c4"


@dataclass
class FakeJob:
    submission_id: str
    entrypoint: str
    metadata: dict[str, str]
    submitted: float
    status: str = "PENDING"
    message: str = "Job has not started yet."
    start_time: int | None = None  # ms since the epoch, as Ray reports it
    end_time: int | None = None
    logs: list[str] = field(default_factory=list)
    stop_requests: int = 0

    def details(self) -> dict[str, Any]:
        return {
            "type": "SUBMISSION",
            "job_id": None,
            "submission_id": self.submission_id,
            "status": self.status,
            "message": self.message,
            "entrypoint": self.entrypoint,
            "metadata": self.metadata,
            "start_time": self.start_time,
            "end_time": self.end_time,
            "driver_node_id": DRIVER_NODE_ID if self.start_time is not None else None,
        }


class FakeHead:
    """One Ray head's Jobs API."""

    def __init__(self, *, cluster: str, ip: str, port: int, token: str | None, start_delay: float) -> None:
        self.cluster, self.ip, self.port, self.token = cluster, ip, port, token
        self.start_delay = start_delay
        self.jobs: dict[str, FakeJob] = {}
        self.lock = threading.Lock()
        self.unauthorized = 0
        self.log_reads = {"tail": 0, "whole": 0}  # driver log requests, by endpoint
        self._server = ThreadingHTTPServer((ip, port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"ray-head-{cluster}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def job(self, submission_id: str) -> FakeJob | None:
        with self.lock:
            job = self.jobs.get(submission_id)
            if job is not None and job.status == "PENDING" and time.time() - job.submitted >= self.start_delay:
                job.status, job.message = "RUNNING", "Job is currently running."
                job.start_time = int(time.time() * 1000)
            return job


def _handler_for(head: FakeHead) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read the log
            log.debug("%s %s", head.cluster, format % args)

        def _reply(self, code: int, body: Any) -> None:
            data = (json.dumps(body) if not isinstance(body, str) else body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if head.token is None:
                return True
            header = self.headers.get("Authorization") or self.headers.get("X-Ray-Authorization") or ""
            if not header:
                head.unauthorized += 1
                self._reply(401, "Unauthorized: Missing authentication token")
                return False
            if header != f"Bearer {head.token}":
                head.unauthorized += 1
                self._reply(403, "Forbidden: Invalid authentication token")
                return False
            return True

        def _route(self) -> tuple[str | None, str]:
            parts = [p for p in self.path.split("?")[0].split("/") if p]  # api, jobs, <id>, [logs|stop]
            if parts[:2] != ["api", "jobs"]:
                return None, ""
            return (parts[2] if len(parts) > 2 else None), (parts[3] if len(parts) > 3 else "")

        def _log_tail(self) -> None:
            query = parse_qs(urlsplit(self.path).query)
            submission_id = (query.get("submission_id") or [""])[0]
            lines = int((query.get("lines") or ["1000"])[0])
            if not (query.get("node_id") or query.get("node_ip")):
                self._reply(500, "500 Internal Server Error\n\nServer got itself in trouble")
                return
            job = head.job(submission_id)
            if job is None or job.status == "PENDING":
                self._reply(500, f"Could not find a log file.\n\tsubmission_id: {submission_id}\n")
                return
            with head.lock:
                head.log_reads["tail"] += 1
                tail = job.logs if lines == -1 else job.logs[-lines:]
                self._reply(200, "".join(line + "\n" for line in tail))

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if urlsplit(self.path).path == "/api/v0/logs/file":
                self._log_tail()
                return
            submission_id, action = self._route()
            job = head.job(submission_id) if submission_id else None
            if job is None:
                self._reply(404, f"Job {submission_id} does not exist")
            elif action == "logs":
                with head.lock:
                    head.log_reads["whole"] += 1
                    self._reply(200, {"logs": "".join(line + "\n" for line in job.logs)})
            else:
                with head.lock:
                    self._reply(200, job.details())

        def do_POST(self) -> None:
            if not self._authorized():
                return
            submission_id, action = self._route()
            length = int(self.headers.get("Content-Length") or 0)
            payload = json.loads(self.rfile.read(length) or b"{}")
            if submission_id is None:
                self._submit(payload)
                return
            job = head.job(submission_id)
            if job is None or action != "stop":
                self._reply(404, f"Job {submission_id} does not exist")
                return
            with head.lock:
                job.stop_requests += 1
                stopped = job.status not in TERMINAL
                if stopped:
                    job.status, job.message = "STOPPED", "Job was intentionally stopped."
                    job.end_time = int(time.time() * 1000)
            self._reply(200, {"stopped": stopped})

        def _submit(self, payload: Mapping[str, Any]) -> None:
            submission_id = payload.get("submission_id") or f"raysubmit_{len(head.jobs)}"
            with head.lock:
                if submission_id in head.jobs:
                    # Ray 2.60 wraps the job manager's ValueError into a 500 with its traceback.
                    self._reply(
                        500,
                        f"Traceback (most recent call last):\nValueError: Job with submission_id "
                        f"{submission_id} already exists. Please use a different submission_id.\n",
                    )
                    return
                head.jobs[submission_id] = FakeJob(
                    submission_id=submission_id,
                    entrypoint=payload["entrypoint"],
                    metadata=dict(payload.get("metadata") or {}),
                    submitted=time.time(),
                )
            self._reply(200, {"submission_id": submission_id, "job_id": None})

    return Handler


class RayJobsDouble:
    """The fake heads of all RayClusters; plug `start_head`/`stop_head` into KubeletDouble."""

    def __init__(self, *, port: int, start_delay: float = 0.3) -> None:
        self.port = port
        self.start_delay = start_delay
        self.heads: dict[str, FakeHead] = {}  # by pod name
        self._lock = threading.Lock()

    # --- KubeletDouble hooks -------------------------------------------------------------------
    def on_start(self, pod: Mapping[str, Any], ip: str, env: Mapping[str, str]) -> None:
        labels = pod["metadata"].get("labels") or {}
        if labels.get("ray.io/node-type") != "head":
            return
        token = env.get("RAY_AUTH_TOKEN") if env.get("RAY_AUTH_MODE") == "token" else None
        head = FakeHead(
            cluster=labels["ray.io/cluster"], ip=ip, port=self.port, token=token, start_delay=self.start_delay
        )
        with self._lock:
            self.heads[pod["metadata"]["name"]] = head

    def on_stop(self, pod: Mapping[str, Any]) -> None:
        with self._lock:
            head = self.heads.pop(pod["metadata"]["name"], None)
        if head is not None:
            head.stop()

    def close(self) -> None:
        with self._lock:
            heads, self.heads = list(self.heads.values()), {}
        for head in heads:
            head.stop()

    # --- what the test does and asks ----------------------------------------------------------
    def find(self, submission_id: str) -> FakeJob | None:
        """The job with this id on a live head."""
        with self._lock:
            heads = list(self.heads.values())
        for head in heads:
            job = head.job(submission_id)
            if job is not None:
                return job
        return None

    def head_of(self, cluster: str) -> FakeHead | None:
        with self._lock:
            return next((h for h in self.heads.values() if h.cluster == cluster), None)

    def print_line(self, submission_id: str, line: str) -> None:
        job = self._require(submission_id)
        job.logs.append(line)

    def finish(self, submission_id: str, status: str, message: str = "") -> None:
        assert status in TERMINAL, status
        job = self._require(submission_id)
        job.status, job.message = status, message or f"Job {status.lower()}."
        job.end_time = int(time.time() * 1000)

    def _require(self, submission_id: str) -> FakeJob:
        job = self.find(submission_id)
        if job is None:
            raise KeyError(f"no live head has Ray job {submission_id}")
        return job
