"""The rollout-correction learning benchmark's arithmetic and its arms (no jobs run)."""

from __future__ import annotations

import pytest

from rldock.config.loading import load_job_config
from rldock.runtime.cli.arguments import parse_override
from rldock_benchmarks.mismatch_learning import (
    ARMS,
    DEMO_CONFIG,
    MEASURED,
    REPO,
    arm_summary,
    on_par,
    over_seeds,
    refusals,
)


def records(rewards: list[float], **gap: float) -> list[dict]:
    return [{"iteration": i + 1, "reward_mean": reward, **gap} for i, reward in enumerate(rewards)]


def test_an_arm_summary_has_its_rise_curve_and_mean_gap():
    summary = arm_summary(
        [
            {"iteration": 1, "reward_mean": 0.2, "mismatch/kl": 1e-3, "mismatch/abs_diff_mean": 0.1},
            {"iteration": 2, "reward_mean": 0.6, "mismatch/kl": 3e-3, "mismatch/abs_diff_mean": 0.3},
        ]
    )
    assert summary["curve"] == [0.2, 0.6] and summary["rise"] == pytest.approx(0.0)  # a 5-window: both halves
    assert summary["mismatch/kl"] == pytest.approx(2e-3) and summary["mismatch/abs_diff_mean"] == pytest.approx(0.2)
    assert "mismatch/tokens_dropped" not in summary  # recorded only where a correction ran


def test_on_par_is_the_share_of_the_matched_runs_rise_above_the_control():
    flat, rising = [0.3] * 10, [0.3] * 5 + [0.7] * 5
    arms = {
        "matched": arm_summary(records(rising)),
        "lr0": arm_summary(records(flat)),
        "bfloat16/none": arm_summary(records([0.3] * 5 + [0.5] * 5)),
    }
    assert on_par(arms) == {"matched": pytest.approx(1.0), "bfloat16/none": pytest.approx(0.5)}
    assert on_par({"matched": arms["matched"]}) == {}  # no control to measure against
    assert on_par({"matched": arms["lr0"], "lr0": arms["lr0"]}) == {}  # the matched run did not learn


def test_every_arm_is_a_job_with_its_gap_source_and_correction():
    # the overrides as `rldock train --set` parses them
    cfgs = {
        arm: load_job_config(DEMO_CONFIG, overrides=dict(map(parse_override, [*MEASURED, *changes])), check_local=False)
        for arm, changes in ARMS.items()
    }
    assert refusals(str(DEMO_CONFIG), list(ARMS), []) == {}
    assert all(cfg.monitoring.mismatch is not None for cfg in cfgs.values())  # every arm measures the gap
    assert cfgs["lr0"].algorithm.learning_rate == 0 and cfgs["matched"].rollout.dtype in (None, "float32")
    for arm, cfg in cfgs.items():
        source, _, correction = arm.partition("/")
        assert (cfg.rollout.dtype == "bfloat16") == (source == "bfloat16"), arm
        assert (cfg.training.mode, cfg.dock.max_staleness) == (("async", 2) if source == "async2" else ("sync", 0))
        assert (cfg.algorithm.rollout_correction is None) == (correction in ("", "none")), arm
    assert cfgs["bfloat16/seq_mask"].algorithm.rollout_correction.reject == "sequence"
    assert cfgs["async2/icepop"].algorithm.rollout_correction.reject == "token"
    assert cfgs["bfloat16/tis"].algorithm.rollout_correction.weight == "token"


def test_the_arms_a_config_refuses_are_named_with_the_reason():
    """The tiny MoE's FSDP x EP ranks run every arm, the async pipeline's too; a serial phase schedule runs no
    async pipeline: those arms are refused before any job runs."""
    moe = str(REPO / "examples" / "grpo-tiny-moe.yaml")
    assert refusals(moe, list(ARMS), MEASURED) == {}
    refused = refusals(moe, list(ARMS), [*MEASURED, "resources.phase_schedule=serial"])
    assert set(refused) == {arm for arm in ARMS if arm.startswith("async2/")}
    assert all("resources.phase_schedule" in reason for reason in refused.values())


def test_a_run_s_records_leave_out_the_initial_evaluation(tmp_path):
    """evaluation.at_start logs iteration 0, the initial policy's evaluation, which has no reward_mean: the
    summaries read iterations 1 on."""
    import json

    from rldock_benchmarks.learning import read_records

    lines = [{"iteration": 0, "val/reward": 0.3}, *records([0.2, 0.4], **{"mismatch/kl": 1e-3})]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = arm_summary(read_records(tmp_path))
    assert summary["curve"] == [0.2, 0.4] and summary["mismatch/kl"] == pytest.approx(1e-3)


def test_on_par_over_seeds_spreads_each_arm_over_the_seeds_that_say_something():
    seeds = [{"matched": 1.0, "bfloat16/tis": 0.8}, {}, {"matched": 1.0, "bfloat16/tis": 1.2}]  # seed 1: no rise
    spread = over_seeds(seeds)
    assert spread["bfloat16/tis"] == {"mean": pytest.approx(1.0), "min": 0.8, "max": 1.2, "seeds": 2}
    assert spread["matched"]["seeds"] == 2
