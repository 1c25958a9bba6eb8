"""The attack corpus (sandbox_attacks.py) against the python tool's sandbox, in every mode it runs in:
with namespaces (this machine), with unshare refused and no capability (a pod under the `restricted`
Pod Security Standard), and, in that weaker mode, without the audit hook (what a program that got past
the hook meets). Each attack runs through a caller of its own process (sandbox_caller.py), and after
each one:

- nothing outside the scratch directory was read (the secret is not in what the model reads) or written
  (the directory beside it is as it was: names, contents, modes, times), nothing connected to loopback;
- the caller's priority, CPUs, scheduling policy and limits are as they were, and nothing the program
  made is left in /dev/shm or SysV IPC;
- the caller is alive (it answered), no process of the program's session is left, and the scratch
  directory is gone;
- with the audit hook, the program did not end `ok`, the model reads why it stopped, and its interpreter
  did not crash (no signal but the sandbox's own kills).
"""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_attacks import ATTACK_LIMITS, ATTACKS, SHARED_NAME

from rldock.runtime.sandbox.boot import BOOT_FAILED_MESSAGE, LAYERS_MISSING_MESSAGE

CALLER = Path(__file__).with_name("sandbox_caller.py")
# (how the caller runs, the hook or not, the kernel layers missing as on a machine without them)
MODES = [
    ("namespaces", "hook", ""),
    ("restricted", "hook", ""),
    ("restricted", "kernel-only", ""),
    ("restricted", "hook", "landlock"),
    ("restricted", "hook", "landlock,seccomp"),
]
MODE_IDS = ["namespaces", "restricted", "restricted-kernel-only", "restricted-no-landlock", "restricted-hook-only"]
# The wall clock counts the interpreter's boot, which a loaded machine stretches past seconds: an attack that
# ends otherwise gets a minute, so that only a program that really waits meets it (sandbox_attacks.py's
# ATTACK_LIMITS gives those theirs).
LIMITS = {"cpu_seconds": 2, "wall_seconds": 60, "memory_mib": 512, "max_output_chars": 2000}
ANSWER_TIMEOUT_S = 120.0
# Our own kills: the wall clock and the disk watchdog (SIGKILL), RLIMIT_CPU (SIGXCPU, then SIGKILL).
SANDBOX_SIGNALS = (-9, -24)


class Caller:
    """One sandbox_caller.py process; restarted if an attack killed it (that attack's test fails)."""

    def __init__(self, mode: str, hook: str, missing: str):
        self.argv = [sys.executable, str(CALLER), mode, hook, missing]
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        """Starts the caller process if it is not running (a first attack, or one that killed it)."""
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=CALLER.parent
            )
            assert json.loads(self._line()) == {"ready": True}

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def ask(self, request: dict) -> dict:
        self.start()
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self._line()
        assert line, f"the caller died during the attack (exit {self.process.wait()})"
        return json.loads(line)

    def _line(self) -> str:
        assert self.process is not None and self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], ANSWER_TIMEOUT_S)
        assert ready, f"the caller gave no answer in {ANSWER_TIMEOUT_S} s"
        return self.process.stdout.readline()

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module", params=MODES, ids=MODE_IDS)
def caller(request) -> Iterator[tuple[Caller, str, str, str]]:
    instance = Caller(*request.param)
    yield instance, *request.param
    instance.close()


def snapshot(directory: Path) -> dict[str, tuple]:
    return {
        path.name: (path.read_bytes(), path.stat().st_mode, path.stat().st_mtime_ns) for path in directory.iterdir()
    }


def process_state(pid: int) -> dict[str, object]:
    """What a program could change of another process without signalling it: its priority, CPUs, scheduling
    policy and resource limits."""
    return {
        "nice": os.getpriority(os.PRIO_PROCESS, pid),
        "cpus": os.sched_getaffinity(pid),
        "policy": os.sched_getscheduler(pid),
        "limits": [resource.prlimit(pid, limit) for limit in (resource.RLIMIT_NOFILE, resource.RLIMIT_AS)],
    }


