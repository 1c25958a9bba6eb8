"""The suite's one way to run a job: `rldock train` in a subprocess, as a user runs it, from an
example, a config file or a test's own config (written beside the output as job.yaml), with
`--set` overrides; `run` waits for it and returns a `Run` (exit code, output, the output folder and
its metrics records), `start` hands back the process for the tests that kill or watch it.

Tests that assert on the same run share it through a module-scoped fixture that runs it once (the
module's runs declared in one place); a test that needs a job of its own (a kill, a resume, a
failure) runs it itself.
Imported by basename (tests/ is on pytest's rootdir path), like ray_head.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypedDict

import yaml
from typing_extensions import Unpack

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


class Options(TypedDict, total=False):
    """How `rldock train` runs, beside its config and overrides: `resume` (--resume), `max_restarts`
    (default 0; None leaves the CLI's default, restarts allowed), `progress` (default False:
    --no-progress, one machine-readable line per iteration), `extra` (more arguments, as given)."""

    resume: bool
    max_restarts: int | None
    progress: bool
    extra: Sequence[str]


def command(
    config: Config, output: Path, overrides: Mapping[str, object] | None = None, **options: Unpack[Options]
) -> list[str]:
    """The `rldock train` argv (a mapping `config` written to job.yaml beside `output`)."""
    path = config_path(config, output.parent)
    argv = [sys.executable, "-m", "rldock.runtime.cli", "train", str(path), "--output", str(output)]
    argv += [] if options.get("progress", False) else ["--no-progress"]
    max_restarts = options.get("max_restarts", 0)
    argv += [] if max_restarts is None else ["--max-restarts", str(max_restarts)]
    argv += ["--resume"] if options.get("resume", False) else []
    for key, value in (overrides or {}).items():
        argv += ["--set", f"{key}={value}"]
    return [*argv, *options.get("extra", ())]


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
    env: Mapping[str, str] | None = None,
    timeout_s: float = 900,
    check: bool = True,
    **options: Unpack[Options],
) -> Run:
    """Run the job to its end; with `check`, assert it exited 0 (the message: its output's tail)."""
    argv = command(config, output, overrides, **options)
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
    env: Mapping[str, str] | None = None,
    log: IO[str] | None = None,
    **options: Unpack[Options],
) -> subprocess.Popen[str]:
    """Start the job and return its process, in a session of its own (a kill of its process group
    reaches every process it started). Its output, stdout and stderr together, goes to `log`, or to
    the process's stdout pipe, which a test that polls the job must then read as it goes (a pipe
    nobody reads fills and stalls the job)."""
    argv = command(config, output, overrides, **options)
    return subprocess.Popen(
        argv,
        stdout=log if log is not None else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=None if env is None else dict(env),
    )


def train_demo(output: Path, overrides: Mapping[str, object], *, resume: bool = False) -> list[dict]:
    """The demo (examples/grpo-tiny.yaml) with `overrides`, no restarts; its records."""
    return run(DEMO, output, overrides, resume=resume).records


def small_layout(root: Path, iterations: int, layout: Mapping[str, object]) -> dict[str, object]:
    """The overrides of a job that tries a parallel layout (`layout`: the training and rollout
    fields it sets) on the tiny model built once in root/model: 4 prompts x 4 responses, no
    warm-up (the KV cache its default, sized to the tiny model's sequences)."""
    return {
        "iterations": iterations,
        "model.path": str(root / "model"),
        "warmup.steps": 0,
        "algorithm.num_prompts_per_iteration": 4,
        "algorithm.num_responses_per_prompt": 4,
        **layout,
    }


# The TP 2 x DP 1 demo (conftest.py's session fixture tp2_resharding_runs runs it under both resharding
# modes): stopped after TP2_CHECKPOINT_AT iterations, then resumed to TP2_ITERATIONS.
TP2_ITERATIONS, TP2_CHECKPOINT_AT = 4, 3


