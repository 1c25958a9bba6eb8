"""Kind-style nodes (e2e/src/rldock_e2e/nodes): real kubelets and containerd in privileged podman
containers, joined to their own control plane (node-lifecycle controller on), with the emulated
Ascend device plugin; pods run in the operator image that images/build.sh builds (the
`kind_cluster` fixture, tests/e2e/conftest.py, which skips with the reason where this machine
cannot build or run it).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest

from rldock_e2e.controlplane import wait_for
from rldock_e2e.nodes.cluster import DEVICE_RESOURCE
from rldock_e2e.nodes.containers import STATUS_SCRIPT, parse_status, task_pids

pytestmark = pytest.mark.e2e


def test_nodes_join_ready_with_their_devices(kind_cluster):
    plane, nodes, _ = kind_cluster
    for name, kind_node in nodes.nodes.items():
        node = plane.kubectl_json("get", "node", name)
        assert node["status"]["allocatable"][DEVICE_RESOURCE] == str(kind_node.devices)
        assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.20.2"
        assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://1.6")
        # the node-lifecycle controller lifted the not-ready taint the admission plugin put on
        assert not node["spec"].get("taints")


def _pod(name: str, image: str, *, devices: int, command: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", command],
                    "resources": {"limits": {DEVICE_RESOURCE: str(devices), "memory": "256Mi", "cpu": "500m"}},
                }
            ],
        },
    }


def test_pod_gets_devices_env_logs_and_exec(kind_cluster):
    plane, _, image = kind_cluster
    name = f"devices-{uuid.uuid4().hex[:6]}"
    pod = _pod(
        name,
        image,
        devices=2,
        command=(
            "echo visible=$ASCEND_RT_VISIBLE_DEVICES runtime=$ASCEND_VISIBLE_DEVICES; "
            "echo memory=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null "
            "|| cat /sys/fs/cgroup/memory.max); "
            "id -u; exec sleep 600"
        ),
    )
    plane.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        wait_for(
            f"pod {name} running",
            lambda: plane.kubectl_json("get", "pod", name)["status"].get("phase") == "Running",
            timeout=180,
            interval=1.0,
        )
        wait_for(f"pod {name} logs", lambda: "memory=" in plane.kubectl("logs", name).stdout, timeout=60, interval=1.0)
        logs = plane.kubectl("logs", name).stdout
        visible = logs.split("visible=")[1].split()[0]
        assert len(visible.split(",")) == 2 and f"runtime={visible}" in logs, logs
        assert "memory=268435456" in logs, logs  # the limit reached the container's cgroup
        assert logs.strip().splitlines()[-1] == "10001", logs  # the image's non-root user
        out = plane.kubectl("exec", name, "--", "python", "-c", "import rldock.operator; print('imported')").stdout
        assert out.strip() == "imported"
    finally:
        plane.kubectl("delete", "pod", name, "--grace-period=1", "--wait=true")


def test_devices_are_counted_by_the_scheduler(kind_cluster):
    """More than a node has stays Pending with the scheduler's reason; what fits runs."""
    plane, nodes, image = kind_cluster
    name = f"toomany-{uuid.uuid4().hex[:6]}"
    most = max(node.devices for node in nodes.nodes.values())
    plane.kubectl("apply", "-f", "-", input=json.dumps(_pod(name, image, devices=most + 1, command="true")))
    try:

        def unschedulable() -> bool:
            conditions = plane.kubectl_json("get", "pod", name)["status"].get("conditions", [])
            return any(
                c.get("reason") == "Unschedulable" and DEVICE_RESOURCE in c.get("message", "") for c in conditions
            )

        wait_for(f"pod {name} unschedulable", unschedulable, timeout=60, interval=1.0)
    finally:
        plane.kubectl("delete", "pod", name, "--grace-period=0", "--force", "--wait=true")


def test_runtime_image_runs_under_the_kubelet(kind_cluster, runtime_image):
    """The CPU runtime image as KubeRay runs it: `bash -lc` (a login shell, so the image's
    profile must put its venv on PATH), the image's non-root user, /dev/shm from a memory
    emptyDir; Ray, vLLM, torch and the `rldock` command the operator submits are there."""
    plane, _, _ = kind_cluster
    name = f"runtime-{uuid.uuid4().hex[:6]}"
    pod = _pod(name, runtime_image, devices=1, command="")
    container = pod["spec"]["containers"][0]
    script = (
        "ray --version && rldock --help >/dev/null && python -c "
        "'import torch, vllm, rldock.runtime.cli; print(\"imports ok\", torch.__version__)' "
        "&& df --output=fstype /dev/shm | tail -1 && id -u"
    )
    container["command"] = ["/bin/bash", "-lc", "--", script]
    container["resources"]["limits"]["memory"] = "2Gi"
    container["volumeMounts"] = [{"name": "shared-mem", "mountPath": "/dev/shm"}]
    pod["spec"]["volumes"] = [{"name": "shared-mem", "emptyDir": {"medium": "Memory"}}]
    plane.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        wait_for(
            f"pod {name} finished",
            lambda: plane.kubectl_json("get", "pod", name)["status"].get("phase") in ("Succeeded", "Failed"),
            timeout=600,
            interval=2.0,
        )
        logs = plane.kubectl("logs", name).stdout
        assert plane.kubectl_json("get", "pod", name)["status"]["phase"] == "Succeeded", logs
        lines = logs.strip().splitlines()
        assert lines[0].startswith("ray, version 2.60.0"), logs
        assert "imports ok 2.13.0+cpu" in logs and lines[-2:] == ["tmpfs", "10001"], logs
    finally:
        plane.kubectl("delete", "pod", name, "--grace-period=1", "--wait=true")


def test_the_status_read_leaves_out_a_process_that_ended():
    """The script container_processes runs in a node, run here: a pid that is gone, listed last,
    prints nothing and fails nothing (the happy path once failed on a Ray worker that ended)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    read = subprocess.run(
        ["sh", "-c", STATUS_SCRIPT, "sh", str(os.getpid()), str(gone.pid)], capture_output=True, text=True, check=True
    )
    chunks = read.stdout.split("--- ")[1:]
    assert [chunk.partition("\n")[0] for chunk in chunks] == [str(os.getpid()), str(gone.pid)]
    assert parse_status(chunks[0].partition("\n")[2])["Pid"] == str(os.getpid())
    assert chunks[1].partition("\n")[2].strip() == ""


def test_container_processes_parse_what_ctr_and_proc_print():
    """The parsing behind the scenarios' non-root check (nodes/containers.py), on captured output
    (runs without nodes): `ctr tasks ps` rows and a /proc/<pid>/status."""
    assert task_pids("PID     INFO\n4242    -\n4250    -\n") == [4242, 4250]
    assert task_pids("PID     INFO\n") == []
    status = parse_status(
        "Name:\traylet\nUid:\t10001\t10001\t10001\t10001\nCapBnd:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\n"
    )
    assert status == {
        "Name": "raylet",
        "Uid": "10001\t10001\t10001\t10001",
        "CapBnd": "0000000000000000",
        "NoNewPrivs": "1",
        "Seccomp": "2",
    }
