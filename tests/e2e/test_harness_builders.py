"""The harness's pure parts, without a control plane: KubeRay CRD edits, emulated-node objects,
the pods the KubeRay double builds, the node agent's env, the cluster DNS double's answers and
the chart copy the Helm release is installed from, a pod's containers as containerd names them."""

from __future__ import annotations

import base64
import json
import shlex
import struct

import pytest

from rldock_e2e.controlplane.crds import KUBERAY_CRD_DIR, downgrade_for_1_20, kuberay_crd_files, load_documents
from rldock_e2e.controlplane.nodes import ASCEND_NODE_LABELS, node_manifest, node_status
from rldock_e2e.doubles import mountpoints
from rldock_e2e.doubles.cluster_dns import ClusterDNS, resolv_conf
from rldock_e2e.doubles.kuberay_pods import build_pod
from rldock_e2e.doubles.pod_env import MissingReference, container_env
from rldock_e2e.nodes.containers import container_ids, running_tasks
from rldock_e2e.nodes.service_dns import ready_addresses
from rldock_e2e.repo import require_kuberay_crds


def _walk(node):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


LIST_MAP = {
    "type": "array",
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["containerPort", "protocol"],
    "items": {
        "type": "object",
        "required": ["containerPort"],
        "properties": {
            "containerPort": {"type": "integer"},
            "protocol": {"type": "string", "default": "TCP"},
            "name": {"type": "string"},
        },
    },
}


@pytest.mark.parametrize(
    "schema, expected",
    [
        ({"type": "string", "x-kubernetes-validations": [{"rule": "self == oldSelf"}]}, {"type": "string"}),
        ({"type": "string", "default": ""}, {"type": "string"}),
        ({"type": "string", "default": "x"}, {"type": "string", "default": "x"}),
        (LIST_MAP, LIST_MAP),  # the key without a default is already required: unchanged
        (
            {**LIST_MAP, "x-kubernetes-list-map-keys": ["name"]},
            {
                **LIST_MAP,
                "x-kubernetes-list-map-keys": ["name"],
                "items": {**LIST_MAP["items"], "required": ["containerPort", "name"]},
            },
        ),
    ],
    ids=["cel", "empty-default", "real-default", "keys-required", "key-made-required"],
)
def test_downgrade_for_1_20(schema: dict, expected: dict) -> None:
    crd = {"spec": {"versions": [{"schema": {"openAPIV3Schema": schema}}]}}
    out = downgrade_for_1_20(crd)
    assert out["spec"]["versions"][0]["schema"]["openAPIV3Schema"] == expected
    assert crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"] == schema  # input untouched


def test_downgrade_of_kuberay_crds_leaves_nothing_1_20_refuses() -> None:
    require_kuberay_crds(KUBERAY_CRD_DIR)
    for path in kuberay_crd_files():
        for doc in load_documents(path):
            nodes = list(_walk(downgrade_for_1_20(doc)))
            assert not any("x-kubernetes-validations" in n for n in nodes), path
            assert not any(n.get("default") == "" for n in nodes), path
            for n in nodes:
                for key in n.get("x-kubernetes-list-map-keys", []):
                    item = n["items"]
                    assert key in item.get("required", []) or "default" in item["properties"][key]


def test_emulated_node_objects() -> None:
    manifest = node_manifest("npu-3", labels={"pool": "a"})
    assert manifest["metadata"]["labels"] == {
        "kubernetes.io/hostname": "npu-3",
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        **ASCEND_NODE_LABELS,
        "pool": "a",
    }
    status = node_status("npu-3", device_resource="huawei.com/Ascend910", num_devices=16)
    assert status["capacity"] == status["allocatable"]
    assert status["allocatable"]["huawei.com/Ascend910"] == "16"
    assert [c["type"] for c in status["conditions"]] == ["Ready"]
    cpu_only = node_status("cpu-0", device_resource=None)
    assert not any("/" in key for key in cpu_only["allocatable"])


# ----- the KubeRay double's pods (e2e/src/rldock_e2e/doubles/kuberay_pods.py) -----------------------------------


