"""Runs the user's harness once per episode against the gateway (docs/agentic.md#bring-your-own-agent).

Two forms, each with its own channel for the episode's result:

- `agent.harness: module:function`, `async def run(task, client) -> reward | dict`, awaited on the gateway's
  loop with a stock `openai.AsyncOpenAI` at the episode's URL and key: its result is what it returns.
- `agent.harness_command`, a process per episode in an environment of only what finds its interpreter
  (`KEPT_ENV`) and `OPENAI_BASE_URL`, `OPENAI_API_KEY`, `RLDOCK_TASK_FILE` (a file holding the data row as
  JSON), `RLDOCK_TASK` (the same JSON, where it fits an environment variable) and `RLDOCK_RESULT_FILE`: its
  result is what it writes to that file (a number, a JSON object with `reward`, or `null`), in a private
  folder of the episode's beside the task's. Its stdout and stderr are its log, never read for a reward (a
  library that prints after the agent's last line cannot change the episode's reward); only their tail is
  kept (`OUTPUT_KEPT_BYTES`), for the message of a command that failed. Its process group is killed when it
  exits, so nothing it started in the background outlives its episode. It and everything it starts run
  under `agent.harness_command_limits` (open files, file size, optionally address space and CPU) with core
  dumps off, set before its first instruction (`limited`).

Agent pods (`spec.agents`, dispatch.py) run the command through the episode runner
(rldock.contract.agent_runner), whose channel is its result post: the exit status and the output's tail,
whose last line is the reward (`command_outcome`).

The rewards of an episode are the steps of an `environment` reward term: what the harness posted to
`.../reward`, then its result (none where it is None). An episode ends `harness_done`, or with a counted
reason: `harness_error` (it raised), `harness_timeout` (past agent.episode_timeout_s: cancelled, a command
killed), `harness_exit` (a command that exited non-zero), `harness_no_result` (a command that exited 0
without writing its result file), `harness_bad_reward` (a result that is no reward), `harness_no_turn` (it
never called the model). The iteration goes on either way, unless every episode of a batch failed in the
harness (`check_not_all_broken`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import json
import logging
import math
import os
import signal
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rldock.config.agent import AgentSpec
from rldock.config.agent_harness import HarnessCommandLimits
from rldock.runtime.agent.interfaces import REWARD_LIMIT
from rldock.runtime.user_code import load_object

logger = logging.getLogger(__name__)

# What a command's environment keeps of the actor's: what finds its interpreter and packages, nothing else
# (no Ray session, no tokens).
KEPT_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR")
# What rldock adds to a command's environment (docs/config-reference.md lists them with KEPT_ENV).
BASE_URL_ENV, API_KEY_ENV = "OPENAI_BASE_URL", "OPENAI_API_KEY"
TASK_ENV, TASK_FILE_ENV, RESULT_FILE_ENV = "RLDOCK_TASK", "RLDOCK_TASK_FILE", "RLDOCK_RESULT_FILE"
OUTPUT_TAIL_CHARS = 2000
# What is kept of a command's output (stdout and stderr): its tail, quoted when it fails. A command that
# prints without end costs this much memory, not all it printed.
OUTPUT_KEPT_BYTES = 64 << 10
# The most of a result file read: a reward and a few measures, never a log.
RESULT_MAX_BYTES = 64 << 10
# The longest task passed in `RLDOCK_TASK` too: Linux refuses an environment string past 128 KiB
# (MAX_ARG_STRLEN) at exec; a longer task is in `RLDOCK_TASK_FILE` only.
TASK_ENV_BYTES = 64 << 10
# After a command exited and its group was killed, how long its output pipe may stay open: only a process
# that left the group (setsid) still holds it, and its output is not waited for.
PIPE_DRAIN_S = 5.0


class HarnessError(ValueError):
    """A harness reference that cannot run; the message names the field."""


def load_harness(reference: str):
    """The function `agent.harness` names, checked: a coroutine function of (task, client)."""
    function = load_object(reference, field="agent.harness", kind="function", error=HarnessError)
    if not inspect.iscoroutinefunction(function):
        raise HarnessError(f"agent.harness: {reference} is not `async def`; write `async def run(task, client)`")
    try:
        inspect.signature(function).bind("task", "client")
    except TypeError as error:
        raise HarnessError(
            f"agent.harness: {reference} cannot be called as run(task, client): {error}; write "
            "`async def run(task, client) -> reward | dict`"
        ) from error
    return function


@dataclass
class HarnessOutcome:
    ended: str = "harness_done"
    rewards: list[float] = field(default_factory=list)  # the returned reward (after the posted ones)
    info: dict = field(default_factory=dict)  # what a dict result held besides `reward`
    error: str | None = None  # a BROKEN outcome's: what went wrong, naming the field


# The harness itself failed (not the model, not the clock), or no agent pod ran it (dispatch.py). Each such
# outcome carries its `error`.
BROKEN = ("harness_error", "harness_exit", "harness_no_result", "harness_bad_reward", "harness_unserved")


def check_not_all_broken(outcomes: Sequence[HarnessOutcome]) -> None:
    """Refuse a batch whose every episode failed in the harness (raised, exited non-zero, wrote no result or no
    reward, was never run): its samples would train on zeros and fallback turns, nothing the harness did; such
    a harness is broken, not unlucky. The error names the reasons and the first episode's."""
    if outcomes and all(outcome.ended in BROKEN for outcome in outcomes):
        counts = collections.Counter(outcome.ended for outcome in outcomes)
        how = (
            f"each ended {outcomes[0].ended}"
            if len(counts) == 1
            else "ended " + ", ".join(f"{reason} ({count})" for reason, count in counts.most_common())
        )
        raise HarnessError(
            f"every episode of the batch ({len(outcomes)}) failed in the harness, {how}; the first: "
            f"{outcomes[0].error} (fix the harness: one that fails on every task trains on nothing of its own)"
        )


