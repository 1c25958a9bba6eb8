"""Which heavy phase runs when on a shared device: the per-device phase schedule of one iteration.

With `resources.placement: colocated` two workers share a device (actor rank d and reference rank
d; the critic or the reward model beside a TP actor rank) and, since all stages start together and
wait on the dock, their phases would overlap on it. Under a `serial` schedule (resources.phase_schedule)
a worker runs a phase (its whole stage call for the iteration) only when its device's schedule has
reached it.

Why one global order and not a lock per device: phases hold cross-device collectives (the DDP
all-reduce of the update, TP all-reduces and FSDP all-gathers in forward passes), so "whoever takes
the device first" deadlocks (critic 0 holds device 0 and all-reduces with critic 1, which waits for
device 1 held by actor 1, which all-reduces with actor 0, which waits for device 0). Every device
instead follows the same order of the iteration's phases, one topological order of the recipe's
dataflow restricted to the phases of the workers on that device: all ranks of a collective reach
their phase together, and a phase's inputs come from phases earlier in the order, so every device
can always progress. Workers that share one phase on one device run it together.

Pure: the trainer builds the schedule from the placement plan and the job's recipe
(rldock.runtime.workers.phase_keeper enforces it); unit-tested in tests/unit/runtime/workers/test_phase_schedule.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from rldock.contract.placement import PlacementPlan
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import runner_names

PhaseSchedule = Literal["serial", "overlap"]
ACCELERATOR_KINDS = ("npu", "cuda")


def resolve_phase_schedule(setting: str, *, device_kind: str, placement: str, mode: str) -> PhaseSchedule:
    """resources.phase_schedule as a worker on `device_kind` applies it: `auto` is serial on
    accelerators with colocated placement in a synchronous job, overlap otherwise (on CPU each
    worker's thread budget is its compute share; under `separate` no device is shared)."""
    if setting == "serial":
        return "serial"
    if setting == "overlap":
        return "overlap"
    serial = device_kind in ACCELERATOR_KINDS and placement == "colocated" and mode == "sync"
    return "serial" if serial else "overlap"


def phase_order(recipe: Recipe) -> tuple[str, ...]:
    """The iteration's launched states in one topological order of the dataflow: the launch order
    (each Ray actor runs its calls in that order) where the dataflow allows it, a state moved after
    the producers of the columns it reads where not (PPO's advantage after the critic's values).
    States of the sampling rounds (DAPO) run before the others start and are not in it."""
    trains = recipe.training_states  # launched after the others (their spec's `trains`), so they come last
    launched = [s for s in recipe.launched_states if s not in trains] + list(trains)
    producer = {column: state for state, columns in recipe.produces.items() if state in launched for column in columns}
    needs = {state: {producer[c] for c in recipe.consumes[state] if c in producer} - {state} for state in launched}
    order: list[str] = []
    while len(order) < len(launched):
        ready = next((s for s in launched if s not in order and needs[s] <= set(order)), None)
        if ready is None:
            raise ValueError(
                f"recipe {recipe.name!r}: its states {sorted(set(launched) - set(order))} "
                "read each other's columns; there is no order to run them in"
            )
        order.append(ready)
    return tuple(order)


def state_runners(plan: PlacementPlan, recipe: Recipe, *, generation_tp: int = 1) -> dict[str, tuple[str, ...]]:
    """State -> names of the device workers that run it (names as PlacementPlan.workers_on gives
    them), from each launched state's spec: every rank of its worker group (under LoRA the reference
    pass's group is the actor's), or each generation replica's first actor rank (every
    `generation_tp`-th) for the rollout. States whose workers hold no device are not scheduled."""
    runners = {
        state: runner_names(plan, recipe.spec(state), generation_tp=generation_tp) for state in recipe.launched_states
    }
    return {state: names for state, names in runners.items() if names}


@dataclass(frozen=True)
class Turn:
    """One phase on one device and the workers there that run it (together)."""

    phase: str
    workers: tuple[str, ...]


def device_schedules(
    plan: PlacementPlan, order: tuple[str, ...], runners: Mapping[str, tuple[str, ...]]
) -> dict[int, tuple[Turn, ...]]:
    """Device (bundle) -> its turns in `order`, for every device that more than one worker shares;
    a device with one worker has nothing to schedule."""
    schedules = {}
    for device in range(plan.num_devices):
        seated = plan.workers_on(device)
        if len(seated) < 2:
            continue
        turns = tuple(
            Turn(phase, workers)
            for phase in order
            if (workers := tuple(w for w in runners.get(phase, ()) if w in seated))
        )
        if turns:
            schedules[device] = turns
    return schedules


def job_schedules(plan: PlacementPlan, recipe: Recipe, *, generation_tp: int = 1) -> dict[int, tuple[Turn, ...]]:
    """The job's serial schedule: device -> its turns per iteration."""
    return device_schedules(plan, phase_order(recipe), state_runners(plan, recipe, generation_tp=generation_tp))


def worker_devices(plan: PlacementPlan) -> dict[str, int]:
    """Worker name -> its device (bundle)."""
    return {name: device for device in range(plan.num_devices) for name in plan.workers_on(device)}
