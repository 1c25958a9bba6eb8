"""The interfaces of agentic rollouts: a tool the policy calls, an environment that answers it between
turns, and a parser that finds tool calls in a generation. Each is a registry (names in the job
config's `agent` section); a user's own class loads as `path/to/file.py:Class` or `module:Class`.

A tool's `call` and an environment's `respond` are coroutines: the rollout loop runs them on an event
loop of its own while the engine keeps generating for the other samples (agent/rollout.py), so a
tool that waits (a subprocess, an HTTP request) never stalls generation. They must not raise for
anything the model wrote: a bad argument is a `ToolResult(..., error=True)` the model reads. An
exception that escapes is still caught by the loop, answered to the model as an error and counted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rldock.config.job import AgentSpec
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
class EnvironmentReply:
    """The environment's answer to a turn that ended without a tool call: `message` goes to the model
    as a `user` turn when the episode goes on; `done` ends it."""

    done: bool
    message: str | None = None


class Environment(ABC):
    """Answers the model between turns (verl calls this an interaction). One instance serves every
    episode of a rollout, so it keeps no per-episode state of its own: what it needs is in its
    arguments."""

    @classmethod
    def from_config(cls, agent: AgentSpec, options: Mapping[str, str]) -> Environment:
        """As `Tool.from_config`: options as keyword arguments, built-ins read the agent section."""
        return cls(**options)

    @abstractmethod
    async def respond(self, final_text: str, *, turn: int, context: EpisodeContext) -> EnvironmentReply:
        """`final_text`: the model's last turn, decoded; `turn`: model turns so far (1 after the first)."""

    def close(self) -> None:
        """Free what the environment holds, where rldock discards it before its process ends (as `Tool.close`)."""
        return  # most environments hold nothing


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """A generation's tool calls in order, and the calls it tried to write but got wrong (a message for
    each, which the model is told as a tool error)."""

    calls: tuple[ToolCall, ...] = ()
    malformed: tuple[str, ...] = ()

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.malformed)


class ToolCallParser(ABC):
    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """The tool calls in one decoded generation (special tokens kept)."""


# name -> the built-in class (a user's class is loaded from its reference instead, agent/loading.py);
# instances are made with `from_config`.
TOOLS: Registry[type[Tool]] = Registry("tool", field="agent.tools[].name")
ENVIRONMENTS: Registry[type[Environment]] = Registry("environment", field="agent.environment.name")
TOOL_CALL_PARSERS: Registry[type[ToolCallParser]] = Registry("tool call format", field="agent.tool_call_format")
