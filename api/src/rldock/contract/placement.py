"""Which worker sits on which device: the placement plan a job's Ray placement group is built from.

One bundle is one device (a whole accelerator resource plus the logical CPUs of the workers on it).
Every actor rank opens a bundle of its own, so tensor-parallel peers and data-parallel replicas
never share a device. A generation replica (`rollout.tensor_parallel_size` consecutive actor ranks)
has one engine, on its first rank, whose TP workers span the replica's devices: one engine per
device at generation TP 1, one engine per g devices at TP g (`engine_devices`). The other device
workers (reference ranks, the critic ranks, the reward model) then fill the devices first fit: with
`resources.placement: colocated` each takes half a device, so a reference rank shares an actor's
device (the MindSpeed RL all-in-one placement) and the critic ranks (one per data-parallel rank,
like the references, but never two on one device: they form a DDP group) and the reward model take
the halves left over (a TP job's actor devices have them) before a new device is opened; with
`separate` every worker takes a whole device.

Pure and config-free: which groups a job seats, how many ranks each and whether two of a group
may share a device are the callers' (the runtime reads them from its worker-state specs,
rldock.runtime.flow.states; the config checks count the same groups). The runtime builds the placement
group from the plan (rldock.runtime.workers.cluster).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

PlacementMode = Literal["colocated", "separate"]

# The share of a device each worker takes in each mode (the actor's too: in colocated mode the
# other half of every actor device is left for a reference rank, a critic or a reward model).
SHARE: dict[str, float] = {"colocated": 0.5, "separate": 1.0}
# Logical CPUs each device worker asks Ray for (Ray then caps its thread pools; see runtime/workers/cluster.py).
CPUS_PER_WORKER = 1


@dataclass(frozen=True)
class Seat:
    """Where one worker runs: its bundle (device) in the placement group and its share of it."""

    bundle: int
    share: float


@dataclass(frozen=True)
class SeatRequest:
    """The ranks of one device worker group besides the actor ranks: `count` ranks named
    "<group> 0", "<group> 1", ...; `distinct` keeps any two of them off one device (they form a
    collective group, which NCCL and HCCL refuse on one device)."""

    group: str
    count: int
    distinct: bool = False


ACTOR_GROUP = "actor"

# The order the non-actor groups take their seats in, first fit: the one table both the runtime (its
# worker-state specs) and the config checks seat by, so the two plans agree seat by seat. A group
# not listed here sits after these, in the order its caller names it.
SEAT_ORDER: tuple[str, ...] = ("reference", "critic", "reward_model")


def in_seat_order(requests: Sequence[SeatRequest]) -> list[SeatRequest]:
    """`requests` sorted by SEAT_ORDER (a stable sort: unlisted groups keep their given order, last)."""
    return sorted(requests, key=lambda r: SEAT_ORDER.index(r.group) if r.group in SEAT_ORDER else len(SEAT_ORDER))


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles (one per device) and the seat of every device worker of a job."""

    accelerator: str  # the Ray resource of one device, e.g. NPU
    bundles: tuple[dict[str, float], ...]
    seats: Mapping[str, tuple[Seat, ...]]  # worker group -> its ranks' seats, the actor ranks first

    @property
    def actors(self) -> tuple[Seat, ...]:
        """The actor ranks' seats, by rank: actor rank i on bundle i."""
        return self.seats[ACTOR_GROUP]

    def group(self, name: str) -> tuple[Seat, ...]:
        """The seats of worker group `name` by rank; () for a group the job does not run."""
        return self.seats.get(name, ())

    @property
    def num_devices(self) -> int:
        return len(self.bundles)

    def engine_devices(self, generation_tp: int) -> tuple[tuple[int, ...], ...]:
        """Per generation replica (in rank order), the bundles its one engine's TP workers use: its
        actor ranks' devices, distinct by construction. Raises ValueError unless `generation_tp`
        divides the actor ranks."""
        if generation_tp < 1 or len(self.actors) % generation_tp:
            raise ValueError(
                f"rollout.tensor_parallel_size={generation_tp} must divide the {len(self.actors)} actor ranks"
            )
        bundles = [seat.bundle for seat in self.actors]
        return tuple(tuple(bundles[start : start + generation_tp]) for start in range(0, len(bundles), generation_tp))

    def workers_on(self, bundle: int) -> list[str]:
        """Names of the workers seated on one bundle, e.g. ['actor 0', 'reference 0']."""
        return [
            f"{group} {rank}"
            for group, seats in self.seats.items()
            for rank, seat in enumerate(seats)
            if seat.bundle == bundle
        ]


def plan_placement(
    *, accelerator: str, num_actor_ranks: int, others: Sequence[SeatRequest] = (), mode: PlacementMode
) -> PlacementPlan:
    """The plan for these workers: actor rank i on device i, then the `others` groups' ranks in
    SEAT_ORDER, first fit (see the module docstring). Raises ValueError for an unknown mode, no actor
    rank or a negative count."""
    if mode not in SHARE:
        raise ValueError(f"unknown placement mode {mode!r}; use one of {sorted(SHARE)}")
    if num_actor_ranks < 1 or any(request.count < 0 for request in others):
        raise ValueError("a placement needs at least one actor rank and no negative count of other ranks")
    share = SHARE[mode]
    used: list[float] = []  # share of each device taken so far
    cpus: list[int] = []

    def open_device() -> int:
        used.append(0.0)
        cpus.append(0)
        return len(used) - 1

    def seat(bundle: int) -> Seat:
        used[bundle] += share
        cpus[bundle] += CPUS_PER_WORKER
        return Seat(bundle=bundle, share=share)

    def first_fit(avoid: frozenset[int] = frozenset()) -> Seat:
        free = next((i for i, taken in enumerate(used) if taken + share <= 1.0 and i not in avoid), None)
        return seat(open_device() if free is None else free)

    seats: dict[str, tuple[Seat, ...]] = {ACTOR_GROUP: tuple(seat(open_device()) for _ in range(num_actor_ranks))}
    for request in in_seat_order(others):
        placed: tuple[Seat, ...] = ()
        for _ in range(request.count):
            avoid = frozenset(s.bundle for s in placed) if request.distinct else frozenset()
            placed += (first_fit(avoid),)
        if placed:
            seats[request.group] = placed
    bundles = tuple({accelerator: 1.0, "CPU": float(n)} for n in cpus)
    return PlacementPlan(accelerator=accelerator, bundles=bundles, seats=seats)
