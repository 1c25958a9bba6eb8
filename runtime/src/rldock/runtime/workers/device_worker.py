"""The integrated device worker: the seats one device holds, as role objects in one process.

Under `resources.placement: colocated` a device holds several seats of the placement plan (actor
rank d and reference rank d; a critic rank or the reward model beside a TP actor rank). Each seat
used to be a Ray actor of its own: two processes per device, two runtime contexts and two
allocators competing for memory the planner counts as one. Here the seats of a device share one
process (MindSpeed RL's IntegratedWorker, verl's ActorRolloutRefWorker): `DeviceWorker` builds
each seat's worker class (ActorWorker, ReferenceWorker, ...) as a plain object and runs the calls
the trainer makes on it. Under `separate` every device holds one seat, so every process is one
seat's worker, as before: `seat_processes` decides from the plan alone, and nothing else branches
on the placement.

The trainer talks to a hosted seat through a `RoleHandle`, which has the Ray actor handle's shape
(`handle.update.remote(iteration)`), so its stage launches, checkpoints and evaluation do not know
which layout runs.

Concurrency. The trainer launches an iteration's stages at once and each waits inside its call:
for its inputs in the dock, and on a serial phase schedule for its turn on the device
(rldock.runtime.workers.phase_keeper). A one-thread actor would run the hosted seats' calls in one queue, in the
order submitted across seats, and a call waiting for something only a later call of another seat
produces would never return. That happens: the run-ahead schedule with partial rollout queues the
next iteration's reference pass before this iteration's update, and the reference waits for
responses that only the generation's second round (queued after that update, on the actor seat of
the same device) writes. So the device worker is a threaded Ray actor, and each seat has a thread
of its own (`SeatThread`) that runs the seat's calls one at a time in the order the trainer
submitted them (the handle numbers them, `CallOrder` admits them in that order), as its own Ray
actor did. Seats wait and compute in their own threads; what may run at once on the device is
what ran at once in two processes: the serial schedule's turns (on accelerators, by default) give
the device to one phase at a time, the engine's sleep and wake and the training state's swap to
host happening inside the actor's phases; on CPU (`overlap`) the dock alone orders the stages.

One process holds one default torch.distributed group: a device's seats share a process unless
two of them belong to collective groups (the actor ranks' DDP/FSDP/TP group, the critic ranks'),
in which case the second takes a process of its own (PPO with training TP > 1 puts critic rank r
beside an actor rank).

What the seats do not share: their constructor arguments, pickled per seat (`Role`), so each has
its own dock client, as in a process of its own. What they share besides the device: torch's
global RNG (the actor seeds it with seed + rank and the critic with the seed in their
constructors, which run in seat order, so each model starts as in a process of its own; later
draws come from one stream), and the torch thread pool (`training.num_threads` budgets threads
per seat, rldock.runtime.workers.threads; each call sets the count in its own pool thread).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup

from rldock.contract.placement import PlacementPlan
from rldock.runtime.flow.states import WorkerContext, WorkerGroup
from rldock.runtime.workers import cluster

logger = logging.getLogger(__name__)

# Calls one device worker may hold at once, waiting or running. Each waits in a thread of its own:
# a seat's stage calls of one or two iterations (the run-ahead schedule), its turn-taking, and the
# driver's checkpoint and evaluation calls, a dozen at most; the rest is margin.
MAX_PENDING_CALLS = 32


@dataclass(frozen=True)
class SeatProcess:
    """One worker process of the job's device seats: its bundle (device) and its seats, as
    (group, rank) in the plan's seat order."""

    bundle: int
    seats: tuple[tuple[str, int], ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The seats' worker names, as PlacementPlan.workers_on gives them ("actor 0")."""
        return tuple(f"{group} {rank}" for group, rank in self.seats)


def seat_processes(plan: PlacementPlan, *, collective: Collection[str]) -> list[SeatProcess]:
    """The processes that hold the plan's seats, by bundle: a device's seats share one, except
    that no process holds seats of two `collective` groups (each joins a default process group,
    and a process has one); such a seat opens another process on its device."""
    processes: list[SeatProcess] = []
    for bundle in range(plan.num_devices):
        on_device: list[list[tuple[str, int]]] = []
        for group, seats in plan.seats.items():
            for rank, seat in enumerate(seats):
                if seat.bundle != bundle:
                    continue
                home = next(
                    (
                        process
                        for process in on_device
                        if group not in collective or all(other not in collective for other, _ in process)
                    ),
                    None,
                )
                if home is None:
                    on_device.append([(group, rank)])
                else:
                    home.append((group, rank))
        processes += [SeatProcess(bundle, tuple(held)) for held in on_device]
    return processes


class CallOrder:
    """One seat's calls, admitted one at a time in the order they were submitted (numbered 0, 1,
    ...): what Ray guarantees a one-thread actor, kept per seat inside a threaded one."""

    def __init__(self) -> None:
        self._next = 0  # the number of the call whose turn it is
        self._changed = threading.Condition()

    @contextmanager
    def turn(self, number: int) -> Iterator[None]:
        """Run the body once every call numbered before `number` has finished (raised or not)."""
        with self._changed:
            self._changed.wait_for(lambda: self._next == number)
        try:
            yield
        finally:
            with self._changed:
                self._next += 1
                self._changed.notify_all()


@dataclass(frozen=True)
class Role:
    """A seat as the device worker builds it: its worker name, class and constructor arguments.

    The arguments are pickled apart from the other seats' (`Role.of`), so each seat unpickles
    objects of its own, as its own process did: a dock client (DockBanks) keeps per-reader state,
    the seconds it waited and whether its rank's share is drained, which two seats must not share
    (one seat's stage loop would stop when the other's share ran out)."""

    name: str  # "actor 0"
    cls: type
    pickled_arguments: bytes

    @classmethod
    def of(cls, name: str, worker: type, arguments: Mapping[str, Any]) -> Role:
        return cls(name, worker, ray.cloudpickle.dumps(dict(arguments)))

    def arguments(self) -> dict[str, Any]:
        """The constructor arguments, a copy of their own at each call."""
        return ray.cloudpickle.loads(self.pickled_arguments)

    def build(self) -> Any:
        return self.cls(**self.arguments())


class SeatThread:
    """One seat's worker object and the one thread that builds it and runs its calls, one at a
    time in the order they were submitted, as a one-thread Ray actor of its own did.

    One thread per seat, not whichever of the Ray actor's pool threads a call lands on: torch keeps
    the current device and stream per thread, OpenMP its thread count, and the C allocator an arena
    per thread (calls spread over the pool's threads grew a SmolLM2 device worker's memory with
    every iteration)."""

    def __init__(self, role: Role):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=role.name)
        self._order = CallOrder()
        self.worker = self._thread.submit(role.build).result()

    def call(self, number: int, method: str, args: tuple, kwargs: dict):
        """`method(*args, **kwargs)` on the seat's worker, after its calls numbered before `number`."""
        with self._order.turn(number):  # enters the thread's queue in submission order
            done = self._thread.submit(self._run, method, args, kwargs)
        return done.result()

    def _run(self, method: str, args: tuple, kwargs: dict):
        # OpenMP keeps its thread count per thread, and a thread starts from OMP_NUM_THREADS (the Ray
        # actor's CPUs), not from the count a seat set (threads.py) in its own thread; vLLM's CPU
        # attention reads the count when it plans a batch and again in its kernel, and refuses two
        # different counts. Every call runs with the process's torch count.
        torch.set_num_threads(torch.get_num_threads())
        return getattr(self.worker, method)(*args, **kwargs)


