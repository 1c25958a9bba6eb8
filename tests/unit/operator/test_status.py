"""The status mapping: observations -> phase, conditions and progress; patches only on change."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from rljob_testing import error_paths, job_dict, round_facts, spec_dict, status_of, validator_for

from rldock.config import Problem
from rldock.contract.progress import MISMATCH_KL
from rldock.operator.api import RLJobSpec
from rldock.operator.constants import CONDITION_MESSAGE_MAX, EventReason, RayJobStatus
from rldock.operator.crd import rljob_schema
from rldock.operator.facts import PodSetObservation, RayJobObservation
from rldock.operator.status import (
    seconds_until_expiry,
    status_changed,
    status_events,
)

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
LATER = NOW + timedelta(seconds=10)
NAME = "grpo"
JOB_ID = "rldock-grpo-0f5c2a6e-0"

READY = {"state": "ready", "readyWorkerReplicas": 2}
STARTING = {"readyWorkerReplicas": 1, "conditions": [{"type": "RayClusterProvisioned", "status": "False"}]}
HELD = {"state": "suspended"}  # Kueue suspends a RayCluster until it admits it
METRICS = {"iteration": 12, "reward_mean": 0.612345, "tokens_per_s_per_device": 1534.26, "kl": 0.01}


def _job(status: RayJobStatus, message: str = "") -> RayJobObservation:
    return RayJobObservation(submission_id=JOB_ID, status=status, message=message)


def _spec(**sections) -> RLJobSpec:
    return RLJobSpec.model_validate(spec_dict(**sections))


def _seen(**observed) -> dict:
    """What a round read of the cluster, as keyword arguments of rljob_testing.round_facts."""
    return observed


def _compute(
    observed: dict | None = None,
    *,
    spec: RLJobSpec | None = None,
    restart_count: int = 0,
    previous: dict | None = None,
    now: datetime = NOW,
    generation: int = 1,
) -> dict:
    return status_of(
        round_facts(
            name=NAME,
            spec=spec if spec is not None else _spec(),
            generation=generation,
            restart_count=restart_count,
            previous=previous,
            now=now,
            **(observed or {}),
        )
    )


def _conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status.get("conditions", [])}


KUEUE = {"scheduling": {"gang": "kueue", "queue": "team-a"}}
RUNNING = _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.RUNNING))

CASES = [
    # id, spec sections, observations, restart count, phase, conditions expected among the status's
    (
        "nothing-created",
        {},
        _seen(),
        0,
        "Pending",
        {
            "SpecValid": ("True", "Valid"),
            "ClusterReady": ("False", "RayClusterCreating"),
            "Running": ("False", "RayJobNotSubmitted"),
        },
    ),
    (
        "cluster-starting",
        {},
        _seen(ray_cluster=STARTING),
        0,
        "Provisioning",
        {"ClusterReady": ("False", "RayClusterProvisioning"), "PodsScheduled": ("True", "Scheduled")},
    ),
    (
        "new-cluster-no-status",
        {},
        _seen(ray_cluster={}),
        0,
        "Provisioning",
        {"ClusterReady": ("False", "RayClusterProvisioning")},
    ),
    (
        "unschedulable",
        {},
        _seen(ray_cluster=STARTING, unschedulable=("0/3 nodes are available: 3 Insufficient huawei.com/Ascend910.",)),
        0,
        "Provisioning",
        {"PodsScheduled": ("False", "Unschedulable")},
    ),
    (
        "kueue-holds-cluster",
        KUEUE,
        _seen(ray_cluster=HELD),
        0,
        "Pending",
        {"ClusterReady": ("False", "WaitingForAdmission")},
    ),
    (
        "suspended-by-someone",
        {},
        _seen(ray_cluster=HELD),
        0,
        "Provisioning",
        {"ClusterReady": ("False", "RayClusterSuspended")},
    ),
    (
        "ready-not-submitted",
        {},
        _seen(ray_cluster=READY),
        0,
        "Provisioning",
        {"ClusterReady": ("True", "RayClusterReady"), "Running": ("False", "RayJobNotSubmitted")},
    ),
    (
        "ready-by-condition",
        {},
        _seen(ray_cluster={"conditions": [{"type": "RayClusterProvisioned", "status": "True"}]}),
        0,
        "Provisioning",
        {"ClusterReady": ("True", "RayClusterReady")},
    ),
    (
        "job-pending",
        {},
        _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.PENDING)),
        0,
        "Provisioning",
        {"Running": ("False", "RayJobPending")},
    ),
    ("job-running", {}, RUNNING, 0, "Running", {"Running": ("True", "RayJobRunning")}),
    (
        "job-succeeded",
        {},
        _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.SUCCEEDED)),
        0,
        "Succeeded",
        {"Complete": ("True", "RayJobSucceeded"), "Running": ("False", "RayJobSucceeded")},
    ),
    (
        "succeeded-then-pod-gone",
        {},
        _seen(
            ray_cluster=READY, ray_job=_job(RayJobStatus.SUCCEEDED), lost_pods=("pod grpo-workers-worker-x deleted",)
        ),
        0,
        "Succeeded",
        {"Complete": ("True", "RayJobSucceeded")},
    ),
    (
        "job-failed",
        {},
        _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.FAILED, "HCCL timeout")),
        0,
        "Retrying",
        {"Retrying": ("True", "RayJobFailed"), "Running": ("False", "RayJobFailed")},
    ),
    (
        "job-stopped",
        {},
        _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.STOPPED)),
        1,
        "Retrying",
        {"Retrying": ("True", "RayJobStopped")},
    ),
    (
        "worker-lost",
        {},
        _seen(
            ray_cluster=STARTING,
            ray_job=_job(RayJobStatus.RUNNING),
            lost_pods=("pod grpo-workers-worker-x: OOMKilled",),
        ),
        2,
        "Retrying",
        {"Retrying": ("True", "WorkerPodLost")},
    ),
    # With an in-job restart budget the runtime recovers the lost worker; the attempt keeps running.
    (
        "worker-lost-in-job-budget",
        {"maxRestarts": 2},
        _seen(
            ray_cluster=STARTING, ray_job=_job(RayJobStatus.RUNNING), lost_pods=("pod grpo-workers-worker-x deleted",)
        ),
        0,
        "Running",
        {"Running": ("True", "RayJobRunning")},
    ),
    (
        "pod-lost-before-job",
        {},
        _seen(ray_cluster=STARTING, lost_pods=("pod x deleted",)),
        0,
        "Provisioning",
        {"ClusterReady": ("False", "RayClusterProvisioning")},
    ),
    (
        "backoff-exhausted",
        {},
        _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.FAILED)),
        3,
        "Failed",
        {"Failed": ("True", "BackoffLimitExceeded")},
    ),
    (
        "no-retries-allowed",
        {"backoffLimit": 0},
        _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.FAILED)),
        0,
        "Failed",
        {"Failed": ("True", "BackoffLimitExceeded")},
    ),
    (
        "restart-in-progress",
        {},
        _seen(ray_cluster=STARTING),
        1,
        "Retrying",
        {"Running": ("False", "RayJobNotSubmitted")},
    ),
    (
        "restart-running",
        {},
        RUNNING,
        1,
        "Running",
        {"Running": ("True", "RayJobRunning"), "Retrying": ("False", "Recovered")},
    ),
    (
        "suspended",
        {"suspend": True},
        _seen(ray_cluster=HELD),
        0,
        "Suspended",
        {
            "Suspended": ("True", "SuspendedByUser"),
            "ClusterReady": ("False", "RayClusterSuspended"),
            "Running": ("False", "SuspendedByUser"),
        },
    ),
    (
        "suspended-and-freed",
        {"suspend": True},
        _seen(),
        0,
        "Suspended",
        {"Suspended": ("True", "SuspendedByUser")},
    ),
    (
        "invalid-spec",
        {},
        _seen(problems=(Problem("spec.checkpoint", "set exactly one"),)),
        0,
        "Failed",
        {"SpecValid": ("False", "InvalidSpec"), "Failed": ("True", "InvalidSpec")},
    ),
]


@pytest.mark.parametrize(
    "sections, observed, restarts, phase, conditions", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_phase_and_conditions(sections, observed, restarts, phase, conditions):
    status = _compute(observed, spec=_spec(**sections), restart_count=restarts)
    assert status["phase"] == phase
    assert conditions.items() <= _conditions(status).items(), _conditions(status)
    assert status["restartCount"] == restarts and status["observedGeneration"] == 1
    assert status["rayClusterName"] == NAME
    # What the operator writes, the CRD accepts.
    assert error_paths(validator_for(rljob_schema()["properties"]["status"]), status) == []
    # Computing again from the result changes nothing: no patch loop.
    again = _compute(observed, spec=_spec(**sections), restart_count=restarts, previous=status, now=LATER)
    assert not status_changed(status, again), (status, again)


def test_messages_carry_what_was_observed():
    message = "0/3 nodes are available: 3 Insufficient huawei.com/Ascend910."
    status = _compute(_seen(ray_cluster=STARTING, unschedulable=(message, message)))
    (scheduled,) = [c for c in status["conditions"] if c["type"] == "PodsScheduled"]
    assert scheduled["message"] == message, "the scheduler's message, once"
    failed = _compute(_seen(ray_cluster=READY, ray_job=_job(RayJobStatus.FAILED, "HCCL timeout")), restart_count=1)
    (retrying,) = [c for c in failed["conditions"] if c["type"] == "Retrying"]
    assert "HCCL timeout" in retrying["message"] and "restart 2 of 3" in retrying["message"]
    invalid = _compute(_seen(problems=(Problem("spec.job.training.data_parallel_size", "G*N ..."),)))
    assert all(
        "spec.job.training.data_parallel_size" in c["message"]
        for c in invalid["conditions"]
        if c["status"] == "False" or c["type"] == "Failed"
    )


def test_progress_from_metrics_survives_rounds_without_them():
    status = _compute(
        _seen(
            ray_cluster=READY,
            ray_job=_job(RayJobStatus.RUNNING),
            metrics=METRICS,
            last_checkpoint="/checkpoints/ns/grpo/checkpoints/iter-000010",
        )
    )
    assert (status["iteration"], status["iterations"], status["progress"]) == (12, 40, "12/40")
    assert (status["reward"], status["tokensPerSecondPerDevice"]) == (0.6123, 1534.3)
    assert status["rayJobId"] == JOB_ID
    later = _compute(_seen(ray_cluster=STARTING), restart_count=1, previous=status, now=LATER)
    assert (later["progress"], later["reward"], later["lastCheckpoint"]) == (
        "12/40",
        0.6123,
        "/checkpoints/ns/grpo/checkpoints/iter-000010",
    )
    assert "rayJobId" not in later, "the new attempt is not submitted yet"
    assert _compute()["progress"] == "0/40"


def test_transition_times_move_only_when_a_condition_flips():
    first = _compute(_seen(ray_cluster=STARTING))
    same = _compute(_seen(ray_cluster=STARTING), previous=first, now=LATER)
    assert same == first
    ready = _compute(_seen(ray_cluster=READY), previous=first, now=LATER)
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times["ClusterReady"] == "2026-03-01T12:00:10Z"  # False -> True
    assert times["SpecValid"] == "2026-03-01T12:00:00Z"  # unchanged


def test_start_and_completion_times():
    provisioning = _compute(_seen(ray_cluster=READY))
    assert "startTime" not in provisioning
    running = _compute(RUNNING, previous=provisioning, now=LATER)
    assert running["startTime"] == "2026-03-01T12:00:10Z"
    done = _compute(
        _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.SUCCEEDED)),
        previous=running,
        now=LATER + timedelta(hours=1),
    )
    assert done["startTime"] == running["startTime"] and done["completionTime"] == "2026-03-01T13:00:10Z"


def test_terminal_phases_stick():
    done = _compute(_seen(ray_cluster=READY, ray_job=_job(RayJobStatus.SUCCEEDED)))
    # The cluster is gone and nothing is observed any more: still Succeeded, only the generation moves.
    after = _compute(_seen(), previous=done, now=LATER, generation=2)
    assert after == {**done, "observedGeneration": 2}
    failed = _compute(_seen(ray_cluster=READY, ray_job=_job(RayJobStatus.FAILED)), restart_count=3)
    assert _compute(RUNNING, previous=failed, restart_count=3, now=LATER)["phase"] == "Failed"


def test_a_provisioning_clusters_workers_count_the_rollout_pools_pods():
    """KubeRay's readyWorkerReplicas counts every worker group's pods, the pool's among them."""
    job = spec_dict()["job"]
    job["rollout"] = {"pool": {"replicas": 2}}
    status = _compute(_seen(ray_cluster={**STARTING, "readyWorkerReplicas": 3}), spec=_spec(job=job))
    (ready,) = [c for c in status["conditions"] if c["type"] == "ClusterReady"]
    assert ready["message"] == "3/4 (the trainer's 2, the rollout pool's 2) workers ready", ready
    plain = _compute(_seen(ray_cluster=STARTING))
    assert [c["message"] for c in plain["conditions"] if c["type"] == "ClusterReady"] == ["1/2 workers ready"]


