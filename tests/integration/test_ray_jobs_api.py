"""The operator's Jobs API client against a REAL Ray 2.60 head with token authentication: the
endpoints, the `Authorization: Bearer` header and RAY_AUTH_MODE/RAY_AUTH_TOKEN (the env the
operator puts in every Ray pod) work as the operator assumes, and a progress line printed by the
driver comes back through the log endpoint. (The operator tests use a test double of this API.)

The head (tests/ray_head.py) is one of its own, with the dashboard that serves the Jobs API.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ray_head import ray_head

from rldock.contract.progress import format_progress
from rldock.operator.observe import read_progress
from rldock.operator.rayjobs import RayJobsClient, RayJobsError
from rldock_e2e.controlplane import wait_for

pytestmark = pytest.mark.integration

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


@pytest.fixture(scope="module")
def jobs_api() -> Iterator[tuple[str, str]]:
    """A head of its own with the dashboard (the Jobs API), not the tier's shared one."""
    with ray_head(num_cpus=1, dashboard=True) as head:
        assert head.dashboard_url is not None
        client_ = RayJobsClient(head.dashboard_url, token=head.token, timeout=5)

        def up() -> bool:
            try:
                return client_.get_job("probe") is None
            except RayJobsError:
                return False

        wait_for("the Ray dashboard", up, timeout=120, interval=1)
        yield head.dashboard_url, head.token


# Submitting starts a job-supervisor actor before the POST returns: seconds on a loaded 2-core
# machine (seen > 5 s, the operator's default; the operator then finds the job on its next round).
HTTP_TIMEOUT_S = 60.0


def _wait_terminal(client: RayJobsClient, submission_id: str) -> dict:
    return wait_for(
        f"Ray job {submission_id} to end",
        lambda: (job := client.get_job(submission_id)) and job["status"] in TERMINAL and job,
        timeout=240,
        interval=0.5,
    )


def test_submit_follow_and_read_progress_with_token_auth(jobs_api):
    url, token = jobs_api
    client = RayJobsClient(url, token=token, timeout=HTTP_TIMEOUT_S)
    record = {"iteration": 3, "iterations": 4, "reward_mean": 0.25, "tokens_per_s_per_device": 1234.5, "checkpoint": 2}
    request = {
        "entrypoint": f"echo starting; echo '{format_progress(record)}'",
        "submission_id": "rldock-real-0000-0",
        "metadata": {"rldock.io/rljob": "real"},
    }
    assert client.submit_job(request) == request["submission_id"]
    assert client.submit_job(request) == request["submission_id"]  # idempotent: "already exists"
    job = _wait_terminal(client, request["submission_id"])
    assert job["status"] == "SUCCEEDED", job
    assert job["metadata"]["rldock.io/rljob"] == "real" and job["start_time"] > 0
    progress = read_progress(client.get_logs(request["submission_id"]), output_dir="/checkpoints/ns/real")
    assert progress.metrics == record
    assert progress.last_checkpoint == "/checkpoints/ns/real/checkpoints/iter-000002"


def test_the_driver_sees_the_clusters_auth_settings(jobs_api):
    url, token = jobs_api
    client = RayJobsClient(url, token=token, timeout=HTTP_TIMEOUT_S)
    request = {
        "entrypoint": 'test "$RAY_AUTH_MODE" = token && test -n "$RAY_AUTH_TOKEN"',
        "submission_id": "rldock-env-0000-0",
    }
    assert _wait_terminal(client, client.submit_job(request))["status"] == "SUCCEEDED"


def test_stop_a_running_job(jobs_api):
    url, token = jobs_api
    client = RayJobsClient(url, token=token, timeout=HTTP_TIMEOUT_S)
    submission_id = client.submit_job({"entrypoint": "sleep 120", "submission_id": "rldock-stop-0000-0"})
    wait_for("the driver to run", lambda: client.get_job(submission_id)["status"] == "RUNNING", timeout=60)
    assert client.stop_job(submission_id) is True
    assert _wait_terminal(client, submission_id)["status"] == "STOPPED"


@pytest.mark.parametrize("token, code", [(None, "401"), ("0" * 64, "403")])
def test_requests_without_the_token_are_refused(jobs_api, token, code):
    url, _ = jobs_api
    with pytest.raises(RayJobsError, match=code):
        RayJobsClient(url, token=token, timeout=HTTP_TIMEOUT_S).get_job("rldock-real-0000-0")
