"""next_actions(): what a round does for its facts under the rule they classify as, table-driven."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from rljob_testing import spec_dict

from rldock.operator.actions import (
    CountRestart,
    CreateCluster,
    DeleteCluster,
    ScalePool,
    StopJob,
    SubmitJob,
    SuspendCluster,
    next_actions,
)
from rldock.operator.api import RLJobSpec, RLJobStatus
from rldock.operator.constants import (
    ANNOTATION_SPEC_HASH,
    ANNOTATION_SUSPENDED_BY,
    DEFAULT_BACKOFF_LIMIT,
    LABEL_KUEUE_QUEUE,
    MANAGED_BY_RLDOCK,
    RayJobStatus,
)
from rldock.operator.facts import RayJobObservation, RoundFacts
from rldock.operator.rules import Rule, classify

HASH = "h1"


def _cluster(
    *, suspend: bool = False, spec_hash: str = HASH, suspended_by: str | None = None, labels: dict | None = None
) -> dict[str, Any]:
    annotations = {ANNOTATION_SPEC_HASH: spec_hash}
    if suspended_by:
        annotations[ANNOTATION_SUSPENDED_BY] = suspended_by
    return {
        "metadata": {"name": "j", "uid": "c1", "annotations": annotations, "labels": labels or {}},
        "spec": {"suspend": suspend},
        "status": {"state": "ready"},
    }


def _job(status: RayJobStatus, attempt: int = 0) -> RayJobObservation:
    return RayJobObservation(submission_id=f"rldock-j-0000-{attempt}", status=status)


def _facts(
    *,
    restart_count: int = 0,
    cluster: dict | None = "default",
    job: RayJobObservation | None = None,
    spec: dict | None = None,
    lost_pods: tuple[str, ...] = (),
    **kwargs: Any,
) -> RoundFacts:
    return RoundFacts(
        name="j",
        now=datetime(2026, 3, 1, tzinfo=timezone.utc),
        spec=RLJobSpec.model_validate(spec or spec_dict()),
        previous=RLJobStatus(restart_count=restart_count),
        looked=True,
        cluster=_cluster() if cluster == "default" else cluster,
        desired_spec_hash=HASH,
        ray_job=job,
        lost_pods=lost_pods,
        **kwargs,
    )


def _actions(facts: RoundFacts) -> list:
    rule = classify(facts)
    assert rule is not None
    return next_actions(facts, rule)


def _queued_in(queue: str) -> RoundFacts:
    """A Kueue job of queue "q" whose cluster Kueue holds, labelled for `queue`."""
    return _facts(
        cluster=_cluster(suspend=True, labels={LABEL_KUEUE_QUEUE: queue}),
        spec=spec_dict(scheduling={"gang": "kueue", "queue": "q"}),
        desired_scheduling_labels={LABEL_KUEUE_QUEUE: "q"},
    )


RUNNING, PENDING = _job(RayJobStatus.RUNNING), _job(RayJobStatus.PENDING)
SUSPEND = spec_dict(suspend=True)
KUEUE_SUSPEND = spec_dict(suspend=True, scheduling={"gang": "kueue", "queue": "q"})
KUEUE = spec_dict(scheduling={"gang": "kueue", "queue": "q"})
LOST = ("pod j-worker-0 was deleted",)

CASES = {
    # No StopJob: the Jobs API's stop kills the driver 3 s after its SIGTERM; the pods' preStop hooks stop it
    # after its iteration and checkpoint.
    "suspend: suspend the cluster, whose pods' hooks stop the job": (
        _facts(spec=SUSPEND, job=RUNNING),
        [SuspendCluster(True)],
    ),
    "suspend with kueue: Kueue owns spec.suspend, so delete": (
        _facts(spec=KUEUE_SUSPEND, job=PENDING),
        [DeleteCluster(replace=False, why="the RLJob is suspended")],
    ),
    "suspended already: nothing": (_facts(spec=SUSPEND, cluster=_cluster(suspend=True)), []),
    "suspended with kueue, cluster gone: nothing": (
        _facts(spec=KUEUE_SUSPEND, cluster=None),
        [],
    ),
    "unsuspend: the operator's own suspend": (
        _facts(cluster=_cluster(suspend=True, suspended_by=MANAGED_BY_RLDOCK)),
        [SuspendCluster(False)],
    ),
    "suspended by someone else (an admin): theirs to undo, nothing else either": (
        _facts(cluster=_cluster(suspend=True), job=None),
        [],
    ),
    "kueue has not admitted: leave spec.suspend to Kueue": (
        _facts(cluster=_cluster(suspend=True), spec=KUEUE),
        [],
    ),
    "succeeded: release the cluster": (
        _facts(job=_job(RayJobStatus.SUCCEEDED)),
        [DeleteCluster(replace=False, why="the RLJob succeeded")],
    ),
    "failed for good while a driver still runs: stop it, release": (
        _facts(restart_count=DEFAULT_BACKOFF_LIMIT, job=RUNNING, lost_pods=LOST),
        [StopJob(RUNNING.submission_id, "the RLJob failed"), DeleteCluster(replace=False, why="the RLJob failed")],
    ),
    "no cluster: create it": (_facts(cluster=None), [CreateCluster()]),
    "cluster deleted mid-run: create it and count the restart": (
        _facts(cluster=None, job=_job(RayJobStatus.FAILED)),
        [CreateCluster(), CountRestart()],
    ),
    "failed job: count a restart": (_facts(job=_job(RayJobStatus.FAILED)), [CountRestart()]),
    "stopped job: count a restart": (
        _facts(job=_job(RayJobStatus.STOPPED)),
        [CountRestart()],
    ),
    "lost worker: stop the driver, count a restart": (
        _facts(job=RUNNING, lost_pods=LOST),
        [StopJob(RUNNING.submission_id, "a worker pod was lost; restarting"), CountRestart()],
    ),
    "restart counted, cluster ready: submit the next attempt": (
        _facts(restart_count=1, ready_to_submit=True, previous_attempt=_job(RayJobStatus.STOPPED)),
        [SubmitJob(1)],
    ),
    "next attempt, but the last driver still runs: stop it first": (
        _facts(restart_count=1, ready_to_submit=True, previous_attempt=RUNNING),
        [StopJob(RUNNING.submission_id, "superseded by the next attempt")],
    ),
    "ready, nothing submitted: submit": (_facts(ready_to_submit=True), [SubmitJob(0)]),
    "not ready: wait": (_facts(), []),
    "running: nothing to do": (_facts(job=RUNNING, ready_to_submit=True), []),
    "spec changed while running: keep the cluster until the next attempt": (
        _facts(job=RUNNING, cluster=_cluster(spec_hash="old")),
        [],
    ),
    "spec changed between attempts: replace the cluster": (
        _facts(cluster=_cluster(spec_hash="old"), ready_to_submit=True),
        [DeleteCluster(replace=True, why="the RayCluster no longer matches the RLJob's spec")],
    ),
    # The status read a cluster Kueue holds suspended as waiting for admission (a start), the actions
    # as someone else's suspend (nothing to do): the spec moved meanwhile, and the old cluster would
    # be admitted, only to be replaced then. Waiting for admission is a start: replace it in the queue.
    "spec changed while kueue holds the cluster: replace it before it is admitted": (
        _facts(cluster=_cluster(suspend=True, spec_hash="old"), spec=KUEUE),
        [DeleteCluster(replace=True, why="the RayCluster no longer matches the RLJob's spec")],
    ),
    # The queue is a label of the RayCluster, outside the spec-hash: a queued job moved to another
    # queue is replaced too, or Kueue admits it from the old queue.
    "queue moved while kueue holds the cluster: replace it": (
        _queued_in("old"),
        [DeleteCluster(replace=True, why="the RayCluster no longer matches the RLJob's spec")],
    ),
    "queue as the spec says: leave it to Kueue": (_queued_in("q"), []),
    # A label the spec does not set is someone else's (Kueue's default queue): replacing the cluster
    # for it would repeat after every creation.
    "a queue label the spec does not set: left alone": (
        _facts(cluster=_cluster(labels={LABEL_KUEUE_QUEUE: "default"}), ready_to_submit=True),
        [SubmitJob(0)],
    ),
    # Under spec.maxRestarts a lost worker is the runtime's to recover: no failed attempt, neither for
    # the status (Running) nor for the actions (the driver is left be, no restart counted).
    "lost worker under maxRestarts: the runtime recovers it, the driver is left be": (
        _facts(job=RUNNING, lost_pods=LOST, spec=spec_dict(maxRestarts=2)),
        [],
    ),
}


@pytest.mark.parametrize("facts, expected", CASES.values(), ids=CASES.keys())
def test_next_actions(facts: RoundFacts, expected: list):
    assert _actions(facts) == expected


def test_a_kueue_cluster_waiting_for_admission_is_a_start_for_status_and_actions_alike():
    facts = _facts(cluster=_cluster(suspend=True), spec=KUEUE)
    assert classify(facts) is Rule.STARTING
    assert classify(_facts(cluster=_cluster(suspend=True))) is Rule.SUSPENDED_BY_OTHER  # an admin's suspend


def test_a_lost_worker_fails_the_attempt_only_without_an_in_job_restart_budget():
    assert classify(_facts(job=RUNNING, lost_pods=LOST)) is Rule.ATTEMPT_FAILED
    assert classify(_facts(job=RUNNING, lost_pods=LOST, spec=spec_dict(maxRestarts=2))) is Rule.ATTEMPT_RUNNING


def _pool_cluster(replicas: int) -> dict[str, Any]:
    cluster = _cluster()
    cluster["spec"]["workerGroupSpecs"] = [
        {"groupName": "workers", "replicas": 1},
        {"groupName": "pool", "replicas": replicas},
    ]
    return cluster


def _pool_spec(replicas: int) -> dict:
    spec = spec_dict()
    spec["job"]["rollout"] = {"pool": {"replicas": replicas}}
    return spec


def test_the_rollout_pool_is_scaled_to_the_spec_while_the_job_runs_and_before_it_starts():
    running = _facts(spec=_pool_spec(2), cluster=_pool_cluster(1), job=RUNNING)
    assert _actions(running) == [ScalePool(2, 1)]
    starting = _facts(spec=_pool_spec(1), cluster=_pool_cluster(2))
    assert ScalePool(1, 2) in _actions(starting)
    assert not any(
        isinstance(a, ScalePool) for a in _actions(_facts(spec=_pool_spec(2), cluster=_pool_cluster(2), job=RUNNING))
    )
    # a pool added to a running job waits for the next cluster (the spec hash differs): nothing to scale in place
    assert _actions(_facts(spec=_pool_spec(2), job=RUNNING)) == []
    # under Kueue, whose admitted pod sets are fixed, neither: the change applies with the next cluster
    kueue = _pool_spec(2)
    kueue["scheduling"] = {"gang": "kueue", "queue": "q"}
    assert _actions(_facts(spec=kueue, cluster=_pool_cluster(1), job=RUNNING)) == []