def test_fixing_an_invalid_spec_starts_the_job():
    invalid = _compute(_seen(problems=(Problem("spec.checkpoint", "set exactly one"),)))
    assert "completionTime" in invalid
    fixed = _compute(_seen(), previous=invalid, now=LATER, generation=2)
    assert fixed["phase"] == "Pending" and "completionTime" not in fixed
    assert _conditions(fixed)["SpecValid"] == ("True", "Valid")
    assert "Failed" not in _conditions(fixed)


def test_a_retry_from_failure_to_recovery():
    running = _compute(RUNNING)
    failed_obs = _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.FAILED, "worker died"))
    retrying = _compute(failed_obs, previous=running, now=LATER)
    assert retrying["phase"] == "Retrying"
    assert [e.reason for e in status_events(running, retrying)] == [EventReason.RETRYING]
    # The handler stopped the job and bumped the restart count; attempt 1 is not submitted yet.
    waiting = _compute(_seen(ray_cluster=STARTING), restart_count=1, previous=retrying, now=LATER)
    assert waiting["phase"] == "Retrying" and _conditions(waiting)["Retrying"] == ("True", "RayJobFailed")
    assert status_events(retrying, waiting) == []
    back = _compute(RUNNING, restart_count=1, previous=waiting, now=LATER)
    assert back["phase"] == "Running" and _conditions(back)["Retrying"] == ("False", "Recovered")
    assert back["restartCount"] == 1