class DeviceWorker:
    """Ray actor (threaded, `MAX_PENDING_CALLS`): the seats of one device, each a plain object in a
    thread of its own (`SeatThread`), built in seat order; `call` runs a method of one of them."""

    def __init__(self, roles: Sequence[Role]):
        self._seats = {role.name: SeatThread(role) for role in roles}
        self.roles: dict[str, Any] = {name: seat.worker for name, seat in self._seats.items()}
        logger.info("device worker holding %s", ", ".join(self.roles))

    def call(self, role: str, number: int, method: str, *args, **kwargs):
        """`role`'s `method(*args, **kwargs)`, once its calls numbered before `number` finished."""
        return self._seats[role].call(number, method, args, kwargs)


class RoleHandle:
    """The trainer's handle on one seat of a device worker, shaped like the seat's own Ray actor
    handle: `handle.method.remote(*args, **kwargs)` returns the call's ObjectRef.

    It numbers the seat's calls as they are submitted (`CallOrder`), so it stays in the process
    that made it: pickling it (a second numbering) is refused."""

    def __init__(self, process, role: str):
        self.process, self.role = process, role  # the DeviceWorker's Ray actor handle; "actor 0"
        self._numbers = itertools.count()
        self._submitting = threading.Lock()  # a number is taken and its call submitted together

    def submit(self, method: str, args: tuple, kwargs: dict):
        with self._submitting:
            return self.process.call.remote(self.role, next(self._numbers), method, *args, **kwargs)

    def __getattr__(self, method: str) -> _RemoteMethod:
        if method.startswith("_"):  # not a worker method: copy, pickle and hasattr probes
            raise AttributeError(method)
        return _RemoteMethod(self, method)

    def __reduce__(self):
        raise TypeError(f"the handle of {self.role} numbers its calls in the driver and cannot be pickled")

    def __repr__(self) -> str:
        return f"RoleHandle({self.role!r})"


