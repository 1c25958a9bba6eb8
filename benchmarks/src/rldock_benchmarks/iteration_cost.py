"""What an iteration costs once a job runs, and how much of it is the dock's dispatch, beside a
baseline commit in the same run.

Prints one JSON document. For this checkout and, with --baseline, a git worktree of that commit
(run on the same virtualenv, its source trees first on PYTHONPATH, as startup.py does), the demo
(examples/grpo-tiny.yaml) runs `rldock train` at two shapes, the variants alternating run by run
(A B A B ...):
- `demo`: the demo as written (G16 N8, 8 prompt and 6 response tokens);
- `fixed_cost`: G2 N2 with 2-token responses, so that the iteration is mostly what every iteration
  pays whatever its size (the dock's calls, the stage calls, the bookkeeping).
Reported per shape and variant, as medians over the iterations after --skip of every run:
`iteration` (timing/iteration), `dispatch` (timing/dispatch: the seconds every rank spent in dock
calls other than waiting for upstream samples, summed over ranks), `dispatch_share` (dispatch /
iteration) and each stage's compute. `ratio` is candidate / baseline of `iteration` and `dispatch`
(below 1: the candidate is faster). `same_numbers` compares reward_mean, kl, loss and entropy at
every iteration of each repeat's candidate and baseline runs of a shape (same_numbers.py): a change
to how samples move must not change what trains.

    .venv/bin/python -m rldock_benchmarks.iteration_cost --baseline cf1afa1 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rldock_benchmarks.harness import machine
from rldock_benchmarks.same_numbers import compare
from rldock_benchmarks.startup import REPO, SOURCE_TREES, worktree_of

CONFIG = "examples/grpo-tiny.yaml"
SHAPES: dict[str, list[str]] = {
    "demo": [],
    "fixed_cost": [
        "algorithm.num_prompts_per_iteration=2",
        "algorithm.num_responses_per_prompt=2",
        "algorithm.max_response_length=2",
    ],
}
STAGES = ("rollout", "reference", "reward", "update")
RUN_TIMEOUT_S = 900


def run_job(source: Path, shape: str, iterations: int, output: Path) -> list[dict[str, Any]]:
    """One `rldock train` of `source`'s code at `shape`: its records."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(source / tree) for tree in SOURCE_TREES)}
    command = [sys.executable, "-m", "rldock.runtime.cli", "train", CONFIG, "--output", str(output), "--no-progress"]
    for override in [f"iterations={iterations}", f"checkpoint.interval={iterations}", *SHAPES[shape]]:
        command += ["--set", override]
    log = output.with_suffix(".log")
    with open(log, "w") as sink:
        done = subprocess.run(
            command, cwd=source, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
        )
    if done.returncode != 0:
        raise RuntimeError(f"{source} {shape}: the job failed (rc {done.returncode}); see {log}")
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]


def timings(records: list[dict[str, Any]], skip: int) -> dict[str, list[float]]:
    """Per timing key, its values over the records after the first `skip`."""
    keys = ["iteration", "dispatch", *(f"compute/{stage}" for stage in STAGES)]
    kept = [record["timing"] for record in records[skip:]]
    return {key: [timing[key] for timing in kept if key in timing] for key in keys}


def summary(runs: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Medians over every kept iteration of every run of one variant at one shape."""
    pooled = {key: [value for run in runs for value in run[key]] for key in runs[0]}
    medians = {key: round(statistics.median(values), 4) for key, values in pooled.items() if values}
    medians["dispatch_share"] = round(medians["dispatch"] / medians["iteration"], 3)
    medians["iterations_measured"] = len(pooled["iteration"])
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=24, help="iterations per run")
    parser.add_argument("--skip", type=int, default=4, help="first iterations of each run not measured")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant at each shape")
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="only these shapes (default: both)")
    parser.add_argument("--baseline", help="a commit to run beside this checkout (e.g. main before a change)")
    args = parser.parse_args(argv)
    shapes = args.shape or list(SHAPES)
    report: dict[str, Any] = {
        "config": CONFIG,
        "iterations": args.iterations,
        "skip": args.skip,
        "repeats": args.repeats,
        "machine": machine(),
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rldock-iteration-cost-") as scratch, worktree_of(args.baseline) as base:
        variants = {"candidate": REPO, **({"baseline": base} if base is not None else {})}
        report["shapes"] = {}
        for shape in shapes:
            runs: dict[str, list[dict[str, list[float]]]] = {name: [] for name in variants}
            same: list[dict[str, Any]] = []
            for repeat in range(args.repeats):
                outputs = {}
                for name, source in variants.items():
                    outputs[name] = Path(scratch) / f"{shape}-{name}-{repeat}"
                    records = run_job(source, shape, args.iterations, outputs[name])
                    runs[name].append(timings(records, args.skip))
                    print(f"{shape} {name} run {repeat}: {len(records)} iterations", file=sys.stderr)
                if base is not None:
                    verdict = compare(outputs["baseline"], outputs["candidate"])
                    same.append(
                        {
                            key: verdict[key]
                            for key in ("same", "iterations", "metrics_differing", "checkpoint_files_differing")
                        }
                    )
            entry: dict[str, Any] = {name: summary(measured) for name, measured in runs.items()}
            if base is not None:
                entry["ratio"] = {
                    key: round(entry["candidate"][key] / entry["baseline"][key], 3) for key in ("iteration", "dispatch")
                }
                entry["same_numbers"] = same
            report["shapes"][shape] = entry
    if args.baseline is not None:
        report["baseline_ref"] = args.baseline
    report["seconds"] = round(time.monotonic() - started, 1)
    report["machine"]["load_average_at_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
