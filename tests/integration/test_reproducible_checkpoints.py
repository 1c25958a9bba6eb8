"""Two runs of the demo job from the same commit write byte-identical checkpoint files: the policy,
the optimizer and rng.pt, the actor ranks' torch CPU generator states (issue 49).

Two data-parallel ranks each hold a vLLM engine, and the dock deals the iteration's prompt groups
to whichever rank asks first, so how many tokens a rank samples changes from run to run. vLLM's
CPU sampler draws from torch's CPU generator once per running request and step; before the engine
kept a stream of its own (engines/vllm_rollout.py, `_own_rng`), those draws moved the ranks'
training stream and rng.pt differed between two runs while the weights were equal.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from jobs import train_demo  # tests/jobs.py

from rldock.runtime.checkpoint import SAVE_FILE

pytestmark = pytest.mark.integration


def run_demo(root: Path, name: str) -> dict[str, str]:
    """The demo (DP 2, G 16 x N 8) for 2 iterations with a checkpoint after each; the sha256 of each
    checkpoint file by its path under checkpoints/."""
    output = root / name
    overrides = {
        "iterations": 2,
        "model.path": str(root / "model"),  # built by the first run, read by the second
        "warmup.steps": 0,
        "rollout.cpu_kv_cache_gib": 0.25,
        "dock.timeout_s": 120,
        "checkpoint.interval": 1,
        "checkpoint.keep_last": 2,
    }
    train_demo(output, overrides)
    checkpoints = output / "checkpoints"
    return {
        str(path.relative_to(checkpoints)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(checkpoints.rglob("*"))
        if path.is_file() and path.name != SAVE_FILE  # how long the save took: a wall time
    }


def test_two_runs_write_byte_identical_checkpoints(tmp_path):
    first, second = run_demo(tmp_path, "first"), run_demo(tmp_path, "second")
    assert {"iter-000001/rng.pt", "iter-000002/rng.pt", "iter-000002/optimizer.pt"} <= set(first)
    assert any(path.startswith("iter-000002/policy/") for path in first)
    assert first == second, sorted(path for path in first if first[path] != second.get(path))
