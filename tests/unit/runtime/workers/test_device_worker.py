"""The integrated device worker (rldock.runtime.workers.device_worker): which seats share a process,
each seat's calls in the order submitted, and a seat waiting inside its call while another seat
of the same process runs the call it waits for (no deadlock), on a local Ray."""

from __future__ import annotations

import pickle
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from rldock.contract.placement import SeatRequest, plan_placement
from rldock.runtime.workers.device_worker import (
    MAX_PENDING_CALLS,
    CallOrder,
    DeviceWorker,
    Role,
    RoleHandle,
    SeatProcess,
    distinct_processes,
    seat_processes,
)

COLLECTIVE = {"actor", "critic"}


def _plan(mode: str, *, actors: int, references: int = 0, critics: int = 0, reward_model: bool = False):
    others = [
        SeatRequest("reference", references),
        SeatRequest("critic", critics, distinct=True),
        SeatRequest("reward_model", int(reward_model)),
    ]
    return plan_placement(accelerator="NPU", num_actor_ranks=actors, others=others, mode=mode)


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        # GRPO DP 2: one process per device, actor rank first
        (
            _plan("colocated", actors=2, references=2),
            [SeatProcess(0, (("actor", 0), ("reference", 0))), SeatProcess(1, (("actor", 1), ("reference", 1)))],
        ),
        # separate: every seat its own device, so its own process
        (
            _plan("separate", actors=2, references=2),
            [
                SeatProcess(0, (("actor", 0),)),
                SeatProcess(1, (("actor", 1),)),
                SeatProcess(2, (("reference", 0),)),
                SeatProcess(3, (("reference", 1),)),
            ],
        ),
        # PPO + reward model, DP 1: the critic and the reward model share the second device's process
        (
            _plan("colocated", actors=1, references=1, critics=1, reward_model=True),
            [
                SeatProcess(0, (("actor", 0), ("reference", 0))),
                SeatProcess(1, (("critic", 0), ("reward_model", 0))),
            ],
        ),
        # PPO DP 2 x TP 2: a critic rank beside an actor rank would be a second process group: its own process
        (
            _plan("colocated", actors=4, references=2, critics=2),
            [
                SeatProcess(0, (("actor", 0), ("reference", 0))),
                SeatProcess(1, (("actor", 1), ("reference", 1))),
                SeatProcess(2, (("actor", 2),)),
                SeatProcess(2, (("critic", 0),)),
                SeatProcess(3, (("actor", 3),)),
                SeatProcess(3, (("critic", 1),)),
            ],
        ),
    ],
)
def test_a_devices_seats_share_a_process_unless_two_form_process_groups(plan, expected):
    processes = seat_processes(plan, collective=COLLECTIVE)
    assert processes == expected
    assert sorted(name for p in processes for name in p.names) == sorted(
        name for bundle in range(plan.num_devices) for name in plan.workers_on(bundle)
    )


def test_one_process_per_device_under_colocated_for_every_algorithms_seats():
    """GRPO, PPO (DP 1 and 2) and a reward model at TP 1: as many processes as devices."""
    for plan in (
        _plan("colocated", actors=2, references=2),
        _plan("colocated", actors=1, references=1, critics=1, reward_model=True),
        _plan("colocated", actors=2, references=2, critics=2, reward_model=True),
    ):
        processes = seat_processes(plan, collective=COLLECTIVE)
        assert [p.bundle for p in processes] == list(range(plan.num_devices))


def test_call_order_runs_a_seats_calls_in_their_numbers_also_after_one_raises():
    order, ran = CallOrder(), []

    def call(number: int) -> None:
        try:
            with order.turn(number):
                ran.append(number)
                if number == 1:
                    raise RuntimeError("the call's own error")
        except RuntimeError:
            pass

    threads = [threading.Thread(target=call, args=(n,)) for n in (3, 1, 2, 0)]  # submitted out of order
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert ran == [0, 1, 2, 3]


class Seat:
    """A seat class keeping what it was given (the test double of a worker class)."""

    def __init__(self, *, dock: dict, tag: str):
        self.dock, self.tag = dock, tag


def test_each_seat_gets_its_own_copy_of_its_arguments():
    """As in processes of their own: a dock client handed to two seats is two clients."""
    dock = {"drained": False}
    worker = DeviceWorker(
        [Role.of("a 0", Seat, {"dock": dock, "tag": "a"}), Role.of("b 0", Seat, {"dock": dock, "tag": "b"})]
    )
    a, b = worker.roles["a 0"], worker.roles["b 0"]
    assert a.dock == b.dock == dock and a.dock is not b.dock and (a.tag, b.tag) == ("a", "b")
    a.dock["drained"] = True
    assert b.dock == {"drained": False}


