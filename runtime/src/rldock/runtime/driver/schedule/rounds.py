"""DAPO's sampling rounds: an iteration's bank filled by rounds of prompt groups, each round's
dropped groups refilled, until G groups pass the recipe's filter (driver/feed.py DynamicSampling)."""

from __future__ import annotations

import time

import torch

from rldock.config.algorithm import AlgorithmSpec
from rldock.runtime.algorithms.episode_rows import at_heads
from rldock.runtime.dock import TransferDock
from rldock.runtime.driver.feed import DriverBatch, DynamicSampling, SampledRounds, SampleFacts, group_rows
from rldock.runtime.driver.schedule.driver import Driver
from rldock.runtime.driver.schedule.stages import gather_failing_fast
from rldock.runtime.flow.columns import EPISODE
from rldock.runtime.flow.recipe import SamplingRounds
from rldock.runtime.flow.states import StageCall


def fill_by_rounds(
    driver: Driver, bank: TransferDock, iteration: int, *, rounds: SamplingRounds, algo: AlgorithmSpec
) -> tuple[DriverBatch, float, SampledRounds]:
    """Run the recipe's sampling `rounds` round by round in `bank`; returns the kept batch, the
    seconds spent putting and the rounds' results, metrics and facts (every round's samples, read
    through the recipe's sample_facts state, which the filter reads too). The kept groups (and any
    padding) are in the bank when it returns: nothing more to put."""
    put_seconds = 0.0
    facts = SampleFacts()
    read = driver.recipe.spec(rounds.read_state)

    def run_round(groups: torch.Tensor, fresh: DriverBatch, sampling_round: int):
        """Fresh prompt groups into the bank's group slots `groups`, emptied first (the groups
        the filter dropped; the first round starts the iteration), then the sampling states;
        only the read state's (B,) columns come back to the driver: the filter's score, the length."""
        nonlocal put_seconds
        rows = group_rows(groups, driver.group_size)  # (k*N*S,)
        started = time.perf_counter()
        if sampling_round == 0:
            bank.reset()
        else:
            bank.recycle(rows)
        driver.put_groups(groups, fresh, bank)
        put_seconds += time.perf_counter() - started
        launched = driver.launch(StageCall(iteration, sampling_round=sampling_round), rounds.states)
        results = gather_failing_fast(launched, recover=driver.workers.recover)
        got = bank.get(read.name, list(read.consumes), batch_size=len(rows), whole_groups=True)
        assert got is not None and torch.equal(got[0], rows), "the filter state must get exactly this round's rows"
        facts.add(got[1])
        scores = got[1][rounds.score_column]  # (k*N*S,)
        # the filter counts episodes: each one's score once (its first row's), where it has several rows
        return results, at_heads(scores, got[1][EPISODE[0]]) if EPISODE[0] in got[1].keys() else scores

    sampled = DynamicSampling(
        num_groups=algo.num_prompts_per_iteration,
        group_size=driver.group_size,
        episodes_per_group=algo.num_responses_per_prompt,
        max_rounds=algo.dapo.max_sampling_rounds,
        group_filter=rounds.group_filter(algo),
    ).run(driver.feed.draw, run_round)
    sampled.facts = facts
    return sampled.batch, put_seconds, sampled
