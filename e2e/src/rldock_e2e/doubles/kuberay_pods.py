"""The head and worker Pods KubeRay builds for a RayCluster: pure functions for the KubeRay double.

Transcribed from KubeRay v1.x (ray-operator/controllers/ray/common/pod.go and utils/constant.go),
keeping what a pod's life here depends on:

- rayStartParams completed as `setMissingRayStartParams` does (worker `address` = the head
  Service's FQDN and GCS port, head `dashboard-host` 0.0.0.0, `metrics-export-port` 8080,
  `block`, `dashboard-agent-listen-port` 52365) and as `generateRayStartCommand` does (`num-cpus`
  and `memory` from the Ray container's limits, `num-gpus` from a `*gpu` limit, `TPU` /
  `neuron_cores` resources from those devices);
- the `ray start` line as `convertParamMap` writes it: keys sorted, `--key=value` with the value
  pasted as it is (KubeRay does not quote: a value with spaces or JSON needs its own shell
  quotes), `true` as a bare flag, `false` dropped; run as `/bin/bash -lc -- "ulimit -n 65536; ray
  start ..."`;
- the env KubeRay adds (RAY_CLUSTER_NAME, RAY_CLOUD_INSTANCE_ID, RAY_NODE_TYPE_NAME through
  fieldRefs, FQ_RAY_IP/RAY_IP on workers, RAY_PORT, RAY_ADDRESS, KUBERAY_GEN_RAY_START_CMD, ...);
- the worker's `wait-gcs-ready` init container (`ray health-check` against the head until the GCS
  answers, with the Ray container's securityContext), the readiness and liveness exec probes (`wget` of the
  raylet's and the GCS's health
  endpoints), the metrics container port, and a `/dev/shm` memory emptyDir unless one is mounted.

Not transcribed: autoscaler sidecars, GCS fault tolerance, TLS, RayService/RayJob specifics.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from typing import Any

from kubernetes.utils import parse_quantity

GCS_PORT = 6379
DASHBOARD_PORT = 8265
METRICS_PORT = 8080
DASHBOARD_AGENT_LISTEN_PORT = 52365
CLIENT_PORT = 10001
SERVING_PORT = 8000
HEAD_GROUP = "headgroup"
CONTAINER_COMMAND = ["/bin/bash", "-lc", "--"]
_CUSTOM_ACCELERATORS = {"aws.amazon.com/neuroncore": "neuron_cores", "google.com/tpu": "TPU"}
_WGET_HEALTH = "wget -T {timeout} -q -O- http://localhost:{port}/{path} | grep success"
_RAYLET_HEALTH_PATH = "api/local_raylet_healthz"
_GCS_HEALTH_PATH = "api/gcs_healthz"


def head_service_name(cluster: str) -> str:
    return f"{cluster}-head-svc"


def head_fqdn(cluster: str, namespace: str) -> str:
    return f"{head_service_name(cluster)}.{namespace}.svc.cluster.local"


def head_port(head_params: Mapping[str, str]) -> str:
    return str(head_params.get("port", GCS_PORT))


def complete_params(params: Mapping[str, str], *, head: bool, port: str, fqdn: str) -> dict[str, str]:
    """setMissingRayStartParams."""
    out = {key: str(value) for key, value in params.items()}
    if not head:
        out.setdefault("address", f"{fqdn}:{port}")
    else:
        out.setdefault("dashboard-host", "0.0.0.0")
    out.setdefault("metrics-export-port", str(METRICS_PORT))
    out["block"] = "true"
    out.setdefault("dashboard-agent-listen-port", str(DASHBOARD_AGENT_LISTEN_PORT))
    return out


def ray_start_command(params: Mapping[str, str], *, head: bool, limits: Mapping[str, Any]) -> str:
    """generateRayStartCommand: `params` completed from the container's limits, then the line."""
    params = dict(params)
    if "num-cpus" not in params and "cpu" in limits:
        params["num-cpus"] = str(math.ceil(parse_quantity(limits["cpu"])))
    if "memory" not in params and "memory" in limits:
        params["memory"] = str(math.ceil(parse_quantity(limits["memory"])))
    resources = json.loads(params["resources"].strip("'\"` ")) if "resources" in params else {}
    has_custom = any(name in resources for name in _CUSTOM_ACCELERATORS.values())
    for key in sorted(limits):
        amount = parse_quantity(limits[key])
        if "num-gpus" not in params and key.endswith("gpu") and amount:
            params["num-gpus"] = str(math.ceil(amount))
        if not has_custom and key in _CUSTOM_ACCELERATORS and amount:
            resources[_CUSTOM_ACCELERATORS[key]] = float(amount)
            params["resources"] = f"'{json.dumps(resources, separators=(',', ':'))}'"
            has_custom = True
    return ("ray start --head " if head else "ray start ") + convert_param_map(params)


def convert_param_map(params: Mapping[str, str]) -> str:
    flags = ""
    for key in sorted(params):
        value = params[key]
        if value.lower() in ("true", "false") and key not in ("log-color", "include-dashboard"):
            if value.lower() == "true":
                flags += f" --{key} "
        else:
            flags += f" --{key}={value} "
    return flags


def _probe(command: str, *, initial_delay: int, timeout: int, failure_threshold: int) -> dict[str, Any]:
    return {
        "exec": {"command": ["bash", "-c", command]},
        "initialDelaySeconds": initial_delay,
        "timeoutSeconds": timeout,
        "periodSeconds": 5,
        "successThreshold": 1,
        "failureThreshold": failure_threshold,
    }


