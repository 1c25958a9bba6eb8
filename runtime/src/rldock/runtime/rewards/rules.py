"""String rule rewards in [0, 1]: `exact_match`, `digit_match` and `format`.

All compare the response with surrounding whitespace removed; the caller passes the decoded
response without EOS or padding (see `models.decode_responses`).

- `exact_match`: 1.0 if the response is exactly the ground truth, else 0.0.
- `digit_match`: 1.0 for the exact answer; otherwise partial credit
  `matches / max(len(response), len(answer))`, where `matches` counts characters equal to the
  answer's at the same place value (strings aligned at their right end, units with units, since
  that is what "the right digit" means for a number). Dividing by the longer length penalises a
  wrong length: "95" against answer "950" scores 0, "15" against "105" scores 1/3. A wrong answer
  always scores below 1, so the exact answer stays the only optimum while the reward is dense
  enough for a tiny model to climb.
- `format`: 1.0 if the response matches the term's `pattern` as a whole (`re.fullmatch`, with
  `re.DOTALL` so `.` spans lines), else 0.0. Whole-response matching is what "the response has
  this format" means; a pattern that only needs to occur somewhere is written `.*x.*`.
"""

from __future__ import annotations

import re

from rldock.config.reward import RewardTermSpec
from rldock.runtime.rewards.terms import BatchRewardFn, per_sample, register_reward


def exact_match(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0


def digit_match(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
    response, answer = solution_str.strip(), ground_truth.strip()
    if response == answer:
        return 1.0
    longest = max(len(response), len(answer))
    if longest == 0:
        return 0.0
    matches = sum(r == a for r, a in zip(reversed(response), reversed(answer)))
    return matches / longest


@register_reward("exact_match")
def _build_exact_match(term: RewardTermSpec, at: str) -> BatchRewardFn:
    return per_sample(exact_match)


@register_reward("digit_match")
def _build_digit_match(term: RewardTermSpec, at: str) -> BatchRewardFn:
    return per_sample(digit_match)


@register_reward("format")
def _build_format(term: RewardTermSpec, at: str) -> BatchRewardFn:
    assert term.pattern is not None  # config/reward.py requires it for a `format` term
    pattern = re.compile(term.pattern, re.DOTALL)  # config/reward.py checked that it compiles

    def format_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
        return 1.0 if pattern.fullmatch(solution_str.strip()) else 0.0

    return per_sample(format_reward)
