"""rldock's OpenEnv client (agent/service/env_client.py) against real servers: an environment written with
openenv-core's own server classes, and `rldock env serve` replicas that rldock starts, loses and
replaces itself (agent/service/local.py); the preflight's questions (agent/service/env_probe.py); the
python tool sending its calls to the python sandbox environment."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import pytest
from openenv_servers import openenv_guess_server, secret_number

from rldock.config.agent import AgentSpec, SandboxSpec
from rldock.config.agent_environment import EnvironmentServersSpec
from rldock.config.job import JobConfig
from rldock.runtime.agent.interfaces import EnvironmentUnavailable, EpisodeContext, Observation, SessionFailed
from rldock.runtime.agent.service.auth import TOKEN_ENV
from rldock.runtime.agent.service.env_client import OpenEnvEnvironment, Replicas, resolve_replicas
from rldock.runtime.agent.service.env_probe import environment_server_problems, replica_problems
from rldock.runtime.agent.service.listeners import held_by_session
from rldock.runtime.agent.service.local import EnvironmentStartError, JobEnvironmentServers, LocalServers
from rldock.runtime.agent.tools import PythonTool

DOUBLES = Path(__file__).resolve().parents[1] / "env_doubles.py"  # tests/unit/runtime/, shared with env_server/'s tests
RLDOCK = [sys.executable, "-m", "rldock.runtime.cli"]
COUNTING = f"{DOUBLES}:CountingEnvironment"
ROW = EpisodeContext("42", "test", {"task": 7})


ALGORITHM = {
    "name": "grpo",
    "num_prompts_per_iteration": 2,
    "num_responses_per_prompt": 2,
    "max_prompt_length": 64,
    "max_response_length": 64,
    "learning_rate": 1e-4,
}


def job(**fields) -> JobConfig:
    """A job config with `fields` beside the required ones."""
    return JobConfig.model_validate({"iterations": 1, "model": {"path": "/models/m"}, "algorithm": ALGORITHM, **fields})


@pytest.fixture(scope="module")
def guess_url():
    with openenv_guess_server(highest=10) as url:
        yield url


def serve_command(environment: str, *options: str) -> list[str]:
    return [*RLDOCK, "env", "serve", environment, "--listen-fd", "{listen_fd}", *options]


@pytest.fixture(autouse=True)
def _job_token_kept_to_the_test():
    """LocalServers makes the job's token in this process's environment, as in a trainer; it goes with the test."""
    before = os.environ.get(TOKEN_ENV)
    yield
    if before is None:
        os.environ.pop(TOKEN_ENV, None)
    else:
        os.environ[TOKEN_ENV] = before


async def play(environment: OpenEnvEnvironment, seed: int, guesses: list[str]) -> list[Observation]:
    session = environment.session()
    try:
        observations = [await session.reset(seed=seed, episode_id=f"e{seed}", context=ROW)]
        for guess in guesses:
            observations.append(await session.step(guess))
            if observations[-1].done:
                break
        return observations
    finally:
        await session.close()


def test_an_environment_written_with_openenv_core_is_played_session_by_session(guess_url):
    environment = OpenEnvEnvironment(name="guess", servers=EnvironmentServersSpec(url=guess_url))
    assert environment.max_sessions == 8  # one replica, servers.sessions_per_replica

    async def two_games():
        # Two sessions at once, each with its own number: their state is the server's, per session.
        return await asyncio.gather(
            play(environment, 1, ["0", "11"]), play(environment, 2, [str(n) for n in range(1, 11)])
        )

    first, second = asyncio.run(two_games())
    assert first[0].message == "I picked a whole number from 1 to 10. Guess it."
    assert [o.message for o in first[1:]] == ["Higher.", "Lower."] and [o.reward for o in first[1:]] == [0.0, 0.0]
    number = secret_number(2, 10)
    assert len(second) == 1 + number and second[-1].done and second[-1].reward == 1.0
    assert second[-1].message == f"Right! The number was {number}."
    assert all(o.reward == 0.0 and not o.done for o in second[1:-1])


def test_the_preflight_asks_health_and_schema_naming_the_field(guess_url):
    assert replica_problems([guess_url], action_field="message") is None
    kind, problem = replica_problems([guess_url], action_field="guess")
    assert kind == "action_field" and "has no field 'guess' (its fields: message, metadata)" in problem
    cfg = job(
        **{
            "agent": {"environment": {"name": "openenv", "servers": {"url": guess_url}, "action_field": "guess"}},
            "reward": {"terms": [{"name": "environment"}]},
        }
    )
    (found,) = environment_server_problems(cfg)
    assert found.path == "agent.environment.action_field" and guess_url in found.message


def test_a_server_that_does_not_speak_openenv_is_named_with_what_it_answered():
    class Plain(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = b'{"ok": true}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        kind, problem = replica_problems([base], action_field="message")
        assert kind == "health" and "not OpenEnv's" in problem and '{"ok": true}' in problem
    finally:
        server.shutdown()
        server.server_close()  # the socket closed too: else the kernel still accepts and no one answers (a timeout)
    # Nothing listening: the URL and the connection error.
    kind, problem = replica_problems([base], action_field="message")
    assert kind == "health" and f"{base}/health did not answer" in problem
    cfg = job(agent={"environment": {"name": "openenv", "servers": {"url": base}}})
    (found,) = environment_server_problems(cfg)
    assert found.path == "agent.environment.servers.url"


def test_a_service_name_is_an_rljobs_to_resolve():
    cfg = job(agent={"environment": {"name": "openenv", "servers": {"service": "games"}}})
    (found,) = environment_server_problems(cfg)
    assert found.path == "agent.environment.servers.service" and "spec.environments" in found.message


def test_local_replicas_share_the_sessions_and_a_dead_one_is_replaced(tmp_path):
    closed = tmp_path / "closed.log"
    servers = EnvironmentServersSpec(
        command=serve_command(COUNTING, "--option", f"closed_log={closed}"), replicas=2, sessions_per_replica=2
    )
    local = LocalServers(servers, field="agent.environment", log_dir=tmp_path / "logs")
    urls = local.start()
    try:
        environment = OpenEnvEnvironment(name="counting", servers=servers, urls=urls)
        assert environment.max_sessions == 4

        async def four_sessions():
            sessions = [environment.session() for _ in range(4)]
            for number, session in enumerate(sessions):
                await session.reset(seed=number, episode_id=f"e{number}", context=ROW)
            on = [session.replica.base for session in sessions]
            steps = [await session.step("hi") for session in sessions]
            return sessions, on, steps

        async def scenario():
            sessions, on, steps = await four_sessions()
            assert sorted(on) == sorted(urls * 2)  # two sessions on each replica
            assert [s.fields["seed"] for s in steps] == [0, 1, 2, 3] and all(s.reward == 1.0 for s in steps)
            # The replica of session 0 dies: that session fails, the ones on the other replica go on.
            victim = local.processes[urls.index(on[0])]
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait()
            # Its port stays rldock's (the socket it passed), so nothing else on the machine can take it.
            with pytest.raises(OSError), socket.socket() as squatter:
                squatter.bind(("127.0.0.1", local.ports[urls.index(on[0])]))
            with pytest.raises(SessionFailed, match="was closed"):
                await sessions[0].step("again")
            other = next(i for i, base in enumerate(on) if base != on[0])
            assert (await sessions[other].step("again")).reward == 2.0
            for session in sessions:
                await session.close()

        asyncio.run(scenario())
        # rldock started it again on its port, and a new episode plays there.
        deadline_replaced = local.restarts
        asyncio.run(_until(lambda: local.restarts >= 1 and replica_problems(urls, action_field="message") is None))
        assert local.restarts >= 1 >= deadline_replaced - 1
        (reset, step) = asyncio.run(play(environment, 9, ["x"]))
        assert step.fields == {"steps": 1, "seed": 9}
    finally:
        local.stop()
    assert all(process.poll() is not None for process in local.processes)
    # The sessions on the surviving replica closed (the killed one's never could).
    assert len(closed.read_text().split()) >= 2


def test_sessions_opened_at_once_spread_over_the_replicas(tmp_path):
    """A rollout opens its first episodes' sessions all at once: each counts on its replica before its
    connection is open, so they fill both replicas instead of all going to the one first in order
    (whose server would refuse those past its sessions with CAPACITY_REACHED)."""
    servers = EnvironmentServersSpec(command=serve_command(COUNTING), replicas=2, sessions_per_replica=2)
    local = LocalServers(servers, field="agent.environment", log_dir=tmp_path / "logs")
    urls = local.start()
    try:
        environment = OpenEnvEnvironment(name="counting", servers=servers, urls=urls)

        async def at_once():
            sessions = [environment.session() for _ in range(4)]
            await asyncio.gather(*(s.reset(seed=n, episode_id=f"e{n}", context=ROW) for n, s in enumerate(sessions)))
            on = [session.replica.base for session in sessions]
            for session in sessions:
                await session.close()
            return on

        assert sorted(asyncio.run(at_once())) == sorted(urls * 2)
        assert [replica.open_sessions for replica in environment.replicas.replicas.values()] == [0, 0]
    finally:
        local.stop()


async def _until(condition, timeout_s: float = 120.0) -> None:
    """Poll `condition` (the state a test waits for) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.2)


