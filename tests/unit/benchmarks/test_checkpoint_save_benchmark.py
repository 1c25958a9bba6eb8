"""rldock_benchmarks.checkpoint_save's summary of a job's progress lines."""

from __future__ import annotations

from rldock_benchmarks.checkpoint_save import summarise


def test_the_benchmark_sets_the_estimate_beside_each_save_once():
    lines = [
        {"iteration": 1, "checkpoint": None, "checkpoint_estimate_s": 3.0},
        {"iteration": 2, "checkpoint": 2, "checkpoint_s": 2.0},
        {"iteration": 3, "checkpoint": 2, "checkpoint_s": 2.0},  # the same save, repeated on the next line
        {"iteration": 4, "checkpoint": 4, "checkpoint_s": 4.0},
    ]
    summary = summarise(lines, planned=10, written=11)
    assert summary["saves_s"] == [2.0, 4.0] and summary["estimate_s"] == 3.0
    assert summary["estimate_over_median_save"] == 1.0