def test_resume_after_suspend():
    suspended = _compute(_seen(), spec=_spec(suspend=True))
    resumed = _compute(_seen(), previous=suspended, now=LATER)
    assert resumed["phase"] == "Pending"
    assert _conditions(resumed)["Suspended"] == ("False", "Resumed")
    assert [e.reason for e in status_events(suspended, resumed)] == [EventReason.RESUMED]
    assert "PodsScheduled" not in _conditions(suspended)


@pytest.mark.parametrize(
    "old, new, changed",
    [
        (None, {}, False),
        ({"phase": "Running", "reward": None}, {"phase": "Running"}, False),
        ({"phase": "Running"}, {"phase": "Running", "iteration": 3}, True),
        ({"conditions": [{"type": "A", "message": None}]}, {"conditions": [{"type": "A"}]}, False),
    ],
)
def test_status_changed(old, new, changed):
    assert status_changed(old, new) is changed


@pytest.mark.parametrize(
    "old_observed, new_observed, sections, reasons",
    [
        (_seen(), _seen(problems=(Problem("spec.x", "bad"),)), {}, [EventReason.INVALID_SPEC]),
        (
            _seen(ray_cluster=STARTING),
            _seen(ray_cluster=STARTING, unschedulable=("no nodes",)),
            {},
            [EventReason.UNSCHEDULABLE],
        ),
        (RUNNING, _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.SUCCEEDED)), {}, [EventReason.SUCCEEDED]),
        (RUNNING, RUNNING, {}, []),
    ],
)
def test_status_events(old_observed, new_observed, sections, reasons):
    old = _compute(old_observed, spec=_spec(**sections))
    new = _compute(new_observed, spec=_spec(**sections), previous=old, now=LATER)
    assert [e.reason for e in status_events(old, new)] == reasons


