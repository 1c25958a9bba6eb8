"""The sandbox's runner: runs a program the model wrote (the `python` tool's) in a fresh interpreter process,
with limits, and says how it ended.

The program runs in a child process, never in the caller (a Ray worker whose crash or leaked state would
cost the rollout): a fresh `python -I -S` started without a shell, in a session and process group of its
own, stdin /dev/null, a minimal environment (nothing of the worker's: no tokens, no keys), in a scratch
directory of its own (its working directory, HOME and TMPDIR), removed afterwards however deep the
program made it. What confines it, in the order it is applied:

- the kernel layers (kernel.py, applied by boot.py's `start` stage): namespaces and a size-capped
  tmpfs scratch where unshare is allowed, resource limits, death with the caller, Landlock file rules,
  and a seccomp filter. They hold whatever the program does inside its interpreter;
- the audit hook (hook.py): clear refusals in the program's own terms, and the file guard of last
  resort where the kernel has no Landlock. Not a boundary;
- here, outside the child: the wall clock (SIGKILL to the whole process group) and, where the scratch
  directory is not a capped tmpfs, a watchdog that kills the group when the directory passes the disk
  limits.

Which kernel layers held is in each result (`SandboxResult.layers`); a missing one is logged once per
process and counted by the python tool (agent/sandbox/without_<layer>). It fails closed: without
Landlock or the seccomp filter (REQUIRED_LAYERS) the boot refuses to run the program, unless the
config's agent.sandbox.allow_missing_layers names the layer; `machine_layers` says which layers this
machine gives, for the tool's start and `rldock validate`. docs/agentic.md#the-sandbox says which layer
holds where, measured.

Outcomes (`Outcome`): ok, error (nonzero exit or an exception), cpu_limit, memory_limit, wall_limit,
disk_limit, refused (the audit hook refused something and the program did not catch it), hook_failed (the
audit hook could not judge an operation, out of memory or from an error in it, and ended the program
rather than let it through).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import os
import signal
import site
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rldock.config import JobConfig, Problem
from rldock.config.agent import SandboxSpec
from rldock.runtime.sandbox import boot

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
_BOOT_FAILED = boot.BOOT_FAILED_MESSAGE
# After the group is killed, its pipes close at once; a process that left the group (only a program
# that got past the audit hook can make one) could hold them open, so stop reading after this.
_DRAIN_SECONDS = 5.0


class Outcome(str, enum.Enum):
    OK = "ok"
    ERROR = "error"
    CPU_LIMIT = "cpu_limit"
    MEMORY_LIMIT = "memory_limit"
    WALL_LIMIT = "wall_limit"
    DISK_LIMIT = "disk_limit"
    REFUSED = "refused"
    HOOK_FAILED = "hook_failed"


@dataclass(frozen=True)
class Layers:
    """The kernel layers that held for one program: the namespaces it entered (`user`, `mount`,
    `network`, and `scratch_filesystem` for the capped tmpfs), the Landlock ABI enforced (0: none) and
    whether the seccomp filter was installed. `reported` is false where the boot failed before it
    could say (the program did not run): then nothing is missing, the boot's error is what to read."""

    namespaces: tuple[str, ...] = ()
    landlock: int = 0
    seccomp: bool = False
    reported: bool = False

    @property
    def missing(self) -> tuple[str, ...]:
        """The layers a kernel or a pod's profile refused, by the names of the metrics that count them."""
        if not self.reported:
            return ()
        held = {"landlock": self.landlock > 0, "seccomp": self.seccomp, "namespaces": "network" in self.namespaces}
        return tuple(name for name, present in held.items() if not present)


class SandboxLayersMissing(ValueError):
    """The machine lacks a kernel layer the config requires (not in agent.sandbox.allow_missing_layers)."""


# Layers without which no program runs: without Landlock the audit hook alone guards files (unless the
# config's allow_missing_layers names it), without the filter it alone would guard processes, signals and
# the caller's scheduling, which it cannot (no audit event for mkfifo, setpriority or pidfd_open).
REQUIRED_LAYERS = ("landlock", "seccomp")


