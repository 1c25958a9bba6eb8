"""The heavy-tail trainer benchmark's configs and summary (no jobs run): both runs are valid sync agent jobs
at one bound, one carried; samples per second over all iterations and after the first."""

from __future__ import annotations

import argparse
from pathlib import Path

from rldock.config import parse_job_config
from rldock_benchmarks.heavy_tail_trainer import job_config, summary

ARGS = argparse.Namespace(
    iterations=4, step_seconds=0.05, steps=2, groups=4, responses=2, max_staleness=2, device="cpu"
)


def test_both_runs_are_sync_agent_jobs_at_the_same_bound_one_carried():
    cfgs = [
        parse_job_config(job_config(ARGS, model=Path("/m"), train_file=Path("/t.jsonl"), carry=carry))
        for carry in (False, True)
    ]
    assert [(c.training.mode, c.dock.max_staleness) for c in cfgs] == [("sync", 2)] * 2
    assert [c.rollout.partial_rollout for c in cfgs] == ["off", "carry"]
    assert cfgs[1].agent is not None and cfgs[1].agent.environment is not None
    assert cfgs[1].agent.environment.options == {"step_seconds": "0.05", "steps": "2"}


def test_samples_per_second_over_all_iterations_and_after_the_first():
    def record(seconds: float, staleness: float) -> dict:
        update = {"samples_handed_out": 8, "stale_dropped": 0}
        return {
            "timing": {"iteration": seconds},
            "dock": {"controllers": {"update": update}},
            "staleness_mean": staleness,
            "staleness_max": staleness,
            "rollout/carry_written": 8,
        }

    out = summary([record(10.0, 0.0), record(2.0, 1.0), record(2.0, 1.0)], samples_per_iteration=8)
    assert out["samples_per_s"] == 24 / 14.0 and out["samples_per_s_after_first"] == 16 / 4.0
    assert out["episodes_trained"] == 24 and out["episodes_dropped"] == 0
    assert out["counters"]["carry_written"] == [8, 8, 8] and out["counters"]["carry_open"] == [0, 0, 0]