def reward_of(value: Any) -> tuple[float | None, dict] | str:
    """(the reward, the rest) of what a harness returned; or what is wrong with it."""
    rest: dict = {}
    if isinstance(value, Mapping):
        rest = {key: item for key, item in value.items() if key != "reward"}
        value = value.get("reward")
    if value is None:
        return None, rest
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"the reward {value!r} is not a finite number"
    if abs(value) > REWARD_LIMIT:
        return f"the reward {value} is past ±{REWARD_LIMIT:g}"
    return float(value), rest


class HarnessRunner:
    """One episode of the configured harness: `await runner(task, base_url=..., api_key=...)`."""

    def __init__(self, spec: AgentSpec):
        self.spec = spec
        self.function = load_harness(spec.harness) if spec.harness is not None else None
        self.command = list(spec.harness_command or [])
        if self.function is None and not self.command:
            raise HarnessError("agent.harness or agent.harness_command: set one to run your own agent")
        if self.command:
            logger.info("agent.harness_command runs %s", confinement())
        # agent.max_concurrent_harness_commands, made on the loop that runs the commands (the gateway's)
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def _command_slots(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.spec.max_concurrent_harness_commands))
        return self._slots[1]

    async def __call__(self, task: dict, *, name: str, base_url: str, api_key: str) -> HarnessOutcome:
        """Episode `name`'s harness run to its outcome (`name` is the dispatcher's; a local run needs only
        the episode's URL and key)."""
        try:
            if self.function is not None:
                value = await asyncio.wait_for(self._call(task, base_url, api_key), self.spec.episode_timeout_s)
            else:
                async with self._command_slots():  # at most agent.max_concurrent_harness_commands at once
                    return await self._run_command(task, base_url, api_key)
        except TimeoutError:
            return HarnessOutcome("harness_timeout")
        except Exception as error:  # broad on purpose: the user's agent failing ends its episode, never the job
            logger.warning("agent.harness raised %s: %s", type(error).__name__, error)
            return HarnessOutcome("harness_error", error=f"agent.harness raised {type(error).__name__}: {error}")
        return value_outcome(value)

    async def _call(self, task: dict, base_url: str, api_key: str) -> Any:
        import openai

        assert self.function is not None
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        try:
            return await self.function(task, client)
        finally:
            await client.close()

    async def _run_command(self, task: dict, base_url: str, api_key: str) -> HarnessOutcome:
        env = {name: os.environ[name] for name in KEPT_ENV if name in os.environ}
        text = json.dumps(task, ensure_ascii=False)
        # The episode's own folder (mode 0700), removed with everything in it when the episode ends.
        with tempfile.TemporaryDirectory(prefix="rldock-episode-") as scratch:
            task_file, result_file = Path(scratch) / "task.json", Path(scratch) / "result.json"
            task_file.write_text(text, encoding="utf-8")
            env.update(
                {
                    BASE_URL_ENV: base_url,
                    API_KEY_ENV: api_key,
                    TASK_FILE_ENV: str(task_file),
                    RESULT_FILE_ENV: str(result_file),
                }
            )
            if len(text.encode()) <= TASK_ENV_BYTES:
                env[TASK_ENV] = text
            code, output = await self._command_output(env)
            try:
                result: str | ResultUnreadable | None = read_result(result_file)
            except ResultUnreadable as error:
                result = error
            return result_outcome(code, output, result)

    async def _command_output(self, env: dict[str, str]) -> tuple[int | None, str]:
        """Run the command to its exit (or its timeout, raised): its exit code and the tail of its output."""
        loop = asyncio.get_running_loop()
        transport, tail = await loop.subprocess_exec(
            lambda: OutputTail(loop, OUTPUT_KEPT_BYTES),
            *limited(self.command, self.spec.harness_command_limits, env),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group, killed with it
        )
        try:
            # its exit, not its pipe's end: a child left in the background keeps the pipe open
            await asyncio.wait_for(asyncio.shield(tail.exited), self.spec.episode_timeout_s)
        finally:  # exited, timed out or cancelled: nothing the command started outlives its episode
            with contextlib.suppress(ProcessLookupError):
                os.killpg(transport.get_pid(), signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(tail.closed), PIPE_DRAIN_S)
            transport.close()
        return transport.get_returncode(), bytes(tail.kept).decode(errors="replace")


