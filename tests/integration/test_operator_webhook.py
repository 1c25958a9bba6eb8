"""The RLJob admission webhook on a real kube-apiserver (e2e/controlplane): the operator, as its own
process (`python -m rldock.operator --webhook-port ...`) with the generated RBAC only, serves it over
HTTPS on this machine with a certificate the test issues; a ValidatingWebhookConfiguration points
the API server at `https://127.0.0.1:<port>/validate-rljob` with that CA as its caBundle, for this
test's namespace only (the configuration is cluster-scoped and other tests share the control plane).

`kubectl apply` of an RLJob outside the admin policy is refused with the fields named and nothing is
stored; a valid one is admitted, and the operator's own writes to it (its finalizer, on creation
and on deletion) pass; spec.managedBy cannot change. An RLJob is never a way around RBAC: a second
non-admin user (the tenant, with a Role in the namespace) cannot name a Secret it may not `get`,
and can name one it may; the image-prefix, NFS-export, control-plane and node-lifecycle taint rules
refuse with the field named. And the chart's certificate through `helm install` and `helm upgrade` on this API
server: reused, so it and the caBundle stay in step.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import ssl
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from test_operator import POLL, rljob, unique

from rldock.operator.admission import WEBHOOK_PATH
from rldock.operator.builders.rbac import build_rbac
from rldock.operator.constants import FINALIZER
from rldock_e2e.controlplane import ADMIN_USER, DEVELOPER_USER, TENANT_USER, ControlPlane, wait_for
from rldock_e2e.controlplane.processes import free_ports
from rldock_e2e.operator_process import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

HOST_ROOT = {
    "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
    "volumeMounts": [{"name": "root", "mountPath": "/host"}],
}
MULTIKUEUE = "kueue.x-k8s.io/multikueue"
TIMEOUT = 60.0
# The operator's policy here: the chart's defaults, plus one image prefix and one NFS export.
IMAGE_PREFIX = "registry.example.com/ml"
NFS_EXPORT = {"server": "nfs.example.com", "path": "/exports/team-a"}
POLICY = {"imagePrefixes": [IMAGE_PREFIX], "nfsExports": [NFS_EXPORT]}
# Secrets of the namespace: the tenant may get the first only.
READABLE, UNREADABLE = "reward-token", "db-password"


def tenant_role(namespace: str) -> list[dict[str, Any]]:
    """What a namespace admin gives a team that runs RLJobs but must not read every Secret: RLJobs,
    the claims and ConfigMaps, and one Secret by name."""
    rules = [
        {
            "apiGroups": ["rldock.io"],
            "resources": ["rljobs"],
            "verbs": ["get", "list", "create", "update", "patch", "delete"],
        },
        {"apiGroups": [""], "resources": ["persistentvolumeclaims", "configmaps"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [READABLE], "verbs": ["get"]},
    ]
    metadata = {"name": "rljob-author", "namespace": namespace}
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": metadata, "rules": rules},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": metadata,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "rljob-author"},
            "subjects": [{"kind": "User", "name": TENANT_USER, "apiGroup": "rbac.authorization.k8s.io"}],
        },
    ]


class Pem(NamedTuple):
    ca: bytes
    cert: bytes
    key: bytes


def issue_certificate(host: str) -> Pem:
    """A CA and a serving certificate it signed for the IP address `host` (TEST ONLY)."""
    now = datetime.datetime.now(datetime.timezone.utc)

    def builder(subject: str, public_key: Any, issuer: str) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=2))
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        builder("rldock-webhook-test-ca", ca_key.public_key(), "rldock-webhook-test-ca")
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    # Go's TLS checks the subjectAltName only (never the common name).
    cert = (
        builder("rldock-webhook-test", key.public_key(), "rldock-webhook-test-ca")
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Pem(
        ca=ca.public_bytes(serialization.Encoding.PEM),
        cert=cert.public_bytes(serialization.Encoding.PEM),
        key=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


class Admission:
    """The namespace under test, its operator and the webhook configuration sending its RLJobs there."""

    def __init__(self, plane: ControlPlane, namespace: str, operator: OperatorProcess) -> None:
        self.plane, self.namespace, self.operator = plane, namespace, operator

    def apply(self, manifest: dict[str, Any], *extra: str, user: str = ADMIN_USER):
        return self.plane.kubectl(
            "apply", "-n", self.namespace, *extra, "-f", "-", input=yaml.safe_dump(manifest), check=False, user=user
        )

    def rljob(self, name: str) -> dict[str, Any] | None:
        result = self.plane.kubectl("get", "rljob", name, "-n", self.namespace, "-o", "json", check=False)
        if result.returncode != 0:
            assert "NotFound" in result.stderr, result.stderr
            return None
        return json.loads(result.stdout)

    def wait(self, what: str, probe: Any) -> Any:
        return wait_for(what, probe, timeout=TIMEOUT, interval=0.25, check=self.operator.check)


def _serving(url: str, ca_file: Path) -> bool:
    """The webhook answers a GET (405: only POST is served) over TLS verified against the CA."""
    try:
        urllib.request.urlopen(url, timeout=2, context=ssl.create_default_context(cafile=str(ca_file)))
    except urllib.error.HTTPError as error:
        return error.code == 405
    except OSError:
        return False
    return False


@pytest.fixture(scope="module")
def admission(
    control_plane: ControlPlane, kuberay_crds: list[str], rljob_crd: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Admission]:
    plane = control_plane
    namespace = unique("webhook")
    selector = {"rldock.io/webhook-test": namespace}  # only this namespace is sent to this test's webhook
    plane.create_namespace(namespace, labels=selector)
    for manifest in build_rbac(
        name="rldock-operator",
        namespaces=[namespace],
        subject={"kind": "User", "name": DEVELOPER_USER, "apiGroup": "rbac.authorization.k8s.io"},
    ):
        plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    for manifest in tenant_role(namespace):
        plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    for secret in (READABLE, UNREADABLE):
        plane.kubectl("create", "secret", "generic", secret, "-n", namespace, "--from-literal=token=s3cret")
    work = tmp_path_factory.mktemp("webhook")
    kubeconfig = yaml.safe_load(plane.kubeconfig.read_text())
    kubeconfig["current-context"] = DEVELOPER_USER
    (work / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    pem = issue_certificate("127.0.0.1")
    for name, data in (("ca.crt", pem.ca), ("tls.crt", pem.cert), ("tls.key", pem.key)):
        (work / name).write_bytes(data)
    (port,) = free_ports(1)
    # The chart's default policy (no hostPath, no control-plane nodes) with one image prefix and
    # one NFS export, as the operator reads it from the chart.
    operator = OperatorProcess(
        namespaces=[namespace],
        kubeconfig=work / "kubeconfig",
        log_dir=work,
        poll_interval=POLL,
        env={**plane.env, "RLDOCK_POLICY": json.dumps(POLICY)},
        extra_args=[
            "--webhook-port",
            str(port),
            "--webhook-cert-file",
            str(work / "tls.crt"),
            "--webhook-key-file",
            str(work / "tls.key"),
        ],
    )
    url = f"https://127.0.0.1:{port}{WEBHOOK_PATH}"
    configuration = f"rldock-webhook-test-{uuid.uuid4().hex[:6]}"
    operator.start()
    try:
        wait_for(
            "the operator's webhook",
            lambda: _serving(url, work / "ca.crt"),
            timeout=TIMEOUT,
            interval=0.25,
            check=operator.check,
        )
        plane.kubectl(
            "apply",
            "-f",
            "-",
            input=yaml.safe_dump(
                {
                    "apiVersion": "admissionregistration.k8s.io/v1",
                    "kind": "ValidatingWebhookConfiguration",
                    "metadata": {"name": configuration},
                    "webhooks": [
                        {
                            "name": "validate.rljobs.rldock.io",
                            "admissionReviewVersions": ["v1"],
                            "sideEffects": "None",
                            "failurePolicy": "Fail",
                            "timeoutSeconds": 10,
                            "clientConfig": {"url": url, "caBundle": base64.b64encode(pem.ca).decode()},
                            "rules": [
                                {
                                    "apiGroups": ["rldock.io"],
                                    "apiVersions": ["v1alpha1"],
                                    "resources": ["rljobs"],
                                    "operations": ["CREATE", "UPDATE"],
                                    "scope": "Namespaced",
                                }
                            ],
                            "namespaceSelector": {"matchLabels": selector},
                        }
                    ],
                }
            ),
        )
        world = Admission(plane, namespace, operator)
        # The API server picks the configuration up a moment later: wait until a server-side dry
        # run (nothing stored; allowed, since the webhook has no side effects) is refused.
        world.wait(
            "the webhook configuration in effect",
            lambda: world.apply(rljob("probe", **HOST_ROOT), "--dry-run=server").returncode != 0,
        )
        yield world
    finally:
        plane.kubectl("delete", "validatingwebhookconfiguration", configuration, "--ignore-not-found", check=False)
        plane.kubectl("delete", "rljobs", "--all", "-n", namespace, "--wait=false", check=False)
        operator.stop()
        plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_an_rljob_outside_the_policy_is_refused_at_apply_naming_the_field(admission: Admission):
    name = unique("hostroot")
    refused = admission.apply(rljob(name, **HOST_ROOT))
    assert refused.returncode != 0
    message = refused.stderr
    assert "validate.rljobs.rldock.io" in message and "denied the request" in message, message
    assert "spec.volumes[0].hostPath.path" in message and "policy.hostPathPrefixes" in message, message
    assert "PolicyDenied" in message, message
    assert admission.rljob(name) is None  # nothing was stored, so nothing can be created for it


def test_an_invalid_rljob_is_refused_with_every_problem(admission: Admission):
    name = unique("invalid")
    manifest = rljob(name, **HOST_ROOT)
    manifest["spec"]["job"]["training"]["data_parallel_size"] = 3  # 8 samples over 3 ranks, on 2 devices
    refused = admission.apply(manifest)
    assert refused.returncode != 0 and "InvalidSpec" in refused.stderr, refused.stderr
    assert refused.stderr.count("spec.job.training.data_parallel_size: ") == 2, refused.stderr
    assert admission.rljob(name) is None


def test_a_quantity_the_schema_accepts_but_no_amount_fits_is_refused_naming_the_field(admission: Admission):
    """`1e99999999999` matches the CRD's quantity pattern; the webhook answers with the field instead
    of dropping the connection (which the API server would report as a failed call, not the field)."""
    name = unique("huge")
    refused = admission.apply(rljob(name, environments=[{"name": "env", "ephemeralStorage": "1e99999999999"}]))
    assert refused.returncode != 0 and "InvalidSpec" in refused.stderr, refused.stderr
    assert "spec.environments[0].ephemeralStorage: " in refused.stderr, refused.stderr
    assert "too large an amount" in refused.stderr, refused.stderr
    assert admission.rljob(name) is None


def test_a_valid_rljob_is_admitted_and_the_operator_s_own_writes_pass(admission: Admission):
    name = unique("valid")
    admitted = admission.apply(rljob(name))
    assert admitted.returncode == 0, admitted.stderr
    # The operator's finalizer is an UPDATE that the webhook sees and lets through (spec unchanged).
    admission.wait(
        "the operator's finalizer",
        lambda: FINALIZER in ((admission.rljob(name) or {}).get("metadata", {}).get("finalizers") or ()),
    )
    # A change into what the policy refuses, and a change of spec.managedBy, are refused.
    widened = admission.apply(rljob(name, **HOST_ROOT))
    assert widened.returncode != 0 and "spec.volumes[0].hostPath.path" in widened.stderr, widened.stderr
    handed_over = admission.apply(rljob(name, managedBy=MULTIKUEUE))
    assert handed_over.returncode != 0 and "spec.managedBy: field is immutable" in handed_over.stderr, (
        handed_over.stderr
    )
    assert "volumes" not in admission.rljob(name)["spec"] and "managedBy" not in admission.rljob(name)["spec"]
    # Deletion: the operator removes its finalizer (another UPDATE) and the RLJob goes.
    admission.plane.kubectl("delete", "rljob", name, "-n", admission.namespace, "--wait=false")
    admission.wait("the RLJob deleted", lambda: admission.rljob(name) is None)


def nfs_volume(path: str) -> dict[str, Any]:
    return {
        "volumes": [{"name": "data", "nfs": {"server": NFS_EXPORT["server"], "path": path}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }


def small_cluster(**placement: Any) -> dict[str, Any]:
    """spec.cluster as rljob() has it, with tolerations or a nodeSelector."""
    return {"cluster": {"head": {"cpu": 1, "memory": "1Gi"}, "worker": {"cpu": 1, "memory": "1Gi"}, **placement}}


def secret_volume(secret: str) -> dict[str, Any]:
    return {
        "volumes": [{"name": "creds", "secret": {"secretName": secret}}],
        "volumeMounts": [{"name": "creds", "mountPath": "/creds"}],
    }


def test_a_user_cannot_mount_a_secret_they_may_not_get(admission: Admission):
    """Through each field that names a Secret: refused at apply with the field, the user, the verb,
    the Secret and the namespace, and nothing stored."""
    name = unique("steal")
    manifest = rljob(
        name,
        **secret_volume(UNREADABLE),
        env=[{"name": "T", "valueFrom": {"secretKeyRef": {"name": UNREADABLE, "key": "token"}}}],
        envFrom=[{"secretRef": {"name": "default-token-xyz"}}],  # a legacy token Secret's name
        imagePullSecrets=[{"name": "regcred"}],
    )
    refused = admission.apply(manifest, user=TENANT_USER)
    assert refused.returncode != 0
    message, ns = refused.stderr, admission.namespace
    assert "denied the request" in message and "Forbidden" in message, message
    for field, secret in (
        ("spec.imagePullSecrets[0].name", "regcred"),
        ("spec.volumes[0].secret.secretName", UNREADABLE),
        ("spec.env[0].valueFrom.secretKeyRef.name", UNREADABLE),
        ("spec.envFrom[0].secretRef.name", "default-token-xyz"),
    ):
        assert f'{field}: user "{TENANT_USER}" may not get secrets "{secret}" in namespace "{ns}"' in message, message
    assert admission.rljob(name) is None
    # The same spec from someone who may read them all (the admin) is admitted: it is the user that
    # decides, not the spec.
    assert admission.apply(manifest, "--dry-run=server").returncode == 0


def test_a_user_with_get_can_mount_the_secret_and_not_add_another(admission: Admission):
    name = unique("allowed")
    admitted = admission.apply(rljob(name, **secret_volume(READABLE)), user=TENANT_USER)
    assert admitted.returncode == 0, admitted.stderr
    # The operator's finalizer: an UPDATE by the operator's own identity, which may get no Secret.
    admission.wait(
        "the operator's finalizer",
        lambda: FINALIZER in ((admission.rljob(name) or {}).get("metadata", {}).get("finalizers") or ()),
    )
    # A change that adds nothing passes; one that adds a Secret the tenant may not get does not.
    suspended = admission.apply(rljob(name, **secret_volume(READABLE), suspend=True), user=TENANT_USER)
    assert suspended.returncode == 0, suspended.stderr
    widened = rljob(name, **secret_volume(READABLE), envFrom=[{"secretRef": {"name": UNREADABLE}}])
    refused = admission.apply(widened, user=TENANT_USER)
    assert refused.returncode != 0, refused.stdout
    assert f'spec.envFrom[0].secretRef.name: user "{TENANT_USER}" may not get secrets "{UNREADABLE}"' in refused.stderr
    assert "envFrom" not in admission.rljob(name)["spec"]
    admission.plane.kubectl("delete", "rljob", name, "-n", admission.namespace, "--wait=false")
    admission.wait("the RLJob deleted", lambda: admission.rljob(name) is None)


@pytest.mark.parametrize(
    "spec, field, setting",
    [
        ({"image": f"{IMAGE_PREFIX}-evil/rt:1"}, "spec.image", "policy.imagePrefixes"),
        ({"image": "registry.example.com.evil.io/ml/rt:1"}, "spec.image", "policy.imagePrefixes"),
        (nfs_volume("/"), "spec.volumes[0].nfs", "policy.nfsExports"),
        (nfs_volume("/exports/team-a/../b"), "spec.volumes[0].nfs.path", "policy.nfsExports"),
        (
            small_cluster(tolerations=[{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]),
            "spec.cluster.tolerations[0]",
            "policy.tolerations",
        ),
        # The node lifecycle's taints (policy.protectedTaints): a cordoned node an admin drains, a
        # failing one; the second toleration of two is the one named.
        (
            small_cluster(tolerations=[{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]),
            "spec.cluster.tolerations[0]",
            "policy.protectedTaints",
        ),
        (
            small_cluster(
                tolerations=[
                    {"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"},
                    {
                        "key": "node.kubernetes.io/not-ready",
                        "operator": "Exists",
                        "effect": "NoExecute",
                        "tolerationSeconds": 600,
                    },
                ]
            ),
            "spec.cluster.tolerations[1]",
            "policy.protectedTaints",
        ),
        (
            small_cluster(tolerations=[{"operator": "Exists", "effect": "NoSchedule"}]),  # every NoSchedule taint
            "spec.cluster.tolerations[0]",
            "policy.tolerations",
        ),
        (
            small_cluster(nodeSelector={"node-role.kubernetes.io/master": "true"}),
            "spec.cluster.nodeSelector[node-role.kubernetes.io/master]",
            "policy.nodeSelectors",
        ),
        ({"scheduling": {"gang": "kueue", "queue": "team-a"}}, "spec.scheduling.queue", "policy.queues"),
        # The environments' pods within policy.environments (issue 50: 16 entries x 256 replicas of any size).
        ({"environments": [{"name": "env", "replicas": 17}]}, "spec.environments[0].replicas", "maxReplicas: 16"),
        (
            {"environments": [{"name": f"env{index}", "replicas": 16} for index in range(3)]},
            "spec.environments",
            "policy.environments.maxPods: 32",
        ),
        (
            {"environments": [{"name": "env", "resources": {"cpu": 1, "memory": "17Gi"}}]},
            "spec.environments[0].resources.memory",
            "policy.environments.maxMemory",
        ),
    ],
)
def test_the_policy_refuses_naming_the_field_and_the_setting(admission: Admission, spec, field, setting):
    name = unique("policy")
    refused = admission.apply(rljob(name, **spec), user=TENANT_USER)
    assert refused.returncode != 0
    assert "PolicyDenied" in refused.stderr and f"{field}: " in refused.stderr and setting in refused.stderr, (
        refused.stderr
    )
    assert admission.rljob(name) is None


@pytest.mark.parametrize(
    "spec",
    [
        {"image": f"{IMAGE_PREFIX}/rt:1"},
        nfs_volume("/exports/team-a/models/"),
        small_cluster(tolerations=[{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}]),
    ],
)
def test_what_the_policy_lists_is_admitted(admission: Admission, spec):
    admitted = admission.apply(rljob(unique("listed"), **spec), "--dry-run=server", user=TENANT_USER)
    assert admitted.returncode == 0, admitted.stderr


def test_helm_upgrade_keeps_the_chart_s_certificate_and_ca_bundle(control_plane: ControlPlane, tmp_path: Path) -> None:
    """The chart's own certificate through Helm's install and upgrade actions on this API server:
    the upgrade's `lookup` finds the Secret, so the served certificate and the caBundle stay the
    same pair; a Secret deleted by an admin is issued anew, the bundle with it. (The release watches
    its own namespace only, whose name label 1.20 does not set: the configuration calls no one.)"""
    helm_release = pytest.importorskip("rldock_e2e.helm_release")
    pytest.importorskip("helm_python")
    namespace, name = unique("webhook-chart"), unique("rel")
    release = helm_release.HelmRelease(control_plane, namespace=namespace, name=name)
    values = {
        "operator": {"watchNamespaces": [namespace]},
        "crds": {"install": False},
        "replicaCount": 1,
        "podDisruptionBudget": {"enabled": False},
    }

    def issued() -> tuple[dict[str, str], str]:
        secret = control_plane.kubectl_json("get", "secret", f"{name}-rldock-webhook-cert", "-n", namespace)
        configuration = control_plane.kubectl_json(
            "get", "validatingwebhookconfiguration", f"{name}-rldock-{namespace}"
        )
        (hook,) = configuration["webhooks"]
        return secret["data"], hook["clientConfig"]["caBundle"]

    installed = False
    try:
        release.install(values)
        installed = True
        first, bundle = issued()
        assert bundle == first["ca.crt"] and set(first) == {"ca.crt", "tls.crt", "tls.key"}
        release.upgrade({**values, "operator": {**values["operator"], "pollInterval": 2}})
        assert issued() == (first, bundle)
        control_plane.kubectl("delete", "secret", f"{name}-rldock-webhook-cert", "-n", namespace)
        release.upgrade(values)
        second, bundle = issued()
        assert bundle == second["ca.crt"] != first["ca.crt"] and second["tls.crt"] != first["tls.crt"]
        # `helm uninstall` takes the configuration with it: no RLJob write waits on a webhook gone.
        release.uninstall()
        installed = False
        gone = control_plane.kubectl("get", "validatingwebhookconfiguration", f"{name}-rldock-{namespace}", check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr, gone.stderr
    finally:
        if installed:
            release.uninstall()
        release.close()
        control_plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
