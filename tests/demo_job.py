"""The embedded demo (examples/grpo-tiny.yaml), or a test's own job config, as the integration tests run
it: `rldock train` in a subprocess with `--set` overrides, no restarts (imported by basename, like
reward_model_builder)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import yaml

DEMO = Path(__file__).resolve().parents[1] / "examples" / "grpo-tiny.yaml"


def train_demo(output: Path, overrides: Mapping[str, object], *, resume: bool = False) -> list[dict]:
    """Run the demo into `output` with `overrides` (field -> value, as `--set` takes them); asserts
    it exits 0 and returns its metrics.jsonl records."""
    return train(DEMO, output, overrides, resume=resume)


def train_job(config: Mapping[str, object], output: Path) -> list[dict]:
    """Run the job `config` (written beside `output` as job.yaml) into `output`, as `train_demo` runs the demo."""
    path = output.parent / "job.yaml"
    path.write_text(yaml.safe_dump(dict(config)))
    return train(path, output, {})


def train(config: Path, output: Path, overrides: Mapping[str, object], *, resume: bool = False) -> list[dict]:
    command = [
        sys.executable,
        "-m",
        "rldock.runtime.cli",
        "train",
        str(config),
        "--output",
        str(output),
        "--no-progress",
        "--max-restarts",
        "0",
        *(["--resume"] if resume else []),
    ]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
