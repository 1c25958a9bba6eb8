"""The RLJob status as a pure function of one round's facts and the rule that decided.

`compute_status(facts, rule)` decides phase, conditions and progress from what the round knows
(facts.RoundFacts: the RayCluster, the current attempt's Ray job, the runtime's last metrics record,
pods the scheduler cannot place, pods lost mid-run, spec problems, the previous status) under the
rule `rules.classify` chose from the same facts. It reads no clock and writes nothing, so the round
stays thin: gather the facts, classify, compute, patch only when `status_changed`. `status_events`
names the transitions worth an Event.

What each rule writes is one function of `_PHASES` (the table is in rules.py): a terminal phase
sticks; spec problems fail the job; `suspend` wins over everything below; then the Ray job decides
(a job whose runtime refused its inputs fails at once; succeeded; failed or lost a worker -> retry
or give up at backoffLimit; running); before the job runs, the cluster decides (Pending,
Provisioning, or Retrying when this is a restart).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, NamedTuple

from pydantic import ValidationError

from rldock.config import Problem
from rldock.contract.progress import (
    CHECKPOINT_ESTIMATE_S,
    CHECKPOINT_S,
    ITERATION_S,
    MISMATCH_KL,
    VAL_ACCURACY,
    VAL_ITERATION,
    VAL_REWARD,
    headline_key,
)
from rldock.operator import naming
from rldock.operator.api import Condition, LastEvaluation, PodSetStatus, RLJobSpec, RLJobStatus
from rldock.operator.constants import (
    CONDITION_MESSAGE_MAX,
    PREEMPT_MARGIN_S,
    RAY_CONDITION_PROVISIONED,
    RAY_CONDITION_SUSPENDED,
    RAY_STATE_READY,
    RAY_STATE_SUSPENDED,
    ConditionType,
    EventReason,
    Phase,
    RayJobStatus,
    Reason,
)
from rldock.operator.facts import PodSetObservation, RoundFacts, Suspension, failed_on_spec
from rldock.operator.rules import Rule


class _Cond(NamedTuple):
    status: bool
    reason: Reason
    message: str = ""


class Event(NamedTuple):
    type: str  # "Normal" or "Warning"
    reason: EventReason
    message: str


class _Updates(dict[ConditionType, _Cond | None]):
    """Condition updates of one round: a value sets the condition, None removes it."""

    def set(self, type_: ConditionType, status: bool, reason: Reason, message: str = "") -> None:
        self[type_] = _Cond(status, reason, message)

    def drop(self, type_: ConditionType) -> None:
        self[type_] = None


_ORDER = list(ConditionType)


def compute_status(f: RoundFacts, rule: Rule) -> dict[str, Any]:
    """The status the RLJob should have now, as the camelCase dict to write, under `rule`
    (rules.classify of the same facts)."""
    assert rule is not Rule.MANAGED_ELSEWHERE, "a job managed elsewhere gets no status from this operator"
    prev = f.previous
    if rule is Rule.FINISHED:
        finished_status = prev.model_copy(update={"observed_generation": f.generation})
        _set_pod_sets(finished_status, f, prev)
        return _dump(finished_status)
    if rule is Rule.REFUSED:
        phase, ray_job_id = Phase.FAILED, None
        conditions = (
            _refused(Reason.INVALID_SPEC, f.problems) if f.problems else _refused(Reason.POLICY_DENIED, f.denied)
        )
    else:
        conditions = _Updates()
        phase = _decide(f, rule, conditions)
        # Every condition carries a message: an empty string reads as null on some API servers
        # (seen on the 1.20 test control plane), which the schema refuses.
        conditions.set(ConditionType.SPEC_VALID, True, Reason.VALID, "the spec passed validation")
        _mismatch_budget(f, conditions)
        _grace_period(f, conditions)
        if failed_on_spec(prev) and ConditionType.FAILED not in conditions:
            conditions.drop(ConditionType.FAILED)  # the spec was fixed: its failure no longer holds
        ray_job_id = f.ray_job.submission_id if f.ray_job else None

    status = RLJobStatus(
        phase=phase,
        conditions=_merge_conditions(prev, conditions, f.generation, f.now),
        restart_count=f.restart_count,
        attempt=f.attempt,
        ray_cluster_name=naming.ray_cluster_name(f.name),
        ray_job_id=ray_job_id,
        last_checkpoint=f.last_checkpoint or prev.last_checkpoint,
        start_time=prev.start_time or (f.now if phase is Phase.RUNNING else None),
        completion_time=(prev.completion_time or f.now) if phase.is_terminal else None,
        observed_generation=f.generation,
    )
    _set_progress(status, f.spec, f.metrics, prev)
    _set_pod_sets(status, f, prev)
    return _dump(status)


def _mismatch_budget(f: RoundFacts, out: _Updates) -> None:
    """RolloutMismatch (spec.job.monitoring.mismatch): the last progress line's mismatch against the budget;
    left as it was in a round that read no new line."""
    budget = f.spec.job.monitoring.mismatch if f.spec is not None else None
    if budget is None or f.metrics is None or MISMATCH_KL not in f.metrics:
        return
    kl, iteration = float(f.metrics[MISMATCH_KL]), int(f.metrics["iteration"])
    figure = f"iteration {iteration}: mismatch/kl {kl:.4g}"
    if kl > budget.max_kl:
        message = (
            f"{figure} is over spec.job.monitoring.mismatch.max_kl {budget.max_kl:.4g}: correct for it with "
            "spec.job.algorithm.rollout_correction, generate in the trainer's precision (spec.job.rollout.dtype) "
            "or raise the budget (docs/algorithms/rollout-correction.md)"
        )
        out.set(ConditionType.ROLLOUT_MISMATCH, True, Reason.OVER_BUDGET, message)
    else:
        message = f"{figure} is within spec.job.monitoring.mismatch.max_kl {budget.max_kl:.4g}"
        out.set(ConditionType.ROLLOUT_MISMATCH, False, Reason.WITHIN_BUDGET, message)


def _grace_period(f: RoundFacts, out: _Updates) -> None:
    """GracePeriodSufficient: whether a stop as the last progress line measures it (the iteration under way may
    take an iteration's seconds, then a checkpoint's save; before the first checkpoint, the driver's estimate of
    the save) fits in what spec.preemption.gracePeriodSeconds leaves the driver; left as it was in a round that
    read no new line, or one with neither figure of a save."""
    metrics = f.metrics or {}
    save_key = CHECKPOINT_S if CHECKPOINT_S in metrics else CHECKPOINT_ESTIMATE_S
    if f.spec is None or not {ITERATION_S, save_key} <= metrics.keys():
        return
    iteration_s, checkpoint_s = float(metrics[ITERATION_S]), float(metrics[save_key])
    need, grace = iteration_s + checkpoint_s, f.spec.preemption.grace_period_seconds
    room = grace - PREEMPT_MARGIN_S
    save = "a checkpoint" if save_key == CHECKPOINT_S else "a checkpoint as estimated before the first"
    figures = f"a stop takes up to {need:.0f} s (an iteration {iteration_s:.0f} s, then {save} {checkpoint_s:.0f} s)"
    if need <= room:
        message = f"{figures}, within the {room} s spec.preemption.gracePeriodSeconds {grace} leaves the driver"
        out.set(ConditionType.GRACE_PERIOD_SUFFICIENT, True, Reason.STOP_FITS, message)
        return
    enough = max(30, math.ceil(need * 1.5) + PREEMPT_MARGIN_S)
    message = (
        f"{figures}, more than the {room} s spec.preemption.gracePeriodSeconds {grace} leaves the driver: a "
        "preemption would end the driver before its checkpoint, and the next attempt would resume from the last "
        f"periodic one; set spec.preemption.gracePeriodSeconds to at least {enough}"
    )
    out.set(ConditionType.GRACE_PERIOD_SUFFICIENT, False, Reason.STOP_TOO_SLOW, message)


def _refused(reason: Reason, problems: Sequence[Problem]) -> _Updates:
    """SpecValid and Failed for a spec that may not run: invalid, or outside the admin's policy."""
    message = "; ".join(str(p) for p in problems)
    conditions = _Updates()
    conditions.set(ConditionType.SPEC_VALID, False, reason, message)
    conditions.set(ConditionType.FAILED, True, reason, message)
    return conditions


