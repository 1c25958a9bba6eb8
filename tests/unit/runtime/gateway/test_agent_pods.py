"""Agent pods' episodes (`agent.harness_pods`, gateway/dispatch.py) run by the real runner
(rldock.contract.agent_runner, as the operator mounts it) in local processes standing in for the pods: each
leases an episode from the gateway, runs the user's command with the episode's endpoint, key and task, and
posts its output; a runner killed mid-episode ends that episode `harness_lost` and the batch goes on; with
no runner at all the batch ends `harness_unserved` and stops, naming spec.agents. The engine is the
scripted double (rldock_e2e.doubles.scripted_engine); the sessions, routes, dispatcher and runner are the product's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_gateway import PROMPT_CAPACITY, job, tokenizer  # noqa: F401 - the fixture

import rldock.contract.agent_runner as agent_runner
from rldock.contract.agent_pods import GATEWAY_ENV
from rldock.contract.runtime_cli import ENVIRONMENT_TOKEN_ENV
from rldock.runtime.gateway.dispatch import LEASE_S, EpisodeDispatcher
from rldock.runtime.gateway.episodes import GatewayEpisodes
from rldock.runtime.gateway.harness_runner import HarnessError
from rldock.runtime.rollout.harness import result_sums
from rldock_e2e.doubles.scripted_engine import ScriptedEngine

TOKEN = "pod-token-for-the-test"
AGENT = """
import json, os, sys, time, openai
task = json.loads(os.environ["RLDOCK_TASK"])
assert "RLDOCK_ENV_TOKEN" not in os.environ  # the pod token leases; a harness has its episode's key only
if task["mode"] == "hang":
    open(task["pid_file"], "w").write(str(os.getpid()))
    time.sleep(600)
if task["mode"] == "background":  # a child left running, holding the output pipe
    import subprocess
    open(task["pid_file"], "w").write(str(subprocess.Popen(["sleep", "600"]).pid))
