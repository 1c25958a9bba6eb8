"""A command harness (agent.harness_command) on its own: its result read from its result file only (its output
is its log), its output read with a bound, what it left running in the background killed when it exits, a
task too long for an environment variable passed as a file, and every variable it gets in the config
reference. No gateway is needed: a command that never calls the model is enough (the URL it gets is not
served)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from test_gateway import REPO, job

from rldock.runtime.gateway.harness_runner import (
    OUTPUT_KEPT_BYTES,
    RESULT_MAX_BYTES,
    TASK_ENV_BYTES,
    HarnessRunner,
)

URL, KEY = "http://127.0.0.1:9/sessions/e/v1", "key"


def write_result(expression: str) -> str:
    """A line of a command's code that writes `str(expression)` to its result file."""
    return f"open(__import__('os').environ['RLDOCK_RESULT_FILE'], 'w').write(str({expression}))\n"


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
        outcome = run_command(f"import sys\nsys.stdout.write('x' * {printed})\nprint()\n" + write_result("0.5"))
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
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n" + write_result(1)
    )
    started = time.monotonic()
    outcome = run_command(code, timeout_s=60)
    assert outcome.ended == "harness_done" and outcome.rewards == [1.0]  # not a timeout waiting for the pipe
    assert time.monotonic() - started < 60
    assert gone(int(pid_file.read_text()))


def test_a_task_too_long_for_the_environment_is_passed_as_a_file():
    prompt = "a" * (300 << 10)  # past Linux's 128 KiB for one environment string
    code = "import json, os\ntask = json.load(open(os.environ['RLDOCK_TASK_FILE']))\n" + write_result(
        "float(len(task['prompt']) == 300 * 1024 and 'RLDOCK_TASK' not in os.environ)"
    )
    outcome = run_command(code, {"prompt": prompt})
    assert outcome.ended == "harness_done" and outcome.rewards == [1.0], outcome.error


