"""Whether an environment server speaks OpenEnv's protocol, asked before a job starts (`rldock validate`,
the trainer's start): `/health` answers `{"status": "healthy"}`, and `/schema` describes the action (with
the field the model's turn goes into) and the observation. Each problem names the config field, the URL
and what it answered."""

from __future__ import annotations

import time
from collections.abc import Sequence

import requests

from rldock.config.agent_environment import EnvironmentServersSpec
from rldock.config.job import JobConfig
from rldock.config.problems import Problem
from rldock.runtime.agent.service.auth import TOKEN_ENV, client_headers
from rldock.runtime.agent.service.env_client import http_url, resolve_replicas

TIMEOUT_S = 5.0
POLL_S = 1.0  # between questions to a server that does not answer yet


def health(base: str, *, timeout: float = TIMEOUT_S) -> str | None:
    """None if the server at `base` answers `/health` as healthy, else what it answered."""
    url = http_url(base, "/health")
    try:
        answer = requests.get(url, timeout=timeout)
    except requests.RequestException as error:
        return f"{url} did not answer: {type(error).__name__}: {error}"
    try:
        status = answer.json().get("status")
    except (ValueError, AttributeError):
        status = None
    if answer.status_code == 200 and status == "healthy":
        return None
    return f'{url} answered HTTP {answer.status_code} {answer.text[:200]!r}, not OpenEnv\'s {{"status": "healthy"}}'


def schema_problem(base: str, *, action_field: str | None, timeout: float = TIMEOUT_S) -> tuple[str, str] | None:
    """None if `/schema` is OpenEnv's {action, observation, state} and the action takes `action_field`; else
    which field is wrong ("health": the server, "action_field": the action field) and what was found."""
    url = http_url(base, "/schema")
    try:
        answer = requests.get(url, timeout=timeout, headers=client_headers())
        schema = answer.json()
    except (requests.RequestException, ValueError) as error:
        return (
            "health",
            f"{url} did not answer with JSON ({type(error).__name__}: {error}); an OpenEnv server serves /schema",
        )
    if answer.status_code == 401:
        return (
            "health",
            f"{url} answered 401: the server wants the job's token; set {TOKEN_ENV} to the one its --token-file "
            f"or {TOKEN_ENV} holds",
        )
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict) or "observation" not in schema:
        return (
            "health",
            f"{url} answered {str(schema)[:200]!r}: not OpenEnv's {{action, observation, state}} schemas (another "
            "protocol, or another version of it)",
        )
    fields = schema["action"].get("properties")
    if action_field is not None and isinstance(fields, dict) and action_field not in fields:
        return (
            "action_field",
            f"the action of {url} has no field {action_field!r} (its fields: {', '.join(sorted(fields))})",
        )
    return None


def replica_problems(bases: Sequence[str], *, action_field: str | None, wait_s: float = 0.0) -> tuple[str, str] | None:
    """The first problem of the replicas at `bases`: ("health" or "action_field", what was found). A
    server that does not answer yet is asked again for up to `wait_s` (pods still starting)."""
    deadline = time.monotonic() + wait_s
    for base in bases:
        problem = health(base)
        while problem is not None and "did not answer" in problem and time.monotonic() < deadline:
            time.sleep(POLL_S)
            problem = health(base)
        if problem is not None:
            return "health", problem
        found = schema_problem(base, action_field=action_field)
        if found is not None:
            return found
    return None


def environment_server_problems(cfg: JobConfig, *, starting: bool = False) -> list[Problem]:
    """Servers a job reaches at a `url` answer as OpenEnv servers; `service` is an RLJob's to resolve.
    (Servers started from a `command` are asked the same when the trainer has started them.) `starting`:
    the job is about to start, so a server not answering yet gets `servers.startup_timeout_s` (an RLJob's
    environment pods may still be starting); `rldock validate` asks once."""
    agent = cfg.agent
    if agent is None:
        return []
    named: list[tuple[str, EnvironmentServersSpec, str | None]] = []
    if agent.environment is not None and agent.environment.servers is not None:
        named.append(("agent.environment", agent.environment.servers, agent.environment.action_field))
    if agent.sandbox.servers is not None and any(tool.name == "python" for tool in agent.tools):
        named.append(("agent.sandbox", agent.sandbox.servers, "message"))
    problems: list[Problem] = []
    for at, servers, action_field in named:
        if servers.service is not None:
            problems.append(
                Problem(
                    f"{at}.servers.service",
                    f"{servers.service!r} names an environment of an RLJob (spec.environments), whose operator sets "
                    "the URL; with rldock train give servers.url or servers.command",
                )
            )
        elif servers.url is not None:
            wait_s = servers.startup_timeout_s if starting else 0.0
            found = replica_problems(resolve_replicas(servers.url), action_field=action_field, wait_s=wait_s)
            if found is not None:
                kind, problem = found
                field = f"{at}.action_field" if kind == "action_field" else f"{at}.servers.url"
                problems.append(Problem(field, problem))
    return problems
