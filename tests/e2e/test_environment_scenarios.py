"""Issue 37's RLJob with an environment as a service, on the real control plane: the operator's
Deployment, headless Service and NetworkPolicy of a `spec.environments` entry, its pods run by the
node agent double (the venv standing in for the image, so `rldock env serve` serves a test double's
class), the cluster DNS double answering the Service's name with every ready pod, and the real
runtime in the Ray pods opening one WebSocket session per episode on them. One replica is taken
away while sessions are open on it: those episodes end as environment errors, the job goes on.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from rldock.operator import naming
from rldock_e2e.pod_security import restricted_violations
from rldock_e2e.scenario import Scenario

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "rljob-tiny.yaml"
CHECKPOINT_CLAIM = "rl-checkpoints"  # what the example mounts (the `scenario` fixture binds it)
START_TIMEOUT = 420  # a Ray head and worker, the driver's model build and warm-up, the engine
RUN_TIMEOUT = 600
ENVIRONMENT = "adder"
PORT = 8000
REPLICAS = 2
SESSIONS_PER_REPLICA = 4
STEP_SECONDS = 2  # each step of the double sleeps this long: an episode holds its session >= 3 steps
MAX_TURNS = 3
ITERATIONS = 3


def _manifest(name: str) -> dict[str, Any]:
    """The example RLJob as an agent job: the tiny model answering additions over MAX_TURNS turns,
    each turn a step of a session on the `adder` environment's pods (rldock_e2e.doubles.
    slow_environment), rewarded by the environment alone; the job config of
    tests/integration/test_environment_job.py, one data-parallel rank."""
    manifest = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    manifest["metadata"]["name"] = name
    job = manifest["spec"]["job"]
    job.update(
        name=name,
        iterations=ITERATIONS,
        # Its own model: the tokenizer is trained on the prompts' text, which the chat template changes.
        model={"path": "/checkpoints/models/tiny-qwen2-env-e2e", "builder": "tiny-qwen2", "dtype": "float32"},
        data={"generator": {"name": "addition", "max_operand": 9, "num_prompts": 64}, "chat_template": "model"},
        reward={"terms": [{"name": "environment", "aggregate": "sum"}]},
        # The answers' format (digits, then EOS): every turn then ends and goes to the environment as a step.
        warmup={"steps": 150, "batch_size": 32, "learning_rate": 0.003},
        agent={
            "environment": {"name": "openenv", "servers": {"service": ENVIRONMENT}},
            "max_turns": MAX_TURNS,
            "max_tool_response_tokens": 24,
        },
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 4,
            "max_prompt_length": 48,
            "max_response_length": 96,
            "learning_rate": 1e-4,
        },
        training={"data_parallel_size": 1, "micro_batch_size": 16},
        dock={"timeout_s": 300},
        checkpoint={"interval": ITERATIONS},
    )
    pythonpath = os.environ.get("PYTHONPATH")
    code_under_test = [{"name": "PYTHONPATH", "value": pythonpath}] if pythonpath else []  # the pods run this code
    manifest["spec"]["cluster"].update(head={"cpu": 1, "memory": "4Gi"}, worker={"cpu": 4, "memory": "16Gi"})
    manifest["spec"]["env"] = code_under_test
    manifest["spec"]["environments"] = [
        {
            "name": ENVIRONMENT,
            "command": [
                "rldock",
                "env",
                "serve",
                "rldock_e2e.doubles.slow_environment:SlowAddition",
                "--host",
                "0.0.0.0",
                "--port",
                str(PORT),
                "--sessions",
                str(SESSIONS_PER_REPLICA),
                "--option",
                f"step_seconds={STEP_SECONDS}",
            ],
            "port": PORT,
            "replicas": REPLICAS,
            "sessionsPerReplica": SESSIONS_PER_REPLICA,
            "resources": {"cpu": "250m", "memory": "512Mi"},
            "env": code_under_test,  # the environment pods get only their own env
        }
    ]
    return manifest


def _established(pids: list[int], port: int) -> int:
    """TCP connections ESTABLISHED to `port` in the network namespace of `pids` (a pod's processes):
    /proc/<pid>/net/tcp lists the sockets of that process's network namespace."""
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended since it was listed
        local_port = f"{port:04X}"
        return sum(1 for line in lines if (f := line.split())[1].endswith(f":{local_port}") and f[3] == "01")
    return 0


def _env_pods(scenario: Scenario, name: str) -> list[dict[str, Any]]:
    return scenario.pods_now(f"rldock.io/environment-of={name}")


def _ready(pod: dict[str, Any]) -> bool:
    return pod["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or ()
    )


# Opt-in (`make test-slow`): a job start and three agentic iterations, about 6-8 minutes on two
# loaded cores (e2e/README.md, "slow").
@pytest.mark.slow
def test_environment_pods_serve_the_job_survive_a_lost_replica_and_go_with_the_rljob(scenario: Scenario) -> None:
    name = "env-job"
    child = naming.environment_name(name, ENVIRONMENT)
    manifest = _manifest(name)
    hold = scenario.hold(name, claim=CHECKPOINT_CLAIM).before(2)  # iteration 1 runs, then it waits
    manifest["spec"]["env"] = [*manifest["spec"]["env"], *hold.env]
    scenario.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))

    # The operator's children of the entry, and its pods created and ready: `Envs 2/2`.
    scenario.wait(
        "the environment's pods ready",
        lambda: scenario.status(name).get("environmentsReady") == f"{REPLICAS}/{REPLICAS}",
        timeout=START_TIMEOUT,
    )
    assert scenario.row(name)["ENVS"] == f"{REPLICAS}/{REPLICAS}", scenario.row(name)
    pods = _env_pods(scenario, name)
    assert len(pods) == REPLICAS and all(_ready(p) for p in pods), pods
    for kind in ("deployment", "service", "networkpolicy"):
        assert scenario.get(kind, child) is not None, kind
    service = _stored(scenario, "service", child)
    assert service["spec"]["clusterIP"] == "None"  # headless: one address per ready pod

    # The stored pod template (defaulted by the API server) passes the restricted profile.
    template = _stored(scenario, "deployment", child)["spec"]["template"]
    assert restricted_violations(template["spec"], template["metadata"].get("annotations")) == []

    # Iteration 1's episodes were sessions on the pods.
    scenario.wait(
        f"RLJob {name} held after iteration 1",
        lambda: scenario.status(name).get("iteration", 0) == 1,
        timeout=START_TIMEOUT,
    )
    (first,) = scenario.metrics(name)
    agent = first["agent"]
    assert agent["environment/resets"] > 0 and agent["environment/steps"] >= agent["environment/resets"], agent
    assert agent["environment/errors"] == 0 and agent["environment/sessions_open"] == 0, agent
    # The pods' server asks for the job's token (the operator's Secret, RLDOCK_ENV_TOKEN on both sides):
    # the Ray pods' clients sent it for those sessions; a request without it is refused (issue 50).
    base = f"http://{pods[0]['status']['podIP']}:{PORT}"
    assert requests.get(f"{base}/health", timeout=10).status_code == 200
    assert requests.get(f"{base}/schema", timeout=10).status_code == 401

    # Iteration 2 runs (held before 3): once sessions are open on one replica, its pod is deleted
    # (what an eviction or a node drain does). Each session lasts MAX_TURNS steps of STEP_SECONDS,
    # so the sessions seen open are still open when the pod's server closes them on SIGTERM.
    victim = pods[0]["metadata"]["name"]
    hold.before(3)
    scenario.wait(
        f"sessions open on {victim}",
        lambda: _established(_pids(scenario, victim), PORT) >= 2,
        timeout=RUN_TIMEOUT,
        interval=0.2,
    )
    scenario.kubectl("delete", "pod", victim, "--wait=false")

    # The Deployment replaces it; the job goes on, the lost sessions counted as environment errors.
    scenario.wait(
        "a replacement environment pod ready",
        lambda: (
            (now := _env_pods(scenario, name))
            and victim not in {p["metadata"]["name"] for p in now}
            and sum(_ready(p) for p in now) == REPLICAS
        ),
        timeout=120,
    )
    scenario.wait(
        f"RLJob {name} held after iteration 2",
        lambda: scenario.status(name).get("iteration", 0) == 2,
        timeout=RUN_TIMEOUT,
    )
    second = scenario.metrics(name)[1]["agent"]
    assert second.get("ended/environment_error", 0) >= 1 and second["environment/errors"] >= 1, second
    assert scenario.status(name)["phase"] == "Running"
    scenario.wait(
        "Envs 2/2 again", lambda: scenario.status(name).get("environmentsReady") == f"{REPLICAS}/{REPLICAS}", timeout=60
    )

    hold.release()  # iteration 3 on both replicas, the new one included
    status = scenario.wait_phase(name, "Succeeded", timeout=RUN_TIMEOUT)
    assert status["restartCount"] == 0 and scenario.row(name)["ITERATION"] == f"{ITERATIONS}/{ITERATIONS}"
    metrics = scenario.metrics(name)
    assert [m["iteration"] for m in metrics] == list(range(1, ITERATIONS + 1))
    last = metrics[-1]["agent"]
    assert last["environment/resets"] > 0 and last["environment/errors"] == 0, last

    # Finished, the environment is released with the Ray cluster: scaled to 0, its pods and their
    # processes gone; the Deployment, Service and NetworkPolicy stay with the RLJob.
    pods = _env_pods(scenario, name)
    scenario.wait(
        "the environment scaled to 0, its pods and processes gone",
        lambda: (
            _stored(scenario, "deployment", child)["spec"]["replicas"] == 0
            and not _env_pods(scenario, name)
            and not any(_pids(scenario, p["metadata"]["name"]) for p in pods)
        ),
        timeout=120,
    )
    # Deleting the RLJob removes the environment's Deployment, Service and NetworkPolicy.
    deleted = scenario.kubectl("delete", "rljob", name, "--timeout=120s")
    assert f'rljob.rldock.io "{name}" deleted' in deleted.stdout
    scenario.wait(
        "the environment's Deployment, Service, NetworkPolicy and pods gone",
        lambda: (
            all(scenario.get(kind, child) is None for kind in ("deployment", "service", "networkpolicy"))
            and not scenario.items("replicasets", "-l", f"rldock.io/environment-of={name}")
            and not _env_pods(scenario, name)
        ),
        timeout=120,
    )


def _stored(scenario: Scenario, kind: str, name: str) -> dict[str, Any]:
    stored = scenario.get(kind, name)
    assert stored is not None, f"no {kind} {name}"
    return stored


def _pids(scenario: Scenario, pod: str) -> list[int]:
    """The live local processes of environment pod `pod` (the node agent double's)."""
    assert scenario.agent is not None
    return scenario.agent.pids(scenario.namespace, labels={"rldock.io/environment": ENVIRONMENT}).get(pod, [])
