"""The tiny model's jobs against openenv-core's guess-the-number game (tests/unit/runtime/agent/openenv_servers.py):
their config, `rldock train` of it, and the warmed-up model the first such job leaves, which the later
ones start from (conftest.py's `guess_game_run`; test_environment_job.py, test_turn_credit_job.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import yaml


def _agent_test_helpers():
    """tests/unit/runtime/agent/openenv_servers.py (the agent tests' servers), loaded by its path."""
    name = "openenv_servers"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "unit" / "runtime" / "agent" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


openenv_guess_server = _agent_test_helpers().openenv_guess_server
hostile_server = _agent_test_helpers().hostile_server

ITERATIONS = 2
MAX_TURNS = 3


def job_config(root: Path, url: str) -> dict:
    return {
        "name": "it-environment",
        "seed": 3,
        "iterations": ITERATIONS,
        "model": {"path": str(root / "model"), "builder": "tiny-qwen2"},
        "data": {"generator": {"name": "addition", "max_operand": 9, "num_prompts": 64}, "chat_template": "model"},
        "reward": {"terms": [{"name": "environment", "aggregate": "sum"}]},
        # The answers' format (digits, then EOS): every turn then ends and goes to the game as a step.
        "warmup": {"steps": 150, "batch_size": 32, "learning_rate": 0.003},
        "agent": {
            "environment": {"name": "openenv", "servers": {"url": url, "sessions_per_replica": 4}},
            "max_turns": MAX_TURNS,
            "max_tool_response_tokens": 24,
        },
        "algorithm": {
            "name": "grpo",
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 4,
            "max_prompt_length": 48,
            "max_response_length": 96,
            "learning_rate": 1e-4,
        },
        "training": {"data_parallel_size": 1, "micro_batch_size": 16},
        "dock": {"timeout_s": 300},
        "checkpoint": {"interval": ITERATIONS},
    }


def from_warmed_model(config: dict, run: Path) -> dict:
    """`config` starting from the warmed-up model of the job whose output is `run` (of `job_config`,
    as `guess_game_run`), with no warm-up of its own: its own would be the same one (the warm-up
    reads the seed, the data, the model and the warm-up settings, which such a job leaves as they
    are; not the algorithm or the devices), and the warm-up is most of a short job's cost."""
    return {**config, "model": {"path": str(run / "warmup")}, "warmup": {"steps": 0}}


def train(root: Path, config: dict) -> Path:
    """`rldock train` of `config` in `root`; its output folder."""
    (root / "job.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "rldock.runtime.cli", "train", str(root / "job.yaml"), "--output", str(root / "run")],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return root / "run"
