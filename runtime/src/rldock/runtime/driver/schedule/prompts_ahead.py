"""Carried episodes' prompts handed ahead (rollout.partial_rollout carry, rollout/agent_carry.py): at the first
iteration an attempt runs, the driver draws the prompt groups of the next `batches_ahead` batches besides the
iteration's own and hands them to the rollout ranks in the call (StageCall.ahead), one row per group, so that
each rank fills its room of (dock.max_staleness + 1) batches at once. Later iterations hand nothing: a rank
admits the groups each bank brings it (rollout/carry.py: `admits_fresh`)."""

from __future__ import annotations

from tensordict import TensorDict

from rldock.runtime.driver.schedule.driver import Prompts
from rldock.runtime.rollout.carry import batches_ahead


class PromptsAhead:
    """What one attempt's sync schedule hands ahead: the prompts of `batches_ahead` batches of
    `num_prompts` groups at its first iteration, nothing after."""

    def __init__(self, *, iterations: int, max_staleness: int, num_prompts: int, group_size: int):
        """`group_size`: the driver batch's rows per group (JobConfig.rows_per_group)."""
        self.iterations, self.max_staleness = iterations, max_staleness
        self.num_prompts, self.group_size = num_prompts, group_size
        self.handed = False

    def take(self, feed: Prompts, iteration: int) -> TensorDict | None:
        """The groups to hand ahead at `iteration` (drawn from `feed` now), or None."""
        if self.handed:
            return None
        self.handed = True
        batches = batches_ahead(iteration, iterations=self.iterations, max_staleness=self.max_staleness)
        if batches == 0:
            return None
        fed = feed.draw(batches * self.num_prompts)
        return fed.batch[:: self.group_size].clone()  # (batches * G,) one row per group
