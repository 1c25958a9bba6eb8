"""The async-vs-sync learning benchmark's arithmetic and its arms (no jobs run)."""

from __future__ import annotations

import pytest

from rldock.config.loading import load_job_config
from rldock.runtime.cli.arguments import parse_override
from rldock_benchmarks.async_learning import ARMS, DEMO_CONFIG, compare, curve_summary


def test_curve_summary_windows():
    summary = curve_summary([0.0, 1.0, 2.0, 3.0], window=2)
    assert (summary["reward_first"], summary["reward_last"], summary["reward_all"]) == (0.5, 2.5, 1.5)
    assert curve_summary([1.0], window=10)["window"] == 1  # a window longer than the run is the run


def test_margins_and_the_sync_spread():
    runs = {
        0: {"sync": {"reward_last": 0.8, "reward_all": 0.5}, "async": {"reward_last": 0.7, "reward_all": 0.5}},
        1: {"sync": {"reward_last": 0.6, "reward_all": 0.5}, "async": {"reward_last": 0.7, "reward_all": 0.6}},
    }
    result = compare(runs)
    assert result["margin_per_seed"][0]["reward_last"] == pytest.approx(-0.1)
    assert result["mean_margin"]["reward_last"] == pytest.approx(0.0)
    assert result["mean_margin"]["reward_all"] == pytest.approx(0.05)
    assert result["sync_seed_spread"]["reward_last"] == pytest.approx(0.1)
    assert result["sync_seed_spread"]["reward_all"] == pytest.approx(0.0)
    assert result["async_within_sync_noise"] == {"reward_last": True, "reward_all": True}
    worse = {0: {"sync": {"reward_last": 0.8, "reward_all": 0.5}, "async": {"reward_last": 0.5, "reward_all": 0.4}}}
    assert compare(worse)["async_within_sync_noise"] == {"reward_last": False, "reward_all": False}


def test_arms_are_valid_jobs_of_the_mode_they_name():
    # the overrides as `rldock train --set` parses them
    cfgs = {
        arm: load_job_config(DEMO_CONFIG, overrides=dict(map(parse_override, overrides)), check_local=False)
        for arm, overrides in ARMS.items()
    }
    assert {arm: (cfg.training.mode, cfg.dock.max_staleness) for arm, cfg in cfgs.items()} == {
        "sync": ("sync", 0),
        "async": ("async", 1),
    }
    assert cfgs["sync"].iterations >= 20  # enough iterations for a first/last window of 10 each
