"""spec.agents against a real kube-apiserver and controller-manager (e2e/controlplane), as
test_operator_environments.py runs spec.environments: the operator as its own process with its generated
RBAC, the real Deployment, ReplicaSet and endpoints controllers and garbage collector, and the kubelet double
making the bound pods Running and Ready.

What runs for real and what does not:
- the agent pods' **processes** are the runner the operator mounted, started by the test from each pod as
  the API server stored it: its command and args, the runner file from the job's ConfigMap, its env as the
  kubelet resolves it (the job's pod token from the Secret the operator made); the user's command (an
  OpenAI-client script) runs per episode;
- the **gateway** is the runtime's (GatewayEpisodes with agent.harness_pods, its dispatcher and sessions), run
  in the test process over the scripted engine double (rldock_e2e/doubles/scripted_engine.py), not a
  Ray job: no KubeRay here, so no Ray pod serves it;
- the pods reach it at 127.0.0.1 instead of the gateway Service's name (a TEST DOUBLE of the cluster's DNS
  and Service routing: the kubelet double's pod addresses are loopback ones); no network plugin enforces the
  NetworkPolicies, checked as the API server stores them.
"""

from __future__ import annotations

import json
import os
import signal
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from test_operator_environments import Envs, operator_namespace

from rldock.config import parse_job_config
from rldock.contract.agent_pods import GATEWAY_ENV, GATEWAY_PORT
from rldock.contract.runtime_cli import ENVIRONMENT_TOKEN_ENV
from rldock.operator import naming
from rldock.runtime.gateway.episodes import GatewayEpisodes
from rldock.runtime.models.tiny import CHAT_TEMPLATE, train_char_tokenizer
from rldock.runtime.rollout.harness import result_sums
from rldock_e2e.controlplane import ControlPlane
from rldock_e2e.doubles.kubelet import KubeletDouble
from rldock_e2e.pod_security import restricted_violations

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

PREFIX = "registry.example.com/agents/"
POLICY = {"imagePrefixes": [PREFIX], "agents": {"maxReplicas": 2}}
AGENT_SCRIPT = """
import json, os, time, openai
task = json.loads(os.environ["RLDOCK_TASK"])
if task["mode"] == "hang":
    open(task["pid_file"], "w").write(str(os.getpid()))
    time.sleep(600)
client = openai.OpenAI()
answer = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["prompt"]}])
print(json.dumps({"reward": float(answer.choices[0].message.content == task["ground_truth"])}))
"""
JOB = {
    "name": "agents",
    "iterations": 2,
    "model": {"path": "/models/tiny", "builder": "tiny-qwen2"},
    "data": {"generator": {"name": "addition"}, "chat_template": "model"},
    "reward": {"terms": [{"name": "environment"}]},
    "agent": {"episode_timeout_s": 120},
    "algorithm": {
        "num_prompts_per_iteration": 4,
        "num_responses_per_prompt": 2,
        "max_prompt_length": 64,
        "max_response_length": 256,
        "learning_rate": 3e-4,
    },
    "training": {"data_parallel_size": 2},
    "resources": {"num_nodes": 1, "devices_per_node": 2},
}


def rljob(name: str, agents: list[dict[str, Any]]) -> dict[str, Any]:
    spec = {
        "job": JOB,
        "checkpoint": {"claimName": "rl-checkpoints"},
        "cluster": {"head": {"cpu": 1, "memory": "1Gi"}, "worker": {"cpu": 1, "memory": "1Gi"}},
        "agents": agents,
    }
    return {"apiVersion": "rldock.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": spec}


