"""What a reconcile round does after observing: a pure function from the situation to actions.

The status says what is; the plan says what to change so the cluster follows the spec. Rules, in
order (each one returns):

1. `spec.suspend`: stop the running attempt, then free the cluster: `RayCluster.spec.suspend`
   (KubeRay deletes every pod, the head too; the operator marks it as its own suspend), or delete
   it when Kueue owns that field (gang=kueue).
2. A terminal phase (Succeeded, or Failed after backoffLimit): stop what still runs and delete the
   RayCluster, so no device stays held; the checkpoint volume keeps the results.
3. No RayCluster: create it (also after someone deleted it mid-run). A RayCluster the operator
   suspended is unsuspended; one suspended by anyone else (Kueue, an admin) is left as it is, and
   nothing else happens until they resume it: no restart is counted for the job it stopped.
4. The attempt failed (Ray job failed or stopped, or a worker was lost while it ran) and the status
   says Retrying: stop it if it still runs and count a restart; the next round submits attempt
   `restartCount`, which resumes from the last checkpoint.
5. The RayCluster no longer matches the spec (spec-hash annotation): replace it, but only between
   attempts. A spec change never kills a running job by itself; it applies to the next attempt
   (a retry, or suspend + unsuspend to apply it now).
6. No job for this attempt and the cluster is ready: submit it, once the previous attempt's driver
   is gone (never two drivers on one checkpoint directory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from rldock.operator.api import RLJobSpec
from rldock.operator.constants import ANNOTATION_SPEC_HASH, GangScheduler, Phase, RayJobStatus
from rldock.operator.observe import ACTIVE_JOB_STATES, Suspension, suspension
from rldock.operator.status import RayJobObservation


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
    pass


Action = Union[CreateCluster, DeleteCluster, SuspendCluster, SubmitJob, StopJob, CountRestart]


@dataclass(frozen=True)
class Situation:
    """One round's facts for a valid spec (a spec with problems is handled before planning)."""

    spec: RLJobSpec
    phase: Phase  # what compute_status decided this round
    restart_count: int
    cluster: Optional[Mapping[str, Any]]  # the RayCluster as stored; None: there is none
    desired_spec_hash: str
    job: Optional[RayJobObservation] = None  # attempt `restart_count`; None: not submitted
    lost_workers: bool = False  # a worker pod was lost while this attempt ran
    ready_to_submit: bool = False  # observe.ready_to_submit
    previous_attempt: Optional[RayJobObservation] = None  # attempt restart_count - 1, when looked up

    @property
    def suspension(self) -> Suspension:
        return suspension(self.cluster)


def _active(job: Optional[RayJobObservation]) -> bool:
    return job is not None and job.status in ACTIVE_JOB_STATES


def plan(s: Situation) -> list[Action]:
    kueue = s.spec.scheduling.gang is GangScheduler.KUEUE
    job_active = _active(s.job)
    actions: list[Action] = []

    if s.spec.suspend:
        if job_active:
            actions.append(StopJob(s.job.submission_id, "the RLJob is suspended"))
        if s.cluster is not None:
            if kueue:  # Kueue owns spec.suspend of the RayCluster: free it by deleting it
                actions.append(DeleteCluster(replace=False, why="the RLJob is suspended"))
            elif not s.cluster.get("spec", {}).get("suspend"):
                actions.append(SuspendCluster(True))
        return actions

    if s.phase.is_terminal:
        if job_active:
            actions.append(StopJob(s.job.submission_id, f"the RLJob {s.phase.value.lower()}"))
        if s.cluster is not None:
            actions.append(DeleteCluster(replace=False, why=f"the RLJob {s.phase.value.lower()}"))
        return actions

    if s.cluster is None:
        actions.append(CreateCluster())
    elif s.suspension is Suspension.OURS:
        actions.append(SuspendCluster(False))  # resumed
    elif s.suspension is Suspension.OTHER:
        return actions  # Kueue's or an admin's suspend: theirs to undo

    attempt_failed = s.job is not None and (
        s.job.status in (RayJobStatus.FAILED, RayJobStatus.STOPPED) or (job_active and s.lost_workers))
    if s.phase is Phase.RETRYING and attempt_failed:
        if job_active:
            actions.append(StopJob(s.job.submission_id, "a worker pod was lost; restarting"))
        actions.append(CountRestart())
        return actions
    if s.cluster is None:
        return actions

    current_hash = (s.cluster.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)
    if current_hash != s.desired_spec_hash and not job_active:
        return [DeleteCluster(replace=True, why="the RayCluster no longer matches the RLJob's spec")]

    if s.job is None and s.ready_to_submit:
        if _active(s.previous_attempt):
            actions.append(StopJob(s.previous_attempt.submission_id, "superseded by the next attempt"))
        else:
            actions.append(SubmitJob(s.restart_count))
    return actions
