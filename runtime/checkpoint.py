"""Checkpoint layout on disk: atomic save, discovery of the latest complete one, pruning.

A checkpoint is a directory `checkpoints/iter-000010/` holding the policy in Hugging Face format
(`policy/`, which the rollout engine can start from), the optimizer state, RNG states and
`state.json` (iteration, data position). It is written under a temporary name and renamed only when
complete, so a run killed at any moment leaves either the previous or the new checkpoint, never a
torn one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "state.json"
POLICY_DIR = "policy"
OPTIMIZER_FILE = "optimizer.pt"
_PREFIX = "iter-"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    iteration: int

    @property
    def policy_dir(self) -> Path:
        return self.path / POLICY_DIR

    @property
    def optimizer_file(self) -> Path:
        return self.path / OPTIMIZER_FILE

    def state(self) -> dict[str, Any]:
        return json.loads((self.path / STATE_FILE).read_text())


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def staging_dir(output_dir: Path, iteration: int) -> Path:
    """Where the pieces of a checkpoint are written before `commit` makes it visible."""
    path = checkpoint_root(output_dir) / f".staging-{_PREFIX}{iteration:06d}"
    if path.exists():
        shutil.rmtree(path)  # left by a run killed while saving
    path.mkdir(parents=True)
    return path


def commit(output_dir: Path, staging: Path, iteration: int, state: dict[str, Any], *,
           keep_last: int) -> Checkpoint:
    """Write state.json last, rename into place, then prune older checkpoints."""
    (staging / STATE_FILE).write_text(json.dumps({**state, "iteration": iteration}, indent=2))
    final = checkpoint_root(output_dir) / f"{_PREFIX}{iteration:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    for old in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old.path)
    return Checkpoint(final, iteration)


def list_checkpoints(output_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.name.startswith(_PREFIX) and (path / STATE_FILE).is_file():
            found.append(Checkpoint(path, int(path.name[len(_PREFIX):])))
    return sorted(found, key=lambda c: c.iteration)


def latest_checkpoint(output_dir: Path) -> Checkpoint | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None
