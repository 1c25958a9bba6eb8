"""The driver prepares its inputs in another thread while Ray starts in its own
(driver/inputs.py, `beside_another_thread`): both run at once, and an error in either reaches the
caller without waiting for the other's work."""

from __future__ import annotations

import threading
import time

import pytest

from rldock.runtime.driver.inputs import beside_another_thread

WAIT_S = 30.0  # generous: each wait below ends as soon as the other side acts


def test_the_work_and_the_call_beside_it_run_at_once():
    started, beside_ran = threading.Event(), threading.Event()
    threads = {}

    def work():
        threads["work"] = threading.current_thread()
        started.set()
        # Run one after the other, this would wait for a call that only comes after it: a deadlock.
        assert beside_ran.wait(WAIT_S)
        return "inputs"

    def beside():
        threads["beside"] = threading.current_thread()
        assert started.wait(WAIT_S)
        beside_ran.set()

    assert beside_another_thread(work, beside) == "inputs"
    assert threads["beside"] is threading.current_thread()
    assert threads["work"] is not threading.current_thread() and threads["work"].daemon


def test_an_error_beside_is_raised_without_waiting_for_the_work():
    release = threading.Event()

    def beside():
        raise ValueError("no devices")

    begun = time.monotonic()
    with pytest.raises(ValueError, match="no devices"):
        beside_another_thread(lambda: release.wait(600), beside)
    assert time.monotonic() - begun < WAIT_S
    release.set()


def test_the_works_error_is_raised_after_the_call_beside_ends():
    beside_ended = threading.Event()

    def work():
        raise RuntimeError("bad data")

    with pytest.raises(RuntimeError, match="bad data"):
        beside_another_thread(work, beside_ended.set)
    assert beside_ended.is_set()
