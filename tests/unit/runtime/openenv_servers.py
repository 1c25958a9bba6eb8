"""TEST HELPERS: environment servers that speak OpenEnv's protocol, each a real process on a free port.

- `rldock_env_server(CLASS, --option...)` runs `rldock env serve` of an rldock environment class;
- `openenv_guess_server()` runs an environment written with openenv-core's own server classes:
  GuessNumberEnvironment (an `openenv.core.env_server.Environment` with its own Action and Observation
  models) under openenv's `create_app` and uvicorn, the way an OpenEnv environment's image runs it;
- `hostile_server(MODE, ...)` runs a server that answers `/health` and `/schema` as an OpenEnv server
  does and a reset as one does, then answers each session's step in one of HOSTILE_ANSWERS' wrong ways:
  the session's reset `ground_truth` names the way where it is one of them, else the sessions take the
  MODEs in turn ("good" answers right).

Both are context managers that yield the server's base URL (`http://127.0.0.1:PORT`) once it answers
`/health`, and stop it with SIGTERM on exit; `running_server` is the one under both, for a test that
needs the process too. A test module makes its fixture of them, e.g.

    @pytest.fixture(scope="module")
    def guess_url():
        with openenv_guess_server() as url:
            yield url

The guess-number game is stateful over several turns: the reset's seed picks a number from 1 to
`highest` (`secret_number(seed, highest)`), each step's `message` is a guess (its last whole number),
answered "Higher." or "Lower." with reward 0.0, and the right one "Right! ..." with reward 1.0 and done.

openenv-core's client is `openenv_servers.GenericEnvClient` (imported here, after the stand-in below).

Run as a script, this file serves that game: `python openenv_servers.py [--port 0] [--sessions 8]
[--highest 10]` logs `... at http://127.0.0.1:PORT` once it listens; `--hostile MODE,...` serves the
hostile server instead.

openenv-core 0.3.0 is installed without its dependencies (requirements/cpu.lock): its HTTP server module
imports fastmcp's `Client` at import time, for MCP environments only, and every `openenv.core` import
goes through it. fastmcp 3 needs mcp<2 where the lock pins mcp 2.3 (vLLM's), so it is left out and
`stand_in_for_fastmcp` puts a module in its place that fails if anything calls it: nothing here uses MCP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 120.0  # a loaded 2-core machine imports rldock's environments in a few seconds
STOP_TIMEOUT_S = 30.0
_URL = re.compile(r"at (http://127\.0\.0\.1:\d+)")
# The venv's `rldock` command, as an environment's `servers.command` runs it.
_SCRIPT = Path(sys.executable).with_name("rldock")
RLDOCK = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "rldock.runtime.cli"]


def stand_in_for_fastmcp() -> None:
    """Makes `import openenv.core` work without fastmcp (the module docstring says why)."""
    try:
        import fastmcp  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        return

    class Unavailable:
        def __init__(self, *args: Any, **kwargs: Any):
            raise RuntimeError("fastmcp is not installed (see openenv_servers.py): MCP environments cannot run here")

    package, client, client_client = (
        types.ModuleType(name) for name in ("fastmcp", "fastmcp.client", "fastmcp.client.client")
    )
    package.Client = Unavailable  # type: ignore[attr-defined]
    client_client.CallToolResult = Unavailable  # type: ignore[attr-defined]
    package.client, client.client = client, client_client  # type: ignore[attr-defined]
    sys.modules.update({"fastmcp": package, "fastmcp.client": client, "fastmcp.client.client": client_client})


# Every openenv import goes through this module, after the stand-in: a test imports openenv's client from here.
stand_in_for_fastmcp()
from openenv.core import GenericEnvClient  # noqa: E402, F401
from openenv.core.env_server import Action, Environment, Observation, State, create_app  # noqa: E402
from pydantic import Field  # noqa: E402


@dataclass(frozen=True)
class RunningServer:
    url: str
    process: subprocess.Popen
    log: Path  # the server's stdout and stderr


@contextlib.contextmanager
def running_server(argv: list[str], *, timeout_s: float = START_TIMEOUT_S) -> Iterator[RunningServer]:
    """Starts `argv` (a server that logs `at http://127.0.0.1:PORT` once it listens), waits until it answers
    /health, yields it, and stops it with SIGTERM (SIGKILL after STOP_TIMEOUT_S) on exit."""
    with tempfile.TemporaryDirectory(prefix="openenv-server-") as folder:
        log = Path(folder) / "server.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            url = _wait_until_healthy(process, log, timeout_s)
            yield RunningServer(url, process, log)
        finally:
            stop(process)


def stop(process: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL if it has not exited in STOP_TIMEOUT_S; its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def _wait_until_healthy(process: subprocess.Popen, log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before answering:\n{log.read_text()}")
        if url is None and (found := _URL.search(log.read_text(errors="replace"))):
            url = found.group(1)
        if url is not None and _healthy(url):
            return url
        time.sleep(0.05)  # the interval between polls, not a wait for readiness
    stop(process)
    raise RuntimeError(f"the server did not answer /health in {timeout_s:g} s:\n{log.read_text()}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextlib.contextmanager
def rldock_env_server(environment: str, *arguments: str) -> Iterator[str]:
    """`rldock env serve ENVIRONMENT --port 0 ARGUMENTS...`; yields its base URL."""
    argv = [*RLDOCK, "env", "serve", environment, "--port", "0", *arguments]
    with running_server(argv) as server:
        yield server.url


@contextlib.contextmanager
def openenv_guess_server(*, sessions: int = 8, highest: int = 10) -> Iterator[str]:
    """GuessNumberEnvironment served by openenv-core's own server; yields its base URL."""
    argv = [sys.executable, str(Path(__file__)), "--port", "0", "--sessions", str(sessions), "--highest", str(highest)]
    # create_app serves openenv's Gradio web interface instead where ENABLE_WEB_INTERFACE says so.
    with running_server(argv) as server:
        yield server.url


