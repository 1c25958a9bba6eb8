"""Does a stateful environment's task learn? examples/agent-smollm2-cabinet.yaml against a learning-rate-0 control.

SmolLM2-135M-Instruct looks through a directory of files the cabinet environment holds for each episode
(rldock.runtime.agent.examples.cabinet): `ls`, then `cat` the right file, then `#### <code>`. Prepares the
model as smollm2_learning does and the data with `rldock data generate cabinet` (each row's demonstration
and the task seed the environment rebuilds its files from), then runs two arms one after the other with
the same seed, through `rldock train`, each starting the environment's server processes
(`agent.environment.servers.command`: `rldock env serve`) itself:

- `trained`: the example: a warm-up on the demonstrations, then GRPO on episodes with the environment;
- `learning_rate_0`: the same with `algorithm.learning_rate=0`, from the `trained` arm's warmed-up model
  with `warmup.steps=0` where that arm ran first (as agent_learning's control).

Credit per turn (docs/algorithms/turn-credit.md) has arms of its own, with `--read-reward R`: the
environment then also rewards the first `cat` of the right file with R (the cabinet's `read_reward`), a
reward per step, and every arm runs against it:

- `trained` (GRPO, trajectory-level), `grpo_turn` (GRPO crediting turns, `algorithm.credit: turn`),
  `ppo_turn_gae` (PPO with its GAE by turn and rewards per turn; the critic on a second CPU device),
  each against the one `learning_rate_0` control (at learning rate 0 the policy is the same whatever the
  algorithm, so one control serves all three).

Bring your own agent (docs/agentic.md#bring-your-own-agent) has arms of its own: `langgraph` runs the same
task through examples/harnesses/langgraph_cabinet.py, a LangGraph graph over a stock OpenAI client at the
episode's gateway URL (no environment servers: the graph is its own shell), and `langgraph_learning_rate_0`
is its control (from the `langgraph` arm's warm-up). For these arms the JSON also sums the gateway's
exactness over every episode of the run (`gateway`: episodes whose dock ids were the sampled ids, and how
many would have drifted, by how many tokens, had the final messages been re-rendered).

Prints one JSON document to stdout: each arm's held-out greedy accuracy at the start (iteration 0, after
the warm-up) and after the last iteration, the model turns per held-out and per sampled episode, how the
held-out episodes ended, the warm-up's and the whole run's seconds, and the margin (trained gain -
control gain; with the turn arms, each arm's); progress goes to stderr.

    .venv/bin/python -m rldock_benchmarks.cabinet_learning --output runs/cabinet-learning
    .venv/bin/python -m rldock_benchmarks.cabinet_learning --iterations 1 --set evaluation.max_prompts=8
    .venv/bin/python -m rldock_benchmarks.cabinet_learning --read-reward 0.2 \
        --arms trained,grpo_turn,ppo_turn_gae,learning_rate_0 --output runs/cabinet-turns
    .venv/bin/python -m rldock_benchmarks.cabinet_learning --arms langgraph,langgraph_learning_rate_0 \
        --output runs/cabinet-langgraph
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rldock_benchmarks.agent_learning import warmup_seconds
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

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
EXAMPLE = EXAMPLES / "agent-smollm2-cabinet.yaml"
# The user's LangGraph program in place of rldock's loop and the environment's servers; one dock row per
# episode (the graph keeps its history, so an episode is one segment).
LANGGRAPH = [
    "agent.environment=null",
    f"agent.harness={EXAMPLES / 'harnesses' / 'langgraph_cabinet.py'}:run",
    "agent.max_segments=1",
]
# The data the example's header prepares: 4 files of 3 codes per task.
DATA_ARGS = ("cabinet", "--num-train", "2000", "--num-val", "100", "--seed", "0")
ARMS = {
    "trained": [],
    "learning_rate_0": ["algorithm.learning_rate=0"],
    "grpo_turn": ["algorithm.credit=turn"],
    "ppo_turn_gae": [
        "algorithm.name=ppo",
        "algorithm.gae_unit=turn",
        "algorithm.credit=turn",
        "resources.devices_per_node=2",  # the critic's rank takes a device of its own
    ],
    "langgraph": LANGGRAPH,
    "langgraph_learning_rate_0": [*LANGGRAPH, "algorithm.learning_rate=0"],
}
CONTROLS = {"learning_rate_0": "trained", "langgraph_learning_rate_0": "langgraph"}  # control: whose warm-up
DEFAULT_ARMS = ("trained", "learning_rate_0")
TURN_ARMS = ("trained", "grpo_turn", "ppo_turn_gae")  # each against learning_rate_0
SERVE = ["rldock", "env", "serve", "rldock.runtime.agent.examples.cabinet:Cabinet", "--listen-fd", "{listen_fd}"]


def read_reward_overrides(read_reward: float | None) -> list[str]:
    """The environment's servers started with the cabinet's `read_reward` (none: the example's own)."""
    if read_reward is None:
        return []
    return [f"agent.environment.servers.command={json.dumps([*SERVE, '--option', f'read_reward={read_reward:g}'])}"]


def control_overrides(label: str, output: Path, done: dict[str, Any]) -> list[str]:
    """The arm's overrides; a control starts from its trained arm's warm-up when that arm has run."""
    warmed_up_by = CONTROLS.get(label)
    if warmed_up_by in done:
        return [*ARMS[label], f"model.path={output / str(warmed_up_by) / 'warmup'}", "warmup.steps=0"]
    return ARMS[label]


GATEWAY_COUNTS = ("exact_episodes", "inexact_episodes", "segments", "rerender_drifted", "rerender_drift_tokens")


def gateway_exactness(records: list[dict[str, Any]]) -> dict[str, float]:
    """The gateway's counts summed over every sampled and held-out episode of a harness arm's run."""
    totals = dict.fromkeys(GATEWAY_COUNTS, 0.0)
    for record in records:
        for name in GATEWAY_COUNTS:
            totals[name] += record.get("agent", {}).get(f"gateway/{name}", 0.0)
            totals[name] += record.get(f"val/agent/gateway/{name}", 0.0)
    return totals


ENDS = ("answer", "max_turns", "length")  # how rldock's own loop ends an episode whose session did not fail
ENDED = "val/agent/ended/"


def episodes(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Held-out accuracy and reward at each evaluation, model turns per episode, held-out (greedy, first and
    last evaluation) and sampled (first and last iteration), and the shares of the last evaluation's
    episodes by how they ended: every end the run counted (a harness's `harness_done`, `harness_error`,
    ... included), with the native loop's ends at 0 where none ended so."""
    evaluations = [r for r in records if "val/accuracy" in r]
    trained = [r for r in records if "timing" in r]
    last = evaluations[-1]
    counted = {key.removeprefix(ENDED): value for key, value in last.items() if key.startswith(ENDED)}
    ended = {**dict.fromkeys(ENDS, 0.0), **counted}
    total = sum(ended.values()) or 1.0
    return {
        "val_accuracy_by_iteration": {r["iteration"]: r["val/accuracy"] for r in evaluations},
        "val_reward_by_iteration": {r["iteration"]: r.get("val/reward") for r in evaluations},
        "val_turns_start": evaluations[0].get("val/agent/turns_mean"),
        "val_turns_end": last.get("val/agent/turns_mean"),
        "val_ended_end": {end: count / total for end, count in ended.items()},
        "train_turns_first": trained[0].get("agent", {}).get("turns_mean"),
        "train_turns_last": trained[-1].get("agent", {}).get("turns_mean"),
        "train_reward_by_iteration": [r["reward_mean"] for r in trained],
    }


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__.splitlines()[0], config=EXAMPLE, output=Path("runs/cabinet-learning"))
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument(
        "--read-reward", type=float, default=None, help="the cabinet's reward for reading the right file"
    )
    args = parser.parse_args(argv)
    labels = args.arms.split(",")
    unknown = sorted(set(labels) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    # The environment's servers.command starts `rldock`: the one beside this interpreter, venv activated or not.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    started = time.perf_counter()
    model = prepare_model()
    data = prepare_data(args.output / "data", DATA_ARGS)
    overrides = [
        *job_overrides(model, data, iterations=args.iterations),
        *read_reward_overrides(args.read_reward),
        *args.overrides,
    ]
    arms: dict[str, dict[str, Any]] = {}
    for label in labels:
        log(f"{label}: starting")
        output = args.output / label
        seconds = train(args.config, output, [*overrides, *control_overrides(label, args.output, arms)], label=label)
        records = read_records(output)
        arms[label] = {**summarise(records, seconds), **episodes(records), "warmup_seconds": warmup_seconds(output)}
        if label.startswith("langgraph"):
            arms[label]["gateway"] = gateway_exactness(records)
        log(
            f"{label}: val accuracy {arms[label]['val_accuracy_start']:.3f} -> {arms[label]['val_accuracy_end']:.3f}, "
            f"turns {arms[label]['val_turns_start']} -> {arms[label]['val_turns_end']} in {seconds:.0f} s"
        )
    results: dict[str, Any] = dict(arms)
    if "learning_rate_0" in arms:
        control = arms["learning_rate_0"]["val_accuracy_gain"]
        if "trained" in arms:
            results["gain_margin_vs_learning_rate_0"] = arms["trained"]["val_accuracy_gain"] - control
        results["gain_margins_vs_learning_rate_0"] = {
            label: arms[label]["val_accuracy_gain"] - control for label in TURN_ARMS if label in arms
        }
    if "langgraph" in arms and "langgraph_learning_rate_0" in arms:
        results["langgraph_gain_margin_vs_learning_rate_0"] = (
            arms["langgraph"]["val_accuracy_gain"] - arms["langgraph_learning_rate_0"]["val_accuracy_gain"]
        )
    print(json.dumps(report(args.config, model, data, overrides, started, results), indent=2))


if __name__ == "__main__":
    main()
