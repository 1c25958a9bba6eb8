"""Is the learning real? Run a job config and the same config with learning rate 0, side by side.

Prints one JSON document: for each run the mean reward of the first and last 5 iterations, their
difference, wall time, and the ratio of the two rises. The learning-rate-0 control keeps every
other part of the pipeline (warm-up, sampling, rewards, dock traffic) identical, so a rise that
only the real run shows comes from the GRPO updates.

    .venv/bin/python benchmarks/learning.py examples/grpo-tiny.yaml --output runs/learning
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def reward_rise(records: list[dict], window: int = 5) -> dict:
    rewards = [r["reward_mean"] for r in records]
    first, last = rewards[:window], rewards[-window:]
    first_mean, last_mean = sum(first) / len(first), sum(last) / len(last)
    return {"reward_first5": first_mean, "reward_last5": last_mean, "rise": last_mean - first_mean,
            "iterations": len(records)}


def run(config: str, output: Path, overrides: list[str]) -> dict:
    command = [sys.executable, "-m", "rldock.cli", "train", config, "--output", str(output),
               "--no-progress", "--resume"]
    for override in overrides:
        command += ["--set", override]
    output.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with (output / "train.log").open("a") as log:  # keeps this script's stdout one JSON document
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line]
    return {**reward_rise(records), "seconds": seconds, "output": str(output)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--output", default="runs/learning")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    out = Path(args.output)
    trained = run(args.config, out / "trained", args.overrides)
    control = run(args.config, out / "lr0", [*args.overrides, "algorithm.learning_rate=0"])
    print(json.dumps({
        "config": args.config,
        "trained": trained,
        "learning_rate_0": control,
        "rise_difference": trained["rise"] - control["rise"],
    }, indent=2))


if __name__ == "__main__":
    main()
