"""A hostile client against `rldock env serve` (a real server process): every request without the job's
token is refused on every route but /health; no API docs are served; the session cap holds on HTTP
/reset and /step as on /ws; bodies and WebSocket messages past wire.MAX_MESSAGE_BYTES are refused (a
compressed message by its size once inflated) with the server's memory bounded; JSON nested too deep or
with a huge integer is answered INVALID_JSON and the socket stays usable; a client that drops its
connection mid-step has its step cancelled and its place freed; the python sandbox server refuses a call
asking for more than its own limits and kills a dropped call's program."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from openenv_servers import RLDOCK, running_server
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from rldock.runtime.agent.service import json_wire

COUNTING = f"{Path(__file__).resolve().parents[1] / 'env_doubles.py'}:CountingEnvironment"
SANDBOX = "rldock.runtime.agent.sandbox_service:PythonSandbox"
TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SESSIONS = 2


@dataclass(frozen=True)
class Server:
    url: str
    pid: int
    closed_log: Path

    def closed(self) -> list[str]:
        return self.closed_log.read_text().split() if self.closed_log.exists() else []


def serve(tmp: Path, environment: str, *arguments: str):
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    argv = [*RLDOCK, "env", "serve", environment, "--port", "0", "--token-file", str(token_file), *arguments]
    return running_server(argv)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("hostile-client")
    log = tmp / "closed.log"
    with serve(tmp, COUNTING, "--sessions", str(SESSIONS), "--option", f"closed_log={log}") as running:
        yield Server(running.url, running.process.pid, log)


def request(
    url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None
) -> tuple[int, Any]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, data
    finally:
        connection.close()


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, timeout=120))


async def session(url: str) -> ClientConnection:
    return await connect(ws_url(url), additional_headers=AUTH, max_size=None)


async def ask(ws: ClientConnection, message: Any) -> dict:
    await ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))
    return json.loads(await ws.recv())


def wait_until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def memory_kib(pid: int) -> dict[str, int]:
    """The process's resident memory now (VmRSS) and at its peak so far (VmHWM), KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM")}


# --- the token and the routes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/schema", None),
        ("GET", "/metadata", None),
        ("GET", "/state", None),
        ("POST", "/reset", b"{}"),
        ("POST", "/step", b'{"action": {"message": "x"}}'),
    ],
)
def test_every_route_but_health_wants_the_token(server: Server, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}):
        status, answer = request(server.url, method, path, body, headers)
        assert (status, answer["detail"]["code"]) == (401, "UNAUTHORIZED"), headers
    assert request(server.url, method, path, body, AUTH)[0] == 200


def test_a_websocket_without_the_token_is_refused_at_the_handshake(server: Server):
    async def attempt(headers: dict) -> int:
        try:
            async with connect(ws_url(server.url), additional_headers=headers):
                return 101
        except InvalidStatus as error:
            return error.response.status_code

    assert run(attempt({})) == 403 and run(attempt({"Authorization": "Bearer nope-nope-nope-nope"})) == 403
    assert request(server.url, "GET", "/health") == (200, {"status": "healthy"})  # the readiness probe's


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
def test_no_api_docs_are_served(server: Server, path):
    assert request(server.url, "GET", path, headers=AUTH)[0] == 404


# --- the session cap on every route --------------------------------------------------------------------


def test_http_reset_and_step_count_against_the_session_cap(server: Server):
    async def hold_every_place() -> list[tuple[int, Any]]:
        held = [await session(server.url) for _ in range(SESSIONS)]
        try:
            for index, ws in enumerate(held):
                await ask(ws, {"type": "reset", "data": {"episode_id": f"cap-{index}"}})
            return [
                await asyncio.to_thread(request, server.url, "POST", "/reset", b"{}", AUTH),
                await asyncio.to_thread(request, server.url, "POST", "/step", b'{"action": {"message": "x"}}', AUTH),
            ]
        finally:
            for ws in held:
                await ws.close()

    refused = run(hold_every_place())
    assert [(status, answer["detail"]["code"]) for status, answer in refused] == [(503, "CAPACITY_REACHED")] * 2
    wait_until(lambda: {"cap-0", "cap-1"} <= set(server.closed()), "the held sessions closed")
    assert request(server.url, "POST", "/reset", b"{}", AUTH)[0] == 200  # the places are free again


# --- sizes, depth and integers -------------------------------------------------------------------------


def test_a_body_past_the_limit_is_refused_declared_or_chunked(server: Server):
    big = b'{"ground_truth": "' + b"x" * json_wire.MAX_MESSAGE_BYTES + b'"}'
    status, answer = request(server.url, "POST", "/reset", big, AUTH)
    assert (status, answer["detail"]["code"]) == (413, "BODY_TOO_LARGE")
    parts = urlsplit(server.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))
    connection.request(
        "POST", "/reset", body=chunks, headers={**AUTH, "Content-Type": "application/json"}, encode_chunked=True
    )
    assert connection.getresponse().status == 413
    connection.close()


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000 + b"]" * 100_000, b'{"seed": ' + b"9" * 5000 + b"}", b'{"seed": NaN}', b"\xff\xfe"],
    ids=["deep", "huge-integer", "nan", "not-utf8"],
)
def test_http_json_past_the_limits_is_invalid_json(server: Server, body):
    status, answer = request(server.url, "POST", "/reset", body, AUTH)
    assert (status, answer["detail"]["code"]) == (400, "INVALID_JSON")


