"""rldock's client of OpenEnv environment servers: the `openenv` environment, one WebSocket session per
episode (docs/agentic.md#environments-as-services).

A small client of the documented protocol rather than `openenv-core`, whose base install pulls gradio,
fastmcp and openai into the trainer's image; the tests run it against `openenv-core`'s own server
classes. On the wire (OpenEnv 0.3): a session is a WebSocket at `<base>/ws`; the client sends
`{"type": "reset", "data": {...}}`, `{"type": "step", "data": <action>}` and `{"type": "close"}`; the
server answers `{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}` or
`{"type": "error", "data": {"message": ..., "code": ...}}`.

Replicas: the base URLs the servers listen at, given (`rldock train` starting `servers.command`), or
the addresses `servers.url`'s host resolves to (a headless Service: one per ready pod), looked up again
when a replica fails. Each session goes to the replica with the fewest open sessions that did not fail
recently; a session whose replica goes away ends its episode (SessionFailed), and when no replica
answers the episode ends as `environment_unavailable` until `servers.unavailable_timeout_s` has
passed without any answer, after which the job fails (EnvironmentUnavailable, fatal).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import websockets
from websockets.asyncio.client import ClientConnection, connect

from rldock.config.agent import AgentSpec
from rldock.config.agent_environment import EnvironmentServersSpec
from rldock.runtime.agent.interfaces import (
    ENVIRONMENTS,
    REWARD_LIMIT,
    Environment,
    EnvironmentProtocolError,
    EnvironmentSession,
    EnvironmentUnavailable,
    EpisodeContext,
    Observation,
    SessionFailed,
)
from rldock.runtime.agent.service import json_wire
from rldock.runtime.agent.service.auth import client_headers

logger = logging.getLogger(__name__)

# A replica that failed is not chosen again for this long, unless every replica has failed.
RETRY_AFTER_S = 5.0
# Seconds to open a session's connection (a replica that does not accept in time is taken as gone).
CONNECT_TIMEOUT_S = 10.0
# Every replica refused a session as full (a server counts a closed session until its close has run, a
# moment after the client's): wait this long before asking again, within the reset's time limit.
CAPACITY_RETRY_S = 0.1
# Close codes with which this client's websockets library ends a connection whose server broke the
# protocol: 1002 a bad frame, 1007 a text frame that is not UTF-8, 1009 a message over wire.MAX_MESSAGE_BYTES
# (decompressed). The server answered, wrongly: its episode ends as a protocol error, the replica stays.
PROTOCOL_CLOSE_CODES = frozenset({1002, 1007, 1009})


class CapacityReached(SessionFailed):
    """The replica holds its most sessions: the reset is tried on another one, or again shortly."""


def ws_url(base: str) -> str:
    """The session endpoint of a server's base URL (http(s) becomes ws(s))."""
    parts = urlsplit(base)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/ws", "", ""))


def http_url(base: str, path: str) -> str:
    """`path` on a server's base URL over http(s) (ws(s) becomes http(s))."""
    parts = urlsplit(base)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + path, "", ""))


