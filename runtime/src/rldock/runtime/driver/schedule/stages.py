"""One iteration's stage results, and gathering the futures of its stages, failing at the first error."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from rldock.runtime.dock import DockActorDiedError, TransferDock
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.driver.feed import DriverBatch, SampleFacts

# What Trainer.run() restarts from (--max-restarts): a worker's process or a dock actor died (a lost
# node takes both, and whichever the driver calls first reports it).
WORKER_DEATHS = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, DockActorDiedError)
DEAD_WORKER_GRACE_S = 5.0  # how long a stage error waits for Ray to report a dead worker behind it


@dataclass
class Stages:
    """What an iteration's schedule ran: the driver's batch, the stages' results and its times."""

    fed: DriverBatch
    put_seconds: float  # the driver's time putting samples into the bank
    results: dict[str, list[StageResult]]  # state -> one result per rank call (DAPO: of every round)
    facts: SampleFacts  # each sample's reward and response length, read from the dock (DAPO: every round's)
    bank: TransferDock  # the dock bank that carried the iteration's samples
    started: float  # perf_counter when the iteration began
    ended: float  # perf_counter when its last stage returned
    round_metrics: dict = field(default_factory=dict)  # DAPO's sampling rounds (driver/feed.py)
    # End to end: since the previous iteration's stages ended (the driver's work between the two
    # included: bookkeeping run inline or waited for, the next draw and reset); None for the first.
    cycle: float | None = None


def gather_failing_fast(
    futures: dict[str, list],
    finished: dict[str, list[StageResult]] | None = None,
    recover: Callable[[Any, Exception], Any] | None = None,
) -> dict[str, list[StageResult]]:
    """ray.get of every stage, raising the first worker error at once instead of waiting for the
    other stages to time out on data that will never come. Each rank's result is added to
    `finished[stage]` as it returns (what an in-flight resume reuses). `recover` (StageWorkers.recover)
    may replace a call whose worker died with another's (a rollout pool's engine): its result then
    takes the dead call's place."""
    futures = {stage: list(refs) for stage, refs in futures.items()}
    stage_of = {ref: stage for stage, refs in futures.items() for ref in refs}
    pending = list(stage_of)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            result = ray.get(done[0])  # raises the worker's exception, naming the actor and stage
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as death:
            replacement = None if recover is None else recover(done[0], death)
            if replacement is not None:
                stage = stage_of.pop(done[0])
                stage_of[replacement] = stage
                futures[stage] = [replacement if ref == done[0] else ref for ref in futures[stage]]
                pending.append(replacement)
                continue
            _keep_returned(pending, stage_of, finished)
            raise
        except ray.exceptions.RayTaskError as error:
            _keep_returned(pending, stage_of, finished)
            # A rank whose collective peer was killed fails at once (connection reset) while Ray
            # still reports the death: the death is the cause, and only it is retried (run()).
            died = _dead_worker_error(pending)
            if died is None:
                raise
            raise died from error
        if finished is not None:
            finished.setdefault(stage_of[done[0]], []).append(result)
    return {stage: ray.get(refs) for stage, refs in futures.items()}


def _keep_returned(pending: list, stage_of: dict, finished: dict[str, list[StageResult]] | None) -> None:
    """On a failure, add to `finished` the results other ranks had already returned: an in-flight
    retry reuses them, and a rank that returned after its last put cannot run its work again (its
    samples are done) to give them back."""
    if finished is None or not pending:
        return
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
    for ref in ready:
        try:
            result = ray.get(ref)
        except ray.exceptions.RayError:
            continue  # failed too: nothing to keep
        finished.setdefault(stage_of[ref], []).append(result)


def _dead_worker_error(pending: list) -> Exception | None:
    """The error of a worker that died among `pending` futures, as Ray reports it within the grace."""
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEAD_WORKER_GRACE_S) if pending else ([], [])
    for ref in ready:
        try:
            ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as died:
            return died
        except ray.exceptions.RayTaskError:
            continue  # another stage's own error: not a death
    return None
