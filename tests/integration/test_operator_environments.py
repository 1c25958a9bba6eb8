"""spec.environments against a real kube-apiserver and controller-manager (e2e/controlplane): the
operator as its own process with exactly the RBAC builders/rbac.py generates, the real Deployment,
ReplicaSet and endpoints controllers, ServiceAccount admission and garbage collector, and the kubelet
double (e2e/src/rldock_e2e/doubles/kubelet.py) making the bound pods Running and Ready.

No KubeRay double here: the RayCluster is created and left alone (no Ray pods), which is all the
environments need; the Ray side is test_operator.py's. No Kueue either: a test admits a queued
RayCluster as Kueue does, by unsuspending it. No network plugin enforces the NetworkPolicies here:
they are checked as the API server stores them (docs/security.md says so).
"""

from __future__ import annotations

import base64
import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from rldock.operator import naming
from rldock.operator.builders.rbac import build_rbac
from rldock_e2e.controlplane import DEVELOPER_USER, ControlPlane, wait_for
from rldock_e2e.doubles.cluster_dns import ClusterDNS
from rldock_e2e.doubles.kubelet import KubeletDouble, StartHook, StopHook
from rldock_e2e.doubles.node_agent import service_addresses
from rldock_e2e.operator_process import OperatorProcess
from rldock_e2e.pod_security import restricted_violations

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

POLL = 1.0
TIMEOUT = 60.0
ENV_PREFIX = "registry.example.com/envs/"
# The admin allows environment images under one prefix (and, as always, the runtime image), and
# one Kueue queue.
QUEUE = "team-a"
POLICY = {"imagePrefixes": [ENV_PREFIX], "queues": [QUEUE]}
CABINET = {
    "name": "cabinet",
    "image": f"{ENV_PREFIX}cabinet:1",
    "port": 9000,
    "replicas": 2,
    "sessionsPerReplica": 4,
    "resources": {"cpu": "100m", "memory": "64Mi"},
}
SANDBOX = {
    "name": "sandbox",
    "command": [
        "rldock",
        "env",
        "serve",
        "rldock.runtime.agent.sandbox_service:PythonSandbox",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ],
    "resources": {"cpu": "100m", "memory": "64Mi"},
}
CHILDREN = ("Deployment", "Service", "NetworkPolicy")


def rljob(
    name: str, environments: list[dict[str, Any]], *, services: tuple[str, str] = ("cabinet", "sandbox"), **spec: Any
) -> dict[str, Any]:
    """An agent job whose environment and sandbox servers are the RLJob's environments `services`."""
    job = {
        "name": name,
        "iterations": 4,
        "model": {"path": "/models/tiny", "builder": "tiny-qwen2"},
        "data": {"generator": {"name": "addition"}, "chat_template": "model"},
        "algorithm": {
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 8,
            "max_response_length": 512,
            "learning_rate": 3e-4,
        },
        "training": {"data_parallel_size": 2},
        "resources": {"num_nodes": 1, "devices_per_node": 2},
        "agent": {
            "tools": [{"name": "python"}],
            "environment": {"name": "openenv", "servers": {"service": services[0]}},
            "sandbox": {"servers": {"service": services[1]}},
        },
    }
    body = {
        "job": job,
        "checkpoint": {"claimName": "rl-checkpoints"},
        "cluster": {"head": {"cpu": 1, "memory": "1Gi"}, "worker": {"cpu": 1, "memory": "1Gi"}},
        "environments": environments,
        **spec,
    }
    return {"apiVersion": "rldock.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": body}


