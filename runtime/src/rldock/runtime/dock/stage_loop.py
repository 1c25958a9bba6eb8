"""The loop every worker runs for one iteration: ask the controller, read, compute, write back.

The dock's consumer side: the workers and the parts they are built from (the training backends)
run it from here, so none of those parts imports the workers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from rldock.runtime.dock import TransferDock


class StageSpec(Protocol):
    """What the loop reads of a worker state's spec (rldock.runtime.flow.states.WorkerState): the dock
    state it asks for and the columns it reads."""

    @property
    def name(self) -> str: ...

    @property
    def consumes(self) -> tuple[str, ...]: ...


# (indices (B,), batch) -> output columns for those indices, or None when the stage writes nothing
StageFn = Callable[[torch.Tensor, TensorDict], TensorDict | None]


@dataclass
class StageResult:
    """What one rank's call of a stage returns to the driver: the seconds it spent waiting for its
    inputs to become ready (and for its device turn), moving data through the dock (requests,
    reads, writes) and computing, the samples it took, and its own metrics by name (training
    metrics, the reward terms' sums, the passes' `computed` tally, the rollout's decode steps and
    counts). Per-sample facts never travel here: they are dock columns the driver reads
    (states.SAMPLE_FACTS). metrics.iteration_record builds the iteration's record from these."""

    wait_s: float = 0.0
    dispatch_s: float = 0.0
    compute_s: float = 0.0
    num_samples: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)

    def with_metrics(self, **metrics: Any) -> StageResult:
        """This result with `metrics` added (a stage's return statement)."""
        self.metrics.update(metrics)
        return self


def run_stage(
    dock: TransferDock,
    spec: StageSpec,
    fn: StageFn,
    *,
    rank: int,
    batch_size: int,
    whole_groups: bool = False,
    balance_ranks: int = 0,
    max_batches: int | None = None,
    timeout_s: float | None = None,
    policy_version: int | None = None,
) -> StageResult:
    """Consume batches of `spec`'s state (its `consumes` columns) until the dock says the
    iteration's samples are exhausted.

    `max_batches` lets a consumer that must get exactly its share (the DP ranks of the update)
    stop without draining samples meant for its peers; `balance_ranks` asks the dock to deal the
    samples over that many ranks with about equal token counts (see TransferDock.get);
    `policy_version` tags what this stage writes with the weights' version (the rollout's).
    Between two batches a rank writes what it made and asks for its next samples in one call
    (TransferDock.put_and_get).
    """
    timing = StageResult()
    request = {
        "rank": rank,
        "batch_size": batch_size,
        "whole_groups": whole_groups,
        "balance_ranks": balance_ranks,
        "timeout_s": timeout_s,
    }
    columns = list(spec.consumes)

    def moved(move: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`move(*args, **kwargs)` (dock traffic), its seconds booked as waiting for samples or as dispatch."""
        start, waited_before = time.perf_counter(), dock.waited_s
        result = move(*args, **kwargs)
        waited = dock.waited_s - waited_before
        timing.wait_s += waited
        timing.dispatch_s += time.perf_counter() - start - waited
        return result

    got = None if max_batches == 0 else moved(dock.get, spec.name, columns, **request)
    num_batches = 0
    while got is not None:
        indices, batch = got
        start = time.perf_counter()
        out = fn(indices, batch)
        timing.compute_s += time.perf_counter() - start
        timing.num_samples += len(indices)
        num_batches += 1
        # The dock said those were the last samples for this rank (no round trip to hear so), or
        # the rank has its share: write what it made and stop. Otherwise the write and the next
        # request are one call to the controllers.
        last = dock.drained or (max_batches is not None and num_batches >= max_batches)
        if out is None:
            got = None if last else moved(dock.get, spec.name, columns, **request)
        elif last:
            moved(dock.put, indices, out, policy_version=policy_version)
            got = None
        else:
            got = moved(dock.put_and_get, indices, out, spec.name, columns, policy_version=policy_version, **request)
    return timing