# Runs first in a command's process: sets its limits and confines it, then becomes the command (execvpe), so
# both hold before any of the command's code runs and everything it starts inherits them. Not preexec_fn,
# which runs Python in a forked child of a threaded process (the actor's) and can deadlock there. argv: the
# limits and the names of the command's variables as JSON, then the command; the command gets only those
# variables (the interpreter may have added one of its own, LC_CTYPE). A command that cannot be started exits
# 127, as a shell's does, saying why.
#
# The confinement is a Landlock domain of the command's own (`confinement`): a process in it may not read the
# /proc files of a process outside it that ptrace guards (environ, memory, maps, open files), where the pod's
# other processes (Ray's, the actors) hold RAY_AUTH_TOKEN and RLDOCK_ENV_TOKEN. The domain restricts nothing
# else it need not, by the kernel's Landlock ABI:
# - 6+ (Linux 6.12): it scopes signals (none to a process outside it) and handles no file or network right, so
#   files, renames, mounts (in a user namespace of its own) and the network are as they were;
# - 2 to 5: it handles only REFER (moving or linking a file to another folder) and grants it beneath `/`, so
#   renames and links work; but a process with a file right handled may not mount, so the command's own
#   sandboxes (bubblewrap, a rootless container) cannot start, and signals are not scoped;
# - 1: any handled file right would also refuse every move to another folder, so the command runs unconfined.
# Landlock wants no_new_privs, so a setuid program the command starts gains nothing. Unconfined (ABI 0 or 1) is
# said once in the actor's log; where confining fails, the command is not run (exit 126).
LIMITS_THEN_EXEC = """
import ctypes, json, os, resource, sys
setup = json.loads(sys.argv[1])
for name, value in setup["limits"].items():
    limit = getattr(resource, name)
    _, hard = resource.getrlimit(limit)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(limit, (value, value))
libc = ctypes.CDLL(None, use_errno=True)
abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, VERSION): the ABI, or -1
if abi >= 2:
    refer = 1 << 13  # LANDLOCK_ACCESS_FS_REFER
    # (handled_access_fs, handled_access_net, scoped): ABI 6+ scopes SIGNAL only; before, REFER alone
    attr = (ctypes.c_uint64 * 3)(*((0, 0, 2) if abi >= 6 else (refer, 0, 0)))
    ruleset = libc.syscall(444, attr, ctypes.sizeof(attr), 0)
    ok = ruleset >= 0
    if ok and abi < 6:  # REFER granted beneath / (LANDLOCK_RULE_PATH_BENEATH: allowed_access, parent_fd; packed)
        root = os.open("/", os.O_PATH | os.O_CLOEXEC)
        rule = (ctypes.c_uint8 * 12).from_buffer_copy(refer.to_bytes(8, "little") + root.to_bytes(4, "little"))
        ok = libc.syscall(445, ruleset, 1, rule, 0) == 0
        os.close(root)
    if not (ok and libc.prctl(38, 1, 0, 0, 0) == 0 and libc.syscall(446, ruleset, 0) == 0):
        print(f"cannot confine the command (Landlock ABI {abi}): {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        sys.exit(126)
    os.close(ruleset)
env = {name: value for name, value in os.environ.items() if name in setup["env"]}
try:
    os.execvpe(sys.argv[2], sys.argv[2:], env)
except OSError as error:
    print(f"cannot start {sys.argv[2]!r}: {error.strerror}", file=sys.stderr)
    sys.exit(127)
"""
MIB = 2**20


