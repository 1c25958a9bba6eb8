"""A command harness (agent.harness_command) on its own: its output read with a bound, what it left running
in the background killed when it exits, and a task too long for an environment variable passed as a file.
No gateway is needed: a command that never calls the model is enough (the URL it gets is not served)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import tracemalloc
from pathlib import Path

from test_gateway import job

from rldock.runtime.gateway.harness_runner import OUTPUT_KEPT_BYTES, TASK_ENV_BYTES, HarnessRunner

URL, KEY = "http://127.0.0.1:9/sessions/e/v1", "key"


def run_command(code: str, task: dict | None = None, *, timeout_s: float = 120):
    """The outcome of one episode of `python -c code`; the timeout is far past any machine's time for it."""
    cfg = job(harness=None, harness_command=[sys.executable, "-c", code], episode_timeout_s=timeout_s)
    runner = HarnessRunner(cfg.agent)
    return asyncio.run(runner(task or {"prompt": "p"}, name="e", base_url=URL, api_key=KEY))


def gone(pid: int, *, deadline_s: float = 30) -> bool:
    """Whether process `pid` is gone (or a zombie) within the deadline: a kill is asynchronous, so wait for it."""
    stop = time.monotonic() + deadline_s
    while time.monotonic() < stop:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_command_that_prints_without_end_is_read_with_a_bound():
    printed = 64 << 20  # 1,000 times what is kept
    tracemalloc.start()
    try:
        outcome = run_command(f"import sys\nsys.stdout.write('x' * {printed})\nprint()\nprint(0.5)\n")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert outcome.ended == "harness_done" and outcome.rewards == [0.5]
    assert peak < 16 * OUTPUT_KEPT_BYTES + (4 << 20), peak  # the tail and the pipe's chunks, not what it printed


def test_what_a_command_left_in_the_background_is_killed_when_it_exits(tmp_path):
    pid_file = tmp_path / "pid"
    # the child keeps the command's output pipe open; the command itself exits at once
    code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print(1)\n"
    )
    started = time.monotonic()
    outcome = run_command(code, timeout_s=60)
    assert outcome.ended == "harness_done" and outcome.rewards == [1.0]  # not a timeout waiting for the pipe
    assert time.monotonic() - started < 60
    assert gone(int(pid_file.read_text()))


def test_a_task_too_long_for_the_environment_is_passed_as_a_file():
    prompt = "a" * (300 << 10)  # past Linux's 128 KiB for one environment string
    code = (
        "import json, os\n"
        "task = json.load(open(os.environ['RLDOCK_TASK_FILE']))\n"
        "print(float(len(task['prompt']) == 300 * 1024 and 'RLDOCK_TASK' not in os.environ))\n"
    )
    outcome = run_command(code, {"prompt": prompt})
    assert outcome.ended == "harness_done" and outcome.rewards == [1.0], outcome.error


def test_a_short_task_is_in_both_and_the_file_is_gone_after(tmp_path):
    seen = tmp_path / "seen"
    code = (
        "import json, os\n"
        f"open({str(seen)!r}, 'w').write(os.environ['RLDOCK_TASK_FILE'])\n"
        "same = json.load(open(os.environ['RLDOCK_TASK_FILE'])) == json.loads(os.environ['RLDOCK_TASK'])\n"
        "print(float(same))\n"
    )
    task = {"prompt": "p" * (TASK_ENV_BYTES // 2), "ground_truth": "5"}
    outcome = run_command(code, task)
    assert outcome.rewards == [1.0]
    assert not Path(seen.read_text()).exists()


def test_a_command_that_fails_reports_the_tail_of_its_output():
    outcome = run_command("import sys\nprint('y' * 100000)\nprint('it went wrong')\nsys.exit(3)\n")
    assert outcome.ended == "harness_exit" and outcome.error is not None
    assert outcome.error.startswith("agent.harness_command exited 3") and outcome.error.endswith("it went wrong\n")
    assert json.dumps(outcome.error).count("y") < 3000


def test_a_command_past_its_timeout_is_killed_with_its_group(tmp_path):
    pid_file = tmp_path / "pid"
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    outcome = run_command(code, timeout_s=10)  # it never exits: any timeout ends it
    assert outcome.ended == "harness_timeout"
    assert gone(int(pid_file.read_text())) and os.path.exists(pid_file)
