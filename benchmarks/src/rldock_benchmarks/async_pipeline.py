"""Asynchronous vs synchronous training end to end, per shape, in one run: iteration time and tokens/s.

For the demo shape and the generation-heavy shape of the throughput benchmark (throughput.py), the
same job runs three times in fresh workers on one local Ray:
- `sync`: training.mode sync, dock.max_staleness 0 (the old-logprob pass skipped as redundant);
- `sync_recompute`: the same with algorithm.recompute_old_logprobs always, the pass the async
  pipeline needs (its samples are one version old), so the pipelining itself is isolated;
- `async`: training.mode async with dock.max_staleness 1: the next iteration's generation,
  old-logprob, reference, reward and advantage stages are launched before this iteration's update.
Each prints the throughput benchmark's summary (medians after warm-up: iteration time, T by Eq. (5),
machine tokens/s, stage breakdown, idle time per worker group) plus the mean staleness of the
samples trained on, and the ratios `async` / `sync` and `async` / `sync_recompute`.

    .venv/bin/python -m rldock_benchmarks.async_pipeline --output runs/async > async.json
    .venv/bin/python -m rldock_benchmarks.async_pipeline --quick --output runs/async-quick

On one node the pipeline can only overlap what different worker processes do at the same time: the
actor ranks run generation and update one after the other in their own process whatever the mode,
so the gain is bounded by the time other groups (reference, reward, advantage) would have spent
while the actors waited, and on two CPU cores shared by every worker there are no idle cores to run
them on (see docs/transfer-dock.md, asynchronous training).
"""

from __future__ import annotations

import logging
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from rldock_benchmarks.throughput import run_shape_benchmark, run_variant, shape_config, summarise

SHAPES = ("demo", "generation_heavy")
VARIANTS: dict[str, dict[str, Any]] = {
    "sync": {"training": {"mode": "sync"}, "dock": {"max_staleness": 0}},
    "sync_recompute": {
        "training": {"mode": "sync"},
        "dock": {"max_staleness": 0},
        "algorithm": {"recompute_old_logprobs": "always"},
    },
    "async": {"training": {"mode": "async"}, "dock": {"max_staleness": 1}},
}


def run_shape(shape, *, args, models: dict[str, Path]) -> dict:
    results: dict[str, Any] = {}
    warm_start: Path | None = None
    for name, variant in VARIANTS.items():
        cfg = shape_config(shape, variant, iterations=args.iterations, models=models)
        output = args.output / shape.name / name
        started = time.perf_counter()
        records = run_variant(cfg, output, warm_start if cfg.warmup.steps else None)
        if cfg.warmup.steps and warm_start is None:  # the variants share one warm-up
            warm_start = args.output / shape.name / "warmup"
            shutil.rmtree(warm_start, ignore_errors=True)
            shutil.copytree(output / "warmup", warm_start)
        measured = records[args.warmup_iterations :] or records[-1:]
        results[name] = {
            **summarise(records, cfg, args.warmup_iterations),
            "staleness_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in measured),
            "wall_s": time.perf_counter() - started,
        }
        logging.info("%s/%s: %.3f s per iteration", shape.name, name, results[name]["iteration_s"])
    asynchronous = results["async"]
    algo = cfg.algorithm
    return {
        "shape": {
            "G": algo.num_prompts_per_iteration,
            "N": algo.num_responses_per_prompt,
            "PL": algo.max_prompt_length,
            "SL": algo.max_response_length,
            "model": shape.model,
        },
        "variants": results,
        "async_vs_sync": {
            "iteration_time_ratio": asynchronous["iteration_s"] / results["sync"]["iteration_s"],
            "tokens_per_s_ratio": asynchronous["tokens_per_s_machine"] / results["sync"]["tokens_per_s_machine"],
        },
        "async_vs_sync_recompute": {
            "iteration_time_ratio": asynchronous["iteration_s"] / results["sync_recompute"]["iteration_s"],
            "tokens_per_s_ratio": asynchronous["tokens_per_s_machine"]
            / results["sync_recompute"]["tokens_per_s_machine"],
        },
    }


def main() -> None:
    run_shape_benchmark(
        __doc__.splitlines()[0], default_output="runs/async", shape_names=SHAPES, unit="variant", run_shape=run_shape
    )


if __name__ == "__main__":
    main()
