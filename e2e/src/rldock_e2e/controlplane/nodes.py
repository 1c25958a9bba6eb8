"""Emulated Ascend nodes: the Node object and status a kubelet with the Ascend device plugin reports.

There is no kubelet here; the control plane only needs a Ready Node whose capacity and
allocatable include the device resource for the real scheduler to bind pods to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone

DEFAULT_DEVICE_RESOURCE = "huawei.com/Ascend910"

# The labels MindX DL's installation guide puts on an Ascend 910 worker node (its scheduler
# components select on them), beside the well-known labels a kubelet sets itself.
ASCEND_NODE_LABELS = {
    "accelerator": "huawei-Ascend910",
    "accelerator-type": "module",
    "host-arch": "huawei-x86",
    "node-role.kubernetes.io/worker": "worker",
    "workerselector": "dls-worker-node",
}


def node_manifest(name: str, *, labels: Mapping[str, str] | None = None, taints: list[dict] | None = None) -> dict:
    """The Node as created (spec and metadata; status goes through the status subresource)."""
    all_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        **ASCEND_NODE_LABELS,
        **(labels or {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels},
        "spec": {"taints": list(taints)} if taints else {},
    }


def node_status(
    name: str,
    *,
    device_resource: str | None = DEFAULT_DEVICE_RESOURCE,
    num_devices: int = 8,
    cpu: str = "64",
    memory: str = "512Gi",
    max_pods: int = 110,
    now: datetime | None = None,
) -> dict:
    """A Ready node's status with `num_devices` of `device_resource` (None: a CPU-only node)."""
    resources = {"cpu": cpu, "memory": memory, "pods": str(max_pods), "ephemeral-storage": "1Ti"}
    if device_resource is not None:
        resources[device_resource] = str(num_devices)
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "capacity": dict(resources),
        "allocatable": dict(resources),
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "emulated node (rldock e2e)",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
        ],
        # Loopback: the node agent test double runs pods as local processes on 127.0.0.1.
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
        "nodeInfo": {
            "architecture": "amd64",
            "operatingSystem": "linux",
            "osImage": "rldock emulated node",
            "kernelVersion": "",
            "kubeletVersion": "v1.20.2",
            "kubeProxyVersion": "v1.20.2",
            "containerRuntimeVersion": "none://",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
        },
    }
