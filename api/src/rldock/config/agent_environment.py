"""`agent.environment`: what answers the model when a turn ends without a tool call (a built-in, an OpenEnv
server, or a user's class), and where an OpenEnv environment's servers are; `agent.sandbox.servers` takes
the same servers section. Its checks across fields are `problems` here (rldock.config.problems gathers
them with the agent section's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field, StringConstraints, field_validator

from rldock.config.problem import Problem
from rldock.config.section import COMMAND, MAX_NAME_LENGTH, MAX_PATH_LENGTH, PATH, Spec, UserOptions, check_class_name

if TYPE_CHECKING:
    from rldock.config.job import JobConfig

# The built-in environments (runtime/src/rldock/runtime/agent/); anything else is a user's own class.
BUILTIN_ENVIRONMENTS = ("feedback", "openenv")


class EnvironmentServersSpec(Spec):
    """Where the servers of an OpenEnv environment are (docs/agentic.md#environments-as-services): set exactly
    one of `url`, `command` and `service`. Each episode opens its own session (a WebSocket at `/ws`) on one of
    them, so an environment keeps each episode's state apart."""

    url: str | None = Field(
        default=None,
        min_length=8,
        max_length=MAX_PATH_LENGTH,
        pattern=r"^(http|https|ws|wss)://[^\s]+$",
        description="Servers running elsewhere: `http://host:port` (or https, ws, wss). A host name that resolves "
        "to several addresses (a headless Service) is one replica per address, looked up again when one fails.",
    )
    command: Annotated[list[Annotated[str, StringConstraints(max_length=MAX_PATH_LENGTH)]] | None, COMMAND] = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="`rldock train` only: the server's command, which rldock starts `replicas` times on this "
        "machine, waits for at `/health`, restarts when one dies and stops with the job. `{listen_fd}` in an "
        "argument is replaced by the descriptor of a socket rldock has bound to a free port and passes to the "
        "process (`[rldock, env, serve, my_env.py:MyEnv, --listen-fd, '{listen_fd}']`: no other process can "
        "take the port in between); `{port}` by a free port, for a server that can only bind one itself (rldock "
        "sends it nothing until the port's listening socket is the server's own, and fails the start if another "
        "process took it). The "
        "process gets a clean environment: PATH, HOME, LANG, TMPDIR, the job's token (RLDOCK_ENV_TOKEN) and `env`.",
    )
    env: dict[Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256)], str] = Field(
        default_factory=dict,
        max_length=256,
        description="`command` only: environment variables of the server processes, which get nothing else of "
        "the trainer's environment (its credentials stay with it).",
    )
    service: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="RLJob only: the name of an entry of the RLJob's `spec.environments`, whose pods the operator "
        "runs; it sets `url` (and `sessions_per_replica`) from it.",
    )
    replicas: int = Field(
        default=1, ge=1, le=256, description="`command` only: server processes to start (one port each)."
    )
    sessions_per_replica: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="Sessions (episodes) one server holds at once; episodes beyond all replicas' sessions wait for "
        "one to close.",
    )
    startup_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description="Seconds the servers have to answer `/health` at start (`command`: after starting them).",
    )
    unavailable_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description="Seconds in which no replica may answer before the job fails naming the environment; until "
        "then an episode that finds none ends as `agent/ended/environment_unavailable` and the others go on.",
    )


