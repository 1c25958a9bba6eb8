"""One record of what a reconcile round knows: the facts every rule is tested on (rules.classify),
and the status (status.py) and the actions (actions.py) are derived from.

A round fills it in two steps (reconcile/): first what the RLJob itself says (its spec worked out
once per generation, desired.py, and the status it stored), which decides the rules of the spec
(MANAGED_ELSEWHERE, FINISHED, REFUSED) before the round touches the cluster; then, only when none
of those holds, what the round read of the cluster (`looked`): its RayCluster, pods, Ray job and
environments. Each fact is written here once, in one form; the facts that are read off others
(who suspended the cluster, whether the job is Kueue's, why the attempt failed) are properties.

Pass only complete observations: a lookup that failed is not an absence (the round skips instead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any

from rldock.config import Problem
from rldock.contract.failure import JobFailure
from rldock.operator.api import RLJobSpec, RLJobStatus
from rldock.operator.constants import (
    ANNOTATION_SUSPENDED_BY,
    MANAGED_BY_RLDOCK,
    SCHEDULING_LABELS,
    ConditionType,
    GangScheduler,
    Phase,
    RayJobStatus,
    Reason,
)

ACTIVE_JOB_STATES = frozenset({RayJobStatus.PENDING, RayJobStatus.RUNNING})


class Suspension(str, Enum):
    """Who holds a RayCluster's spec.suspend."""

    NONE = "none"  # not suspended
    OURS = "ours"  # this operator, for the RLJob's spec.suspend (the annotation says so)
    OTHER = "other"  # Kueue (waiting for admission, preempted) or an admin


def suspension(cluster: Mapping[str, Any] | None) -> Suspension:
    if cluster is None or not (cluster.get("spec") or {}).get("suspend"):
        return Suspension.NONE
    annotations = (cluster.get("metadata") or {}).get("annotations") or {}
    return Suspension.OURS if annotations.get(ANNOTATION_SUSPENDED_BY) == MANAGED_BY_RLDOCK else Suspension.OTHER


def scheduling_labels(obj: Mapping[str, Any] | None) -> dict[str, str]:
    """The gang scheduler's labels a RayCluster (stored or built) carries (constants.SCHEDULING_LABELS)."""
    labels = ((obj or {}).get("metadata") or {}).get("labels") or {}
    return {key: labels[key] for key in SCHEDULING_LABELS if key in labels}


_SPEC_FAILURES = (Reason.INVALID_SPEC, Reason.POLICY_DENIED)


def finished(status: RLJobStatus) -> bool:
    """Succeeded, or Failed for good (a Failed caused by the spec alone is undone by fixing it)."""
    return status.phase is not None and status.phase.is_terminal and not failed_on_spec(status)


def failed_on_spec(status: RLJobStatus) -> bool:
    """A Failed phase that only the spec caused (invalid, or outside the admin's policy), which
    fixing the spec (or the policy) undoes."""
    failed = status.condition(ConditionType.FAILED)
    return status.phase is Phase.FAILED and failed is not None and failed.reason in _SPEC_FAILURES


@dataclass(frozen=True)
class RayJobObservation:
    """The Ray job of an attempt, as the Jobs API reports it."""

    submission_id: str
    status: RayJobStatus
    message: str = ""
    failure: JobFailure | None = None  # the runtime's failure line, when it refused its inputs

    @property
    def active(self) -> bool:
        """Submitted and not over: its driver may still be running."""
        return self.status in ACTIVE_JOB_STATES


@dataclass(frozen=True)
class PodSetObservation:
    """The Deployment of one spec.environments or spec.agents entry: the pods it asks for and those ready."""

    name: str
    replicas: int
    ready_replicas: int = 0


@dataclass(frozen=True)
class Blocked:
    """The round cannot get a child it needs: NameConflict or CreateRefused, and the message."""

    reason: Reason
    message: str