def missing_layers_problem(layers: Layers, limits: SandboxSpec) -> str | None:
    """Why the python tool must not start on a machine with these layers under these limits, naming the
    field and the fix; None when it may."""
    refused = [layer for layer in layers.missing if layer in _required(limits)]
    if not refused:
        return None
    lacks = ", ".join(_LAYER_NAMES[layer] for layer in refused)
    return (
        f"agent.sandbox.allow_missing_layers: this machine lacks {lacks}, "
        f"and the python tool does not run the model's code without it; run where it is (Linux 5.13+ for Landlock, "
        f"x86_64 or aarch64 and a seccomp profile that allows the landlock_* calls and seccomp filters) or use "
        f"agent.sandbox.servers; without Landlock alone, allow_missing_layers: [landlock] runs with what remains "
        f"(docs/agentic.md#the-sandbox)"
    )


def describe_layers(layers: Layers) -> str:
    """One line saying which kernel layers a program gets here, e.g. for `rldock validate`."""
    if not layers.reported:
        return "the sandbox could not start on this machine"
    held = [f"Landlock ABI {layers.landlock}" if layers.landlock else "no Landlock"]
    held.append("seccomp filter" if layers.seccomp else "no seccomp filter")
    held.append(f"namespaces: {', '.join(layers.namespaces)}" if layers.namespaces else "no namespaces")
    return "; ".join(held)


def uses_local_sandbox(cfg: JobConfig) -> bool:
    """Whether the job runs the python tool's programs on the actors' machines (not agent.sandbox.servers)."""
    agent = cfg.agent
    return agent is not None and agent.sandbox.servers is None and any(tool.name == "python" for tool in agent.tools)


def sandbox_layer_problems(cfg: JobConfig) -> list[Problem]:
    """For `rldock validate` and `train`: the python tool would refuse to start on this machine."""
    if not uses_local_sandbox(cfg):
        return []
    assert cfg.agent is not None
    problem = missing_layers_problem(machine_layers(cfg.agent.sandbox), cfg.agent.sandbox)
    return [] if problem is None else [Problem("agent.sandbox.allow_missing_layers", problem)]


def require_layers(limits: SandboxSpec) -> Layers:
    """The python tool's start: the machine's layers, logged; raises SandboxLayersMissing where a layer
    the limits require is missing."""
    layers = machine_layers(limits)
    problem = missing_layers_problem(layers, limits)
    if problem is not None:
        raise SandboxLayersMissing(problem)
    logger.info("the python tool's sandbox on this machine: %s", describe_layers(layers))
    return layers


def machine_layers(limits: SandboxSpec) -> Layers:
    """The kernel layers a program gets on this machine, measured by starting one (an empty program, no
    layer required) in a thread of its own: callable with or without a running event loop."""
    box: list[SandboxResult] = []
    thread = threading.Thread(
        target=lambda: box.append(asyncio.run(_run_program("", limits, audit_hook=True, required=())))
    )
    thread.start()
    thread.join()
    return box[0].layers


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
    layers: Layers


