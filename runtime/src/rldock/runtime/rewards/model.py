"""The `model` term: a learned reward model's score, computed before the reward stage.

The reward model runs on a device in its own worker state (`reward_model`,
runtime/src/rldock/runtime/workers/reward_model.py), which writes each sample's score to the dock
as `rm_score`; the reward worker passes that column to `RewardScorer.score` as the term's
precomputed scores. So the term's batch function never scores text itself: reaching it means the
scores were not passed, a wiring bug, and it says so.
"""

from __future__ import annotations

from rldock.config.reward import RewardTermSpec
from rldock.runtime.rewards.terms import BatchRewardFn, RewardBatch, RewardError, register_reward


@register_reward("model")
def reward_model_term(term: RewardTermSpec, at: str) -> BatchRewardFn:
    def score_batch(batch: RewardBatch):
        raise RewardError(
            f"{at} (model {term.path}) has no precomputed scores: its scores come from the "
            "reward_model worker state (the dock's rm_score column), which did not run for "
            "these samples"
        )

    return score_batch