client = openai.OpenAI()
answer = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
print("noise")
print(json.dumps({"reward": float(answer.choices[0].message.content == task["ground_truth"])}))
"""


@pytest.fixture
def pods(tokenizer, monkeypatch, tmp_path) -> Iterator:  # noqa: F811 - the fixture imported above
    monkeypatch.setenv(ENVIRONMENT_TOKEN_ENV, TOKEN)
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    made: list[GatewayEpisodes] = []
    runners: list[subprocess.Popen] = []

    def episodes(**agent) -> GatewayEpisodes:
        cfg = job(harness=None, harness_pods=True, **agent)
        made.append(GatewayEpisodes(cfg, tokenizer=tokenizer, prompt_capacity=PROMPT_CAPACITY, pod_port=0))
        return made[-1]

    def runner(gateway: GatewayEpisodes, *, token: str = TOKEN) -> subprocess.Popen:
        port = gateway.server.url.rsplit(":", 1)[1]
        env = {**os.environ, GATEWAY_ENV: f"127.0.0.1:{port}", ENVIRONMENT_TOKEN_ENV: token}
        argv = [sys.executable, agent_runner.__file__, "--episodes", "1", "--", sys.executable, str(script)]
        runners.append(subprocess.Popen(argv, env=env, start_new_session=True, stderr=subprocess.PIPE))
        return runners[-1]

    yield episodes, runner
    for process in runners:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for item in made:
        item.close()


def tasks(tmp_path: Path, *modes: str) -> list[dict]:
    return [
        {"mode": mode, "prompt": "2+3?", "ground_truth": "5", "pid_file": str(tmp_path / f"{i}.pid")}
        for i, mode in enumerate(modes)
    ]


def test_pods_lease_the_episodes_and_their_rewards_train_on_the_sampled_ids(pods, tokenizer, tmp_path):  # noqa: F811
    episodes, runner = pods
    gateway = episodes(episode_timeout_s=120)
    runner(gateway), runner(gateway)
    engine = ScriptedEngine(tokenizer, {k: ["5"] for k in range(4)})
    results = gateway.run(engine, tasks=tasks(tmp_path, *["ok"] * 4), prompts=[[1]] * 4, keys=list(range(4)), seed=0)
    assert [r.ended for r in results] == ["harness_done"] * 4
    assert [r.rewards for r in results] == [[1.0]] * 4 and all(r.exact and r.turns == 1 for r in results)
    assert isinstance(gateway.runner, EpisodeDispatcher) and gateway.runner.leases == 4


def test_a_pod_killed_mid_episode_ends_it_lost_and_the_batch_goes_on(pods, tokenizer, tmp_path):  # noqa: F811
    episodes, runner = pods
    gateway = episodes(episode_timeout_s=120)
    dispatcher = gateway.runner
    assert isinstance(dispatcher, EpisodeDispatcher)
    dispatcher.lease_s = 3 * agent_runner.HEARTBEAT_S  # sooner than the default LEASE_S, as safe on a loaded machine
    assert LEASE_S >= 4 * agent_runner.HEARTBEAT_S
    work = tasks(tmp_path, "hang", "ok", "ok")
    doomed = runner(gateway)  # alone, it leases the first episode, whose command hangs
    healthy: list[subprocess.Popen] = []

    def kill_it_then_start_another() -> None:
        pid_file = Path(work[0]["pid_file"])
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:  # its command runs: the lease is held
            time.sleep(0.05)
        os.killpg(doomed.pid, signal.SIGKILL)  # the pod dies: the runner and, as a pod's, its command
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        healthy.append(runner(gateway))

    killer = threading.Thread(target=kill_it_then_start_another)
    killer.start()
    engine = ScriptedEngine(tokenizer, {k: ["5"] for k in range(3)})
    results = gateway.run(engine, tasks=work, prompts=[[1]] * 3, keys=[0, 1, 2], seed=0)
    killer.join()
    assert [r.ended for r in results] == ["harness_lost", "harness_done", "harness_done"]
    assert sum(results[0].row.model_mask) > 0  # the lost episode still has a model turn (its fallback)
    assert result_sums(results, engine_s=0.0, wall_s=0.0)["ended/harness_lost"] == 1
    assert dispatcher.leases == 3


def test_with_no_pod_the_batch_ends_unserved_and_stops_naming_spec_agents(pods, tokenizer, tmp_path):  # noqa: F811
    episodes, _ = pods
    gateway = episodes(episode_timeout_s=0.5)
    engine = ScriptedEngine(tokenizer, {0: ["5"], 1: ["5"]})
    with pytest.raises(HarnessError, match="no agent pod leased episode .* check that spec.agents' pods run"):
        gateway.run(engine, tasks=tasks(tmp_path, "ok", "ok"), prompts=[[1]] * 2, keys=[0, 1], seed=0)


def test_the_dispatcher_asks_for_the_pod_token_and_a_well_formed_result(pods, tmp_path):
    episodes, runner = pods
    gateway = episodes(episode_timeout_s=120)
    url = gateway.server.url.replace("0.0.0.0", "127.0.0.1")
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{url}/episodes/lease", json={}).status_code == 401
    assert httpx.post(f"{url}/episodes/lease", json={}, headers={"Authorization": "Bearer nope"}).status_code == 401
    none = httpx.post(f"{url}/episodes/lease", json={}, headers=good)
    assert none.status_code == 204 and none.headers["retry-after"] == "1"
    assert httpx.post(f"{url}/episodes/x/heartbeat", headers=good).status_code == 410
    assert httpx.post(f"{url}/episodes/x/result", content=json.dumps({"exit_code": 0}), headers=good).status_code == 410
    # A runner with a wrong token stops (the pod restarts, visibly), naming the variable.
    refused = runner(gateway, token="wrong")
    assert refused.wait(timeout=60) == 1
    assert "refused the token in RLDOCK_ENV_TOKEN" in refused.stderr.read().decode()


def test_only_the_lease_holder_beats_and_posts_for_its_episode(pods, tokenizer, tmp_path):  # noqa: F811
    """Every agent pod has the pod token and episode names are no secret: a second pod posting a result (or
    beating) for an episode another holds is refused, and the holder's result is the one that counts."""
    episodes, _ = pods
    gateway = episodes(episode_timeout_s=120)
    url = gateway.server.url.replace("0.0.0.0", "127.0.0.1")
    good = {"Authorization": f"Bearer {TOKEN}"}
    engine = ScriptedEngine(tokenizer, {0: ["5"]})
    results: list = []
    run = threading.Thread(
        target=lambda: results.extend(gateway.run(engine, tasks=tasks(tmp_path, "ok"), prompts=[[1]], keys=[0], seed=0))
    )
    run.start()
    deadline = time.monotonic() + 60
    leased = httpx.post(f"{url}/episodes/lease", json={"runner": "holder"}, headers=good)
    while leased.status_code == 204 and time.monotonic() < deadline:
        time.sleep(0.05)  # the run has not offered its episode yet
        leased = httpx.post(f"{url}/episodes/lease", json={"runner": "holder"}, headers=good)
    lease = leased.json()
    episode = f"{url}/episodes/{lease['episode']}"
    hostile = {"exit_code": 7, "output": "forged"}
    for sent in ({}, {"X-Rldock-Lease": "guessed"}):
        assert httpx.post(f"{episode}/heartbeat", json={}, headers={**good, **sent}).status_code == 403
        assert httpx.post(f"{episode}/result", json=hostile, headers={**good, **sent}).status_code == 403
    mine = {**good, "X-Rldock-Lease": lease["lease"]}
    assert httpx.post(f"{episode}/heartbeat", json={}, headers=mine).status_code == 200
    assert httpx.post(f"{episode}/result", json={"exit_code": 0, "output": "1"}, headers=mine).status_code == 200
    run.join(timeout=60)
    # the holder's result (exit 0, no model turn) ended it, not the forged exit 7
    assert [r.ended for r in results] == ["harness_no_turn"]


