"""Serves one rldock Environment class over OpenEnv's protocol (`rldock env serve`), so the same class
runs in the actor's process for a unit test, as a local process and as an environment pod.

The protocol is openenv-core 0.3.0's (openenv/core/env_server/http_server.py), which its own clients and
rldock's speak:

- `GET /health` -> {"status": "healthy"}; `GET /metadata` -> {"name", "description", "version"} (the
  class's name, its docstring's first paragraph, rldock's version); `GET /schema` -> the JSON schemas of the
  action ({"message": string}), the observation ({"message": string|null, more fields allowed}) and the
  state ({"episode_id", "step_count"}).
- `/ws`, one WebSocket per episode, its messages answered in order. The client sends
  {"type": "reset", "data": {"seed", "episode_id", "ground_truth", "data_source", "extra_info"}} (all
  optional: a random seed, a new episode id, empty strings), {"type": "step", "data": {"message": text}},
  {"type": "state"} and {"type": "close"}. A reset or a step is answered {"type": "observation", "data":
  {"observation": {"message": text|null, **Observation.fields}, "reward": float|null, "done": bool}}, a
  state {"type": "state", "data": {"episode_id", "step_count"}}, anything wrong {"type": "error",
  "data": {"message", "code"}} with OpenEnv's codes (ErrorCode), after which the socket stays open as
  OpenEnv's does. Each reset opens a new `Environment.session()` (closing the one before: a session is
  one episode); it is closed on the close message, a disconnect, an error of the socket and at shutdown.
  Past `max_sessions` open sockets a new one is answered CAPACITY_REACHED and closed (after the client's
  first message, which is how OpenEnv's client gets to read the refusal).
- `POST /reset`, `POST /step`: stateless, as OpenEnv's: a fresh session per request, closed after it.
  `/step` takes OpenEnv's {"action": {...}} and resets the session from the request's own reset fields
  first (an rldock session is only stepped after a reset). `GET /state` is a fresh session's state. Each
  request holds one of the `max_sessions` places while it runs (503 with CAPACITY_REACHED past them);
  a body that is not JSON within wire.loads' limits is answered 400 INVALID_JSON, a wrong one 422
  VALIDATION_ERROR.

Limits (docs/security.md): with a token (`rldock env serve --token-file`, or RLDOCK_ENV_TOKEN) every route
but `/health` wants it (guard.py: 401, or a refused WebSocket handshake); bodies and WebSocket messages
are read up to wire.MAX_MESSAGE_BYTES (HTTP 413; a message past it, decompressed, closes its socket with
1009) and parsed within wire.loads' depth and integer limits (INVALID_JSON, the socket stays open); a
client that disconnects mid-step has its step cancelled and its session closed at once (a sandbox
program killed), which frees its place; no /docs, /redoc or /openapi.json.

The environment's coroutines run on the server's one event loop, as they do in an actor: a session that
waits (a subprocess, a request) lets the others go on. What the environment raises is answered
EXECUTION_ERROR with the exception's type and message and logged; the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib.metadata
import inspect
import json
import logging
import secrets
import socket
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rldock.config.agent import AgentSpec
from rldock.config.agent_environment import EnvironmentSpec
from rldock.runtime.agent.builders import AgentConfigError, build_environment
from rldock.runtime.agent.interfaces import Environment, EnvironmentSession, EpisodeContext, Observation
from rldock.runtime.agent.service import json_wire as wire
from rldock.runtime.env_server.guard import Guard

logger = logging.getLogger(__name__)

# Seconds a SIGTERM waits for the sessions' running steps to answer before they are cancelled; every
# session is closed either way. Below Kubernetes' default grace period of 30 s, so a pod ends by itself.
SHUTDOWN_GRACE_S = 20
# Seconds a refused socket (CAPACITY_REACHED) waits for the client's first message before it is closed.
REFUSAL_LINGER_S = 10.0
# Messages a socket's reader holds ahead of the one being answered (a client that sends before reading).
READ_AHEAD = 2
# OpenEnv's wire names of an observation's own fields; Observation.fields may not reuse them.
_OWN_FIELDS = frozenset({"message", "reward", "done"})


class ErrorCode(str, enum.Enum):
    """OpenEnv's error codes (openenv.core.env_server.types.WSErrorCode)."""

    INVALID_JSON = "INVALID_JSON"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    CAPACITY_REACHED = "CAPACITY_REACHED"
    FACTORY_ERROR = "FACTORY_ERROR"
    SESSION_ERROR = "SESSION_ERROR"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, never ignored


