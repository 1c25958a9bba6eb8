"""Where a job's checkpoints live under its output directory, and how they are named.

The runtime writes `checkpoints/iter-000010/` (rldock.runtime.checkpoint); the operator, which has
no runtime, reports the path of the last one in the RLJob status (rldock.operator.observe).
"""

from __future__ import annotations

import posixpath
import re

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^iter-(\d+)$")


def checkpoint_name(iteration: int) -> str:
    """The folder name of the checkpoint taken after `iteration`, e.g. 'iter-000010'."""
    return f"iter-{iteration:06d}"


def iteration_of(name: str) -> int | None:
    """The iteration a checkpoint folder name stands for, or None for any other name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def checkpoint_path(output_dir: str, iteration: int) -> str:
    """The checkpoint's path as a POSIX string (the operator builds paths on the pods' volume)."""
    return posixpath.join(output_dir, CHECKPOINT_DIR, checkpoint_name(iteration))
