"""next_actions(): what a round does in each situation, table-driven."""

from __future__ import annotations

from typing import Any

import pytest
from rljob_testing import spec_dict

from rldock.operator.actions import (
    CountRestart,
    CreateCluster,
    DeleteCluster,
    Situation,
    StopJob,
    SubmitJob,
    SuspendCluster,
    next_actions,
)
from rldock.operator.api import RLJobSpec
from rldock.operator.constants import (
    ANNOTATION_SPEC_HASH,
    ANNOTATION_SUSPENDED_BY,
    MANAGED_BY_RLDOCK,
    Phase,
    RayJobStatus,
)
from rldock.operator.status import RayJobObservation

HASH = "h1"


def _cluster(*, suspend: bool = False, spec_hash: str = HASH, suspended_by: str | None = None) -> dict[str, Any]:
    annotations = {ANNOTATION_SPEC_HASH: spec_hash}
    if suspended_by:
        annotations[ANNOTATION_SUSPENDED_BY] = suspended_by
    return {
        "metadata": {"name": "j", "uid": "c1", "annotations": annotations},
        "spec": {"suspend": suspend},
        "status": {"state": "ready"},
    }


def _job(status: RayJobStatus, attempt: int = 0) -> RayJobObservation:
    return RayJobObservation(submission_id=f"rldock-j-0000-{attempt}", status=status)


def _situation(
    *,
    phase: Phase = Phase.RUNNING,
    restart_count: int = 0,
    cluster: dict | None = "default",
    job: RayJobObservation | None = None,
    spec: dict | None = None,
    **kwargs: Any,
) -> Situation:
    return Situation(
        spec=RLJobSpec.model_validate(spec or spec_dict()),
        phase=phase,
        restart_count=restart_count,
        cluster=_cluster() if cluster == "default" else cluster,
        desired_spec_hash=HASH,
        job=job,
        **kwargs,
    )


RUNNING, PENDING = _job(RayJobStatus.RUNNING), _job(RayJobStatus.PENDING)
SUSPEND = spec_dict(suspend=True)
KUEUE_SUSPEND = spec_dict(suspend=True, scheduling={"gang": "kueue", "queue": "q"})

CASES = {
    "suspend: stop the job, then suspend the cluster": (
        _situation(phase=Phase.SUSPENDED, spec=SUSPEND, job=RUNNING),
        [StopJob(RUNNING.submission_id, "the RLJob is suspended"), SuspendCluster(True)],
    ),
    "suspend with kueue: Kueue owns spec.suspend, so delete": (
        _situation(phase=Phase.SUSPENDED, spec=KUEUE_SUSPEND, job=PENDING),
        [
            StopJob(PENDING.submission_id, "the RLJob is suspended"),
            DeleteCluster(replace=False, why="the RLJob is suspended"),
        ],
    ),
    "suspended already: nothing": (_situation(phase=Phase.SUSPENDED, spec=SUSPEND, cluster=_cluster(suspend=True)), []),
    "suspended with kueue, cluster gone: nothing": (
        _situation(phase=Phase.SUSPENDED, spec=KUEUE_SUSPEND, cluster=None),
        [],
    ),
    "unsuspend: the operator's own suspend": (
        _situation(phase=Phase.PROVISIONING, cluster=_cluster(suspend=True, suspended_by=MANAGED_BY_RLDOCK)),
        [SuspendCluster(False)],
    ),
    "suspended by someone else (an admin, Kueue): theirs to undo, nothing else either": (
        _situation(phase=Phase.SUSPENDED, cluster=_cluster(suspend=True), job=None),
        [],
    ),
    "kueue has not admitted: leave spec.suspend to Kueue": (
        _situation(
            phase=Phase.PENDING,
            cluster=_cluster(suspend=True),
            spec=spec_dict(scheduling={"gang": "kueue", "queue": "q"}),
        ),
        [],
    ),
    "succeeded: release the cluster": (
        _situation(phase=Phase.SUCCEEDED, job=_job(RayJobStatus.SUCCEEDED)),
        [DeleteCluster(replace=False, why="the RLJob succeeded")],
    ),
    "failed for good while a driver still runs: stop it, release": (
        _situation(phase=Phase.FAILED, job=RUNNING, lost_workers=True),
        [StopJob(RUNNING.submission_id, "the RLJob failed"), DeleteCluster(replace=False, why="the RLJob failed")],
    ),
    "no cluster: create it": (_situation(phase=Phase.PENDING, cluster=None), [CreateCluster()]),
    "cluster deleted mid-run: create it and count the restart": (
        _situation(phase=Phase.RETRYING, cluster=None, job=_job(RayJobStatus.FAILED)),
        [CreateCluster(), CountRestart()],
    ),
    "failed job: count a restart": (_situation(phase=Phase.RETRYING, job=_job(RayJobStatus.FAILED)), [CountRestart()]),
    "stopped job: count a restart": (
        _situation(phase=Phase.RETRYING, job=_job(RayJobStatus.STOPPED)),
        [CountRestart()],
    ),
    "lost worker: stop the driver, count a restart": (
        _situation(phase=Phase.RETRYING, job=RUNNING, lost_workers=True),
        [StopJob(RUNNING.submission_id, "a worker pod was lost; restarting"), CountRestart()],
    ),
    "restart counted, cluster ready: submit the next attempt": (
        _situation(
            phase=Phase.RETRYING, restart_count=1, ready_to_submit=True, previous_attempt=_job(RayJobStatus.STOPPED)
        ),
        [SubmitJob(1)],
    ),
    "next attempt, but the last driver still runs: stop it first": (
        _situation(phase=Phase.RETRYING, restart_count=1, ready_to_submit=True, previous_attempt=RUNNING),
        [StopJob(RUNNING.submission_id, "superseded by the next attempt")],
    ),
    "ready, nothing submitted: submit": (_situation(phase=Phase.PROVISIONING, ready_to_submit=True), [SubmitJob(0)]),
    "not ready: wait": (_situation(phase=Phase.PROVISIONING), []),
    "running: nothing to do": (_situation(job=RUNNING, ready_to_submit=True), []),
    "spec changed while running: keep the cluster until the next attempt": (
        _situation(job=RUNNING, cluster=_cluster(spec_hash="old")),
        [],
    ),
    "spec changed between attempts: replace the cluster": (
        _situation(phase=Phase.PROVISIONING, cluster=_cluster(spec_hash="old"), ready_to_submit=True),
        [DeleteCluster(replace=True, why="the RayCluster no longer matches the RLJob's spec")],
    ),
}


@pytest.mark.parametrize("situation, expected", CASES.values(), ids=CASES.keys())
def test_next_actions(situation: Situation, expected: list):
    assert next_actions(situation) == expected
