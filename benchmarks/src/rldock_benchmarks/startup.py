"""What starting a job costs: wall time to its first record and CPU seconds per process kind, beside
a baseline commit in the same run.

Prints one JSON document. For this checkout and, with --baseline, a git worktree of that commit
(run on the same virtualenv, its source trees first on PYTHONPATH), `rldock train CONFIG` runs with
`iterations` small, the two alternating (A B A B ...) after one unmeasured run of each (the tiny
model's cache, the CPU peak's cache and the page cache warmed for both). While a run starts, its whole
process tree is sampled every 0.1 s from outside (psutil): the driver, Ray's own processes (GCS,
raylet, agents), every actor and idle Ray worker. When the run's first record lands in
metrics.jsonl (the first iteration included) the CPU seconds each process had used are summed by
kind: `driver`, the actor's class (`DeviceWorker`, `RewardWorker`, `ControllerHost`, ...),
`ray_idle_workers` (workers Ray started that held no actor) and `ray_system`. The same measure works
for any commit, so the two columns compare like with like; the candidate's own first record also
carries `timing/startup` (rldock.runtime.startup), the split into imports, constructor and setup
calls per kind, which is reported beside.

    .venv/bin/python -m rldock_benchmarks.startup --baseline 143ee4d --repeats 3

Medians over the repeats; `ratio` is candidate / baseline (below 1: the candidate starts faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from rldock_benchmarks.harness import machine

REPO = Path(__file__).resolve().parents[3]
SOURCE_TREES = ("api/src", "runtime/src", "operator/src")
POLL_S = 0.1
RUN_TIMEOUT_S = 900.0
RAY_SYSTEM = "ray_system"
IDLE_WORKERS = "ray_idle_workers"


def process_kind(cmdline: list[str], *, is_driver: bool) -> str:
    """The kind a process of a job's tree counts under (module docstring)."""
    if is_driver:
        return "driver"
    title = cmdline[0] if cmdline else ""
    if title.startswith("ray::"):
        name = title.removeprefix("ray::").split(".", 1)[0].split(" ", 1)[0]
        return IDLE_WORKERS if name == "IDLE" else name
    return RAY_SYSTEM