class EnvironmentSpec(Spec):
    """What answers the model when a turn ends without a tool call: each episode opens a session of it,
    reset at the start and stepped with every such turn."""

    name: Annotated[str, PATH] = Field(
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="`feedback` (says whether the final answer equals the ground truth and, if not, lets the "
        "model try again until agent.max_turns), `openenv` (an OpenEnv environment server, see `servers`), or "
        "your own environment class run in the actor's process, `path/to/file.py:Class` or "
        "`package.module:Class` (docs/agentic.md#your-own-environment).",
    )
    options: UserOptions = Field(
        default_factory=dict,
        max_length=64,
        description="Your own environment only: keyword arguments (strings) passed to its class.",
    )
    servers: EnvironmentServersSpec | None = Field(
        default=None, description="`openenv` only (required there): where its servers are."
    )
    action_field: str = Field(
        default="message",
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="`openenv` only: the field of the environment's action that carries the model's turn (its text).",
    )
    observation_field: str = Field(
        default="message",
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="`openenv` only: the field of the environment's observation shown to the model as the next "
        "user message; an observation without it is shown as JSON.",
    )

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        return check_class_name(name, BUILTIN_ENVIRONMENTS, "environment")


def problems(cfg: JobConfig) -> list[Problem]:
    """An OpenEnv environment names its servers one way; only it has servers and action/observation fields;
    an `environment` reward term needs an environment that answers with rewards."""
    agent = cfg.agent
    environment = agent.environment if agent is not None else None
    problems: list[Problem] = []
    for index, term in enumerate(cfg.reward.terms):
        harnessed = agent is not None and agent.harnessed
        if term.name == "environment" and environment is None and not harnessed:
            problems.append(
                Problem(
                    f"reward.terms[{index}].name",
                    "an `environment` term scores the rewards of the episode's environment (or harness), and the job "
                    "has no agent.environment or agent.harness; set one or remove the term",
                )
            )
    if agent is None:
        return problems
    if environment is not None:
        at = "agent.environment"
        if environment.name == "openenv" and environment.servers is None:
            problems.append(
                Problem(
                    f"{at}.servers",
                    "an `openenv` environment needs its servers: servers.url (running elsewhere), servers.command "
                    "(started by rldock train) or servers.service (an RLJob's spec.environments entry)",
                )
            )
        if environment.name != "openenv":
            # Compared with the defaults, not with what was set: the operator writes every default out.
            defaults = EnvironmentSpec(name=environment.name)
            for field in ("servers", "action_field", "observation_field"):
                if getattr(environment, field) != getattr(defaults, field):
                    problems.append(
                        Problem(
                            f"{at}.{field}",
                            f"only an `openenv` environment takes {field}; remove it from `{environment.name}`",
                        )
                    )
        if environment.servers is not None:
            problems.extend(servers_problems(environment.servers, f"{at}.servers"))
    if agent.sandbox.servers is not None:
        problems.extend(servers_problems(agent.sandbox.servers, "agent.sandbox.servers"))
    return problems


def servers_problems(servers: EnvironmentServersSpec, at: str) -> list[Problem]:
    """One servers section (`agent.environment.servers`, `agent.sandbox.servers`) at `at`: one way to name them."""
    problems: list[Problem] = []
    given = [name for name in ("url", "command", "service") if getattr(servers, name) is not None]
    if len(given) != 1:
        problems.append(
            Problem(
                at,
                f"set exactly one of url, command and service ({', '.join(given) or 'none'} set): url for servers "
                "running elsewhere, command for servers rldock train starts, service for an RLJob's environment pods",
            )
        )
    if servers.command is None and servers.replicas != EnvironmentServersSpec.model_fields["replicas"].default:
        problems.append(
            Problem(
                f"{at}.replicas",
                "only servers started from a `command` take replicas (a url's or a service's replicas are the "
                "addresses its name resolves to); remove it",
            )
        )
    if servers.command is not None and not any(
        "{port}" in argument or "{listen_fd}" in argument for argument in servers.command
    ):
        problems.append(
            Problem(
                f"{at}.command",
                "no argument holds `{listen_fd}` or `{port}`, so every replica would listen on the same port; pass "
                "one, e.g. [rldock, env, serve, my_env.py:MyEnv, --listen-fd, '{listen_fd}']",
            )
        )
    if servers.env and servers.command is None:
        problems.append(Problem(f"{at}.env", "only servers started from a `command` take env; remove it"))
    return problems
