"""monitoring.mismatch: the train-inference mismatch an iteration may reach. Over it, `warn` logs the
iteration, its figure and the fix (an RLJob's operator sets the condition RolloutMismatch from the
progress line's `mismatch_kl`); `correct` also switches algorithm.rollout_correction on in the actor
ranks from the next iteration to the end of the run (a resume or a restarted attempt switches it on
again, from the records: a budget passed before stays passed); `stop` also checkpoints that iteration
and ends the run with `MismatchOverBudget`, which `rldock train` reports as a failure line (reason
RolloutMismatch): the RLJob fails at once rather than retrying a run that would pass the budget
again."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rldock.config.monitoring import MonitoringSpec
from rldock.contract.failure import FailureReason, FieldProblem, JobFailure

logger = logging.getLogger(__name__)

FIELD = "monitoring.mismatch.max_kl"
CORRECTING = "mismatch/correcting"  # under action `correct`: 1 where the iteration's update was corrected


@dataclass
class MismatchOverBudget(Exception):
    """Iteration `iteration`'s `mismatch/kl` was `kl`, over the budget `max_kl`."""

    iteration: int
    kl: float
    max_kl: float
    stops: bool  # action `stop`: the run ends after this iteration's checkpoint

    def __str__(self) -> str:
        return (
            f"iteration {self.iteration}: mismatch/kl {self.kl:.4g} is over {FIELD} {self.max_kl:.4g} (the engine's "
            "logprobs against the trainer's); correct for it with algorithm.rollout_correction, generate in the "
            "trainer's precision (rollout.dtype), or raise the budget (docs/algorithms/rollout-correction.md)"
        )

    def act(self) -> None:
        """The budget's action: log it; with `stop`, raise this (after the iteration's checkpoint)."""
        logger.warning("%s", self)
        if self.stops:
            raise self

    def failure(self) -> JobFailure:
        """The failure line's content (rldock.contract.failure)."""
        return JobFailure(FailureReason.ROLLOUT_MISMATCH, (FieldProblem(FIELD, str(self)),))


def over_budget(monitoring: MonitoringSpec, record: dict) -> MismatchOverBudget | None:
    """The iteration `record` describes, when its `mismatch/kl` passed monitoring.mismatch.max_kl."""
    budget = monitoring.mismatch
    if budget is None or "mismatch/kl" not in record or record["mismatch/kl"] <= budget.max_kl:
        return None
    return MismatchOverBudget(
        iteration=record["iteration"], kl=record["mismatch/kl"], max_kl=budget.max_kl, stops=budget.action == "stop"
    )


class MismatchBudget:
    """One attempt's monitoring.mismatch: judges each iteration's record and acts on the actor ranks
    `actors` (their handles); under `correct`, whether the correction is on yet."""

    def __init__(self, monitoring: MonitoringSpec, records: Sequence[dict], actors: Sequence[Any]) -> None:
        self.monitoring, self.actors = monitoring, list(actors)
        budget = monitoring.mismatch
        self.corrects = budget is not None and budget.action == "correct"
        # A budget passed before this attempt (a resume, a restarted attempt) stays passed.
        self.correcting = self.corrects and any(over_budget(monitoring, r) for r in records if r["iteration"] > 0)
        if self.correcting:
            self._switch_on()

    def judge(self, record: dict) -> MismatchOverBudget | None:
        """`record`'s iteration against the budget; under `correct`, the record says whether its update
        was corrected (`mismatch/correcting`)."""
        if self.corrects:
            record[CORRECTING] = float(self.correcting)
        return over_budget(self.monitoring, record)

    def act(self, over: MismatchOverBudget) -> None:
        """The budget's action on a passing: log it; `stop` raises (after the iteration's checkpoint);
        `correct` switches the correction on for the iterations after this one."""
        over.act()
        if self.corrects and not self.correcting:
            logger.warning("monitoring.mismatch: algorithm.rollout_correction on from iteration %d", over.iteration + 1)
            self.correcting = True
            self._switch_on()

    def _switch_on(self) -> None:
        ray.get([actor.apply_rollout_correction.remote() for actor in self.actors])