def resolve_replicas(url: str, *, lookup: Callable[..., list] = socket.getaddrinfo) -> list[str]:
    """One base URL per address `url`'s host resolves to (a headless Service's ready pods), in a stable
    order; the URL itself where its host is an address or resolves to one."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port
    try:
        addresses = sorted({info[4][0] for info in lookup(host, port, type=socket.SOCK_STREAM)})
    except OSError:
        return [url]  # unresolvable now: connecting will say so, and the next lookup may find it
    if len(addresses) <= 1:
        return [url]
    suffix = f":{port}" if port else ""
    hosts = [f"[{address}]" if ":" in address else address for address in addresses]  # IPv6 in brackets
    return [urlunsplit((parts.scheme, host + suffix, parts.path, "", "")) for host in hosts]


@dataclass
class Replica:
    base: str
    open_sessions: int = 0
    failed_at: float | None = None  # monotonic time of the last failure, None while it answers


class Replicas:
    """The replicas of one environment service, which one a new session goes to, and whether any has
    answered recently enough for the job to go on."""

    def __init__(
        self,
        *,
        name: str,
        servers: EnvironmentServersSpec,
        urls: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,
        lookup: Callable[[str], list[str]] = resolve_replicas,
    ):
        if not urls and servers.url is None:
            raise ValueError(f"{name}: no replica URLs (servers.command started none) and no servers.url")
        self.name, self.servers, self.clock, self.lookup = name, servers, clock, lookup
        self.given = list(urls)  # fixed replicas (started by rldock train); else looked up from servers.url
        self.replicas: dict[str, Replica] = {}
        self.refresh()
        self.last_answer = clock()  # the servers answered /health before the job started (preflight)

    def refresh(self) -> None:
        """Look the replicas up again (a headless Service's pods come and go); their counts are kept."""
        bases = self.given or self.lookup(self.servers.url or "")
        self.replicas = {base: self.replicas.get(base, Replica(base)) for base in bases}

    @property
    def capacity(self) -> int:
        return len(self.replicas) * self.servers.sessions_per_replica

    def candidates(self) -> list[Replica]:
        """Replicas to try for a new session, best first: not failed recently, fewest open sessions."""
        now = self.clock()
        replicas = list(self.replicas.values())
        fresh = [r for r in replicas if r.failed_at is None or now - r.failed_at >= RETRY_AFTER_S]
        return sorted(fresh or replicas, key=lambda r: (r.open_sessions, r.base))

    def answered(self, replica: Replica) -> None:
        replica.failed_at = None
        self.last_answer = self.clock()

    def failed(self, replica: Replica) -> None:
        replica.failed_at = self.clock()

    def unavailable(self, tried: Sequence[str], errors: Sequence[str]) -> EnvironmentUnavailable:
        """The error of a session that found no replica: fatal once none has answered for the limit."""
        silent = self.clock() - self.last_answer
        limit = self.servers.unavailable_timeout_s
        fatal = silent >= limit
        what = "; ".join(f"{url}: {error}" for url, error in zip(tried, errors)) or "no replica to try"
        message = (
            f"agent environment {self.name}: no replica answered for {silent:.0f} s (servers.unavailable_timeout_s "
            f"{limit:g}); tried {what}"
        )
        return EnvironmentUnavailable(message, fatal=fatal)


@ENVIRONMENTS.register("openenv")
class OpenEnvEnvironment(Environment):
    """An OpenEnv environment served elsewhere: each episode a WebSocket session on one of its replicas.
    The model's turn goes out as the action's `action_field`; the observation's `observation_field` comes
    back as the next message (the whole observation as JSON where it lacks that field)."""

    def __init__(
        self,
        *,
        name: str,
        servers: EnvironmentServersSpec,
        action_field: str = "message",
        observation_field: str = "message",
        urls: Sequence[str] = (),
    ):
        self.name, self.action_field, self.observation_field = name, action_field, observation_field
        self.replicas = Replicas(name=name, servers=servers, urls=urls)
        self.max_sessions = self.replicas.capacity

    @classmethod
    def from_config(cls, agent: AgentSpec, options: Mapping[str, str], urls: Sequence[str] = ()) -> Environment:
        spec = agent.environment
        assert spec is not None and spec.servers is not None, "config/problems.py requires servers for openenv"
        return cls(
            name=describe(spec.servers),
            servers=spec.servers,
            action_field=spec.action_field,
            observation_field=spec.observation_field,
            urls=urls,
        )

    def session(self) -> EnvironmentSession:
        return OpenEnvSession(self)

    def observation(self, data: Any) -> Observation:
        """An observation message's `data` as the model reads it; EnvironmentProtocolError where it is not
        OpenEnv's {observation, reward, done} or its reward is not a finite number within REWARD_LIMIT."""
        if not isinstance(data, dict) or not isinstance(data.get("observation", {}), dict):
            raise EnvironmentProtocolError(
                f"{self.name}: an observation that is not OpenEnv's {{observation, reward, done}}: {data!r:.200}"
            )
        fields = data.get("observation") or {}
        shown = fields.get(self.observation_field)
        if isinstance(shown, str):
            message: str | None = shown
        elif shown is None and not (set(fields) - {self.observation_field}):
            message = None
        else:
            message = json.dumps(fields, ensure_ascii=False, sort_keys=True)
        reward = data.get("reward")
        if reward is not None and (
            isinstance(reward, bool) or not isinstance(reward, (int, float)) or not finite_reward(float(reward))
        ):
            raise EnvironmentProtocolError(
                f"{self.name}: a reward that is not a finite number within {REWARD_LIMIT:g}: {reward!r:.100}"
            )
        done = data.get("done")
        if done is not None and not isinstance(done, bool):
            raise EnvironmentProtocolError(f"{self.name}: a `done` that is not true or false: {done!r:.100}")
        reward = None if reward is None else float(reward)
        others = {key: value for key, value in fields.items() if key != self.observation_field}
        return Observation(message=message, reward=reward, done=bool(done), fields=others)


def finite_reward(reward: float) -> bool:
    """Whether a step's reward is one the dock can keep: finite and within REWARD_LIMIT."""
    return math.isfinite(reward) and abs(reward) <= REWARD_LIMIT


def describe(servers: EnvironmentServersSpec) -> str:
    """The environment's name in messages and logs: its URL, service or command."""
    if servers.url is not None:
        return servers.url
    if servers.service is not None:
        return f"service {servers.service}"
    return " ".join(servers.command or ())


class OpenEnvSession(EnvironmentSession):
    """One episode's WebSocket session on one replica."""

    def __init__(self, environment: OpenEnvEnvironment):
        self.environment = environment
        self.replica: Replica | None = None
        self.connection: ClientConnection | None = None

    async def reset(self, *, seed: int, episode_id: str, context: EpisodeContext) -> Observation:
        data = {
            "seed": seed,
            "episode_id": episode_id,
            "ground_truth": context.ground_truth,
            "data_source": context.data_source,
            "extra_info": dict(context.extra_info),
        }
        full: set[str] = set()  # replicas that refused this session as full
        while True:
            await self._connect(avoid=full)
            try:
                return await self._exchange({"type": "reset", "data": data})
            except CapacityReached:
                assert self.replica is not None
                full.add(self.replica.base)
                await self.close()
                if full >= set(self.environment.replicas.replicas):
                    full.clear()
                    await asyncio.sleep(CAPACITY_RETRY_S)

    async def step(self, text: str) -> Observation:
        return await self._exchange({"type": "step", "data": {self.environment.action_field: text}})

    async def close(self) -> None:
        connection, replica = self.connection, self.replica
        self.connection = self.replica = None
        try:
            if connection is not None:
                try:
                    await connection.send(json.dumps({"type": "close"}))
                except websockets.ConnectionClosed:
                    pass  # the server ended it already
                finally:
                    await connection.close()
        finally:  # counted until the close handshake is done, as the server counts it
            if replica is not None:
                replica.open_sessions -= 1

    async def _connect(self, avoid: Collection[str] = ()) -> None:
        replicas = self.environment.replicas
        tried: list[str] = []
        errors: list[str] = []
        for attempt in range(2):  # the known replicas, then those a fresh lookup finds
            if attempt:
                replicas.refresh()
            candidates = replicas.candidates()
            for replica in [r for r in candidates if r.base not in avoid] or candidates:
                if replica.base in tried:
                    continue
                tried.append(replica.base)
                # Counted before the connect's await: sessions opened at once (a rollout's first episodes)
                # then spread over the replicas instead of all choosing the one that had the fewest.
                replica.open_sessions += 1
                try:
                    self.connection = await connect(
                        ws_url(replica.base),
                        open_timeout=CONNECT_TIMEOUT_S,
                        max_size=json_wire.MAX_MESSAGE_BYTES,
                        additional_headers=client_headers(),
                    )
                except (OSError, TimeoutError, websockets.InvalidHandshake, websockets.InvalidURI) as error:
                    replica.open_sessions -= 1
                    replicas.failed(replica)
                    errors.append(f"{type(error).__name__}: {error}")
                    continue
                except BaseException:  # cancelled (the rollout's timeout): the slot was never used
                    replica.open_sessions -= 1
                    raise
                self.replica = replica
                return
        raise replicas.unavailable(tried, errors)

    async def _exchange(self, message: dict) -> Observation:
        """Send `message` and read its answer. What the server answers wrongly (wire.loads' limits, a frame
        the library refuses, a shape that is not OpenEnv's) raises EnvironmentProtocolError; the replica
        still counts as answering, so a broken server ends episodes, never the job."""
        connection, replica = self.connection, self.replica
        assert connection is not None and replica is not None, "reset opens the session first"
        environment = self.environment
        where = f"{environment.name}: {replica.base}"
        try:
            await connection.send(json.dumps(message))
            raw = await connection.recv()
        except websockets.ConnectionClosed as error:
            if error.sent is not None and error.sent.code in PROTOCOL_CLOSE_CODES:
                environment.replicas.answered(replica)
                raise EnvironmentProtocolError(f"{where} sent a message this client refused: {error}") from error
            environment.replicas.failed(replica)
            raise SessionFailed(f"{where}: the session was closed: {error}") from error
        environment.replicas.answered(replica)
        try:
            answer = json_wire.loads(raw)
        except json_wire.WireError as error:
            raise EnvironmentProtocolError(
                f"{where} answered something that is not JSON within limits: {error}"
            ) from error
        if not isinstance(answer, dict) or answer.get("type") not in ("observation", "error"):
            raise EnvironmentProtocolError(f"{where} answered {answer!r:.200}, not an OpenEnv observation")
        if answer["type"] == "error":
            data = answer.get("data")
            if not isinstance(data, dict):
                raise EnvironmentProtocolError(f"{where} answered an error whose data is not an object: {data!r:.200}")
            code, text = data.get("code"), data.get("message")
            failure = CapacityReached if code == "CAPACITY_REACHED" else SessionFailed
            raise failure(f"{where} answered {message['type']} with error {code!r:.60}: {text!s:.500}")
        return environment.observation(answer.get("data"))