class _Cluster(NamedTuple):
    """What the RayCluster's state means for the phase before the job runs."""

    ready: bool
    waiting_for_admission: bool  # Kueue holds it suspended


def _decide(f: RoundFacts, rule: Rule, out: _Updates) -> Phase:
    """Phase and conditions for a valid spec under `rule`: the suspends say all themselves; below them
    a resumed job says so, and the cluster's conditions are set before the attempt's rule decides."""
    if rule in _SUSPENDED:
        return _SUSPENDED[rule](f, out)
    was_suspended = f.previous.condition(ConditionType.SUSPENDED)
    if was_suspended is not None and was_suspended.status == "True":
        out.set(ConditionType.SUSPENDED, False, Reason.RESUMED, "resuming from the last checkpoint")
    if rule is Rule.BLOCKED:
        return _blocked(f, out)
    return _ATTEMPT[rule](f, out, _cluster_conditions(f, out))


def _suspended(f: RoundFacts, out: _Updates) -> Phase:
    cluster_name = naming.ray_cluster_name(f.name)
    out.set(
        ConditionType.SUSPENDED,
        True,
        Reason.SUSPENDED_BY_USER,
        "the cluster is freed and the checkpoint kept; unset spec.suspend to resume",
    )
    out.set(
        ConditionType.CLUSTER_READY,
        False,
        Reason.RAY_CLUSTER_SUSPENDED,
        f"RayCluster {cluster_name} is " + ("suspended" if f.cluster is not None else "deleted"),
    )
    out.set(ConditionType.RUNNING, False, Reason.SUSPENDED_BY_USER, "the Ray job is stopped")
    out.drop(ConditionType.PODS_SCHEDULED)  # no pods to schedule
    return Phase.SUSPENDED


