"""What a schedule runs an iteration with, fixed for one attempt: the recipe's facts it orders by,
the attempt's workers it launches stages on, the job's feed it draws prompts from and the
bookkeeping whose order it keeps; and the driver's puts into a dock bank and its read of the
samples' facts from it. Objects, not callbacks into the trainer: a schedule is tested with doubles
of each (tests/unit/runtime/driver/schedule/test_schedule.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tensordict import TensorDict

from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.grouping import split_group_columns
from rldock.runtime.driver.feed import DriverBatch, SampleFacts, group_rows
from rldock.runtime.flow.columns import EPISODE
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import StageCall, WorkerState


class StageWorkers(Protocol):
    """The attempt's workers as a schedule uses them (attempt.WorkerGroups)."""

    def launch(self, call: StageCall, specs: Sequence[WorkerState]) -> dict[str, list]:
        """Start each state of `specs` (in that order) on its runners; state -> their futures."""
        ...

    def skip_turns(self, iteration: int, states: list[str]) -> None:
        """A resumed iteration's finished stages give up their turns (serial phase schedule)."""
        ...

    def recover(self, ref, error: Exception):
        """The future of a call replacing the one behind `ref`, whose worker died; None: the death fails the attempt."""
        ...


class Prompts(Protocol):
    """The job's feed (feed.Feed): the next prompts' batch and the sampler's position."""

    def draw(self, num_prompts: int | None = None) -> DriverBatch: ...

    def state_dict(self) -> dict: ...


class Books(Protocol):
    """The bookkeeping's order (bookkeeping.Bookkeeper)."""

    def later(self, fn: Callable, *args) -> Future: ...


class Counters(Protocol):
    """The dock counters' last read (bookkeeping.DockCounters), which a put must not count."""

    def wait(self) -> None: ...


@dataclass(frozen=True)
class Driver:
    """The driver's side of a schedule for one attempt."""

    recipe: Recipe
    output_dir: Path  # where an in-flight iteration's dock is kept for its retry (checkpoint.py)
    group_size: int  # JobConfig.rows_per_group: rows per prompt group (N, times S where episodes have segments)
    workers: StageWorkers
    feed: Prompts
    books: Books
    counters: Counters
    rows_per_episode: int = 1  # JobConfig.rows_per_episode: S

    @property
    def updates(self) -> tuple[str, ...]:
        """The launched states that train (their spec's `trains`): launched last."""
        return self.recipe.training_states

    @property
    def before_update(self) -> tuple[str, ...]:
        """The launched states that may run before the previous iteration's update (recipe order)."""
        return tuple(s for s in self.recipe.launched_states if s not in self.updates)

    def launch(self, call: StageCall, states: Sequence[str]) -> dict[str, list]:
        """Start each of the recipe's `states` (in that order) with `call`; state -> its futures."""
        return self.workers.launch(call, [self.recipe.spec(state) for state in states])

    def put(self, fed: DriverBatch, bank: TransferDock) -> float:
        """Empty `bank` and put the whole batch into it; returns the seconds it took."""
        started = time.perf_counter()
        bank.reset()
        self.put_groups(torch.arange(len(fed.batch) // self.group_size), fed, bank)
        return time.perf_counter() - started

    def put_groups(self, groups: torch.Tensor, fed: DriverBatch, bank: TransferDock) -> None:
        """The driver's rows of group slots `groups` into `bank`: what every sample of a group shares
        (the prompt) crosses the network once per group, not once per sample (dock/grouping.py)."""
        shared, per_sample = split_group_columns(fed.batch, self.group_size)
        if EPISODE[0] in self.recipe.driver_produces:  # each row's episode, numbered by its dock row
            episodes = group_rows(groups, self.group_size) // self.rows_per_episode  # (k*N*S,)
            if per_sample is None:
                per_sample = TensorDict({}, batch_size=[len(episodes)])
            per_sample[EPISODE[0]] = episodes
        self.counters.wait()
        bank.put_groups(groups, shared, samples=per_sample)

    def read_facts(self, bank: TransferDock, *, num_samples: int) -> SampleFacts:
        """Every sample's facts in `bank` (its response length, its reward before shaping), read
        through the recipe's sample_facts state once the iteration's stages are done. The columns
        stay in the dock, so a resumed iteration reads what its failed attempt's ranks wrote, as a
        fresh one does; samples the staleness bound dropped have none."""
        facts, read = self.recipe.facts, SampleFacts()
        while (got := bank.get(facts.name, list(facts.consumes), batch_size=num_samples)) is not None:
            read.add(got[1])
            if bank.drained:  # the dock said so with those rows: no round trip to hear "exhausted"
                break
        return read
