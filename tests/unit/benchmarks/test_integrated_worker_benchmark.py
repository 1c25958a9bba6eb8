"""The integrated-worker benchmark's configs, summary and meters (no jobs run): every shape is a
valid job under both placements, the two differ in their placement alone, the summary takes
medians after the first iteration, and the meter reads real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.states import placement_plan
from rldock_benchmarks.integrated_worker import (
    PLACEMENTS,
    TARGETS,
    compare,
    count_ray_workers,
    job_config,
    shapes,
    summarise,
    tree_rss,
)

SMOLLM2 = {"model": "/m/smollm2", "train": ["/d/train.jsonl"]}


@pytest.mark.parametrize("quick", [False, True])
def test_every_shape_runs_under_both_placements_with_a_seat_beside_each_actor_rank(quick):
    for shape in shapes(quick):
        colocated, separate = (
            job_config(shape, placement, iterations=3, smollm2_paths=SMOLLM2) for placement in PLACEMENTS
        )
        assert colocated.resources.placement == "colocated" and separate.resources.placement == "separate"
        assert not colocated.model.path.startswith("~")  # expanded, as the trainer reads it
        assert colocated.model_dump(exclude={"resources"}) == separate.model_dump(exclude={"resources"})
        recipe = job_recipe(colocated)
        assert "reference" in recipe.states  # a seat to share the actor's device with
        together, apart = placement_plan(colocated, recipe.specs), placement_plan(separate, recipe.specs)
        assert together.num_devices * 2 == apart.num_devices
        assert colocated.checkpoint.interval == colocated.iterations == 3
    full = {s.name: job_config(s, "colocated", iterations=3, smollm2_paths=SMOLLM2) for s in shapes(False)}
    fixed, smollm2 = full["fixed_cost"].algorithm, full["smollm2"]
    assert (fixed.num_prompts_per_iteration, fixed.num_responses_per_prompt, fixed.max_response_length) == (2, 2, 2)
    assert smollm2.model.path == "/m/smollm2" and smollm2.algorithm.kl_coef > 0
    assert smollm2.evaluation.interval == 0 and smollm2.data.val_files == [] and set(TARGETS) == set(full)


def test_a_smollm2_shape_needs_its_prepared_model():
    [smollm2] = [s for s in shapes(False) if s.smollm2]
    with pytest.raises(ValueError, match="SmolLM2"):
        job_config(smollm2, "separate", iterations=3)


def test_summary_is_the_median_after_the_first_iteration_and_keeps_every_reward():
    records = [
        {"timing": {"iteration": s, **({"cycle": s + 0.5} if i else {})}, "reward_mean": r}
        for i, (s, r) in enumerate([(9.0, 0.1), (1.0, 0.2), (3.0, 0.3), (2.0, 0.4)])
    ]
    summary = summarise(records, {"device_processes": 2})
    assert (summary["iteration_s"], summary["stages_s"], summary["iterations_measured"]) == (2.5, 2.0, 3)
    assert summary["rewards"] == [0.1, 0.2, 0.3, 0.4] and summary["device_processes"] == 2


def test_compare_takes_each_placements_median_run_and_checks_the_target_and_the_rewards():
    def run(seconds: float, rewards=(0.5, 0.6)) -> dict:
        return {"iteration_s": seconds, "rewards": list(rewards)}

    runs = {"colocated": [run(0.3), run(0.1), run(0.2)], "separate": [run(0.5)]}
    result = compare(runs, target=0.6)
    assert result["integrated_vs_separate"] == pytest.approx(0.2 / 0.5) and result["meets_target"] is True
    assert result["same_rewards"] is True and result["runs"]["colocated"] == [0.3, 0.1, 0.2]
    runs["separate"] = [run(0.25, rewards=(0.5, 0.7))]
    result = compare(runs, target=0.6)
    assert result["meets_target"] is False and result["same_rewards"] is False


def test_the_meter_reads_resident_memory_and_counts_only_ray_workers_below_its_root():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert tree_rss([os.getpid()]) > tree_rss([child.pid]) > 0  # the child is below this process
        assert tree_rss([2**22 + 7]) == 0  # a process that ended (or never was) counts 0
        assert count_ray_workers(os.getpid()) == 0  # a python child is no Ray worker
    finally:
        child.kill()
        child.wait()
