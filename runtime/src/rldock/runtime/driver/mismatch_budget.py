"""monitoring.mismatch: the train-inference mismatch an iteration may reach. Over it, `warn` logs the
iteration, its figure and the fix (an RLJob's operator sets the condition RolloutMismatch from the
progress line's `mismatch_kl`); `stop` also checkpoints that iteration and ends the run with
`MismatchOverBudget`, which `rldock train` reports as a failure line (reason RolloutMismatch): the
RLJob fails at once rather than retrying a run that would pass the budget again."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rldock.config.monitoring import MonitoringSpec
from rldock.contract.failure import FailureReason, FieldProblem, JobFailure

logger = logging.getLogger(__name__)

FIELD = "monitoring.mismatch.max_kl"


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
