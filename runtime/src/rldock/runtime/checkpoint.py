"""Checkpoint layout on disk: atomic save, discovery of the latest complete one, pruning.

A checkpoint is a directory `checkpoints/iter-000010/` holding the policy in Hugging Face format
(`policy/`, which the rollout engine can start from), the optimizer state, for PPO the critic's,
RNG states and `state.json` (iteration, data position). Each worker group writes and reads its own
part (its spec's `checkpoint`, rldock.runtime.flow.states); the driver writes the rest. It is
written under a temporary name and renamed only when complete, so a run killed at any moment leaves
either the previous or the new checkpoint, never a torn one.

Beside the checkpoints, `inflight-dock.pkl` holds the transfer dock of an iteration that failed
part-way (TransferDock.state_dict, with the results of the stage ranks that had finished): the
retry of that iteration, which starts from the latest checkpoint, resumes from it instead of
redoing finished samples and stages. It holds numpy arrays, so it is pickled (torch's safe loader
refuses them), also atomically.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rldock.contract.checkpoints import CHECKPOINT_DIR, checkpoint_name, iteration_of

STATE_FILE = "state.json"
POLICY_DIR = "policy"
ADAPTER_DIR = "adapter"  # a LoRA checkpoint's trained adapters (peft format), beside `policy`
OPTIMIZER_FILE = "optimizer.pt"
CRITIC_FILE = "critic.pt"  # PPO's whole value model's state dict
CRITIC_OPTIMIZER_FILE = "critic_optimizer.pt"  # as the critic's backend writes it (FSDP: keyed by parameter names)
RANK_STATES_FILE = "rng.pt"  # each worker group's ranks' own states (their torch RNG), by the group's key
INFLIGHT_FILE = "inflight-dock.pkl"
STARTED_FILE = ".save-started"  # in a staging folder: when its save began (time.time()), read by `commit`
# How long the save took, staging to commit: a wall time, apart from state.json so that two runs of the same
# job write the same state (tests/integration/test_reproducible_checkpoints.py compares every other file).
SAVE_FILE = "save.json"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    iteration: int

    @property
    def policy_dir(self) -> Path:
        return self.path / POLICY_DIR

    @property
    def adapter_dir(self) -> Path:
        return self.path / ADAPTER_DIR

    def state(self) -> dict[str, Any]:
        return json.loads((self.path / STATE_FILE).read_text())

    @property
    def save_seconds(self) -> float | None:
        """How long its save took, staging to commit (None: saved before this was recorded)."""
        path = self.path / SAVE_FILE
        return json.loads(path.read_text())["seconds"] if path.is_file() else None


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def staging_dir(output_dir: Path, iteration: int) -> Path:
    """Where the pieces of a checkpoint are written before `commit` makes it visible."""
    path = checkpoint_root(output_dir) / f".staging-{checkpoint_name(iteration)}"
    if path.exists():
        shutil.rmtree(path)  # left by a run killed while saving
    path.mkdir(parents=True)
    (path / STARTED_FILE).write_text(repr(time.time()))
    return path


def commit(output_dir: Path, staging: Path, iteration: int, state: dict[str, Any], *, keep_last: int) -> Checkpoint:
    """Write save.json (the seconds since `staging_dir` made the folder: the save's) and state.json last,
    rename into place, then prune older checkpoints."""
    started = staging / STARTED_FILE
    if started.is_file():
        seconds = round(time.time() - float(started.read_text()), 3)
        (staging / SAVE_FILE).write_text(json.dumps({"seconds": seconds}))
        started.unlink()
    (staging / STATE_FILE).write_text(json.dumps({**state, "iteration": iteration}, indent=2))
    final = checkpoint_root(output_dir) / checkpoint_name(iteration)
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
        iteration = iteration_of(path.name)
        if iteration is not None and (path / STATE_FILE).is_file():
            found.append(Checkpoint(path, iteration))
    return sorted(found, key=lambda c: c.iteration)


def latest_checkpoint(output_dir: Path) -> Checkpoint | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


PROBE_BYTES = 32 * 1024**2  # enough for a disk's cache and a network volume's round trips not to dominate


def measure_write_rate(output_dir: Path, *, size: int = PROBE_BYTES) -> float:
    """Bytes a second the checkpoint folder takes: `size` bytes written there and synced to the device, as a
    save writes and commits its files (rldock.runtime.planning.checkpoint_size estimates a save from it). The
    bytes are random (a compressing file system would take zeros faster than a checkpoint's weights); the
    probe file is removed."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1024**2)
    probe = root / ".write-probe"
    start = time.perf_counter()
    try:
        with probe.open("wb") as f:
            for _ in range(max(1, size // len(block))):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return max(1, size // len(block)) * len(block) / (time.perf_counter() - start)
    finally:
        probe.unlink(missing_ok=True)


def save_inflight(
    output_dir: Path, *, iteration: int, dock_state: dict[str, Any], finished: dict[str, list], launched: dict[str, int]
) -> Path:
    """Keep the dock of `iteration`, which failed part-way, for its retry: written atomically.

    `finished` maps each stage to the results of its ranks that returned, `launched` each stage
    to how many ranks it was started on.
    """
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".{INFLIGHT_FILE}.partial"
    with partial.open("wb") as f:
        pickle.dump(
            {"iteration": iteration, "dock": dock_state, "finished": finished, "launched": launched}, f, protocol=5
        )
    final = root / INFLIGHT_FILE
    os.replace(partial, final)
    return final


def load_inflight(output_dir: Path, iteration: int) -> dict[str, Any] | None:
    """The snapshot `save_inflight` kept for `iteration`, or None (none kept, or of another iteration)."""
    path = checkpoint_root(output_dir) / INFLIGHT_FILE
    if not path.is_file():
        return None
    with path.open("rb") as f:
        snapshot = pickle.load(f)  # our own file, written by save_inflight
    return snapshot if snapshot["iteration"] == iteration else None


def clear_inflight(output_dir: Path) -> None:
    """Forget the in-flight snapshot (its iteration finished)."""
    (checkpoint_root(output_dir) / INFLIGHT_FILE).unlink(missing_ok=True)
