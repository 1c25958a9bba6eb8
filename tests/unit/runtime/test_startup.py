"""rldock.runtime.startup: a timed actor class reports its process's CPU before, in and after its
constructor; the first record's timing/startup sums the processes by kind; start-up's pauses of the
cyclic collector nest and end."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from rldock.runtime.startup import (
    PHASES,
    DriverClock,
    ProcessStartup,
    collections_paused,
    pause_collections,
    startup_line,
    startup_timing,
    timed,
)


def _spin(seconds: float) -> None:
    """Spend `seconds` of this process's CPU time."""
    until = time.process_time() + seconds
    while time.process_time() < until:
        pass


class Worker:
    """A worker whose constructor and first call take CPU."""

    def __init__(self, value: int, *, spin_s: float) -> None:
        _spin(spin_s)
        self.value = value

    def work(self, spin_s: float) -> int:
        _spin(spin_s)
        return self.value


def test_a_timed_class_is_the_class_with_its_start_up_measured():
    Timed = timed(Worker)
    assert Timed.__name__ == "Worker" and issubclass(Timed, Worker) and Timed.__doc__ == Worker.__doc__
    before = time.process_time()
    worker = Timed(7, spin_s=0.05)
    assert worker.value == 7  # the constructor ran, with its arguments
    worker.work(0.03)
    report = worker.startup()
    assert report.kind == "Worker"
    # CPU before the constructor: everything this process did until then
    assert before <= report.before_init_cpu <= before + 0.01
    assert report.init_cpu >= 0.05 and report.setup_cpu >= 0.03
    assert report.init_cpu < 0.05 + 0.05 and report.setup_cpu < 0.03 + 0.05  # what ran, not more


def test_the_actor_s_signature_is_its_class_s():
    """Ray checks a call's arguments against the constructor's signature before it starts a process."""
    import inspect

    assert inspect.signature(timed(Worker).__init__) == inspect.signature(Worker.__init__)


def test_start_up_is_summed_by_kind():
    processes = [
        ProcessStartup("driver", before_init_cpu=5.0, init_cpu=3.0, setup_cpu=1.0),
        ProcessStartup("DeviceWorker", before_init_cpu=7.0, init_cpu=0.25, setup_cpu=8.0),
        ProcessStartup("DeviceWorker", before_init_cpu=6.0, init_cpu=0.25, setup_cpu=9.0),
    ]
    timing = startup_timing(processes, wall=30.0)
    assert timing["wall"] == 30.0
    assert timing["cpu"] == pytest.approx(39.5)
    assert timing["DeviceWorker"] == {"processes": 2, "before_init_cpu": 13.0, "init_cpu": 0.5, "setup_cpu": 17.0}
    assert timing["driver"] == {"processes": 1, "before_init_cpu": 5.0, "init_cpu": 3.0, "setup_cpu": 1.0}
    assert set(timing["driver"]) == {"processes", *PHASES}


def test_the_driver_s_clock_counts_the_wall_time_from_its_process_s_start():
    """Read in a fresh interpreter, so the bound is that process's life as this test saw it (the
    suite's own process may have started an hour before)."""
    code = "from rldock.runtime.startup import DriverClock; print(DriverClock.start().wall_since_start())"
    started = time.time()
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    lived = time.time() - started
    # the kernel records a process's start in clock ticks (10 ms), psutil rounds it to 10 ms
    assert -0.02 <= float(printed) <= lived + 0.02


def test_the_driver_s_clock_splits_imports_inputs_and_the_rest():
    clock = DriverClock.start()
    _spin(0.05)
    clock.inputs_ready()
    _spin(0.03)
    driver = clock.driver_startup()
    assert driver.kind == "driver" and driver.before_init_cpu == clock.imported_cpu
    assert 0.05 <= driver.init_cpu < 0.1 and 0.03 <= driver.setup_cpu < 0.08


def test_only_the_run_s_first_attempt_reads_the_start_up():
    """A restart's processes are a retry's cost, not the job's start: the clock is read once."""
    clock = DriverClock.start()
    assert clock.read_once() and not clock.read_once() and not clock.read_once()


def test_the_log_line_gives_each_kind_s_cpu():
    timing = startup_timing(
        [
            ProcessStartup("driver", before_init_cpu=5.0, init_cpu=3.0, setup_cpu=1.0),
            ProcessStartup("DeviceWorker", before_init_cpu=7.0, init_cpu=0.5, setup_cpu=8.0),
            ProcessStartup("DeviceWorker", before_init_cpu=6.0, init_cpu=0.5, setup_cpu=9.0),
        ],
        wall=30.0,
    )
    assert startup_line(timing) == (
        "30.0 s to the first iteration, 40.0 CPU seconds: DeviceWorker 31.0 (2 processes), driver 9.0"
    )


@pytest.fixture
def collecting() -> Iterator[None]:
    """The collector on, as in a fresh process, and as found afterwards."""
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_collections_pause_inside_and_nest(collecting):
    with collections_paused():
        assert not gc.isenabled()
        with collections_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause is still under way
    assert gc.isenabled()


def test_a_pause_leaves_a_collector_that_was_off_off(collecting):
    gc.disable()
    with collections_paused():
        pass
    assert not gc.isenabled()


def test_overlapping_pauses_of_two_threads_resume_when_the_last_ends(collecting):
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def second() -> None:
        first_in.wait()
        with collections_paused():
            second_in.set()
            first_out.wait()
            seen.append(gc.isenabled())

    thread = threading.Thread(target=second)
    thread.start()
    with collections_paused():
        first_in.set()
        second_in.wait()
    first_out.set()
    thread.join()
    assert seen == [False]  # the first thread's pause had ended, the second's had not
    assert gc.isenabled()


def test_a_worker_s_pause_ends_with_its_actor_s_constructor_even_one_that_fails(collecting):
    class Failing:
        def __init__(self) -> None:
            raise ValueError("no model")

    pause_collections()  # Ray's worker set-up hook, at the process's start
    worker = timed(Worker)(1, spin_s=0)
    assert gc.isenabled() and worker.value == 1
    pause_collections()
    with pytest.raises(ValueError, match="no model"):
        timed(Failing)()
    assert gc.isenabled()
    timed(Worker)(2, spin_s=0)  # no pause under way: the constructor's end changes nothing
    assert gc.isenabled()