class ResetData(_Wire):
    """A reset's data: OpenEnv's seed and episode id, and the sample's row (EpisodeContext)."""

    seed: int | None = Field(default=None, ge=0, description="The episode's seed; unset: a random one.")
    episode_id: str | None = Field(default=None, max_length=255, description="Unset: a new random id.")
    ground_truth: str = ""
    data_source: str = ""
    extra_info: dict[str, Any] = Field(default_factory=dict)


class MessageAction(_Wire):
    """A step's action: the model's turn as text."""

    message: str
    # OpenEnv's Action base class has this field, so a client built on its classes sends it; unused here.
    metadata: dict[str, Any] = Field(default_factory=dict)


class MessageObservation(BaseModel):
    """What a reset or a step answers, as `/schema` describes it: the environment's fields beside
    `message` are allowed (Observation.fields)."""

    model_config = ConfigDict(extra="allow")

    message: str | None = None


class SessionState(_Wire):
    episode_id: str | None = None
    step_count: int = 0


class StepRequest(ResetData):
    """HTTP `/step`'s body: OpenEnv's StepRequest (action, timeout_s, request_id), plus the reset fields the
    fresh session is reset with first."""

    action: MessageAction
    timeout_s: float | None = Field(default=None, gt=0, description="Accepted as OpenEnv's; not enforced.")
    request_id: str | None = Field(default=None, max_length=255)


class _ResetMessage(_Wire):
    type: Literal["reset"]
    data: ResetData = Field(default_factory=ResetData)


class _StepMessage(_Wire):
    type: Literal["step"]
    data: MessageAction


class _StateMessage(_Wire):
    type: Literal["state"]


class _CloseMessage(_Wire):
    type: Literal["close"]


_MESSAGES: dict[str, type[_Wire]] = {
    "reset": _ResetMessage,
    "step": _StepMessage,
    "state": _StateMessage,
    "close": _CloseMessage,
}


class ProtocolError(Exception):
    """Answered to the client as {"type": "error", "data": {"message", "code", **details}}."""

    def __init__(self, code: ErrorCode, message: str, **details: Any):
        super().__init__(message)
        self.code = code
        self.details = details

    def data(self) -> dict[str, Any]:
        return {"message": str(self), "code": self.code.value, **self.details}


