"""Enforcing the serial phase schedule (rldock.runtime.workers.phase_schedule): a turn keeper per job and
the turn a worker takes around each of its stage calls.

The keeper is one async Ray actor holding every shared device's schedule. A worker asks it for
its turn (`wait_turn`), runs its phase and reports it done (`done`, also when the phase raised, so
a failing job stops with its own error instead of its device waiting forever). The keeper grants a
phase on a device once every earlier phase of the iteration there is done (or skipped: stages a
resumed iteration does not run again), and keeps the iteration's timeline of phases for the
metrics. One keeper per job, not per node: two small round trips per phase and worker, against
phases that take seconds on the devices this is for. A restarted job (trainer retry, resume)
starts a new keeper with its new workers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
from ray.actor import ActorHandle

from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.flow.states import StageCall, WorkerState
from rldock.runtime.startup import timed
from rldock.runtime.workers.phase_schedule import Turn, job_schedules, resolve_phase_schedule, worker_devices

if TYPE_CHECKING:
    from rldock.config import JobConfig
    from rldock.runtime.device import DeviceInfo

logger = logging.getLogger(__name__)


class TurnKeeper:
    """Async Ray actor: grants each shared device's phases in its schedule's order, per iteration.

    Iterations are sequential (a synchronous job launches an iteration once the last one finished),
    so the keeper keeps only the newest iteration's progress and timeline.
    """

    def __init__(self, schedules: Mapping[int, tuple[Turn, ...]]):
        self.schedules = dict(schedules)
        self._iteration = 0
        self._done: dict[tuple[int, str], set[str]] = {}  # (device, phase) -> workers done with it
        self._skipped: set[str] = set()
        self._timeline: list[dict] = []
        self._changed = asyncio.Condition()

    def _at(self, iteration: int) -> None:
        if iteration > self._iteration:  # a new iteration: the last one's phases all finished
            self._iteration, self._done, self._skipped, self._timeline = iteration, {}, set(), []

    def _finished(self, device: int, turn: Turn) -> bool:
        return turn.phase in self._skipped or set(turn.workers) <= self._done.get((device, turn.phase), set())

    def _my_turn(self, device: int, phase: str) -> bool:
        for turn in self.schedules[device]:
            if turn.phase == phase:
                return True
            if not self._finished(device, turn):
                return False
        raise AssertionError("unreachable: wait_turn checked the phase is scheduled")

    async def wait_turn(self, device: int, iteration: int, phase: str) -> None:
        if phase not in {turn.phase for turn in self.schedules.get(device, ())}:
            raise ValueError(f"phase {phase!r} is not in device {device}'s schedule")
        async with self._changed:
            self._at(iteration)
            await self._changed.wait_for(lambda: self._my_turn(device, phase))

    async def done(self, device: int, iteration: int, phase: str, worker: str, start: float, end: float) -> None:
        async with self._changed:
            self._at(iteration)
            self._done.setdefault((device, phase), set()).add(worker)
            self._timeline.append({"device": device, "phase": phase, "worker": worker, "start": start, "end": end})
            self._changed.notify_all()

    async def skip(self, iteration: int, phases: list[str]) -> None:
        """Phases a resumed iteration does not run again: done on every device."""
        async with self._changed:
            self._at(iteration)
            self._skipped.update(phases)
            self._changed.notify_all()

    async def timeline(self, iteration: int) -> list[dict]:
        """The iteration's phases in the order they finished, start and end in seconds after the
        first start (wall clock of the workers' nodes)."""
        if iteration != self._iteration or not self._timeline:
            return []
        origin = min(entry["start"] for entry in self._timeline)
        return [
            {**entry, "start": round(entry["start"] - origin, 6), "end": round(entry["end"] - origin, 6)}
            for entry in self._timeline
        ]


def start_keeper(schedules: Mapping[int, tuple[Turn, ...]]):
    """A TurnKeeper for these schedules, as a Ray actor outside the placement group (no CPU: it
    only waits)."""
    return ray.remote(timed(TurnKeeper)).options(num_cpus=0, max_restarts=0).remote(schedules)


@dataclass(frozen=True)
class DeviceTurns:
    """What one worker needs to take its turns: the keeper, its device and its scheduled phases."""

    keeper: ActorHandle  # the job's TurnKeeper
    device: int
    worker: str
    phases: frozenset[str]

    @contextmanager
    def turn(self, iteration: int, phase: str) -> Iterator[float]:
        """Run the body in `phase`'s turn on this worker's device (at once for an unscheduled phase);
        yields the seconds it waited for the turn."""
        if phase not in self.phases:
            yield 0.0
            return
        asked = time.perf_counter()
        ray.get(self.keeper.wait_turn.remote(self.device, iteration, phase))
        waited = time.perf_counter() - asked
        start = time.time()
        try:
            yield waited
        finally:
            ray.get(self.keeper.done.remote(self.device, iteration, phase, self.worker, start, time.time()))


class TakesTurns:
    """Mixin for device workers: `take_turns` hands them their DeviceTurns; stage methods decorated
    with `in_turn(spec)` then run in their turn. Needs `self.cfg` and `self.device` (DeviceInfo)."""

    cfg: JobConfig  # set by the worker's __init__
    device: DeviceInfo  # set by the worker's __init__
    _turns: DeviceTurns | None = None

    def runs_serial(self) -> bool:
        """Whether the job's phase_schedule resolves to serial on this worker's device (the driver
        may not see the devices, so `auto` is resolved here)."""
        cfg = self.cfg
        return (
            resolve_phase_schedule(
                cfg.resources.phase_schedule,
                device_kind=self.device.kind,
                placement=cfg.resources.placement,
                mode=cfg.training.mode,
            )
            == "serial"
        )

    def take_turns(self, turns: DeviceTurns) -> None:
        self._turns = turns


def in_turn(spec: WorkerState):
    """Decorate a stage method `(self, call: StageCall)` of a TakesTurns worker to run in the turn
    of `spec`'s phase (its state's name) in the call's iteration."""
    phase = spec.name

    def decorate(method):
        @functools.wraps(method)
        def wrapper(self, call: StageCall):
            if self._turns is None:
                return method(self, call)
            with self._turns.turn(call.iteration, phase) as waited:
                result = method(self, call)
            if isinstance(result, StageResult):  # a stage's idle time includes its turn's wait
                result.wait_s += waited
            return result

        return wrapper

    return decorate


def hand_out_turns(cfg, plan, recipe, workers) -> ActorHandle | None:
    """Start the job's TurnKeeper and give every device worker on a shared device its DeviceTurns;
    returns the keeper, or None when nothing is scheduled (phase_schedule overlap or `auto` on CPU, an
    async job, or no device shared). `workers` is the trainer's WorkerGroups."""
    if cfg.resources.phase_schedule == "overlap" or cfg.training.mode != "sync":
        return None
    schedules = job_schedules(plan, recipe, generation_tp=cfg.rollout.tensor_parallel_size)
    if not schedules:
        return None
    handles = {f"{group} {rank}": handle for group, ranks in workers.ranks.items() for rank, handle in enumerate(ranks)}
    devices = worker_devices(plan)
    shared = {name: handle for name, handle in handles.items() if devices.get(name) in schedules}
    serial = dict(zip(shared, ray.get([handle.runs_serial.remote() for handle in shared.values()])))
    if len(set(serial.values())) > 1:  # a worker left out would never mark its phases done
        raise RuntimeError(
            f"resources.phase_schedule {cfg.resources.phase_schedule!r} resolved differently on "
            f"the workers' devices ({serial}); set resources.device or phase_schedule explicitly"
        )
    if not any(serial.values()):  # `auto` on CPU: overlap
        return None
    keeper = start_keeper(schedules)
    ray.get(keeper.timeline.remote(0))  # started now, not inside the first iteration's timing
    ray.get(
        [
            handle.take_turns.remote(
                DeviceTurns(
                    keeper,
                    devices[name],
                    name,
                    frozenset(turn.phase for turn in schedules[devices[name]] if name in turn.workers),
                )
            )
            for name, handle in shared.items()
        ]
    )
    logger.info(
        "serial phase schedule: %s",
        "; ".join(
            f"device {device}: " + " -> ".join(f"{turn.phase} ({', '.join(turn.workers)})" for turn in turns)
            for device, turns in schedules.items()
        ),
    )
    return keeper
