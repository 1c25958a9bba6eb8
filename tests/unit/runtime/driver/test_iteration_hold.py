"""The e2e scenarios' hold (runtime/driver/iteration_hold.py): a file that holds the driver before an
iteration until the test moves or deletes it; nothing at all without RLDOCK_TEST_HOLD_FILE."""

from __future__ import annotations

from pathlib import Path

import pytest

from rldock.runtime.driver.iteration_hold import HOLD_FILE_ENV, IterationHold


def test_without_the_variable_nothing_is_held_or_read():
    hold = IterationHold.from_environ({})
    assert hold.path is None and not hold.holds(1)
    hold.wait_before(1)  # returns at once


@pytest.mark.parametrize(
    "content, held, free",
    [
        (None, [], [1, 5, 100]),  # no file: nothing held
        ("5", [5, 6, 100], [1, 4]),  # iteration 5 and later wait
        ("5\n", [5], [4]),
        ("", [1, 5], []),  # empty: whatever comes next
        ("next", [1], []),
    ],
)
def test_the_file_holds_an_iteration_and_the_later_ones(tmp_path: Path, content, held, free):
    path = tmp_path / "hold"
    if content is not None:
        path.write_text(content)
    hold = IterationHold.from_environ({HOLD_FILE_ENV: str(path)})
    assert [i for i in held + free if hold.holds(i)] == held


def test_waits_until_the_test_moves_the_hold_then_until_it_deletes_the_file(tmp_path: Path):
    path = tmp_path / "hold"
    path.write_text("3")
    steps = iter([lambda: path.write_text("4"), lambda: None, path.unlink])
    slept = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        next(steps)()

    hold = IterationHold(path, poll_s=0.01, sleep=sleep)
    hold.wait_before(2)
    assert slept == []  # not held: no wait
    hold.wait_before(3)  # held at 3; the file moves the hold to 4, which lets 3 go
    assert len(slept) == 1
    hold.wait_before(4)  # held at 4 until the file is deleted
    assert len(slept) == 3 and not path.exists()