def _health_command(*, head: bool) -> str:
    raylet = _WGET_HEALTH.format(timeout=1, port=DASHBOARD_AGENT_LISTEN_PORT, path=_RAYLET_HEALTH_PATH)
    if not head:
        return raylet
    gcs = _WGET_HEALTH.format(timeout=10, port=DASHBOARD_PORT, path=_GCS_HEALTH_PATH)
    return f"{raylet} && {gcs}"


def _wait_gcs_ready(fqdn: str, port: str) -> str:
    return f"""
SECONDS=0
while true; do
  if (( SECONDS <= 120 )); then
    if ray health-check --address {fqdn}:{port} > /dev/null 2>&1; then
      echo "GCS is ready."
      break
    fi
    echo "$SECONDS seconds elapsed: Waiting for GCS to be ready."
  else
    if ray health-check --address {fqdn}:{port}; then
      echo "GCS is ready. Any error messages above can be safely ignored."
      break
    fi
    echo "$SECONDS seconds elapsed: Still waiting for GCS to be ready."
  fi
  sleep 5
done
"""


def build_pod(cluster: Mapping[str, Any], group: Mapping[str, Any], *, head: bool) -> dict[str, Any]:
    """The Pod KubeRay creates for `group` (the headGroupSpec or one workerGroupSpec)."""
    name, namespace = cluster["metadata"]["name"], cluster["metadata"]["namespace"]
    group_name = HEAD_GROUP if head else group["groupName"]
    node_type = "head" if head else "worker"
    template = copy.deepcopy(group["template"])
    spec = template["spec"]
    port = head_port(cluster["spec"]["headGroupSpec"].get("rayStartParams") or {})
    fqdn = head_fqdn(name, namespace)
    ray = spec["containers"][0]
    params = complete_params(group.get("rayStartParams") or {}, head=head, port=port, fqdn=fqdn)
    if group.get("labels"):  # KubeRay >= 1.5: the group's Ray node labels (it refuses them in rayStartParams)
        params["labels"] = ",".join(f"{key}={value}" for key, value in sorted(group["labels"].items()))

    if not head:
        spec.setdefault("initContainers", []).append(
            {
                "name": "wait-gcs-ready",
                "image": ray.get("image", ""),
                "command": list(CONTAINER_COMMAND),
                "args": [_wait_gcs_ready(fqdn, port)],
                "env": [
                    *copy.deepcopy(ray.get("env") or []),
                    {"name": "FQ_RAY_IP", "value": fqdn},
                    {"name": "RAY_IP", "value": head_service_name(name)},
                ],
                "volumeMounts": copy.deepcopy(ray.get("volumeMounts") or []),
                "resources": {
                    "limits": {"cpu": "200m", "memory": "256Mi"},
                    "requests": {"cpu": "200m", "memory": "256Mi"},
                },
                # KubeRay copies the Ray container's securityContext, so the pod keeps its profile.
                **({"securityContext": copy.deepcopy(ray["securityContext"])} if "securityContext" in ray else {}),
            }
        )
    if not any(p.get("name") == "metrics" for p in ray.get("ports") or ()):
        ray.setdefault("ports", []).append({"name": "metrics", "containerPort": METRICS_PORT})
    if not any(m.get("mountPath") == "/dev/shm" for m in ray.get("volumeMounts") or ()):
        spec.setdefault("volumes", []).append({"name": "shared-mem", "emptyDir": {"medium": "Memory"}})
        ray.setdefault("volumeMounts", []).append({"name": "shared-mem", "mountPath": "/dev/shm"})

    start = ray_start_command(params, head=head, limits=(ray.get("resources") or {}).get("limits") or {})
    user_command = " ".join([*(ray.get("command") or ()), *(ray.get("args") or ())])
    if "ray start" not in user_command:
        generated = f"ulimit -n 65536; {start}"
        ray["command"] = list(CONTAINER_COMMAND)
        ray["args"] = [f"{user_command} && {generated}" if user_command else generated]

    address = "127.0.0.1" if head else fqdn
    env = ray.setdefault("env", [])
    present = {var["name"] for var in env}
    if not head:
        env += [{"name": "FQ_RAY_IP", "value": fqdn}, {"name": "RAY_IP", "value": head_service_name(name)}]
    env += [
        {"name": "RAY_CLUSTER_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['ray.io/cluster']"}}},
        {"name": "RAY_CLOUD_INSTANCE_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "RAY_NODE_TYPE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['ray.io/group']"}}},
        {"name": "KUBERAY_GEN_RAY_START_CMD", "value": start},
    ]
    for key, value in (
        ("RAY_PORT", port),
        ("RAY_ADDRESS", f"{address}:{port}"),
        ("RAY_USAGE_STATS_KUBERAY_IN_USE", "1"),
    ):
        if key not in present:
            env.append({"name": key, "value": value})
    if head:
        env.append({"name": "RAY_USAGE_STATS_EXTRA_TAGS", "value": "kuberay_version=double;kuberay_crd=RayCluster"})
    if "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE" not in present:
        env.append({"name": "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE", "value": "1"})
    health = _health_command(head=head)
    ray.setdefault("livenessProbe", _probe(health, initial_delay=30, timeout=5 if head else 1, failure_threshold=120))
    ray.setdefault("readinessProbe", _probe(health, initial_delay=10, timeout=5 if head else 1, failure_threshold=10))

    labels = {
        **(template.get("metadata", {}).get("labels") or {}),
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": name,
        "ray.io/node-type": node_type,
        "ray.io/group": group_name,
        "ray.io/identifier": f"{name}-{node_type}",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{name}-head-" if head else f"{name}-{group_name}-worker-",
            "namespace": namespace,
            "labels": labels,
            "annotations": dict(template.get("metadata", {}).get("annotations") or {}),
            "ownerReferences": [
                {
                    "apiVersion": "ray.io/v1",
                    "kind": "RayCluster",
                    "name": name,
                    "uid": cluster["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
    }