class Envs:
    """The namespace under test and the reads the tests make."""

    def __init__(self, plane: ControlPlane, namespace: str, operator: OperatorProcess) -> None:
        self.plane, self.namespace, self.operator = plane, namespace, operator
        self.api = plane.api_client()
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.networking = client.NetworkingV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def apply(self, manifest: dict[str, Any]) -> None:
        self.plane.kubectl("apply", "-n", self.namespace, "-f", "-", input=yaml.safe_dump(manifest))

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.plane.kubectl(
            "patch", "rljob", name, "-n", self.namespace, "--type=merge", "-p", json.dumps({"spec": spec})
        )

    def rljob(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object("rldock.io", "v1alpha1", self.namespace, "rljobs", name)
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def child(self, kind: str, name: str) -> dict[str, Any] | None:
        read = {
            "Deployment": self.apps.read_namespaced_deployment,
            "Service": self.core.read_namespaced_service,
            "NetworkPolicy": self.networking.read_namespaced_network_policy,
            "ConfigMap": self.core.read_namespaced_config_map,
            "ServiceAccount": self.core.read_namespaced_service_account,
            "Secret": self.core.read_namespaced_secret,  # as the admin: the operator cannot
            "RayCluster": lambda name, namespace, **kw: self.custom.get_namespaced_custom_object(
                "ray.io", "v1", namespace, "rayclusters", name, **kw
            ),
        }[kind]
        try:
            return json.loads(read(name, self.namespace, _preload_content=False).data)
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def environment_pods(self, rljob: str) -> list[dict[str, Any]]:
        selector = f"rldock.io/environment-of={naming.label_value(rljob)}"
        response = self.core.list_namespaced_pod(self.namespace, label_selector=selector, _preload_content=False)
        return json.loads(response.data)["items"]

    def events(self, name: str) -> list[dict[str, Any]]:
        response = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name}", _preload_content=False
        )
        return json.loads(response.data)["items"]

    def wait(self, what: str, probe: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
        return wait_for(what, probe, timeout=timeout, interval=0.25, check=self.operator.check)

    def wait_status(self, name: str, what: str, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            obj = self.rljob(name)
            return obj if obj is not None and predicate(obj.get("status") or {}) else None

        try:
            return self.wait(f"RLJob {name}: {what}", probe)
        except TimeoutError:
            raise AssertionError(
                f"RLJob {name}: no {what}; status now: {json.dumps((self.rljob(name) or {}).get('status'))}\n"
                f"operator log:\n{self.operator.log_path.read_text(errors='replace')[-4000:]}"
            ) from None


@contextlib.contextmanager
def operator_namespace(
    control_plane: ControlPlane,
    work: Path,
    *,
    policy: dict[str, Any],
    on_start: StartHook | None = None,
    on_stop: StopHook | None = None,
) -> Iterator[tuple[Envs, KubeletDouble]]:
    """A namespace and a node of its own, the operator (its generated RBAC, the admin's `policy`) watching
    it, and the kubelet double with the hooks given; all gone on exit."""
    namespace, node = f"envs-{uuid.uuid4().hex[:6]}", f"envs-{uuid.uuid4().hex[:6]}"
    control_plane.create_namespace(namespace)
    control_plane.create_node(node, devices=4)
    for manifest in build_rbac(
        name="rldock-operator",
        namespaces=[namespace],
        subject={"kind": "User", "name": DEVELOPER_USER, "apiGroup": "rbac.authorization.k8s.io"},
    ):
        control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    kubeconfig = yaml.safe_load(control_plane.kubeconfig.read_text())
    kubeconfig["current-context"] = DEVELOPER_USER
    (work / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    operator = OperatorProcess(
        namespaces=[namespace],
        kubeconfig=work / "kubeconfig",
        log_dir=work,
        poll_interval=POLL,
        ray_timeout=2.0,
        env={**control_plane.env, "RLDOCK_POLICY": json.dumps(policy)},
    )
    with KubeletDouble(control_plane.api_client(), namespace=namespace, on_start=on_start, on_stop=on_stop) as kubelet:
        operator.start()
        try:
            yield Envs(control_plane, namespace, operator), kubelet
        finally:
            operator.stop()
            control_plane.kubectl("delete", "rljobs", "--all", "-n", namespace, "--wait=false", check=False)
            control_plane.kubectl("delete", "node", node, "--wait=false", check=False)


@pytest.fixture(scope="module")
def envs(
    control_plane: ControlPlane,
    kuberay_crds: list[str],
    rljob_crd: list[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Envs]:
    with operator_namespace(control_plane, tmp_path_factory.mktemp("operator"), policy=POLICY) as (envs, _):
        yield envs


def test_environments_run_as_restricted_pods_behind_headless_services_and_go_with_the_rljob(envs: Envs):
    name = "agent"
    envs.apply(rljob(name, [CABINET, SANDBOX]))
    uid = envs.wait("the RLJob", lambda: envs.rljob(name))["metadata"]["uid"]
    ray_policy = envs.wait("the Ray pods' NetworkPolicy", lambda: envs.child("NetworkPolicy", f"{name}-ray"))
    # The environments' own ServiceAccount: no token mounted, and no RoleBinding names it.
    account = envs.wait(
        "the environments' ServiceAccount",
        lambda: envs.child("ServiceAccount", naming.environment_service_account_name(name)),
    )
    assert account["automountServiceAccountToken"] is False
    assert account["metadata"]["ownerReferences"][0]["uid"] == uid
    bindings = client.RbacAuthorizationV1Api(envs.api).list_namespaced_role_binding(envs.namespace).items
    assert not [
        b
        for b in bindings
        for s in b.subjects or ()
        if s.kind == "ServiceAccount" and s.name == account["metadata"]["name"]
    ]
    # The job's environment token: a random one, in a Secret the RLJob owns; the Ray pods read it too.
    token_secret = naming.environment_token_secret_name(name, uid)
    secret = envs.wait("the environment token's Secret", lambda: envs.child("Secret", token_secret))
    assert len(base64.b64decode(secret["data"]["token"])) >= 32
    assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
    cluster = envs.wait("the RayCluster", lambda: envs.child("RayCluster", name))
    for template in [cluster["spec"]["headGroupSpec"]["template"]] + [
        group["template"] for group in cluster["spec"]["workerGroupSpecs"]
    ]:
        env = template["spec"]["containers"][0]["env"]
        assert {
            "name": "RLDOCK_ENV_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": token_secret, "key": "token"}},
        } in env

    for entry in (CABINET, SANDBOX):
        child = naming.environment_name(name, entry["name"])
        deployment, service, policy = (
            envs.wait(f"{kind} {child}", lambda k=kind, c=child: envs.child(k, c)) for kind in CHILDREN
        )
        for obj in (deployment, service, policy):
            (owner,) = obj["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["uid"], owner["controller"]) == ("RLJob", uid, True)
        # The pod template as the API server stored it (defaults applied) passes `restricted`.
        template = deployment["spec"]["template"]
        assert restricted_violations(template["spec"], template["metadata"].get("annotations")) == []
        assert template["spec"]["automountServiceAccountToken"] is False
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["ports"][0]["port"] == entry.get("port", 8000)
        # Only the job's Ray pods (head and workers) may connect, on the entry's port; the Ray pods'
        # own policy does not select the environment's pods.
        (rule,) = policy["spec"]["ingress"]
        assert rule["ports"] == [{"protocol": "TCP", "port": entry.get("port", 8000)}]
        assert rule["from"] == [
            {
                "podSelector": {
                    "matchLabels": {"rldock.io/rljob": name},
                    "matchExpressions": [
                        {"key": "rldock.io/role", "operator": "In", "values": ["head", "worker", "pool"]}
                    ],
                }
            }
        ]
        labels = template["metadata"]["labels"]
        assert "rldock.io/rljob" not in labels
        assert not ray_policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        # Out, only the cluster's DNS (the admin listed nothing more).
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        (dns,) = policy["spec"]["egress"]
        assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
        assert dns["to"] == [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ]
        # Read-only root, a sized /tmp as the only writable path, an ephemeral-storage limit.
        (container,) = template["spec"]["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert template["spec"]["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
        assert container["resources"]["limits"]["ephemeral-storage"] == "1Gi"
        # The Service picks the pods by the RLJob's uid as well.
        assert service["spec"]["selector"]["rldock.io/environment-of-uid"] == uid
        # The job's environment token, from the Secret the operator made.
        assert container["env"][-1]["valueFrom"]["secretKeyRef"] == {"name": token_secret, "key": "token"}
        assert template["spec"]["serviceAccountName"] == account["metadata"]["name"]

    # The runtime's job config names the Services, never `service:`.
    job_yaml = envs.child("ConfigMap", naming.config_map_name(name))["data"]["job.yaml"]
    cabinet = naming.environment_name(name, "cabinet")
    assert f"url: http://{cabinet}.{envs.namespace}.svc.cluster.local:9000" in job_yaml
    assert "sessions_per_replica: 4" in job_yaml

    # The Deployment controller makes the pods, the kubelet double readies them, the status follows.
    status = envs.wait_status(name, "3/3 environment pods ready", lambda s: s.get("environmentsReady") == "3/3")[
        "status"
    ]
    assert status["environments"] == [
        {"name": "cabinet", "replicas": 2, "readyReplicas": 2},
        {"name": "sandbox", "replicas": 1, "readyReplicas": 1},
    ]
    table = envs.plane.kubectl("get", "rlj", name, "-n", envs.namespace).stdout
    assert "ENVS" in table and "3/3" in table, table
    assert any(e["reason"] == "CreatedEnvironment" for e in envs.events(name))

    # The headless Service's name answers every ready pod's address, as the node agent's cluster
    # DNS double publishes it from the pods and the Service as stored. (The Endpoints the real
    # controller would write are refused here: the kubelet double's pod IPs are loopback addresses.)
    service = envs.child("Service", cabinet)
    pods = envs.environment_pods(name)
    dns = ClusterDNS("127.0.0.1")
    dns.set_services(service_addresses([service], pods, ip_of=lambda pod: pod["status"].get("podIP", "")))
    cabinet_ips = sorted(
        p["status"]["podIP"] for p in pods if p["metadata"]["labels"]["rldock.io/environment"] == "cabinet"
    )
    # The pods as the ReplicaSet controller made them and ServiceAccount admission passed them: the
    # environments' account, and no token volume.
    for pod in pods:
        assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
        assert [volume["name"] for volume in pod["spec"]["volumes"]] == ["tmp"]
    assert len(cabinet_ips) == 2
    assert sorted(dns.resolve(f"{cabinet}.{envs.namespace}.svc.cluster.local")) == cabinet_ips

    # Suspend scales every environment to 0; resume brings them back.
    envs.patch_spec(name, {"suspend": True})
    envs.wait_status(name, "environments scaled to 0", lambda s: s.get("environmentsReady") == "0/0")
    envs.wait("no environment pod", lambda: envs.environment_pods(name) == [])
    envs.patch_spec(name, {"suspend": False})
    envs.wait_status(name, "environments back", lambda s: s.get("environmentsReady") == "3/3")

    # Deleted with the RLJob: the garbage collector takes every child and its pods.
    envs.plane.kubectl("delete", "rljob", name, "-n", envs.namespace, "--wait=false")
    envs.wait("the RLJob gone", lambda: envs.rljob(name) is None)
    for entry in (CABINET, SANDBOX):
        child = naming.environment_name(name, entry["name"])
        for kind in CHILDREN:
            envs.wait(f"{kind} {child} collected", lambda k=kind, c=child: envs.child(k, c) is None)
    envs.wait("the environments' pods gone", lambda: envs.environment_pods(name) == [])


def test_an_environment_image_outside_the_policy_is_denied_and_nothing_is_created(envs: Envs):
    name = "denied"
    envs.apply(rljob(name, [{**CABINET, "image": "elsewhere.example.com/cabinet:1"}, SANDBOX]))
    status = envs.wait_status(name, "phase Failed", lambda s: s.get("phase") == "Failed")["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PolicyDenied" and "spec.environments[0].image" in failed["message"]
    assert "policy.imagePrefixes" in failed["message"]
    event = envs.wait(
        "the PolicyDenied event", lambda: next((e for e in envs.events(name) if e["reason"] == "PolicyDenied"), None)
    )
    assert event["type"] == "Warning" and "spec.environments[0].image" in event["message"]
    for entry in (CABINET, SANDBOX):
        for kind in CHILDREN:
            assert envs.child(kind, naming.environment_name(name, entry["name"])) is None
    assert envs.environment_pods(name) == []


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions") or ()}


def test_environment_pods_are_absent_while_the_job_is_queued_and_created_once_admitted(envs: Envs):
    """Kueue's convention: the RayCluster is created suspended and Kueue admits it by unsuspending it
    (done here by hand: no Kueue runs). Until then the environments hold no pod; they carry the queue."""
    name = "queued"
    envs.apply(rljob(name, [CABINET, SANDBOX], scheduling={"gang": "kueue", "queue": QUEUE}))
    child = naming.environment_name(name, "cabinet")
    cluster = envs.wait("the suspended RayCluster", lambda: envs.child("RayCluster", name))
    assert cluster["spec"]["suspend"] is True
    deployment = envs.wait("the Deployment", lambda: envs.child("Deployment", child))
    assert deployment["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == QUEUE
    assert deployment["spec"]["template"]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == QUEUE
    # Settled while queued: a round that read the suspended cluster (the only kind that says
    # WaitingForAdmission: the first round, before the cluster exists, says RayClusterCreating) reported
    # the environments at 0 pods, and the Deployment controller made no pod.
    envs.wait_status(
        name,
        "environments at 0 while queued, from a round that read the suspended cluster",
        lambda s: (
            _conditions(s).get("ClusterReady", {}).get("reason") == "WaitingForAdmission"
            and s.get("environments")
            == [
                {"name": "cabinet", "replicas": 0, "readyReplicas": 0},
                {"name": "sandbox", "replicas": 0, "readyReplicas": 0},
            ]
        ),
    )
    envs.wait(
        "the ReplicaSet settled at 0",
        lambda: (
            (envs.child("Deployment", child).get("status") or {}).get("observedGeneration")
            == envs.child("Deployment", child)["metadata"]["generation"]
        ),
    )
    assert envs.child("Deployment", child)["spec"]["replicas"] == 0
    assert envs.environment_pods(name) == []

    # Kueue admits the cluster: the environments' pods come.
    envs.plane.kubectl(
        "patch",
        "raycluster",
        name,
        "-n",
        envs.namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"suspend": False}}),
    )
    envs.wait_status(name, "the environments' pods ready once admitted", lambda s: s.get("environmentsReady") == "3/3")
    assert len(envs.environment_pods(name)) == 3


def test_an_object_of_a_child_s_name_that_this_rljob_does_not_own_is_reported_never_adopted(envs: Envs):
    """A Service where the RLJob's environment Service goes, owned by another RLJob (or by nobody but
    labelled as this RLJob's): left exactly as it is, the RLJob says NameConflict, no pod is made."""
    owner = "owner"
    envs.apply(rljob(owner, [CABINET, SANDBOX]))
    owner_uid = envs.wait("the owner RLJob", lambda: envs.rljob(owner))["metadata"]["uid"]
    for taker, owner_references in (
        (
            "taker",
            [
                {
                    "apiVersion": "rldock.io/v1alpha1",
                    "kind": "RLJob",
                    "name": owner,
                    "uid": owner_uid,
                    "controller": True,
                }
            ],
        ),
        ("taker-unowned", []),
    ):
        child = naming.environment_name(taker, "cabinet")
        planted = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": child,
                "labels": {"rldock.io/rljob": taker, "rldock.io/environment": "cabinet"},
                "ownerReferences": owner_references,
            },
            "spec": {"clusterIP": "None", "selector": {"app": "attacker"}, "ports": [{"port": 9000}]},
        }
        envs.apply(planted)
        before = envs.child("Service", child)
        envs.apply(rljob(taker, [CABINET, SANDBOX]))
        status = envs.wait_status(
            taker,
            "NameConflict",
            lambda s: _conditions(s).get("ClusterReady", {}).get("reason") == "NameConflict",
        )["status"]
        message = _conditions(status)["ClusterReady"]["message"]
        assert f"Service {child} already exists" in message and "not adopted" in message
        after = envs.child("Service", child)
        assert after["metadata"].get("ownerReferences") == before["metadata"].get("ownerReferences")
        assert after["spec"]["selector"] == {"app": "attacker"}
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]  # never written
        assert envs.child("Deployment", child) is None and envs.environment_pods(taker) == []
        # The Event is posted after the status is written: waited for, not assumed.
        envs.wait(
            f"{taker}'s NameConflict event", lambda t=taker: any(e["reason"] == "NameConflict" for e in envs.events(t))
        )


