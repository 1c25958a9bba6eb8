"""Rules that span several fields of a JobConfig.

They are kept out of the pydantic validators so that a caller gets every problem at once, each
with the dotted path of the field to change: `rldock train` prints them, the operator turns them
into a condition and an Event on an RLJob that the API server's schema already accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rldock.config.job import JobConfig


@dataclass(frozen=True)
class Problem:
    path: str  # dotted field path, e.g. "training.data_parallel_size"
    message: str  # what is wrong and how to fix it

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def find_problems(cfg: JobConfig) -> list[Problem]:
    """Problems visible from the config alone (no filesystem, no cluster)."""
    problems: list[Problem] = []
    algo, training = cfg.algorithm, cfg.training
    num_samples = cfg.num_samples_per_iteration
    dp = training.data_parallel_size

    if num_samples % dp:
        problems.append(Problem(
            "training.data_parallel_size",
            f"G*N = {algo.num_prompts_per_iteration}*{algo.num_responses_per_prompt} = {num_samples} "
            f"samples per iteration cannot be split evenly over {dp} data-parallel ranks; choose a DP "
            f"size that divides {num_samples} or change algorithm.num_prompts_per_iteration",
        ))
    elif num_samples % (dp * algo.num_updates_per_iteration):
        problems.append(Problem(
            "algorithm.num_updates_per_iteration",
            f"each of the {dp} ranks holds {num_samples // dp} samples, which cannot be split into "
            f"{algo.num_updates_per_iteration} equal mini-batches",
        ))
    if dp > cfg.num_devices:
        problems.append(Problem(
            "training.data_parallel_size",
            f"{dp} ranks need {dp} devices but resources give {cfg.resources.num_nodes} node(s) x "
            f"{cfg.resources.devices_per_node} = {cfg.num_devices}; lower the DP size or add devices",
        ))
    warehouses = cfg.dock.num_warehouses
    if warehouses is not None and warehouses > algo.num_prompts_per_iteration:
        problems.append(Problem(
            "dock.num_warehouses",
            f"{warehouses} warehouses for {algo.num_prompts_per_iteration} prompt groups would leave "
            "some warehouses empty; use at most one warehouse per prompt group",
        ))
    if cfg.checkpoint.interval > cfg.iterations:
        problems.append(Problem(
            "checkpoint.interval",
            f"interval {cfg.checkpoint.interval} exceeds iterations {cfg.iterations}; only the final "
            "checkpoint would be written, so a crash would lose the whole run",
        ))
    return problems


def find_local_problems(cfg: JobConfig) -> list[Problem]:
    """Problems that need the local filesystem: run where the job will run, not in the operator."""
    model_dir = Path(cfg.model.path).expanduser()
    if cfg.model.builder is None and not (model_dir / "config.json").is_file():
        return [Problem(
            "model.path",
            f"no model at {model_dir} (config.json missing); point it at a Hugging Face format "
            "directory, or set model.builder to build a tiny demo model there",
        )]
    return []
