"""What every reward term shares: the registry of term builders, the function signature, the error.

A reward function has verl's signature, `fn(data_source, solution_str, ground_truth, extra_info)
-> float | dict`; a dict holds the score under "score" and its other numeric keys become metrics.
Terms are built from their config by a registered builder into a *batch* function over lists of
those four arguments, because some terms (the `remote` one) score a whole batch per call. A batch
function returns one outcome per sample: the function's value, or the exception it raised, so that
the scorer can apply `reward.on_error` per sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rldock.config.job import RewardTermSpec
from rldock.runtime.registry import Registry

RewardValue = float | dict[str, Any]
# (data_source, solution_str, ground_truth, extra_info) -> score or {"score": ..., other metrics}
RewardFn = Callable[[str, str, str, dict], RewardValue]
# The same over lists of equal length -> one value or raised exception per sample.
BatchRewardFn = Callable[[list[str], list[str], list[str], list[dict]], list[RewardValue | Exception]]
# (the term's config, its field path such as "reward.terms[1]") -> its batch function
TermBuilder = Callable[[RewardTermSpec, str], BatchRewardFn]

REWARDS: Registry[TermBuilder] = Registry("reward", field="reward.terms.name")
register_reward = REWARDS.register


class RewardError(RuntimeError):
    """A reward term could not score: the message names the term (its config path) and, for a
    sample, its data source; the original exception is chained as the cause.

    It takes one message argument only, so it survives pickling across Ray processes.
    """


def per_sample(fn: RewardFn) -> BatchRewardFn:
    """A batch function that calls `fn` on each sample and keeps what it raised as that sample's outcome."""

    def score_batch(
        data_sources: list[str], solution_strs: list[str], ground_truths: list[str], extra_infos: list[dict]
    ) -> list[RewardValue | Exception]:
        outcomes: list[RewardValue | Exception] = []
        for sample in zip(data_sources, solution_strs, ground_truths, extra_infos):
            try:
                outcomes.append(fn(*sample))
            except Exception as error:  # broad on purpose: user functions may raise anything; on_error decides
                outcomes.append(error)
        return outcomes

    return score_batch
