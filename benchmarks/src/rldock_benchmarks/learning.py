"""Is the learning real? Run a job config and the same config with learning rate 0, side by side.

Prints one JSON document: for each run the mean reward of the first and last 5 iterations, their
difference, wall time, and the ratio of the two rises. The learning-rate-0 control keeps every
other part of the pipeline (warm-up, sampling, rewards, dock traffic) identical, so a rise that
only the real run shows comes from the GRPO updates.

    .venv/bin/python -m rldock_benchmarks.learning examples/grpo-tiny.yaml --output runs/learning
    .venv/bin/python -m rldock_benchmarks.learning examples/ppo-tiny.yaml --output runs/ppo \\
        --plot docs/img/ppo-learning.png

Any algorithm's config works: the control only sets `algorithm.learning_rate=0` (the policy), so
whatever else the algorithm trains (PPO's critic) still runs in the control. `--plot` draws both
reward curves into one PNG.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rldock.runtime.driver.records import headline_key


def reward_rise(records: list[dict], window: int = 5) -> dict:
    """Rise of the run's headline metric: the sampled reward, or for DPO (which samples nothing)
    the policy's preference accuracy on each iteration's fresh pairs, measured before its step.
    The keys keep the `reward_` names so reports of every algorithm read alike."""
    key = headline_key(records[0])
    rewards = [r[key] for r in records]
    first, last = rewards[:window], rewards[-window:]
    first_mean, last_mean = sum(first) / len(first), sum(last) / len(last)
    return {
        "metric": key,
        "reward_first5": first_mean,
        "reward_last5": last_mean,
        "rise": last_mean - first_mean,
        "iterations": len(records),
    }


def train_command(config: str, output: Path, overrides: list[str]) -> list[str]:
    """`rldock train` of `config` into `output` with progress lines (not the bar), resuming what is there."""
    command = [
        sys.executable,
        "-m",
        "rldock.runtime.cli",
        "train",
        config,
        "--output",
        str(output),
        "--no-progress",
        "--resume",
    ]
    for override in overrides:
        command += ["--set", override]
    return command


def run(config: str, output: Path, overrides: list[str]) -> dict:
    command = train_command(config, output, overrides)
    output.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with (output / "train.log").open("a") as log:  # keeps this script's stdout one JSON document
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    records = read_records(output)
    return {**reward_rise(records), "seconds": seconds, "output": str(output)}


def read_records(output: Path) -> list[dict]:
    """The run's iterations' records: not iteration 0, the initial policy's evaluation (evaluation.at_start)."""
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line]
    return [record for record in records if record["iteration"] >= 1]


def plot_curves(runs: dict[str, Path], title: str, path: Path) -> None:
    """Mean reward per iteration of each run (label -> output dir) on one axis, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, output in runs.items():
        records = read_records(output)
        key = headline_key(records[0])
        ax.plot([r["iteration"] for r in records], [r[key] for r in records], marker=".", label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward (sampled)" if key == "reward_mean" else "policy preference accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--output", default="runs/learning")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--plot", type=Path, help="write both runs' reward curves to this PNG")
    args = parser.parse_args()
    out = Path(args.output)
    trained = run(args.config, out / "trained", args.overrides)
    control = run(args.config, out / "lr0", [*args.overrides, "algorithm.learning_rate=0"])
    if args.plot:
        plot_curves(
            {"trained": out / "trained", "learning rate 0 (control)": out / "lr0"}, Path(args.config).name, args.plot
        )
    print(
        json.dumps(
            {
                "config": args.config,
                "trained": trained,
                "learning_rate_0": control,
                "rise_difference": trained["rise"] - control["rise"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