class AgentPods:
    """The agent pods' processes: each pod the kubelet double runs is recorded with its resolved env; the
    test starts its runner (`start`) once the gateway is up; a pod's stop or `kill` ends it, as a dying pod."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.pods: dict[str, tuple[Mapping[str, Any], dict[str, str]]] = {}
        self.processes: dict[str, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def on_start(self, pod: Mapping[str, Any], _ip: str, env: dict[str, str]) -> None:
        if "rldock.io/agent" in (pod["metadata"].get("labels") or {}):
            with self._lock:
                self.pods[pod["metadata"]["name"]] = (pod, env)

    def on_stop(self, pod: Mapping[str, Any]) -> None:
        self.kill(pod["metadata"]["name"])

    def start(self, name: str, envs: Envs, *, gateway_port: int) -> None:
        pod, env = self.pods[name]
        (container,) = pod["spec"]["containers"]
        (volume,) = (v for v in pod["spec"]["volumes"] if "configMap" in v)
        (mount,) = (m for m in container["volumeMounts"] if m["name"] == volume["name"])
        # The ConfigMap volume as the kubelet would mount it: its files under the mount path.
        mounted = self.work / name
        mounted.mkdir(exist_ok=True)
        for key, text in envs.child("ConfigMap", volume["configMap"]["name"])["data"].items():
            (mounted / key).write_text(text)
        python, runner = container["command"]
        assert python == "python3" and runner.startswith(mount["mountPath"] + "/")
        argv = [sys.executable, str(mounted / runner.removeprefix(mount["mountPath"] + "/")), *container["args"]]
        # The gateway Service's name, routed to the test's gateway (the DNS and Service routing double).
        assert env[GATEWAY_ENV].endswith(f".svc.cluster.local:{GATEWAY_PORT}")
        process_env = {**env, GATEWAY_ENV: f"127.0.0.1:{gateway_port}", "PATH": os.environ["PATH"]}
        with self._lock:
            self.processes[name] = subprocess.Popen(argv, env=process_env, start_new_session=True)

    def kill(self, name: str) -> None:
        with self._lock:
            process = self.processes.pop(name, None)
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def close(self) -> None:
        for name in list(self.processes):
            self.kill(name)


@pytest.fixture(scope="module")
def agent_envs(
    control_plane: ControlPlane,
    kuberay_crds: list[str],
    rljob_crd: list[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Envs, KubeletDouble, AgentPods]]:
    pods = AgentPods(tmp_path_factory.mktemp("pods"))
    work = tmp_path_factory.mktemp("operator")
    try:
        with operator_namespace(control_plane, work, policy=POLICY, on_start=pods.on_start, on_stop=pods.on_stop) as (
            envs,
            kubelet,
        ):
            yield envs, kubelet, pods
    finally:
        pods.close()


def agent_pods(envs: Envs, rljob: str) -> list[dict[str, Any]]:
    response = envs.core.list_namespaced_pod(
        envs.namespace, label_selector=f"rldock.io/agent-of={naming.label_value(rljob)}", _preload_content=False
    )
    return [p for p in json.loads(response.data)["items"] if not p["metadata"].get("deletionTimestamp")]


def test_agent_pods_run_restricted_serve_episodes_survive_a_killed_pod_and_go_with_the_rljob(
    agent_envs, tmp_path, monkeypatch
):
    envs, kubelet, pods = agent_envs
    name = "solver-job"
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    entry = {"name": "solver", "command": [sys.executable, str(script)], "replicas": 2}
    envs.apply(rljob(name, [entry]))
    uid = envs.wait("the RLJob", lambda: envs.rljob(name))["metadata"]["uid"]

    # The children, as the API server stored them, all owned by the RLJob.
    child = naming.agent_name(name, "solver")
    deployment = envs.wait("the agent's Deployment", lambda: envs.child("Deployment", child))
    policy = envs.wait("the agent's NetworkPolicy", lambda: envs.child("NetworkPolicy", child))
    runner_map = envs.wait(
        "the runner ConfigMap", lambda: envs.child("ConfigMap", naming.agent_runner_config_map_name(name))
    )
    gateway = envs.wait("the gateway Service", lambda: envs.child("Service", naming.gateway_service_name(name)))
    for obj in (deployment, policy, runner_map, gateway):
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("RLJob", uid, True)
    template = deployment["spec"]["template"]
    assert restricted_violations(template["spec"], template["metadata"].get("annotations")) == []
    assert template["spec"]["automountServiceAccountToken"] is False
    assert "ingress" not in policy["spec"] and policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    ports = [rule.get("ports") for rule in policy["spec"]["egress"]]
    assert [{"protocol": "TCP", "port": GATEWAY_PORT}] in ports
    assert gateway["spec"]["clusterIP"] == "None" and gateway["spec"]["selector"] == {"rldock.io/rljob": name}
    ray_policy = envs.child("NetworkPolicy", f"{name}-ray")
    assert any(
        rule.get("ports") == [{"protocol": "TCP", "port": GATEWAY_PORT}] for rule in ray_policy["spec"]["ingress"]
    )
    job_yaml = envs.child("ConfigMap", naming.config_map_name(name))["data"]["job.yaml"]
    assert "harness_pods: true" in job_yaml

    # The pods made by the Deployment controller, readied by the kubelet double; the status follows.
    envs.wait_status(name, "2/2 agent pods ready", lambda s: s.get("agentsReady") == "2/2")
    assert "AGENTS" in envs.plane.kubectl("get", "rlj", name, "-n", envs.namespace).stdout
    assert any(e["reason"] == "CreatedAgent" for e in envs.events(name))

    # The job's gateway with the pods' token (as the Ray pods read it from the same Secret).
    first, second = sorted(p["metadata"]["name"] for p in agent_pods(envs, name))
    monkeypatch.setenv(ENVIRONMENT_TOKEN_ENV, pods.pods[first][1][ENVIRONMENT_TOKEN_ENV])
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = CHAT_TEMPLATE
    cfg = parse_job_config({**JOB, "agent": {"episode_timeout_s": 120, "harness_pods": True}})
    served = GatewayEpisodes(cfg, tokenizer=tokenizer, prompt_capacity=64, pod_port=0)
    try:
        assert served.runner.lease_s > 2  # type: ignore[union-attr]
        served.runner.lease_s = 6.0  # type: ignore[union-attr]  # three of the runner's 2 s heartbeats
        port = int(served.server.url.rsplit(":", 1)[1])
        tasks = [
            {"mode": mode, "prompt": "2+3?", "ground_truth": "5", "pid_file": str(tmp_path / f"{i}.pid")}
            for i, mode in enumerate(("hang", "ok", "ok", "ok"))
        ]
        pods.start(first, envs, gateway_port=port)  # alone, it leases the first episode, whose command hangs

        def kill_the_pod_then_serve_from_the_other() -> None:
            pid_file = Path(tasks[0]["pid_file"])
            deadline = time.monotonic() + 60
            while not pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            pods.kill(first)  # the pod's processes die with it
            if pid_file.exists():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            kubelet.fail(first)
            pods.start(second, envs, gateway_port=port)

        killer = threading.Thread(target=kill_the_pod_then_serve_from_the_other)
        killer.start()
        from rldock_e2e.doubles.scripted_engine import ScriptedEngine

        engine = ScriptedEngine(tokenizer, {k: ["5"] for k in range(4)})
        results = served.run(engine, tasks=tasks, prompts=[[1]] * 4, keys=[0, 1, 2, 3], seed=0)
        killer.join()
    finally:
        served.close()
    assert [r.ended for r in results] == ["harness_lost", "harness_done", "harness_done", "harness_done"]
    assert [r.rewards for r in results[1:]] == [[1.0]] * 3
    assert result_sums(results, engine_s=0.0, wall_s=0.0)["ended/harness_lost"] == 1

    # Deleted with the RLJob: the garbage collector takes every child and the pods.
    envs.plane.kubectl("delete", "rljob", name, "-n", envs.namespace, "--wait=false")
    envs.wait("the RLJob gone", lambda: envs.rljob(name) is None)
    for kind, child_name in (
        ("Deployment", child),
        ("NetworkPolicy", child),
        ("ConfigMap", naming.agent_runner_config_map_name(name)),
        ("Service", naming.gateway_service_name(name)),
        ("ServiceAccount", naming.environment_service_account_name(name)),
    ):
        envs.wait(f"{kind} {child_name} collected", lambda k=kind, c=child_name: envs.child(k, c) is None)
    envs.wait("the agents' pods gone", lambda: agent_pods(envs, name) == [])


def test_an_agent_image_outside_the_policy_is_denied_and_nothing_is_created(agent_envs):
    envs, _, _ = agent_envs
    name = "denied-agent"
    entry = {"name": "solver", "image": "elsewhere.example.com/solver:1", "command": ["python3", "a.py"]}
    envs.apply(rljob(name, [entry, {"name": "big", "command": ["python3", "a.py"], "replicas": 3}]))
    status = envs.wait_status(name, "phase Failed", lambda s: s.get("phase") == "Failed")["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PolicyDenied"
    assert "spec.agents[0].image" in failed["message"] and "policy.imagePrefixes" in failed["message"]
    assert "spec.agents[1].replicas" in failed["message"] and "policy.agents.maxReplicas" in failed["message"]
    for agent in ("solver", "big"):
        assert envs.child("Deployment", naming.agent_name(name, agent)) is None
    assert agent_pods(envs, name) == []
