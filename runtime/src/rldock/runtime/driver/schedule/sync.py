"""The synchronous schedule: an iteration fills its bank, runs every stage and its update, and the
next begins only after; a worker's death keeps the bank for the iteration's retry."""

from __future__ import annotations

import time
from collections.abc import Callable

from rldock.config.algorithm import AlgorithmSpec
from rldock.runtime import checkpoint as ckpt
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.driver.schedule.driver import Driver
from rldock.runtime.driver.schedule.inflight import Inflight, keep_inflight
from rldock.runtime.driver.schedule.prompts_ahead import PromptsAhead
from rldock.runtime.driver.schedule.stages import Stages
from rldock.runtime.driver.schedule.steps import (
    advance_policy,
    cycle_since,
    gather_stages,
    launch_unfinished,
    start_in_bank,
)
from rldock.runtime.flow.states import StageCall


class SyncSchedule:
    """One iteration at a time in one bank: fill (fresh prompts, DAPO's rounds or the bank a failed
    attempt kept), the states before the update, the update, then wait for all of them. With carried
    episodes, the prompts handed ahead go with the attempt's first iteration (prompts_ahead.py)."""

    def __init__(self, driver: Driver, banks: DockBanks, *, algo: AlgorithmSpec, ahead: PromptsAhead | None = None):
        """`ahead`: carried episodes' prompts to hand the rollout at the attempt's first iteration."""
        self.driver, self.banks, self.algo, self.ahead = driver, banks, algo, ahead
        self.inflight: Inflight | None = None  # the iteration running now, kept if a worker dies
        self.last_ended: float | None = None  # when the last iteration's stages ended (perf_counter)

    def run(self, iteration: int) -> Stages:
        driver = self.driver
        started = time.perf_counter()
        self.inflight = inflight = Inflight(iteration)
        bank = self.banks.bank(iteration)
        ahead = self.ahead.take(driver.feed, iteration) if self.ahead is not None else None
        fed, put_seconds, sampled, futures = start_in_bank(
            driver, bank, iteration, inflight, algo=self.algo, ahead=ahead
        )
        futures.update(launch_unfinished(driver, StageCall(iteration), driver.updates, inflight))
        stages = gather_stages(
            driver, futures, inflight, fed=fed, put_seconds=put_seconds, sampled=sampled, bank=bank, started=started
        )
        stages.cycle, self.last_ended = cycle_since(self.last_ended, stages.ended), stages.ended
        # The update made policy version `iteration`. No stage runs now and nothing is left to
        # bound, so it goes in the bookkeeping's order, before the counters read the next put waits for.
        driver.books.later(advance_policy, self.banks, iteration)
        ckpt.clear_inflight(driver.output_dir)  # this iteration's work is done: nothing to resume
        return stages

    def checkpoint_sampler_state(self) -> dict:
        """The sampler's position for a checkpoint taken now."""
        return self.driver.feed.state_dict()

    def keep_inflight(self, stop_workers: Callable[[], None]) -> None:
        """After a worker died: stop the workers, then keep the bank of the iteration in flight for
        its retry. Sampling rounds (DAPO) refill the bank each round, and carried episodes die with their
        ranks (the bank's rows are written with groups they held): such an iteration is redone whole
        from the checkpoint."""
        if self.inflight is None or self.driver.recipe.sampling_rounds is not None or self.ahead is not None:
            return
        stop_workers()
        keep_inflight(self.driver.output_dir, self.inflight, self.banks.bank(self.inflight.iteration))
