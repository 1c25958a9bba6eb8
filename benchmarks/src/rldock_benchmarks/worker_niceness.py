"""What Ray's worker niceness costs a job that shares the machine with one busy process.

Ray's raylet starts every worker at niceness 15 (RAY_worker_niceness), so that it and the GCS come first.
A job's compute runs in those workers: beside a process at the default niceness that keeps a core busy,
CFS gives them a weight of 36 against its 1024. The test suite sets RAY_worker_niceness=0
(tests/conftest.py); this measures what that changes.

The demo (examples/grpo-tiny.yaml) at `--iterations`, each job with a local Ray of its own, first with
Ray's default niceness and then with 0, while one process spins (`while True: pass`, niceness 0) for the
whole run. Prints one JSON document: each arm's wall seconds and their ratio.

    .venv/bin/python -m rldock_benchmarks.worker_niceness --output /tmp/niceness
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parents[3] / "examples" / "grpo-tiny.yaml"
RAY_DEFAULT_NICENESS = 15


def run_demo(output: Path, *, niceness: int, iterations: int) -> float:
    """Wall seconds of one demo run whose Ray workers start at `niceness`."""
    shutil.rmtree(output, ignore_errors=True)
    # A local Ray of its own (no RAY_ADDRESS), passive OpenMP waits as in the test suite.
    environ = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    environ.update(OMP_WAIT_POLICY="PASSIVE", RAY_worker_niceness=str(niceness))
    command = [sys.executable, "-m", "rldock.runtime.cli", "train", str(DEMO), "--output", str(output)]
    command += ["--no-progress", "--max-restarts", "0", "--set", f"iterations={iterations}"]
    command += ["--set", f"checkpoint.interval={iterations}"]
    start = time.perf_counter()
    done = subprocess.run(command, env=environ, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the demo failed at niceness {niceness}:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="folder for the two runs' outputs")
    parser.add_argument("--iterations", type=int, default=2)
    args = parser.parse_args(argv)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        seconds = {
            niceness: run_demo(args.output / f"niceness-{niceness}", niceness=niceness, iterations=args.iterations)
            for niceness in (RAY_DEFAULT_NICENESS, 0)
        }
    finally:
        spinner.kill()
    print(
        json.dumps(
            {
                "iterations": args.iterations,
                "busy_neighbours": 1,
                "wall_s_ray_default_niceness_15": round(seconds[RAY_DEFAULT_NICENESS], 1),
                "wall_s_niceness_0": round(seconds[0], 1),
                "default_vs_0": round(seconds[RAY_DEFAULT_NICENESS] / seconds[0], 2),
                "load_average_1min": os.getloadavg()[0],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