def _suspended_by_other(f: RoundFacts, out: _Updates) -> Phase:
    cluster_name = naming.ray_cluster_name(f.name)
    out.set(
        ConditionType.SUSPENDED,
        True,
        Reason.SUSPENDED_EXTERNALLY,
        f"RayCluster {cluster_name} was suspended by another controller or an admin, not by this RLJob's "
        "spec.suspend; the operator leaves it suspended, counts no restart, and resumes from the last "
        "checkpoint once they unsuspend it",
    )
    out.set(ConditionType.CLUSTER_READY, False, Reason.RAY_CLUSTER_SUSPENDED, f"RayCluster {cluster_name} is suspended")
    out.set(ConditionType.RUNNING, False, Reason.SUSPENDED_EXTERNALLY, "the Ray job stopped with its cluster")
    out.drop(ConditionType.PODS_SCHEDULED)
    return Phase.SUSPENDED


_SUSPENDED: dict[Rule, Callable[[RoundFacts, _Updates], Phase]] = {
    Rule.SUSPENDED: _suspended,
    Rule.SUSPENDED_BY_OTHER: _suspended_by_other,
}


def _blocked(f: RoundFacts, out: _Updates) -> Phase:
    assert f.blocked is not None
    out.set(ConditionType.CLUSTER_READY, False, f.blocked.reason, f.blocked.message)
    out.set(
        ConditionType.RUNNING, False, Reason.RAY_JOB_NOT_SUBMITTED, "the Ray job is submitted once the cluster is ready"
    )
    return Phase.RETRYING if f.restart_count > 0 else Phase.PENDING


def _attempt_refused(f: RoundFacts, out: _Updates, cluster: _Cluster) -> Phase:
    job = f.ray_job
    assert job is not None and job.failure is not None
    # The runtime refused its inputs (a path missing in the pods): every retry would fail the
    # same way, so the RLJob fails now with the runtime's reason and the fields to fix.
    reason = Reason(job.failure.reason.value)
    # a budget the run passed (monitoring.mismatch, action stop) stops it after a checkpoint
    what = "stopped the job" if reason is Reason.ROLLOUT_MISMATCH else "refused to start"
    message = f"Ray job {job.submission_id}: the runtime {what} (not retried): " + job.failure.message(
        field_prefix="spec.job."
    )
    out.set(ConditionType.RUNNING, False, reason, message)
    out.set(ConditionType.FAILED, True, reason, message)
    return Phase.FAILED


