"""A round's actions (actions.py's, derived from the rule that decided) done to the cluster and the Jobs
API: create, suspend, scale the rollout pool of or delete the RayCluster, count a restart, submit or stop the
attempt's Ray job."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from rldock.operator.actions import (
    Action,
    CountRestart,
    CreateCluster,
    DeleteCluster,
    NextAttempt,
    ScalePool,
    StopJob,
    SubmitJob,
    SuspendCluster,
)
from rldock.operator.api import RLJobSpec
from rldock.operator.builders import build_job_submission, device_resource
from rldock.operator.builders.ray_cluster import with_pool_replicas
from rldock.operator.constants import (
    ANNOTATION_SUSPENDED_BY,
    JOB_METADATA_WORKER_PODS,
    MANAGED_BY_RLDOCK,
    EventReason,
)
from rldock.operator.kube import Kube
from rldock.operator.observe import ready_worker_names
from rldock.operator.rayjobs import RayJobsError
from rldock.operator.reconcile.children import create
from rldock.operator.reconcile.round import Outcome, Round, Seen
from rldock.operator.settings import OperatorSettings

log = logging.getLogger(__name__)


def apply(
    kube: Kube,
    settings: OperatorSettings,
    action: Action,
    rnd: Round,
    spec: RLJobSpec,
    *,
    desired: Mapping[str, Any],
    cluster: Mapping[str, Any] | None,
    seen: Seen,
    status: dict[str, Any],
    out: Outcome,
) -> None:
    ns, name = rnd.ref.namespace, rnd.cluster_name
    if isinstance(action, CreateCluster):
        if create(kube, desired) is not None:
            resources = spec.job.resources
            devices = device_resource(spec, settings.pod_defaults)
            each = f"{resources.devices_per_node} {devices} each" if devices else "no device (resources.device cpu)"
            out.event(
                "Normal",
                EventReason.CREATED_RAY_CLUSTER,
                f"created RayCluster {name}: a head and {resources.num_nodes} worker(s) with {each}",
            )
    elif isinstance(action, DeleteCluster):
        assert cluster is not None
        if kube.delete("RayCluster", ns, name, uid=cluster["metadata"]["uid"]):
            reason = EventReason.REPLACED_RAY_CLUSTER if action.replace else EventReason.RELEASED_RAY_CLUSTER
            out.event("Normal", reason, f"deleted RayCluster {name}: {action.why}")
    elif isinstance(action, SuspendCluster):
        # The annotation marks the suspend as this operator's, the only kind it undoes (actions.py).
        kube.patch(
            "RayCluster",
            ns,
            name,
            {
                "metadata": {"annotations": {ANNOTATION_SUSPENDED_BY: MANAGED_BY_RLDOCK if action.suspend else None}},
                "spec": {"suspend": action.suspend},
            },
        )
    elif isinstance(action, ScalePool):
        assert cluster is not None
        # The whole list (a merge patch replaces it), on the cluster as read: another writer's change meanwhile
        # (KubeRay, Kueue's admission) makes the API server refuse it (409), and the next round scales again.
        version = cluster["metadata"].get("resourceVersion")  # the API server's objects always have one
        patch = {
            **({"metadata": {"resourceVersion": version}} if version else {}),
            "spec": {"workerGroupSpecs": with_pool_replicas(cluster, action.replicas)},
        }
        try:
            kube.patch("RayCluster", ns, name, patch)
        except ApiException as error:
            if error.status != 409:
                raise
            log.info("%s: the RayCluster changed since it was read; the rollout pool is scaled next round", name)
            return
        out.event(
            "Normal",
            EventReason.SCALED_ROLLOUT_POOL,
            f"scaled the rollout pool of RayCluster {name} from {action.had} to {action.replicas} engine(s)",
        )
    elif isinstance(action, (CountRestart, NextAttempt)):
        status["attempt"] = rnd.facts.attempt + 1
        if isinstance(action, CountRestart):
            status["restartCount"] = rnd.previous.restart_count + 1
    elif isinstance(action, (SubmitJob, StopJob)):
        assert seen.jobs is not None, "jobs are only submitted or stopped on a running head"
        _apply_job(action, rnd, spec, seen, status, out)
    else:  # pragma: no cover - next_actions() returns only the types above
        raise TypeError(f"unknown action {action!r}")


def _apply_job(
    action: SubmitJob | StopJob, rnd: Round, spec: RLJobSpec, seen: Seen, status: dict[str, Any], out: Outcome
) -> None:
    jobs = seen.jobs
    assert jobs is not None
    try:
        if isinstance(action, SubmitJob):
            request = build_job_submission(job=rnd.ref, spec=spec, attempt=action.attempt)
            request["metadata"][JOB_METADATA_WORKER_PODS] = ",".join(ready_worker_names(seen.summary))
            # The SubmittedRayJob Event comes from status_events when rayJobId changes, so a
            # request that timed out but took effect is still announced once the job is seen.
            status["rayJobId"] = jobs.submit_job(request)
        elif jobs.stop_job(action.submission_id):
            out.event("Normal", EventReason.STOPPED_RAY_JOB, f"stopped Ray job {action.submission_id}: {action.why}")
    except RayJobsError as error:  # the next round sees the job's state and decides again
        log.warning("%s/%s: %s failed: %s", rnd.ref.namespace, rnd.ref.name, action, error)
