"""The Jobs API client against the Ray head test double (e2e/src/rldock_e2e/doubles/ray_jobs.py) over real HTTP.

tests/integration/test_ray_jobs_api.py runs the same client against a real Ray 2.60 head.
"""

from __future__ import annotations

from typing import Iterator

import pytest


from rldock_e2e.controlplane.processes import free_ports
from rldock_e2e.doubles.ray_jobs import FakeHead
from rldock.operator.rayjobs import RayJobsClient, RayJobsError

TOKEN = "0123abcd" * 8
REQUEST = {"entrypoint": "rldock train /etc/rldock/job.yaml --resume", "submission_id": "rldock-j-1234-0",
           "metadata": {"rldock.io/rljob": "j"}}


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