def test_backoff_exhaustion_and_suspension_events():
    running = _compute(RUNNING, restart_count=3)
    failed = _compute(
        _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.FAILED)), restart_count=3, previous=running, now=LATER
    )
    (event,) = status_events(running, failed)
    assert (event.type, event.reason) == ("Warning", EventReason.BACKOFF_LIMIT_EXCEEDED)
    suspended = _compute(_seen(ray_cluster=READY), spec=_spec(suspend=True), previous=running, now=LATER)
    assert [e.reason for e in status_events(running, suspended)] == [EventReason.SUSPENDED]


@pytest.mark.parametrize(
    "ttl, finished_ago, expected",
    [
        (None, 100, None),
        (3600, 100, 3500.0),
        (60, 100, -40.0),
    ],
)
def test_seconds_until_expiry(ttl, finished_ago, expected):
    spec = _spec(ttlSecondsAfterFinished=ttl)
    done = _compute(_seen(ray_cluster=READY, ray_job=_job(RayJobStatus.SUCCEEDED)), spec=spec)
    now = NOW + timedelta(seconds=finished_ago)
    assert seconds_until_expiry(spec=spec, status=done, now=now) == expected
    assert seconds_until_expiry(spec=spec, status=_compute(RUNNING, spec=spec), now=now) is None


