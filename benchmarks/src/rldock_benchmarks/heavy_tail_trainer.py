"""Throughput with a heavy tail through the trainer: carried episodes (rollout.partial_rollout carry) against
synchronous iterations (off), at one staleness bound, as `rldock train` runs them.

The same sync agent job twice in fresh workers, on heavy_tail.py's model (the tiny model ending about every
other token with EOS) and environment (each episode's reset and steps sleep `--step-seconds` x k, k 1-10
drawn per episode): `synchronous` with rollout.partial_rollout off (each iteration waits for its slowest
episode; dock.max_staleness the same bound, which nothing reaches), `carried` with carry at
`--max-staleness`. Each iteration trains one batch of G x N episodes; the update is a real one (the tiny
model's). Prints one JSON document: per run the samples per second over all its iterations (the
headline: both runs train the same G x N x iterations episodes, the carried run's extra admissions in its
first iteration and its drain in the last included) and over the iterations after the first, each
iteration's seconds, staleness (the update's mean and max) and carry counters, the episodes trained and
dropped (the update's samples handed out and stale_dropped); `samples_per_s_ratio`, carried over
synchronous; and the machine's load average when each run started and ended (the 1-minute figure).

    .venv/bin/python -m rldock_benchmarks.heavy_tail_trainer > heavy-tail-trainer.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from rldock_benchmarks.heavy_tail import eos_heavy_model
from rldock_benchmarks.smollm2_learning import log
from rldock_benchmarks.throughput import run_variant

MAX_MODEL_LEN = 128  # the model's positions: max_prompt_length + max_response_length
COUNTERS = ("carry_admitted", "carry_written", "carry_open")


def job_config(args, *, model: Path, train_file: Path, carry: bool) -> dict[str, Any]:
    """The job of one run: sync, one batch of `--groups` x `--responses` episodes per iteration."""
    return {
        "name": "heavy-tail-carried" if carry else "heavy-tail-synchronous",
        "seed": 1,
        "iterations": args.iterations,
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"train_files": [str(train_file)], "chat_template": "model"},
        "agent": {
            "environment": {
                "name": "rldock_benchmarks.heavy_tail:HeavyTailEnvironment",
                "options": {"step_seconds": str(args.step_seconds), "steps": str(args.steps)},
            },
            "max_turns": args.steps + 1,
            "max_tool_response_tokens": 8,
        },
        "algorithm": {
            "num_prompts_per_iteration": args.groups,
            "num_responses_per_prompt": args.responses,
            "max_prompt_length": 48,
            "max_response_length": MAX_MODEL_LEN - 48,
            "learning_rate": 1e-5,
        },
        "training": {"mode": "sync", "data_parallel_size": 1, "micro_batch_size": args.groups * args.responses},
        "rollout": {"partial_rollout": "carry", "importance_correction": "behaviour"} if carry else {},
        "dock": {"max_staleness": args.max_staleness},
        # the environment's reward, 1 at an episode's end: what is measured is the schedule, not learning
        "reward": {"terms": [{"name": "environment", "aggregate": "sum"}]},
        "evaluation": {"interval": 0},
        "checkpoint": {"interval": args.iterations, "keep_last": 1},
        "resources": {"device": args.device},
    }


def workload(output: Path) -> tuple[Path, Path]:
    """The model (heavy_tail.py's, ending about every other token) and the train file of 256 prompts, in `output`."""
    output.mkdir(parents=True, exist_ok=True)
    model = eos_heavy_model(output / "model", max_model_len=MAX_MODEL_LEN)
    train_file = output / "train.jsonl"
    train_file.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "0"}) + "\n" for i in range(256)))
    return model, train_file


def summary(records: list[dict], *, samples_per_iteration: int) -> dict[str, Any]:
    """Samples per second after the first iteration and over all, and what each iteration trained."""
    seconds = [r["timing"]["iteration"] for r in records]
    updates = [r["dock"]["controllers"]["update"] for r in records]
    return {
        "samples_per_s": samples_per_iteration * len(records) / sum(seconds),
        "samples_per_s_after_first": samples_per_iteration * (len(records) - 1) / sum(seconds[1:]),
        "iteration_s": seconds,
        "staleness_mean": [r["staleness_mean"] for r in records],
        "staleness_max": [r["staleness_max"] for r in records],
        "counters": {key: [r.get(f"rollout/{key}", 0) for r in records] for key in COUNTERS},
        "episodes_trained": sum(u["samples_handed_out"] for u in updates),
        "episodes_dropped": sum(u["stale_dropped"] for u in updates),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/heavy-tail-trainer"))
    parser.add_argument("--groups", type=int, default=4, help="groups per batch (G)")
    parser.add_argument("--responses", type=int, default=2, help="episodes per group (N)")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--step-seconds", type=float, default=0.05, help="a step's sleep at k = 1")
    parser.add_argument("--steps", type=int, default=2, help="environment steps per episode after its reset")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the JSON report

    from rldock.config import parse_job_config

    model, train_file = workload(args.output)
    samples = args.groups * args.responses
    report: dict[str, Any] = {}
    with contextlib.redirect_stdout(sys.stderr):  # Ray's forwarded lines too: stdout carries only the JSON
        for name, carry in (("synchronous", False), ("carried", True)):
            cfg = parse_job_config(job_config(args, model=model, train_file=train_file, carry=carry))
            load = os.getloadavg()[0]
            records = run_variant(cfg, args.output / name, None)
            report[name] = summary(records, samples_per_iteration=samples)
            report[name]["load_average"] = [load, os.getloadavg()[0]]
            log(f"{name}: {report[name]['samples_per_s']:.2f} samples/s")
    result = {
        "shape": {
            "groups": args.groups,
            "responses": args.responses,
            "iterations": args.iterations,
            "max_staleness": args.max_staleness,
            "step_seconds": args.step_seconds,
            "steps": args.steps,
            "slowness": "1-10x per episode",
            "device": args.device,
        },
        **report,
        "samples_per_s_ratio": report["carried"]["samples_per_s"] / report["synchronous"]["samples_per_s"],
        "samples_per_s_after_first_ratio": report["carried"]["samples_per_s_after_first"]
        / report["synchronous"]["samples_per_s_after_first"],
        "episodes_dropped": sum(report[name]["episodes_dropped"] for name in report),
    }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
