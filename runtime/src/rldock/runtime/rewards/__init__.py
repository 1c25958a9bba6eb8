"""Rewards: registered terms scoring a `RewardBatch`, combined by `RewardScorer`.

`reward.terms` in the job config lists the terms; each response's reward is the sum of
weight * score over them (docs/rewards.md). Importing this package registers every term.
"""

from rldock.runtime.rewards import environment, function, math_answer, model, remote, rules  # noqa: F401  (register)
from rldock.runtime.rewards.reward_metrics import RewardMetrics, merge_reward_metrics
from rldock.runtime.rewards.scorer import ERRORS_METRIC, RewardScorer, ScoredBatch
from rldock.runtime.rewards.terms import (
    REWARDS,
    BatchRewardFn,
    RewardBatch,
    RewardError,
    RewardFn,
    column_lists,
    per_sample,
    register_reward,
)

__all__ = [
    "ERRORS_METRIC",
    "REWARDS",
    "BatchRewardFn",
    "RewardBatch",
    "RewardError",
    "RewardFn",
    "RewardMetrics",
    "RewardScorer",
    "column_lists",
    "ScoredBatch",
    "merge_reward_metrics",
    "per_sample",
    "register_reward",
]
