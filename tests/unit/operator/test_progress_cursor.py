"""The progress cursor: each poll parses only the driver log's new complete lines, with the same
answer as parsing the whole log, and a log that starts over is read from the start."""

from __future__ import annotations

import random

import pytest

from rldock.contract.progress import format_progress, last_progress
from rldock.operator import progress_cursor
from rldock.operator.progress_cursor import ProgressCursor


def _line(i: int) -> str:
    return format_progress({"iteration": i, "reward_mean": i / 10, "tokens_per_s_per_device": 100.0}) + "\n"


NOISE = "INFO worker.py:123 -- some Ray chatter\n"


@pytest.mark.parametrize(
    "polls, expected",
    [
        # (submission id, log) per poll -> the iteration each poll reports
        ([("a", _line(1)), ("a", _line(1) + _line(2))], [1, 2]),
        ([("a", _line(1)), ("a", _line(1) + NOISE)], [1, 1]),  # nothing new: the last record stays
        ([("a", _line(1)), ("a", _line(1) + _line(2)[:20])], [1, 1]),  # a half-written line waits
        ([("a", _line(1) + _line(2)[:20]), ("a", _line(1) + _line(2))], [1, 2]),  # ... until complete
        ([("a", _line(1) + _line(2)), ("a", _line(7))], [2, 7]),  # shorter: a new log (new head)
        # other text before the offset: a new log
        ([("a", NOISE + _line(1)), ("a", NOISE.upper() + _line(5) + NOISE)], [1, 5]),
        ([("a", _line(3)), ("b", NOISE)], [3, None]),  # the next attempt's log is its own
    ],
)
def test_each_poll_reports_the_last_record_of_the_log(polls, expected):
    cursor = ProgressCursor()
    got = [(record or {}).get("iteration") for sid, log in polls for record in [cursor.last_record("job", sid, log)]]
    assert got == expected


def test_only_new_lines_are_parsed(monkeypatch):
    """Before: every 5 s poll parsed every job's whole log again."""
    parsed: list[int] = []

    def spy(lines):
        lines = list(lines)
        parsed.append(len(lines))
        return last_progress(lines)

    monkeypatch.setattr(progress_cursor, "last_progress", spy)
    cursor, log = ProgressCursor(), NOISE * 10_000
    cursor.last_record("job", "a", log)
    for i in range(1, 4):
        log += NOISE * 9 + _line(i)
        assert cursor.last_record("job", "a", log)["iteration"] == i
    assert parsed == [10_000, 10, 10, 10]


def test_same_answer_as_parsing_the_whole_log():
    rng, cursor, log = random.Random(0), ProgressCursor(), ""
    for i in range(300):
        log += "".join(rng.choice([NOISE, _line(i), "RLDOCK_PROGRESS {broken\n"]) for _ in range(rng.randint(0, 3)))
        cut = log + (_line(i + 1)[: rng.randint(0, 30)])  # the driver may be mid-line
        complete = cut[: cut.rfind("\n") + 1]
        assert cursor.last_record("job", "a", cut) == last_progress(complete.splitlines())


def test_memory_is_bounded():
    cursor = ProgressCursor(max_jobs=3)
    for job in range(10):
        cursor.last_record(job, "a", _line(job) * 1000)
    assert len(cursor) == 3
    cursor.forget(9)
    assert len(cursor) == 2
    assert all(len(read.fingerprint) <= progress_cursor.FINGERPRINT for read in cursor._reads.values())


def test_the_benchmark_compares_both_ways_on_the_same_answers():
    from rldock_benchmarks.operator_logs import parse_args, run

    report = run(parse_args(["--jobs", "3", "--initial-lines", "200", "--polls", "3"]))
    assert report["same_progress_reported"] and report["cursor_entries"] == 3
    assert {"whole", "incremental", "ratio_parse_whole_over_incremental"} <= report.keys()
