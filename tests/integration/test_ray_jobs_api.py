"""The operator's Jobs API client against a REAL Ray 2.60 head with token authentication: the
endpoints, the `Authorization: Bearer` header and RAY_AUTH_MODE/RAY_AUTH_TOKEN (the env the
operator puts in every Ray pod) work as the operator assumes, and a progress line printed by the
driver comes back through the log endpoint. (The operator tests use a test double of this API.)

The head runs as `ray start --head --block` in its own process group on free loopback ports and a
private temp dir, and is stopped by killing that group: never `ray stop`, which would end every
Ray process on the machine.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rldock.contract.progress import format_progress
from rldock.operator.observe import read_progress
from rldock.operator.rayjobs import RayJobsClient, RayJobsError
from rldock_e2e.controlplane import pid_alive, wait_for
from rldock_e2e.controlplane.processes import ManagedProcess, free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


@pytest.fixture(scope="module")
def ray_head() -> Iterator[tuple[str, str]]:
    ray = Path(sys.executable).with_name("ray")
    if not ray.exists():
        pytest.skip("the ray CLI is not installed in this environment")
    token = secrets.token_hex(32)
    gcs, dashboard, manager, objects, client, agent_http, agent_grpc, runtime_env, metrics = free_ports(9)
    temp = Path(tempfile.mkdtemp(prefix="rldock-ray-", dir="/tmp"))  # short: Ray's unix sockets live here
    argv = [
        str(ray),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--node-manager-port={manager}",
        f"--object-manager-port={objects}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        "--num-cpus=1",
        f"--temp-dir={temp}",
        "--disable-usage-stats",
    ]
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    head = ManagedProcess("ray-head", argv, log_path=temp / "head.log", env=env, cwd=temp)
    url = f"http://127.0.0.1:{dashboard}"
    client_ = RayJobsClient(url, token=token, timeout=5)

    def up() -> bool:
        if head.poll() is not None:
            raise AssertionError(f"ray start exited:\n{head.log_tail()}")
        try:
            return client_.get_job("probe") is None
        except RayJobsError:
            return False

    try:
        wait_for("the Ray dashboard", up, timeout=120, interval=1)
        yield url, token
    finally:
        head.stop(timeout=3)  # `ray start --block` may sit on SIGTERM; then the group is killed
        assert not pid_alive(head.pid)
        shutil.rmtree(temp, ignore_errors=True)


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


def test_submit_follow_and_read_progress_with_token_auth(ray_head):
    url, token = ray_head
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


def test_the_driver_sees_the_clusters_auth_settings(ray_head):
    url, token = ray_head
    client = RayJobsClient(url, token=token, timeout=HTTP_TIMEOUT_S)
    request = {
        "entrypoint": 'test "$RAY_AUTH_MODE" = token && test -n "$RAY_AUTH_TOKEN"',
        "submission_id": "rldock-env-0000-0",
    }
    assert _wait_terminal(client, client.submit_job(request))["status"] == "SUCCEEDED"


def test_stop_a_running_job(ray_head):
    url, token = ray_head
    client = RayJobsClient(url, token=token, timeout=HTTP_TIMEOUT_S)
    submission_id = client.submit_job({"entrypoint": "sleep 120", "submission_id": "rldock-stop-0000-0"})
    wait_for("the driver to run", lambda: client.get_job(submission_id)["status"] == "RUNNING", timeout=60)
    assert client.stop_job(submission_id) is True
    assert _wait_terminal(client, submission_id)["status"] == "STOPPED"


@pytest.mark.parametrize("token, code", [(None, "401"), ("0" * 64, "403")])
def test_requests_without_the_token_are_refused(ray_head, token, code):
    url, _ = ray_head
    with pytest.raises(RayJobsError, match=code):
        RayJobsClient(url, token=token, timeout=HTTP_TIMEOUT_S).get_job("rldock-real-0000-0")