def test_a_full_replica_makes_a_reset_wait_for_a_place_not_fail(tmp_path):
    # The load benchmark found it: a server counts a closed session until its close has run, a moment
    # after the client's, so a reset right after a close could be refused as CAPACITY_REACHED.
    servers = EnvironmentServersSpec(command=serve_command(COUNTING, "--sessions", "1"), sessions_per_replica=1)
    local = LocalServers(servers, field="agent.environment", log_dir=tmp_path)
    urls = local.start()
    try:
        environment = OpenEnvEnvironment(name="counting", servers=servers, urls=urls)

        async def scenario():
            for seed in range(5):  # back to back: each reset follows the previous close at once
                reset, step = await play(environment, seed, ["x"])
                assert step.fields["seed"] == seed
            holder = environment.session()
            await holder.reset(seed=10, episode_id="holder", context=ROW)
            waiting = asyncio.ensure_future(play(environment, 11, ["y"]))
            await asyncio.sleep(0.5)  # the second reset keeps asking while the one place is taken
            assert not waiting.done()
            await holder.close()
            reset, step = await asyncio.wait_for(waiting, timeout=60)
            assert step.fields["seed"] == 11

        asyncio.run(scenario())
    finally:
        local.stop()


def test_rldock_in_a_command_is_the_trainers_own_without_an_activated_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # as `.venv/bin/rldock train ...` from a plain shell
    # the bound socket handed down ({listen_fd}): a free port probed, then bound by the server, can be taken between
    servers = EnvironmentServersSpec(command=["rldock", "env", "serve", COUNTING, "--listen-fd", "{listen_fd}"])
    local = LocalServers(servers, field="agent.environment", log_dir=tmp_path)
    try:
        (url,) = local.start()
        assert replica_problems([url], action_field="message") is None
    finally:
        local.stop()


