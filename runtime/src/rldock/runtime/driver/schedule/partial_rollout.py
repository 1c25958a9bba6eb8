"""Partial rollout in the run-ahead schedule: the states held back until the cut generation's second
round, and that round launched with them after the update that cut it (rollout/partial.py)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from rldock.runtime.driver.schedule.driver import Driver
from rldock.runtime.flow.states import ROLLOUT_RESUME, StageCall


def held_states(states: Sequence[str], actor_rank_states: Collection[str]) -> tuple[str, ...]:
    """Of the run-ahead iteration's `states`, those the actor ranks run over its responses: queued
    before the update, they would wait for responses only the second round writes, and the update
    queued behind them on the same ranks would never start."""
    return tuple(state for state in states if state in actor_rank_states)


def launch_after_cut(driver: Driver, iteration: int, held: Sequence[str]) -> dict[str, list]:
    """The second round of `iteration`'s generation on every engine, then the held-back states."""
    call = StageCall(iteration)
    return {**driver.workers.launch(call, [ROLLOUT_RESUME]), **driver.launch(call, held)}
