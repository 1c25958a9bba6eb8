"""The failure line round-trips, and a log's last well-formed one wins over noise around it."""

from __future__ import annotations

from rldock.contract.failure import (
    PREFIX,
    FailureReason,
    FieldProblem,
    JobFailure,
    format_failure,
    last_failure,
    parse_failure,
)
from rldock.contract.progress import format_progress

FAILURE = JobFailure(
    FailureReason.PATH_NOT_FOUND,
    (
        FieldProblem("model.path", "/models/x does not exist"),
        FieldProblem("data.train_files[0]", "/data/a.jsonl does not exist"),
    ),
)


def test_round_trip_among_other_log_lines():
    log = [
        "2026-11-22 INFO rldock: starting",
        format_progress({"iteration": 1}),
        "ray: " + format_failure(FAILURE),
        "Traceback (most recent call last):",
    ]
    assert last_failure(log) == FAILURE


def test_a_log_without_a_failure_line():
    assert last_failure(["plain", format_progress({"iteration": 3})]) is None


def test_broken_or_unknown_records_are_ignored():
    log = [
        format_failure(FAILURE),
        PREFIX + '{"reason": "PathNotFound", "problems": [{"field": "x"',  # cut mid-write
        PREFIX + '{"reason": "SomethingNewer", "problems": [{"field": "x", "message": "y"}]}',
        PREFIX + '{"reason": "PathNotFound", "problems": []}',
    ]
    assert last_failure(log) == FAILURE
    assert parse_failure(["not", "a", "record"]) is None


def test_the_message_reroots_the_fields():
    assert FAILURE.message(field_prefix="spec.job.") == (
        "spec.job.model.path: /models/x does not exist; spec.job.data.train_files[0]: /data/a.jsonl does not exist"
    )
