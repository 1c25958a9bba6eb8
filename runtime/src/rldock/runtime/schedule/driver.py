"""What a schedule calls outside itself (starting states on their workers, drawing prompts, the
bookkeeping's order), the recipe's facts it orders by, and the driver's puts into a dock bank."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from rldock.runtime.algorithms.recipes import Recipe
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.grouping import split_group_columns
from rldock.runtime.sampling import DriverBatch


class Launch(Protocol):
    """`launch(iteration, states, *, sampling_round=0, round_tokens=None)`: starts each of `states`
    (in that order) on its workers and returns state -> the futures of its rank calls."""

    def __call__(
        self, iteration: int, states: Sequence[str], *, sampling_round: int = 0, round_tokens: int | None = None
    ) -> dict[str, list]: ...


@dataclass(frozen=True)
class Driver:
    """The trainer's side of a schedule: fixed for one attempt (one set of workers)."""

    recipe: Recipe
    output_dir: Path  # where an in-flight iteration's dock is kept for its retry (checkpoint.py)
    group_size: int  # algorithm.num_responses_per_prompt: rows per prompt group
    before_update: tuple[str, ...]  # launched states that may run before the previous iteration's update
    updates: tuple[str, ...]  # launched states that train
    launch: Launch
    draw: Callable[..., DriverBatch]  # draw(num_prompts=G): the recipe's batch for the next prompts
    sampler_state: Callable[[], dict]  # the sampler's position now (for a checkpoint)
    finish_rollout: Callable[[int], list]  # partial rollout: each engine's second round of `iteration`
    skip_turns: Callable[[int, list[str]], None]  # a resumed iteration's finished stages give up their turns
    before_put: Callable[[], None]  # waits for the last iteration's dock counters (they must not count a put)
    later: Callable[..., object]  # later(fn, *args): runs fn in the bookkeeping's order (bookkeeping.py)

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
        self.before_put()
        bank.put_groups(groups, shared, samples=per_sample)
