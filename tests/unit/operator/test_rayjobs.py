"""The Jobs API client against the Ray head test double (e2e/src/rldock_e2e/doubles/ray_jobs.py) over real HTTP,
and against raw sockets that trickle or flood (the bounds on what a head may make the operator read).

tests/integration/test_ray_jobs_api.py runs the same client against a real Ray 2.60 head.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from rldock.operator.rayjobs import RayJobsClient, RayJobsError
from rldock_e2e.controlplane.processes import free_ports
from rldock_e2e.doubles.ray_jobs import FakeHead

TOKEN = "0123abcd" * 8
REQUEST = {
    "entrypoint": "rldock train /etc/rldock/job.yaml --resume",
    "submission_id": "rldock-j-1234-0",
    "metadata": {"rldock.io/rljob": "j"},
}


@pytest.fixture
def head() -> Iterator[FakeHead]:
    (port,) = free_ports(1)
    fake = FakeHead(cluster="j", ip="127.0.0.1", port=port, token=TOKEN, start_delay=0.0)
    yield fake
    fake.stop()


def _client(head: FakeHead, token: str | None = TOKEN) -> RayJobsClient:
    return RayJobsClient(f"http://127.0.0.1:{head.port}", token=token, timeout=2)


def test_submit_is_idempotent_and_the_job_can_be_followed_and_stopped(head: FakeHead):
    client = _client(head)
    assert client.get_job(REQUEST["submission_id"]) is None
    assert client.submit_job(REQUEST) == REQUEST["submission_id"]
    assert client.submit_job(REQUEST) == REQUEST["submission_id"]  # "already exists": the same job
    assert list(head.jobs) == [REQUEST["submission_id"]]
    details = client.get_job(REQUEST["submission_id"])
    assert details["status"] == "RUNNING" and details["metadata"] == REQUEST["metadata"]
    head.jobs[REQUEST["submission_id"]].logs.append("RLDOCK_PROGRESS {}")
    assert client.get_logs(REQUEST["submission_id"]) == "RLDOCK_PROGRESS {}\n"
    assert client.stop_job(REQUEST["submission_id"]) is True
    assert client.get_job(REQUEST["submission_id"])["status"] == "STOPPED"
    assert client.stop_job(REQUEST["submission_id"]) is False  # already stopped
    assert client.stop_job("unknown") is False and client.get_logs("unknown") == ""


@pytest.mark.parametrize("token, code", [(None, "401"), ("wrong", "403")])
def test_a_refused_token_is_an_error_not_an_absent_job(head: FakeHead, token, code):
    with pytest.raises(RayJobsError, match=f"{code}.*auth token"):
        _client(head, token).get_job(REQUEST["submission_id"])


def test_an_unreachable_head_is_an_error():
    (port,) = free_ports(1)
    with pytest.raises(RayJobsError, match="api/jobs"):
        RayJobsClient(f"http://127.0.0.1:{port}", token=TOKEN, timeout=1).get_job("x")


# --- bounded reads: only the log's tail, a size cap, a total deadline ------------------------------


class Recorder:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []

    def jobs_api_request(self, *, endpoint: str, seconds: float, outcome: str) -> None:
        assert seconds >= 0
        self.requests.append((endpoint, outcome))


def _running_job(head: FakeHead, lines: list[str]) -> str:
    client = _client(head)
    client.submit_job(REQUEST)
    head.jobs[REQUEST["submission_id"]].logs.extend(lines)
    return REQUEST["submission_id"]


def test_the_driver_log_is_read_from_its_tail_not_whole(head: FakeHead):
    submission_id = _running_job(head, [f"line {i}" for i in range(50)])
    recorder = Recorder()
    client = RayJobsClient(f"http://127.0.0.1:{head.port}", token=TOKEN, timeout=2, tail_lines=10, metrics=recorder)
    tail = "".join(f"line {i}\n" for i in range(40, 50))
    assert client.get_logs(submission_id) == tail  # the details first: the tail needs the driver's node
    assert client.get_job(submission_id)["status"] == "RUNNING"
    assert client.get_logs(submission_id) == tail  # known now: one request
    assert head.log_reads == {"tail": 2, "whole": 0}
    assert recorder.requests == [("get_job", "ok"), ("log_tail", "ok"), ("get_job", "ok"), ("log_tail", "ok")]


def test_the_tail_request_names_the_driver_node_as_ray_requires(head: FakeHead):
    submission_id = _running_job(head, ["x"])
    base = f"http://127.0.0.1:{head.port}/api/v0/logs/file?submission_id={submission_id}&lines=5"
    request = urllib.request.Request(base, headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as refused:  # Ray 2.60's GetLogOptions: no node, 500
        urllib.request.urlopen(request, timeout=2)
    assert refused.value.code == 500
    node = _client(head).get_job(submission_id)["driver_node_id"]
    request = urllib.request.Request(f"{base}&node_id={node}", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=2) as response:
        assert response.read() == b"x\n"


def test_a_log_the_tail_endpoint_cannot_serve_is_read_whole(head: FakeHead):
    submission_id = _running_job(head, ["early failure"])
    job = head.jobs[submission_id]
    job.status = "PENDING"  # no driver node yet: the state API answers 500
    job.submitted += 3600  # and it stays so
    recorder = Recorder()
    client = RayJobsClient(f"http://127.0.0.1:{head.port}", token=TOKEN, timeout=2, metrics=recorder)
    assert client.get_logs(submission_id) == "early failure\n"  # no driver node: straight to the whole log
    assert head.log_reads == {"tail": 0, "whole": 1}
    assert recorder.requests == [("get_job", "ok"), ("logs", "ok")]


def test_a_tail_the_state_api_refuses_falls_back_to_the_whole_log(head: FakeHead):
    submission_id = _running_job(head, ["line"])
    recorder = Recorder()
    client = RayJobsClient(f"http://127.0.0.1:{head.port}", token=TOKEN, timeout=2, metrics=recorder)
    client.get_job(submission_id)
    head.jobs[submission_id].status = "PENDING"  # the state API answers 500 for it now
    head.jobs[submission_id].submitted += 3600
    assert client.get_logs(submission_id) == "line\n"
    assert recorder.requests[1:] == [("log_tail", "http_error"), ("logs", "ok")]


def test_a_log_larger_than_the_cap_keeps_its_last_whole_lines(head: FakeHead):
    lines = [f"{i:04d} " + "x" * 95 for i in range(100)]  # 100 lines of 101 bytes with the newline
    submission_id = _running_job(head, lines)
    client = RayJobsClient(f"http://127.0.0.1:{head.port}", token=TOKEN, timeout=2, max_bytes=1000)
    text = client.get_logs(submission_id)
    assert text == "".join(line + "\n" for line in lines[-9:])  # 9 whole lines fit in 1000 bytes


@pytest.mark.parametrize(
    "log_text",
    [
        'a\nb \\ "quoted" \u00e9\n' * 40 + "last line with \\n and \t\n",
        "\\" * 500 + "\nend\n",
        "\u4e2d\u6587" * 300 + "\nend\n",
    ],
)
def test_a_whole_log_larger_than_the_cap_keeps_its_end(log_text):
    import json as json_module

    from rldock.operator.rayjobs import _logs_from_json

    body = json_module.dumps({"logs": log_text})
    for cut in (20, 37, 101, 256):
        text = _logs_from_json(body[-cut:] if cut < len(body) else body, truncated=True, what="test")
        assert log_text.endswith(text) and len(text) <= cut
    assert _logs_from_json(body, truncated=False, what="test") == log_text


def _raw_server(reply: Callable[[socket.socket], None]) -> Iterator[str]:
    """An HTTP server of one thread that answers each connection with `reply`."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.recv(65536)
                with contextlib.suppress(OSError):
                    reply(connection)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    listener.close()


