"""Does the estimate of a checkpoint's save hold? Run a job that checkpoints every second iteration (the first
iteration's progress line, before any checkpoint, carries the estimate) and set the driver's
estimate (`checkpoint_estimate_s` on its progress lines before the first checkpoint:
rldock.runtime.planning.checkpoint_size) beside each save's measured seconds (`checkpoint_s`, from save.json),
and the bytes planned beside the bytes the last checkpoint holds.

    .venv/bin/python -m rldock_benchmarks.checkpoint_save examples/grpo-smollm2-math.yaml --iterations 6

Prints one JSON document. With `--preempt-after K` the driver gets SIGTERM once iteration K's progress line is
logged, as a pod's deletion sends it (rldock.runtime.driver.preemption): the iteration under way finishes, is
saved and the run exits 143. The document then adds that save's seconds and the seconds from the signal to the
driver's exit, which is what `spec.preemption.gracePeriodSeconds` must cover (give an odd K + 1, so that the
iteration saved is not also a periodic checkpoint):

    .venv/bin/python -m rldock_benchmarks.checkpoint_save examples/grpo-smollm2-math.yaml --iterations 6 \
        --preempt-after 2
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import time
from pathlib import Path

from rldock.config import load_job_config
from rldock.contract.progress import CHECKPOINT_ESTIMATE_S, CHECKPOINT_S, ITERATION_S, PREFIX
from rldock.runtime.checkpoint import STATE_FILE, latest_checkpoint
from rldock.runtime.cli.arguments import parse_override
from rldock.runtime.planning.checkpoint_size import checkpoint_bytes
from rldock.runtime.planning.shapes import load_shape
from rldock_benchmarks.learning import run, train_command


def progress_lines(log: str) -> list[dict]:
    """The progress lines of a log, but for a last line still being written."""
    whole = log[: log.rfind("\n") + 1]
    return [json.loads(line[len(PREFIX) :]) for line in whole.splitlines() if line.startswith(PREFIX)]


def preempted_run(config: str, output: Path, overrides: list[str], *, after: int, poll_s: float = 0.05) -> dict:
    """Run the job and SIGTERM its driver once iteration `after`'s progress line is logged: the seconds from the
    signal to the commit of the checkpoint it asked for (the grace period's part that saves the run) and to the
    driver's exit (what the pod's grace period must hold, the workers' stop included), and its exit code."""
    output.mkdir(parents=True)
    log_path = output / "train.log"
    with log_path.open("a") as log:
        driver = subprocess.Popen(train_command(config, output, overrides), stdout=log, stderr=subprocess.STDOUT)
        signalled, seen = None, None
        while driver.poll() is None:
            if signalled is None and (
                seen := [x for x in progress_lines(log_path.read_text()) if x["iteration"] >= after]
            ):
                driver.send_signal(signal.SIGTERM)
                signalled = time.time()
            time.sleep(poll_s)
    exited = time.time()
    last = latest_checkpoint(output)
    if signalled is None or not seen or last is None:
        raise SystemExit(
            f"the run ended (exit {driver.returncode}) before iteration {after} or a checkpoint: see {log_path}"
        )
    return {
        "exit_code": driver.returncode,
        "iteration_saved": last.iteration,
        "save_s": last.save_seconds,
        "signal_to_commit_s": round((last.path / STATE_FILE).stat().st_mtime - signalled, 3),
        "signal_to_exit_s": round(exited - signalled, 3),
        "operator_bound_s": stop_bound(seen[0]),
    }


def stop_bound(line: dict) -> float:
    """What the operator's GracePeriodSufficient holds a stop to, read from the last progress line before it: the
    iteration under way may take an iteration's seconds, then a save (or, before the first, the estimate of one)."""
    return round(line[ITERATION_S] + line.get(CHECKPOINT_S, line.get(CHECKPOINT_ESTIMATE_S, 0.0)), 3)


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
    parser.add_argument(
        "--preempt-after", type=int, metavar="K", help="SIGTERM the driver once iteration K is logged (docstring)"
    )
    args = parser.parse_args()
    if args.output.exists():  # the job runner resumes a finished run there and appends to its log
        parser.error(f"--output {args.output} exists: give a new folder (a rerun there would measure nothing new)")
    # no held-out evaluation: its passes are not what is measured
    overrides = [f"iterations={args.iterations}", "checkpoint.interval=2", "evaluation.interval=0", "data.val_files=[]"]
    if args.preempt_after is None:
        run(args.config, args.output, overrides)
    else:
        preemption = preempted_run(args.config, args.output, overrides, after=args.preempt_after)
    cfg = load_job_config(args.config, overrides=dict(parse_override(o) for o in overrides))
    planned = checkpoint_bytes(cfg, load_shape(preset=None, model_path=cfg.model.path)).total
    last = latest_checkpoint(args.output)
    written = sum(f.stat().st_size for f in last.path.rglob("*") if f.is_file()) if last else 0
    lines = progress_lines((args.output / "train.log").read_text())
    report = {"config": args.config, **summarise(lines, planned=planned, written=written)}
    if args.preempt_after is not None:  # the last checkpoint is the preemption's
        report["preemption"] = {
            **preemption,
            "iteration_saved": last and last.iteration,
            "save_s": last and last.save_seconds,
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
