"""rldock.runtime.driver.preemption: a first SIGTERM asks the run to stop (the process goes on), a
second goes to the handler installed before."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from rldock.runtime.driver.preemption import EXIT_CODE, Preempted, StopRequest


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
