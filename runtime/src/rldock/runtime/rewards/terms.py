"""What every reward term shares: the registry of term builders, the batch they score, the error.

The built-in terms have verl's signature, `fn(data_source, solution_str, ground_truth, extra_info)
-> float | dict`; a dict holds the score under "score" and its other numeric keys become metrics.
A user's `function` term may also have TRL's batch form (rewards/forms.py). Terms are built from
their config by a registered builder into a *batch* function over a `RewardBatch`, because some
terms (the `remote` one, TRL's form) score a whole batch per call. A batch function returns one
outcome per sample: the function's value, or the exception it raised, so that the scorer can apply
`reward.on_error` per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rldock.config.reward import RewardTermSpec
from rldock.runtime.registry import Registry

RewardValue = float | dict[str, Any]
# (data_source, solution_str, ground_truth, extra_info) -> score or {"score": ..., other metrics}
RewardFn = Callable[[str, str, str, dict], RewardValue]


@dataclass(frozen=True)
class RewardBatch:
    """The samples a term scores, one entry per sample in every list. `prompts`, `columns` and
    `completion_ids` are what TRL's form passes besides the completions; a caller that has none
    leaves them out."""

    data_sources: list[str]
    solution_strs: list[str]  # the decoded responses
    ground_truths: list[str]
    extra_infos: list[dict]
    prompts: list[str | list] | None = None  # each row's prompt as stored: text or chat messages
    columns: dict[str, list] = field(default_factory=dict)  # each other data column -> its values
    completion_ids: list[list[int]] | None = None  # each response's token ids (no padding)

    def __len__(self) -> int:
        return len(self.solution_strs)


def column_lists(rows: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """Each column of `rows` (one mapping of column -> value per row) -> its value per row, None where
    a row lacks it (jsonl objects need not share their fields): RewardBatch.columns."""
    names = dict.fromkeys(name for row in rows for name in row)
    return {name: [row.get(name) for row in rows] for name in names}


# A batch -> one value or raised exception per sample.
BatchRewardFn = Callable[[RewardBatch], list[RewardValue | Exception]]
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

    def score_batch(batch: RewardBatch) -> list[RewardValue | Exception]:
        outcomes: list[RewardValue | Exception] = []
        for sample in zip(batch.data_sources, batch.solution_strs, batch.ground_truths, batch.extra_infos):
            try:
                outcomes.append(fn(*sample))
            except Exception as error:  # broad on purpose: user functions may raise anything; on_error decides
                outcomes.append(error)
        return outcomes

    return score_batch
