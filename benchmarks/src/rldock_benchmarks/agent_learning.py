"""Does tool use learn? examples/agent-smollm2-python.yaml against a learning-rate-0 control and the job without tools.

SmolLM2-135M-Instruct on word problems whose arithmetic it cannot do in its head (sums and products of
numbers up to 999). Prepares the model and the data (with each row's python-tool demonstration) as
smollm2_learning does, then runs three arms one after the other with the same seed, through
`rldock train`:

- `tools`: the example: a warm-up on the tool-use demonstrations, then GRPO on episodes with the python tool;
- `learning_rate_0`: the same with `algorithm.learning_rate=0`, starting from the `tools` arm's warmed-up
  model with `warmup.steps=0` where that arm ran first (the warm-up is deterministic given the seed, so
  this is the model its own warm-up would make, minutes sooner); RL changes nothing;
- `no_tools`: the same job without the `agent` section and without `data.demonstration_key`, so the
  warm-up trains on the worked answers instead, the same steps, then GRPO on single responses.

Prints one JSON document to stdout: each arm's held-out greedy accuracy at the start (iteration 0, after
the warm-up) and after the last iteration, the tool calls per held-out and per sampled episode, the
warm-up's and the whole run's seconds, and the margins (tools gain - control gain; tools final - no-tools
final); progress goes to stderr.

    .venv/bin/python -m rldock_benchmarks.agent_learning --output runs/agent-learning
    .venv/bin/python -m rldock_benchmarks.agent_learning --iterations 1 --set evaluation.max_prompts=8
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from rldock_benchmarks.smollm2_learning import (
    arguments,
    job_overrides,
    log,
    prepare_data,
    prepare_model,
    read_records,
    report,
    summarise,
    train,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "agent-smollm2-python.yaml"
# The data the example's header prepares: one-step sums and products of numbers up to 999.
DATA_ARGS = (
    "word_problems",
    "--operations",
    "add,multiply",
    "--max-number",
    "999",
    "--max-factor",
    "999",
    "--num-train",
    "2000",
    "--num-val",
    "100",
    "--seed",
    "0",
    "--tool-demonstrations",
    "python",
)
ARMS = {
    "tools": [],
    "learning_rate_0": ["algorithm.learning_rate=0"],
    "no_tools": ["agent=null", "data.demonstration_key=null"],
}
_WARMUP_SECONDS = re.compile(r"warmup finished: \d+ steps in ([0-9.]+) s")


def tool_use(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Tool calls per episode: held-out (greedy) at the first and last evaluation, sampled in the first
    and last iteration; zeros for a job without tools (its records have no agent section)."""
    evaluations = [r for r in records if "val/accuracy" in r]
    trained = [r for r in records if "timing" in r]
    return {
        "val_tool_calls_start": evaluations[0].get("val/agent/tool_calls_mean", 0.0),
        "val_tool_calls_end": evaluations[-1].get("val/agent/tool_calls_mean", 0.0),
        "train_tool_calls_first": trained[0].get("agent", {}).get("tool_calls_mean", 0.0),
        "train_tool_calls_last": trained[-1].get("agent", {}).get("tool_calls_mean", 0.0),
    }


def warmup_seconds(output: Path) -> float | None:
    """The warm-up's seconds as the job logged them (None when it ran none or the log lacks the line)."""
    found = _WARMUP_SECONDS.findall((output / "train.log").read_text())
    return float(found[-1]) if found else None


def arm_overrides(
    label: str, output: Path, done: dict[str, Any], *, arms: dict[str, list[str]] = ARMS, warmed_up_by: str = "tools"
) -> list[str]:
    """The arm's own overrides (of `arms`); the control starts from the warm-up of the arm `warmed_up_by`
    when that arm has run."""
    if label == "learning_rate_0" and warmed_up_by in done:
        return [*arms[label], f"model.path={output / warmed_up_by / 'warmup'}", "warmup.steps=0"]
    return arms[label]


def margins(arms: dict[str, dict[str, Any]]) -> dict[str, float]:
    tools, control, no_tools = arms["tools"], arms["learning_rate_0"], arms["no_tools"]
    return {
        "gain_margin_vs_learning_rate_0": tools["val_accuracy_gain"] - control["val_accuracy_gain"],
        "final_margin_vs_no_tools": tools["val_accuracy_end"] - no_tools["val_accuracy_end"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__.splitlines()[0], config=EXAMPLE, output=Path("runs/agent-learning"))
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    args = parser.parse_args(argv)
    labels = args.arms.split(",")
    unknown = sorted(set(labels) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    started = time.perf_counter()
    model = prepare_model()
    data = prepare_data(args.output / "data", DATA_ARGS)
    overrides = [*job_overrides(model, data, iterations=args.iterations), *args.overrides]
    arms: dict[str, dict[str, Any]] = {}
    for label in labels:
        log(f"{label}: starting")
        output = args.output / label
        seconds = train(args.config, output, [*overrides, *arm_overrides(label, args.output, arms)], label=label)
        records = read_records(output)
        arms[label] = {**summarise(records, seconds), **tool_use(records), "warmup_seconds": warmup_seconds(output)}
        log(
            f"{label}: val accuracy {arms[label]['val_accuracy_start']:.3f} -> {arms[label]['val_accuracy_end']:.3f}, "
            f"tool calls {arms[label]['val_tool_calls_start']:.2f} -> {arms[label]['val_tool_calls_end']:.2f} "
            f"in {seconds:.0f} s"
        )
    results = {**arms, **(margins(arms) if set(ARMS) <= set(arms) else {})}
    print(json.dumps(report(args.config, model, data, overrides, started, results), indent=2))


if __name__ == "__main__":
    main()
