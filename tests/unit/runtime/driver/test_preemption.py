"""rldock.runtime.driver.preemption: a first SIGTERM asks the run to stop (the process goes on), a
second goes to the handler installed before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rldock.runtime.driver.preemption import (
    EXIT_CODE,
    Preempted,
    StopRequest,
    drivers_here,
    is_driver,
    stop_drivers,
)


@pytest.fixture
def restored_sigterm():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_first_sigterm_asks_a_second_goes_to_the_handler_before(restored_sigterm):
    before: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: before.append(signum))
    stop = StopRequest()
    stop.install()
    assert not stop.requested
    os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode of this thread
    assert stop.requested and before == []
    with pytest.raises(SystemExit) as exited:
        os.kill(os.getpid(), signal.SIGTERM)
    assert before == [signal.SIGTERM] and exited.value.code == EXIT_CODE == 143
    assert signal.getsignal(signal.SIGTERM) is not stop._on_signal  # given back


def test_outside_the_main_thread_nothing_is_installed(restored_sigterm):
    installed = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=StopRequest().install)
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGTERM) is installed


def test_the_stop_names_the_iteration_and_the_way_on():
    assert "after iteration 7" in str(Preempted(7)) and "--resume" in str(Preempted(7))


def test_a_driver_is_rldock_train_however_it_was_started():
    assert is_driver(["/usr/bin/python3", "/usr/local/bin/rldock", "train", "/etc/rldock/job.yaml", "--resume"])
    assert is_driver(["python", "-m", "rldock.runtime.cli", "train", "job.yaml"])
    assert not is_driver(["/usr/local/bin/rldock", "validate", "job.yaml"])
    assert not is_driver(["/bin/sh", "-c", "rldock train /etc/rldock/job.yaml --output /o"])  # the Ray job's shell
    assert not is_driver(["ray", "start", "--head"])


# A stand-in driver: it checkpoints for 0.5 s on SIGTERM, then exits as `rldock train` does (143).
_DRIVER = """
import signal, sys, time
def stop(*_):
    time.sleep(0.5)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_preempt_finds_the_drivers_signals_them_and_waits_until_they_exit():
    """`rldock preempt`, the head pod's preStop hook. The signal goes to the stand-in's pid only: the unit tier
    runs beside the job tiers, whose real drivers this machine also holds."""
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, "rldock.runtime.cli", "train", "job.yaml"], stdout=subprocess.PIPE, text=True
    )
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "rldock.runtime.cli", "validate"])
    try:
        assert driver.stdout is not None and driver.stdout.readline() == "ready\n"  # its handler is installed
        found = drivers_here()
        assert driver.pid in found and other.pid not in found
        started = time.monotonic()
        signalled, running = stop_drivers(30, pids=[driver.pid], poll_s=0.05)
        assert (signalled, running) == ([driver.pid], []) and time.monotonic() - started >= 0.5  # it waited
        assert driver.wait(timeout=30) == EXIT_CODE and other.poll() is None
    finally:
        for process in (driver, other):
            process.kill()
            process.wait()


def test_a_driver_that_outlives_the_timeout_is_reported_running():
    stuck = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)",
            "rldock.runtime.cli",
            "train",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stuck.stdout is not None and stuck.stdout.readline() == "ready\n"
        assert stop_drivers(0.3, pids=[stuck.pid], poll_s=0.05) == ([stuck.pid], [stuck.pid])
    finally:
        stuck.kill()
        stuck.wait()