def test_a_short_task_is_in_both_and_the_file_is_gone_after(tmp_path):
    seen = tmp_path / "seen"
    code = (
        "import json, os\n"
        f"open({str(seen)!r}, 'w').write(os.environ['RLDOCK_TASK_FILE'])\n"
        "same = json.load(open(os.environ['RLDOCK_TASK_FILE'])) == json.loads(os.environ['RLDOCK_TASK'])\n"
        + write_result("float(same)")
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


# --- the result file: the reward's only channel -----------------------------------------------------------


def test_what_a_command_prints_after_writing_its_result_does_not_change_its_reward():
    # as the OpenAI Agents SDK's tracing does at exit, on stderr, after the agent's last line
    code = write_result(0.75) + (
        "import sys\nprint(0.75, flush=True)\nprint('[non-fatal] Tracing: max retries reached', file=sys.stderr)\n"
    )
    outcome = run_command(code)
    assert outcome.ended == "harness_done" and outcome.rewards == [0.75], outcome.error


def test_a_reward_printed_but_not_written_is_no_reward():
    outcome = run_command("print(1.0)\n")
    assert outcome.ended == "harness_no_result" and outcome.rewards == []
    assert outcome.error is not None and "without writing its result to $RLDOCK_RESULT_FILE" in outcome.error


@pytest.mark.parametrize(
    ("written", "ended", "rewards", "info"),
    [
        (repr('{"reward": 0.5, "turns": 3}'), "harness_done", [0.5], {"turns": 3}),
        (repr("null"), "harness_done", [], {}),  # no reward of its own: what it posted, reward.terms
        (repr("1e400"), "harness_bad_reward", [], {}),
        (repr("great"), "harness_bad_reward", [], {}),
        (repr(""), "harness_bad_reward", [], {}),
        ("'[' * 60000", "harness_bad_reward", [], {}),  # nested past the JSON parser's depth
    ],
)
def test_the_result_file_holds_what_a_harness_returns(written, ended, rewards, info):
    outcome = run_command(write_result(written))
    assert (outcome.ended, outcome.rewards, outcome.info) == (ended, rewards, info)
    if ended == "harness_bad_reward":
        assert outcome.error is not None and "agent.harness_command's result ($RLDOCK_RESULT_FILE)" in outcome.error


@pytest.mark.parametrize(
    ("make", "says"),
    [
        ("os.mkfifo(path)", "is not a regular file"),  # read without waiting for a writer
        ("os.symlink(os.environ['RLDOCK_TASK_FILE'], path)", "cannot be read"),  # a link is not followed
        (f"open(path, 'w').write('1' * {RESULT_MAX_BYTES + 1})", f"more than {RESULT_MAX_BYTES} bytes"),
    ],
)
def test_a_result_file_is_read_as_a_small_regular_file_only(make, says):
    started = time.monotonic()
    outcome = run_command(f"import os\npath = os.environ['RLDOCK_RESULT_FILE']\n{make}\n", timeout_s=60)
    assert outcome.ended == "harness_bad_reward" and outcome.error is not None and says in outcome.error
    assert time.monotonic() - started < 30


def test_every_variable_a_command_gets_is_in_the_config_reference():
    # what the kernel passed at exec, before the interpreter adds any of its own (LC_CTYPE)
    code = write_result(
        "__import__('json').dumps({'reward': 1, 'names': sorted(entry.split(b'=', 1)[0].decode() for entry in "
        "open('/proc/self/environ', 'rb').read().split(b'\\0') if entry)})"
    )
    outcome = run_command(code)
    names = set(outcome.info["names"])
    assert {"OPENAI_BASE_URL", "OPENAI_API_KEY", "RLDOCK_TASK", "RLDOCK_TASK_FILE", "RLDOCK_RESULT_FILE"} <= names
    (row,) = [
        line
        for line in (REPO / "docs" / "config-reference.md").read_text().splitlines()
        if line.startswith("| `harness_command` |")
    ]
    assert sorted(name for name in names if name not in row) == []


def test_no_more_commands_run_at_once_than_the_cap_and_every_episode_runs(tmp_path):
    """agent.max_concurrent_harness_commands: six episodes, two at a time."""
    log = tmp_path / "spans"
    code = (
        "import os, time\n"
        f"with open({str(log)!r}, 'a') as f: f.write(f'+ {{time.monotonic()}}\\n')\n"
        "time.sleep(1.0)\n"
        f"with open({str(log)!r}, 'a') as f: f.write(f'- {{time.monotonic()}}\\n')\n" + write_result("1")
    )
    cfg = job(
        harness=None,
        harness_command=[sys.executable, "-c", code],
        episode_timeout_s=120,
        max_concurrent_harness_commands=2,
    )
    runner = HarnessRunner(cfg.agent)

    async def six():
        return await asyncio.gather(
            *(runner({"prompt": "p"}, name=f"e{i}", base_url=URL, api_key=KEY) for i in range(6))
        )

    outcomes = asyncio.run(six())
    assert [(outcome.ended, outcome.rewards) for outcome in outcomes] == [("harness_done", [1.0])] * 6
    events = sorted(
        (float(at), +1 if sign == "+" else -1) for sign, at in (line.split() for line in log.read_text().splitlines())
    )
    running, most = 0, 0
    for _, change in events:  # an end and a start at the same instant: the end first (sorted -1 before +1)
        running += change
        most = max(most, running)
    # never more than the cap (without it all six overlap); how many did overlap depends on the machine's load
    assert 1 <= most <= 2 and running == 0


# --- agent.harness_command_limits ---------------------------------------------------------------------------

LIMITS_SEEN = write_result(
    "__import__('json').dumps({'reward': 1, 'limits': {name: __import__('resource').getrlimit("
    "getattr(__import__('resource'), name)) for name in ('RLIMIT_NOFILE', 'RLIMIT_FSIZE', 'RLIMIT_CORE', "
    "'RLIMIT_AS', 'RLIMIT_CPU')}, 'child': __import__('subprocess').run([__import__('sys').executable, '-c', "
    "'import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])'], capture_output=True, "
    "text=True).stdout.strip()})"
)


def run_limited(code: str, **limits):
    cfg = job(
        harness=None,
        harness_command=[sys.executable, "-c", code],
        episode_timeout_s=120,
        harness_command_limits=limits,
    )
    return asyncio.run(HarnessRunner(cfg.agent)({"prompt": "p"}, name="e", base_url=URL, api_key=KEY))


def test_a_command_and_what_it_starts_run_under_the_limits_and_dump_no_core():
    outcome = run_limited(LIMITS_SEEN, open_files=100, file_size_mib=3, memory_mib=4096, cpu_seconds=50)
    limits = {name: tuple(value) for name, value in outcome.info["limits"].items()}
    assert limits == {
        "RLIMIT_NOFILE": (100, 100),
        "RLIMIT_FSIZE": (3 * 2**20, 3 * 2**20),
        "RLIMIT_CORE": (0, 0),
        "RLIMIT_AS": (4096 * 2**20, 4096 * 2**20),
        "RLIMIT_CPU": (50, 50),
    }
    assert outcome.info["child"] == "100"  # inherited: set before the command's first instruction


def test_by_default_open_files_and_file_size_are_bounded_and_memory_and_cpu_are_not():
    import resource

    limits = {name: tuple(value) for name, value in run_limited(LIMITS_SEEN).info["limits"].items()}
    assert limits["RLIMIT_NOFILE"][0] == min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    assert limits["RLIMIT_FSIZE"][0] == 1024 * 2**20 and limits["RLIMIT_CORE"] == (0, 0)
    assert limits["RLIMIT_AS"] == resource.getrlimit(resource.RLIMIT_AS)  # the actor's, unchanged
    assert limits["RLIMIT_CPU"] == resource.getrlimit(resource.RLIMIT_CPU)


def test_a_runaway_file_and_a_runaway_allocation_stop_at_their_limits(tmp_path):
    big = tmp_path / "log"
    code = (
        "import errno\n"
        "try:\n"
        f"    open({str(big)!r}, 'wb').write(b'x' * (3 * 2**20))\n"
        "    wrote = 'all'\n"
        "except OSError as error:\n"
        "    wrote = errno.errorcode[error.errno]\n"
        "try:\n"
        "    block = bytearray(512 * 2**20)\n"
        "    allocated = 'all'\n"
        "except MemoryError:\n"
        "    allocated = 'MemoryError'\n"
        + write_result("__import__('json').dumps({'reward': 1, 'wrote': wrote, 'allocated': allocated})")
    )
    outcome = run_limited(code, file_size_mib=1, memory_mib=256)
    assert (outcome.info["wrote"], outcome.info["allocated"]) == ("EFBIG", "MemoryError")
    assert big.stat().st_size == 2**20  # it stopped at the limit


def test_a_command_that_cannot_be_started_ends_its_episode_saying_why():
    cfg = job(harness=None, harness_command=["/nonexistent/agent", "--flag"], episode_timeout_s=120)
    outcome = asyncio.run(HarnessRunner(cfg.agent)({"prompt": "p"}, name="e", base_url=URL, api_key=KEY))
    assert outcome.ended == "harness_exit" and outcome.error is not None
    assert (
        "exited 127" in outcome.error
        and "cannot start '/nonexistent/agent': No such file or directory" in outcome.error
    )


# --- confinement: a command cannot read the pod's tokens from its other processes -------------------------------

_PEEK_FROM_A_COMMAND = """
import ctypes, json, os, shutil, subprocess, sys, tempfile
from rldock.config.agent_harness import HarnessCommandLimits
from rldock.runtime.gateway.harness_runner import LIMITS_THEN_EXEC, limited
python = sys.executable
if os.getuid() == 0:  # an ordinary uid (root reads every process's files), dumpable as when started under it
    python = shutil.which("python3", path="/usr/bin:/bin")  # one uid 65534 may run (not under /root)
    if python is None:
        print(json.dumps(None))
        sys.exit(0)
    os.setgid(65534)
    os.setuid(65534)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
ASKED = "abi = libc.syscall(444, None, 0, 1)"
def run(command, abi):  # abi: None unconfined; 0 the kernel's own; else the helper told the kernel has that one
    if abi is None:
        argv = command
    else:
        argv = [python, *limited(command, HarnessCommandLimits(), {"PATH": "/usr/bin:/bin"})[1:]]
        argv[3] = LIMITS_THEN_EXEC.replace(ASKED, f"abi = {abi}") if abi else argv[3]  # python -I -c SCRIPT
    return subprocess.run(argv, capture_output=True, env={"PATH": "/usr/bin:/bin"})
folder = tempfile.mkdtemp()
os.makedirs(f"{folder}/a")
os.makedirs(f"{folder}/b")
seen = {}
for abi in (None, 0, 5):  # this process holds the token, as Ray's and the actors' do in a Ray pod
    environ = run(["cat", f"/proc/{os.getpid()}/environ"], abi)
    signal = run(["sh", "-c", f"kill -0 {os.getpid()}"], abi)
    open(f"{folder}/a/f", "w").close()
    moved = run(["mv", f"{folder}/a/f", f"{folder}/b/f"], abi)  # to another folder: what REFER guards
    os.remove(f"{folder}/b/f") if moved.returncode == 0 else os.remove(f"{folder}/a/f")
    read = int(b"pod-secret" in environ.stdout)
    seen[str(abi)] = [read, environ.stderr.decode(), signal.returncode, moved.returncode]
print(json.dumps(seen))
"""


def test_a_command_cannot_read_the_tokens_of_the_pods_other_processes_nor_signal_them():
    """The red team's finding: a harness command read RAY_AUTH_TOKEN from the environ of a Ray pod's process of
    its uid. In its own Landlock domain the command is refused what ptrace guards of a process outside it, on this
    kernel and as the helper confines it on a kernel of Landlock ABI 5 (REFER handled, granted beneath /); in both
    it still moves a file to another folder (an ABI 1 rule would have refused it)."""
    from rldock.runtime.sandbox.kernel import landlock_abi

    if landlock_abi() < 2:
        pytest.skip("this kernel's Landlock cannot confine a command (harness_runner.confinement says unconfined)")
    done = subprocess.run(
        [sys.executable, "-c", _PEEK_FROM_A_COMMAND],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_AUTH_TOKEN": "pod-secret"},
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    if seen is None:
        pytest.skip("running as root with no python3 in /usr/bin or /bin that uid 65534 may run")
    assert seen["None"] == [1, "", 0, 0]  # the same commands unconfined: the token read, the signal sent
    for abi in ("0", "5"):
        readable, error, signal, moved = seen[abi]
        assert readable == 0 and "Permission denied" in error and moved == 0, seen
    assert seen["5"][2] == 0  # signals are scoped from Landlock ABI 6
    assert (seen["0"][2] != 0) == (landlock_abi() >= 6), seen