def test_what_a_command_leaves_running_is_killed_and_its_runner_goes_on(pods, tokenizer, tmp_path):  # noqa: F811
    """A command that exits leaving a child that holds its output pipe: the child is killed with the
    command's process group and the runner (one episode at a time) posts the result and leases the next."""
    episodes, runner = pods
    gateway = episodes(episode_timeout_s=30)
    runner(gateway)
    work = tasks(tmp_path, "background", "ok")
    engine = ScriptedEngine(tokenizer, {0: ["5"], 1: ["5"]})
    pid_file = Path(work[0]["pid_file"])
    try:
        results = gateway.run(engine, tasks=work, prompts=[[1]] * 2, keys=[0, 1], seed=0)
        assert [r.ended for r in results] == ["harness_done"] * 2
        assert [r.rewards for r in results] == [[1.0]] * 2
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 30
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # killed; its reaping by whoever adopted it may lag
        assert not _running(pid)
    finally:
        if pid_file.exists() and _running(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_a_second_gateway_on_the_pods_port_is_refused_naming_the_field(pods):
    episodes, _ = pods
    first = episodes(episode_timeout_s=1)
    port = int(first.server.url.rsplit(":", 1)[1])
    with pytest.raises(
        HarnessError, match=f"agent.harness_pods: the gateway cannot serve the agent pods on port {port}"
    ):
        GatewayEpisodes(
            job(harness=None, harness_pods=True),
            tokenizer=first.tokenizer,
            prompt_capacity=PROMPT_CAPACITY,
            pod_port=port,
        )


_PEEK = """
import ctypes, os, subprocess, sys
from rldock.contract.agent_runner import PR_SET_DUMPABLE, undumpable
if os.getuid() == 0:  # an ordinary uid (root reads every process's files), dumpable as when started under it
    os.setgid(65534)
    os.setuid(65534)
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
def peek():  # what a command of the same uid reads of the runner's environment
    return subprocess.run(["cat", f"/proc/{os.getpid()}/environ"], capture_output=True).stdout
print(int(b"pod-secret" in peek()), int(undumpable()), int(b"pod-secret" in peek()))
"""


def test_a_command_of_the_same_uid_cannot_read_the_pod_token_from_the_runner():
    """The red team's finding: a command read another runner's environ and leased its episodes."""
    done = subprocess.run(
        [sys.executable, "-c", _PEEK],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, ENVIRONMENT_TOKEN_ENV: "pod-secret"},
    )
    assert done.returncode == 0, done.stderr
    readable_before, made_undumpable, readable_after = map(int, done.stdout.split())
    assert (readable_before, made_undumpable, readable_after) == (1, 1, 0)