class ThreadRecorder:
    """A seat recording the thread each of its calls runs in (and the one that built it)."""

    def __init__(self) -> None:
        self.threads, self.values = [threading.get_ident()], []

    def record(self, value: int) -> int:
        self.threads.append(threading.get_ident())
        self.values.append(value)
        return value


def test_a_seats_calls_run_in_the_one_thread_that_built_it_in_their_numbers():
    """Whatever thread of the Ray actor's pool a call arrives in (torch's current device and
    stream, OpenMP's thread count and the allocator's arena are per thread)."""
    worker = DeviceWorker([Role.of("a 0", ThreadRecorder, {}), Role.of("b 0", ThreadRecorder, {})])
    results: dict[int, int] = {}
    callers = [
        threading.Thread(target=lambda n=n: results.update({n: worker.call("a 0", n, "record", n)}))
        for n in (2, 0, 3, 1)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=10)
    a, b = worker.roles["a 0"], worker.roles["b 0"]
    assert results == {0: 0, 1: 1, 2: 2, 3: 3} and a.values == [0, 1, 2, 3]
    assert len(set(a.threads)) == 1 and a.threads[0] != b.threads[0] != threading.get_ident()


def test_a_role_handle_stays_in_the_driver():
    with pytest.raises(TypeError, match="actor 0"):
        pickle.dumps(RoleHandle(object(), "actor 0"))


def test_distinct_processes_counts_a_device_worker_once():
    worker, alone = object(), object()
    handles = [RoleHandle(worker, "actor 0"), RoleHandle(worker, "reference 0"), alone]
    assert distinct_processes(handles) == [worker, alone]


# --- on a local Ray ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_session(start_local_ray) -> Iterator[None]:
    # The roles below live in this test module, which Ray's workers cannot import: ship it by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with start_local_ray(num_cpus=2):
        yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


class Writer:
    """A seat that writes values to a board file (the dock's part)."""

    def __init__(self, *, board: Path):
        self.board = board

    def write(self, value: int) -> int:
        with self.board.open("a") as board:
            board.write(f"{value}\n")
        return value


class Reader:
    """A seat whose call waits inside it for what the Writer seat writes (a stage waiting for its
    inputs, or for its turn)."""

    def __init__(self, *, board: Path):
        self.board = board

    def read(self, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while not self.board.exists() or not self.board.read_text():
            if time.monotonic() > deadline:
                raise TimeoutError("nothing was written")
            time.sleep(0.01)
        return [int(line) for line in self.board.read_text().split()]


def _device_worker(board: Path, max_concurrency: int):
    roles = [Role.of("reader 0", Reader, {"board": board}), Role.of("writer 0", Writer, {"board": board})]
    process = ray.remote(DeviceWorker).options(num_cpus=0, max_concurrency=max_concurrency).remote(roles)
    return process, RoleHandle(process, "reader 0"), RoleHandle(process, "writer 0")


def test_a_seat_waiting_inside_its_call_lets_the_other_seat_run(ray_session, tmp_path):
    """Submitted first, the reader waits for a value the writer's later call writes: the threaded
    device worker runs both, and each seat's own calls in the order submitted."""
    process, reader, writer = _device_worker(tmp_path / "board", MAX_PENDING_CALLS)
    waiting = reader.read.remote(timeout_s=60)
    writes = [writer.write.remote(value) for value in range(5)]
    assert ray.get(writes, timeout=60) == list(range(5))
    assert ray.get(waiting, timeout=60)[0] == 0
    assert ray.get(reader.read.remote(timeout_s=1), timeout=60) == list(range(5))  # in submission order
    ray.kill(process)


def test_one_thread_for_the_seats_of_a_device_would_deadlock(ray_session, tmp_path):
    """Why the device worker is threaded: in one queue the reader's wait holds the writer's call
    back, and the read never returns (it gives up after its own timeout)."""
    process, reader, writer = _device_worker(tmp_path / "board", 1)
    waiting = reader.read.remote(timeout_s=3)
    written = writer.write.remote(0)
    ready, _ = ray.wait([written], timeout=2)
    assert ready == []  # the write is queued behind the read
    with pytest.raises(ray.exceptions.RayTaskError, match="nothing was written"):
        ray.get(waiting, timeout=60)
    assert ray.get(written, timeout=60) == 0
    ray.kill(process)
