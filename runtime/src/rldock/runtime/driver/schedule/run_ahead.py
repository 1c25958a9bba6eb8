"""The run-ahead schedule (training.mode async): before an iteration's update, the next iteration is
put into the other bank and launched, all but its update, so its samples come from the policy one
version old; with partial rollout that generation is cut and finished after the update."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from rldock.config.algorithm import AlgorithmSpec
from rldock.runtime import checkpoint as ckpt
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.driver.feed import DriverBatch, SampledRounds
from rldock.runtime.driver.schedule.driver import Driver
from rldock.runtime.driver.schedule.inflight import Inflight
from rldock.runtime.driver.schedule.partial_rollout import held_states, launch_after_cut
from rldock.runtime.driver.schedule.stages import Stages
from rldock.runtime.driver.schedule.steps import (
    advance_policy,
    cycle_since,
    gather_stages,
    launch_unfinished,
    start_in_bank,
)
from rldock.runtime.flow.states import StageCall


@dataclass
class Ahead:
    """An iteration put into its bank and launched (all but its update) ahead."""

    iteration: int
    fed: DriverBatch
    put_seconds: float
    futures: dict[str, list]  # state -> the futures of its ranks
    sampler_state: dict  # the sampler before this iteration's draw, for the checkpoint before it
    # partial rollout: the states launched only after the update that cut the generation; None: not cut
    held: tuple[str, ...] | None = None


class RunAheadSchedule:
    """Two iterations in flight, each in its own bank (dock/banks.py): the next one's generation and
    inference run before, and beside, this one's update."""

    def __init__(
        self,
        driver: Driver,
        banks: DockBanks,
        *,
        algo: AlgorithmSpec,
        iterations: int,
        round_tokens: int | None = None,
        actor_rank_states: Collection[str] | None = None,
    ):
        """`round_tokens`: the run-ahead generation's token budget (rollout.max_tokens_per_round, which
        the rollout applies under partial rollout only). `actor_rank_states`: the states the actor
        ranks run, held back while a cut generation waits for its second round (None: no cut)."""
        self.driver, self.banks, self.algo = driver, banks, algo
        self.iterations = iterations
        self.round_tokens, self.actor_rank_states = round_tokens, actor_rank_states
        self.ahead: Ahead | None = None
        self.inflight: Inflight | None = None
        self.last_ended: float | None = None  # when the last iteration's stages ended (perf_counter)

    def run(self, iteration: int) -> Stages:
        driver = self.driver
        started = time.perf_counter()
        self.inflight = inflight = Inflight(iteration)
        bank = self.banks.bank(iteration)
        ahead, self.ahead = self.ahead, None
        if ahead is not None:  # put and launched while the previous iteration's update ran
            assert ahead.iteration == iteration, "the pipeline ran ahead to another iteration"
            fed, put_seconds, futures = ahead.fed, ahead.put_seconds, ahead.futures
            sampled = SampledRounds(fed, {}, {})
        else:
            fed, put_seconds, sampled, futures = start_in_bank(driver, bank, iteration, inflight, algo=self.algo)
        if iteration < self.iterations:
            self.ahead = self.queue_ahead_of_update(iteration + 1)
        futures.update(launch_unfinished(driver, StageCall(iteration), driver.updates, inflight))
        if self.ahead is not None and self.ahead.held is not None:  # after the update that cut it
            self.ahead.futures.update(launch_after_cut(driver, self.ahead.iteration, self.ahead.held))
        stages = gather_stages(
            driver, futures, inflight, fed=fed, put_seconds=put_seconds, sampled=sampled, bank=bank, started=started
        )
        stages.cycle, self.last_ended = cycle_since(self.last_ended, stages.ended), stages.ended
        # The update made policy version `iteration`: the bound applies at once to what is left, in
        # the next iteration's bank too, which is filling: its update must see the new version.
        advance_policy(self.banks, iteration)
        ckpt.clear_inflight(driver.output_dir)  # this iteration's work is done: nothing to resume
        return stages

    def queue_ahead_of_update(self, iteration: int) -> Ahead:
        """Put `iteration`'s prompts into its bank and launch its states but the update. Call it
        before launching the running iteration's update: Ray runs one actor's calls in the order
        they were submitted, so on the actor ranks this generation and old-logprob pass run before
        that update (on the policy one version old), while the other workers' stages overlap it.

        With partial rollout the generation is cut at `round_tokens`, and the states the actor
        ranks run over its responses are held back (`held`) until after the update
        (partial.launch_after_cut)."""
        driver = self.driver
        sampler_state = driver.feed.state_dict()  # the checkpoint before this iteration keeps it
        fed = driver.feed.draw()
        put_seconds = driver.put(fed, self.banks.bank(iteration))
        held = None if self.actor_rank_states is None else held_states(driver.before_update, self.actor_rank_states)
        futures = driver.launch(
            StageCall(iteration, round_tokens=self.round_tokens),
            [s for s in driver.before_update if s not in (held or ())],
        )
        return Ahead(iteration, fed, put_seconds, futures, sampler_state, held)

    def checkpoint_sampler_state(self) -> dict:
        """The sampler's position for a checkpoint taken now: before the run-ahead's draw, since a
        resume redoes that iteration."""
        return self.ahead.sampler_state if self.ahead is not None else self.driver.feed.state_dict()

    def keep_inflight(self, stop_workers: Callable[[], None]) -> None:
        """Two iterations are in flight: a worker's death redoes both from the checkpoint."""
