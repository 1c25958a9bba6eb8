"""One `rldock train` run on local Ray from a test: an example config with `--set` overrides, in a
subprocess as a user runs it, and its metrics records read back."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from rldock_e2e.repo import REPO_ROOT


def train_example(
    example: str, output: Path, overrides: Mapping[str, object], *, resume: bool = False, timeout_s: float = 900
) -> list[dict]:
    """Run `rldock train examples/<example>` into `output` (no restarts, no progress bar) with each
    override as `--set key=value`; fails with the run's last output unless it exits 0. Returns the
    records of metrics.jsonl."""
    command = [sys.executable, "-m", "rldock.runtime.cli", "train", str(REPO_ROOT / "examples" / example)]
    command += ["--output", str(output), "--no-progress", "--max-restarts", "0", *(["--resume"] if resume else [])]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
