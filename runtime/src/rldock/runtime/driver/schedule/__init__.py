"""Iteration schedules: the order of one iteration's calls in each training mode, and its dock banks.

A schedule is chosen once per attempt (`choose_schedule`) and runs every iteration the trainer asks
for: it asks the banks for the iteration's bank, puts the feed's batch, launches the recipe's
states on the attempt's workers (`Driver`: the recipe, the workers, the feed and the bookkeeping's
order, objects the trainer hands it once per attempt), gathers their results (`Stages`) and
advances the banks' policy version. The trainer builds the metrics record from those results
(metrics.iteration_record) and keeps the lifecycle: workers, checkpoints, evaluation, progress.

- sync.py: one iteration at a time (training.mode sync).
- run_ahead.py: the next iteration launched, all but its update, before this one's update
  (training.mode async with dock.max_staleness >= 1); it relies on Ray running one actor's calls in
  submission order (RunAheadSchedule.queue_ahead_of_update).
- Parts they compose: rounds.py (DAPO's sampling rounds), partial_rollout.py (partial rollout's cut
  generation finished after the update), prompts_ahead.py (carried episodes' prompts handed ahead at an
  attempt's first iteration), inflight.py (an iteration's bank kept when a worker dies,
  and its retry resumed from it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

from rldock.config import JobConfig
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.driver.schedule.driver import Driver, StageWorkers
from rldock.runtime.driver.schedule.inflight import Inflight
from rldock.runtime.driver.schedule.prompts_ahead import PromptsAhead
from rldock.runtime.driver.schedule.run_ahead import RunAheadSchedule
from rldock.runtime.driver.schedule.stages import WORKER_DEATHS, Stages, gather_failing_fast
from rldock.runtime.driver.schedule.sync import SyncSchedule

__all__ = [
    "WORKER_DEATHS",
    "Driver",
    "Inflight",
    "RunAheadSchedule",
    "Schedule",
    "StageWorkers",
    "Stages",
    "SyncSchedule",
    "choose_schedule",
    "gather_failing_fast",
    "num_banks",
    "runs_ahead",
]


class Schedule(Protocol):
    def run(self, iteration: int) -> Stages:
        """Run `iteration` to the end of its last stage."""

    def checkpoint_sampler_state(self) -> dict:
        """The sampler's position a checkpoint taken now keeps."""

    def keep_inflight(self, stop_workers: Callable[[], None]) -> None:
        """After a worker died: keep what the retry can resume from (stopping the workers first)."""


def runs_ahead(cfg: JobConfig) -> bool:
    """Whether the job runs the next iteration ahead of this one's update."""
    return cfg.training.mode == "async" and cfg.dock.max_staleness >= 1


def num_banks(cfg: JobConfig) -> int:
    """Dock banks the job's schedule uses: two when the next iteration's samples are put while this
    one's still train."""
    return 2 if runs_ahead(cfg) else 1


def prompts_ahead(cfg: JobConfig, *, group_size: int) -> PromptsAhead | None:
    """Carried episodes' hand-ahead (rollout.partial_rollout carry, a sync job), or None."""
    if cfg.rollout.partial_rollout != "carry":
        return None
    return PromptsAhead(
        iterations=cfg.iterations,
        max_staleness=cfg.dock.max_staleness,
        num_prompts=cfg.algorithm.num_prompts_per_iteration,
        group_size=group_size,
    )


def choose_schedule(
    cfg: JobConfig, driver: Driver, banks: DockBanks, *, actor_rank_states: Collection[str]
) -> Schedule:
    """The job's schedule. `actor_rank_states`: the states the actor ranks run (partial rollout
    holds them back until the cut generation is finished)."""
    if not runs_ahead(cfg):
        return SyncSchedule(driver, banks, algo=cfg.algorithm, ahead=prompts_ahead(cfg, group_size=driver.group_size))
    partial = cfg.rollout.partial_rollout != "off"
    return RunAheadSchedule(
        driver,
        banks,
        algo=cfg.algorithm,
        iterations=cfg.iterations,
        round_tokens=cfg.rollout.max_tokens_per_round,
        actor_rank_states=actor_rank_states if partial else None,
    )