def confinement() -> str:
    """How this machine confines a harness command from the pod's other processes (LIMITS_THEN_EXEC), for the
    actor's log."""
    from rldock.runtime.sandbox.kernel import landlock_abi

    abi = landlock_abi()
    if abi < 2:
        have = "no Landlock" if abi < 1 else "Landlock ABI 1, whose file rules would refuse moves between folders"
        return (
            f"unconfined: this kernel has {have} (Linux 5.19+ confines), so a command may read the tokens in "
            "the environments of the pod's other processes of its uid"
        )
    if abi >= 6:
        return f"in a Landlock domain of its own (ABI {abi}): it may not read or signal the pod's other processes"
    return (
        f"in a Landlock domain of its own (ABI {abi}): it may not read the pod's other processes' /proc files; "
        "it may not mount (Landlock before ABI 6 refuses mounts to a confined process) and may signal them"
    )


def limited(command: Sequence[str], limits: HarnessCommandLimits, env: Mapping[str, str]) -> list[str]:
    """`command` started under `limits` (agent.harness_command_limits), no core dumps and confined, with `env`
    (the variables' names travel in argv, their values, the key among them, only in the environment)."""
    values = {
        "RLIMIT_CORE": 0,
        "RLIMIT_NOFILE": limits.open_files,
        "RLIMIT_FSIZE": limits.file_size_mib * MIB,
        **({"RLIMIT_AS": limits.memory_mib * MIB} if limits.memory_mib is not None else {}),
        **({"RLIMIT_CPU": limits.cpu_seconds} if limits.cpu_seconds is not None else {}),
    }
    # -I: the helper itself reads no PYTHON* variable and no site packages; the command still gets its env.
    setup = json.dumps({"limits": values, "env": sorted(env)})
    return [sys.executable, "-I", "-c", LIMITS_THEN_EXEC, setup, *command]


