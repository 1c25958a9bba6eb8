"""The `python` tool's sandbox: runs a program the model wrote in a fresh interpreter process, with
limits, and says how it ended.

The program runs in a child process, never in the caller (a Ray worker whose crash or leaked state
would cost the rollout). Its layers, and where each holds:

- Its own process: a fresh `python -I -S` (no PYTHON* variables, no .pth files, no user site), started
  without a shell, in a session and process group of its own, stdin /dev/null, a minimal environment
  (nothing of the worker's: no tokens, no keys), and a scratch directory of its own as working
  directory, HOME and TMPDIR, deleted afterwards. Holds everywhere.
- Kernel resource limits, set by the child on itself (agent/sandbox_boot.py; not `preexec_fn`, which
  is unsafe in a threaded process): RLIMIT_CPU (agent.sandbox.cpu_seconds: SIGXCPU, then SIGKILL a
  second later), RLIMIT_AS (agent.sandbox.memory_mib: allocations fail, Python raises MemoryError),
  RLIMIT_FSIZE (16 MiB a file), RLIMIT_NOFILE (64), RLIMIT_CORE (0). Holds everywhere (setrlimit needs
  no privilege to lower a limit). Not limited: the number of files written (disk use is bounded only by
  16 MiB a file times what the program writes before its wall-clock limit).
- Wall-clock limit (agent.sandbox.wall_seconds), enforced here: the child's whole process group gets
  SIGKILL. Holds everywhere.
- A network namespace of its own (unshare(2) of a user and a network namespace, or of a network
  namespace alone where the process may): no interface is up, the host's loopback is unreachable.
  Holds where unshare is allowed (as root with CAP_SYS_ADMIN, or where unprivileged user namespaces
  are); in a pod under the restricted Pod Security Standard (all capabilities dropped), the
  RuntimeDefault seccomp profile refuses unshare and the child carries on without the namespace.
- A seccomp filter the child installs on itself (agent/sandbox_boot.py `_syscall_filter`), which the
  kernel applies whatever the program does in the interpreter: socket(2), creating processes (fork,
  vfork, clone without CLONE_THREAD: threads stay allowed), signals to other processes, pidfds,
  io_uring, and reaching another process's memory (ptrace, process_vm_*) fail with EPERM. Holds
  wherever a process may install a filter with no_new_privs (no privilege needed; RuntimeDefault
  allows it) on x86_64 and aarch64; on other machines, or where prctl is refused, the child carries on
  without it.
- An audit hook (sys.addaudithook), installed in the child before the program's first line, which
  always applies: it refuses sockets and name lookups, starting processes (fork, exec, spawn,
  subprocess, os.system), ctypes and the modules that reach C or start processes without audit events
  (so packages that import ctypes unconditionally, sympy among them, do not import; numpy does),
  subinterpreters, hand-built code objects, tracing, changing resource limits, signalling other
  processes (the worker runs as the same user), writing outside the scratch directory, and reading
  outside it and Python's installation (another process's /proc files hold its environment; the job's
  data holds the answers). A refusal is a PermissionError (an ImportError for an import) the program
  may catch. The hook keeps what it calls in a closure, so replacing os.path.realpath or a builtin
  does not blind it, and checks a path as the kernel will resolve it. It is still a guard against
  what programs ordinarily do, not a security boundary (Python's documentation says as much): a
  program written to defeat it gets past it, e.g. with a path object whose __fspath__ answers the
  hook and the call differently, or with crafted bytecode loaded by marshal. Against such programs,
  run the tool in a separate sandbox service: past the hook, what remains is the kernel's layers
  above (no processes, sockets or signals where the filter is installed; files are then the pod's to
  guard, under the restricted Pod Security Standard).

Outcomes (`Outcome`): ok, error (nonzero exit or an exception), cpu_limit, memory_limit, wall_limit,
refused (the audit hook refused something and the program did not catch it).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import shutil
import signal
import site
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rldock.config.job import SandboxSpec
from rldock.runtime.agent import sandbox_boot

logger = logging.getLogger(__name__)

# What the child's environment holds: enough for the interpreter and common libraries, nothing of
# the worker's. One thread per numeric library: the sandbox shares the worker's CPUs.
_ENVIRONMENT = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_READ_CHUNK = 65536
_BOOT_FAILED = sandbox_boot.BOOT_FAILED_MESSAGE
# After the group is killed, its pipes close at once; a process that left the group (only a program
# that got past the audit hook can make one) could hold them open, so stop reading after this.
_DRAIN_SECONDS = 5.0


class Outcome(str, enum.Enum):
    OK = "ok"
    ERROR = "error"
    CPU_LIMIT = "cpu_limit"
    MEMORY_LIMIT = "memory_limit"
    WALL_LIMIT = "wall_limit"
    REFUSED = "refused"


@dataclass(frozen=True)
class SandboxResult:
    """How a program ended. `stdout` and `stderr` are each cut to the limits' max_output_chars, their
    beginning and end kept and a line saying the cut between; `exit_code` is the process's return
    code (negative: the signal that ended it); `text` is what the model reads: stdout, then stderr,
    cut to max_output_chars together, then a line saying what stopped the program, if something did."""

    stdout: str
    stderr: str
    exit_code: int
    outcome: Outcome
    text: str


def _reason(outcome: Outcome, limits: SandboxSpec) -> str:
    return {
        Outcome.CPU_LIMIT: f"[stopped: the program used its {limits.cpu_seconds:g} s of CPU time]",
        Outcome.MEMORY_LIMIT: f"[stopped: the program ran out of its {limits.memory_mib} MiB of memory]",
        Outcome.WALL_LIMIT: f"[stopped: the program ran for {limits.wall_seconds:g} s, its time limit]",
        Outcome.REFUSED: "[stopped: the sandbox refused an operation (network, processes, files or ctypes)]",
    }.get(outcome, "")


class _Capture:
    """The first and the last bytes of a stream, kept as they arrive (what a killed program printed is
    not lost), and how many came in all. The middle is read and dropped: a program that prints forever
    costs no memory. The end is kept because that is where a traceback says what went wrong."""

    def __init__(self, keep_bytes: int):
        self.keep_bytes = keep_bytes
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    async def read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(_READ_CHUNK):
            self.total += len(chunk)
            room = self.keep_bytes - len(self.head)
            self.head += chunk[:room]
            self.tail += chunk[room:]
            del self.tail[: -self.keep_bytes]

    def text(self, max_chars: int) -> str:
        """The stream if it fits in max_chars characters; else its first and last max_chars/2 and a line
        saying that output was cut between them."""
        dropped = self.total > len(self.head) + len(self.tail)
        head = self.head.decode(errors="replace")
        # Decoded as one where nothing was dropped: a character may straddle the two buffers.
        tail = self.tail.decode(errors="replace") if dropped else (self.head + self.tail).decode(errors="replace")
        if not dropped and len(tail) <= max_chars:
            return tail
        first = max_chars // 2
        last = max_chars - first
        return f"{head[:first]}\n[... output cut: {self.total} bytes in all ...]\n{tail[-last:] if last else ''}"


def _model_text(stdout: _Capture, stderr: _Capture, outcome: Outcome, limits: SandboxSpec) -> str:
    """stdout then stderr in max_output_chars together: each stream gets what it needs up to half, and
    the other what is left."""
    budget = limits.max_output_chars
    stdout_text = stdout.text(budget)
    stderr_text = stderr.text(budget)
    if len(stdout_text) + len(stderr_text) > budget:
        stdout_budget = max(budget // 2, budget - len(stderr_text))
        stdout_text = stdout.text(stdout_budget)
        stderr_text = stderr.text(budget - min(len(stdout_text), stdout_budget))
    body = stdout_text + stderr_text
    reason = _reason(outcome, limits)
    return f"{body.rstrip(chr(10))}\n{reason}" if body and reason else body or reason


async def run_python(code: str, limits: SandboxSpec) -> SandboxResult:
    """Runs `code` as a program in a fresh sandboxed interpreter (the module docstring says how);
    returns its output and outcome. Raises for nothing the program does."""
    scratch = tempfile.mkdtemp(prefix="rldock-sandbox-")
    try:
        Path(scratch, sandbox_boot.PROGRAM).write_text(code, encoding="utf-8")
        argv = [
            sys.executable,
            *sandbox_boot.INTERPRETER_FLAGS,
            sandbox_boot.__file__,
            "start",
            scratch,
            repr(limits.cpu_seconds),
            str(limits.memory_mib),
            *_site_packages(),
        ]
        environment = {**_ENVIRONMENT, "HOME": scratch, "TMPDIR": scratch}
        return await _run(argv, cwd=scratch, env=environment, limits=limits)
    finally:
        _remove(scratch)


def _site_packages() -> list[str]:
    """The worker's site-packages (in a virtual environment, its own and not the base interpreter's),
    added to the child's sys.path without running their .pth files: installed packages such as numpy
    import (not those that need ctypes, which the audit hook refuses: sympy), rldock's editable source
    trees do not."""
    return [path for path in site.getsitepackages() if os.path.isdir(path)]


async def _run(argv: list[str], *, cwd: str, env: dict[str, str], limits: SandboxSpec) -> SandboxResult:
    """Starts `argv` in a process group of its own and collects it; SIGKILL to the group at the wall
    limit. The command is a parameter so that tests can run a process group the audit hook would not
    allow a program to make."""
    # A UTF-8 character is at most 4 bytes: this many bytes hold max_output_chars characters.
    stdout = _Capture(4 * limits.max_output_chars)
    stderr = _Capture(4 * limits.max_output_chars)
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    assert process.stdout is not None and process.stderr is not None
    readers = [asyncio.ensure_future(stdout.read(process.stdout)), asyncio.ensure_future(stderr.read(process.stderr))]
    waiter = asyncio.ensure_future(process.wait())
    timed_out = False
    try:
        _, pending = await asyncio.wait([*readers, waiter], timeout=limits.wall_seconds)
        if pending:
            timed_out = waiter in pending
            _kill_group(process)
            await waiter
            _, unread = await asyncio.wait(readers, timeout=_DRAIN_SECONDS)
            for reader in unread:
                reader.cancel()
    finally:
        # Also on cancellation (the rollout ended): no program outlives its call.
        if process.returncode is None:
            _kill_group(process)
            await waiter
        for reader in readers:
            reader.cancel()
    elapsed = time.monotonic() - started
    assert process.returncode is not None
    if process.returncode == sandbox_boot.EXIT_BOOT_FAILED and stderr.head.startswith(_BOOT_FAILED.encode()):
        # Not raised: a program can exit with the same code and message, and must not stop the
        # rollout. A sandbox that cannot start fails every call, and says so here.
        logger.error("the python tool's sandbox did not start: %s", stderr.text(limits.max_output_chars))
    outcome = _outcome(process.returncode, timed_out=timed_out, elapsed=elapsed, limits=limits)
    return SandboxResult(
        stdout=stdout.text(limits.max_output_chars),
        stderr=stderr.text(limits.max_output_chars),
        exit_code=process.returncode,
        outcome=outcome,
        text=_model_text(stdout, stderr, outcome, limits),
    )


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL to the child's process group (the child leads it: its pid is the group id), so that what
    it started dies with it. Sent while the child is unreaped (or was reaped an instant before, when it
    ended just at the limit) or while a member of its group lives: until then the kernel gives its id
    to no other process or group."""
    with contextlib.suppress(ProcessLookupError):  # the group ended on its own meanwhile
        os.killpg(process.pid, signal.SIGKILL)