@dataclass(frozen=True)
class _RemoteMethod:
    handle: RoleHandle
    method: str

    def remote(self, *args, **kwargs):
        return self.handle.submit(self.method, args, kwargs)


def start_device_seats(
    groups: Mapping[str, WorkerGroup], context: WorkerContext, *, plan: PlacementPlan, placement: PlacementGroup
) -> dict[str, list]:
    """Start the workers of the device groups in `groups` on their seats of `plan`: one process per
    `seat_processes` entry, a seat's own worker class where it holds one seat, else a DeviceWorker
    holding them. Returns group name -> its workers' handles by rank (Ray actor handles or
    RoleHandles)."""
    collective = {name for name, group in groups.items() if group.joins_group(context.cfg)}
    handles: dict[str, dict[int, Any]] = {name: {} for name in groups}
    for process in seat_processes(plan, collective=collective):
        seats = [plan.group(group)[rank] for group, rank in process.seats]
        workers = [
            (groups[group].worker_class(), groups[group].arguments(context, rank, len(plan.group(group))))
            for group, rank in process.seats
        ]
        if len(workers) == 1:
            [(group, rank)], [(worker, arguments)] = process.seats, workers
            handles[group][rank] = cluster.seated(worker, group=placement, plan=plan, seat=seats[0]).remote(**arguments)
            continue
        roles = [Role.of(name, worker, arguments) for name, (worker, arguments) in zip(process.names, workers)]
        device_worker = cluster.seated_together(
            DeviceWorker, group=placement, plan=plan, seats=seats, max_concurrency=MAX_PENDING_CALLS
        ).remote(roles)
        for (group, rank), role in zip(process.seats, roles):
            handles[group][rank] = RoleHandle(device_worker, role.name)
    return {name: [by_rank[rank] for rank in sorted(by_rank)] for name, by_rank in handles.items()}


def distinct_processes(handles: Sequence) -> list:
    """The Ray actors behind `handles`, each once: the seats a device worker holds share one."""
    processes: list = []
    for handle in handles:
        process = handle.process if isinstance(handle, RoleHandle) else handle
        if not any(process is known for known in processes):
            processes.append(process)
    return processes
