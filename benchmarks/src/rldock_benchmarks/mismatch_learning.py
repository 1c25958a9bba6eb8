"""Which rollout corrections keep learning on par when the engine and the trainer disagree?

Runs one config (the demo by default; `examples/grpo-tiny-moe.yaml` for the tiny MoE) in arms, one job
after the other, and prints one JSON document. Two sources of the train-inference gap, each run with no
correction and with three of algorithm.rollout_correction's (docs/algorithms/rollout-correction.md):

- `bfloat16`: generation in bfloat16 (rollout.dtype) over the float32 trainer;
- `async2`: training.mode async with dock.max_staleness 2, the engine up to two versions behind the
  policy whose old-logprob pass meets its logprobs (the behaviour policy against the proximal one).

Corrections: `none`, `tis` (token-level truncated importance weights, cap 2), `seq_mask` (the `trl`
preset: sequence weights masked outside [0, 3]) and `icepop` (the `icepop` preset: token weights masked
outside [0.5, 5]). Against them the `matched` run (float32, synchronous: the gap only the kernels make)
and its learning-rate-0 control `lr0`. Every arm measures the gap (monitoring.mismatch, action `warn`,
a budget no run reaches), so each reports the mean of `mismatch/kl` and `mismatch/abs_diff_mean` over
its iterations beside its reward curve; `on_par` compares each arm's reward rise with the matched
run's, in units of the matched run's rise above the control's. An arm the config check refuses on the
config (the async arms on a config with resources.phase_schedule serial) is listed under `refused` with the
reason and not run.

`--seeds K` runs every arm under seeds 0..K-1 (the job's `seed`: data order, sampling, initialisation and the
warm-up). `on_par` is then computed within each seed (its arms against its own matched run and control), and
`on_par_over_seeds` gives each arm's mean, least and greatest over the seeds: an arm whose range holds the
matched run's 1 is not shown to learn worse than it.

    .venv/bin/python -m rldock_benchmarks.mismatch_learning --output runs/mismatch-learning > mismatch.json
    .venv/bin/python -m rldock_benchmarks.mismatch_learning --config examples/grpo-tiny-moe.yaml \\
        --output runs/mismatch-learning-moe > mismatch-moe.json
    .venv/bin/python -m rldock_benchmarks.mismatch_learning --arms matched bfloat16/none --iterations 4
    .venv/bin/python -m rldock_benchmarks.mismatch_learning --seeds 3 --output runs/mismatch-seeds > seeds.json

`--plot` draws every arm's reward curve into one PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rldock.config.loading import ConfigError, load_job_config
from rldock.runtime.cli.arguments import parse_override
from rldock_benchmarks.learning import plot_curves, read_records, reward_rise, run

REPO = Path(__file__).resolve().parents[3]
DEMO_CONFIG = REPO / "examples" / "grpo-tiny.yaml"
# Every arm measures the gap and never stops on it: the metrics of the uncorrected arms too.
MEASURED = ["monitoring.mismatch.max_kl=10", "monitoring.mismatch.action=warn"]
SOURCES: dict[str, list[str]] = {
    "bfloat16": ["rollout.dtype=bfloat16"],
    "async2": ["training.mode=async", "dock.max_staleness=2"],
}
CORRECTIONS: dict[str, list[str]] = {
    "none": [],
    "tis": ["algorithm.rollout_correction.weight=token", "algorithm.rollout_correction.weight_cap=2"],
    "seq_mask": ["algorithm.rollout_correction.preset=trl"],
    "icepop": ["algorithm.rollout_correction.preset=icepop"],
}
ARMS: dict[str, list[str]] = {
    "matched": [],
    "lr0": ["algorithm.learning_rate=0"],
    **{
        f"{source}/{correction}": [*changes, *fix]
        for source, changes in SOURCES.items()
        for correction, fix in CORRECTIONS.items()
    },
}
GAP_KEYS = ("mismatch/kl", "mismatch/abs_diff_mean", "mismatch/tokens_dropped", "mismatch/sequences_dropped")


def arm_summary(records: list[dict]) -> dict:
    """One arm's reward rise (learning.reward_rise), its reward curve, and the mean over its iterations of
    each gap metric it recorded (the dropped shares only where a correction ran)."""
    gap = {key: statistics.fmean(r[key] for r in records) for key in GAP_KEYS if all(key in r for r in records)}
    return {**reward_rise(records), **gap, "curve": [r["reward_mean"] for r in records]}


def refusals(config: str, arms: list[str], common: list[str]) -> dict[str, str]:
    """The arms whose job `rldock train` would refuse on `config` (a serial phase schedule refuses the async
    pipeline), each with the config check's message, before any job runs."""
    refused = {}
    for name in arms:
        overrides = dict(map(parse_override, [*common, *ARMS[name]]))
        try:
            load_job_config(config, overrides=overrides, check_local=False)
        except ConfigError as error:
            refused[name] = str(error)
    return refused


