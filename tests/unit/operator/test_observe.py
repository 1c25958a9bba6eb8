"""observe: pods, the Jobs API address, the Ray job and its progress line, children's ownership."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rljob_testing import spec_dict

from rldock.contract.progress import format_progress
from rldock.operator.api import RLJobSpec, RLJobStatus
from rldock.operator.constants import JOB_METADATA_WORKER_PODS, Phase, RayJobStatus
from rldock.operator.observe import (
    Ownership,
    PodSummary,
    WorkerPod,
    admitted,
    attempt_workers,
    dashboard_url,
    job_observation,
    lost_workers,
    ownership,
    read_progress,
    ready_to_submit,
    summarize_pods,
)
from rldock.operator.settings import DashboardAddress


def pod(
    name: str,
    node_type: str,
    *,
    phase: str = "Running",
    ready: bool = True,
    deleting: bool = False,
    unschedulable: str | None = None,
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable is not None:
        conditions = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}]
    meta: dict[str, Any] = {"name": name, "labels": {"ray.io/node-type": node_type}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "conditions": conditions}}


def test_summary_of_a_ready_cluster():
    summary = summarize_pods(
        [pod("c-head-a", "head"), pod("c-workers-worker-b", "worker"), pod("c-workers-worker-c", "worker", ready=False)]
    )
    assert summary.head_running and summary.head_ready
    assert summary.ready_workers == 1 and [w.name for w in summary.workers] == [
        "c-workers-worker-b",
        "c-workers-worker-c",
    ]
    assert summary.unschedulable == ()


def test_summary_carries_the_schedulers_messages():
    message = "0/2 nodes are available: 2 Insufficient huawei.com/Ascend910."
    summary = summarize_pods(
        [
            pod("c-head-a", "head", phase="Pending", ready=False),
            pod("c-workers-worker-b", "worker", phase="Pending", unschedulable=message),
            pod("c-workers-worker-c", "worker", phase="Pending", unschedulable="gone", deleting=True),
        ]
    )
    assert summary.unschedulable == (message,)
    assert not summary.head_running and summary.ready_workers == 0


def test_the_rollout_pools_pods_are_apart_from_the_trainers_workers():
    """Pool pods (KubeRay's `ray.io/group: pool`) come and go as the pool is scaled: they are no worker whose loss
    fails the attempt, nor one the submission waits for, and one the scheduler cannot place holds nothing back."""
    message = "0/2 nodes are available: 2 Insufficient huawei.com/Ascend910."
    pool = [pod("c-pool-worker-d", "worker"), pod("c-pool-worker-e", "worker", phase="Pending", unschedulable=message)]
    for entry in pool:
        entry["metadata"]["labels"]["ray.io/group"] = "pool"
    summary = summarize_pods([pod("c-head-a", "head"), pod("c-workers-worker-b", "worker"), *pool])
    assert [w.name for w in summary.workers] == ["c-workers-worker-b"] and summary.ready_workers == 1
    assert summary.pool_unschedulable == (message,) and summary.unschedulable == ()
    assert lost_workers(summary, num_workers=1, attempt_workers=frozenset({"c-workers-worker-b"})) == []


def test_a_terminating_head_is_not_up():
    summary = summarize_pods([pod("c-head-a", "head", deleting=True)])
    assert not summary.head_running and not summary.head_ready


def _workers(*workers: WorkerPod) -> PodSummary:
    return PodSummary(head_running=True, head_ready=True, workers=workers, ready_workers=sum(w.ready for w in workers))


W = WorkerPod


@pytest.mark.parametrize(
    "summary, attempt, expected",
    [
        (_workers(W("w-a", "Running", False, True), W("w-b", "Running", False, True)), {"w-a", "w-b"}, []),
        (
            _workers(W("w-a", "Failed", False, reason="OOMKilled"), W("w-b", "Running", False, True)),
            None,
            ["worker pod w-a failed: OOMKilled", "only 1 of 2 worker pods exist"],
        ),
        # Being deleted: its hook keeps its Ray node up while the driver saves the iteration (not lost yet)...
        (_workers(W("w-a", "Running", True), W("w-b", "Running", False, True)), {"w-a", "w-b"}, []),
        # ... and lost once gone
        (
            _workers(W("w-b", "Running", False, True)),
            {"w-a", "w-b"},
            ["worker pod w-a is gone", "only 1 of 2 worker pods exist"],
        ),
        # KubeRay already replaced w-a by w-c: the attempt lost a worker all the same.
        (
            _workers(W("w-c", "Running", False, True), W("w-b", "Running", False, True)),
            {"w-a", "w-b"},
            ["worker pod w-a is gone"],
        ),
        (_workers(W("w-b", "Running", False, True)), None, ["only 1 of 2 worker pods exist"]),
    ],
    ids=["none", "failed", "being-deleted", "deleted", "replaced", "missing"],
)
def test_lost_workers(summary, attempt, expected):
    assert lost_workers(summary, num_workers=2, attempt_workers=attempt) == expected


def test_attempt_workers_come_from_the_job_metadata():
    assert attempt_workers({"metadata": {JOB_METADATA_WORKER_PODS: "w-a,w-b"}}) == {"w-a", "w-b"}
    assert attempt_workers({"metadata": {}}) is None and attempt_workers(None) is None


def _ray_cluster(*, state: str | None = "ready", suspend: bool = False) -> dict[str, Any]:
    return {"spec": {"suspend": suspend}, "status": {"state": state} if state else {}}


@pytest.mark.parametrize(
    "cluster, summary, expected",
    [
        (_ray_cluster(), _workers(W("w-a", "Running", False, True)), True),
        (_ray_cluster(state=None), _workers(W("w-a", "Running", False, True)), False),  # KubeRay not ready yet
        (_ray_cluster(), _workers(W("w-a", "Pending", False, False)), False),  # a worker is being replaced
        (_ray_cluster(suspend=True), _workers(W("w-a", "Running", False, True)), False),
        (_ray_cluster(), PodSummary(head_running=True, head_ready=False, ready_workers=1), False),
        # A head pod of the job still stopping (its driver may be saving the checkpoint to resume from),
        # of this RayCluster or of an earlier one of the same name (deleted for a suspend under Kueue).
        (_ray_cluster(), replace(_workers(W("w-a", "Running", False, True)), head_terminating="h-old"), False),
        (_ray_cluster(), replace(_workers(W("w-a", "Running", False, True)), earlier_head_terminating="h-0"), False),
    ],
)
def test_ready_to_submit(cluster, summary, expected):
    assert ready_to_submit(cluster, summary, num_workers=1) is expected


def test_ready_to_submit_reads_kuberays_provisioned_condition():
    cluster = {"spec": {}, "status": {"conditions": [{"type": "RayClusterProvisioned", "status": "True"}]}}
    assert ready_to_submit(cluster, _workers(W("w-a", "Running", False, True)), num_workers=1)


STATUS = {"head": {"podIP": "10.1.2.3", "serviceIP": "10.96.0.7"}, "endpoints": {"dashboard": "18265"}}


@pytest.mark.parametrize(
    "mode, status, expected",
    [
        (DashboardAddress.SERVICE_DNS, {}, "http://my-job-head-svc.team-a.svc:8265"),
        (DashboardAddress.SERVICE_DNS, STATUS, "http://my-job-head-svc.team-a.svc:18265"),
        (DashboardAddress.SERVICE_IP, STATUS, "http://10.96.0.7:18265"),
        (DashboardAddress.POD_IP, STATUS, "http://10.1.2.3:18265"),
        (DashboardAddress.POD_IP, {"head": {"podIP": "fd00::5"}}, "http://[fd00::5]:8265"),
        (DashboardAddress.POD_IP, {"head": {"serviceIP": "10.96.0.7"}}, None),  # no pod IP yet
    ],
)
def test_dashboard_url(mode, status, expected):
    assert dashboard_url(mode=mode, rljob_name="my-job", namespace="team-a", cluster_status=status) == expected


def test_job_observation():
    running = RLJobStatus(phase=Phase.RUNNING, ray_job_id="sid-0")
    observed = job_observation("sid-0", {"status": "FAILED", "message": "exit 1"}, previous=running)
    assert (observed.status, observed.message) == (RayJobStatus.FAILED, "exit 1")
    # The job the status saw running vanished with its head: that attempt failed.
    vanished = job_observation("sid-0", None, previous=running)
    assert vanished.status is RayJobStatus.FAILED and "head" in vanished.message
    assert job_observation("sid-0", None, previous=RLJobStatus(phase=Phase.PROVISIONING)) is None
    assert job_observation("sid-0", None, previous=RLJobStatus(phase=Phase.SUSPENDED, ray_job_id="sid-0")) is None
    with pytest.raises(ValueError):
        job_observation("sid-0", {"status": "EXPLODED"}, previous=running)


def _record(iteration: int, checkpoint: int | None) -> dict[str, Any]:
    return {
        "iteration": iteration,
        "iterations": 10,
        "reward_mean": 0.5,
        "tokens_per_s_per_device": 99.0,
        "kl": 0.0,
        "loss": 0.1,
        "response_length_mean": 4.0,
        "checkpoint": checkpoint,
    }


def test_read_progress_takes_the_last_line_and_its_checkpoint():
    log = "\n".join(["(raylet) starting", format_progress(_record(4, 4)), "noise", format_progress(_record(5, 4))])
    progress = read_progress(log, output_dir="/checkpoints/ns/job")
    assert progress.metrics["iteration"] == 5
    assert progress.last_checkpoint == "/checkpoints/ns/job/checkpoints/iter-000004"
    assert read_progress(format_progress(_record(1, None)), output_dir="/o").last_checkpoint is None
    assert read_progress("no progress yet", output_dir="/o").metrics is None
    assert read_progress(format_progress({"iteration": 1}), output_dir="/o").metrics is None  # incomplete


def test_checkpoint_path_follows_the_runtimes_layout(tmp_path: Path):
    from rldock.runtime import checkpoint  # torch-free; the operator image has no runtime

    expected = checkpoint.checkpoint_root(tmp_path) / "iter-000012"
    staging = checkpoint.staging_dir(tmp_path, 12)
    assert checkpoint.commit(tmp_path, staging, 12, {}, keep_last=1).path == expected
    got = read_progress(format_progress(_record(12, 12)), output_dir=str(tmp_path)).last_checkpoint
    assert got == str(expected)


def _owned(uid: str | None, label: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": {"rldock.io/rljob": label} if label else {}}
    if uid:
        meta["ownerReferences"] = [{"uid": uid, "controller": True}]
    return {"metadata": meta}


@pytest.mark.parametrize(
    "obj, expected",
    [
        (_owned("u1"), Ownership.OURS),
        (_owned("u2", label="job"), Ownership.FOREIGN),  # an older RLJob of the same name
        (_owned(None, label="job"), Ownership.ORPHAN),
        (_owned(None), Ownership.FOREIGN),  # someone else's object of that name
    ],
)
def test_ownership(obj, expected):
    assert ownership(obj, uid="u1", rljob_name="job") is expected


def test_read_progress_accepts_a_dpo_record():
    record = {"iteration": 3, "policy_preference_accuracy": 0.75, "tokens_per_s_per_device": 10.0}
    assert read_progress(format_progress(record), output_dir="/o").metrics == record


def test_read_progress_keeps_the_last_evaluation_of_the_line():
    record = {**_record(6, 4), "val_iteration": 5, "val_reward": 0.4, "val_accuracy": 0.25}
    assert read_progress(format_progress(record), output_dir="/o").metrics == record


# --- Admission: when the environments' pods may run ------------------------------------------------

_SUSPENDED_BY_US = {"annotations": {"rldock.io/suspended-by": "rldock.io/rljob-operator"}}


def _head(node: str | None, *, deleting: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": "h", "labels": {"ray.io/node-type": "head"}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": metadata, "spec": {"nodeName": node} if node else {}, "status": {"phase": "Pending"}}


@pytest.mark.parametrize(
    "gang, cluster, pods, expected",
    [
        ("none", None, [], False),  # no cluster yet
        ("none", {"spec": {}}, [], True),
        ("none", {"spec": {"suspend": True}, "metadata": _SUSPENDED_BY_US}, [], False),  # spec.suspend
        ("kueue", {"spec": {"suspend": True}, "metadata": {}}, [], False),  # waiting in Kueue's queue
        ("kueue", {"spec": {"suspend": False}, "metadata": {}}, [], True),  # Kueue admitted it
        ("volcano", {"spec": {}}, [_head(None)], False),  # the gang waits for Volcano
        ("volcano", {"spec": {}}, [_head("node-1")], True),  # Volcano bound it
        ("volcano", {"spec": {}}, [_head("node-1", deleting=True)], False),
    ],
)
def test_admitted_is_an_unsuspended_cluster_and_for_volcano_a_bound_head(gang, cluster, pods, expected):
    sections = {} if gang == "none" else {"scheduling": {"gang": gang, "queue": "q"}}
    spec = RLJobSpec.model_validate(spec_dict(**sections))
    assert admitted(spec, cluster, summarize_pods(pods)) is expected