def test_unreadable_previous_status_and_naive_clock():
    status = _compute(RUNNING, previous={"phase": "Exploding", "conditions": "?"})
    assert status["phase"] == "Running"
    with pytest.raises(ValueError, match="timezone"):
        _compute(now=datetime(2026, 1, 1))


def test_a_submission_is_announced_once_even_when_its_request_timed_out():
    # The submit request timed out but Ray took the job: the round after sees it, and the Event
    # comes from that change of rayJobId, once.
    waiting = _compute(_seen(ray_cluster=READY))
    seen = _compute(RUNNING, previous=waiting, now=LATER)
    (event,) = status_events(waiting, seen)
    assert (event.reason, event.type) == (EventReason.SUBMITTED_RAY_JOB, "Normal") and JOB_ID in event.message
    assert status_events(seen, _compute(RUNNING, previous=seen, now=LATER)) == []


def test_dpo_progress_reports_the_preference_accuracy_as_its_reward():
    dpo_metrics = {k: v for k, v in METRICS.items() if k != "reward_mean"} | {"policy_preference_accuracy": 0.875}
    status = _compute(_seen(ray_cluster=READY, ray_job=_job(RayJobStatus.RUNNING), metrics=dpo_metrics))
    assert (status["iteration"], status["reward"]) == (12, 0.875)


@pytest.mark.parametrize("length", [10, CONDITION_MESSAGE_MAX, CONDITION_MESSAGE_MAX + 1, 3_000_000])
def test_condition_messages_are_bounded(length):
    """A message quoting a huge spec value must not make every status patch too large."""
    problem = Problem("spec.cluster.nodeSelector[zone]", "x" * length)
    status = _compute(_seen(problems=[problem]), spec=None)
    for cond in status["conditions"]:
        assert len(cond["message"]) <= CONDITION_MESSAGE_MAX
        assert cond["message"].startswith("spec.cluster.nodeSelector[zone]")
        assert ("characters cut" in cond["message"]) is (len(str(problem)) > CONDITION_MESSAGE_MAX)


def test_last_evaluation_comes_from_the_progress_record_and_outlives_records_without_one():
    from rldock.contract.progress import format_progress
    from rldock.operator.observe import read_progress

    # as the trainer prints it: iteration 6 carries the evaluation of iteration 5
    line = format_progress({**METRICS, "iteration": 6, "val_iteration": 5, "val_reward": 0.41234, "val_accuracy": 0.25})
    metrics = read_progress(line, output_dir="/o").metrics
    status = _compute(_seen(ray_cluster=READY, ray_job=_job(RayJobStatus.RUNNING), metrics=metrics))
    assert status["lastEvaluation"] == {"iteration": 5, "reward": 0.4123, "accuracy": 0.25}
    assert validator_for(rljob_schema()["properties"]["status"]).is_valid(status)
    # a later line of a job that never evaluated again (or an older trainer) keeps it
    later = _compute(
        _seen(ray_cluster=READY, ray_job=_job(RayJobStatus.RUNNING), metrics={**METRICS, "iteration": 7}),
        previous=status,
        now=LATER,
    )
    assert later["lastEvaluation"] == status["lastEvaluation"] and later["iteration"] == 7
    assert "lastEvaluation" not in _compute(_seen(ray_cluster=READY, metrics=METRICS))


# --- spec.environments ---------------------------------------------------------------------------------

ENVIRONMENTS = {"environments": [{"name": "cabinet", "replicas": 3}, {"name": "sandbox"}]}


