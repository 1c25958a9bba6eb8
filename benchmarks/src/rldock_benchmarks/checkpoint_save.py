"""Does the estimate of a checkpoint's save hold? Run a job that checkpoints every second iteration (the first
iteration's progress line, before any checkpoint, carries the estimate) and set the driver's
estimate (`checkpoint_estimate_s` on its progress lines before the first checkpoint:
rldock.runtime.planning.checkpoint_size) beside each save's measured seconds (`checkpoint_s`, from save.json),
and the bytes planned beside the bytes the last checkpoint holds.

    .venv/bin/python -m rldock_benchmarks.checkpoint_save examples/grpo-smollm2-math.yaml --iterations 6

Prints one JSON document. A preemption's save (SIGTERM, rldock.runtime.driver.preemption) runs the same
`_save_checkpoint` as a periodic one, so these saves are its figures too.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rldock.config import load_job_config
from rldock.contract.progress import CHECKPOINT_ESTIMATE_S, CHECKPOINT_S, PREFIX
from rldock.runtime.checkpoint import latest_checkpoint
from rldock.runtime.cli.arguments import parse_override
from rldock.runtime.planning.checkpoint_size import checkpoint_bytes
from rldock.runtime.planning.shapes import load_shape
from rldock_benchmarks.learning import run


def progress_lines(log: str) -> list[dict]:
    return [json.loads(line[len(PREFIX) :]) for line in log.splitlines() if line.startswith(PREFIX)]


def summarise(lines: list[dict], *, planned: int, written: int) -> dict:
    """The estimate (the first line's), each save's seconds (the line of each iteration that checkpointed: later
    lines repeat it), and their ratio."""
    estimates = [line[CHECKPOINT_ESTIMATE_S] for line in lines if CHECKPOINT_ESTIMATE_S in line]
    saves = [line[CHECKPOINT_S] for line in lines if CHECKPOINT_S in line and line["checkpoint"] == line["iteration"]]
    estimate = estimates[0] if estimates else None
    measured = statistics.median(saves) if saves else None
    return {
        "bytes_planned": planned,
        "bytes_written": written,
        "estimate_s": estimate,
        "saves_s": saves,
        "estimate_over_median_save": None if not (estimate and measured) else round(estimate / measured, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--output", type=Path, default=Path("runs/checkpoint-save"))
    parser.add_argument("--iterations", type=int, default=6)
    args = parser.parse_args()
    if args.output.exists():  # the job runner resumes a finished run there and appends to its log
        parser.error(f"--output {args.output} exists: give a new folder (a rerun there would measure nothing new)")
    # no held-out evaluation: its passes are not what is measured
    overrides = [f"iterations={args.iterations}", "checkpoint.interval=2", "evaluation.interval=0", "data.val_files=[]"]
    run(args.config, args.output, overrides)
    cfg = load_job_config(args.config, overrides=dict(parse_override(o) for o in overrides))
    planned = checkpoint_bytes(cfg, load_shape(preset=None, model_path=cfg.model.path)).total
    last = latest_checkpoint(args.output)
    written = sum(f.stat().st_size for f in last.path.rglob("*") if f.is_file()) if last else 0
    lines = progress_lines((args.output / "train.log").read_text())
    print(json.dumps({"config": args.config, **summarise(lines, planned=planned, written=written)}, indent=2))


if __name__ == "__main__":
    main()
