"""A preempted head (operator side, rules.PREEMPTED): the head pod is deleted while the job runs (a node drain,
a preemption, `kubectl delete pod`); its preStop hook stops the driver after a checkpoint. The operator records
Preempted from its stored status, the one record that outlives the head, counts no restart, submits the same
attempt to the new head, and says Resumed when it runs. A head lost without a deletion the operator saw still
fails the attempt (RayJobFailed) and counts a restart."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

from rljob_testing import round_facts, spec_dict

from rldock.operator.actions import CountRestart, SubmitJob, next_actions
from rldock.operator.api import RLJobSpec
from rldock.operator.constants import EventReason, Phase, RayJobStatus
from rldock.operator.facts import RayJobObservation
from rldock.operator.observe import job_observation, summarize_pods
from rldock.operator.rules import Rule, classify
from rldock.operator.status import compute_status, parse_status, status_events

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
JOB_ID = "rldock-grpo-0f5c2a6e-0"
READY = {"state": "ready", "readyWorkerReplicas": 2}
SPEC = RLJobSpec.model_validate(spec_dict())
HEAD = "grpo-raycluster-head-x7k2p"


def head_pod(*, deleting: bool) -> dict:
    meta = {"name": HEAD, "labels": {"ray.io/node-type": "head"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-03-01T12:00:00Z"
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    return {"metadata": meta, "spec": {"nodeName": "n1"}, "status": status}


def a_round(previous: dict | None, *, at: int, **observed):
    """(facts, rule, status, actions) of one round that looked at a ready cluster."""
    facts = round_facts(spec=SPEC, previous=previous, now=NOW + timedelta(seconds=at), ray_cluster=READY, **observed)
    rule = classify(facts)
    assert rule is not None
    return facts, rule, compute_status(facts, rule), next_actions(facts, rule)


def conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def running_status() -> dict:
    running = RayJobObservation(submission_id=JOB_ID, status=RayJobStatus.RUNNING)
    metrics = {"iteration": 7, "reward_mean": 0.5, "tokens_per_s_per_device": 100.0}
    _, rule, status, _ = a_round(None, at=0, ray_job=running, metrics=metrics)
    assert rule is Rule.ATTEMPT_RUNNING and status["phase"] == "Running" and status["iteration"] == 7
    return status


def test_the_summary_names_a_head_pod_being_deleted():
    assert summarize_pods([head_pod(deleting=True)]).head_terminating == HEAD
    summary = summarize_pods([head_pod(deleting=False)])
    assert summary.head_terminating is None and summary.head_running


def test_a_head_deleted_while_the_job_runs_is_a_preemption_resumed_as_the_same_attempt():
    running = running_status()
    # The head terminates: the round reads no Jobs API (the head no longer runs), so the job looks lost.
    lost = job_observation(JOB_ID, None, previous=parse_status(running))
    assert lost is not None and lost.status is RayJobStatus.FAILED
    facts, rule, preempted, actions = a_round(running, at=10, ray_job=lost, head_terminating=HEAD)
    assert rule is Rule.PREEMPTED and facts.preempted
    assert actions == []  # the hook stops the driver; no restart counted, nothing stopped
    assert preempted["restartCount"] == 0 and preempted["phase"] == Phase.PROVISIONING.value
    assert conditions(preempted)["Preempted"] == ("True", "HeadPodDeleted")
    assert conditions(preempted)["Running"] == ("False", "HeadPodDeleted")
    message = next(c["message"] for c in preempted["conditions"] if c["type"] == "Preempted")
    assert HEAD in message and "the last it reported: 7" in message
    events = status_events(running, preempted)
    assert [(e.type, e.reason) for e in events] == [("Warning", EventReason.PREEMPTED)]

    # A later round while the pod still terminates: still Preempted, the same message, no second Event.
    _, rule, again, actions = a_round(preempted, at=15, ray_job=None, head_terminating=HEAD)
    assert rule is Rule.PREEMPTED and actions == [] and status_events(preempted, again) == []

    # The head is gone and KubeRay made a new one: no job there, and none is a failure (the stored phase is
    # not Running any more): the same attempt is submitted, no restart counted.
    assert job_observation(JOB_ID, None, previous=parse_status(again)) is None
    _, rule, starting, actions = a_round(again, at=30, ray_job=None, ready_to_submit=True)
    assert rule is Rule.STARTING and actions == [SubmitJob(0)]
    assert not any(isinstance(a, CountRestart) for a in actions)
    assert conditions(starting)["Preempted"] == ("True", "HeadPodDeleted")  # until the attempt runs

    # The attempt runs again (resumed from the checkpoint the stopped driver saved).
    resumed_job = RayJobObservation(submission_id=JOB_ID, status=RayJobStatus.RUNNING)
    _, rule, resumed, _ = a_round(starting, at=40, ray_job=resumed_job)
    assert rule is Rule.ATTEMPT_RUNNING and resumed["phase"] == "Running" and resumed["restartCount"] == 0
    assert conditions(resumed)["Preempted"] == ("False", "Resumed")
    assert ("Normal", EventReason.RESUMED) in [(e.type, e.reason) for e in status_events(starting, resumed)]


def test_a_head_lost_without_a_deletion_seen_fails_the_attempt_and_counts_a_restart():
    running = running_status()
    lost = job_observation(JOB_ID, None, previous=parse_status(running))
    _, rule, status, actions = a_round(running, at=10, ray_job=lost)
    assert rule is Rule.ATTEMPT_FAILED and CountRestart() in actions
    assert "Preempted" not in conditions(status)


def test_a_head_deleted_with_its_cluster_or_before_the_job_ran_is_no_preemption():
    running = running_status()
    lost = job_observation(JOB_ID, None, previous=parse_status(running))
    facts, rule, _, _ = a_round(running, at=10, ray_job=lost, head_terminating=HEAD)
    assert rule is Rule.PREEMPTED
    deleted = facts.cluster | {"metadata": {"deletionTimestamp": "2026-03-01T12:00:00Z"}}
    assert not replace(facts, cluster=deleted).preempted  # the cluster goes (released, replaced)
    suspended = facts.cluster | {"spec": {"suspend": True}}
    assert not replace(facts, cluster=suspended).preempted  # suspended: the suspend rules say it
    _, rule, _, _ = a_round(None, at=0, ray_job=None, head_terminating=HEAD)  # never ran: nothing to save
    assert rule is Rule.STARTING


def test_the_grace_period_is_held_to_what_a_stop_takes():
    """GracePeriodSufficient from the progress line's figures: an iteration's seconds and a checkpoint's save
    against spec.preemption.gracePeriodSeconds less the 15 s Ray's own stop keeps; False names the value to set
    and is a Warning Event once; no figures yet (no checkpoint saved): no condition."""
    running = RayJobObservation(submission_id=JOB_ID, status=RayJobStatus.RUNNING)
    line = {"iteration": 7, "reward_mean": 0.5, "tokens_per_s_per_device": 100.0, "iteration_s": 40.0}
    _, _, first, _ = a_round(None, at=0, ray_job=running, metrics=line)
    assert "GracePeriodSufficient" not in conditions(first)  # neither a checkpoint's save nor its estimate
    # Before the first checkpoint, the driver's estimate of a save stands in for it.
    short = RLJobSpec.model_validate(spec_dict(preemption={"gracePeriodSeconds": 60}))
    facts = round_facts(
        spec=short, now=NOW, ray_cluster=READY, ray_job=running, metrics=line | {"checkpoint_estimate_s": 30.0}
    )
    estimated = compute_status(facts, Rule.ATTEMPT_RUNNING)
    assert conditions(estimated)["GracePeriodSufficient"] == ("False", "StopTooSlow")
    message = next(c["message"] for c in estimated["conditions"] if c["type"] == "GracePeriodSufficient")
    assert "then a checkpoint as estimated before the first 30 s" in message and message.endswith("at least 120")
    _, _, fits, _ = a_round(first, at=5, ray_job=running, metrics=line | {"checkpoint_s": 20.0})
    assert conditions(fits)["GracePeriodSufficient"] == ("True", "StopFits")  # 60 s of the 285 s the default leaves
    short = RLJobSpec.model_validate(spec_dict(preemption={"gracePeriodSeconds": 60}))
    facts = round_facts(
        spec=short, previous=fits, now=NOW, ray_cluster=READY, ray_job=running, metrics=line | {"checkpoint_s": 20.0}
    )
    slow = compute_status(facts, Rule.ATTEMPT_RUNNING)
    assert conditions(slow)["GracePeriodSufficient"] == ("False", "StopTooSlow")
    message = next(c["message"] for c in slow["conditions"] if c["type"] == "GracePeriodSufficient")
    assert "up to 60 s" in message and "the 45 s spec.preemption.gracePeriodSeconds 60" in message
    assert message.endswith("at least 105")  # 1.5 x 60 s, plus the 15 s Ray's stop keeps
    assert [e.reason for e in status_events(fits, slow)] == [EventReason.GRACE_PERIOD_TOO_SHORT]
    assert status_events(slow, compute_status(facts, Rule.ATTEMPT_RUNNING)) == []  # once, not every round


def test_an_attempt_that_finishes_before_a_round_sees_it_run_still_ends_the_preemption():
    running = running_status()
    lost = job_observation(JOB_ID, None, previous=parse_status(running))
    _, _, preempted, _ = a_round(running, at=10, ray_job=lost, head_terminating=HEAD)
    done = RayJobObservation(submission_id=JOB_ID, status=RayJobStatus.SUCCEEDED)
    _, rule, succeeded, _ = a_round(preempted, at=60, ray_job=done)
    assert rule is Rule.ATTEMPT_SUCCEEDED and succeeded["phase"] == "Succeeded"
    assert conditions(succeeded)["Preempted"] == ("False", "Resumed")


def test_a_worker_pod_deleted_under_an_in_job_restart_budget_is_the_runtimes_to_recover():
    """maxRestarts > 0: the runtime restarts its workers inside the attempt (no next attempt), so a worker pod
    being deleted records no preemption; at 0 it does, from the first round that sees it."""
    running = RayJobObservation(submission_id=JOB_ID, status=RayJobStatus.RUNNING)
    budget = RLJobSpec.model_validate(spec_dict(maxRestarts=2))
    facts = round_facts(spec=budget, now=NOW, ray_cluster=READY, ray_job=running, workers_terminating=("w-1",))
    assert not facts.draining and "Preempted" not in conditions(compute_status(facts, classify(facts)))
    _, rule, status, actions = a_round(None, at=0, ray_job=running, workers_terminating=("w-1",))
    assert rule is Rule.ATTEMPT_RUNNING and actions == []
    assert conditions(status)["Preempted"] == ("True", "WorkerPodDeleted")
