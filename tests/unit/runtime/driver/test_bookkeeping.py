"""The driver's bookkeeping runs in submission order, in the background or at once, and no failure
in the background is lost: it raises where the driver waits."""

from __future__ import annotations

import threading

import pytest

from rldock.runtime.driver.bookkeeping import Bookkeeper


def test_background_calls_run_in_order_off_the_callers_thread():
    keeper = Bookkeeper(background=True)
    release, order, threads = threading.Event(), [], set()

    def step(n):
        if n == 0:
            release.wait(timeout=10)  # the driver goes on while the first call is still running
        order.append(n)
        threads.add(threading.get_ident())
        return n

    futures = [keeper.later(step, n) for n in range(5)]
    assert not futures[-1].done()
    release.set()
    keeper.close()
    assert order == [0, 1, 2, 3, 4] and [f.result() for f in futures] == order
    assert threading.get_ident() not in threads


def _fail() -> None:
    raise OSError("disk full")


def _failing_then_writing() -> tuple[Bookkeeper, list[str]]:
    """A background keeper asked for a call that fails, then for a record's write."""
    keeper, written = Bookkeeper(background=True), []
    keeper.later(_fail)
    keeper.later(written.append, "record 2")
    return keeper, written


def test_a_background_failure_raises_where_the_driver_waits_and_later_calls_still_run():
    keeper, written = _failing_then_writing()
    with pytest.raises(OSError, match="disk full"):
        keeper.close()
    assert written == ["record 2"]


def test_inline_calls_run_at_once_and_raise_there():
    keeper = Bookkeeper(background=False)
    assert keeper.later(lambda: threading.get_ident()).result() == threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        keeper.later(lambda: 1 / 0)
    keeper.close()


def test_closing_on_the_loops_own_failure_logs_a_bookkeeping_error_instead_of_raising_it(caplog):
    # The loop's error is the one the driver's retry must see; the bookkeeping's is only logged.
    keeper, written = _failing_then_writing()
    keeper.close(raise_errors=False)
    assert written == ["record 2"]
    assert "bookkeeping call failed" in caplog.text and "disk full" in caplog.text
