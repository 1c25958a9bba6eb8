"""The node agent double (e2e/src/rldock_e2e/doubles/node_agent.py) on its own: pods the real scheduler binds to
its emulated nodes run as local processes in their own sandboxes, with their volumes, env, pod IP
and /etc/hosts, report their state, and leave nothing behind when deleted."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from rldock_e2e.controlplane import ControlPlane, wait_for
from rldock_e2e.controlplane.processes import pid_alive
from rldock_e2e.doubles.node_agent import NodeAgentDouble
from rldock_e2e.doubles.sandbox import sandbox_unavailable

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def agent(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeAgentDouble]:
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("node-agent")
    with NodeAgentDouble(control_plane, workdir=work, host_root=work / "shared", interval=0.2) as node_agent:
        node_agent.add_node(f"agent-{uuid.uuid4().hex[:6]}", devices=8)
        yield node_agent
    assert not node_agent.errors, node_agent.errors
    # The mount points the agent had to create on the host are gone with it.
    assert not Path("/agent-shared").exists() and not Path("/etc/agent-test").exists()


def _pod(name: str, script: str, **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "none",
                    "command": ["/bin/bash", "-lc", "--"],
                    "args": [script],
                    "env": [
                        {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
                        {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "GREETING", "value": "hello $(MY_IP)"},
                    ],
                    "volumeMounts": [
                        {"name": "cfg", "mountPath": "/etc/agent-test", "readOnly": True},
                        {"name": "shared", "mountPath": "/agent-shared"},
                    ],
                }
            ],
            "volumes": [
                {"name": "cfg", "configMap": {"name": "cfg"}},
                {"name": "shared", "hostPath": {"path": "/data/agent", "type": "DirectoryOrCreate"}},
            ],
            **spec,
        },
    }


def test_pod_runs_with_volumes_env_and_its_own_address(
    control_plane: ControlPlane, namespace: str, agent: NodeAgentDouble
) -> None:
    core = client.CoreV1Api(control_plane.api_client())
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"}, "data": {"job.yaml": "x: 1\n"}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s"}, "stringData": {"token": "t0ken"}})
    core.create_namespaced_service(
        namespace, {"metadata": {"name": "web"}, "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080}]}}
    )
    script = (
        'cat /etc/agent-test/job.yaml; echo "$FROM_SECRET $GREETING $(hostname)"; which python; '
        'test -d "$HOME/.cache" && echo image-home-visible; '
        f"echo written > /agent-shared/out.txt; until getent hosts web.{namespace}.svc.cluster.local; "
        "do sleep 0.2; done; exec python -m http.server 8080"
    )
    core.create_namespaced_pod(namespace, _pod("web", script))

    def running() -> dict | None:
        pod = control_plane.kubectl_json("get", "pod", "web", "-n", namespace)
        return pod if pod["status"].get("phase") == "Running" and pod["status"].get("podIP") else None

    pod = wait_for("pod web Running", running, timeout=60)
    ip = pod["status"]["podIP"]
    assert not ip.startswith("127."), ip  # a pod-network address, not the node's
    # The host (where the operator runs) reaches the pod at its IP.
    body = wait_for("the pod's server", lambda: _get(f"http://{ip}:8080/"), timeout=30)
    assert "Directory listing" in body
    log = agent.log_path(namespace, "web", "main")
    wait_for("the hosts line", lambda: "web." in log.read_text(), timeout=30)
    text = log.read_text()
    assert "x: 1" in text and f"t0ken hello {ip} web" in text, text
    assert "image-home-visible" in text, text  # HOME and its warm caches are there in the pod
    assert str(Path(agent.image_env["PATH"].split(":")[0]) / "python") in text, text  # the "image" PATH
    assert f"{ip}" in text.split("web.")[0].splitlines()[-1]  # the Service name resolves to the pod
    assert (agent.host_root / "data/agent/out.txt").read_text() == "written\n"
    ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert ready["Ready"] == "True" and pod["status"]["containerStatuses"][0]["state"].get("running")

    pids = agent.pids(namespace)["web"]
    assert pids and all(pid_alive(p) for p in pids)
    control_plane.kubectl("delete", "pod", "web", "-n", namespace, "--wait=true", "--timeout=60s")
    assert not any(pid_alive(p) for p in pids), "processes of a deleted pod are still running"


def test_exit_codes_and_phases(control_plane: ControlPlane, namespace: str, agent: NodeAgentDouble) -> None:
    core = client.CoreV1Api(control_plane.api_client())
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"}, "data": {}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s"}, "stringData": {"token": "t"}})
    core.create_namespaced_pod(namespace, _pod("ok", "exit 0"))
    core.create_namespaced_pod(namespace, _pod("bad", "exit 3"))
    core.create_namespaced_pod(
        namespace,
        _pod(
            "missing",
            "exit 0",
            volumes=[{"name": "cfg", "configMap": {"name": "no-such-map"}}, {"name": "shared", "emptyDir": {}}],
        ),
    )

    def phase(name: str) -> str:
        return control_plane.kubectl_json("get", "pod", name, "-n", namespace)["status"].get("phase", "")

    wait_for("ok Succeeded", lambda: phase("ok") == "Succeeded", timeout=60)
    wait_for("bad Failed", lambda: phase("bad") == "Failed", timeout=60)
    bad = control_plane.kubectl_json("get", "pod", "bad", "-n", namespace)
    assert bad["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    missing = control_plane.kubectl_json("get", "pod", "missing", "-n", namespace)
    assert missing["status"]["phase"] == "Pending"
    waiting = wait_for(
        "missing waits for its ConfigMap",
        lambda: control_plane.kubectl_json("get", "pod", "missing", "-n", namespace)["status"].get("containerStatuses"),
        timeout=30,
    )
    assert waiting[0]["state"]["waiting"]["reason"] == "CreateContainerConfigError", json.dumps(waiting)


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def test_a_deleted_pod_runs_its_pre_stop_hook_in_its_container_before_sigterm(
    control_plane: ControlPlane, namespace: str, agent: NodeAgentDouble
) -> None:
    """A kubelet runs a container's preStop exec hook (the Ray head's `rldock preempt`) in that container's
    namespaces before it sends SIGTERM: the hook sees the container's own processes (its PID 1 is the
    container's command), and the pod stays terminating, reported Running, while the hook runs."""
    core = client.CoreV1Api(control_plane.api_client())
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"}, "data": {}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s"}, "stringData": {"token": "t"}})
    script = "trap 'echo term >> /agent-shared/order; exit 0' TERM; while true; do sleep 0.1; done"
    # the hook ends when the test says so (`go`), after it has seen the pod terminating and still running
    hook = (
        "tr '\\0' ' ' < /proc/1/cmdline > /agent-shared/hook-saw; "
        "until [ -e /agent-shared/go ]; do sleep 0.1; done; echo hook >> /agent-shared/order"
    )
    pod = _pod("hooked", script, terminationGracePeriodSeconds=30)
    pod["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {"command": ["/bin/bash", "-c", hook]}}}
    core.create_namespaced_pod(namespace, pod)
    wait_for(
        "pod hooked Running",
        lambda: control_plane.kubectl_json("get", "pod", "hooked", "-n", namespace)["status"].get("phase") == "Running",
        timeout=60,
    )
    shared = agent.host_root / "data/agent"
    for leftover in ("order", "go", "hook-saw"):
        (shared / leftover).unlink(missing_ok=True)
    control_plane.kubectl("delete", "pod", "hooked", "-n", namespace, "--wait=false")
    saw = wait_for(
        "the hook ran", lambda: (shared / "hook-saw").is_file() and (shared / "hook-saw").read_text(), timeout=30
    )
    assert "trap" in saw, saw  # PID 1 of the namespace the hook ran in: the container's command
    terminating = control_plane.kubectl_json("get", "pod", "hooked", "-n", namespace)
    assert terminating["metadata"].get("deletionTimestamp") and terminating["status"]["phase"] == "Running"
    (shared / "go").touch()
    control_plane.kubectl("wait", "--for=delete", "pod/hooked", "-n", namespace, "--timeout=60s")
    assert (shared / "order").read_text().split() == ["hook", "term"]  # SIGTERM only after the hook ended