class TreeSampler:
    """The CPU seconds of every process under `root` (itself included), as last seen alive."""

    def __init__(self, root: psutil.Process) -> None:
        self.root = root
        self.seen: dict[int, tuple[str, float]] = {}  # pid -> (kind, cpu seconds)

    def sample(self) -> None:
        try:
            processes = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in processes:
            try:
                with process.oneshot():
                    times = process.cpu_times()
                    kind = process_kind(process.cmdline(), is_driver=process.pid == self.root.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            known = self.seen.get(process.pid)
            if known is not None and known[0] not in (IDLE_WORKERS, RAY_SYSTEM):
                kind = known[0]  # a worker keeps the actor it held (a title between calls can read otherwise)
            self.seen[process.pid] = (kind, times.user + times.system)

    def by_kind(self) -> dict[str, dict[str, float]]:
        kinds: dict[str, dict[str, float]] = {}
        for kind, seconds in self.seen.values():
            entry = kinds.setdefault(kind, {"processes": 0, "cpu_s": 0.0})
            entry["processes"] += 1
            entry["cpu_s"] += seconds
        return kinds


def first_record(metrics: Path) -> dict | None:
    try:
        line = metrics.read_text().split("\n", 1)[0]
    except FileNotFoundError:
        return None
    return json.loads(line) if line.endswith("}") else None


def run_job(source: Path, config: str, iterations: int, output: Path) -> dict[str, Any]:
    """One `rldock train` of `source`'s code: seconds to the first record, CPU by kind then, and the
    first record's timing/startup (absent where the code does not write it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(source / tree) for tree in SOURCE_TREES)}
    command = [sys.executable, "-m", "rldock.runtime.cli", "train", config, "--output", str(output), "--no-progress"]
    command += ["--set", f"iterations={iterations}", "--set", f"checkpoint.interval={iterations}"]
    log = output.with_suffix(".log")
    started = time.monotonic()
    with open(log, "w") as sink:
        job = subprocess.Popen(command, cwd=source, env=env, stdout=sink, stderr=subprocess.STDOUT)
        sampler = TreeSampler(psutil.Process(job.pid))
        record = None
        while record is None:
            sampler.sample()
            record = first_record(output / "metrics.jsonl")
            if job.poll() is not None and record is None:
                raise RuntimeError(f"{source}: the job ended (rc {job.returncode}) before its first record; see {log}")
            if time.monotonic() - started > RUN_TIMEOUT_S:
                job.kill()
                raise RuntimeError(f"{source}: no first record after {RUN_TIMEOUT_S:.0f} s; see {log}")
            time.sleep(POLL_S)
        seconds = time.monotonic() - started
        kinds = sampler.by_kind()
        if job.wait(timeout=RUN_TIMEOUT_S) != 0:
            raise RuntimeError(f"{source}: the job failed (rc {job.returncode}); see {log}")
    return {
        "first_record_s": seconds,
        "cpu_s": sum(entry["cpu_s"] for entry in kinds.values()),
        "kinds": kinds,
        "timing_startup": record.get("timing", {}).get("startup"),
    }


@contextmanager
def baseline_tree(ref: str) -> Iterator[Path]:
    """A detached git worktree of `ref`, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="rldock-startup-baseline-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), ref], cwd=REPO, check=True, capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=REPO, check=False)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the runs of one variant."""
    kinds = sorted({kind for run in runs for kind in run["kinds"]})
    return {
        "runs": len(runs),
        "first_record_s": round(statistics.median(r["first_record_s"] for r in runs), 2),
        "first_record_s_all": [round(r["first_record_s"], 2) for r in runs],
        "cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 2),
        "cpu_s_all": [round(r["cpu_s"], 2) for r in runs],
        "cpu_s_by_kind": {
            kind: round(statistics.median(r["kinds"].get(kind, {}).get("cpu_s", 0.0) for r in runs), 2)
            for kind in kinds
        },
        "processes_by_kind": {kind: max(r["kinds"].get(kind, {}).get("processes", 0) for r in runs) for kind in kinds},
        "timing_startup": runs[-1]["timing_startup"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/grpo-tiny.yaml", help="the job to start (default: the demo)")
    parser.add_argument("--iterations", type=int, default=2, help="iterations per run (the first one is timed)")
    parser.add_argument("--repeats", type=int, default=2, help="measured runs of each variant")
    parser.add_argument("--baseline", help="a commit to run beside this checkout (e.g. main before a change)")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"config": args.config, "iterations": args.iterations, "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="rldock-startup-") as scratch, worktree_of(args.baseline) as base:
        variants = {"candidate": REPO, **({"baseline": base} if base is not None else {})}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        for repeat in range(args.repeats + 1):  # round 0 warms the caches and is not counted
            for name, source in variants.items():
                measured = run_job(source, args.config, args.iterations, Path(scratch) / f"{name}-{repeat}")
                print(
                    f"{name} run {repeat}: first record after {measured['first_record_s']:.1f} s, "
                    f"{measured['cpu_s']:.1f} CPU s" + (" (warm-up, not counted)" if repeat == 0 else ""),
                    file=sys.stderr,
                )
                if repeat > 0:
                    runs[name].append(measured)
        report["variants"] = {name: summary(measured) for name, measured in runs.items()}
    if args.baseline is not None:
        candidate, baseline = report["variants"]["candidate"], report["variants"]["baseline"]
        report["baseline_ref"] = args.baseline
        report["ratio"] = {
            key: round(candidate[key] / baseline[key], 3) for key in ("first_record_s", "cpu_s") if baseline[key]
        }
    report["machine"]["load_average_at_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


@contextmanager
def worktree_of(ref: str | None) -> Iterator[Path | None]:
    """baseline_tree(ref), or None without a ref."""
    if ref is None:
        yield None
        return
    with baseline_tree(ref) as folder:
        yield folder


if __name__ == "__main__":
    main()