def _resumed_after_preemption(f: RoundFacts, out: _Updates, what: str) -> None:
    """Preempted=False (Resumed) once the attempt after a preemption runs, or finished before a round saw it run."""
    preempted = f.previous.condition(ConditionType.PREEMPTED)
    if preempted is not None and preempted.status == "True":
        out.set(ConditionType.PREEMPTED, False, Reason.RESUMED, f"{what}, from the checkpoint the stop left")


def _attempt_succeeded(f: RoundFacts, out: _Updates, cluster: _Cluster) -> Phase:
    assert f.ray_job is not None
    _resumed_after_preemption(f, out, f"Ray job {f.ray_job.submission_id} ran again after the preemption")
    out.set(ConditionType.RUNNING, False, Reason.RAY_JOB_SUCCEEDED, f"Ray job {f.ray_job.submission_id} succeeded")
    out.set(
        ConditionType.COMPLETE, True, Reason.RAY_JOB_SUCCEEDED, f"all {f.valid_spec.job.iterations} iterations done"
    )
    return Phase.SUCCEEDED


def _attempt_failed(f: RoundFacts, out: _Updates, cluster: _Cluster) -> Phase:
    failure, restarts, limit = f.attempt_failure, f.restart_count, f.valid_spec.backoff_limit
    assert failure is not None
    reason, message = failure
    out.set(ConditionType.RUNNING, False, reason, message)
    if f.retries_left:
        out.set(
            ConditionType.RETRYING,
            True,
            reason,
            f"restart {restarts + 1} of {limit}, resuming from the last checkpoint: {message}",
        )
        return Phase.RETRYING
    out.set(
        ConditionType.FAILED,
        True,
        Reason.BACKOFF_LIMIT_EXCEEDED,
        f"failed after {restarts} restart(s) (backoffLimit {limit}): {message}",
    )
    return Phase.FAILED


def _last_reported(f: RoundFacts) -> str:
    """The iteration under way when a pod is deleted, as the Preempted messages name it."""
    last = f.previous.iteration
    return f" (the last it reported: {last})" if last else ""


def _preempted(f: RoundFacts, out: _Updates, cluster: _Cluster) -> Phase:
    out.set(
        ConditionType.PREEMPTED,
        True,
        Reason.HEAD_POD_DELETED,
        f"the head pod {f.head_terminating} is being deleted while the job ran (a node drain, a preemption, a "
        f"deleted pod): its preStop hook stops the driver, which finishes the iteration under way"
        f"{_last_reported(f)}, checkpoints it and exits; the next attempt resumes after it on the new head, and no "
        "restart is counted",
    )
    out.set(
        ConditionType.RUNNING, False, Reason.HEAD_POD_DELETED, f"the Ray job stops with head pod {f.head_terminating}"
    )
    return _before_the_job(f, cluster)


def _worker_drained(f: RoundFacts, out: _Updates) -> None:
    """Preempted=True (WorkerPodDeleted) from the first round that sees a worker pod of the running attempt being
    deleted alone until the next attempt runs: the record `RoundFacts.drained` reads once the pod is gone."""
    out.set(
        ConditionType.PREEMPTED,
        True,
        Reason.WORKER_POD_DELETED,
        f"worker pod {', '.join(f.workers_terminating)} is being deleted while the job runs (a node drain, an "
        f"eviction, a deleted pod): its preStop hook has the driver finish the iteration under way"
        f"{_last_reported(f)} and save it; the attempt ends once the pod is gone, and the next resumes after that "
        "iteration, no restart counted",
    )


def _worker_drained_attempt(f: RoundFacts, out: _Updates, cluster: _Cluster) -> Phase:
    failure = f.attempt_failure
    assert failure is not None  # Preempted=True stays as the rounds that saw the pod terminating set it
    out.set(
        ConditionType.RUNNING,
        False,
        Reason.WORKER_POD_DELETED,
        f"{failure[1]}, drained: the next attempt resumes after the iteration it saved",
    )
    return _before_the_job(f, cluster)


