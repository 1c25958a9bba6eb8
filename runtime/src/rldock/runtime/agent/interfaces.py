"""The interfaces of agentic rollouts: a tool the policy calls and an environment whose sessions answer it
between turns (the parser that finds tool calls in a generation is chat/parsers.py's `ToolCallParser`).
Each is a registry (names in the job config's `agent` section); a user's own class loads as
`path/to/file.py:Class` or `module:Class`.

A tool's `call` and a session's `reset`, `step` and `close` are coroutines: the rollout loop runs them
on an event loop of its own while the engine keeps generating for the other samples (agent/episode_loop.py),
so a tool or an environment that waits (a subprocess, an HTTP request) never stalls generation. They
must not raise for anything the model wrote: a bad argument is a `ToolResult(..., error=True)` or an
observation the model reads. An exception that escapes a tool is still caught by the loop, answered to
the model as an error and counted; one that escapes an environment of the actor's own process stops
the job (SessionFailed and EnvironmentUnavailable, what a service's client raises, end one episode).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rldock.config.agent import AgentSpec
from rldock.runtime.registry import Registry


@dataclass(frozen=True)
class ToolResult:
    """What a tool returns to the model: the text of the `tool` message, and whether the call failed
    (bad arguments, the program raised, a limit stopped it): failures are counted per tool. `counts`
    are the tool's own counters for this call, summed per iteration as `agent/<key>` (the python tool
    counts the sandbox layers a call ran without)."""

    text: str
    error: bool = False
    counts: Mapping[str, int] = field(default_factory=dict)


class Tool(ABC):
    """A function the policy may call. `name` is what the model writes in a call; `parameters` is the
    JSON schema of its arguments; both go to the chat template as OpenAI's function format."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    @classmethod
    def from_config(cls, agent: AgentSpec, options: Mapping[str, str]) -> Tool:
        """The tool as the job configures it: a user's class gets its ToolSpec.options as keyword
        arguments; a built-in overrides this to read its settings from the agent section."""
        return cls(**options)

    def schema(self) -> dict:
        """The tool as a chat template's `tools=` takes it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }

    @abstractmethod
    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        """Run the tool on the arguments the model wrote (a JSON object, not yet checked)."""

    def close(self) -> None:
        """Free what the tool holds (processes, connections), where rldock discards the tool before its
        process ends (the driver builds the tools once to read their schemas); an actor's tools live as
        long as its process, which Ray ends with the job."""
        return  # most tools hold nothing


@dataclass(frozen=True)
class EpisodeContext:
    """What an environment knows of the sample it answers: its train-file row."""

    ground_truth: str
    data_source: str
    extra_info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    """What an environment answers a reset or a step (OpenEnv's observation, as the model reads it):
    `message` goes to the model as the next `user` message (None or "": nothing to say), `reward` is
    this step's (None: none), `done` ends the episode. `fields` are more fields of the observation
    as OpenEnv sends it (an object of which `message` is one field), JSON values under names other
    than message, reward and done: the python sandbox environment says there whether the program
    failed and which sandbox layers it ran without (agent/sandbox_service.py)."""

    message: str | None = None
    reward: float | None = None
    done: bool = False
    fields: Mapping[str, Any] = field(default_factory=dict)


class EnvironmentSession(ABC):
    """One episode's session with an environment: reset once at the episode's start, then stepped with
    every model turn that ends without a tool call, until an observation says `done`. A session may
    keep the episode's state (a checkout, a database, a game); nothing is shared between sessions.
    `close` is called once on every path (done, error, timeout, job stop)."""

    @abstractmethod
    async def reset(self, *, seed: int, episode_id: str, context: EpisodeContext) -> Observation:
        """Start the episode. `seed` is derived from (job seed, iteration, sample), so a resumed job's
        episodes start the same; `context` is the sample's train-file row."""

    @abstractmethod
    async def step(self, text: str) -> Observation:
        """The model's turn (decoded, special tokens dropped) as the action; the observation that follows."""

    async def close(self) -> None:
        """End the session and free what it holds."""
        return  # a session that holds nothing has nothing to free


class SessionFailed(RuntimeError):
    """An episode's session broke (its replica went away, the server answered an error or spoke another
    protocol): that episode ends (`agent/ended/environment_error`), the others go on."""


class EnvironmentProtocolError(SessionFailed):
    """A server's answer broke the protocol or its limits (not JSON, too large or too deep, a reward that
    is not a finite number within REWARD_LIMIT, an error whose data is not an object): that episode ends
    (`agent/ended/environment_protocol_error`), the others go on."""


# The largest reward magnitude an environment step may give: the dock keeps rewards as float32 and a
# group's advantages add them, so a reward near float32's range (3.4e38) would overflow to inf there.
REWARD_LIMIT = 1e6


class EnvironmentUnavailable(RuntimeError):
    """No replica of a service environment answered. Until `servers.unavailable_timeout_s` has passed
    without any answer the episode ends (`agent/ended/environment_unavailable`); after it (`fatal`) the
    job fails with this message, which names the environment and what was tried."""

    def __init__(self, message: str, *, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal

    def __reduce__(self):  # keep `fatal` across Ray's pickling
        return (_unavailable, (str(self), self.fatal))


def _unavailable(message: str, fatal: bool) -> EnvironmentUnavailable:
    return EnvironmentUnavailable(message, fatal=fatal)


class Environment(ABC):
    """What answers the model between turns (verl calls this an interaction, OpenEnv an environment):
    one instance per rollout engine, which opens one session per episode. `max_sessions`: how many
    sessions it holds at once (None: no limit); an episode beyond them waits for one to close."""

    max_sessions: int | None = None

    @classmethod
    def from_config(cls, agent: AgentSpec, options: Mapping[str, str]) -> Environment:
        """As `Tool.from_config`: options as keyword arguments, built-ins read the agent section."""
        return cls(**options)

    @abstractmethod
    def session(self) -> EnvironmentSession:
        """A new session for one episode (not yet reset)."""

    def close(self) -> None:
        """Free what the environment holds, where rldock discards it before its process ends (as `Tool.close`)."""
        return  # most environments hold nothing


# name -> the built-in class (a user's class is loaded from its reference instead, agent/builders.py);
# instances are made with `from_config`.
TOOLS: Registry[type[Tool]] = Registry("tool", field="agent.tools[].name")
ENVIRONMENTS: Registry[type[Environment]] = Registry("environment", field="agent.environment.name")
