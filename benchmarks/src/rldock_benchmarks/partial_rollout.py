"""Partial rollout in the async pipeline, in one run: iteration time, tokens/s and the cut counters.

For the throughput benchmark's early-stopping shape (responses of unequal length, throughput.py) and
its generation-heavy shape (every response runs to max_response_length), the same async job
(training.mode async, dock.max_staleness 1) runs three times in fresh workers on one local Ray:
`off` (rollout.partial_rollout off), `resume` and `drop`, the last two with
rollout.max_tokens_per_round a quarter of max_response_length. Each prints the throughput
benchmark's summary (medians after warm-up) plus the partial-rollout counters per measured iteration
(means) and the ratios to `off`.

    .venv/bin/python -m rldock_benchmarks.partial_rollout --quick --output runs/partial-quick > partial.json

On one node the actor ranks run both rounds, the update and the old-logprob pass one after the
other in their own process, so cutting a generation moves work from before the update to after it
and adds a second engine call (and, for `resume`, the prefix's prefill again; `drop` samples the cut
responses again whole): what it saves elsewhere, a batch held back by its longest responses, needs
generation and training on different devices (docs/transfer-dock.md, partial rollout).
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

from rldock_benchmarks.throughput import run_shape_benchmark, run_variant, shape_config, summarise

SHAPES = ("generation_heavy", "early_stop")
MODES = ("off", "resume", "drop")
COUNTERS = ("partial_cut", "partial_resumed", "partial_dropped", "partial_carried_tokens", "partial_dropped_tokens")
BUDGET_SHARE = 4  # rollout.max_tokens_per_round = max_response_length // this


def variant(mode: str, max_response_length: int) -> dict[str, Any]:
    """The job overrides of one mode: async one iteration ahead, and the cut for resume and drop."""
    rollout = (
        {}
        if mode == "off"
        else {"partial_rollout": mode, "max_tokens_per_round": max(1, max_response_length // BUDGET_SHARE)}
    )
    return {"training": {"mode": "async"}, "dock": {"max_staleness": 1}, "rollout": rollout}


def run_shape(shape, *, args, models: dict[str, Path]) -> dict:
    max_response_length = shape.overrides["algorithm"]["max_response_length"]
    results: dict[str, Any] = {}
    for mode in MODES:
        cfg = shape_config(shape, variant(mode, max_response_length), iterations=args.iterations, models=models)
        started = time.perf_counter()
        records = run_variant(cfg, args.output / shape.name / mode, None)
        measured = records[args.warmup_iterations :] or records[-1:]
        counters = {key: statistics.fmean(r.get(f"rollout/{key}", 0) for r in measured) for key in COUNTERS}
        results[mode] = {
            **summarise(records, cfg, args.warmup_iterations),
            "counters": counters,
            "staleness_mean": statistics.fmean(r["staleness_mean"] for r in measured),
            "max_tokens_per_round": cfg.rollout.max_tokens_per_round,
            "wall_s": time.perf_counter() - started,
        }
        logging.info("%s/%s: %.3f s per iteration", shape.name, mode, results[mode]["iteration_s"])
    off = results["off"]
    return {
        "max_response_length": max_response_length,
        "variants": results,
        "vs_off": {
            mode: {
                "iteration_time_ratio": results[mode]["iteration_s"] / off["iteration_s"],
                "tokens_per_s_ratio": results[mode]["tokens_per_s_machine"] / off["tokens_per_s_machine"],
            }
            for mode in MODES
            if mode != "off"
        },
    }


def main() -> None:
    run_shape_benchmark(
        __doc__.splitlines()[0], default_output="runs/partial", shape_names=SHAPES, unit="mode", run_shape=run_shape
    )


if __name__ == "__main__":
    main()