def tp2_demo(
    root: Path, mode: str, *, iterations: int, resume: bool = False, strategy: str = "ddp"
) -> tuple[Path, list[dict]]:
    """The demo at training TP 2 x DP 1, generation TP 1, `training.resharding: mode`, in root/mode (under
    `strategy: fsdp`, root/fsdp-mode: FSDP over the TP shards); the tiny model built once in root/model.
    The output folder and its records."""
    output = root / (mode if strategy == "ddp" else f"{strategy}-{mode}")
    overrides = small_layout(
        root,
        iterations,
        {
            "training.strategy": strategy,
            "training.data_parallel_size": 1,
            "training.tensor_parallel_size": 2,
            "training.resharding": mode,
            # One micro-batch holds the iteration's 16 samples: the old log-probs then come from the same
            # batch shapes under both modes, whatever order the dock hands samples out in.
            "training.micro_batch_size": 16,
            "dock.timeout_s": 120,
            "checkpoint.interval": TP2_CHECKPOINT_AT,
        },
    )
    return output, train_demo(output, overrides, resume=resume)


# The PPO jobs (test_ppo_job; conftest.py's session fixture ppo_fsdp_critic_ranks): G prompts x N responses.
PPO_G, PPO_N, PPO_ITERATIONS = 4, 4, 2


def ppo_job(
    root: Path,
    algorithm: str,
    *,
    micro_batch_size: int = 8,
    output: str = "run",
    iterations: int = PPO_ITERATIONS,
    resume: bool = False,
    data_parallel_size: int = 1,
    strategy: str = "ddp",
    layout: Mapping[str, Mapping[str, object]] | None = None,
) -> list[dict]:
    """A short PPO-family job (`algorithm`: ppo, pf_ppo) on the tiny model built once in root/model,
    in root/`output`; `layout` adds fields to its sections (training, rollout, dock). Its records."""
    config: dict[str, Any] = {
        "name": f"it-{algorithm}",
        "seed": 1,
        "iterations": iterations,
        "model": {"path": str(root / "model"), "builder": "tiny-qwen2"},
        "algorithm": {
            "name": algorithm,
            "num_prompts_per_iteration": PPO_G,
            "num_responses_per_prompt": PPO_N,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "learning_rate": 1e-4,
            "pf_ppo": {"mode": "best_random"},
        },
        "training": {
            "data_parallel_size": data_parallel_size,
            "micro_batch_size": micro_batch_size,
            "strategy": strategy,
        },
        "dock": {"timeout_s": 120},
        "checkpoint": {"interval": 1, "keep_last": 1},
    }
    for section, fields in (layout or {}).items():
        config[section] = {**config.get(section, {}), **fields}
    return run(config, root / output, resume=resume, max_restarts=None).records


def two_critic_ranks(
    root: Path, strategy: str, layout: Mapping[str, Mapping[str, object]] | None = None
) -> tuple[Path, list[dict]]:
    """PPO at data_parallel_size 2 under `strategy`, two micro-batches per rank: iteration 1, a
    checkpoint, then iteration 2 resumed from it; the output folder and the records of both."""
    ppo_job(root, "ppo", micro_batch_size=4, iterations=1, data_parallel_size=2, strategy=strategy, layout=layout)
    records = ppo_job(
        root, "ppo", micro_batch_size=4, resume=True, data_parallel_size=2, strategy=strategy, layout=layout
    )
    return root / "run", records


# The `mismatch/` metrics of a job that measures the gap and corrects nothing (monitoring.mismatch alone).
MISMATCH_MEASURES = tuple(
    f"mismatch/{key}"
    for key in ("kl", "kl_seq", "abs_diff_mean", "abs_diff_max", "seq_ratio_p50", "seq_ratio_p99", "tokens")
)


def check_float32_gap(record: dict) -> None:
    """A record of a job whose float32 engine and float32 trainer differ only by their kernels: its
    `mismatch/` measures present, the gap of the same weights' logprobs. Measured on this machine: logprobs
    1.6e-7 to 3.2e-7 apart on average, a k3 near 1e-14 (float32's epsilon, 1.2e-7, times logits of a few
    units, summed over a vocabulary of about 40 and a hidden size of 128, bounds any CPU's at ~1e-5). The
    bounds sit far above that and below any broken column: another token's or row's logprobs, a tool's
    token counted, zeros, or tokens an older version sampled (one update of these jobs moves a logprob
    by 1e-3 and more)."""
    gap = {key: value for key, value in record.items() if key.startswith("mismatch/")}
    assert set(MISMATCH_MEASURES) <= set(gap) and gap["mismatch/tokens"] > 0, record
    assert 0 <= gap["mismatch/kl"] < 1e-6 and 0 < gap["mismatch/abs_diff_mean"] < 1e-4, gap
    assert 0 <= gap["mismatch/abs_diff_max"] < 1e-2 and 0.99 < gap["mismatch/seq_ratio_p50"] < 1.01, gap
