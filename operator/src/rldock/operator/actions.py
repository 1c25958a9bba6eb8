"""What a reconcile round does after observing: a pure function from the situation to actions.

The status says what is; the actions change the cluster so it follows the spec. Which rule decides
comes from the operator's one table of rules (rules.py); what each rule does here:

- FINISHED (the phase this round decided is Succeeded or Failed): stop what still runs and delete
  the RayCluster, so no device stays held; the checkpoint volume keeps the results.
- SUSPENDED (`spec.suspend`): stop the running attempt, then free the cluster: `RayCluster.spec.suspend`
  (KubeRay deletes every pod, the head too; the operator marks it as its own suspend), or delete it
  when Kueue owns that field (gang=kueue).
- SUSPENDED_BY_OTHER (Kueue, an admin): nothing until they resume it; no restart is counted for the
  job it stopped.
- ATTEMPT_FAILED (the Ray job failed or stopped, or a worker was lost while it ran, and the status
  says Retrying): stop it if it still runs and count a restart; the next round submits attempt
  `restartCount`, which resumes from the last checkpoint.
- ATTEMPT_RUNNING: leave the driver be.
- STARTING: create the RayCluster when there is none (also after someone deleted it mid-run);
  replace it when it no longer matches the spec (spec-hash annotation), which only happens between
  attempts: a spec change never kills a running job by itself, it applies to the next attempt (a
  retry, or suspend + unsuspend to apply it now); then submit the attempt once the cluster is ready
  and the previous attempt's driver is gone (never two drivers on one checkpoint directory).

Whatever the rule, a RayCluster that is missing is created and one the operator suspended is
unsuspended (`_bring_up`), also in the round that counts a restart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from rldock.operator.api import RLJobSpec
from rldock.operator.constants import ANNOTATION_SPEC_HASH, GangScheduler, Phase, RayJobStatus
from rldock.operator.observe import ACTIVE_JOB_STATES, Suspension, suspension
from rldock.operator.rules import Rule, first_rule
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


Action = CreateCluster | DeleteCluster | SuspendCluster | SubmitJob | StopJob | CountRestart


@dataclass(frozen=True)
class Situation:
    """One round's facts for a valid spec (a spec with problems is handled before the actions)."""

    spec: RLJobSpec
    phase: Phase  # what compute_status decided this round
    restart_count: int
    cluster: Mapping[str, Any] | None  # the RayCluster as stored; None: there is none
    desired_spec_hash: str
    job: RayJobObservation | None = None  # attempt `restart_count`; None: not submitted
    lost_workers: bool = False  # a worker pod was lost while this attempt ran
    ready_to_submit: bool = False  # observe.ready_to_submit
    previous_attempt: RayJobObservation | None = None  # attempt restart_count - 1, when looked up

    @property
    def suspension(self) -> Suspension:
        return suspension(self.cluster)


def _active(job: RayJobObservation | None) -> TypeGuard[RayJobObservation]:
    return job is not None and job.status in ACTIVE_JOB_STATES


def next_actions(s: Situation) -> list[Action]:
    """What this round does, in order."""
    job = s.job
    rule = first_rule(
        {
            Rule.FINISHED: lambda: s.phase.is_terminal,
            Rule.SUSPENDED: lambda: s.spec.suspend,
            Rule.SUSPENDED_BY_OTHER: lambda: s.suspension is Suspension.OTHER,
            Rule.ATTEMPT_FAILED: lambda: (
                s.phase is Phase.RETRYING
                and job is not None
                and (job.status in (RayJobStatus.FAILED, RayJobStatus.STOPPED) or (_active(job) and s.lost_workers))
            ),
            Rule.ATTEMPT_RUNNING: lambda: _active(job),
        }
    )
    return _ACTIONS[rule](s)


def _release(s: Situation) -> list[Action]:
    why = f"the RLJob {s.phase.value.lower()}"
    actions: list[Action] = []
    if _active(s.job):
        actions.append(StopJob(s.job.submission_id, why))
    if s.cluster is not None:
        actions.append(DeleteCluster(replace=False, why=why))
    return actions


def _suspend(s: Situation) -> list[Action]:
    actions: list[Action] = []
    if _active(s.job):
        actions.append(StopJob(s.job.submission_id, "the RLJob is suspended"))
    if s.cluster is not None:
        if s.spec.scheduling.gang is GangScheduler.KUEUE:  # Kueue owns spec.suspend: free it by deleting it
            actions.append(DeleteCluster(replace=False, why="the RLJob is suspended"))
        elif not s.cluster.get("spec", {}).get("suspend"):
            actions.append(SuspendCluster(True))
    return actions


def _bring_up(s: Situation) -> list[Action]:
    """Create a missing RayCluster, resume one the operator suspended."""
    if s.cluster is None:
        return [CreateCluster()]
    return [SuspendCluster(False)] if s.suspension is Suspension.OURS else []


def _retry(s: Situation) -> list[Action]:
    actions = _bring_up(s)
    if _active(s.job):
        actions.append(StopJob(s.job.submission_id, "a worker pod was lost; restarting"))
    return [*actions, CountRestart()]


def _start(s: Situation) -> list[Action]:
    if s.cluster is None:
        return [CreateCluster()]
    current_hash = (s.cluster.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_SPEC_HASH)
    if current_hash != s.desired_spec_hash:
        return [DeleteCluster(replace=True, why="the RayCluster no longer matches the RLJob's spec")]
    actions = _bring_up(s)
    if s.job is None and s.ready_to_submit:
        if _active(s.previous_attempt):
            actions.append(StopJob(s.previous_attempt.submission_id, "superseded by the next attempt"))
        else:
            actions.append(SubmitJob(s.restart_count))
    return actions


_ACTIONS: dict[Rule, Callable[[Situation], list[Action]]] = {
    Rule.FINISHED: _release,
    Rule.SUSPENDED: _suspend,
    Rule.SUSPENDED_BY_OTHER: lambda s: [],
    Rule.ATTEMPT_FAILED: _retry,
    Rule.ATTEMPT_RUNNING: _bring_up,
    Rule.STARTING: _start,
}
