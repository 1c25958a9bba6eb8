"""Carried episodes on the real engine (rollout/carry.py, benchmarks' heavy_tail): the tiny model's episodes
with an environment whose steps take 1-10x each other, 6 batches of 2 groups x 2 episodes at
max_staleness 2. Groups left unfinished at a batch's cut are carried, sessions open, and finish in a later
batch on newer weights; every episode started is written, none older than the bound.

Then the same through the trainer (rollout.partial_rollout carry, `rldock train`): a sync job of 3
iterations whose rank keeps 2 batches open (max_staleness 1) and trains each iteration on the groups that
finished, the others carried into the next iteration; every group admitted trains once, none stale past
the bound and none dropped. Its run resumed from the checkpoint after iteration 2, as after a crash in
iteration 3, keeps the records it had and redoes iteration 3 with none of the episodes open at the checkpoint: it
draws their prompt groups again (the prompt ledger) and admits only the batch it trains, on the checkpoint's
weights. The job measures the train-inference gap
(monitoring.mismatch) on the tokens the old-logprob pass's weights sampled."""

from __future__ import annotations

import json
import shutil

import jobs  # tests/jobs.py
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


JOB_G, JOB_N, JOB_ITERATIONS = 2, 2, 3


def test_a_carry_job_trains_carried_groups_in_a_later_iteration_within_the_bound(tmp_path):
    config = {
        "name": "it-carry",
        "seed": 1,
        "iterations": JOB_ITERATIONS,
        "model": {"path": str(tmp_path / "model"), "builder": "tiny-qwen2"},
        "data": {"generator": {"name": "addition", "num_prompts": 64}, "chat_template": "model"},
        "agent": {"environment": {"name": "feedback"}, "max_turns": 3, "max_tool_response_tokens": 8},
        "algorithm": {
            "num_prompts_per_iteration": JOB_G,
            "num_responses_per_prompt": JOB_N,
            "max_prompt_length": 48,
            "max_response_length": 24,
            "learning_rate": 1e-4,
        },
        "training": {"mode": "sync", "data_parallel_size": 1, "micro_batch_size": 4},
        "rollout": {"partial_rollout": "carry", "importance_correction": "behaviour"},
        "dock": {"timeout_s": 120, "max_staleness": 1},
        "evaluation": {"interval": 0},
        "checkpoint": {"interval": 2, "keep_last": 2},
        "monitoring": {"mismatch": {"max_kl": 1.0, "action": "warn"}},
    }
    records = jobs.run(config, tmp_path / "run").records
    assert [r["iteration"] for r in records] == list(range(1, JOB_ITERATIONS + 1))
    episodes = JOB_G * JOB_N
    for record in records:  # each iteration trains one batch of every group it wrote, none dropped
        update = record["dock"]["controllers"]["update"]
        assert update["samples_handed_out"] == episodes and update["stale_dropped"] == 0, record["iteration"]
        assert record["rollout/carry_written"] == episodes and record["staleness_max"] <= 1
    # two batches admitted at the start, one with the next iteration, none with the last
    assert [r["rollout/carry_admitted"] for r in records] == [2 * episodes, episodes, 0]
    assert [r["rollout/carry_open"] for r in records] == [episodes, episodes, 0]  # drained at the end
    # the groups carried past the first cut trained a version after the one that started them
    assert any(r["staleness_max"] == 1 for r in records)
    # the gap (monitoring.mismatch) on the tokens the pass's weights sampled; an iteration whose tokens an
    # older version all sampled measures none (mismatch/tokens 0, every figure 0, not a gap of 0)
    assert any(r["mismatch/tokens"] > 0 for r in records)
    for record in records:
        if record["mismatch/tokens"] > 0:
            jobs.check_float32_gap(record)
        else:
            assert {k: v for k, v in record.items() if k.startswith("mismatch/")} == dict.fromkeys(
                jobs.MISMATCH_MEASURES, 0
            ), record

    # A crash in iteration 3: the run as it was before that iteration's checkpoint, resumed.
    shutil.copytree(tmp_path / "run", tmp_path / "crashed")
    shutil.rmtree(tmp_path / "crashed" / "checkpoints" / f"iter-{JOB_ITERATIONS:06d}")
    resumed_log = jobs.run(tmp_path / "job.yaml", tmp_path / "crashed", resume=True)
    resumed = resumed_log.records
    assert resumed[:2] == records[:2]  # kept, not redone
    redone = resumed[2]
    assert redone["iteration"] == JOB_ITERATIONS
    assert redone["dock"]["controllers"]["update"]["samples_handed_out"] == episodes
    # no episode left open at the checkpoint trains: the resumed attempt starts with none open and admits
    # the one batch the run has left to write, on the checkpoint's weights
    assert (redone["rollout/carry_admitted"], redone["rollout/carry_written"], redone["rollout/carry_open"]) == (
        episodes,
        episodes,
        0,
    )
    assert redone["staleness_max"] == 0
    # The prompt ledger (driver/prompt_ledger.py): the groups the rank held open at the checkpoint were drawn again
    # (their episodes generated anew), so the resumed run trained the same prompt groups as the run that was
    # not stopped, each once; the last iteration's fresh groups, which no rank had room to admit, stay open.
    assert "drawing again the 2 prompt groups" in resumed_log.stdout + resumed_log.stderr
    whole, again = (
        json.loads((tmp_path / run / "checkpoints" / f"iter-{JOB_ITERATIONS:06d}" / "ledger.json").read_text())
        for run in ("run", "crashed")
    )
    assert again["trained"] == whole["trained"]  # which iteration trains which group: the episodes' pace
    assert sorted(d for draws in whole["trained"].values() for d in draws) == list(range(6))
    assert [len(draws) for draws in whole["trained"].values()] == [JOB_G] * JOB_ITERATIONS
    summary = {"trained": 6, "passed_over": 0, "trained_twice": 0}
    assert whole["summary"] == {**summary, "drawn": 8, "open": 2}
    assert again["summary"] == {**summary, "drawn": 6, "open": 0}  # iteration 3 drew only the held groups again
