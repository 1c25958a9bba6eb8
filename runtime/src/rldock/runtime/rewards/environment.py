"""The `environment` reward term: the rewards an episode's environment answered its steps with
(agent/episode_loop.py keeps one per step), aggregated into the episode's score as `aggregate` says.

The rewards reach the term in `extra_info["trajectory"]["environment_rewards"]`, where the reward worker
(agent/trajectory.py) and the held-out evaluation put each episode's.
"""

from __future__ import annotations

from collections.abc import Sequence

from rldock.config.reward import RewardTermSpec
from rldock.runtime.rewards.terms import BatchRewardFn, RewardBatch, RewardError, RewardValue, register_reward


def aggregate_rewards(rewards: Sequence[float], how: str) -> float:
    """An episode's score from its per-step rewards: their `sum`, or the `last` step's; 0 without a step."""
    if not rewards:
        return 0.0
    if how == "sum":
        return float(sum(rewards))
    if how == "last":
        return float(rewards[-1])
    raise ValueError(f"unknown aggregate {how!r}; use sum or last")


@register_reward("environment")
def environment_term(term: RewardTermSpec, at: str) -> BatchRewardFn:
    how = term.aggregate or "sum"

    def score_batch(batch: RewardBatch) -> list[RewardValue | Exception]:
        scores: list[RewardValue | Exception] = []
        for info in batch.extra_infos:
            trajectory = info.get("trajectory")
            if not isinstance(trajectory, dict) or "environment_rewards" not in trajectory:
                raise RewardError(
                    f"{at} (environment) got a sample without its environment's rewards: the term scores episodes "
                    "of a job with agent.environment"
                )
            scores.append(aggregate_rewards(trajectory["environment_rewards"], how))
        return scores

    return score_batch
