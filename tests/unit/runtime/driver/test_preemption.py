"""rldock.runtime.driver.preemption: a first SIGTERM asks the run to stop (the process goes on), a
second goes to the handler installed before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rldock.contract.runtime_cli import DRAIN_REQUESTS_DIR
from rldock.runtime.cli import build_parser
from rldock.runtime.driver import preemption
from rldock.runtime.driver.preemption import (
    EXIT_CODE,
    Preempted,
    StopNotice,
    StopRequest,
    drain_request,
    drivers_here,
    follow_stop,
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


def test_a_notice_is_up_from_its_post_until_taken_down_or_past_its_time(tmp_path):
    now = [1000.0]
    notice = StopNotice(tmp_path / "out" / "preempting.json", clock=lambda: now[0])
    assert not notice.up()
    notice.post(285)  # the folder made if the driver has not made it yet
    assert notice.up() and [p.name for p in notice.path.parent.iterdir()] == ["preempting.json"]
    now[0] += 285  # a notice whose hook was killed before it took it down holds nobody past its time
    assert not notice.up()
    notice.post(10)
    notice.take_down()
    notice.take_down()  # twice: nothing to take down
    assert not notice.up() and not notice.path.exists()
    notice.path.write_text("{")  # being replaced (another pod's partial view): counts as up
    assert notice.up()


def test_a_worker_hook_without_a_notice_goes_after_looking_for_one(tmp_path):
    started = time.monotonic()
    assert follow_stop(StopNotice(tmp_path / "preempting.json"), 60, notice_wait_s=0.3, poll_s=0.05) is False
    assert 0.3 <= time.monotonic() - started < 30


def test_a_worker_hook_waits_while_the_notice_is_up_then_goes(tmp_path):
    """The worker pod's Ray node stays up for the head's driver: the hook returns only once the notice that
    appeared after it started (the head's hook runs later) is taken down."""
    notice = StopNotice(tmp_path / "preempting.json")
    result: list[bool] = []
    follower = threading.Thread(
        target=lambda: result.append(follow_stop(notice, 60, notice_wait_s=30, poll_s=0.02)), daemon=True
    )
    follower.start()
    notice.post(60)
    follower.join(0.5)  # with the notice up it cannot return before its 60 s
    assert follower.is_alive() and result == []
    notice.take_down()
    follower.join(30)
    assert result == [True]


def test_a_worker_hook_gives_up_at_its_timeout(tmp_path):
    notice = StopNotice(tmp_path / "preempting.json")
    notice.post(600)
    assert follow_stop(notice, 0.3, notice_wait_s=10, poll_s=0.05) is True


def test_the_hook_posts_its_notice_while_the_drivers_stop_and_follow_needs_one(tmp_path, capsys, monkeypatch):
    path = tmp_path / "preempting.json"
    args = build_parser().parse_args(["preempt", "--timeout", "5", "--notice", str(path)])
    posted: list[bool] = []

    def stop(timeout_s: float) -> tuple[list[int], list[int]]:
        posted.append(StopNotice(path).up())
        return [], []

    monkeypatch.setattr(preemption, "stop_drivers", stop)
    assert args.run(args) == 0
    assert posted == [True] and not path.exists()  # up while the drivers stopped, taken down after
    follow = build_parser().parse_args(["preempt", "--follow"])
    assert follow.run(follow) == 2 and "--follow needs --notice" in capsys.readouterr().err


def _requests_watched(output_dir: Path) -> StopRequest:
    """A StopRequest watching `output_dir`'s requests, installed off the main thread (SIGTERM left alone); its
    watcher polls once a minute, so the test answers the requests itself (`answer_requests`)."""
    stop = StopRequest(poll_s=60)
    installer = threading.Thread(target=stop.install, args=(output_dir,))
    installer.start()
    installer.join()
    return stop


def test_a_worker_pod_deleted_alone_asks_for_a_checkpoint_and_waits_for_it(tmp_path):
    """A drain of one worker pod: its hook posts a request named after the pod; the driver acknowledges it; the
    hook keeps the pod's Ray node up until the driver, at the next boundary, has saved the iteration just done
    and answers. The run goes on (no stop)."""
    notice = StopNotice(tmp_path / "preempting.json")
    request = drain_request(notice, "job-worker-0")
    assert request.path == tmp_path / "drain-requests" / "job-worker-0.json"
    stop = _requests_watched(tmp_path)
    stop.between_iterations(4, first=1, save=pytest.fail)  # nothing asked: nothing saved
    result: list[bool] = []
    follower = threading.Thread(
        target=lambda: result.append(follow_stop(notice, 60, request=request, notice_wait_s=30, poll_s=0.02)),
        daemon=True,
    )
    follower.start()
    deadline = time.monotonic() + 30
    while not request.path.exists() and time.monotonic() < deadline:  # the hook posted its request
        time.sleep(0.02)
    stop.answer_requests()
    assert stop.drains and not stop.requested and request.acknowledged()
    follower.join(0.5)  # acknowledged and up: it cannot return before the driver answers
    assert follower.is_alive() and result == []
    saved: list[int] = []
    stop.between_iterations(5, first=1, save=saved.append)  # the boundary after iteration 5: no Preempted
    assert saved == [5] and not stop.drains
    follower.join(30)
    assert result == [True] and not request.path.exists()


def test_a_sigterm_at_the_boundary_saves_unless_a_checkpoint_holds_it_then_stops(tmp_path):
    stop = _requests_watched(tmp_path)
    stop.requested = True  # what the SIGTERM handler sets
    saved: list[int] = []
    with pytest.raises(Preempted) as raised:
        stop.between_iterations(3, first=4, save=saved.append)  # stopped before this attempt's first iteration
    assert raised.value.iteration == 3 and saved == []
    with pytest.raises(Preempted):
        stop.between_iterations(6, first=4, save=saved.append)
    assert saved == [6]


def test_a_request_nobody_takes_up_is_taken_down_and_a_stale_one_asks_nothing_of_a_later_run(tmp_path):
    notice = StopNotice(tmp_path / "preempting.json")
    request = drain_request(notice, "job-worker-0")
    started = time.monotonic()  # no driver runs: the hook goes after looking for an answer
    assert follow_stop(notice, 60, request=request, notice_wait_s=0.3, poll_s=0.05) is False
    assert 0.3 <= time.monotonic() - started < 30 and not request.path.exists()
    now = [1000.0]
    StopNotice(request.path, clock=lambda: now[0]).post(10)  # left by a hook killed before it took it down
    stop = _requests_watched(tmp_path)  # a later run's driver, past the request's time
    stop.answer_requests()
    assert not stop.drains and not request.acknowledged()


def test_a_rollout_pool_pods_hook_follows_the_driver_but_asks_for_no_checkpoint(tmp_path, monkeypatch):
    """`rldock preempt --follow --no-drain` (a pool pod's hook): deleted alone, it posts no drain request (its loss
    costs its engine, not the attempt) and returns once nothing says a driver is stopping."""
    path = tmp_path / "preempting.json"
    monkeypatch.setattr(preemption, "NOTICE_WAIT_S", 0.2)
    args = build_parser().parse_args(["preempt", "--timeout", "5", "--notice", str(path), "--follow", "--no-drain"])
    asked: list = []
    monkeypatch.setattr(preemption, "follow_stop", lambda notice, timeout_s, *, request: asked.append(request) or False)
    assert args.run(args) == 0
    assert asked == [None] and not (tmp_path / DRAIN_REQUESTS_DIR).exists()
