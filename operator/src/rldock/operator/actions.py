"""What a reconcile round does after observing: a pure function from the round's facts and the rule
that decided (rules.classify) to actions.

The status says what is; the actions change the cluster so it follows the spec. What each rule does
here (the table is in rules.py):

- ATTEMPT_SUCCEEDED, ATTEMPT_REFUSED, and ATTEMPT_FAILED at backoffLimit (the job ends this round):
  stop what still runs and delete the RayCluster, so no device stays held; the checkpoint volume
  keeps the results.
- SUSPENDED (`spec.suspend`): free the cluster: `RayCluster.spec.suspend` (KubeRay deletes every pod,
  the head too; the operator marks it as its own suspend), or delete it when Kueue owns that field
  (gang=kueue). The running attempt is not stopped through the Jobs API (whose stop kills the driver
  3 s after its SIGTERM): the pods' preStop hooks stop it, its iteration finished and checkpointed,
  the workers' Ray nodes kept up meanwhile (rldock.runtime.driver.preemption), as in a preemption.
- SUSPENDED_BY_OTHER (an admin): nothing until they resume it; no restart is counted for the job it
  stopped.
- PREEMPTED (the head pod is being deleted while the job ran): nothing; the head's preStop hook stops
  the driver after a checkpoint, KubeRay makes a new head, and STARTING submits the same attempt to
  it (no restart counted), which resumes from that checkpoint.
- WORKER_DRAINED (the attempt ended after a worker pod deleted alone, whose hook had the iteration under
  way saved): stop the job if it still runs and number the next attempt, counting no restart; the next
  round submits it, which resumes after the saved iteration.
- ATTEMPT_FAILED with restarts left: stop the job if it still runs and count a restart (which numbers the
  next attempt too); the next round submits attempt `attempt`, which resumes from the last checkpoint.
- ATTEMPT_RUNNING: leave the driver be (but scale the rollout pool's worker group to the spec: `_scale_pool`).
- STARTING: create the RayCluster when there is none (also after someone deleted it mid-run);
  replace it when it no longer matches the spec (spec-hash annotation, and the gang scheduler's
  labels, e.g. the queue), which only happens between attempts (also while Kueue holds it waiting
  for admission): a spec change never kills a running job by itself, it applies to the next
  attempt (a retry, or suspend + unsuspend to apply it now);
  then submit the attempt once the cluster is ready, no head pod of the job is still stopping (its
  driver may be saving a checkpoint: observe.ready_to_submit) and the previous attempt's driver is
  gone (never two drivers on one checkpoint directory).

Whatever the rule, a RayCluster that is missing is created and one the operator suspended is
unsuspended (`_bring_up`), also in the round that counts a restart. The rules the round decides
before it looks at the cluster (FINISHED, REFUSED) release it there (reconcile/); BLOCKED acts on
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

from rldock.operator.builders.ray_cluster import pool_group_replicas, scales_under_kueue
from rldock.operator.constants import ANNOTATION_SPEC_HASH
from rldock.operator.facts import RayJobObservation, RoundFacts, Suspension, scheduling_labels
from rldock.operator.rules import Rule


@dataclass(frozen=True)
class CreateCluster:
    pass


@dataclass(frozen=True)
class DeleteCluster:
    replace: bool  # False: release it (job over, suspended with Kueue)
    why: str


@dataclass(frozen=True)
class SuspendCluster:
    suspend: bool


@dataclass(frozen=True)
class SubmitJob:
    attempt: int


@dataclass(frozen=True)
class StopJob:
    submission_id: str
    why: str


@dataclass(frozen=True)
class CountRestart:
    """A failed attempt: one more restart, and the next attempt's number."""


@dataclass(frozen=True)
class NextAttempt:
    """An attempt a drain ended: the next attempt's number, no restart counted."""


@dataclass(frozen=True)
class ScalePool:
    """The rollout pool's worker group to `replicas` pods (spec.job.rollout.pool.replicas changed)."""

    replicas: int
    had: int


Action = CreateCluster | DeleteCluster | SuspendCluster | ScalePool | SubmitJob | StopJob | CountRestart | NextAttempt


def _active(job: RayJobObservation | None) -> TypeGuard[RayJobObservation]:
    return job is not None and job.active


def next_actions(f: RoundFacts, rule: Rule) -> list[Action]:
    """What this round does under `rule`, in order."""
    return _ACTIONS[rule](f)