class OutputTail(asyncio.SubprocessProtocol):
    """A command's output as it arrives, of which the last `limit` bytes are kept; `exited` is done when the
    process exits, `closed` when its output pipe has closed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int):
        self.limit = limit
        self.kept = bytearray()
        self.exited: asyncio.Future = loop.create_future()
        self.closed: asyncio.Future = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.kept += data
        if len(self.kept) > self.limit:
            del self.kept[: len(self.kept) - self.limit]

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


def exit_outcome(code: int | None, text: str, *, field: str) -> HarnessOutcome | None:
    """`harness_exit` for a command that exited `code` other than 0 having printed `text` (its tail quoted);
    None for one that exited 0."""
    if code == 0:
        return None
    tail = text[-OUTPUT_TAIL_CHARS:]
    logger.warning("%s exited %s: %s", field, code, tail)
    return HarnessOutcome("harness_exit", error=f"{field} exited {code}: {tail}")


class ResultUnreadable(ValueError):
    """A result file that is not a regular file of at most RESULT_MAX_BYTES; the message says which."""


def read_result(path: Path) -> str | None:
    """What a command wrote to its result file, or None where it wrote none. Opened without following a link
    or waiting on a FIFO, and read only as a regular file of at most RESULT_MAX_BYTES (ResultUnreadable
    otherwise): the command is the user's, and the actor's event loop reads it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as error:  # a link (ELOOP) or no permission: written, but not as a result
        raise ResultUnreadable(f"cannot be read: {error.strerror}") from error
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ResultUnreadable("is not a regular file")
        data = file.read(RESULT_MAX_BYTES + 1)
    if len(data) > RESULT_MAX_BYTES:
        raise ResultUnreadable(f"holds more than {RESULT_MAX_BYTES} bytes; write the reward, not a log")
    return data.decode(errors="replace")


def result_outcome(
    code: int | None, output: str, result: str | ResultUnreadable | None, *, field: str = "agent.harness_command"
) -> HarnessOutcome:
    """The outcome of a command that exited `code` having printed `output` (its log, never read for a reward)
    and written `result` to its result file (what read_result returned or raised; None where it wrote none)."""
    exited = exit_outcome(code, output, field=field)
    if exited is not None:
        return exited
    if result is None:
        error = (
            f"{field} exited 0 without writing its result to ${RESULT_FILE_ENV} (a number, a JSON object with "
            "`reward`, or null for none but what it posted); what it prints is its log, not its reward"
        )
        logger.warning("%s", error)
        return HarnessOutcome("harness_no_result", error=error)
    if isinstance(result, ResultUnreadable):
        logger.warning("%s: its result file (%s) %s", field, RESULT_FILE_ENV, result)
        return HarnessOutcome("harness_bad_reward", error=f"{field}: its result file (${RESULT_FILE_ENV}) {result}")
    try:
        value = json.loads(result)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        value = result.strip()  # reward_of names it
    return value_outcome(value, field=f"{field}'s result (${RESULT_FILE_ENV})")


def command_outcome(code: int | None, text: str, *, field: str = "spec.agents[].command") -> HarnessOutcome:
    """The outcome of an agent pod's command (dispatch.py), which the episode runner reports as its exit status
    `code` and its output's tail `text`, whose last line is the reward (a number, or a JSON object with
    `reward`); `field`: what ran it, for the message."""
    exited = exit_outcome(code, text, field=field)
    if exited is not None:
        return exited
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return value_outcome(None, field=field)
    try:
        return value_outcome(json.loads(lines[-1]), field=field)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return value_outcome(lines[-1], field=field)  # reward_of names it


def value_outcome(value: Any, *, field: str = "agent.harness") -> HarnessOutcome:
    """The outcome of a harness whose result is `value` (`field`: what gave it, for the message)."""
    reward = reward_of(value)
    if isinstance(reward, str):
        logger.warning("%s: %s", field, reward)
        return HarnessOutcome("harness_bad_reward", error=f"{field}: {reward}")
    number, info = reward
    return HarnessOutcome(rewards=[] if number is None else [number], info=info)