def _reason(outcome: Outcome, limits: SandboxSpec) -> str:
    return {
        Outcome.CPU_LIMIT: f"[stopped: the program used its {limits.cpu_seconds:g} s of CPU time]",
        Outcome.MEMORY_LIMIT: f"[stopped: the program ran out of its {limits.memory_mib} MiB of memory]",
        Outcome.WALL_LIMIT: f"[stopped: the program ran for {limits.wall_seconds:g} s, its time limit]",
        Outcome.DISK_LIMIT: (
            f"[stopped: the program wrote more than {limits.disk_mib} MiB or {limits.max_files} files, its disk limit]"
        ),
        Outcome.REFUSED: "[stopped: the sandbox refused an operation (network, processes, files or ctypes)]",
        Outcome.HOOK_FAILED: "[stopped: the sandbox could not check an operation (out of memory or an error in the "
        "check) and ended the program]",
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
    result = await _run_program(code, limits, audit_hook=True, required=_required(limits))
    for layer in result.layers.missing:
        if layer not in _missing_logged:
            _missing_logged.add(layer)
            logger.warning(
                "the python tool's sandbox runs without %s on this machine (docs/agentic.md#the-sandbox says what "
                "still holds); counted as agent/sandbox/without_%s",
                _LAYER_NAMES[layer],
                layer,
            )
    return result


_LAYER_NAMES = {
    "landlock": "Landlock (the kernel has none: only the audit hook guards files)",
    "seccomp": "its seccomp filter",
    "namespaces": "namespaces (unshare is refused, as in a restricted pod: a watchdog caps the scratch directory)",
}
_missing_logged: set[str] = set()


def _required(limits: SandboxSpec) -> tuple[str, ...]:
    return tuple(layer for layer in REQUIRED_LAYERS if layer not in limits.allow_missing_layers)


async def _run_program(
    code: str, limits: SandboxSpec, *, audit_hook: bool, required: tuple[str, ...], skip: tuple[str, ...] = ()
) -> SandboxResult:
    """`run_python`, and for tests: with audit_hook=False the kernel layers alone; with `skip` as on a
    machine without those layers (landlock, seccomp). The boot refuses to run the program without a
    `required` layer."""
    scratch = tempfile.mkdtemp(prefix="rldock-sandbox-")
    report_read, report_write = os.pipe()
    try:
        os.set_blocking(report_read, False)
        Path(scratch, boot.PROGRAM).write_text(code, encoding="utf-8")
        configuration = {
            "scratch": scratch,
            "cpu_seconds": limits.cpu_seconds,
            "memory_mib": limits.memory_mib,
            "disk_bytes": limits.disk_mib * 2**20,
            "max_files": limits.max_files,
            "parent": os.getpid(),
            "report_fd": report_write,
            "site": _site_packages(),
            "audit_hook": audit_hook,
            "required": list(required),
            "skip": list(skip),
        }
        argv = [sys.executable, *boot.INTERPRETER_FLAGS, boot.__file__, "start", json.dumps(configuration)]
        environment = {**_ENVIRONMENT, "HOME": scratch, "TMPDIR": scratch}
        result = await _run(argv, cwd=scratch, env=environment, limits=limits, pass_fds=(report_write,), watch=scratch)
        return dataclasses.replace(result, layers=_layers(report_read))
    finally:
        os.close(report_read)
        os.close(report_write)
        remove_tree(scratch)


def _layers(report: int) -> Layers:
    """What the boot's `start` stage wrote before it ran the program (nothing if it failed first)."""
    try:
        data = json.loads(os.read(report, 65536))
    except (BlockingIOError, ValueError):
        return Layers()
    return Layers(
        namespaces=tuple(data.get("namespaces", ())),
        landlock=data.get("landlock", 0),
        seccomp=data.get("seccomp", False),
        reported=True,
    )


def _site_packages() -> list[str]:
    """The worker's site-packages (in a virtual environment, its own and not the base interpreter's),
    added to the child's sys.path without running their .pth files: installed packages such as numpy
    import (not those that need ctypes, which the sandbox refuses: sympy), rldock's editable source
    trees do not."""
    return [path for path in site.getsitepackages() if os.path.isdir(path)]


async def _run(
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    limits: SandboxSpec,
    pass_fds: tuple[int, ...] = (),
    watch: str | None = None,
) -> SandboxResult:
    """Starts `argv` in a process group of its own and collects it; SIGKILL to the group at the wall
    limit, or when the directory `watch` passes the disk limits. The command is a parameter so that
    tests can run a process group a sandboxed program could not make."""
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
        pass_fds=pass_fds,
    )
    assert process.stdout is not None and process.stderr is not None
    readers = [asyncio.ensure_future(stdout.read(process.stdout)), asyncio.ensure_future(stderr.read(process.stderr))]
    waiter = asyncio.ensure_future(process.wait())
    watchdog = _DiskWatchdog(watch, limits) if watch is not None else None
    watching = asyncio.ensure_future(watchdog.run(process)) if watchdog is not None else None
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
        if watching is not None:
            watching.cancel()
    elapsed = time.monotonic() - started
    assert process.returncode is not None
    if process.returncode == boot.EXIT_BOOT_FAILED and stderr.head.startswith(_BOOT_FAILED.encode()):
        # Not raised: a program can exit with the same code and message, and must not stop the
        # rollout. A sandbox that cannot start fails every call, and says so here.
        logger.error("the python tool's sandbox did not start: %s", stderr.text(limits.max_output_chars))
    if watchdog is not None and watchdog.exceeded:
        outcome = Outcome.DISK_LIMIT
    else:
        outcome = _outcome(process.returncode, timed_out=timed_out, elapsed=elapsed, limits=limits)
    return SandboxResult(
        stdout=stdout.text(limits.max_output_chars),
        stderr=stderr.text(limits.max_output_chars),
        exit_code=process.returncode,
        outcome=outcome,
        text=_model_text(stdout, stderr, outcome, limits),
        layers=Layers(),
    )


