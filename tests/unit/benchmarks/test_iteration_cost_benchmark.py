"""rldock_benchmarks.iteration_cost's measure: the timing keys taken from records after the skipped
ones, medians pooled over runs, the dispatch share. (The whole benchmark starts real jobs: its figures
are in docs/results.md, "The dock's dispatch per iteration".)"""

from __future__ import annotations

from rldock_benchmarks.iteration_cost import SHAPES, summary, timings


def record(iteration: float, dispatch: float) -> dict:
    return {"timing": {"iteration": iteration, "dispatch": dispatch, "compute/update": iteration / 2}}


def test_the_skipped_iterations_are_left_out_and_missing_keys_stay_empty():
    records = [record(9.0, 9.0), record(0.2, 0.1), record(0.4, 0.1)]
    kept = timings(records, skip=1)
    assert kept["iteration"] == [0.2, 0.4] and kept["dispatch"] == [0.1, 0.1]
    assert kept["compute/update"] == [0.1, 0.2] and kept["compute/rollout"] == []


def test_medians_pool_every_run_s_iterations_and_give_the_share():
    runs = [timings([record(0.2, 0.05), record(0.3, 0.06)], 0), timings([record(0.4, 0.2)], 0)]
    report = summary(runs)
    assert report["iteration"] == 0.3 and report["dispatch"] == 0.06
    assert report["dispatch_share"] == 0.2 and report["iterations_measured"] == 3
    assert "compute/rollout" not in report  # no run recorded it


def test_the_fixed_cost_shape_is_the_demo_with_two_groups_of_two_and_two_token_answers():
    assert SHAPES["demo"] == []
    assert sorted(SHAPES["fixed_cost"]) == [
        "algorithm.max_response_length=2",
        "algorithm.num_prompts_per_iteration=2",
        "algorithm.num_responses_per_prompt=2",
    ]