def on_par(arms: dict[str, dict]) -> dict[str, float]:
    """Each arm's rise above the control's as a share of the matched run's rise above it: 1 learns as the
    matched run did, 0 as the control. Empty without both references, or when the matched run did not
    rise above the control (nothing to be on par with)."""
    if "matched" not in arms or "lr0" not in arms:
        return {}
    base = arms["lr0"]["rise"]
    scale = arms["matched"]["rise"] - base
    if scale <= 0:
        return {}
    return {name: (arm["rise"] - base) / scale for name, arm in arms.items() if name != "lr0"}


def over_seeds(on_par_by_seed: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each arm's on_par over the seeds whose matched run learned (an empty seed says nothing): mean, least,
    greatest and how many seeds it rests on."""
    arms = sorted({arm for seed in on_par_by_seed for arm in seed})
    spread = {}
    for arm in arms:
        values = [seed[arm] for seed in on_par_by_seed if arm in seed]
        spread[arm] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "seeds": len(values)}
    return spread


def run_arms(config: str, out: Path, names: list[str], common: list[str]) -> tuple[dict, dict]:
    """Every arm of `names`, one job after the other in out/<arm>: their summaries and their folders."""
    arms, folders = {}, {}
    for name in names:
        folders[name] = out / name.replace("/", "-")
        seconds = run(config, folders[name], [*common, *ARMS[name]])["seconds"]
        arms[name] = {**arm_summary(read_records(folders[name])), "seconds": seconds}
    return arms, folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEMO_CONFIG))
    parser.add_argument("--output", default="runs/mismatch-learning")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--iterations", type=int, help="override the config's iterations")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--plot", type=Path, help="write every arm's reward curve to this PNG (the first seed's)")
    parser.add_argument("--seeds", type=int, help="run every arm under seeds 0..K-1 (module docstring)")
    args = parser.parse_args()
    out = Path(args.output)
    common = [*args.overrides, *MEASURED, *([f"iterations={args.iterations}"] if args.iterations else [])]
    refused = refusals(args.config, args.arms, common)
    names = [arm for arm in args.arms if arm not in refused]
    if args.seeds is None:
        arms, folders = run_arms(args.config, out, names, common)
        report: dict[str, object] = {"arms": arms, "on_par": on_par(arms)}
    else:
        seeds: list[dict] = []
        every_folders = []
        for seed in range(args.seeds):
            arms, seed_folders = run_arms(args.config, out / f"seed{seed}", names, [*common, f"seed={seed}"])
            every_folders.append(seed_folders)
            seeds.append({"seed": seed, "arms": arms, "on_par": on_par(arms)})
        folders = every_folders[0]
        report = {"seeds": seeds, "on_par_over_seeds": over_seeds([s["on_par"] for s in seeds])}
    if args.plot:
        plot_curves(folders, Path(args.config).name, args.plot)
    print(json.dumps({"config": args.config, **report, "refused": refused}, indent=2))


if __name__ == "__main__":
    main()