def test_websocket_json_past_the_limits_is_invalid_json_and_the_socket_goes_on(server: Server):
    async def talk() -> list[dict]:
        ws = await session(server.url)
        try:
            answers = [
                await ask(ws, "[" * 100_000 + "]" * 100_000),
                await ask(ws, '{"type": "reset", "data": {"seed": ' + "9" * 5000 + "}}"),
                await ask(ws, b"\xff\xfe"),  # a binary frame that is not UTF-8
            ]
            answers.append(await ask(ws, {"type": "reset", "data": {"episode_id": "after-bad-json"}}))
            return answers
        finally:
            await ws.close()

    answers = run(talk())
    assert [answer["data"].get("code") for answer in answers[:3]] == ["INVALID_JSON"] * 3
    assert answers[3]["type"] == "observation"


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "deflate-bomb"])
def test_a_websocket_message_past_the_limit_closes_its_socket_with_memory_bounded(server: Server, compressed):
    # 80 MiB of JSON: as one plain frame, or compressed by permessage-deflate to about 80 KiB.
    message = '{"type": "reset", "data": {"ground_truth": "' + " " * (80 * 1024 * 1024) + '"}}'

    async def send_it() -> int | None:
        async with connect(
            ws_url(server.url), additional_headers=AUTH, compression="deflate" if compressed else None
        ) as ws:
            try:
                await ws.send(message)
                await ws.recv()
            except ConnectionClosed as error:
                return error.rcvd.code if error.rcvd else None
        return None

    before = memory_kib(server.pid)
    assert run(send_it()) == 1009  # "message too big"
    after = memory_kib(server.pid)
    grown_mib = (after["VmHWM"] - before["VmRSS"]) / 1024
    print(
        f"server memory ({'compressed' if compressed else 'plain'}): RSS {before['VmRSS'] / 1024:.1f} MiB before, "
        f"peak {after['VmHWM'] / 1024:.1f} MiB after, {grown_mib:.1f} MiB over"
    )
    assert grown_mib < 32, (before, after)  # the 80 MiB never held: at most a limit's worth, and buffers
    assert request(server.url, "POST", "/reset", b"{}", AUTH)[0] == 200  # the server goes on


# --- a client that goes away mid-step ------------------------------------------------------------------


def test_a_client_that_drops_mid_step_has_its_step_cancelled_and_its_place_freed(server: Server):
    async def drop_mid_step() -> None:
        held = [await session(server.url) for _ in range(SESSIONS)]
        for index, ws in enumerate(held):
            await ask(ws, {"type": "reset", "data": {"episode_id": f"dropped-{index}"}})
            await ws.send(json.dumps({"type": "step", "data": {"message": "hang"}}))  # never answered
        await asyncio.sleep(0)
        for ws in held:
            ws.transport.abort()  # gone without a close frame

    run(drop_mid_step())
    wait_until(lambda: {"dropped-0", "dropped-1"} <= set(server.closed()), "the dropped sessions closed")

    async def next_session() -> dict:
        ws = await session(server.url)
        try:
            return await ask(ws, {"type": "reset", "data": {"episode_id": "after-drop"}})
        finally:
            await ws.close()

    assert run(next_session())["type"] == "observation"


# --- the sandbox server's own limits ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("hostile-sandbox")
    limits = ["--option", "memory_mib=256", "--option", "wall_seconds=30", "--option", "cpu_seconds=30"]
    with serve(tmp, SANDBOX, *limits) as running:
        yield Server(running.url, running.process.pid, tmp / "none")


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc's parent links)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_the_sandbox_server_refuses_limits_above_its_own(sandbox: Server):
    async def call(limits: dict) -> dict:
        ws = await session(sandbox.url)
        try:
            return await ask(ws, {"type": "reset", "data": {"extra_info": {"sandbox": limits}}})
        finally:
            await ws.close()

    for limits in ({"memory_mib": 1024 * 1024}, {"wall_seconds": 600, "disk_mib": 64}):
        refused = run(call(limits))
        assert (
            refused["data"]["code"] == "EXECUTION_ERROR"
            and "more than this server allows" in refused["data"]["message"]
        )
    assert run(call({"memory_mib": 128}))["type"] == "observation"


def test_a_dropped_sandbox_call_has_its_program_killed(sandbox: Server):
    before = descendants(sandbox.pid)

    async def start_and_drop() -> None:
        ws = await session(sandbox.url)
        await ask(ws, {"type": "reset", "data": {"extra_info": {"sandbox": {"wall_seconds": 30}}}})
        await ws.send(json.dumps({"type": "step", "data": {"message": "import time\ntime.sleep(25)"}}))
        await asyncio.to_thread(wait_until, lambda: descendants(sandbox.pid) - before, "the program started")
        ws.transport.abort()

    run(start_and_drop())
    wait_until(lambda: not (descendants(sandbox.pid) - before), "the program killed", timeout_s=10)