@contextlib.contextmanager
def hostile_server(*modes: str) -> Iterator[str]:
    """The hostile server (the module docstring), its sessions taking `modes` in turn; yields its base URL."""
    unknown = set(modes) - set(HOSTILE_ANSWERS)
    assert not unknown, f"no hostile answer {unknown}; the answers: {sorted(HOSTILE_ANSWERS)}"
    argv = [sys.executable, str(Path(__file__)), "--port", "0", "--hostile", ",".join(modes)]
    with running_server(argv) as server:
        yield server.url


def _observation(reward: str = "0.5", done: str = "false", message: str = '"fine"') -> str:
    """An observation message's JSON written by hand, so that a value json.dumps would refuse goes out."""
    data = f'{{"observation": {{"message": {message}}}, "reward": {reward}, "done": {done}}}'
    return f'{{"type": "observation", "data": {data}}}'


HUGE_OBSERVATION_BYTES = 64 * 1024 * 1024
DEEP = 100_000  # arrays in arrays

# mode -> the step's answer: (text or bytes, whether bytes go out as a text frame); None never answers.
HOSTILE_ANSWERS: dict[str, tuple[str | bytes, bool] | None] = {
    "good": (_observation(), True),
    "error_data_not_object": ('{"type": "error", "data": ["not", "an", "object"]}', True),
    "error_data_string": ('{"type": "error", "data": "boom"}', True),
    "deep_json": ('{"type": "observation", "data": ' + "[" * DEEP + "]" * DEEP + "}", True),
    "huge_integer": (_observation(reward="9" * 5000), True),
    "not_utf8_text": (b'{"type": "observation", "data": "\xff\xfe"}', True),
    "not_utf8_binary": (b"\xff\xfe\xfd", False),
    "nan_reward": (_observation(reward="NaN"), True),
    "infinite_reward": (_observation(reward="1e400"), True),
    "reward_1e39": (_observation(reward="1e39"), True),
    "done_not_bool": (_observation(done='"yes"'), True),
    "not_openenv": ('{"type": "hello"}', True),
    "not_json": ("<html>", True),
    "huge_observation": (None, True),  # made when asked: HUGE_OBSERVATION_BYTES of message
    "never_answers": None,
}