def _outcome(returncode: int, *, timed_out: bool, elapsed: float, limits: SandboxSpec) -> Outcome:
    if timed_out:
        return Outcome.WALL_LIMIT
    if returncode == 0:
        return Outcome.OK
    if returncode == sandbox_boot.EXIT_MEMORY:
        return Outcome.MEMORY_LIMIT
    if returncode == sandbox_boot.EXIT_REFUSED:
        return Outcome.REFUSED
    if returncode == -signal.SIGXCPU:
        return Outcome.CPU_LIMIT
    if returncode == -signal.SIGKILL and elapsed >= limits.cpu_seconds:
        # Not ours (that is timed_out): RLIMIT_CPU's hard limit, for a program that handled SIGXCPU.
        # (A kernel OOM kill also reads as SIGKILL; one that came before cpu_seconds is an error.)
        return Outcome.CPU_LIMIT
    return Outcome.ERROR


def _remove(scratch: str) -> None:
    """Deletes the scratch directory, also where the program took its own permissions away (a
    directory of mode 0 cannot be listed by a non-root user, so rmtree alone would fail)."""
    os.chmod(scratch, 0o700)
    for root, directories, _ in os.walk(scratch):  # top-down: each directory is opened before it is listed
        for name in directories:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o700)
    shutil.rmtree(scratch)
