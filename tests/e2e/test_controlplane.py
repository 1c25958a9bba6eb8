"""The e2e control plane itself: API round trips, the real scheduler on emulated Ascend nodes,
KubeRay's real schema, our CRD on a 1.20 apiserver, garbage collection, and no leaked processes."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from rldock_e2e.controlplane import DEVELOPER_USER, ControlPlane, pid_alive, wait_for

pytestmark = pytest.mark.e2e

DEVICE = "huawei.com/Ascend910"
REPO_ROOT = Path(__file__).resolve().parents[2]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def device_pod(name: str, *, node: str, devices: int) -> dict:
    """A pod asking for `devices` NPUs, pinned to `node` so other tests' nodes don't matter."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [
                {
                    "name": "main",
                    "image": "rldock/none:0",
                    "command": ["true"],
                    "resources": {"limits": {DEVICE: str(devices)}},
                }
            ],
        },
    }


def ray_container(name: str) -> dict:
    return {"name": name, "image": "rayproject/ray:2.40.0"}


def raycluster(name: str, *, replicas: object) -> dict:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {
            "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [ray_container("ray-head")]}}},
            "workerGroupSpecs": [
                {
                    "groupName": "workers",
                    "replicas": replicas,
                    "minReplicas": 0,
                    "maxReplicas": 4,
                    "rayStartParams": {},
                    "template": {"spec": {"containers": [ray_container("ray-worker")]}},
                }
            ],
        },
    }


def rljob(name: str, *, iterations: object = 3) -> dict:
    return {
        "apiVersion": "rldock.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name},
        "spec": {
            "job": {
                "iterations": iterations,
                "model": {"path": "/models/tiny", "builder": "tiny-qwen2"},
                "algorithm": {
                    "num_prompts_per_iteration": 8,
                    "num_responses_per_prompt": 4,
                    "max_prompt_length": 8,
                    "max_response_length": 6,
                    "learning_rate": 3e-4,
                },
                "resources": {"num_nodes": 1, "devices_per_node": 8},
            },
            "checkpoint": {"claimName": "rl-checkpoints"},
        },
    }


def test_namespace_and_configmap_round_trip(control_plane: ControlPlane, namespace: str) -> None:
    with control_plane.api_client() as api_client:
        core = client.CoreV1Api(api_client)
        assert core.read_namespace(namespace).status.phase == "Active"
        data = {"config.yaml": "iterations: 3\n", "empty": ""}
        core.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"}, "data": data})
        assert core.read_namespaced_config_map("cfg", namespace).data == data
    listed = control_plane.kubectl_json("get", "configmaps", "-n", namespace)
    assert "cfg" in [item["metadata"]["name"] for item in listed["items"]]


def test_non_admin_user_is_authenticated_but_not_authorized(control_plane: ControlPlane) -> None:
    result = control_plane.kubectl("get", "pods", "-n", "default", user=DEVELOPER_USER, check=False)
    assert result.returncode != 0
    assert 'User "developer" cannot list resource "pods"' in result.stderr


def test_emulated_node_advertises_devices(emulated_nodes) -> None:
    name = unique("npu")
    node = emulated_nodes(name, devices=4)
    assert node["status"]["allocatable"][DEVICE] == "4"
    assert node["metadata"]["labels"]["accelerator"] == "huawei-Ascend910"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == name
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"
    assert not node["spec"].get("taints")  # TaintNodesByCondition's not-ready taint is lifted


def test_scheduler_binds_fitting_pod_and_leaves_oversized_pending(
    control_plane: ControlPlane, namespace: str, emulated_nodes
) -> None:
    node = unique("npu")
    emulated_nodes(node, devices=8)
    with control_plane.api_client() as api_client:
        core = client.CoreV1Api(api_client)
        core.create_namespaced_pod(namespace, device_pod("fits", node=node, devices=8))
        core.create_namespaced_pod(namespace, device_pod("too-big", node=node, devices=16))

        bound = wait_for(
            "pod fits bound", lambda: core.read_namespaced_pod("fits", namespace).spec.node_name, timeout=60
        )
        assert bound == node

        def unschedulable():
            pod = core.read_namespaced_pod("too-big", namespace)
            return next(
                (c for c in pod.status.conditions or [] if c.type == "PodScheduled" and c.status == "False"), None
            )

        condition = wait_for("pod too-big marked unschedulable", unschedulable, timeout=60)
        pod = core.read_namespaced_pod("too-big", namespace)
        assert pod.spec.node_name is None and pod.status.phase == "Pending"
        assert condition.reason == "Unschedulable"
        assert f"Insufficient {DEVICE}" in condition.message