def _attempt_running(f: RoundFacts, out: _Updates, cluster: _Cluster) -> Phase:
    job = f.ray_job
    assert job is not None
    if job.status is RayJobStatus.RUNNING:
        out.set(ConditionType.RUNNING, True, Reason.RAY_JOB_RUNNING, f"Ray job {job.submission_id} is running")
        if f.restart_count > 0:
            out.set(ConditionType.RETRYING, False, Reason.RECOVERED, f"running again after restart {f.restart_count}")
        if f.draining:
            _worker_drained(f, out)
        else:
            _resumed_after_preemption(f, out, f"Ray job {job.submission_id} runs again after the preemption")
        return Phase.RUNNING
    # PENDING: submitted, the driver has not started; the cluster decides the phase, as before a job.
    out.set(
        ConditionType.RUNNING,
        False,
        Reason.RAY_JOB_PENDING,
        f"Ray job {job.submission_id} is waiting for its driver to start",
    )
    return _before_the_job(f, cluster)


def _starting(f: RoundFacts, out: _Updates, cluster: _Cluster) -> Phase:
    out.set(
        ConditionType.RUNNING,
        False,
        Reason.RAY_JOB_NOT_SUBMITTED,
        "submitting the Ray job" if cluster.ready else "the Ray job is submitted once the cluster is ready",
    )
    return _before_the_job(f, cluster)


def _before_the_job(f: RoundFacts, cluster: _Cluster) -> Phase:
    if f.restart_count > 0:
        return Phase.RETRYING  # the Retrying condition of the failure stays as it was
    if f.cluster is None or cluster.waiting_for_admission:
        return Phase.PENDING
    return Phase.PROVISIONING


_ATTEMPT: dict[Rule, Callable[[RoundFacts, _Updates, _Cluster], Phase]] = {
    Rule.PREEMPTED: _preempted,
    Rule.ATTEMPT_REFUSED: _attempt_refused,
    Rule.ATTEMPT_SUCCEEDED: _attempt_succeeded,
    Rule.WORKER_DRAINED: _worker_drained_attempt,
    Rule.ATTEMPT_FAILED: _attempt_failed,
    Rule.ATTEMPT_RUNNING: _attempt_running,
    Rule.STARTING: _starting,
}


def _cluster_conditions(f: RoundFacts, out: _Updates) -> _Cluster:
    """Sets ClusterReady from KubeRay's RayCluster status (and its spec.suspend, which KubeRay's
    status follows a moment later), and PodsScheduled from the pods the scheduler cannot place."""
    cluster = _cluster_ready(f, out)
    if f.unschedulable:
        messages = dict.fromkeys(f.unschedulable)  # unique, in order
        out.set(ConditionType.PODS_SCHEDULED, False, Reason.UNSCHEDULABLE, "; ".join(messages))
    elif f.cluster is not None:
        out.set(ConditionType.PODS_SCHEDULED, True, Reason.SCHEDULED, "no pod is waiting for a node")
    else:
        out.drop(ConditionType.PODS_SCHEDULED)
    return cluster