# How often the watchdog measures the scratch directory where no capped tmpfs holds it. What a program
# writes between two looks is the overshoot (docs/agentic.md#the-sandbox gives it, measured).
_DISK_POLL_SECONDS = 0.02


class _DiskWatchdog:
    """Kills the program's group when its scratch directory holds more than disk_mib of blocks or more
    than max_files entries. Where the boot mounted a capped tmpfs there, this directory only holds the
    program's source and the watchdog never fires: the kernel refuses the writes first.

    Each walk runs in a worker thread (the loop's default executor), not on the event loop, which runs
    every other call of the rollout: a walk of max_files entries takes tens of milliseconds. A walk still
    running when the program ends is harmless: it only reads, and makes unreadable directories readable
    as remove_tree does."""

    def __init__(self, directory: str, limits: SandboxSpec):
        self.directory = directory
        self.max_bytes = limits.disk_mib * 2**20
        self.max_files = limits.max_files
        self.exceeded = False

    async def run(self, process: asyncio.subprocess.Process) -> None:
        while process.returncode is None:
            within = await asyncio.to_thread(
                _within, self.directory, max_bytes=self.max_bytes, max_files=self.max_files
            )
            if not within:
                self.exceeded = True
                _kill_group(process)
                return
            await asyncio.sleep(_DISK_POLL_SECONDS)


def _within(directory: str, *, max_bytes: int, max_files: int) -> bool:
    """Whether the tree under `directory` stays within both limits; stops counting as soon as it does
    not. Iterative (a tree of any depth). A directory the program made unreadable to its owner is made
    readable again (the owner may always chmod); one that stays unreadable counts as over."""
    used_bytes, files = 0, 0
    pending = [directory]
    while pending:
        current = pending.pop()
        try:
            entries = _entries(current)
        except FileNotFoundError:
            continue
        except PermissionError:
            return False
        for entry in entries:
            files += 1
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            used_bytes += info.st_blocks * 512
            if stat.S_ISDIR(info.st_mode):
                pending.append(entry.path)
            if files > max_files or used_bytes > max_bytes:
                return False
    return True


def _entries(directory: str) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as listing:
            return list(listing)
    except PermissionError:
        os.chmod(directory, 0o700)
        with os.scandir(directory) as listing:
            return list(listing)


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
    if returncode == boot.EXIT_MEMORY:
        return Outcome.MEMORY_LIMIT
    if returncode == boot.EXIT_REFUSED:
        return Outcome.REFUSED
    if returncode == boot.EXIT_UNJUDGED:
        return Outcome.HOOK_FAILED
    if returncode == -signal.SIGXCPU:
        return Outcome.CPU_LIMIT
    if returncode == -signal.SIGKILL and elapsed >= limits.cpu_seconds:
        # Not ours (that is timed_out): RLIMIT_CPU's hard limit, for a program that handled SIGXCPU.
        # (A kernel OOM kill also reads as SIGKILL; one that came before cpu_seconds is an error.)
        return Outcome.CPU_LIMIT
    return Outcome.ERROR


_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(root: str) -> None:
    """Deletes `root` and everything under it, however deep (no recursion, no path longer than one
    name: each step is relative to one open directory), also where the program took its own
    permissions away (a directory of mode 0 cannot be listed by a non-root user). Runs once the program
    is dead, so nothing under `root` changes meanwhile. Holds one descriptor at a time."""
    os.chmod(root, 0o700)
    current = os.open(root, _DIRECTORY)
    descended: list[str] = []  # the names from root down to `current`
    try:
        while True:
            child = None
            with os.scandir(current) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        child = entry.name
                        break
                    os.unlink(entry.name, dir_fd=current)
            if child is not None:
                os.chmod(child, 0o700, dir_fd=current)
                below = os.open(child, _DIRECTORY, dir_fd=current)
                os.close(current)
                current = below
                descended.append(child)
                continue
            if not descended:
                break
            above = os.open("..", _DIRECTORY, dir_fd=current)
            os.close(current)
            current = above
            os.rmdir(descended.pop(), dir_fd=current)
    finally:
        os.close(current)
    os.rmdir(root)
