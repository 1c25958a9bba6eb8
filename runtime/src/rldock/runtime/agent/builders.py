"""The job's tools, environment and tool-call parser, built from its `agent` section, and the
renderer of its prompts and turns.

A built-in name is looked up in its registry (agent/interfaces.py); anything else is the user's own class,
loaded as `path/to/file.py:Class` or `package.module:Class` (rldock.runtime.user_code) and checked to
be a subclass of the interface it is named for. Every error is an AgentConfigError whose message
starts with the config field to change.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import TypeVar, cast

from rldock.config import JobConfig
from rldock.config.agent import BUILTIN_TOOLS, AgentSpec
from rldock.config.agent_environment import BUILTIN_ENVIRONMENTS
from rldock.runtime.agent import environments, tools  # noqa: F401  (register the built-ins)
from rldock.runtime.agent.interfaces import (
    ENVIRONMENTS,
    TOOLS,
    Environment,
    Tool,
)
from rldock.runtime.agent.service.env_client import OpenEnvEnvironment
from rldock.runtime.agent.tools import PythonTool
from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.chat.harness_request import read_harness_request
from rldock.runtime.chat.parsers import TOOL_CALL_PARSERS, ToolCallParser
from rldock.runtime.registry import Registry
from rldock.runtime.user_code import load_object

ClassT = TypeVar("ClassT", type[Tool], type[Environment])
MadeT = TypeVar("MadeT", Tool, Environment)


class AgentConfigError(ValueError):
    """The agent section names a tool or environment that cannot be built; the message starts with the
    field to change."""


def build_tools(agent: AgentSpec, *, sandbox_urls: Sequence[str] = ()) -> dict[str, Tool]:
    """The configured tools by the name the model calls them (`Tool.name`), in config order. On an error
    the tools already built are closed. `sandbox_urls`: the python sandbox servers `rldock train` started
    from agent.sandbox.servers.command."""
    built: dict[str, Tool] = {}
    where: dict[str, int] = {}  # tool name -> index in agent.tools
    with ExitStack() as close_on_error:
        for index, spec in enumerate(agent.tools):
            at = f"agent.tools[{index}]"
            cls = _class(spec.name, builtins=BUILTIN_TOOLS, registry=TOOLS, interface=Tool, field=f"{at}.name")
            if spec.name == "python":  # its sandbox servers' URLs are the trainer's to say
                tool: Tool = PythonTool.from_config(agent, spec.options, sandbox_urls=sandbox_urls)
            else:
                tool = _instance(cls, Tool, agent, spec.options, at)
            close_on_error.callback(tool.close)
            name = getattr(tool, "name", None)
            if not isinstance(name, str) or not name:
                raise AgentConfigError(
                    f"{at}.name: {spec.name} has no `name` (a non-empty string, what the model writes to call it); "
                    "set it as a class attribute or in __init__"
                )
            if name in built:
                raise AgentConfigError(
                    f"{at}.name: a second tool called {name!r} (agent.tools[{where[name]}] is one already); the "
                    "model could not tell them apart: list each tool once, or give your own tool another name"
                )
            built[name], where[name] = tool, index
        close_on_error.pop_all()
    return built


def build_environment(agent: AgentSpec, *, replica_urls: Sequence[str] = ()) -> Environment | None:
    """The configured environment, or None when turns without a tool call end the episode.
    `replica_urls`: the servers `rldock train` started from `servers.command` (an `openenv` environment)."""
    spec = agent.environment
    if spec is None:
        return None
    if spec.name == "openenv":  # the one built-in with servers: where they are is the trainer's to say
        return OpenEnvEnvironment.from_config(agent, {}, urls=replica_urls)
    at = "agent.environment"
    cls = _class(
        spec.name, builtins=BUILTIN_ENVIRONMENTS, registry=ENVIRONMENTS, interface=Environment, field=f"{at}.name"
    )
    return _instance(cls, Environment, agent, spec.options, at)


def build_parser(agent: AgentSpec) -> ToolCallParser:
    """The parser of `agent.tool_call_format`."""
    return TOOL_CALL_PARSERS.get(agent.tool_call_format)()


def job_conversation(cfg: JobConfig, tokenizer) -> ChatRenderer | None:
    """The renderer of an agent job's prompts and turns (its tools described), None without an agent. With
    agent.harness_request, the harness's captured first request: its tools, and its messages before each
    row's prompt (the prompts as the gateway renders the harness's requests)."""
    if cfg.agent is None:
        return None
    if cfg.agent.harness_request is not None:
        request = read_harness_request(cfg.agent.harness_request)
        return ChatRenderer(tokenizer, tools=request.tools, preamble=request.messages)
    built = build_tools(cfg.agent)
    try:
        return ChatRenderer(
            tokenizer,
            tools=[tool.schema() for tool in built.values()],
            opens_with_environment=cfg.agent.environment is not None,
        )
    finally:
        for tool in built.values():
            tool.close()


def _class(name: str, *, builtins: tuple[str, ...], registry: Registry[ClassT], interface: type, field: str) -> ClassT:
    """The built-in class `name` names, or the user's class it references, checked against `interface`."""
    if name in builtins:
        return registry.get(name)
    found = load_object(name, field=field, kind="class", error=AgentConfigError)
    assert isinstance(found, type)  # load_object checked the kind
    if not issubclass(found, interface):
        raise AgentConfigError(
            f"{field}: {name} is not a subclass of {interface.__module__}.{interface.__name__}; derive your "
            f"class from it (docs/agentic.md)"
        )
    if inspect.isabstract(found):
        missing = sorted(getattr(found, "__abstractmethods__", ()))
        raise AgentConfigError(
            f"{field}: {name} does not define {', '.join(missing)}, which every {interface.__name__} has"
        )
    return cast(ClassT, found)


def _instance(cls: type[MadeT], interface: type, agent: AgentSpec, options: Mapping[str, str], at: str) -> MadeT:
    """`cls.from_config(agent, options)`; a TypeError or ValueError there (an option the class does not take,
    one it needs left out, or a value it refuses) names the options field."""
    try:
        made = cls.from_config(agent, options)
    except (TypeError, ValueError) as error:
        raise AgentConfigError(
            f"{at}.options: {cls.__name__} cannot be made with options {dict(options)}: {error}; give the "
            "keyword arguments its __init__ takes"
        ) from error
    if not isinstance(made, interface):
        raise AgentConfigError(
            f"{at}.name: {cls.__name__}.from_config returned a {type(made).__name__}, not a {interface.__name__}"
        )
    return made
