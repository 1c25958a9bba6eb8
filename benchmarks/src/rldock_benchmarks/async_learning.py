"""Does asynchronous training learn as well as synchronous at the same number of samples?

Runs one config (the demo by default) with `training.mode: sync` and with `training.mode: async`
(`dock.max_staleness` 1: generation one iteration ahead of the update) for several seeds, one job
after the other, and prints one JSON document: per seed and arm the mean reward over the first
and last `--window` iterations and over all of them, the per-iteration reward curve, the margin
async - sync per seed, and the spread of the sync arm over seeds (the control's noise the margin
is judged against). Both arms run the same iterations of the same G x N samples, so they train on
the same number of samples.

    .venv/bin/python -m rldock_benchmarks.async_learning --output runs/async-learning > async-learning.json
    .venv/bin/python -m rldock_benchmarks.async_learning --seeds 0 --iterations 4 --output runs/al-smoke

`--plot` draws every run's reward curve into one PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rldock.runtime.driver.records import headline_key
from rldock_benchmarks.learning import plot_curves, read_records, run

REPO = Path(__file__).resolve().parents[3]
DEMO_CONFIG = REPO / "examples" / "grpo-tiny.yaml"
ARMS: dict[str, list[str]] = {
    "sync": ["training.mode=sync", "dock.max_staleness=0"],
    "async": ["training.mode=async", "dock.max_staleness=1"],
}


def curve_summary(rewards: list[float], window: int) -> dict:
    """Mean reward of the first and last `window` iterations and of all of them."""
    window = max(1, min(window, len(rewards)))
    return {
        "reward_first": statistics.fmean(rewards[:window]),
        "reward_last": statistics.fmean(rewards[-window:]),
        "reward_all": statistics.fmean(rewards),
        "window": window,
        "curve": rewards,
    }


def compare(runs: dict[int, dict[str, dict]]) -> dict:
    """Margins async - sync per seed (last window and all iterations), their means over seeds, and
    the sync arm's spread over seeds (population standard deviation; 0 with one seed)."""
    seeds = sorted(runs)
    margins = {
        seed: {key: runs[seed]["async"][key] - runs[seed]["sync"][key] for key in ("reward_last", "reward_all")}
        for seed in seeds
    }
    spread = {
        key: statistics.pstdev([runs[seed]["sync"][key] for seed in seeds]) for key in ("reward_last", "reward_all")
    }
    mean_margin = {key: statistics.fmean(m[key] for m in margins.values()) for key in ("reward_last", "reward_all")}
    return {
        "margin_per_seed": margins,
        "mean_margin": mean_margin,
        "sync_seed_spread": spread,
        "async_within_sync_noise": {key: mean_margin[key] >= -spread[key] for key in mean_margin},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEMO_CONFIG))
    parser.add_argument("--output", type=Path, default=Path("runs/async-learning"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=None, help="per run (default: the config's)")
    parser.add_argument("--window", type=int, default=10, help="iterations in the first/last means")
    parser.add_argument("--plot", type=Path, help="write every run's reward curve to this PNG")
    args = parser.parse_args()
    common = [f"iterations={args.iterations}"] if args.iterations else []
    runs: dict[int, dict[str, dict]] = {}
    for seed in args.seeds:
        for arm, overrides in ARMS.items():
            output = args.output / f"seed{seed}" / arm
            result = run(args.config, output, [*common, f"seed={seed}", *overrides])
            records = read_records(output)
            key = headline_key(records[0])
            runs.setdefault(seed, {})[arm] = {
                **curve_summary([r[key] for r in records], args.window),
                "metric": key,
                "seconds": result["seconds"],
                "staleness_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in records),
            }
    if args.plot:
        plot_curves(
            {f"{arm}, seed {seed}": args.output / f"seed{seed}" / arm for seed in args.seeds for arm in ARMS},
            f"{Path(args.config).name}: sync vs async",
            args.plot,
        )
    print(json.dumps({"config": args.config, "seeds": args.seeds, "runs": runs, **compare(runs)}, indent=2))


if __name__ == "__main__":
    main()