def wire_observation(observation: Observation) -> dict[str, Any]:
    """An Observation as OpenEnv's reset and step answers carry it (serialize_observation's shape)."""
    if not isinstance(observation, Observation):
        raise TypeError(f"the environment answered a {type(observation).__name__}, not an rldock Observation")
    clash = sorted(_OWN_FIELDS & set(observation.fields))
    if clash:
        raise ValueError(f"Observation.fields may not hold {', '.join(clash)}: set them as the Observation's own")
    wire = {
        "observation": {"message": observation.message, **observation.fields},
        "reward": observation.reward,
        "done": observation.done,
    }
    try:  # here, where a failure is the environment's answer (EXECUTION_ERROR), not the socket's
        json.dumps(wire, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(f"the observation is not JSON: {error}") from error
    return wire


class Episode:
    """One client's session with the environment (a WebSocket's, or one HTTP request's): the rldock
    session of its current episode and the state OpenEnv reports."""

    def __init__(self, environment: Environment):
        self.environment = environment
        self.session: EnvironmentSession | None = None
        self.state = SessionState()

    async def reset(self, data: ResetData) -> dict[str, Any]:
        await self.end()
        try:
            self.session = self.environment.session()
        except Exception as error:  # the user's code: answered, logged, and the server goes on
            logger.exception("%s.session() failed", type(self.environment).__name__)
            raise ProtocolError(ErrorCode.FACTORY_ERROR, _described(error)) from error
        episode_id = data.episode_id or uuid.uuid4().hex
        seed = secrets.randbelow(2**31) if data.seed is None else data.seed
        context = EpisodeContext(
            ground_truth=data.ground_truth, data_source=data.data_source, extra_info=data.extra_info
        )
        self.state = SessionState(episode_id=episode_id)
        try:
            return wire_observation(await self.session.reset(seed=seed, episode_id=episode_id, context=context))
        except Exception as error:  # as above; a session whose reset failed holds no episode to step
            await self.end()
            raise _execution_error("reset", error) from error

    async def step(self, action: MessageAction) -> dict[str, Any]:
        if self.session is None:
            raise ProtocolError(ErrorCode.VALIDATION_ERROR, "no episode to step: reset the session first")
        try:
            answer = wire_observation(await self.session.step(action.message))
        except Exception as error:  # as in reset; the episode stays, as an OpenEnv session does
            raise _execution_error("step", error) from error
        self.state = SessionState(episode_id=self.state.episode_id, step_count=self.state.step_count + 1)
        return answer

    async def end(self) -> None:
        """Close the current session, if any; what its close raises is logged, never passed on (the
        session is gone either way)."""
        session, self.session = self.session, None
        if session is None:
            return
        try:
            await session.close()
        except Exception:  # the user's code, on a path that must go on (disconnect, shutdown)
            logger.exception("closing a session of %s failed", type(self.environment).__name__)


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _execution_error(call: str, error: Exception) -> ProtocolError:
    logger.warning("a session's %s raised %s", call, _described(error), exc_info=error)
    return ProtocolError(ErrorCode.EXECUTION_ERROR, _described(error))


def _validation_error(error: ValidationError) -> ProtocolError:
    errors = json.loads(error.json(include_url=False, include_context=False, include_input=False))
    return ProtocolError(ErrorCode.VALIDATION_ERROR, f"invalid message: {error}", errors=errors)


async def answer(episode: Episode, raw: str | bytes) -> dict[str, Any] | None:
    """The answer to one WebSocket message (None: the client closed the session)."""
    try:
        message = wire.loads(raw)
    except wire.WireError as error:
        return {"type": "error", "data": ProtocolError(ErrorCode.INVALID_JSON, f"invalid JSON: {error}").data()}
    kind = message.get("type") if isinstance(message, dict) else None
    try:
        if not isinstance(kind, str) or kind not in _MESSAGES:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}: one of {', '.join(_MESSAGES)}")
        try:
            parsed = _MESSAGES[kind].model_validate(message)
        except ValidationError as error:
            raise _validation_error(error) from error
        if isinstance(parsed, _ResetMessage):
            return {"type": "observation", "data": await episode.reset(parsed.data)}
        if isinstance(parsed, _StepMessage):
            return {"type": "observation", "data": await episode.step(parsed.data)}
        if isinstance(parsed, _StateMessage):
            return {"type": "state", "data": episode.state.model_dump()}
        return None
    except ProtocolError as error:
        return {"type": "error", "data": error.data()}


