"""A job whose runtime refused its inputs (the failure line in its log) fails the RLJob at once,
with the runtime's reason, the fields under spec.job and an Event; other failures still retry."""

from __future__ import annotations

from datetime import datetime, timezone

from rljob_testing import round_facts, spec_dict, status_of

from rldock.contract.failure import FailureReason, FieldProblem, JobFailure, format_failure
from rldock.operator.actions import CountRestart, DeleteCluster, next_actions
from rldock.operator.api import RLJobSpec, RLJobStatus
from rldock.operator.facts import RoundFacts
from rldock.operator.observe import job_observation
from rldock.operator.rules import classify
from rldock.operator.status import status_events

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
NAME = "grpo"
JOB_ID = "rldock-grpo-0f5c2a6e-0"
MISSING = JobFailure(
    FailureReason.PATH_NOT_FOUND,
    (
        FieldProblem("model.path", "/models/qwen does not exist (nearest existing folder: /); mount the volume"),
        FieldProblem("--output", "/checkpoints/a/b: /checkpoints is not writable by this process (uid 1000)"),
    ),
)
LOG = "\n".join(
    [
        "INFO rldock: loading",
        "invalid job config /etc/rldock/job.yaml:",
        "  - model.path: /models/qwen does not exist",
        format_failure(MISSING),
        "",
    ]
)
RAY_MESSAGE = "Job entrypoint command failed with exit code 2, last available logs (truncated to 20,000 chars):\n"


def _observe(status: str, *, log: str = "", message: str = ""):
    return job_observation(JOB_ID, {"status": status, "message": message}, previous=RLJobStatus(), log_text=log)


def test_the_failure_line_is_read_from_a_failed_jobs_log_or_rays_message():
    assert _observe("FAILED", log=LOG).failure == MISSING
    assert _observe("FAILED", message=RAY_MESSAGE + LOG).failure == MISSING  # Ray quotes the log's end
    assert _observe("FAILED", log="Traceback ...\nRuntimeError: HCCL timeout\n").failure is None
    assert _observe("RUNNING", log=LOG).failure is None  # only a failed job has failed for a reason


def _facts(job, *, restart_count: int = 0) -> RoundFacts:
    return round_facts(
        name=NAME,
        spec=RLJobSpec.model_validate(spec_dict()),
        ray_cluster={"state": "ready"},
        ray_job=job,
        restart_count=restart_count,
        previous={"phase": "Running", "rayJobId": JOB_ID},
        now=NOW,
    )


def _status(job, *, restart_count: int = 0) -> dict:
    return status_of(_facts(job, restart_count=restart_count))


def test_a_refused_input_fails_at_once_naming_the_field_under_spec_job():
    status = _status(_observe("FAILED", log=LOG))
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Failed" and status["restartCount"] == 0
    assert (conditions["Failed"]["status"], conditions["Failed"]["reason"]) == ("True", "PathNotFound")
    assert conditions["Running"]["reason"] == "PathNotFound"
    message = conditions["Failed"]["message"]
    assert "spec.job.model.path: /models/qwen does not exist" in message and "not retried" in message
    assert "; --output: /checkpoints/a/b" in message  # a command-line option is not a spec.job field
    events = status_events({"phase": "Running", "rayJobId": JOB_ID}, status)
    assert [(e.type, e.reason.value, e.message) for e in events] == [("Warning", "PathNotFound", message)]


def test_invalid_job_input_has_its_own_reason():
    failure = JobFailure(FailureReason.INVALID_JOB_INPUT, (FieldProblem("training.tensor_parallel_size", "x"),))
    status = _status(_observe("FAILED", log=format_failure(failure)))
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Failed"] == "InvalidJobInput"


def test_a_failure_without_the_line_still_retries():
    status = _status(_observe("FAILED", log="RuntimeError: HCCL timeout\n"))
    assert status["phase"] == "Retrying"


def test_the_failed_phase_releases_the_cluster_without_counting_a_restart():
    job = _observe("FAILED", log=LOG)
    facts = _facts(job)
    actions = next_actions(facts, classify(facts))
    assert [type(a) for a in actions] == [DeleteCluster]
    assert not any(isinstance(a, CountRestart) for a in actions)


def test_a_job_stopped_on_its_mismatch_budget_fails_at_once_saying_it_was_stopped():
    failure = JobFailure(
        FailureReason.ROLLOUT_MISMATCH,
        (FieldProblem("monitoring.mismatch.max_kl", "iteration 3: mismatch/kl 0.05 is over ..."),),
    )
    status = _status(_observe("FAILED", log=format_failure(failure)))
    failed = {c["type"]: c for c in status["conditions"]}["Failed"]
    assert status["phase"] == "Failed" and (failed["reason"], failed["status"]) == ("RolloutMismatch", "True")
    assert (
        "the runtime stopped the job (not retried): spec.job.monitoring.mismatch.max_kl: iteration 3"
        in failed["message"]
    )
    events = status_events({"phase": "Running", "rayJobId": JOB_ID}, status)
    assert [(e.type, e.reason.value) for e in events] == [("Warning", "RolloutMismatch")]
