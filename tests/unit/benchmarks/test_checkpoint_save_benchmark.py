"""rldock_benchmarks.checkpoint_save's summary of a job's progress lines."""

from __future__ import annotations

from rldock.contract.progress import PREFIX
from rldock_benchmarks.checkpoint_save import progress_lines, stop_bound, summarise


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


def test_a_progress_line_still_being_written_is_not_read():
    # the preempted run polls the log while the driver writes it
    log = f'{PREFIX}{{"iteration": 1}}\nother output\n{PREFIX}{{"iteration": 2, "chec'
    assert progress_lines(log) == [{"iteration": 1}]
    assert progress_lines(log + 'kpoint": 2}\n') == [{"iteration": 1}, {"iteration": 2, "checkpoint": 2}]


def test_the_stop_is_held_to_an_iteration_and_a_save_or_before_the_first_its_estimate():
    assert stop_bound({"iteration": 2, "iteration_s": 10.0, "checkpoint_s": 2.0, "checkpoint_estimate_s": 9.0}) == 12.0
    assert stop_bound({"iteration": 1, "iteration_s": 10.0, "checkpoint_estimate_s": 3.5}) == 13.5
