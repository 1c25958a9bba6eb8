"""Rewards: registered terms with verl's function signature, combined by `RewardScorer`.

`reward.terms` in the job config lists the terms; each response's reward is the sum of
weight * score over them (docs/rewards.md). Importing this package registers every term.
"""

from rldock.runtime.rewards import function, math_answer, model, remote, rules  # noqa: F401  (register the terms)
from rldock.runtime.rewards.base import REWARDS, BatchRewardFn, RewardError, RewardFn, per_sample, register_reward
from rldock.runtime.rewards.metrics import RewardMetrics, merge_reward_metrics
from rldock.runtime.rewards.scorer import ERRORS_METRIC, RewardScorer, ScoredBatch

__all__ = [
    "ERRORS_METRIC",
    "REWARDS",
    "BatchRewardFn",
    "RewardError",
    "RewardFn",
    "RewardMetrics",
    "RewardScorer",
    "ScoredBatch",
    "merge_reward_metrics",
    "per_sample",
    "register_reward",
]