def shared_objects_of(programs: list[int]) -> list[str]:
    """What the programs left that outlives them outside their scratch directory: POSIX shared memory,
    semaphores and queues the attacks name (/dev/shm is the machine's: other tests use it too), and SysV
    segments, semaphores and queues they created (by creator pid, where the kernel lists it)."""
    left = [name for name in os.listdir("/dev/shm") if SHARED_NAME in name]
    for kind in ("shm", "sem", "msg"):
        lines = Path("/proc/sysvipc", kind).read_text().splitlines()
        header = lines[0].split()
        if "cpid" in header:  # shm: the creator's pid; sem and msg list none, and the filter refuses all three
            column = header.index("cpid")
            left += [line for line in lines[1:] if int(line.split()[column]) in programs]
    return left


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_an_attack_gets_nothing_and_harms_no_one(caller, name, tmp_path):
    client, mode, hook, missing = caller
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    canary = f"CANARY-{uuid.uuid4()}"
    secret.write_text(canary)
    outside.chmod(0o755)
    secret.chmod(0o644)  # readable to the sandbox's user as far as file modes go: only the sandbox stops it
    before = snapshot(outside)
    client.start()
    caller_before = process_state(client.pid)
    scratch_parent = tmp_path / "scratch"
    scratch_parent.mkdir()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    prelude = f"OUTSIDE = {str(outside)!r}\nSECRET = {str(secret)!r}\nPORT = {port}\n"
    try:
        answer = client.ask(
            {
                "code": prelude + ATTACKS[name],
                "tempdir": str(scratch_parent),
                "limits": {**LIMITS, **ATTACK_LIMITS.get(name, {})},
            }
        )
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected
    finally:
        listener.close()
    assert canary not in answer["text"], answer["text"]
    assert snapshot(outside) == before
    assert process_state(client.pid) == caller_before
    assert shared_objects_of(answer["programs"]) == []
    assert answer["left"] == [] and answer["scratch_left"] == [], answer
    if hook == "hook":
        assert answer["outcome"] != "ok", answer["text"]
        assert answer["text"].strip(), "the model is told why the program stopped"
        assert answer["exit_code"] >= 0 or answer["exit_code"] in SANDBOX_SIGNALS, answer
    expected_namespaces = ["user", "mount", "network", "scratch_filesystem"] if mode == "namespaces" else []
    assert answer["layers"] == {
        "namespaces": expected_namespaces,
        "landlock": answer["layers"]["landlock"],
        "seccomp": "seccomp" not in missing,
    }, answer
    assert (answer["layers"]["landlock"] >= 1) is ("landlock" not in missing)
    if "seccomp" in missing:  # the hook alone: the program never ran
        assert answer["text"].startswith(BOOT_FAILED_MESSAGE) and LAYERS_MISSING_MESSAGE in answer["text"], answer


def test_the_corpus_has_every_attack_of_the_issue():
    # Issue 36's list, each by the name it has here: a renamed or dropped attack fails this.
    named = {
        "disarm the hook, then run a fresh interpreter",
        "disarm the hook, then read the caller's environment and memory",
        "SIGIO to the caller through F_SETOWN",
        "SIGKILL to the caller through F_SETSIG",
        "mkfifo outside",
        "mknod outside",
        "list /",
        "list extended attributes outside",
        "_ctypes under another module name",
        "marshal.loads of hand-built code",
        "bad bytecode through marshal",
        "a path that answers the check and the call differently",
        "1,100 nested directories",
        "fill the disk with 64 files of 16 MiB",
        # Issue 52
        "use up the memory with threads, then read while the hook cannot allocate",
        # Issue 50
        "renice the caller",
        "pin the caller to one CPU",
        "SCHED_IDLE for the caller",
        "POSIX shared memory left in /dev/shm",
        "a thread storm",
    }
    assert named <= set(ATTACKS)
    assert len(ATTACKS) >= 68


def test_the_caller_dying_kills_the_program(tmp_path):
    # The caller is SIGKILLed while its program sleeps: the program dies with it (PR_SET_PDEATHSIG), with
    # no one left to enforce the wall clock.
    code = "import time\nprint('sleeping', flush=True)\ntime.sleep(3600)"
    request = {"code": code, "tempdir": str(tmp_path), "limits": {**LIMITS, "wall_seconds": 600}}
    caller = subprocess.Popen(
        [sys.executable, str(CALLER), "restricted", "hook"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=CALLER.parent,
    )
    try:
        assert caller.stdout is not None and caller.stdin is not None
        assert json.loads(caller.stdout.readline()) == {"ready": True}
        caller.stdin.write(json.dumps(request) + "\n")
        caller.stdin.flush()
        program = wait_for_child_in_run_stage(caller.pid)
    finally:
        caller.kill()
        caller.wait()
    from test_sandbox import wait_until_dead

    wait_until_dead(program)


def wait_for_child_in_run_stage(parent: int, timeout_s: float = 60.0) -> int:
    from test_sandbox import running_programs

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if programs := running_programs(parent):
            return programs[0]
        time.sleep(0.01)  # polls the state it waits for
    raise AssertionError(f"no program of caller {parent} started in {timeout_s} s")


def test_the_caller_runs_as_a_restricted_pod_would():
    # The emulation itself: without it, the restricted modes would test nothing.
    probe = (
        "import ctypes, os\n"
        "from sandbox_caller import _as_a_restricted_pod\n"
        "_as_a_restricted_pod()\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x40000000), ctypes.get_errno())\n"
        "keys = ('CapEff', 'CapBnd', 'NoNewPrivs')\n"
        "print([line.split()[1] for line in open('/proc/self/status') if line.startswith(keys)])\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", probe], cwd=CALLER.parent, capture_output=True, text=True, check=True
    )
    assert output.stdout.splitlines() == ["-1 1", "['0000000000000000', '0000000000000000', '1']"], output.stderr
