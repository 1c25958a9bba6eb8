"""The steps every schedule takes, in the order it chooses: fill an iteration's bank and launch its
stages before the update, launch what is left of a set of states, gather the stages' results."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tensordict import TensorDict

from rldock.config.algorithm import AlgorithmSpec
from rldock.runtime import checkpoint as ckpt
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.driver.feed import DriverBatch, SampledRounds
from rldock.runtime.driver.schedule.driver import Driver
from rldock.runtime.driver.schedule.inflight import Inflight, resume_inflight
from rldock.runtime.driver.schedule.rounds import fill_by_rounds
from rldock.runtime.driver.schedule.stages import Stages, gather_failing_fast
from rldock.runtime.flow.states import StageCall


def fill_bank(
    driver: Driver, bank: TransferDock, iteration: int, inflight: Inflight, *, algo: AlgorithmSpec
) -> tuple[DriverBatch, float, SampledRounds]:
    """Put the iteration's batch into `bank`: G fresh prompts, the dock a failed attempt of this
    iteration left (same prompts), or with sampling rounds (DAPO) the groups those rounds kept.
    Returns the batch, the seconds spent putting and the results already in (rounds', resumed)."""
    rounds = driver.recipe.sampling_rounds
    if rounds is not None:
        return fill_by_rounds(driver, bank, iteration, rounds=rounds, algo=algo)
    fed = driver.feed.draw()
    snapshot = ckpt.load_inflight(driver.output_dir, iteration)
    if snapshot is not None and bank.can_load(snapshot["dock"]):
        return fed, *resume_inflight(bank, fed, snapshot, inflight, recipe=driver.recipe)
    return fed, driver.put(fed, bank), SampledRounds(fed, {}, {})


def start_in_bank(
    driver: Driver,
    bank: TransferDock,
    iteration: int,
    inflight: Inflight,
    *,
    algo: AlgorithmSpec,
    ahead: TensorDict | None = None,
) -> tuple[DriverBatch, float, SampledRounds, dict[str, list]]:
    """Fill `bank` with the iteration's batch and launch its states before the update (with carried
    episodes' prompts handed `ahead`, StageCall.ahead); returns what `fill_bank` does and the launched
    futures."""
    fed, put_seconds, sampled = fill_bank(driver, bank, iteration, inflight, algo=algo)
    if inflight.skip:  # their turns (serial phase schedule) are not taken again
        driver.workers.skip_turns(iteration, sorted(inflight.skip))
    call = StageCall(iteration, ahead=ahead)
    return fed, put_seconds, sampled, launch_unfinished(driver, call, driver.before_update, inflight)


def launch_unfinished(driver: Driver, call: StageCall, states: Sequence[str], inflight: Inflight) -> dict[str, list]:
    """Launch `states` with `call` but those a failed attempt of the iteration finished on every rank."""
    return driver.launch(call, [state for state in states if state not in inflight.skip])


def gather_stages(
    driver: Driver,
    futures: dict[str, list],
    inflight: Inflight,
    *,
    fed: DriverBatch,
    put_seconds: float,
    sampled: SampledRounds,
    bank: TransferDock,
    started: float,
) -> Stages:
    """Wait for every launched stage (recording each rank's result in `inflight` as it returns), join
    the results that came in before (sampling rounds, a resumed attempt) and read the samples' facts
    from `bank` (Driver.read_facts; the sampling rounds read them already)."""
    inflight.launched.update({state: len(refs) for state, refs in futures.items()})
    gathered = gather_failing_fast(futures, finished=inflight.finished, recover=driver.workers.recover)
    results = {**sampled.results, **{s: sampled.results.get(s, []) + r for s, r in gathered.items()}}
    facts = sampled.facts if sampled.facts is not None else driver.read_facts(bank, num_samples=len(fed.batch))
    return Stages(fed, put_seconds, results, facts, bank, started, time.perf_counter(), sampled.metrics)


def cycle_since(previous_end: float | None, ended: float) -> float | None:
    """An iteration's cycle (Stages.cycle): the seconds since the previous iteration's stages ended,
    or None for the first iteration a schedule runs."""
    return None if previous_end is None else ended - previous_end


def advance_policy(banks: DockBanks, version: int) -> None:
    """The update made policy `version`: every bank applies the staleness bound to what is left."""
    for bank in banks.docks:
        bank.set_policy_version(version)
