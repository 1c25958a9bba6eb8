"""Runs the user's harness once per episode against the gateway (docs/agentic.md#bring-your-own-agent).

Two forms: `agent.harness: module:function`, `async def run(task, client) -> reward | dict` awaited on the
gateway's loop with a stock `openai.AsyncOpenAI` at the episode's URL and key; and `agent.harness_command`,
a process per episode with `OPENAI_BASE_URL`, `OPENAI_API_KEY`, `RLDOCK_TASK_FILE` (a file holding the data row
as JSON) and `RLDOCK_TASK` (the same JSON, where it fits an environment variable) in an environment of only
these and what finds its interpreter, whose last printed line is its reward (a number, or a JSON object with
`reward`). Of its output only the tail is kept (`OUTPUT_KEPT_BYTES`), and its process group is killed when it
exits, so nothing it started in the background outlives its episode.

The rewards of an episode are the steps of an `environment` reward term: what the harness posted to
`.../reward`, then what it returned (none where it returned None). An episode ends `harness_done`, or with a
counted reason: `harness_error` (it raised), `harness_timeout` (past agent.episode_timeout_s: cancelled, a
command killed), `harness_exit` (a command that exited non-zero), `harness_bad_reward` (a return value that is
no reward), `harness_no_turn` (it never called the model). The iteration goes on either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import os
import signal
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rldock.config.job import AgentSpec
from rldock.runtime.agent.interfaces import REWARD_LIMIT
from rldock.runtime.user_code import load_object

logger = logging.getLogger(__name__)

# What a command's environment keeps of the actor's: what finds its interpreter and packages, nothing else
# (no Ray session, no tokens).
KEPT_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR")
OUTPUT_TAIL_CHARS = 2000
# What is kept of a command's output (stdout and stderr): its tail, whose last line is the reward. A command
# that prints without end costs this much memory, not all it printed.
OUTPUT_KEPT_BYTES = 64 << 10
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
    info: dict = field(default_factory=dict)  # what a dict return held besides `reward`
    error: str | None = None  # harness_error / harness_exit: what went wrong, naming the field


# The harness itself failed (not the model, not the clock), or no agent pod ran it (dispatch.py).
BROKEN = ("harness_error", "harness_exit", "harness_unserved")


def check_not_all_broken(outcomes: Sequence[HarnessOutcome]) -> None:
    """Refuse a batch whose every episode's harness raised or exited non-zero: its samples would be fallback
    turns only, training on nothing the harness did; such a harness is broken, not unlucky."""
    if outcomes and all(outcome.ended in BROKEN for outcome in outcomes):
        raise HarnessError(
            f"every episode of the batch ({len(outcomes)}) failed in the harness; the first: {outcomes[0].error} "
            "(fix the harness: one that fails on every task trains on nothing of its own)"
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

    async def __call__(self, task: dict, *, name: str, base_url: str, api_key: str) -> HarnessOutcome:
        """Episode `name`'s harness run to its outcome (`name` is the dispatcher's; a local run needs only
        the episode's URL and key)."""
        try:
            if self.function is not None:
                value = await asyncio.wait_for(self._call(task, base_url, api_key), self.spec.episode_timeout_s)
            else:
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
        with tempfile.TemporaryDirectory(prefix="rldock-task-") as scratch:
            task_file = Path(scratch) / "task.json"
            task_file.write_text(text, encoding="utf-8")
            env.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY=api_key, RLDOCK_TASK_FILE=str(task_file))
            if len(text.encode()) <= TASK_ENV_BYTES:
                env["RLDOCK_TASK"] = text
            code, output = await self._command_output(env)
        return command_outcome(code, output)

    async def _command_output(self, env: dict[str, str]) -> tuple[int | None, str]:
        """Run the command to its exit (or its timeout, raised): its exit code and the tail of its output."""
        loop = asyncio.get_running_loop()
        transport, tail = await loop.subprocess_exec(
            lambda: OutputTail(loop, OUTPUT_KEPT_BYTES),
            *self.command,
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


def command_outcome(code: int | None, text: str, *, field: str = "agent.harness_command") -> HarnessOutcome:
    """The outcome of a command harness that exited `code` having printed `text` (its last line the reward);
    `field`: what ran it, for the message (a pod's command: spec.agents)."""
    if code != 0:
        tail = text[-OUTPUT_TAIL_CHARS:]
        logger.warning("%s exited %s: %s", field, code, tail)
        return HarnessOutcome("harness_exit", error=f"{field} exited {code}: {tail}")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return value_outcome(None)
    try:
        return value_outcome(json.loads(lines[-1]))
    except ValueError:
        return value_outcome(lines[-1])  # reward_of names it


def value_outcome(value: Any) -> HarnessOutcome:
    """The outcome of a harness that returned (or printed) `value`."""
    reward = reward_of(value)
    if isinstance(reward, str):
        logger.warning("agent.harness: %s", reward)
        return HarnessOutcome("harness_bad_reward")
    number, info = reward
    return HarnessOutcome(rewards=[] if number is None else [number], info=info)