def test_kuberay_schema_refuses_wrong_type(
    control_plane: ControlPlane, kuberay_crds: list[str], namespace: str
) -> None:
    assert "rayclusters.ray.io" in kuberay_crds
    good = control_plane.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(raycluster("good", replicas=2)))
    assert "created" in good.stdout
    # Server side, as the operator's client sends it (no client-side validation).
    with control_plane.api_client() as api_client:
        custom = client.CustomObjectsApi(api_client)
        with pytest.raises(client.ApiException) as refused:
            custom.create_namespaced_custom_object(
                "ray.io", "v1", namespace, "rayclusters", raycluster("bad", replicas="two")
            )
    assert refused.value.status == 422
    message = json.loads(refused.value.body)["message"]
    assert "spec.workerGroupSpecs.replicas in body must be of type integer" in message, message
    # Through kubectl, whose client-side validation uses the schema the server publishes.
    bad = control_plane.kubectl(
        "create", "-n", namespace, "-f", "-", input=json.dumps(raycluster("bad", replicas="two")), check=False
    )
    assert bad.returncode != 0
    assert "spec.workerGroupSpecs[0].replicas" in bad.stderr and "integer" in bad.stderr, bad.stderr


def test_rljob_crd_installs_and_serves(control_plane: ControlPlane, rljob_crd: list[str], namespace: str) -> None:
    assert rljob_crd == ["rljobs.rldock.io"]
    empty = control_plane.kubectl("get", "rljobs", "-n", namespace)
    assert empty.returncode == 0
    control_plane.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(rljob("tiny")))
    table = control_plane.kubectl("get", "rljobs", "-n", namespace).stdout.split()
    for column in ("NAME", "PHASE", "ITERATION", "REWARD", "TPS", "AGE", "tiny"):
        assert column in table, table
    bad = control_plane.kubectl(
        "create", "-n", namespace, "-f", "-", input=json.dumps(rljob("bad", iterations="many")), check=False
    )
    assert bad.returncode != 0
    assert "spec.job.iterations" in bad.stderr, bad.stderr


def test_garbage_collector_deletes_dependents(control_plane: ControlPlane, namespace: str) -> None:
    with control_plane.api_client() as api_client:
        core = client.CoreV1Api(api_client)
        owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
        owner_ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
        core.create_namespaced_config_map(namespace, {"metadata": {"name": "child", "ownerReferences": [owner_ref]}})
        core.delete_namespaced_config_map("owner", namespace)

        def child_gone() -> bool:
            names = [cm.metadata.name for cm in core.list_namespaced_config_map(namespace).items]
            return "child" not in names

        wait_for("the garbage collector to delete child", child_gone, timeout=60)


# The child restores Python's Ctrl-C handler first: a test run started in the background by a
# shell without job control (`make test &`) inherits SIGINT ignored, and Python then installs none.
_CHILD = textwrap.dedent("""
    import json, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from rldock_e2e.controlplane import ControlPlane
    with ControlPlane(workdir=sys.argv[1], build=False) as plane:
        print(json.dumps(plane.pids), flush=True)
        time.sleep(600)
""")


def _read_line(process: subprocess.Popen, timeout: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    if not selector.select(timeout):
        raise TimeoutError(f"no output from the child in {timeout} s")
    return process.stdout.readline()


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"]
)
def test_no_process_left_when_interrupted(control_plane: ControlPlane, tmp_path: Path, signum: int) -> None:
    """A test run stopped by Ctrl-C, by SIGTERM or by SIGKILL leaves no server running."""
    with open(tmp_path / "child.log", "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(tmp_path / "cp")], stdout=subprocess.PIPE, stderr=log, text=True
        )
        try:
            line = _read_line(child, timeout=300)
            assert line, (tmp_path / "child.log").read_text()[-3000:]
            pids = json.loads(line)
            assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
            assert all(pid_alive(pid) for pid in pids.values())
            child.send_signal(signum)
            child.wait(timeout=60)
            # Polls the state; the bound only limits a failure. Servers stopping gracefully on a loaded
            # 2-core machine (a full test run beside them) can take longer than 15 s.
            wait_for("all servers gone", lambda: not any(map(pid_alive, pids.values())), timeout=60)
        finally:
            child.kill()
            child.wait()