def test_the_issue_s_name_collision_pair_cannot_meet(envs: Envs):
    """Job `math` with an environment `v2-head-svc` against job `math-env-v2`: the environment's
    Service was `math-env-v2-head-svc`, the name KubeRay gives `math-env-v2`'s head Service (and takes
    as its own when it exists). Now its name ends in a hash; both jobs run, neither is in conflict."""
    attacker, victim = "math", "math-env-v2"
    envs.apply(rljob(attacker, [{**CABINET, "name": "v2-head-svc"}, SANDBOX], services=("v2-head-svc", "sandbox")))
    envs.apply(rljob(victim, [CABINET, SANDBOX]))
    head_service = naming.head_service_name(victim)
    assert head_service == "math-env-v2-head-svc"
    taken = naming.environment_name(attacker, "v2-head-svc")
    assert taken != head_service
    envs.wait_status(attacker, "its environments ready", lambda s: s.get("environmentsReady") == "3/3")
    envs.wait_status(victim, "its environments ready", lambda s: s.get("environmentsReady") == "3/3")
    assert envs.child("Service", taken)["metadata"]["ownerReferences"][0]["name"] == attacker
    assert envs.child("Service", head_service) is None  # left to KubeRay (none runs here)
    for name in (attacker, victim):
        assert _conditions(envs.rljob(name)["status"]).get("ClusterReady", {}).get("reason") != "NameConflict"


