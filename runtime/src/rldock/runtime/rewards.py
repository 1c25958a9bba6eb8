"""Rule rewards in [0, 1] by name: `get_reward_fn(name)(response_text, answer_text) -> float`.

Both rewards compare the response with surrounding whitespace removed; the caller passes the
decoded response without EOS or padding (see `models.decode_responses`).

- `exact_match`: 1.0 if the response is exactly the answer, else 0.0.
- `digit_match`: 1.0 for the exact answer; otherwise partial credit
  `matches / max(len(response), len(answer))`, where `matches` counts characters equal to the
  answer's at the same place value (strings aligned at their right end, units with units, since
  that is what "the right digit" means for a number). Dividing by the longer length penalises a
  wrong length: "95" against answer "950" scores 0, "15" against "105" scores 1/3. A wrong answer
  always scores below 1, so the exact answer stays the only optimum while the reward is dense
  enough for a tiny model to climb.
"""

from __future__ import annotations

from typing import Callable

from rldock.runtime.registry import Registry

RewardFn = Callable[[str, str], float]

REWARDS: Registry[RewardFn] = Registry("reward", field="reward.name")
register_reward = REWARDS.register
get_reward_fn = REWARDS.get


@register_reward("exact_match")
def exact_match(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


@register_reward("digit_match")
def digit_match(response: str, answer: str) -> float:
    response, answer = response.strip(), answer.strip()
    if response == answer:
        return 1.0
    longest = max(len(response), len(answer))
    if longest == 0:
        return 0.0
    matches = sum(r == a for r, a in zip(reversed(response), reversed(answer)))
    return matches / longest