class Sessions:
    """The open WebSocket sessions, at most `limit` at once."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open: set[Episode] = set()

    def admit(self, episode: Episode) -> bool:
        # No await between the check and the add: the event loop runs one handler at a time here.
        if len(self.open) >= self.limit:
            return False
        self.open.add(episode)
        return True

    def refusal(self) -> ProtocolError:
        return ProtocolError(
            ErrorCode.CAPACITY_REACHED,
            f"this server holds {self.limit} sessions at most, all open",
            active_sessions=len(self.open),
            max_sessions=self.limit,
        )


def build_app(environment: Environment, *, max_sessions: int, token: str | None = None, url: str = "") -> Guard:
    """The ASGI app that serves `environment`, asking for `token` where one is given (guard.py); `url` is
    only logged at start."""
    cls = type(environment)
    summary = (inspect.getdoc(cls) or "").split("\n\n")[0]  # the docstring's first paragraph, on one line
    metadata = {
        "name": cls.__name__,
        "description": " ".join(summary.split()),
        "version": importlib.metadata.version("rldock"),
    }
    schema = {
        "action": MessageAction.model_json_schema(),
        "observation": MessageObservation.model_json_schema(),
        "state": SessionState.model_json_schema(),
    }
    sessions = Sessions(max_sessions)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        logger.info("serving %s at %s (OpenEnv protocol, %d sessions at most)", cls.__name__, url, max_sessions)
        if token is None:
            logger.warning(
                "no token (--token-file or RLDOCK_ENV_TOKEN): anyone who reaches %s can open sessions", url or "it"
            )
        try:
            yield
        finally:
            # uvicorn has closed every socket and waited for (or cancelled) their handlers, which close
            # their sessions; these are any left behind.
            left = list(sessions.open)
            await asyncio.gather(*(episode.end() for episode in left))
            environment.close()
            logger.info("stopped serving %s (%d sessions closed at shutdown)", cls.__name__, len(left))

    # No /docs, /redoc or /openapi.json: the protocol is OpenEnv's, and a server need not describe itself.
    app = FastAPI(
        title=f"rldock environment {cls.__name__}", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "healthy"}

    @app.get("/metadata")
    async def get_metadata() -> dict[str, str]:
        return metadata

    @app.get("/schema")
    async def get_schema() -> dict[str, Any]:
        return schema

    @app.get("/state")
    async def get_state() -> dict[str, Any]:
        return SessionState().model_dump()

    @app.post("/reset")
    async def http_reset(request: Request) -> Any:
        return await _one_request(environment, sessions, await request.body(), step=False)

    @app.post("/step")
    async def http_step(request: Request) -> Any:
        return await _one_request(environment, sessions, await request.body(), step=True)

    @app.websocket("/ws")
    async def websocket_session(websocket: WebSocket) -> None:
        await websocket.accept()
        episode = Episode(environment)
        if not sessions.admit(episode):
            with contextlib.suppress(WebSocketDisconnect, asyncio.TimeoutError):
                await websocket.send_text(json.dumps({"type": "error", "data": sessions.refusal().data()}))
                # Closed after the client's first message: OpenEnv's client sends before it reads, and a
                # socket closed before that send would show it a closed connection, not the refusal.
                await asyncio.wait_for(websocket.receive(), REFUSAL_LINGER_S)
            with contextlib.suppress(RuntimeError, WebSocketDisconnect):  # the client closed it first
                await websocket.close()
            return
        try:
            await _converse(websocket, episode)
        finally:
            sessions.open.discard(episode)
            await episode.end()
            with contextlib.suppress(RuntimeError, WebSocketDisconnect):  # closed already: by the client, or shutdown
                await websocket.close()

    return Guard(app, token=token, max_body_bytes=wire.MAX_MESSAGE_BYTES)


async def _converse(websocket: WebSocket, episode: Episode) -> None:
    """Answer a socket's messages in order until it closes. A reader task takes the client's messages
    while an answer runs, so a disconnect mid-step is seen at once: the step is cancelled (a sandbox
    program killed) and the caller closes the session, which frees its place."""
    inbox: asyncio.Queue[Mapping[str, Any]] = asyncio.Queue(maxsize=READ_AHEAD)
    gone = asyncio.Event()

    async def read() -> None:
        try:
            while True:
                received = await websocket.receive()
                if received["type"] == "websocket.disconnect":
                    return
                await inbox.put(received)
        except (WebSocketDisconnect, RuntimeError):  # RuntimeError: the socket was closed under the read
            return
        finally:
            gone.set()

    reader = asyncio.create_task(read())
    disconnected = asyncio.create_task(gone.wait())
    try:
        while True:
            next_message = asyncio.create_task(inbox.get())
            await asyncio.wait({next_message, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            if not next_message.done():
                next_message.cancel()
                if inbox.empty():
                    return  # the client went away
                received = inbox.get_nowait()
            else:
                received = next_message.result()
            raw = received.get("text")
            answering = asyncio.create_task(answer(episode, raw if raw is not None else received.get("bytes") or b""))
            await asyncio.wait({answering, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            if not answering.done():  # disconnected mid-answer: stop the work now, not when it ends
                answering.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await answering
                return
            reply = answering.result()
            if reply is None:
                return
            await websocket.send_text(json.dumps(reply))
    except WebSocketDisconnect:
        return  # the client went away (or shutdown closed the socket) while an answer was on its way
    finally:
        for task in (reader, disconnected):
            task.cancel()
        await asyncio.gather(reader, disconnected, return_exceptions=True)


async def _one_request(environment: Environment, sessions: Sessions, body: bytes, *, step: bool) -> Any:
    """HTTP `/reset` and `/step`: a fresh session for the one request, holding one of the server's places."""
    try:
        fields = {} if not body.strip() else wire.loads(body)
    except wire.WireError as error:
        return _http_error(ProtocolError(ErrorCode.INVALID_JSON, f"invalid JSON: {error}"))
    try:
        request = (StepRequest if step else ResetData).model_validate(fields)
    except ValidationError as error:
        return _http_error(_validation_error(error))
    episode = Episode(environment)
    if not sessions.admit(episode):
        return _http_error(sessions.refusal())
    reset = ResetData.model_validate(request.model_dump(include=set(ResetData.model_fields)))
    try:
        reply = await episode.reset(reset)
        if isinstance(request, StepRequest):
            reply = await episode.step(request.action)
        return reply
    except ProtocolError as error:
        return _http_error(error)
    finally:
        sessions.open.discard(episode)
        await episode.end()


