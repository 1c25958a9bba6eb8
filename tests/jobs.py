"""The suite's one way to run a job: `rldock train` in a subprocess, as a user runs it, from an
example, a config file or a test's own config (written beside the output as job.yaml), with
`--set` overrides; `run` waits for it and returns a `Run` (exit code, output, the output folder and
its metrics records), `start` hands back the process for the tests that kill or watch it.

`SharedRuns` (the integration tier's session fixture `shared_runs`) runs a job once per session
for every test that asks for the same config, overrides and options: tests that assert on the same
run share it; a test that needs a job of its own (a kill, a resume, a failure) calls `run`.
Imported by basename (tests/ is on pytest's rootdir path), like ray_head.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEMO = EXAMPLES / "grpo-tiny.yaml"

Config = Path | str | Mapping[str, object]


def config_path(config: Config, folder: Path) -> Path:
    """A config file for `config`: an example's name ("grpo-tiny.yaml"), a path, or a mapping written
    to `folder`/job.yaml."""
    if isinstance(config, Mapping):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "job.yaml"
        path.write_text(yaml.safe_dump(dict(config)))
        return path
    path = Path(config)
    return path if path.is_absolute() or path.exists() else EXAMPLES / path


def command(
    config: Path,
    output: Path,
    overrides: Mapping[str, object] | None = None,
    *,
    resume: bool = False,
    max_restarts: int | None = 0,
    progress: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """The `rldock train` argv. `max_restarts=None` leaves the CLI's default (restarts allowed)."""
    argv = [sys.executable, "-m", "rldock.runtime.cli", "train", str(config), "--output", str(output)]
    argv += [] if progress else ["--no-progress"]
    argv += [] if max_restarts is None else ["--max-restarts", str(max_restarts)]
    argv += ["--resume"] if resume else []
    for key, value in (overrides or {}).items():
        argv += ["--set", f"{key}={value}"]
    return [*argv, *extra]


def records(output: Path) -> list[dict]:
    """The run's metrics.jsonl records, in order."""
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Run:
    output: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def records(self) -> list[dict]:
        return records(self.output)

    def tail(self) -> str:
        """The end of what the run printed, for an assertion's message."""
        return self.stdout[-4000:] + self.stderr[-8000:]


def run(
    config: Config,
    output: Path,
    overrides: Mapping[str, object] | None = None,
    *,
    resume: bool = False,
    max_restarts: int | None = 0,
    progress: bool = False,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 900,
    check: bool = True,
) -> Run:
    """Run the job to its end; with `check`, assert it exited 0 (the message: its output's tail)."""
    path = config_path(config, output.parent)
    argv = command(path, output, overrides, resume=resume, max_restarts=max_restarts, progress=progress, extra=extra)
    environment = None if env is None else dict(env)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=environment)
    result = Run(output, done.returncode, done.stdout, done.stderr)
    if check:
        assert done.returncode == 0, result.tail()
    return result


def start(
    config: Config,
    output: Path,
    overrides: Mapping[str, object] | None = None,
    *,
    resume: bool = False,
    max_restarts: int | None = 0,
    progress: bool = False,
    extra: Sequence[str] = (),
    **popen: object,
) -> subprocess.Popen:
    """Start the job and return its process (Popen's keyword arguments as given: pipes, env, session)."""
    path = config_path(config, output.parent)
    argv = command(path, output, overrides, resume=resume, max_restarts=max_restarts, progress=progress, extra=extra)
    return subprocess.Popen(argv, **popen)  # type: ignore[call-overload]


def train_demo(output: Path, overrides: Mapping[str, object], *, resume: bool = False) -> list[dict]:
    """The demo (examples/grpo-tiny.yaml) with `overrides`, no restarts; its records."""
    return run(DEMO, output, overrides, resume=resume).records


class SharedRuns:
    """Each distinct job (its config's text, overrides and options) run once per session, under
    `root`; `get` returns the finished `Run`, and fails for each test that asks while the run failed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[str, Run] = {}

    def get(self, config: Config, overrides: Mapping[str, object] | None = None, **options: object) -> Run:
        source: Config = config if isinstance(config, Mapping) else config_path(config, self.root)
        text = yaml.safe_dump(dict(source)) if isinstance(source, Mapping) else Path(source).read_text()
        settings = sorted((key, str(value)) for key, value in (overrides or {}).items())
        key = hashlib.sha256(json.dumps([text, settings, sorted(options.items())]).encode()).hexdigest()[:16]
        if key not in self._runs:
            self._runs[key] = run(source, self.root / key / "run", overrides, check=False, **options)  # type: ignore[arg-type]
        shared = self._runs[key]
        assert shared.returncode == 0, shared.tail()  # a failed run fails every test that shares it, each saying why
        return shared