def _cluster_ready(f: RoundFacts, out: _Updates) -> _Cluster:
    cluster_name, status = naming.ray_cluster_name(f.name), f.cluster_status
    if status is None:
        out.set(ConditionType.CLUSTER_READY, False, Reason.RAY_CLUSTER_CREATING, f"creating RayCluster {cluster_name}")
        return _Cluster(ready=False, waiting_for_admission=False)
    kuberay_conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or ()}
    if (
        f.suspension is Suspension.OTHER
        or status.get("state") == RAY_STATE_SUSPENDED
        or kuberay_conditions.get(RAY_CONDITION_SUSPENDED) == "True"
    ):
        # spec.suspend is false here, so someone else holds the cluster: Kueue until it admits it.
        if f.kueue:
            spec = f.valid_spec
            out.set(
                ConditionType.CLUSTER_READY,
                False,
                Reason.WAITING_FOR_ADMISSION,
                f"Kueue has not admitted RayCluster {cluster_name} from queue {spec.scheduling.queue} yet",
            )
            return _Cluster(ready=False, waiting_for_admission=True)
        out.set(
            ConditionType.CLUSTER_READY, False, Reason.RAY_CLUSTER_SUSPENDED, f"RayCluster {cluster_name} is suspended"
        )
        return _Cluster(ready=False, waiting_for_admission=False)
    num_workers = f.valid_spec.job.resources.num_nodes
    if status.get("state") == RAY_STATE_READY or kuberay_conditions.get(RAY_CONDITION_PROVISIONED) == "True":
        out.set(ConditionType.CLUSTER_READY, True, Reason.RAY_CLUSTER_READY, f"head and {num_workers} worker(s) ready")
        return _Cluster(ready=True, waiting_for_admission=False)
    # KubeRay counts the rollout pool's pods among its ready workers (every worker group's)
    pool = f.valid_spec.job.rollout.pool
    expected = (
        f"{num_workers + pool.replicas} (the trainer's {num_workers}, the rollout pool's {pool.replicas})"
        if pool is not None
        else num_workers
    )
    out.set(
        ConditionType.CLUSTER_READY,
        False,
        Reason.RAY_CLUSTER_PROVISIONING,
        f"{status.get('readyWorkerReplicas') or 0}/{expected} workers ready",
    )
    return _Cluster(ready=False, waiting_for_admission=False)


def _merge_conditions(prev: RLJobStatus, new: _Updates, generation: int | None, now: datetime) -> list[Condition]:
    """New values win; a None value removes the condition; conditions not mentioned carry over.

    lastTransitionTime moves only when the True/False status flips, so an unchanged situation
    yields an identical status and no patch.
    """
    merged = {c.type: c for c in prev.conditions}
    for type_, cond in new.items():
        if cond is None:
            merged.pop(type_, None)
            continue
        status: Literal["True", "False"] = "True" if cond.status else "False"
        message = shorten(cond.message)
        old = merged.get(type_)
        merged[type_] = Condition(
            type=type_,
            status=status,
            reason=cond.reason,
            message=message,
            last_transition_time=now if old is None or old.status != status else old.last_transition_time,
            observed_generation=generation,
        )
    return [merged[t] for t in _ORDER if t in merged]


def shorten(message: str, limit: int = CONDITION_MESSAGE_MAX) -> str:
    """`message` cut in the middle to at most `limit` characters, saying how much was cut."""
    if len(message) <= limit:
        return message
    infix = f" ... [{len(message) - limit} characters cut] ... "
    keep = limit - len(infix)
    return message[: keep // 2] + infix + message[len(message) - (keep - keep // 2) :]


def _set_progress(
    status: RLJobStatus, spec: RLJobSpec | None, metrics: Mapping[str, Any] | None, prev: RLJobStatus
) -> None:
    status.iteration, status.reward = prev.iteration, prev.reward
    status.tokens_per_second_per_device = prev.tokens_per_second_per_device
    status.last_evaluation = prev.last_evaluation
    status.rollout_mismatch_kl = prev.rollout_mismatch_kl
    if metrics is not None:  # keys as rldock.runtime.driver.trainer writes each iteration's record
        status.iteration = int(metrics["iteration"])
        status.reward = round(float(metrics[headline_key(metrics)]), 4)  # DPO: preference accuracy
        status.tokens_per_second_per_device = round(float(metrics["tokens_per_s_per_device"]), 1)
        status.last_evaluation = last_evaluation(metrics) or status.last_evaluation
        if MISMATCH_KL in metrics:
            status.rollout_mismatch_kl = float(metrics[MISMATCH_KL])
    status.iterations = spec.job.iterations if spec is not None else prev.iterations
    if status.iterations is not None:
        status.progress = f"{status.iteration or 0}/{status.iterations}"


def _set_pod_sets(status: RLJobStatus, f: RoundFacts, prev: RLJobStatus) -> None:
    """`environments` and `environmentsReady` ("ready/replicas" summed) from this round's Deployments,
    or as they were when the round did not look; neither without environments; `agents` and
    `agentsReady` alike."""
    for section in ("environments", "agents"):
        observed: Sequence[PodSetObservation] | None = getattr(f, section)
        ready = f"{section}_ready"
        if observed is None:
            setattr(status, section, getattr(prev, section))
            setattr(status, ready, getattr(prev, ready))
            continue
        listed = [
            PodSetStatus(name=seen.name, replicas=seen.replicas, ready_replicas=seen.ready_replicas)
            for seen in observed
        ]
        setattr(status, section, listed or None)
        summed = f"{sum(seen.ready_replicas for seen in observed)}/{sum(seen.replicas for seen in observed)}"
        setattr(status, ready, summed if observed else None)


def last_evaluation(metrics: Mapping[str, Any]) -> LastEvaluation | None:
    """The evaluation a progress record carries (rldock.contract.progress.evaluation_headline), or
    None when the job has not evaluated yet."""
    if not {VAL_ITERATION, VAL_REWARD, VAL_ACCURACY} <= metrics.keys():
        return None
    return LastEvaluation(
        iteration=int(metrics[VAL_ITERATION]),
        reward=round(float(metrics[VAL_REWARD]), 4),
        accuracy=round(float(metrics[VAL_ACCURACY]), 4),
    )


def parse_status(raw: Mapping[str, Any] | None) -> RLJobStatus:
    """The previous status; one this operator cannot read (another version wrote it) counts as empty."""
    try:
        return RLJobStatus.model_validate(raw or {})
    except ValidationError:
        return RLJobStatus()


def _dump(status: RLJobStatus) -> dict[str, Any]:
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)


