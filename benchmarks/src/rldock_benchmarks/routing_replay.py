"""Routing replay against none on the tiny MoE job: how far the update's logprobs of the sampled tokens
are from their old logprobs, with `algorithm.routing_replay: reference` and `off`.

The same job (examples/grpo-tiny-moe.yaml: EP 2 x FSDP 2, vLLM on CPU) runs twice on local Ray, with
several optimizer steps per iteration and the old-logprob pass in both (`recompute_old_logprobs:
always`, which `reference` implies) and the engine's logprobs kept (`rollout.return_logprobs`), and prints
one JSON document: per run the update metrics averaged over its iterations and steps
(`ratio_sq_dev_mean`, the token mean of (ratio - 1)^2; `ratio_abs_dev_max`, the largest |ratio - 1| of a
step; `logprob_abs_diff_mean`, the token mean of |logprob - old logprob|; `rollout_logprob_abs_diff_mean`,
the token mean of |logprob - the vLLM engine's logprob|, the training-inference mismatch; and under
replay `moe/routing_replay_changed`, the share of replayed (token, layer) routings the routers would
have chosen otherwise), the reward and the wall time, and the off/reference ratios.

    .venv/bin/python -m rldock_benchmarks.routing_replay \\
        --output runs/routing-replay > routing-replay.json

What it measures: `reference` pins the update's routing to the old-logprob pass's, so the mismatch it
narrows is the drift of routing between that pass and the update's forwards (other micro-batch layouts,
then weights moved by the earlier steps). It does not use the rollout engine's routing (vLLM's CPU build
returns none), which is what R3 replays; `rollout_logprob_abs_diff_mean` shows what it does to the
engine-versus-trainer gap all the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rldock_benchmarks.learning import run

CONFIG = "examples/grpo-tiny-moe.yaml"
MODES = ("off", "reference")
SPREAD_KEYS = ("ratio_sq_dev_mean", "ratio_abs_dev_max", "logprob_abs_diff_mean", "rollout_logprob_abs_diff_mean")


def run_mode(mode: str, *, output: Path, iterations: int, updates: int, overrides: list[str]) -> dict:
    """One job at `algorithm.routing_replay: mode`; the spread metrics averaged over its iterations."""
    settings = [
        f"iterations={iterations}",
        f"algorithm.num_updates_per_iteration={updates}",
        "algorithm.recompute_old_logprobs=always",
        "rollout.return_logprobs=true",
        f"algorithm.routing_replay={mode}",
        f"checkpoint.interval={iterations}",
        *overrides,
    ]
    result = run(CONFIG, output / mode, settings)
    records = [json.loads(line) for line in (output / mode / "metrics.jsonl").read_text().splitlines() if line]
    keys = [*SPREAD_KEYS, *(["moe/routing_replay_changed"] if mode == "reference" else [])]
    return {
        **{key: statistics.fmean(r[key] for r in records) for key in keys},
        "first_iteration": {key: records[0][key] for key in keys},
        "reward_mean": statistics.fmean(r["reward_mean"] for r in records),
        "iterations": len(records),
        "seconds": result["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/routing-replay"))
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--updates", type=int, default=4, help="algorithm.num_updates_per_iteration")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    runs = {
        mode: run_mode(
            mode, output=args.output, iterations=args.iterations, updates=args.updates, overrides=args.overrides
        )
        for mode in MODES
    }
    off, replay = runs["off"], runs["reference"]
    print(
        json.dumps(
            {
                "config": CONFIG,
                "num_updates_per_iteration": args.updates,
                "runs": runs,
                "off_over_reference": {key: off[key] / max(replay[key], 1e-300) for key in SPREAD_KEYS},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
