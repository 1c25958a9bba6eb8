"""`rldock env serve` speaks OpenEnv's protocol: openenv-core's own client (GenericEnvClient over /ws) and
its HTTP API drive real server processes (openenv_servers.py) of the feedback environment, a stateful
test double (env_doubles.py) and the python sandbox; and the openenv-core server of openenv_servers.py
answers the same client."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openenv_servers import (
    RLDOCK,
    GenericEnvClient,
    openenv_guess_server,
    rldock_env_server,
    running_server,
    secret_number,
)

from rldock.config.agent import SandboxSpec
from rldock.runtime import cli
from rldock.runtime.agent.environments import WRONG
from rldock.runtime.agent.interfaces import Observation
from rldock.runtime.agent.sandbox_service import LIMIT_FIELDS, sandbox_limits
from rldock.runtime.agent.tools import PythonTool
from rldock.runtime.env_server.serve import wire_observation

COUNTING = f"{Path(__file__).resolve().parents[1] / 'env_doubles.py'}:CountingEnvironment"
SANDBOX = "rldock.runtime.agent.sandbox_service:PythonSandbox"


@dataclass(frozen=True)
class Counting:
    url: str
    closed_log: Path

    def closed(self) -> list[str]:
        return self.closed_log.read_text().split() if self.closed_log.exists() else []

    def wait_closed(self, *episode_ids: str, timeout_s: float = 30.0) -> None:
        """Until every one of `episode_ids` is in the closed log (a session closes after its socket does)."""
        deadline = time.monotonic() + timeout_s
        while not set(episode_ids) <= set(self.closed()):
            assert time.monotonic() < deadline, f"sessions {episode_ids} not closed; closed: {self.closed()}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def counting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Counting]:
    log = tmp_path_factory.mktemp("counting") / "closed.log"
    with rldock_env_server(COUNTING, "--option", f"closed_log={log}") as url:
        yield Counting(url, log)


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, timeout=120))


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def post(url: str, body: dict) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


# --- the feedback environment, end to end -----------------------------------------------------------------


def test_feedback_environment_over_openenv_client():
    async def episode(url: str) -> tuple:
        async with GenericEnvClient(base_url=url) as env:
            first = await env.reset(seed=3, episode_id="e1", ground_truth="#### 4", data_source="test")
            wrong = await env.step({"message": "It is #### 5"})
            right = await env.step({"message": "2 + 2 = #### 4"})
            return first, wrong, right, await env.state()

    with rldock_env_server("feedback") as url:
        first, wrong, right, state = run(episode(url))
        metadata, schema, health = get(f"{url}/metadata"), get(f"{url}/schema"), get(f"{url}/health")
    assert (first.observation, first.reward, first.done) == ({"message": None}, None, False)
    assert (wrong.observation, wrong.done) == ({"message": WRONG}, False)
    assert (right.observation, right.done) == ({"message": None}, True)
    assert state == {"episode_id": "e1", "step_count": 2}
    assert health == {"status": "healthy"}
    assert metadata["name"] == "FeedbackEnvironment" and metadata["description"].startswith("Accepts a final answer")
    assert metadata["version"] == importlib.metadata.version("rldock")
    assert schema["action"]["properties"]["message"]["type"] == "string" and schema["action"]["required"] == ["message"]
    assert schema["observation"]["properties"]["message"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
    assert set(schema["state"]["properties"]) == {"episode_id", "step_count"}


# --- sessions -------------------------------------------------------------------------------------------


def test_concurrent_sessions_keep_their_own_state(counting: Counting):
    async def two_episodes() -> tuple:
        a, b = GenericEnvClient(base_url=counting.url), GenericEnvClient(base_url=counting.url)
        await asyncio.gather(a.connect(), b.connect())
        try:
            reset_a, reset_b = await asyncio.gather(
                a.reset(seed=1, episode_id="a"),
                b.reset(seed=2, episode_id="b", ground_truth="7", data_source="src", extra_info={"k": "v"}),
            )
            await a.step({"message": "x"})
            step_b, step_a = await asyncio.gather(b.step({"message": "z"}), a.step({"message": "y"}))
            return reset_a, reset_b, step_a, step_b, await a.state(), await b.state()
        finally:
            await asyncio.gather(a.close(), b.close())

    reset_a, reset_b, step_a, step_b, state_a, state_b = run(two_episodes())
    assert reset_a.observation == {"message": 'seed 1: {"data_source": "", "ground_truth": ""}'}
    assert reset_b.observation == {"message": 'seed 2: {"data_source": "src", "ground_truth": "7", "k": "v"}'}
    # Observation.fields travel beside `message`; the reward is the step's.
    assert step_a.observation == {"message": "step 2 of seed 1: y", "steps": 2, "seed": 1} and step_a.reward == 2.0
    assert step_b.observation == {"message": "step 1 of seed 2: z", "steps": 1, "seed": 2} and step_b.reward == 1.0
    assert (state_a, state_b) == ({"episode_id": "a", "step_count": 2}, {"episode_id": "b", "step_count": 1})
    counting.wait_closed("a", "b")


def test_a_second_reset_closes_the_first_episode(counting: Counting):
    async def two_resets() -> tuple:
        async with GenericEnvClient(base_url=counting.url) as env:
            await env.reset(seed=1, episode_id="first")
            await env.step({"message": "x"})
            await env.reset(seed=2, episode_id="second")
            return await env.step({"message": "y"}), await env.state()

    step, state = run(two_resets())
    assert step.observation["message"] == "step 1 of seed 2: y"
    assert state == {"episode_id": "second", "step_count": 1}
    counting.wait_closed("first", "second")


def test_a_raising_environment_is_an_execution_error_and_the_session_goes_on(counting: Counting):
    async def errors() -> tuple:
        async with GenericEnvClient(base_url=counting.url) as env:
            await env.reset(seed=1, episode_id="raises")
            with pytest.raises(RuntimeError, match=r"RuntimeError: asked to raise at a step \(code: EXECUTION_ERROR\)"):
                await env.step({"message": "raise"})
            after = await env.step({"message": "after"})
            state = await env.state()
            with pytest.raises(RuntimeError, match=r"ValueError: asked to raise at reset \(code: EXECUTION_ERROR\)"):
                await env.reset(seed=1, episode_id="failed-reset", ground_truth="raise")
            # a session whose reset failed holds no episode
            with pytest.raises(RuntimeError, match=r"no episode to step.*VALIDATION_ERROR"):
                await env.step({"message": "x"})
            return after, state

    after, state = run(errors())
    assert after.observation["message"] == "step 1 of seed 1: after"  # the failed step did not count
    assert state == {"episode_id": "raises", "step_count": 1}
    counting.wait_closed("raises", "failed-reset")


def test_wrong_messages_get_openenvs_error_codes(counting: Counting):
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def talk() -> tuple[list[dict], bool]:
        answers = []
        async with connect(counting.url.replace("http://", "ws://") + "/ws") as ws:
            for message in (
                "not json",
                json.dumps({"type": "dance"}),
                json.dumps(["reset"]),
                json.dumps({"type": "step", "data": {"message": "x"}}),  # before any reset
                json.dumps({"type": "step", "data": {"msg": "x"}}),
                json.dumps({"type": "reset", "data": {"seed": -1}}),
                json.dumps({"type": "reset", "data": {"sed": 1}}),
                json.dumps({"type": "reset", "data": {"episode_id": "protocol"}}),
                json.dumps({"type": "state"}),
            ):
                await ws.send(message)
                answers.append(json.loads(await ws.recv()))
            await ws.send(json.dumps({"type": "close"}))
            try:
                await asyncio.wait_for(ws.recv(), timeout=30)
            except ConnectionClosed:
                return answers, True
            return answers, False

    answers, closed = run(talk())
    codes = [answer["data"].get("code") for answer in answers]
    assert codes == [
        "INVALID_JSON",
        "UNKNOWN_TYPE",
        "UNKNOWN_TYPE",
        "VALIDATION_ERROR",
        "VALIDATION_ERROR",
        "VALIDATION_ERROR",
        "VALIDATION_ERROR",
        None,
        None,
    ]
    assert "reset the session first" in answers[3]["data"]["message"]
    assert [error["loc"] for error in answers[4]["data"]["errors"]] == [["data", "message"], ["data", "msg"]]
    assert answers[7]["type"] == "observation" and answers[7]["data"]["observation"]["message"].startswith("seed ")
    assert answers[8] == {"type": "state", "data": {"episode_id": "protocol", "step_count": 0}}
    assert closed  # the close message ends the socket, and with it the session
    counting.wait_closed("protocol")


def test_http_reset_and_step_are_stateless_as_openenvs(counting: Counting):
    assert post(f"{counting.url}/reset", {"seed": 5, "episode_id": "http-reset", "ground_truth": "g"}) == (
        200,
        {"observation": {"message": 'seed 5: {"data_source": "", "ground_truth": "g"}'}, "reward": None, "done": False},
    )
    for _ in range(2):  # a fresh session each time: always its first step
        status, body = post(
            f"{counting.url}/step", {"action": {"message": "stop"}, "seed": 5, "episode_id": "http-step"}
        )
        assert status == 200
        assert body == {
            "observation": {"message": "step 1 of seed 5: stop", "steps": 1, "seed": 5},
            "reward": 1.0,
            "done": True,
        }
    assert get(f"{counting.url}/state") == {"episode_id": None, "step_count": 0}
    status, body = post(f"{counting.url}/step", {"action": {"message": "raise"}, "episode_id": "http-raise"})
    assert status == 500 and body["detail"]["code"] == "EXECUTION_ERROR"
    assert post(f"{counting.url}/step", {"action": {"text": "x"}})[0] == 422
    assert post(f"{counting.url}/reset", {"seed": 1, "colour": "red"})[0] == 422
    counting.wait_closed("http-reset", "http-step", "http-raise")  # closed after each request


def test_sessions_past_the_limit_are_refused_with_capacity_reached(tmp_path: Path):
    async def crowd(url: str) -> None:
        first = GenericEnvClient(base_url=url)
        await first.reset(seed=1, episode_id="one")
        second = GenericEnvClient(base_url=url)
        with pytest.raises(RuntimeError, match="CAPACITY_REACHED"):
            await second.reset(seed=2)
        await second.close()
        await first.close()
        # The slot frees once the server has closed the first session: poll until a third is admitted.
        deadline = time.monotonic() + 30
        while True:
            third = GenericEnvClient(base_url=url)
            try:
                result = await third.reset(seed=3, episode_id="three")
                break
            except RuntimeError as error:
                assert "CAPACITY_REACHED" in str(error) and time.monotonic() < deadline
                await asyncio.sleep(0.05)
            finally:
                await third.close()
        assert result.observation["message"].startswith("seed 3")

    log = tmp_path / "closed.log"
    with rldock_env_server(COUNTING, "--sessions", "1", "--option", f"closed_log={log}") as url:
        run(crowd(url))
    assert log.read_text().split() == ["one", "three"]


def test_sigterm_stops_the_server_and_closes_its_sessions(tmp_path: Path):
    log = tmp_path / "closed.log"
    argv = [*RLDOCK, "env", "serve", COUNTING, "--port", "0", "--option", f"closed_log={log}"]

    async def open_then_stop(url: str, process: Any) -> int:
        clients = [GenericEnvClient(base_url=url) for _ in range(2)]
        for index, client in enumerate(clients):
            await client.reset(seed=index, episode_id=f"open-{index}")
        process.send_signal(signal.SIGTERM)
        while process.poll() is None:
            await asyncio.sleep(0.05)
        for client in clients:
            await client.close()
        return process.returncode

    with running_server(argv) as server:
        returncode = run(open_then_stop(server.url, server.process))
        output = server.log.read_text()
    assert returncode in (0, -signal.SIGTERM), output  # uvicorn re-raises the signal once it has shut down
    assert sorted(log.read_text().split()) == ["open-0", "open-1"]
    assert f"serving CountingEnvironment at {server.url} (OpenEnv protocol, 8 sessions at most)" in output
    assert "stopped serving CountingEnvironment" in output and "Traceback" not in output


# --- the python sandbox as an environment ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sandbox_url() -> Iterator[str]:
    with rldock_env_server(SANDBOX) as url:
        yield url


def _call_sandbox(url: str, code: str, limits: dict) -> Any:
    async def call() -> Any:
        async with GenericEnvClient(base_url=url) as env:
            await env.reset(seed=0, extra_info={"sandbox": limits})
            return await env.step({"message": code})

    return run(call())


def test_the_sandbox_environment_answers_what_the_python_tool_does(sandbox_url: str, tmp_path: Path):
    outside = tmp_path / "answers.txt"
    outside.write_text("the answers")
    limits = {"cpu_seconds": 2, "wall_seconds": 10, "max_output_chars": 400}
    for code in ("print(6 * 7)", f"print(open({str(outside)!r}).read())", "raise SystemExit(3)", ""):
        served = _call_sandbox(sandbox_url, code, limits)
        local = run(PythonTool(SandboxSpec(**limits)).call({"code": code}))
        assert served.observation == {"message": local.text, "error": local.error, "counts": dict(local.counts)}, code
        assert served.done and served.reward is None
    refused = _call_sandbox(sandbox_url, f"print(open({str(outside)!r}).read())", limits)
    assert refused.observation["error"] and "the sandbox refused reading" in refused.observation["message"]
    assert "the answers" not in refused.observation["message"]
    assert _call_sandbox(sandbox_url, "print(6 * 7)", {}).observation["message"] == "42\n"  # SandboxSpec's defaults


def test_sandbox_limits_come_from_extra_info():
    assert sandbox_limits({}) == SandboxSpec()
    assert sandbox_limits({"sandbox": {"cpu_seconds": 2, "max_output_chars": 100}}) == SandboxSpec(
        cpu_seconds=2, max_output_chars=100
    )
    assert "servers" not in LIMIT_FIELDS and "wall_seconds" in LIMIT_FIELDS
    with pytest.raises(ValueError, match="servers not a sandbox limit"):
        sandbox_limits({"sandbox": {"servers": {"url": "http://elsewhere:8000"}}})
    with pytest.raises(ValueError, match="cpu_seconds"):
        sandbox_limits({"sandbox": {"cpu_seconds": -1}})
    with pytest.raises(ValueError, match="an object of sandbox limits"):
        sandbox_limits({"sandbox": 5})


# --- what is refused before serving -------------------------------------------------------------------


def test_observation_fields_may_not_reuse_the_observations_own_names():
    assert wire_observation(Observation(message="m", reward=1.0, fields={"x": [1]})) == {
        "observation": {"message": "m", "x": [1]},
        "reward": 1.0,
        "done": False,
    }
    with pytest.raises(ValueError, match="may not hold done, reward"):
        wire_observation(Observation(fields={"reward": 1, "done": True}))
    with pytest.raises(TypeError, match="not JSON"):
        wire_observation(Observation(fields={"files": {"a", "b"}}))
    with pytest.raises(TypeError, match="not JSON"):
        wire_observation(Observation(reward=float("nan")))


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["nonsense"], "error: CLASS: 'nonsense' is not a built-in environment"),
        (["openenv"], "error: CLASS: `openenv` is rldock's client"),
        (["no_such_module:Env"], "error: CLASS:"),
        ([COUNTING, "--option", "colour=red"], "error: --option: CountingEnvironment cannot be made with options"),
        (
            [COUNTING, "--option", "closed_log=a", "--option", "closed_log=b"],
            "error: --option: closed_log is given twice",
        ),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_argument(arguments, expected, capsys):
    assert cli.main(["env", "serve", *arguments]) == 2
    assert capsys.readouterr().err.startswith(expected)


def test_a_port_in_use_is_refused(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["env", "serve", COUNTING, "--port", str(port)]) == 2
    assert f"error: --host/--port: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


# --- openenv_servers.py's openenv-core server, with openenv-core's client --------------------------------


@pytest.fixture(scope="module")
def guess_url() -> Iterator[str]:
    with openenv_guess_server(highest=10) as url:
        yield url


def test_the_openenv_core_guess_server_plays_with_openenvs_client(guess_url: str):
    async def play(seed: int) -> tuple[list, Any, int]:
        async with GenericEnvClient(base_url=guess_url) as env:
            first = await env.reset(seed=seed, episode_id=f"guess-{seed}")
            low, high, results = 1, 10, []
            while True:
                guess = (low + high) // 2
                result = await env.step({"message": f"My guess is {guess}"})
                results.append((guess, result))
                if result.done:
                    break
                low, high = (guess + 1, high) if result.observation["message"] == "Higher." else (low, guess - 1)
            state = await env.state()
            return results, first, state["step_count"]

    async def two_games() -> list:
        return await asyncio.gather(play(11), play(13))

    for seed, (results, first, steps) in zip((11, 13), run(two_games())):
        assert first.observation == {"message": "I picked a whole number from 1 to 10. Guess it."} and not first.done
        assert results[-1][0] == secret_number(seed, 10)
        assert [result.reward for _, result in results] == [0.0] * (len(results) - 1) + [1.0]
        assert results[-1][1].observation["message"] == f"Right! The number was {secret_number(seed, 10)}."
        assert steps == len(results)
    assert secret_number(11, 10) != secret_number(13, 10)  # the two sessions played different games
    schema = get(f"{guess_url}/schema")
    assert schema["action"]["properties"]["message"]["type"] == "string"
    assert get(f"{guess_url}/health") == {"status": "healthy"}