def rejected_status(
    *, previous: Mapping[str, Any] | None, message: str, generation: int | None, now: datetime
) -> dict[str, Any]:
    """A short status for when the API server refused the computed one: the phase and counts as
    they were, and SpecValid=False saying why (a refusal that repeats is a spec too large)."""
    prev = parse_status(previous)
    updates = _Updates()
    updates.set(ConditionType.SPEC_VALID, False, Reason.STATUS_REJECTED, message)
    # Only SpecValid carries over (its transition time), so the short status stays short.
    spec_valid = RLJobStatus(conditions=[c for c in prev.conditions if c.type is ConditionType.SPEC_VALID])
    status = RLJobStatus(
        phase=prev.phase or Phase.PENDING,
        restart_count=prev.restart_count,
        attempt=prev.attempt,
        ray_job_id=prev.ray_job_id,
        ray_cluster_name=prev.ray_cluster_name,
        conditions=_merge_conditions(spec_valid, updates, generation, now),
        observed_generation=generation,
    )
    return _dump(status)


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch turning `old` into `new` (null removes fields `new` no longer has)."""
    return {**{key: None for key in old if key not in new}, **new}


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether `new` differs from the stored status (absent and null fields are the same)."""
    return _without_nulls(old or {}) != _without_nulls(new)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


# keyed by str: Condition.reason is a plain str, and a Reason (a str Enum) equals its value
_SPEC_EVENTS: dict[str, EventReason] = {
    Reason.STATUS_REJECTED: EventReason.STATUS_REJECTED,
    Reason.POLICY_DENIED: EventReason.POLICY_DENIED,
}
_BLOCKED_EVENTS: dict[str, EventReason] = {
    Reason.NAME_CONFLICT: EventReason.NAME_CONFLICT,
    Reason.CREATE_REFUSED: EventReason.CREATE_REFUSED,
    Reason.TOKEN_REFUSED: EventReason.TOKEN_REFUSED,
}
_INPUT_EVENTS: dict[str, EventReason] = {
    Reason.PATH_NOT_FOUND: EventReason.PATH_NOT_FOUND,
    Reason.INVALID_JOB_INPUT: EventReason.INVALID_JOB_INPUT,
    Reason.ROLLOUT_MISMATCH: EventReason.ROLLOUT_MISMATCH,
}