@pytest.mark.parametrize(
    "observed, previous, environments, ready",
    [
        # This round's Deployments, in spec order, summed for kubectl.
        (
            (PodSetObservation("cabinet", 3, 2), PodSetObservation("sandbox", 1, 1)),
            None,
            [
                {"name": "cabinet", "replicas": 3, "readyReplicas": 2},
                {"name": "sandbox", "replicas": 1, "readyReplicas": 1},
            ],
            "3/4",
        ),
        # Suspended: 0 asked for, the pods still going.
        ((PodSetObservation("cabinet", 0, 1), PodSetObservation("sandbox", 0)), None, None, "1/0"),
        # Not looked at this round (a blocked round): as before.
        (
            None,
            {"environments": [{"name": "a", "replicas": 1, "readyReplicas": 1}], "environmentsReady": "1/1"},
            [{"name": "a", "replicas": 1, "readyReplicas": 1}],
            "1/1",
        ),
        # Looked at and none there (the entries left the spec): gone from the status.
        (
            (),
            {"environments": [{"name": "a", "replicas": 1, "readyReplicas": 1}], "environmentsReady": "1/1"},
            None,
            None,
        ),
    ],
    ids=["running", "suspended", "not-looked-at", "none-left"],
)
def test_the_environments_ready_pods_are_in_the_status(observed, previous, environments, ready):
    status = _compute(_seen(ray_cluster=READY, environments=observed), spec=_spec(**ENVIRONMENTS), previous=previous)
    if environments is not None:
        assert status["environments"] == environments
    elif observed:
        assert [e["readyReplicas"] for e in status["environments"]] == [seen.ready_replicas for seen in observed]
    else:
        assert "environments" not in status
    assert status.get("environmentsReady") == ready
    assert error_paths(validator_for(rljob_schema()["properties"]["status"]), status) == []


def test_a_finished_rljob_keeps_its_status_and_reports_its_environments_scaled_down():
    done = _compute(_seen(ray_cluster=READY, ray_job=_job(RayJobStatus.SUCCEEDED)), spec=_spec(**ENVIRONMENTS))
    assert done["phase"] == "Succeeded"
    later = _compute(
        _seen(environments=(PodSetObservation("cabinet", 0), PodSetObservation("sandbox", 0))),
        spec=_spec(**ENVIRONMENTS),
        previous=done,
        now=LATER,
    )
    assert later["environmentsReady"] == "0/0" and later["phase"] == "Succeeded"
    assert {k: v for k, v in later.items() if not k.startswith("environments")} == {
        k: v for k, v in done.items() if not k.startswith("environments")
    }


# --- spec.job.monitoring.mismatch ---------------------------------------------------------------------------


def _budgeted(max_kl: float = 0.01) -> RLJobSpec:
    """spec.job with monitoring.mismatch (the job config keeps its own snake_case keys)."""
    job = job_dict()
    job["monitoring"] = {"mismatch": {"max_kl": max_kl}}
    return _spec(job=job)


def test_the_mismatch_is_held_to_its_budget_in_a_condition_with_one_event_per_passing():
    running = _job(RayJobStatus.RUNNING)

    def round_with(kl: float, iteration: int, previous: dict | None = None) -> dict:
        metrics = {**METRICS, "iteration": iteration, MISMATCH_KL: kl}
        return _compute(_seen(ray_cluster=READY, ray_job=running, metrics=metrics), spec=_budgeted(), previous=previous)

    under = round_with(0.004, 3)
    assert _conditions(under)["RolloutMismatch"] == ("False", "WithinBudget") and under["rolloutMismatchKl"] == 0.004
    over = round_with(0.02, 4, previous=under)
    assert _conditions(over)["RolloutMismatch"] == ("True", "OverBudget")
    message = next(c["message"] for c in over["conditions"] if c["type"] == "RolloutMismatch")
    assert "iteration 4: mismatch/kl 0.02 is over spec.job.monitoring.mismatch.max_kl 0.01" in message
    assert "spec.job.algorithm.rollout_correction" in message
    assert validator_for(rljob_schema()["properties"]["status"]).is_valid(over)
    events = status_events(under, over)
    assert [(e.type, e.reason, e.message) for e in events] == [("Warning", EventReason.ROLLOUT_MISMATCH, message)]
    still = round_with(0.03, 5, previous=over)  # over again: the condition's message moves, no second Event
    assert _conditions(still)["RolloutMismatch"][0] == "True" and status_events(over, still) == []
    back = round_with(0.001, 6, previous=still)
    assert _conditions(back)["RolloutMismatch"] == ("False", "WithinBudget") and status_events(still, back) == []
    # a round that read no new progress line keeps the condition and the figure
    quiet = _compute(_seen(ray_cluster=READY, ray_job=running), spec=_budgeted(), previous=back)
    assert _conditions(quiet)["RolloutMismatch"] == ("False", "WithinBudget") and quiet["rolloutMismatchKl"] == 0.001


def test_without_a_budget_the_figure_is_reported_and_no_condition_set():
    metrics = {**METRICS, MISMATCH_KL: 0.5}
    status = _compute(_seen(ray_cluster=READY, ray_job=_job(RayJobStatus.RUNNING), metrics=metrics))
    assert "RolloutMismatch" not in _conditions(status) and status["rolloutMismatchKl"] == 0.5