def _cluster(worker_params: dict, *, worker_limits: dict) -> dict:
    def template(name: str, limits: dict) -> dict:
        return {
            "spec": {
                "containers": [
                    {
                        "name": name,
                        "image": "img",
                        "resources": {"limits": limits},
                        "env": [{"name": "MINE", "value": "1"}],
                        "volumeMounts": [{"name": "cfg", "mountPath": "/etc/rldock"}],
                    }
                ],
                "volumes": [{"name": "cfg", "configMap": {"name": "c"}}],
            }
        }

    return {
        "metadata": {"name": "demo", "namespace": "team-a", "uid": "u-1"},
        "spec": {
            "headGroupSpec": {
                "rayStartParams": {"num-cpus": "2", "dashboard-host": "0.0.0.0"},
                "template": template("ray-head", {"cpu": "2", "memory": "4Gi"}),
            },
            "workerGroupSpecs": [
                {
                    "groupName": "workers",
                    "replicas": 1,
                    "rayStartParams": worker_params,
                    "template": template("ray-worker", worker_limits),
                }
            ],
        },
    }


FQDN = "demo-head-svc.team-a.svc.cluster.local"


@pytest.mark.parametrize(
    "head, params, limits, expected",
    [
        (
            True,
            {"num-cpus": "2", "dashboard-host": "0.0.0.0"},
            {"cpu": "2", "memory": "4Gi"},
            "ray start --head  --block  --dashboard-agent-listen-port=52365  --dashboard-host=0.0.0.0 "
            " --memory=4294967296  --metrics-export-port=8080  --num-cpus=2 ",
        ),
        # The operator's worker group: the resources JSON carries its own shell quotes.
        (
            False,
            {"resources": "'{\"NPU\": 8}'"},
            {"cpu": "500m", "memory": "1Gi", "huawei.com/Ascend910": "8"},
            f"ray start  --address={FQDN}:6379  --block  --dashboard-agent-listen-port=52365 "
            " --memory=1073741824  --metrics-export-port=8080  --num-cpus=1  --resources='{\"NPU\": 8}' ",
        ),
        (
            False,
            {},
            {"cpu": "4", "nvidia.com/gpu": "2"},
            f"ray start  --address={FQDN}:6379  --block  --dashboard-agent-listen-port=52365 "
            " --metrics-export-port=8080  --num-cpus=4  --num-gpus=2 ",
        ),
        (
            False,
            {},
            {"cpu": "4", "google.com/tpu": "4"},
            f"ray start  --address={FQDN}:6379  --block  --dashboard-agent-listen-port=52365 "
            " --metrics-export-port=8080  --num-cpus=4  --resources='{\"TPU\":4.0}' ",
        ),
    ],
    ids=["head", "worker-npu", "worker-gpu", "worker-tpu"],
)
def test_ray_start_line_as_kuberay_writes_it(head, params, limits, expected) -> None:
    cluster = _cluster(params, worker_limits=limits)
    if head:
        cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = limits
    group = cluster["spec"]["headGroupSpec"] if head else cluster["spec"]["workerGroupSpecs"][0]
    pod = build_pod(cluster, group, head=head)
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["/bin/bash", "-lc", "--"]
    assert container["args"] == [f"ulimit -n 65536; {expected}"]
    env = {v["name"]: v.get("value", v.get("valueFrom")) for v in container["env"]}
    assert env["KUBERAY_GEN_RAY_START_CMD"] == expected and env["MINE"] == "1"
    assert env["RAY_ADDRESS"] == ("127.0.0.1:6379" if head else f"{FQDN}:6379")
    assert env["RAY_CLUSTER_NAME"] == {"fieldRef": {"fieldPath": "metadata.labels['ray.io/cluster']"}}
    assert ("FQ_RAY_IP" in env) is not head
    assert "localhost:52365/api/local_raylet_healthz" in container["readinessProbe"]["exec"]["command"][2]
    assert ("localhost:8265/api/gcs_healthz" in container["readinessProbe"]["exec"]["command"][2]) is head
    assert {"name": "shared-mem", "mountPath": "/dev/shm"} in container["volumeMounts"]
    labels = pod["metadata"]["labels"]
    assert labels["ray.io/node-type"] == ("head" if head else "worker")
    assert labels["ray.io/group"] == ("headgroup" if head else "workers")
    assert pod["metadata"]["generateName"] == ("demo-head-" if head else "demo-workers-worker-")
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_the_ray_start_line_is_what_bash_runs() -> None:
    """What reaches `ray start` once bash has parsed KubeRay's line: the NPU resource as JSON."""
    cluster = _cluster({"resources": "'{\"NPU\": 8}'"}, worker_limits={"cpu": "4"})
    (container,) = build_pod(cluster, cluster["spec"]["workerGroupSpecs"][0], head=False)["spec"]["containers"]
    words = shlex.split(container["args"][0].split("; ", 1)[1])
    assert json.loads(next(w for w in words if w.startswith("--resources=")).split("=", 1)[1]) == {"NPU": 8}


