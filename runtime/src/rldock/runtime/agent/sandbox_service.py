"""The python tool's sandbox as an environment (`rldock env serve
rldock.runtime.agent.sandbox_service:PythonSandbox`): in an RLJob the python tool sends each call to such
a server (agent.sandbox.servers), so the code a model writes never runs in a pod that holds the job's
credentials, weights or Ray session.

One call is one session: the reset brings the call's limits (the job's agent.sandbox) in
`extra_info["sandbox"]`, the one step is the program, and the observation is what the in-process tool
answers, made by the same code (tools.PythonTool): `message` the text the model reads, and two more
fields, `error` (the call failed: the program raised, exited nonzero or hit a limit) and `counts` (the
tool's counters: {"sandbox/without_<layer>": 1} for each kernel layer the program ran without, and
{"sandbox/<outcome>": 1} when the sandbox stopped it), with
done true. The sandbox inside is the in-process one (sandbox/): its kernel layers hold in this
server's process as they do in an actor.

The server's own options are the most a call may ask for (`rldock env serve ...:PythonSandbox --option
memory_mib=256 --option wall_seconds=10`; a limit not given: SandboxSpec's default): a reset asking for
more of any limit is refused (EXECUTION_ERROR naming the limit), and a limit the reset leaves out is the
server's. A client therefore cannot buy itself a terabyte of memory or an hour of wall time.

Where the machine lacks Landlock the server refuses every program, as the in-process tool refuses to
start, unless its admin opts in by name: `--option allow_missing_layers=landlock` (the only layer that
may be missing, as agent.sandbox.allow_missing_layers); a client can never ask for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from rldock.config.agent import SandboxSpec
from rldock.runtime.agent.interfaces import Environment, EnvironmentSession, EpisodeContext, Observation
from rldock.runtime.agent.tools import PythonTool

# The SandboxSpec fields a call's limits may set: all but `servers`, which says where the tool runs (left
# unset here, so the tool this server runs is the in-process one, never a client of another server), and
# `allow_missing_layers`: a client never lowers the server's sandbox, which requires every layer.
LIMIT_FIELDS = tuple(name for name in SandboxSpec.model_fields if name not in ("servers", "allow_missing_layers"))


def sandbox_limits(extra_info: Mapping[str, Any]) -> SandboxSpec:
    """The limits a reset's `extra_info["sandbox"]` sets (a mapping of LIMIT_FIELDS; a field left out
    keeps SandboxSpec's default, as in a job config). A field that is not a limit, or a value out of
    SandboxSpec's range, raises ValueError naming it."""
    given = extra_info.get("sandbox", {})
    if not isinstance(given, Mapping):
        raise ValueError(f'extra_info["sandbox"] must be an object of sandbox limits, got {type(given).__name__}')
    unknown = sorted(set(given) - set(LIMIT_FIELDS))
    if unknown:
        raise ValueError(
            f'extra_info["sandbox"]: {", ".join(unknown)} not a sandbox limit; limits: {", ".join(LIMIT_FIELDS)}'
        )
    return SandboxSpec.model_validate(dict(given))  # pydantic's ValidationError is a ValueError


def within(asked: SandboxSpec, ceiling: SandboxSpec, given: Mapping[str, Any]) -> SandboxSpec:
    """The limits a call runs with: each limit it gave (`given`) if at most the server's `ceiling`, the
    ceiling's for the others; ValueError naming every limit asked above the ceiling."""
    over = [
        f"{name} {getattr(asked, name)} (at most {getattr(ceiling, name)})"
        for name in LIMIT_FIELDS
        if name in given and getattr(asked, name) > getattr(ceiling, name)
    ]
    if over:
        raise ValueError(f'extra_info["sandbox"] asks for more than this server allows: {", ".join(over)}')
    return SandboxSpec.model_validate(
        {name: getattr(asked if name in given else ceiling, name) for name in LIMIT_FIELDS}
        | {"allow_missing_layers": ceiling.allow_missing_layers}  # the server's own, never the client's
    )


def server_sandbox(options: Mapping[str, str]) -> SandboxSpec:
    """The server's ceiling from its `--option`s: the limits (LIMIT_FIELDS) and `allow_missing_layers`, a
    comma-separated list of layers (`landlock`); ValueError naming the option."""
    options = dict(options)
    layers = [layer.strip() for layer in options.pop("allow_missing_layers", "").split(",") if layer.strip()]
    ceiling = sandbox_limits({"sandbox": options})
    try:
        return SandboxSpec.model_validate(ceiling.model_dump() | {"allow_missing_layers": layers})
    except ValidationError:
        raise ValueError(
            f"--option allow_missing_layers={','.join(layers)}: only 'landlock' may be missing (the seccomp filter "
            "cannot be done without)"
        ) from None


class PythonSandbox(Environment):
    """Runs each session's program in the python tool's sandbox and answers what the tool would; its
    options (LIMIT_FIELDS) are the most a call may ask for, and `allow_missing_layers` its own opt-in."""

    def __init__(self, **options: str):
        self.ceiling = server_sandbox(options)  # ValueError names an option that is not a limit

    def session(self) -> EnvironmentSession:
        return PythonSandboxSession(self.ceiling)


class PythonSandboxSession(EnvironmentSession):
    """One tool call: the limits from the reset, the program as the step."""

    tool: PythonTool

    def __init__(self, ceiling: SandboxSpec):
        self.ceiling = ceiling

    async def reset(self, *, seed: int, episode_id: str, context: EpisodeContext) -> Observation:
        asked = sandbox_limits(context.extra_info)
        given = context.extra_info.get("sandbox", {})
        self.tool = PythonTool(within(asked, self.ceiling, given))
        return Observation()

    async def step(self, text: str) -> Observation:
        result = await self.tool.call({"code": text})
        return Observation(
            message=result.text, done=True, fields={"error": result.error, "counts": dict(result.counts)}
        )