def _release(f: RoundFacts, why: str) -> list[Action]:
    actions: list[Action] = []
    if _active(f.ray_job):
        actions.append(StopJob(f.ray_job.submission_id, why))
    if f.cluster is not None:
        actions.append(DeleteCluster(replace=False, why=why))
    return actions


def _suspend(f: RoundFacts) -> list[Action]:
    actions: list[Action] = []  # no StopJob: the pods' preStop hooks stop the driver (module docstring)
    if f.cluster is not None:
        if f.kueue:  # Kueue owns spec.suspend: free it by deleting it
            actions.append(DeleteCluster(replace=False, why="the RLJob is suspended"))
        elif not f.cluster.get("spec", {}).get("suspend"):
            actions.append(SuspendCluster(True))
    return actions


def _bring_up(f: RoundFacts) -> list[Action]:
    """Create a missing RayCluster, resume one the operator suspended, scale its rollout pool to the spec."""
    if f.cluster is None:
        return [CreateCluster()]
    return [*([SuspendCluster(False)] if f.suspension is Suspension.OURS else []), *_scale_pool(f)]


def _scale_pool(f: RoundFacts) -> list[Action]:
    """The pool's worker group to spec.job.rollout.pool.replicas, in place, also while the job runs: the
    runtime starts an engine on a new pod as its Ray node joins and hands a removed one's groups to the others
    (docs/placement.md#the-rollout-pool). A pool added or removed changes the cluster's spec hash instead."""
    pool = None if f.spec is None else f.spec.job.rollout.pool
    had = None if f.cluster is None else pool_group_replicas(f.cluster)
    if pool is None or had is None or had == pool.replicas or scales_under_kueue(f.valid_spec):
        return []  # under Kueue the spec hash holds the replicas: a change applies with the next cluster
    return [ScalePool(pool.replicas, had)]


def _retry(f: RoundFacts) -> list[Action]:
    if not f.retries_left:
        return _failed(f)
    return [*_stop_for_the_next(f, "a worker pod was lost; restarting"), CountRestart()]


def _after_drain(f: RoundFacts) -> list[Action]:
    return [*_stop_for_the_next(f, "a worker pod was drained; resuming after its checkpoint"), NextAttempt()]


def _stop_for_the_next(f: RoundFacts, why: str) -> list[Action]:
    actions = _bring_up(f)
    if _active(f.ray_job):
        actions.append(StopJob(f.ray_job.submission_id, why))
    return actions


def _start(f: RoundFacts) -> list[Action]:
    if f.cluster is None:
        return [CreateCluster()]
    current_hash = (f.cluster.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)
    if current_hash != f.desired_spec_hash or _scheduling_moved(f):
        return [DeleteCluster(replace=True, why="the RayCluster no longer matches the RLJob's spec")]
    actions = _bring_up(f)
    if f.ray_job is None and f.ready_to_submit:
        if _active(f.previous_attempt):
            actions.append(StopJob(f.previous_attempt.submission_id, "superseded by the next attempt"))
        else:
            actions.append(SubmitJob(f.attempt))
    return actions


def _scheduling_moved(f: RoundFacts) -> bool:
    """The spec's gang scheduler labels (the queue) differ from the cluster's: they are outside the
    hash, and a job moved to another queue must be queued there. Only the labels the spec sets are
    compared: one it does not set may be another controller's (Kueue labels a job without a queue
    with its namespace's default queue), and replacing the cluster for it would only repeat."""
    stored = scheduling_labels(f.cluster)
    return any(stored.get(key) != value for key, value in f.desired_scheduling_labels.items())


def _failed(f: RoundFacts) -> list[Action]:
    return _release(f, "the RLJob failed")


def _succeeded(f: RoundFacts) -> list[Action]:
    return _release(f, "the RLJob succeeded")


def _nothing(f: RoundFacts) -> list[Action]:
    return []


_ACTIONS: dict[Rule, Callable[[RoundFacts], list[Action]]] = {
    Rule.SUSPENDED: _suspend,
    Rule.SUSPENDED_BY_OTHER: _nothing,
    Rule.BLOCKED: _nothing,
    Rule.PREEMPTED: _nothing,
    Rule.ATTEMPT_REFUSED: _failed,
    Rule.ATTEMPT_SUCCEEDED: _succeeded,
    Rule.WORKER_DRAINED: _after_drain,
    Rule.ATTEMPT_FAILED: _retry,
    Rule.ATTEMPT_RUNNING: _bring_up,
    Rule.STARTING: _start,
}
