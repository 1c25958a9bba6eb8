"""In-flight resume: the bank of an iteration a worker died in is kept with its finished stage
results, and the iteration's retry loads it and runs only what was left."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from rldock.runtime import checkpoint as ckpt
from rldock.runtime.dock import DockActorDiedError, TransferDock
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.driver.feed import DriverBatch, SampledRounds
from rldock.runtime.flow.recipe import Recipe

logger = logging.getLogger(__name__)


@dataclass
class Inflight:
    """What an iteration has done so far: results of stage ranks that returned, ranks per stage."""

    iteration: int
    finished: dict[str, list[StageResult]] = field(default_factory=dict)
    launched: dict[str, int] = field(default_factory=dict)
    skip: set[str] = field(default_factory=set)  # stages a resumed iteration does not run again
    resumed: bool = False  # loaded the dock of a failed attempt (resume_inflight)


def keep_inflight(output_dir: Path, inflight: Inflight, bank: TransferDock) -> None:
    """Keep `bank`, the dock of the iteration in flight, for its retry (ckpt.save_inflight), unless
    the dock died too. Every worker must have stopped: no writer may run while the dock is read."""
    try:
        state = bank.state_dict()
    except DockActorDiedError as error:
        logger.warning("the dock died too (%s); iteration %d will be redone from its start", error, inflight.iteration)
        return
    path = ckpt.save_inflight(
        output_dir,
        iteration=inflight.iteration,
        dock_state=state,
        finished=inflight.finished,
        launched=inflight.launched,
    )
    logger.info("kept the dock of iteration %d in %s for its retry", inflight.iteration, path)


def resume_inflight(
    bank: TransferDock, fed: DriverBatch, snapshot: dict, inflight: Inflight, *, recipe: Recipe
) -> tuple[float, SampledRounds]:
    """Load the dock an earlier attempt of this iteration left into `bank` (instead of putting `fed`,
    the same prompts: the sampler resumed from the same checkpoint). Samples a stage took without
    its outputs reaching the dock go back to it; stages whose every rank finished are not run again
    (`inflight.skip`) and their results are reused. States that write nothing (the update) always
    run: their effect, the weights, was lost with the worker. Returns the seconds it took and the
    reused results."""
    started = time.perf_counter()
    produces = recipe.produces
    bank.reset()
    bank.load_state_dict(snapshot["dock"], produces=produces)
    finished, launched = snapshot["finished"], snapshot["launched"]
    reruns = {state for state in recipe.launched_states if not produces.get(state)}
    kept = {state: results for state, results in finished.items() if state not in reruns}
    skip = {state for state, results in kept.items() if len(results) == launched.get(state)}
    # Partly finished stages run again on every rank; the ranks that had finished find their
    # work done, so the results that came back then are joined with the new ones (in the
    # metrics; a second failure keeps only the stages finished whole).
    inflight.skip = skip
    inflight.resumed = True
    inflight.finished.update({state: list(kept[state]) for state in skip})
    inflight.launched.update({state: launched[state] for state in skip})
    logger.info(
        "iteration %d resumes from the dock of its failed attempt; not run again: %s",
        inflight.iteration,
        sorted(inflight.skip),
    )
    return time.perf_counter() - started, SampledRounds(fed, kept, {})
