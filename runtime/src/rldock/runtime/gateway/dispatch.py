"""The episode source of agent pods (`agent.harness_pods`, an RLJob's `spec.agents`): each episode waits on
the gateway until a pod's runner leases it, and its outcome is what the runner reports, or how its lease
ended. It takes the place of `HarnessRunner` in the harness rollout (episodes.py): the same gateway, sessions
and rows; only who runs the user's command differs.

Routes, beside the sessions' on the same gateway (the protocol the runner speaks,
rldock.contract.agent_runner), each asking for the job's pod token as a bearer token (401 otherwise):

- `POST /episodes/lease`: the oldest waiting episode, `{"episode", "lease", "path", "api_key", "task",
  "timeout_s"}` (`path`: the session's base path; the runner puts the address it leased from before it;
  `lease`: a secret of this lease alone), or 204 with Retry-After when none waits;
- `POST /episodes/<id>/heartbeat`: 200 while the lease holds, 410 once the episode ended (the runner then
  kills its command);
- `POST /episodes/<id>/result`: `{"exit_code", "output"}`, the command's exit status and its output's tail,
  whose last line is the reward (harness_runner.command_outcome; `agent.harness_command` in the actor writes
  a result file instead).

Heartbeats and results also ask for the lease's secret (`X-Rldock-Lease`; 403 otherwise): the pod token is
every agent pod's (and readable by the commands they run), and episode names are no secret, so without it one
pod could post the reward of, or keep alive, an episode another pod holds.

How an episode ends besides its result, each counted under `agent/ended/<reason>`: `harness_lost`, its
lease's heartbeats stopped for `LEASE_S` (the pod died or lost the network); `harness_timeout`, leased past
`agent.episode_timeout_s`; `harness_unserved`, no pod leased it within `agent.episode_timeout_s` (a batch
whose every episode went unserved stops the job: no pod runs, harness.BROKEN). Nothing waits longer than the
episode's timeout plus `LEASE_S`, so an iteration always ends.

Concurrency: everything runs on the gateway's event loop (routes and the per-episode waits), so the
waiting queue and the leases need no lock. The loop renders nothing (gateway/server.py renders on threads
beside it), so a harness's long request never delays a heartbeat into `harness_lost`. A lease's or a result's
body must arrive within `body_timeout_s` (408 otherwise, and nothing leased); the connections themselves are
capped and timed as every gateway connection is (connections.py).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rldock.runtime.gateway.connections import BODY_TIMEOUT_S, BodyTooLarge, BodyUnread, read_body
from rldock.runtime.gateway.harness_runner import HarnessOutcome, command_outcome

logger = logging.getLogger(__name__)

LEASE_S = 10.0  # a lease without a heartbeat this long is lost (the runner beats every 2 s)
CHECK_S = 0.25  # how often a waiting episode looks at its lease
RETRY_AFTER_S = 1
MAX_RESULT_BYTES = 64 << 10  # a result's body: the output's tail and the exit status
FIELD = "spec.agents[].command"  # what ran a pod's episode, for messages
LEASE_HEADER = "X-Rldock-Lease"  # the lease's secret, on its heartbeats and result


@dataclass
class _Episode:
    name: str
    task: dict
    api_key: str
    path: str
    offered: float
    outcome: asyncio.Future
    leased: float | None = None  # when a runner leased it
    beat: float = 0.0  # the lease's last heartbeat
    runner: str = ""
    secret: str = ""  # the lease's: what its heartbeats and result send in LEASE_HEADER


@dataclass
class EpisodeDispatcher:
    """Episodes offered to the pods (`await dispatcher(task, name=..., base_url=..., api_key=...)`, as a
    HarnessRunner is called) and the routes the pods lease them through (`mount`)."""

    token: str  # the job's pod token
    timeout_s: float  # agent.episode_timeout_s
    lease_s: float = LEASE_S
    body_timeout_s: float = BODY_TIMEOUT_S  # a lease's or a result's body, all of it (connections.py)
    _waiting: collections.deque[_Episode] = field(default_factory=collections.deque)
    _open: dict[str, _Episode] = field(default_factory=dict)
    leases: int = 0  # episodes leased so far (the tests read it)

    async def __call__(self, task: dict, *, name: str, base_url: str, api_key: str) -> HarnessOutcome:
        path = "/" + base_url.split("://", 1)[-1].split("/", 1)[-1]
        episode = _Episode(name, task, api_key, path, time.monotonic(), asyncio.get_running_loop().create_future())
        self._waiting.append(episode)
        self._open[name] = episode
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(episode.outcome), CHECK_S)
                except TimeoutError:
                    ended = self._overdue(episode, time.monotonic())
                    if ended is not None:
                        logger.warning("episode %s ended %s (runner %r)", name, ended, episode.runner or "none")
                        return HarnessOutcome(ended, error=self._why(ended, episode))
        finally:
            self._open.pop(name, None)
            if episode in self._waiting:
                self._waiting.remove(episode)

    def _overdue(self, episode: _Episode, now: float) -> str | None:
        if episode.leased is None:
            return "harness_unserved" if now - episode.offered > self.timeout_s else None
        if now - episode.beat > self.lease_s:
            return "harness_lost"
        if now - episode.leased > self.timeout_s:
            return "harness_timeout"
        return None

    def _why(self, ended: str, episode: _Episode) -> str:
        if ended == "harness_unserved":
            return (
                f"no agent pod leased episode {episode.name} within agent.episode_timeout_s ({self.timeout_s:g} s); "
                "check that spec.agents' pods run (kubectl get rljob: Agents) and reach the gateway"
            )
        if ended == "harness_lost":
            return f"runner {episode.runner!r} stopped beating for episode {episode.name} (its pod died?)"
        return f"{FIELD} ran past agent.episode_timeout_s ({self.timeout_s:g} s) in runner {episode.runner!r}"

    def mount(self, app: FastAPI) -> None:
        def authorized(request: Request) -> bool:
            sent = request.headers.get("authorization", "")
            token = sent.removeprefix("Bearer ").strip() if sent.startswith("Bearer ") else ""
            return secrets.compare_digest(token.encode(), self.token.encode())

        def refused() -> JSONResponse:
            return JSONResponse({"error": "the job's pod token (RLDOCK_ENV_TOKEN) is required"}, status_code=401)

        def held(name: str, request: Request) -> _Episode | Response:
            """Episode `name` if it is leased and open and the request sends its lease's secret."""
            episode = self._open.get(name)
            if episode is None or episode.leased is None or episode.outcome.done():
                return Response(status_code=410)
            sent = request.headers.get(LEASE_HEADER, "")
            if not secrets.compare_digest(sent.encode(), episode.secret.encode()):
                return JSONResponse(
                    {"error": f"episode {name} is leased to another runner ({LEASE_HEADER} is not its lease's)"},
                    status_code=403,
                )
            return episode

        @app.post("/episodes/lease")
        async def lease(request: Request):
            if not authorized(request):
                return refused()
            try:
                body = await _small_json(request, timeout_s=self.body_timeout_s)
            except BodyUnread as error:  # before an episode is leased to a runner that is not there
                return _late(error)
            if not self._waiting:
                return Response(status_code=204, headers={"Retry-After": str(RETRY_AFTER_S)})
            episode = self._waiting.popleft()
            episode.leased = episode.beat = time.monotonic()
            episode.secret = secrets.token_urlsafe(24)
            episode.runner = str(body.get("runner", ""))[:253] if isinstance(body, dict) else ""
            self.leases += 1
            return JSONResponse(
                {
                    "episode": episode.name,
                    "lease": episode.secret,
                    "path": episode.path,
                    "api_key": episode.api_key,
                    "task": episode.task,
                    "timeout_s": self.timeout_s,
                }
            )

        @app.post("/episodes/{name}/heartbeat")
        async def heartbeat(name: str, request: Request):
            if not authorized(request):
                return refused()
            episode = held(name, request)
            if isinstance(episode, Response):
                return episode
            episode.beat = time.monotonic()
            leased = episode.leased or episode.beat  # held() answered only a leased one
            return JSONResponse({"timeout_s": max(0.0, self.timeout_s - (episode.beat - leased))})

        @app.post("/episodes/{name}/result")
        async def result(name: str, request: Request):
            if not authorized(request):
                return refused()
            episode = held(name, request)
            if isinstance(episode, Response):
                return episode
            try:
                body = await _small_json(request, timeout_s=self.body_timeout_s)
            except BodyUnread as error:
                return _late(error)
            code = body.get("exit_code") if isinstance(body, dict) else None
            output = body.get("output") if isinstance(body, dict) else None
            if not isinstance(code, int) or isinstance(code, bool) or not isinstance(output, str):
                return JSONResponse({"error": "the body must be {exit_code: int, output: str}"}, status_code=400)
            if episode.outcome.done():  # ended while its body was read
                return Response(status_code=410)
            episode.outcome.set_result(command_outcome(code, output, field=FIELD))
            return JSONResponse({"ended": name})


async def _small_json(request: Request, *, timeout_s: float) -> object:
    """The request's JSON body, at most MAX_RESULT_BYTES; {} for an empty, oversized or invalid one. A body not
    in within `timeout_s` (or whose client went away) raises BodyUnread."""
    try:
        raw = await read_body(request, limit=MAX_RESULT_BYTES, timeout_s=timeout_s)
    except BodyTooLarge:
        return {}
    try:
        return json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        return {}


def _late(error: BodyUnread) -> JSONResponse:
    return JSONResponse({"error": str(error)}, status_code=error.status)
