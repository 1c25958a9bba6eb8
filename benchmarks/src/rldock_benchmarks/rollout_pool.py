"""Samples per second with a rollout pool (rollout.pool) of 1, 2 and 3 engines beside a fixed trainer, against
the actor ranks' engines alone, on the heavy-tailed agent workload of heavy_tail_trainer.py, as `rldock train`
runs it.

The same sync agent job (one actor rank: the trainer is fixed) in fresh workers per run: `colocated`, no pool;
`pool-1`, `pool-2`, `pool-3` with that many pool engines generating beside the actor rank's engine (each engine
takes whole groups from the dock while any are left). heavy_tail.py's model (the tiny model ending about every other
token with EOS) and environment (each episode's reset and steps sleep `--step-seconds` x k, k 1-10 drawn per
episode). Prints one JSON document: per run the samples per second over all its iterations and after the first,
each iteration's seconds, the samples each pool engine generated, the pool's weight load per version (each
engine's `load_weights`, median and max over the iterations after the first) and actor rank 0's host copy of the
version (`published_weights`'s path: the only path built, the object store); `samples_per_s_ratio`, each pool
run over `colocated`; and the machine's load average when each run started and ended (the 1-minute figure).

    .venv/bin/python -m rldock_benchmarks.rollout_pool > rollout-pool.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from rldock_benchmarks.heavy_tail_trainer import job_config, workload
from rldock_benchmarks.smollm2_learning import log
from rldock_benchmarks.throughput import run_variant

POOL_SIZES = (1, 2, 3)


def summary(records: list[dict], *, samples_per_iteration: int) -> dict[str, Any]:
    """Samples per second over all iterations and after the first, and what the pool did in each."""
    seconds = [r["timing"]["iteration"] for r in records]
    loads = [r["rollout/pool_weights_load_s"] for r in records if "rollout/pool_weights_load_s" in r]
    copies = [r["rollout/pool_publish_copy_s"] for r in records if "rollout/pool_publish_copy_s" in r]
    return {
        "samples_per_s": samples_per_iteration * len(records) / sum(seconds),
        "samples_per_s_after_first": samples_per_iteration * (len(records) - 1) / sum(seconds[1:]),
        "iteration_s": seconds,
        "pool_engine_samples": [r.get("rollout/pool_engine_samples", {}) for r in records],
        **(
            {
                "weights_load_s": {"median": statistics.median(loads), "max": max(loads)},
                "publish_copy_s": {"median": statistics.median(copies), "max": max(copies)},
            }
            if loads
            else {}
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/rollout-pool"))
    parser.add_argument("--groups", type=int, default=4, help="groups per batch (G)")
    parser.add_argument("--responses", type=int, default=2, help="episodes per group (N)")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--step-seconds", type=float, default=0.05, help="a step's sleep at k = 1")
    parser.add_argument("--steps", type=int, default=2, help="environment steps per episode after its reset")
    parser.add_argument("--pools", type=int, nargs="+", default=list(POOL_SIZES), help="pool sizes to run")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    args.max_staleness = 1  # heavy_tail_trainer's job reads it; nothing here is stale (sync, no carry)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the JSON report

    from rldock.config import parse_job_config

    model, train_file = workload(args.output)
    samples = args.groups * args.responses
    report: dict[str, Any] = {}
    with contextlib.redirect_stdout(sys.stderr):  # Ray's forwarded lines too: stdout carries only the JSON
        for replicas in (0, *args.pools):
            name = f"pool-{replicas}" if replicas else "colocated"
            data = job_config(args, model=model, train_file=train_file, carry=False)
            data["name"] = f"rollout-{name}"
            if replicas:
                data["rollout"] = {"pool": {"replicas": replicas}}
            load = os.getloadavg()[0]
            records = run_variant(parse_job_config(data), args.output / name, None)
            report[name] = summary(records, samples_per_iteration=samples)
            report[name]["load_average"] = [load, os.getloadavg()[0]]
            log(f"{name}: {report[name]['samples_per_s']:.2f} samples/s")
    baseline = report["colocated"]
    result = {
        "shape": {
            "groups": args.groups,
            "responses": args.responses,
            "iterations": args.iterations,
            "step_seconds": args.step_seconds,
            "steps": args.steps,
            "slowness": "1-10x per episode",
            "trainer": "one actor rank, its engine generating beside the pool's",
            "device": args.device,
        },
        **report,
        "samples_per_s_ratio": {
            name: run["samples_per_s"] / baseline["samples_per_s"]
            for name, run in report.items()
            if name != "colocated"
        },
        "samples_per_s_after_first_ratio": {
            name: run["samples_per_s_after_first"] / baseline["samples_per_s_after_first"]
            for name, run in report.items()
            if name != "colocated"
        },
    }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