def test_a_command_that_dies_at_start_is_named_with_its_output(tmp_path):
    servers = EnvironmentServersSpec(command=serve_command("no_such_module:Nothing"))
    with pytest.raises(
        EnvironmentStartError, match=r"(?s)agent.environment.servers.command: replica 0 exited .*no_such_module"
    ):
        LocalServers(servers, field="agent.environment", log_dir=tmp_path).start()


def test_the_jobs_servers_are_asked_the_preflights_questions_once_started(tmp_path):
    cfg = job(
        **{
            "agent": {
                "environment": {
                    "name": "openenv",
                    "servers": {"command": serve_command(COUNTING)},
                    "action_field": "code",
                }
            }
        }
    )
    with pytest.raises(
        EnvironmentStartError, match="agent.environment.action_field: the action of .* has no field 'code'"
    ):
        JobEnvironmentServers(cfg, log_dir=tmp_path).start()


def test_no_replica_answering_ends_the_episode_until_the_limit_then_fails_the_job():
    now = [0.0]
    servers = EnvironmentServersSpec(url="http://127.0.0.1:9", unavailable_timeout_s=60)  # port 9: discard, closed
    environment = OpenEnvEnvironment(name="gone", servers=servers)
    environment.replicas = Replicas(name="gone", servers=servers, clock=lambda: now[0])

    async def reset():
        await environment.session().reset(seed=0, episode_id="e", context=ROW)

    with pytest.raises(EnvironmentUnavailable) as first:
        asyncio.run(reset())
    assert not first.value.fatal and "http://127.0.0.1:9" in str(first.value)
    now[0] = 61.0
    with pytest.raises(
        EnvironmentUnavailable, match=r"no replica answered for 61 s .* tried http://127.0.0.1:9"
    ) as late:
        asyncio.run(reset())
    assert late.value.fatal


def test_a_headless_services_addresses_are_its_replicas():
    def lookup(host, port, type):
        assert (host, port) == ("games.ns.svc.cluster.local", 8000)
        return [(0, 0, 0, "", (address, port)) for address in ("10.0.0.7", "10.0.0.5", "10.0.0.7")]

    url = "http://games.ns.svc.cluster.local:8000"
    assert resolve_replicas(url, lookup=lookup) == ["http://10.0.0.5:8000", "http://10.0.0.7:8000"]
    assert resolve_replicas(url, lookup=lambda *a, **k: [(0, 0, 0, "", ("10.0.0.5", 8000))]) == [url]


