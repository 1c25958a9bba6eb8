"""The failure line: why the runtime refused a job before training (or stopped it on a budget), for the
operator to show.

When `rldock train` finds a problem with its inputs that no retry can fix (a configured path that
does not exist in the pod, a model whose shape the config cannot split), it prints one such line
beside its human-readable error and exits. The operator reads the failed Ray job's log, finds the
line, and fails the RLJob at once with a typed condition reason and the fields to fix, instead of
retrying backoffLimit times and quoting a traceback. Both sides import this module, so the format
has one definition (as the progress line in progress.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rldock.contract.log_records import prefixed_records

PREFIX = "RLDOCK_FAILURE "


class FailureReason(str, Enum):
    """Why the runtime refused the job; the operator uses the value as its condition reason."""

    PATH_NOT_FOUND = "PathNotFound"  # a configured path is missing, unreadable or of the wrong kind
    INVALID_JOB_INPUT = "InvalidJobInput"  # the config does not fit what the pod holds (e.g. the model)
    # monitoring.mismatch with action stop: an iteration's train-inference mismatch passed its budget
    ROLLOUT_MISMATCH = "RolloutMismatch"


@dataclass(frozen=True)
class FieldProblem:
    """One problem, at a field path of the job config (`model.path`, `data.train_files[0]`)."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True)
class JobFailure:
    reason: FailureReason
    problems: tuple[FieldProblem, ...]

    def message(self, *, field_prefix: str = "") -> str:
        """Every problem on one line, job config fields under `field_prefix` (the operator:
        `spec.job.`); command-line options such as `--output` keep their name."""
        return "; ".join(
            f"{'' if p.field.startswith('-') else field_prefix}{p.field}: {p.message}" for p in self.problems
        )


def format_failure(failure: JobFailure) -> str:
    record = {
        "reason": failure.reason.value,
        "problems": [{"field": p.field, "message": p.message} for p in failure.problems],
    }
    return PREFIX + json.dumps(record, separators=(",", ":"), sort_keys=True)


def parse_failure(record: Any) -> JobFailure | None:
    """A failure record as decoded JSON, or None when it is not one (an unknown reason included:
    a newer runtime's reason reads as no structured failure, and the generic path applies)."""
    if not isinstance(record, dict) or not isinstance(record.get("problems"), list):
        return None
    try:
        reason = FailureReason(record.get("reason"))
    except ValueError:
        return None
    problems = tuple(
        FieldProblem(str(p["field"]), str(p["message"]))
        for p in record["problems"]
        if isinstance(p, dict) and "field" in p and "message" in p
    )
    return JobFailure(reason, problems) if problems else None


def last_failure(log_lines: Iterable[str]) -> JobFailure | None:
    """The last well-formed failure record in a log, or None; other lines are ignored."""
    last = None
    for record in prefixed_records(log_lines, PREFIX):
        last = parse_failure(record) or last
    return last