@dataclass(frozen=True)
class RoundFacts:
    """What one round knows of one RLJob. `looked` is False until the round has read the cluster;
    the cluster's facts keep their defaults until then (and in a blocked round, which reports only
    what blocked it)."""

    name: str  # the RLJob's
    now: datetime  # timezone-aware
    spec: RLJobSpec | None = None  # None: managed elsewhere (not parsed), or it did not parse (problems)
    problems: Sequence[Problem] = ()  # validation.parse_spec
    denied: Sequence[Problem] = ()  # policy.policy_problems: a valid spec the admin's policy refuses
    previous: RLJobStatus = field(default_factory=RLJobStatus)  # the stored status, parsed
    generation: int | None = None
    managed_elsewhere: bool = False  # spec.managedBy names another controller
    # --- read of the cluster (once `looked`) ---
    looked: bool = False
    cluster: Mapping[str, Any] | None = None  # the RayCluster as stored; None: there is none
    desired_spec_hash: str | None = None  # the spec-hash annotation the RayCluster built now carries
    # ... and its gang scheduler's labels (the queue), which the hash leaves out (scheduling_labels)
    desired_scheduling_labels: Mapping[str, str] = field(default_factory=dict)
    ray_job: RayJobObservation | None = None  # attempt number `attempt`; None: not submitted yet
    previous_attempt: RayJobObservation | None = None  # attempt - 1, when looked up
    ready_to_submit: bool = False  # observe.ready_to_submit
    metrics: Mapping[str, Any] | None = None  # the runtime's last metrics record
    last_checkpoint: str | None = None
    unschedulable: Sequence[str] = ()  # scheduler messages of this job's Pending pods
    lost_pods: Sequence[str] = ()  # why worker pods died or vanished while the Ray job ran
    head_terminating: str | None = None  # a head pod being deleted (observe.PodSummary), by name
    workers_terminating: Sequence[str] = ()  # worker pods being deleted while the Ray job runs, by name
    blocked: Blocked | None = None  # a child that cannot be had (reconcile/), with why
    # The environments' Deployments (spec.environments order); None: not looked at this round.
    environments: Sequence[PodSetObservation] | None = None
    agents: Sequence[PodSetObservation] | None = None  # the agents' Deployments, alike

    def __post_init__(self) -> None:
        if self.now.tzinfo is None:
            raise ValueError("now must be timezone-aware, e.g. datetime.now(timezone.utc)")
        if self.spec is None and not self.problems and not self.managed_elsewhere:
            raise ValueError("a spec that did not parse must come with its problems (validation.parse_spec)")

    @property
    def valid_spec(self) -> RLJobSpec:
        """The spec, once the rules of the spec have not held (a spec that did not parse is REFUSED)."""
        assert self.spec is not None, "a spec without problems parsed"
        return self.spec

    @property
    def restart_count(self) -> int:
        """Restarts made so far: the current attempt's number."""
        return self.previous.restart_count

    @property
    def attempt(self) -> int:
        """The current attempt's number: restarts and drained attempts so far (`restart_count` on a status
        written before attempts were numbered apart)."""
        stored = self.previous.attempt
        return self.previous.restart_count if stored is None else stored

    @property
    def draining(self) -> bool:
        """A worker pod is being deleted alone while the attempt runs (a drain, an eviction) in a job without an
        in-job restart budget: its preStop hook has the driver save the iteration under way
        (rldock.runtime.driver.preemption), and the attempt ends once the pod is gone."""
        return bool(self.workers_terminating) and self.spec is not None and self.spec.max_restarts == 0

    @property
    def drained(self) -> bool:
        """The current attempt saw a worker pod deleted alone (`draining`, recorded as Preempted=True
        WorkerPodDeleted: the stored status is what outlives the pod), so its end is a preemption: the next
        attempt counts no restart. Only the attempt the last round saw running: Preempted stays True until the
        next one runs, and that one failing before any round saw it run is a failure, counted (else an attempt
        that fails at once would be retried forever)."""
        before, running = (
            self.previous.condition(ConditionType.PREEMPTED),
            self.previous.condition(ConditionType.RUNNING),
        )
        return (
            before is not None
            and before.status == "True"
            and before.reason == Reason.WORKER_POD_DELETED
            and running is not None
            and running.status == "True"
        )

    @property
    def kueue(self) -> bool:
        return self.spec is not None and self.spec.scheduling.gang is GangScheduler.KUEUE

    @property
    def suspension(self) -> Suspension:
        """Who holds the RayCluster's spec.suspend."""
        return suspension(self.cluster)

    @property
    def cluster_status(self) -> Mapping[str, Any] | None:
        """KubeRay's status of the RayCluster ({} when new); None: there is no cluster."""
        return None if self.cluster is None else (self.cluster.get("status") or {})

    @property
    def attempt_failure(self) -> tuple[Reason, str] | None:
        """Why the current attempt failed, or None: its Ray job failed or was stopped, or a worker pod
        was lost while it ran and the job has no in-job restart budget (spec.maxRestarts, with which a
        lost worker is the runtime's to recover). A job whose runtime refused its inputs failed too,
        for good (rule ATTEMPT_REFUSED, tested first); a succeeded job has nothing left to lose."""
        job = self.ray_job
        if job is None:
            return None
        if job.status is RayJobStatus.FAILED:
            return Reason.RAY_JOB_FAILED, f"Ray job {job.submission_id} failed: {job.message or 'no message'}"
        if job.status is RayJobStatus.STOPPED:
            return Reason.RAY_JOB_STOPPED, f"Ray job {job.submission_id} was stopped outside the operator"
        if self.lost_pods and self.spec is not None and self.spec.max_restarts == 0:
            return Reason.WORKER_POD_LOST, "; ".join(dict.fromkeys(self.lost_pods))
        return None

    @property
    def preempted(self) -> bool:
        """The head pod is being deleted while the attempt ran (a node drain, a preemption, `kubectl delete
        pod`), not with its cluster (suspended, deleted): its preStop hook stops the driver, which checkpoints
        the iteration under way and exits (rldock.runtime.driver.preemption), and the job goes with the head.
        It holds from the round that sees the pod terminating after the job ran (the stored phase Running,
        read before the round's status replaces it: this stored status is what outlives the head pod) until
        the pod is gone, and again if a head is deleted before the next attempt runs."""
        if self.head_terminating is None or self.suspension is not Suspension.NONE:
            return False
        if self.cluster is None or (self.cluster.get("metadata") or {}).get("deletionTimestamp"):
            return False
        before = self.previous.condition(ConditionType.PREEMPTED)
        return self.previous.phase is Phase.RUNNING or (before is not None and before.status == "True")

    @property
    def retries_left(self) -> bool:
        """A failed attempt is retried: fewer restarts so far than spec.backoffLimit."""
        return self.spec is not None and self.restart_count < self.spec.backoff_limit