def status_events(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[Event]:
    """Events for the transitions between two statuses (none when nothing meaningful changed)."""
    before, after = parse_status(old), parse_status(new)
    events: list[Event] = []

    def became(type_: ConditionType, status: str) -> Condition | None:
        cond, was = after.condition(type_), before.condition(type_)
        if cond is None or cond.status != status:
            return None
        unchanged = was is not None and (was.status, was.reason, was.message) == (
            cond.status,
            cond.reason,
            cond.message,
        )
        return None if unchanged else cond

    if (cond := became(ConditionType.SPEC_VALID, "False")) is not None:
        events.append(Event("Warning", _SPEC_EVENTS.get(cond.reason, EventReason.INVALID_SPEC), cond.message))
    if (cond := became(ConditionType.CLUSTER_READY, "False")) is not None and cond.reason in _BLOCKED_EVENTS:
        events.append(Event("Warning", _BLOCKED_EVENTS[cond.reason], cond.message))
    if (cond := became(ConditionType.PODS_SCHEDULED, "False")) is not None:
        events.append(Event("Warning", EventReason.UNSCHEDULABLE, cond.message))
    if (cond := became(ConditionType.GRACE_PERIOD_SUFFICIENT, "False")) is not None:
        events.append(Event("Warning", EventReason.GRACE_PERIOD_TOO_SHORT, cond.message))
    if (cond := became(ConditionType.PREEMPTED, "True")) is not None:
        events.append(Event("Warning", EventReason.PREEMPTED, cond.message))
    if (cond := became(ConditionType.PREEMPTED, "False")) is not None and cond.reason == Reason.RESUMED:
        events.append(Event("Normal", EventReason.RESUMED, cond.message))
    over, was_over = after.condition(ConditionType.ROLLOUT_MISMATCH), before.condition(ConditionType.ROLLOUT_MISMATCH)
    if over is not None and over.status == "True" and (was_over is None or was_over.status != "True"):
        events.append(
            Event("Warning", EventReason.ROLLOUT_MISMATCH, over.message)
        )  # once per passing, not per iteration
    if after.ray_job_id is not None and after.ray_job_id != before.ray_job_id:
        events.append(
            Event(
                "Normal",
                EventReason.SUBMITTED_RAY_JOB,
                f"submitted Ray job {after.ray_job_id} (attempt {after.attempt})",  # compute_status writes it
            )
        )
    if after.phase is not before.phase:
        if after.phase is Phase.RETRYING and (cond := after.condition(ConditionType.RETRYING)) is not None:
            events.append(Event("Warning", EventReason.RETRYING, cond.message))
        cond = became(ConditionType.FAILED, "True")
        if cond is not None and cond.reason == Reason.BACKOFF_LIMIT_EXCEEDED:
            events.append(Event("Warning", EventReason.BACKOFF_LIMIT_EXCEEDED, cond.message))
        if cond is not None and cond.reason in _INPUT_EVENTS:
            events.append(Event("Warning", _INPUT_EVENTS[cond.reason], cond.message))
        if after.phase is Phase.SUCCEEDED:
            events.append(Event("Normal", EventReason.SUCCEEDED, f"finished {after.progress} iterations"))
        suspended = after.condition(ConditionType.SUSPENDED)
        if after.phase is Phase.SUSPENDED and suspended is not None and suspended.reason == Reason.SUSPENDED_EXTERNALLY:
            events.append(Event("Warning", EventReason.SUSPENDED_EXTERNALLY, suspended.message))
        elif after.phase is Phase.SUSPENDED:
            events.append(Event("Normal", EventReason.SUSPENDED, "suspended: freeing the cluster"))
        if before.phase is Phase.SUSPENDED:
            events.append(Event("Normal", EventReason.RESUMED, "resuming from the last checkpoint"))
    return events


def seconds_until_expiry(*, spec: RLJobSpec, status: Mapping[str, Any], now: datetime) -> float | None:
    """Seconds until ttlSecondsAfterFinished deletes a finished RLJob (<= 0: delete now); None: never."""
    parsed = parse_status(status)
    if spec.ttl_seconds_after_finished is None or parsed.completion_time is None:
        return None
    if parsed.phase is None or not parsed.phase.is_terminal:
        return None
    return spec.ttl_seconds_after_finished - (now - parsed.completion_time).total_seconds()
