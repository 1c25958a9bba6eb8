"""What one reconcile round reads from the cluster, reduced to the facts the status and the plan
use. Pure functions over plain dicts (objects as the API server returns them, camelCase).

- the RayCluster's pods (KubeRay labels them `ray.io/cluster`, `ray.io/node-type`): is the head
  up, how many workers are ready, the scheduler's messages for pods it cannot place, and which
  workers were lost while the Ray job ran;
- where the Jobs API of the cluster is (settings.DashboardAddress);
- the Ray job of the current attempt, including a job that vanished with its head;
- the runtime's last progress line in the job's log (rldock.contract.progress).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rldock.contract.checkpoints import checkpoint_path
from rldock.contract.failure import last_failure
from rldock.contract.progress import headline_key, last_progress
from rldock.operator import naming
from rldock.operator.api import RLJobSpec, RLJobStatus
from rldock.operator.constants import (
    DASHBOARD_ENDPOINT,
    DASHBOARD_PORT,
    JOB_METADATA_WORKER_PODS,
    LABEL_RAY_GROUP,
    LABEL_RAY_NODE_TYPE,
    LABEL_RLJOB,
    POOL_GROUP,
    RAY_CONDITION_PROVISIONED,
    RAY_NODE_TYPE_HEAD,
    RAY_NODE_TYPE_WORKER,
    RAY_STATE_READY,
    GangScheduler,
    Phase,
    RayJobStatus,
)
from rldock.operator.facts import (
    PodSetObservation,
    RayJobObservation,
    Suspension,
    suspension,
)
from rldock.operator.settings import DashboardAddress


# --- Pods ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerPod:
    name: str
    phase: str
    terminating: bool
    ready: bool = False
    reason: str = ""


@dataclass(frozen=True)
class PodSummary:
    head_scheduled: bool = False  # the head pod is bound to a node (a gang scheduler admitted the cluster)
    head_running: bool = False  # the head pod runs (its dashboard may answer)
    head_ready: bool = False  # ... and passes its readiness probe
    head_terminating: str | None = None  # the name of a head pod being deleted (its preStop hook may run)
    # ... and of an earlier RayCluster of the same name (deleted for a suspend under Kueue, or a spec change)
    earlier_head_terminating: str | None = None
    ready_workers: int = 0
    workers: tuple[WorkerPod, ...] = ()  # the trainer's worker group's (WORKER_GROUP)
    unschedulable: tuple[str, ...] = ()  # the scheduler's messages, one per pod it cannot place
    # The rollout pool's worker group (POOL_GROUP) is apart: its pods come and go as it is scaled, and an engine
    # lost with one costs that engine, not the attempt (rldock.runtime.driver.rollout_pool). Its pods the
    # scheduler cannot place show in the condition but hold back no submission.
    pool_unschedulable: tuple[str, ...] = ()


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or ())


def _condition(pod: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in pod.get("status", {}).get("conditions") or () if c.get("type") == type_), None)


def _ready(pod: Mapping[str, Any]) -> bool:
    ready = _condition(pod, "Ready")
    return (
        pod.get("status", {}).get("phase") == "Running"
        and ready is not None
        and ready.get("status") == "True"
        and not pod["metadata"].get("deletionTimestamp")
    )


def summarize_pods(pods: Sequence[Mapping[str, Any]]) -> PodSummary:
    """Pods of one RayCluster (already filtered to those it owns)."""
    head_scheduled, head_running, head_ready = False, False, False
    workers: list[WorkerPod] = []
    unschedulable: list[str] = []
    pool_unschedulable: list[str] = []
    head_terminating: str | None = None
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        meta, status = pod["metadata"], pod.get("status", {})
        labels = meta.get("labels") or {}
        in_pool = labels.get(LABEL_RAY_GROUP) == POOL_GROUP
        scheduled = _condition(pod, "PodScheduled")
        if (
            scheduled is not None
            and scheduled.get("status") == "False"
            and scheduled.get("reason") == "Unschedulable"
            and not meta.get("deletionTimestamp")
        ):
            message = scheduled.get("message") or f"pod {meta['name']} cannot be scheduled"
            (pool_unschedulable if in_pool else unschedulable).append(message)
        if in_pool:
            continue
        node_type = labels.get(LABEL_RAY_NODE_TYPE)
        if node_type == RAY_NODE_TYPE_HEAD:
            head_scheduled = head_scheduled or (
                bool((pod.get("spec") or {}).get("nodeName")) and not meta.get("deletionTimestamp")
            )
            head_running = head_running or (status.get("phase") == "Running" and not meta.get("deletionTimestamp"))
            head_ready = head_ready or _ready(pod)
            if meta.get("deletionTimestamp"):
                head_terminating = meta["name"]
        elif node_type == RAY_NODE_TYPE_WORKER:
            workers.append(
                WorkerPod(
                    name=meta["name"],
                    phase=status.get("phase", "Pending"),
                    terminating=bool(meta.get("deletionTimestamp")),
                    ready=_ready(pod),
                    reason=status.get("reason") or status.get("message") or "",
                )
            )
    return PodSummary(
        head_scheduled=head_scheduled,
        head_running=head_running,
        head_ready=head_ready,
        head_terminating=head_terminating,
        ready_workers=sum(w.ready for w in workers),
        workers=tuple(workers),
        unschedulable=tuple(unschedulable),
        pool_unschedulable=tuple(pool_unschedulable),
    )


def lost_workers(summary: PodSummary, *, num_workers: int, attempt_workers: Collection[str] | None) -> list[str]:
    """Why worker pods were lost while the Ray job ran, or an empty list.

    A worker is lost when its pod failed, or when a pod the attempt started on (`attempt_workers`,
    recorded in the Ray job's metadata at submission) is gone, even though KubeRay already replaced it
    under a new name; and workers are missing when fewer pods exist than the job needs. None for
    `attempt_workers` (not recorded) checks the first and last rules only. A pod being deleted is not
    lost yet: its preStop hook asks the driver to stop and keeps its Ray node up while the driver saves
    the iteration under way (rldock.runtime.driver.preemption); it is lost once gone.
    """
    lost = []
    for worker in summary.workers:
        if worker.phase == "Failed":
            lost.append(f"worker pod {worker.name} failed" + (f": {worker.reason}" if worker.reason else ""))
    present = {w.name for w in summary.workers}
    lost += [f"worker pod {name} is gone" for name in sorted(set(attempt_workers or ()) - present)]
    live = sum(1 for w in summary.workers if w.phase != "Failed")
    if live < num_workers:
        lost.append(f"only {live} of {num_workers} worker pods exist")
    return lost


def attempt_workers(details: Mapping[str, Any] | None) -> frozenset[str] | None:
    """The worker pods an attempt was submitted on (its Ray job's metadata), if recorded."""
    value = ((details or {}).get("metadata") or {}).get(JOB_METADATA_WORKER_PODS)
    return frozenset(filter(None, value.split(","))) if isinstance(value, str) else None


def ready_worker_names(summary: PodSummary) -> list[str]:
    return [w.name for w in summary.workers if w.ready]


# --- The RayCluster ----------------------------------------------------------------------------
def cluster_is_ready(cluster_status: Mapping[str, Any] | None) -> bool:
    """KubeRay's own verdict: state `ready`, or the RayClusterProvisioned condition."""
    if not cluster_status:
        return False
    conditions = {c.get("type"): c.get("status") for c in cluster_status.get("conditions") or ()}
    return cluster_status.get("state") == RAY_STATE_READY or conditions.get(RAY_CONDITION_PROVISIONED) == "True"


def admitted(spec: RLJobSpec, cluster: Mapping[str, Any] | None, summary: PodSummary) -> bool:
    """Whether the job may run now, so that its environments' pods may: its RayCluster exists and is
    not suspended (by its spec.suspend, or by Kueue until it admits the cluster), and under a Volcano
    gang (whose pods exist, pending, until Volcano admits the PodGroup) its head pod is bound to a
    node. Before that the environments hold no pods (reconcile/)."""
    if cluster is None or suspension(cluster) is not Suspension.NONE:
        return False
    return summary.head_scheduled if spec.scheduling.gang is GangScheduler.VOLCANO else True


def ready_to_submit(cluster: Mapping[str, Any], summary: PodSummary, *, num_workers: int) -> bool:
    """The cluster can take the job: KubeRay says ready and the head and every worker are Ready now
    (KubeRay keeps `ready` once reached, also while it replaces a lost worker), and no head pod of the
    job is being deleted: its preStop hook may still be letting a driver save its checkpoint, which the
    next attempt resumes from."""
    return (
        not cluster.get("spec", {}).get("suspend")
        and cluster_is_ready(cluster.get("status"))
        and summary.head_ready
        and summary.ready_workers >= num_workers
        and not summary.unschedulable
        and summary.head_terminating is None
        and summary.earlier_head_terminating is None
    )


def dashboard_url(
    *, mode: DashboardAddress, rljob_name: str, namespace: str, cluster_status: Mapping[str, Any] | None
) -> str | None:
    """The Jobs API base URL, or None while the status lacks the address `mode` needs.

    The port is the dashboard entry of KubeRay's `.status.endpoints` (the head Service's port),
    8265 when absent.
    """
    status = cluster_status or {}
    port = (status.get("endpoints") or {}).get(DASHBOARD_ENDPOINT) or DASHBOARD_PORT
    if mode is DashboardAddress.SERVICE_DNS:
        return f"http://{naming.head_service_name(rljob_name)}.{namespace}.svc:{port}"
    head = status.get("head") or {}
    host = head.get("serviceIP") if mode is DashboardAddress.SERVICE_IP else head.get("podIP")
    if not host:
        return None
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"http://{host}:{port}"


# --- The Ray job -------------------------------------------------------------------------------
def job_observation(
    submission_id: str, details: Mapping[str, Any] | None, *, previous: RLJobStatus, log_text: str = ""
) -> RayJobObservation | None:
    """The Ray job of the current attempt from the Jobs API answer (None: no such job).

    A job this RLJob's status saw running that the cluster no longer knows went down with its head
    (the head pod was replaced, taking the job table with it): that attempt failed. A failed job
    carries the runtime's failure line (rldock.contract.failure) when its log (`log_text`) has one,
    or Ray's message does (Ray quotes the end of the log in it).
    """
    if details is not None:
        status, message = RayJobStatus(details["status"]), str(details.get("message") or "")
        failure = None
        if status is RayJobStatus.FAILED:
            failure = last_failure(log_text.splitlines()) or last_failure(message.splitlines())
        return RayJobObservation(submission_id=submission_id, status=status, message=message, failure=failure)
    if previous.ray_job_id == submission_id and previous.phase is Phase.RUNNING:
        return RayJobObservation(
            submission_id=submission_id, status=RayJobStatus.FAILED, message="the Ray head was lost while the job ran"
        )
    return None


@dataclass(frozen=True)
class Progress:
    metrics: dict[str, Any] | None = None  # the last progress record, as compute_status reads it
    last_checkpoint: str | None = None


def read_progress(log_text: str, *, output_dir: str) -> Progress:
    """The last progress line of a job log, and the checkpoint it names as a path."""
    return progress_of(last_progress(log_text.splitlines()), output_dir=output_dir)


def progress_of(record: Mapping[str, Any] | None, *, output_dir: str) -> Progress:
    """A progress record (the last one of a log) as the status reads it; nothing when incomplete."""
    if record is None or not {"iteration", headline_key(record), "tokens_per_s_per_device"} <= record.keys():
        return Progress()
    checkpoint = record.get("checkpoint")
    path = checkpoint_path(output_dir, checkpoint) if isinstance(checkpoint, int) else None
    return Progress(metrics=dict(record), last_checkpoint=path)


# --- Children ----------------------------------------------------------------------------------
class Ownership(str, Enum):
    OURS = "ours"  # controlled by this RLJob
    ORPHAN = "orphan"  # labelled as this RLJob's but controlled by nobody: reported, never adopted
    FOREIGN = "foreign"  # someone else's (or an older RLJob's of the same name still going away)


def ownership(obj: Mapping[str, Any], *, uid: str, rljob_name: str) -> Ownership:
    refs = obj.get("metadata", {}).get("ownerReferences") or ()
    controller = next((ref for ref in refs if ref.get("controller")), None)
    if controller is not None:
        return Ownership.OURS if controller.get("uid") == uid else Ownership.FOREIGN
    labels = obj.get("metadata", {}).get("labels") or {}
    return Ownership.ORPHAN if labels.get(LABEL_RLJOB) == naming.label_value(rljob_name) else Ownership.FOREIGN


# --- Environments ------------------------------------------------------------------------------
def pod_set_observation(name: str, deployment: Mapping[str, Any]) -> PodSetObservation:
    """The pods a spec.environments or spec.agents entry's Deployment asks for, and those ready."""
    return PodSetObservation(
        name=name,
        replicas=int(deployment["spec"].get("replicas") or 0),
        ready_replicas=int((deployment.get("status") or {}).get("readyReplicas") or 0),
    )