def test_the_python_tool_runs_its_code_in_the_sandbox_environment(tmp_path):
    servers = EnvironmentServersSpec(command=serve_command("rldock.runtime.agent.sandbox_service:PythonSandbox"))
    local = LocalServers(servers, field="agent.sandbox", log_dir=tmp_path)
    urls = local.start()
    try:
        # The server allows at most its own 10 s; the boot counts in it, and under load it can take seconds.
        agent = AgentSpec(tools=[{"name": "python"}], sandbox=SandboxSpec(servers=servers, wall_seconds=10))
        tool = PythonTool.from_config(agent, {}, sandbox_urls=urls)
        here = asyncio.run(PythonTool(SandboxSpec()).call({"code": "print(6 * 7)"}))
        there = asyncio.run(tool.call({"code": "print(6 * 7)"}))
        assert there == here and there.text.strip() == "42" and not there.error
        # A program that fails fails the same way, and one that reads outside its scratch directory too.
        failed = asyncio.run(tool.call({"code": "raise SystemExit(3)"}))
        assert failed.error
        secret = tmp_path / "secret.txt"
        secret.write_text("s3cr3t")
        spy = asyncio.run(tool.call({"code": f"print(open({str(secret)!r}).read())"}))
        assert spy.error and "s3cr3t" not in spy.text
    finally:
        local.stop()
    # The server is gone: the call is the model's error message, not a crash.
    gone = asyncio.run(tool.call({"code": "print(1)"}))
    assert gone.error and "the python sandbox service failed" in gone.text


def test_local_servers_get_a_clean_environment_and_want_the_jobs_token(tmp_path, monkeypatch):
    import requests

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the trainer's own")
    monkeypatch.setenv("HF_TOKEN", "the trainer's own")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    servers = EnvironmentServersSpec(
        command=serve_command(f"{DOUBLES}:VariablesEnvironment"), env={"JUDGE_MODEL": "small"}
    )
    local = LocalServers(servers, field="agent.environment", log_dir=tmp_path)
    try:
        (url,) = local.start()
        environment = OpenEnvEnvironment(name="variables", servers=servers, urls=[url])
        reset, step = asyncio.run(play(environment, 0, ["JUDGE_MODEL"]))
        names = set(json.loads(reset.message))
        assert names <= {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "JUDGE_MODEL", TOKEN_ENV, "LC_CTYPE"}, names
        assert {"PATH", "JUDGE_MODEL", TOKEN_ENV} <= names and step.message == "small"
        # The job's token, made for it and asked of every client: none, or another, is refused.
        assert len(os.environ[TOKEN_ENV]) >= 32
        for headers in ({}, {"Authorization": "Bearer another-token-0123456789"}):
            assert requests.get(f"{url}/schema", headers=headers, timeout=30).status_code == 401
        assert requests.get(f"{url}/health", timeout=30).status_code == 200
    finally:
        local.stop()


class _Impostor(http.server.BaseHTTPRequestHandler):
    """Another process's server on the port rldock found free: it answers /health as a server would and
    records every request (a token among them)."""

    seen: list[tuple[str, str | None]] = []

    def do_GET(self):
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        body = json.dumps({"status": "healthy"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_port_another_process_took_is_sent_nothing_and_fails_the_start(tmp_path):
    """Issue 50: a `{port}` server's port can be taken between rldock's look and the server's bind. The
    taker answers /health, but rldock asks the port's owner first, sends it nothing, and names the fix."""
    # A server that never binds its port, so the taker keeps it (as one that lost the race).
    servers = EnvironmentServersSpec(command=[sys.executable, "-c", "import time; time.sleep(60)", "{port}"])
    local = LocalServers(servers, field="agent.environment", log_dir=tmp_path)
    _Impostor.seen = []
    impostor = http.server.ThreadingHTTPServer(("127.0.0.1", local.ports[0]), _Impostor)
    thread = threading.Thread(target=impostor.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(EnvironmentStartError) as refused:
            local.start()
        message = str(refused.value)
        assert message.startswith(f"agent.environment.servers.command: port {local.ports[0]} of replica 0")
        assert "{listen_fd}" in message
        assert _Impostor.seen == []  # not even /health
    finally:
        impostor.shutdown()
        impostor.server_close()
        local.stop()


def test_who_listens_on_a_port_is_read_from_proc():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        assert held_by_session(port, os.getsid(0)) is None  # bound, not listening
        listener.listen()
        assert held_by_session(port, os.getsid(0)) is True
        assert held_by_session(port, os.getsid(0) + 1_000_000) is False  # a session that holds nothing
    assert held_by_session(port, os.getsid(0)) is None