async def _hostile_session(connection, modes) -> None:
    from websockets.exceptions import ConnectionClosed

    mode = next(modes)
    try:
        async for raw in connection:
            message = json.loads(raw)
            if message.get("type") == "close":
                return
            if message.get("type") == "reset":
                asked = message.get("data", {}).get("ground_truth", "")
                mode = asked if asked in HOSTILE_ANSWERS else mode
                await connection.send(_observation(reward="null", message='"hostile: ' + mode + '"'))
                continue
            answer = HOSTILE_ANSWERS[mode]
            if answer is None:
                await connection.wait_closed()  # never answers; the client's time limit ends the episode
                return
            text, as_text = answer
            if mode == "huge_observation":
                text = _observation(message='"' + "x" * HUGE_OBSERVATION_BYTES + '"')
            await connection.send(text, text=as_text)
    except ConnectionClosed:
        return


def serve_hostile(modes: list[str], port: int) -> None:
    """Serve the hostile server on 127.0.0.1:`port` until SIGTERM (module docstring); without compression, so
    that the 64 MiB answer costs a copy, not seconds of deflate that would hold up the other sessions."""
    from websockets.asyncio.server import serve
    from websockets.datastructures import Headers
    from websockets.http11 import Response

    schema = {
        "action": {"type": "object", "properties": {"message": {"type": "string"}}},
        "observation": {"type": "object"},
        "state": {"type": "object"},
    }
    answers = {"/health": {"status": "healthy"}, "/schema": schema}
    turns = itertools.cycle(modes)

    def http(connection, request):
        body = answers.get(request.path)
        if body is None:
            return None  # /ws: the WebSocket handshake goes on
        headers = Headers([("Content-Type", "application/json")])
        return Response(200, "OK", headers, json.dumps(body).encode())

    async def main() -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", port))
        stop = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set_result, None)
        async with serve(
            lambda c: _hostile_session(c, turns), sock=sock, process_request=http, max_size=None, compression=None
        ):
            logging.getLogger("openenv_servers").info(
                "hostile server (%s) at http://127.0.0.1:%d", ",".join(modes), sock.getsockname()[1]
            )
            await stop

    asyncio.run(main())


def secret_number(seed: int, highest: int) -> int:
    """The number an episode reset with `seed` asks for."""
    return random.Random(seed).randint(1, highest)


class GuessAction(Action):
    message: str = Field(description="The guess: the last whole number in the text counts.")


class GuessObservation(Observation):
    message: str = Field(default="", description="What the game says.")


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Guess a whole number from 1 to `highest`, picked from the reset's seed, told higher or lower."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session is an instance of its own, sharing nothing

    def __init__(self, highest: int = 10):
        super().__init__()
        self.highest = highest
        self.number = secret_number(0, highest)
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.number = secret_number(0 if seed is None else seed, self.highest)
        self._state = State(episode_id=episode_id or uuid.uuid4().hex, step_count=0)
        return GuessObservation(message=f"I picked a whole number from 1 to {self.highest}. Guess it.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.message)
        if not numbers:
            return GuessObservation(message="Answer with a whole number.", reward=0.0)
        guess = int(numbers[-1])
        if guess == self.number:
            return GuessObservation(message=f"Right! The number was {self.number}.", reward=1.0, done=True)
        return GuessObservation(message="Higher." if guess < self.number else "Lower.", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


def main(argv: list[str] | None = None) -> None:
    import functools

    import uvicorn

    parser = argparse.ArgumentParser(description="serve GuessNumberEnvironment with openenv-core's create_app")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--highest", type=int, default=10)
    parser.add_argument("--hostile", help="serve the hostile server, its sessions taking these modes in turn")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.hostile:
        serve_hostile(args.hostile.split(","), args.port)
        return
    os.environ.pop("ENABLE_WEB_INTERFACE", None)  # the plain API, not openenv's Gradio interface
    app = create_app(
        functools.partial(GuessNumberEnvironment, highest=args.highest),
        GuessAction,
        GuessObservation,
        env_name="guess_number",
        max_concurrent_envs=args.sessions,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(128)
    logging.getLogger("openenv_servers").info(
        "GuessNumberEnvironment (openenv-core) at http://127.0.0.1:%d", sock.getsockname()[1]
    )
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, timeout_graceful_shutdown=10)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
