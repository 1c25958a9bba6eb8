"""The reward metrics of an iteration, summed over the batches (and sampling rounds) that produced them.

A worker keeps a RewardMetrics while it scores and returns `state()` with its results; the trainer
merges the states of all results into the iteration's record (`merge_reward_metrics`): means
weighted by the samples behind each, and the total of `reward/errors`.
"""

from __future__ import annotations

from rldock.runtime.rewards.scorer import ERRORS_METRIC, ScoredBatch


class RewardMetrics:
    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.errors = 0

    def add(self, scored: ScoredBatch) -> None:
        for label, scores in scored.term_scores.items():
            self._add(f"reward/{label}", scores.sum().item(), scores.numel())
        for key, values in scored.extras.items():
            self._add(key, sum(values), len(values))
        self.errors += scored.num_errors

    def _add(self, key: str, total: float, count: int) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + total
        self.counts[key] = self.counts.get(key, 0) + count

    def state(self) -> dict:
        """Plain data (it crosses Ray and lands in in-flight checkpoints)."""
        return {"sums": dict(self.sums), "counts": dict(self.counts), "errors": self.errors}


def merge_reward_metrics(states: list[dict]) -> dict[str, float]:
    """`reward/<term>` means and the `reward/errors` total over the given states; {} for none."""
    if not states:
        return {}
    merged = RewardMetrics()
    for state in states:
        for key, total in state["sums"].items():
            merged._add(key, total, state["counts"][key])
        merged.errors += state["errors"]
    means = {key: merged.sums[key] / merged.counts[key] for key in merged.sums if merged.counts[key]}
    return {**means, ERRORS_METRIC: merged.errors}