def test_workers_wait_for_the_gcs_with_the_ray_containers_env_and_mounts() -> None:
    cluster = _cluster({}, worker_limits={"cpu": "4"})
    pod = build_pod(cluster, cluster["spec"]["workerGroupSpecs"][0], head=False)
    (init,) = pod["spec"]["initContainers"]
    assert init["name"] == "wait-gcs-ready" and f"ray health-check --address {FQDN}:6379" in init["args"][0]
    assert {"name": "MINE", "value": "1"} in init["env"] and {"name": "FQ_RAY_IP", "value": FQDN} in init["env"]
    assert init["volumeMounts"] == [{"name": "cfg", "mountPath": "/etc/rldock"}]
    head = build_pod(cluster, cluster["spec"]["headGroupSpec"], head=True)
    assert "initContainers" not in head["spec"]


# ----- the node agent's pieces: env (pod_env.py) and cluster DNS (cluster_dns.py) ----------------


def test_container_env_as_the_kubelet_computes_it() -> None:
    secret = {"s": {"token": base64.b64encode(b"t0k").decode()}}
    config = {"c": {"mode": "fast", "level": "3"}}
    pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"ray.io/cluster": "demo"}},
        "spec": {"nodeName": "npu-0"},
    }
    container = {
        "envFrom": [{"configMapRef": {"name": "c"}, "prefix": "CFG_"}],
        "env": [
            {"name": "A", "value": "x"},
            {"name": "B", "value": "$(A)-$(NOPE)-$$(A)"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "mode"}}},
            {"name": "CLUSTER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['ray.io/cluster']"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "GONE", "valueFrom": {"secretKeyRef": {"name": "missing", "key": "k", "optional": True}}},
        ],
        "resources": {"limits": {"cpu": "1500m"}},
    }
    env = container_env(
        pod,
        container,
        config_map=config.get,
        secret=secret.get,
        pod_ip="10.244.1.7",
        image_env={"PATH": "/bin", "A": "image"},
    )
    assert env == {
        "PATH": "/bin",
        "A": "x",
        "B": "x-$(NOPE)-$(A)",
        "TOKEN": "t0k",
        "MODE": "fast",
        "CFG_mode": "fast",
        "CFG_level": "3",
        "CLUSTER": "demo",
        "IP": "10.244.1.7",
    }
    with pytest.raises(MissingReference):
        container_env(
            pod,
            {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "missing", "key": "k"}}}]},
            config_map=config.get,
            secret=secret.get,
        )