@pytest.fixture
def trickling() -> Iterator[str]:
    def reply(connection: socket.socket) -> None:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(100):  # a byte every 0.1 s: every socket read succeeds, the body never ends
            connection.sendall(b" ")
            time.sleep(0.1)

    yield from _raw_server(reply)


@pytest.fixture
def huge() -> Iterator[str]:
    def reply(connection: socket.socket) -> None:
        body = b'{"status": "RUNNING", "pad": "' + b"x" * 200_000 + b'"}'
        connection.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )

    yield from _raw_server(reply)


def test_a_trickling_server_is_cut_at_the_total_deadline(trickling: str):
    recorder = Recorder()
    client = RayJobsClient(trickling, token=TOKEN, timeout=0.5, metrics=recorder)
    started = time.monotonic()
    with pytest.raises(RayJobsError, match="within 0.5 s"):
        client.get_job("x")
    assert time.monotonic() - started < 1.5  # each byte came within a socket timeout; the total did not
    assert recorder.requests == [("get_job", "timeout")]


def test_an_answer_larger_than_the_cap_is_an_error(huge: str):
    recorder = Recorder()
    client = RayJobsClient(huge, token=TOKEN, timeout=2, max_bytes=100_000, metrics=recorder)
    with pytest.raises(RayJobsError, match="larger than 100000 bytes"):
        client.get_job("x")
    assert recorder.requests == [("get_job", "too_large")]
    assert RayJobsClient(huge, token=TOKEN, timeout=2).get_job("x")["status"] == "RUNNING"  # 1 MiB cap


def test_requests_are_recorded_with_their_outcome(head: FakeHead):
    recorder = Recorder()
    client = RayJobsClient(f"http://127.0.0.1:{head.port}", token=TOKEN, timeout=2, metrics=recorder)
    client.get_job("unknown")
    client.submit_job(REQUEST)
    client.submit_job(REQUEST)  # "already exists" is an answer the client expects
    client.stop_job(REQUEST["submission_id"])
    with pytest.raises(RayJobsError):
        RayJobsClient(f"http://127.0.0.1:{head.port}", token="wrong", timeout=2, metrics=recorder).get_job("x")
    assert recorder.requests == [
        ("get_job", "ok"),
        ("submit", "ok"),
        ("submit", "ok"),
        ("stop", "ok"),
        ("get_job", "auth_error"),
    ]
    (port,) = free_ports(1)
    with pytest.raises(RayJobsError):
        RayJobsClient(f"http://127.0.0.1:{port}", token=TOKEN, timeout=1, metrics=recorder).get_job("x")
    assert recorder.requests[-1] == ("get_job", "unreachable")