# HTTP status of each error code an HTTP route answers (else 500: the environment's own failure).
_HTTP_STATUS = {
    ErrorCode.INVALID_JSON: 400,
    ErrorCode.VALIDATION_ERROR: 422,
    ErrorCode.CAPACITY_REACHED: 503,
}


def _http_error(error: ProtocolError) -> JSONResponse:
    return JSONResponse(status_code=_HTTP_STATUS.get(error.code, 500), content={"detail": error.data()})


def load_environment(reference: str, options: Mapping[str, str]) -> Environment:
    """The environment `reference` names, made as a job's agent.environment is (agent/builders.py): a
    built-in name, or the user's class `path/to/file.py:Class` / `package.module:Class` with `options`
    as keyword arguments. An AgentConfigError names the argument to change (CLASS, --option)."""
    if reference == "openenv":
        raise AgentConfigError(
            "CLASS: `openenv` is rldock's client of environment servers, not an environment to serve; name "
            "the environment's class (`path/to/file.py:Class` or `package.module:Class`)"
        )
    try:
        agent = AgentSpec(environment=EnvironmentSpec(name=reference, options=dict(options)))
    except ValidationError as error:
        problem = error.errors()[0]
        where = "--option" if "options" in problem["loc"] else "CLASS"
        raise AgentConfigError(f"{where}: {problem['msg'].removeprefix('Value error, ')}") from error
    try:
        environment = build_environment(agent)
    except AgentConfigError as error:
        message = str(error).replace("agent.environment.options", "--option").replace("agent.environment.name", "CLASS")
        raise AgentConfigError(message) from error
    assert environment is not None  # the spec names one
    return environment


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); raises OSError as bind does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def inherited(fd: int) -> socket.socket:
    """The listening TCP socket this process was given as descriptor `fd`; OSError if it is not one."""
    sock = socket.socket(fileno=fd)
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise OSError(f"descriptor {fd} is not a listening TCP socket")
    return sock


def serve(environment: Environment, *, sock: socket.socket, max_sessions: int, token: str | None = None) -> None:
    """Serve `environment` on the listening `sock` until SIGTERM or SIGINT, which close every session;
    every route but /health asks for `token` where one is given."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    config = uvicorn.Config(
        build_app(environment, max_sessions=max_sessions, token=token, url=url),
        # The plain asyncio loop: the python sandbox's subprocess handling is tested on it (not uvloop).
        loop="asyncio",
        lifespan="on",
        log_config=None,  # the process's logging (the CLI's), not uvicorn's own set-up
        log_level="warning",  # uvicorn's start and stop chatter and a line per request are left out
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        # websockets' sans-I/O protocol bounds a message after decompression and across its fragments.
        ws="websockets-sansio",
        ws_max_size=wire.MAX_MESSAGE_BYTES,
        # Connections at once, idle ones included (503 past it): the sessions and their refusals' lingering.
        limit_concurrency=4 * max_sessions + 64,
    )
    uvicorn.Server(config).run(sockets=[sock])