def _query(name: str, qtype: int) -> bytes:
    question = b"".join(bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + question + struct.pack("!HH", qtype, 1)


def test_cluster_dns_answers_service_names_only() -> None:
    dns = ClusterDNS("127.0.0.1")
    dns.set_services({("team-a", "demo-head-svc"): "10.244.1.2"})
    reply = dns.answer(_query("demo-head-svc.team-a.svc.cluster.local", 1))
    ident, flags, _, answers = struct.unpack("!HHHH", reply[:8])
    assert (ident, flags & 0xF, answers) == (0x1234, 0, 1) and reply[-4:] == bytes([10, 244, 1, 2])
    _, flags, _, answers = struct.unpack("!HHHH", dns.answer(_query("demo-head-svc.team-a.svc.cluster.local", 28))[:8])
    assert (flags & 0xF, answers) == (0, 0)  # AAAA of a known name: NOERROR, no address
    for unknown in (
        "other.team-a.svc.cluster.local",
        "demo-head-svc.team-a.svc.cluster.local.team-a.svc.cluster.local",
        "pypi.org",
    ):
        _, flags, _, answers = struct.unpack("!HHHH", dns.answer(_query(unknown, 1))[:8])
        assert (flags & 0xF, answers) == (3, 0), unknown  # NXDOMAIN
    assert resolv_conf("10.244.1.1", "team-a").splitlines() == [
        "search team-a.svc.cluster.local svc.cluster.local cluster.local",
        "nameserver 10.244.1.1",
        "options ndots:5",
    ]


def test_service_dns_names_the_first_ready_address_only() -> None:
    """Endpoints as the endpoints controller writes them: a Service whose only pod is not ready
    yet (notReadyAddresses) has no name, as kube-proxy would route it nowhere."""

    def endpoints(name, subsets):
        return {"metadata": {"namespace": "ns", "name": name}, "subsets": subsets}

    items = [
        endpoints("head-svc", [{"addresses": [{"ip": "10.245.1.7"}, {"ip": "10.245.0.3"}]}]),
        endpoints("starting", [{"notReadyAddresses": [{"ip": "10.245.0.9"}]}]),
        endpoints("no-pods", None),
    ]
    assert ready_addresses(items) == {("ns", "head-svc"): "10.245.1.7"}


def test_mount_points_go_when_no_agent_uses_them(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RLDOCK_CACHE", str(tmp_path / "cache" / "rldock"))
    target = tmp_path / "host" / "etc" / "rldock"
    mountpoints.claim([str(target)])
    assert target.is_dir()
    registry = mountpoints._registry()
    registry.write_text(registry.read_text() + f"1 {target}\n")  # another live run uses it too
    mountpoints.release()
    assert target.is_dir()  # not pulled from under the other run's pods
    registry.write_text(f"999999999 {target}\n")  # that run died without cleaning up
    mountpoints.release(mine=False)
    assert not target.exists() and registry.read_text() == ""


def test_containers_of_a_pod_as_containerd_lists_them() -> None:
    pod = {
        "metadata": {"name": "w"},
        "status": {
            "containerStatuses": [{"name": "ray-worker", "containerID": "containerd://abc123"}, {"name": "sidecar"}]
        },
    }  # not started yet: no id
    assert container_ids(pod) == {"ray-worker": "abc123"}
    assert container_ids({"metadata": {"name": "p"}, "status": {}}) == {}
    table = (
        "TASK      PID     STATUS    \n"
        "abc123    4242    RUNNING   \n"
        "def456    0       STOPPED   \n"
        "0a1b2c    17      PAUSED    \n"
    )
    assert running_tasks(table) == {"abc123"}
    assert running_tasks("TASK    PID    STATUS    \n") == set()


def test_the_pods_kuberay_makes_from_the_operators_cluster_stay_restricted() -> None:
    """What KubeRay adds (its init container, probes, env, /dev/shm) keeps the pods `restricted`:
    the init container carries the Ray container's securityContext, as KubeRay copies it."""
    from rldock.operator.api import RLJobSpec
    from rldock.operator.builders import RLJobRef, build_ray_cluster
    from rldock_e2e.pod_security import restricted_violations

    spec = RLJobSpec.model_validate(
        {
            "job": {
                "name": "j",
                "iterations": 1,
                "model": {"path": "/m"},
                "resources": {"num_nodes": 1, "devices_per_node": 2},
                "algorithm": {
                    "num_prompts_per_iteration": 2,
                    "num_responses_per_prompt": 2,
                    "max_prompt_length": 8,
                    "max_response_length": 8,
                    "learning_rate": 1e-5,
                },
                "training": {"data_parallel_size": 2},
            },
            "checkpoint": {"claimName": "c"},
        }
    )
    cluster = build_ray_cluster(job=RLJobRef("j", "team-a", "u-1"), spec=spec)
    cluster["metadata"]["uid"] = "c-1"
    for group, head in ((cluster["spec"]["headGroupSpec"], True), (cluster["spec"]["workerGroupSpecs"][0], False)):
        pod = build_pod(cluster, group, head=head)
        assert bool(pod["spec"].get("initContainers")) is not head
        assert restricted_violations(pod["spec"], pod["metadata"].get("annotations")) == []