def test_a_re_created_rljob_makes_its_own_token_secrets(envs: Envs):
    """An RLJob deleted and created again under its name while the old one's Secrets still exist (here
    kept for good by an orphaning delete; after an ordinary delete, until the garbage collector comes).
    The operator may only create Secrets and takes one that exists as made, so the new RLJob's Secrets
    must have other names: else its pods would read the old token, then a Secret collected under them."""
    name = "again"
    envs.apply(rljob(name, [CABINET, SANDBOX]))
    old_uid = envs.wait("the first RLJob", lambda: envs.rljob(name))["metadata"]["uid"]
    old = [naming.environment_token_secret_name(name, old_uid), naming.auth_secret_name(name, old_uid)]
    for secret in old:
        envs.wait(f"Secret {secret}", lambda s=secret: envs.child("Secret", s))
    envs.wait_status(name, "its environments ready", lambda s: s.get("environmentsReady") == "3/3")
    envs.plane.kubectl("delete", "rljob", name, "-n", envs.namespace, "--cascade=orphan", "--wait=false")
    envs.wait("the first RLJob gone", lambda: envs.rljob(name) is None)
    # Every other child goes (their names do not depend on the uid); the Secrets stay.
    envs.plane.kubectl(
        "delete",
        "deployments,services,networkpolicies,serviceaccounts,configmaps,rayclusters",
        "-n",
        envs.namespace,
        "-l",
        f"rldock.io/rljob={naming.label_value(name)}",
    )

    envs.apply(rljob(name, [CABINET, SANDBOX]))
    new_uid = envs.wait("the second RLJob", lambda: envs.rljob(name))["metadata"]["uid"]
    assert new_uid != old_uid
    token, auth = naming.environment_token_secret_name(name, new_uid), naming.auth_secret_name(name, new_uid)
    for secret, before in zip((token, auth), old, strict=True):
        assert secret != before
        made = envs.wait(f"Secret {secret}", lambda s=secret: envs.child("Secret", s))
        assert [owner["uid"] for owner in made["metadata"]["ownerReferences"]] == [new_uid]
        assert envs.child("Secret", before) is not None  # the old one is still there, and not taken
    envs.wait_status(name, "its environments ready again", lambda s: s.get("environmentsReady") == "3/3")
    deployment = envs.child("Deployment", naming.environment_name(name, "cabinet"))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["env"][-1]["valueFrom"]["secretKeyRef"]["name"] == token
    cluster = envs.child("RayCluster", name)
    head_env = {
        var["name"]: var for var in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert head_env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == auth
    assert head_env["RLDOCK_ENV_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == token
    envs.plane.kubectl("delete", "rljob", name, "-n", envs.namespace, "--wait=false")
    envs.plane.kubectl("delete", "secrets", *old, "-n", envs.namespace)
