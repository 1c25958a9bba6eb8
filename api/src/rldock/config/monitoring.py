"""`monitoring`: budgets a running job is held to, which the cluster sees (the RLJob's conditions and
Events) and acts on (docs/algorithms/rollout-correction.md#a-budget-on-the-gap)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rldock.config.section import Spec


class MismatchBudgetSpec(Spec):
    """The largest train-inference mismatch a job accepts, and what passing it does."""

    max_kl: float = Field(
        gt=0,
        le=10,
        description="The budget on `mismatch/kl`, the token mean of k3 = rho - 1 - log rho with rho = "
        "pi_train / pi_engine, the estimate of KL(engine, trainer) on the sampled tokens.",
    )
    action: Literal["warn", "correct", "stop"] = Field(
        default="warn",
        description="When an iteration's `mismatch/kl` passes max_kl: `warn` logs it, and in an RLJob the "
        "condition RolloutMismatch turns True with a Warning Event (False again when an iteration is back "
        "under); `correct` also switches algorithm.rollout_correction (which it needs) on from the next "
        "iteration to the end of the run, a resume included: until then the correction's weights are computed "
        "for the mismatch/ metrics but weigh nothing (`mismatch/correcting` says which); `stop` also saves a "
        "checkpoint of that iteration and ends the job (exit 1; an RLJob Failed with reason RolloutMismatch, not "
        "retried), naming the iteration, the figure and the fix.",
    )


class MonitoringSpec(Spec):
    """Budgets on a running job's health."""

    mismatch: MismatchBudgetSpec | None = Field(
        default=None,
        description="A budget on the train-inference mismatch. Setting it measures the gap every iteration "
        "(the `mismatch/` metrics: the rollout keeps the engine's logprobs, the old-logprob pass runs), with "
        "or without algorithm.rollout_correction.",
    )
