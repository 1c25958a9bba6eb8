"""The throughput benchmark's configs and summary (no jobs run): every shape and variant is a valid
job whose switches say what the variant claims, and the summary takes medians after warm-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from rldock_benchmarks.throughput import ALL_OFF, ALL_ON, SWITCHES_OFF, SWITCHES_ON, shape_config, shapes, summarise

MODELS = {"heavy": Path("/m/heavy"), "heavy_no_eos": Path("/m/heavy-no-eos")}


@pytest.mark.parametrize("quick", [False, True])
def test_every_shape_and_variant_is_a_valid_job_with_its_switches(quick):
    for shape in shapes(quick):
        on = shape_config(shape, ALL_ON, iterations=3, models=MODELS)
        off = shape_config(shape, ALL_OFF, iterations=3, models=MODELS)

        def switches(cfg):
            return (
                cfg.algorithm.recompute_old_logprobs,
                cfg.training.trim_padding,
                cfg.training.num_threads,
                cfg.rollout.stream_groups,
                cfg.ablations.fuse_reward_advantage,
                cfg.ablations.background_bookkeeping,
                cfg.ablations.colocate_controllers,
                cfg.ablations.shared_memory,
            )

        assert switches(on) == ("auto", True, None, 0, True, True, True, True)
        assert switches(off) == ("always", False, 0, 0, False, False, False, False)
        for variant in [*SWITCHES_OFF.values(), *SWITCHES_ON.values()]:
            cfg = shape_config(shape, variant, iterations=3, models=MODELS)
            changed = [a != b for a, b in zip(switches(cfg), switches(on))]
            assert sum(changed) == 1, (shape.name, variant)  # exactly one optimisation switched
    full = {s.name: shape_config(s, ALL_ON, iterations=3, models=MODELS) for s in shapes(False)}
    heavy = full["generation_heavy"].algorithm
    assert (heavy.num_prompts_per_iteration, heavy.num_responses_per_prompt, heavy.max_response_length) == (32, 8, 128)
    assert full["generation_heavy"].model.path == "/m/heavy-no-eos" and full["early_stop"].model.path == "/m/heavy"
    demo = full["demo"].algorithm
    assert (demo.num_prompts_per_iteration, demo.num_responses_per_prompt) == (16, 8)
    assert full["demo"].model.path == str(Path.home() / ".cache/rldock/models/tiny-qwen2-addition-v1")  # `~` expanded


def test_summary_is_the_median_after_warm_up():
    cfg = shape_config(shapes(False)[0], ALL_ON, iterations=4, models=MODELS)  # demo: G16 N8
    records = [
        {
            "timing": {"iteration": s, "rollout": s / 2, "compute/rollout": s / 4, "idle/update": 0.1},
            "tokens_per_s_per_device": 10.0 / s,
            "prompt_length_mean": 6.0,
            "response_length_mean": 2.0,
            "reward_mean": 0.5,
        }
        for s in (9.0, 1.0, 2.0, 3.0)
    ]
    summary = summarise(records, cfg, warmup_iterations=1)
    assert summary["iteration_s"] == 2.0 and summary["iterations_measured"] == 3
    assert summary["tokens_per_s_machine"] == 16 * 8 * (6.0 + 2.0) / 2.0
    assert summary["stages_s"] == {"rollout": 1.0} and summary["idle_s"] == {"update": 0.1}
    assert summary["compute_s"] == {"rollout": 0.5}
