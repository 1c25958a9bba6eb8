"""Carried episodes on the real engine (rollout/carry.py, benchmarks' heavy_tail): the tiny model's episodes
with an environment whose steps take 1-10x each other, 6 batches of 2 groups x 2 episodes at
max_staleness 2. Groups left unfinished at a batch's cut are carried, sessions open, and finish in a later
batch on newer weights; every episode started is written, none older than the bound."""

from __future__ import annotations

import pytest

from rldock_benchmarks.heavy_tail import heavy_tail_loop, run

pytestmark = pytest.mark.integration

GROUPS, RESPONSES, ITERATIONS, BOUND = 2, 2, 6, 2


def test_carried_episodes_finish_in_a_later_batch_within_the_bound_and_none_is_dropped(tmp_path):
    loop, prompts = heavy_tail_loop(tmp_path / "model", step_seconds=0.02, steps=2)
    try:
        report = run(
            loop,
            prompts,
            groups=GROUPS,
            responses=RESPONSES,
            iterations=ITERATIONS,
            max_staleness=BOUND,
            update_seconds=0.0,
            run_seed=1,
        )
    finally:
        loop.close()
    episodes = report["episodes"]
    assert episodes == {"started": 24, "written": 24, "open_at_end": 0, "dropped": 0}
    staleness = {int(k): v for k, v in report["staleness_histogram"].items()}
    assert sum(staleness.values()) == GROUPS * ITERATIONS and max(staleness) <= BOUND
    # (bound + 1) batches admitted at version 0 and one written then: the rest train later, some of them
    # with turns sampled on both sides of an update
    assert sum(v for k, v in staleness.items() if k >= 1) >= BOUND * GROUPS
    assert report["groups_spanning_versions"] >= 1
    assert loop.sessions_open == 0
