"""`function`: the user's own reward function, loaded in the reward worker's process.

`reward.terms[i].function` names it as `path/to/file.py:name` or `package.module:name`, loaded as
every user object is (rldock.runtime.user_code). It has verl's form
`fn(data_source, solution_str, ground_truth, extra_info) -> float | dict` or TRL's batch form
`fn(prompts, completions, **kwargs) -> list[float | None]`, told apart by its signature
(rewards/forms.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from rldock.config.reward import RewardTermSpec
from rldock.runtime.rewards.forms import batch_function
from rldock.runtime.rewards.terms import BatchRewardFn, RewardError, register_reward
from rldock.runtime.user_code import load_object


def load_function(reference: str, at: str) -> Callable:
    """The callable named by `file.py:name` or `module:name`; RewardError naming `at` if there is none."""
    return cast(Callable, load_object(reference, field=f"{at}.function", kind="function", error=RewardError))


@register_reward("function")
def _build_function(term: RewardTermSpec, at: str) -> BatchRewardFn:
    assert term.function is not None  # config/reward.py requires it for a `function` term
    return batch_function(load_function(term.function, at), field=f"{at}.function", reference=term.function)
