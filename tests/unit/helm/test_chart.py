"""The Helm chart (helm/rldock), rendered and linted with the Helm library: valid Kubernetes objects
for each variant, RBAC equal to the operator's builder, a Deployment whose environment the
operator's own settings parser reads back, the CRD identical to crds/, and bad values refused."""

from __future__ import annotations

import base64
import copy
import functools
import re
import shutil
import socket
import ssl
import tarfile
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from chart_testing import (
    CHART,
    KUBERNETES_VERSIONS,
    NAMESPACE,
    REPO,
    VARIANTS,
    by_kind,
    one,
    render,
    render_files,
)
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import padding

from rldock.contract.version import __version__
from rldock.operator.admission import REQUEST_DEADLINE_S, WEBHOOK_PATH, WebhookServer, review
from rldock.operator.api import PodDefaults
from rldock.operator.builders.rbac import build_rbac, service_account_subject
from rldock.operator.constants import CRD_NAME, ImagePullPolicy
from rldock.operator.leader import LeaseTimings, lease_rules
from rldock.operator.policy import AdminPolicy
from rldock.operator.settings import MAX_POLL_INTERVAL, MIN_POLL_INTERVAL, DashboardAddress, load_settings
from rldock.operator.validation import device_resource_error

CHART_KINDS = {
    "CustomResourceDefinition",
    "Secret",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "ValidatingWebhookConfiguration",
}
OPERATOR_COMMAND = ["python", "-m", "rldock.operator"]
CHART_VARIABLES = {
    "RLDOCK_NAMESPACES",
    "RLDOCK_POLL_INTERVAL",
    "RLDOCK_LOG_LEVEL",
    "RLDOCK_DASHBOARD_ADDRESS",
    "RLDOCK_RAY_TIMEOUT",
    "RLDOCK_DEFAULT_IMAGE",
    "RLDOCK_IMAGE_PULL_POLICY",
    "RLDOCK_DEFAULT_DEVICE_RESOURCE",
    "RLDOCK_LEADER_ELECTION",
    "RLDOCK_LEASE_NAME",
    "RLDOCK_LEASE_DURATION",
    "RLDOCK_RENEW_DEADLINE",
    "RLDOCK_RETRY_PERIOD",
    "RLDOCK_HEALTH_PORT",
    "RLDOCK_POLICY",
    "RLDOCK_NETWORK_POLICY",
    "RLDOCK_OPERATOR_POD_LABELS",
    "RLDOCK_TOKEN_KEY",
    "RLDOCK_WEBHOOK_PORT",
    "RLDOCK_WEBHOOK_CERT_FILE",
    "RLDOCK_WEBHOOK_KEY_FILE",
}
# Variables the operator refuses to start without, once the chart sets them.
REQUIRED_VARIABLES = {"RLDOCK_TOKEN_KEY", "RLDOCK_WEBHOOK_CERT_FILE", "RLDOCK_WEBHOOK_KEY_FILE"}
# What the chart's token-key Secret gives the operator container (a generated key at install).
TOKEN_KEY = "k" * 64
# What the downward API gives the operator container in a pod of the Deployment.
POD = {"metadata.name": "rldock-7d9f8b6c5-x2k4q", "metadata.namespace": NAMESPACE}
LEADER_ELECTION_ROLE = "-leader-election"  # suffix of the Role and RoleBinding for the Lease
AGGREGATED_ROLES = ("-edit", "-view")  # suffixes of the ClusterRoles that aggregate into edit/admin and view


def _values(**overrides: Any) -> dict[str, Any]:
    """The chart's defaults merged with `overrides` (what the template saw)."""
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(overrides)


def _without_labels(manifest: dict[str, Any]) -> dict[str, Any]:
    manifest = copy.deepcopy(manifest)
    manifest["metadata"].pop("labels", None)
    return manifest


# --- Chart metadata and lint ----------------------------------------------------------------


def test_app_version_is_the_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = (REPO / "pyproject.toml").read_text()
    assert chart["appVersion"] == __version__
    assert f'version = "{__version__}"' in pyproject


@pytest.mark.parametrize("kube_version", ["v1.20.0", "v1.30.0"])
@pytest.mark.parametrize("variant", [*VARIANTS, "with-kuberay"])
def test_strict_lint_is_clean(variant, kube_version):
    """`helm lint --strict helm/rldock` as a user runs it on the checkout: no error, no warning (the
    KubeRay subchart is vendored, so nothing is missing), for each variant of the values."""
    values = {"kuberay-operator": {"enabled": True}} if variant == "with-kuberay" else VARIANTS[variant]
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=kube_version)
    assert report["errors"] == [], report["messages"]
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]


def test_the_vendored_kuberay_chart_is_the_declared_dependency():
    """charts/ holds KubeRay's chart at the declared version (Chart.yaml says where it came from), and
    Helm finds it: no `helm dependency update`, no chart repository needed to install or lint."""
    (dependency,) = yaml.safe_load((CHART / "Chart.yaml").read_text())["dependencies"]
    archive = CHART / "charts" / f"{dependency['name']}-{dependency['version']}.tgz"
    assert sorted(p.name for p in (CHART / "charts").iterdir()) == [archive.name]
    with tarfile.open(archive) as tar:
        vendored = yaml.safe_load(tar.extractfile(f"{dependency['name']}/Chart.yaml").read())  # type: ignore[union-attr]
    assert (vendored["name"], vendored["version"]) == (dependency["name"], dependency["version"])
    assert vendored["home"] == "https://github.com/ray-project/kuberay"
    assert helm.dependency_list(CHART) == [
        {**{k: dependency[k] for k in ("name", "version", "repository")}, "status": "ok"}
    ]


def test_kuberay_is_an_optional_dependency_off_by_default():
    (dependency,) = yaml.safe_load((CHART / "Chart.yaml").read_text())["dependencies"]
    assert dependency["condition"] == "kuberay-operator.enabled"
    assert _values()["kuberay-operator"]["enabled"] is False
    assert not [o for o in render() if "kuberay" in o["metadata"]["name"]]
    enabled = render({"kuberay-operator": {"enabled": True}})
    images = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["image"]
        for d in by_kind(enabled, "Deployment")
    }
    assert images["kuberay-operator"] == f"quay.io/kuberay/operator:v{dependency['version']}", images


def test_helm_show_readme_prints_the_charts_readme():
    """`helm show readme helm/rldock`: the chart's README, whose quick start names files that exist."""
    readme = helm.show(str(CHART), output_format="readme")
    assert readme.startswith("# rldock") and readme.strip() == (CHART / "README.md").read_text().strip()
    for path in ("examples/rljob-cpu.yaml", "docs/install.md", "docs/rljob-reference.md", "docs/troubleshooting.md"):
        assert path in readme and (REPO / path).is_file(), path
    assert "helm install rldock helm/rldock" in readme and "--dependency-update" not in readme


# --- Every rendered object --------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_objects_are_valid_kubernetes_objects(variant, version):
    objects = render(VARIANTS[variant])
    kinds = {o["kind"] for o in objects}
    # Only built-in kinds, all of which kubernetes-validate knows (the CRD included); a kind it has
    # no schema for would have to be skipped here explicitly, by name.
    assert kinds <= CHART_KINDS, kinds - CHART_KINDS
    for manifest in objects:
        kubernetes_validate.validate(manifest, version, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_namespaced_objects_live_in_the_release_namespace(variant):
    watched = VARIANTS[variant].get("operator", {}).get("watchNamespaces", [])
    for manifest in render(VARIANTS[variant]):
        namespace = manifest["metadata"].get("namespace")
        if manifest["kind"] in ("Role", "RoleBinding") and manifest["metadata"]["name"].endswith(LEADER_ELECTION_ROLE):
            assert namespace == NAMESPACE  # the Lease lives in the operator's own namespace
        elif manifest["kind"] in ("Role", "RoleBinding"):
            assert namespace in watched
        elif manifest["kind"] in ("ServiceAccount", "Deployment", "Service", "PodDisruptionBudget", "Secret"):
            assert namespace == NAMESPACE
        else:
            assert namespace is None, manifest["kind"]


# --- RBAC -------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_rbac_is_what_the_operator_builder_makes(variant):
    objects = render(VARIANTS[variant])
    deployment = one(objects, "Deployment")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    rbac = [
        _without_labels(o)
        for o in objects
        if o["kind"].endswith(("Role", "RoleBinding"))
        and not o["metadata"]["name"].endswith((LEADER_ELECTION_ROLE, *AGGREGATED_ROLES))
    ]
    namespaces = VARIANTS[variant].get("operator", {}).get("watchNamespaces", [])
    expected = build_rbac(
        name=deployment["metadata"]["name"], subject=service_account_subject(account, NAMESPACE), namespaces=namespaces
    )
    key = lambda m: (m["kind"], m["metadata"].get("namespace", ""))  # noqa: E731
    assert sorted(rbac, key=key) == sorted(expected, key=key)


def test_per_namespace_watching_needs_nothing_cluster_scoped():
    """Nothing cluster-scoped for the operator; the roles that aggregate RLJob rights into `edit`
    and `view` are cluster-scoped by nature (and bind nothing), and can be left out."""
    objects = render(VARIANTS["per-namespace"])
    assert not by_kind(objects, "ClusterRoleBinding")
    assert {r["metadata"]["name"] for r in by_kind(objects, "ClusterRole")} == {f"rldock{s}" for s in AGGREGATED_ROLES}
    alone = render({**VARIANTS["per-namespace"], "rbac": {"create": True, "aggregateToDefaultRoles": False}})
    assert not by_kind(alone, "ClusterRole")
    roles = [r for r in by_kind(objects, "Role") if not r["metadata"]["name"].endswith(LEADER_ELECTION_ROLE)]
    assert [r["metadata"]["namespace"] for r in roles] == ["team-a", "team-b"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_lease_rules_are_the_elector_s_in_the_release_namespace(variant):
    objects = render(VARIANTS[variant])
    deployment = one(objects, "Deployment")
    name = f"{deployment['metadata']['name']}{LEADER_ELECTION_ROLE}"
    (role,) = [o for o in by_kind(objects, "Role") if o["metadata"]["name"] == name]
    (binding,) = [o for o in by_kind(objects, "RoleBinding") if o["metadata"]["name"] == name]
    lease = load_settings([], _env(_container(objects))).lease_name
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == lease_rules(lease)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [service_account_subject(account, NAMESPACE)]


def test_no_lease_rules_without_leader_election():
    objects = render({"replicaCount": 1, "leaderElection": {"enabled": False}})
    assert not [o for o in objects if o["metadata"]["name"].endswith(LEADER_ELECTION_ROLE)]


def test_rbac_and_service_account_can_be_left_to_an_admin():
    objects = render({"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "given"}})
    assert {o["kind"] for o in objects} == {
        "CustomResourceDefinition",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "Secret",
        "ValidatingWebhookConfiguration",
    }
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "given"


# --- The operator Deployment ------------------------------------------------------------------


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the operator sees it: values, and the downward API's fields
    of a pod (POD)."""
    env = {var["name"]: var["value"] for var in container["env"] if "value" in var}
    for var in container["env"]:
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field is not None:
            env[var["name"]] = POD[field]
        secret = var.get("valueFrom", {}).get("secretKeyRef")
        if secret is not None:  # a Secret the chart makes, e.g. the token key: any value of its size
            env[var["name"]] = "0" * 64
    return env


def test_two_replicas_with_leader_election_replaced_by_a_rolling_update():
    objects = render()
    spec = one(objects, "Deployment")["spec"]
    assert spec["replicas"] == 2
    # A new pod starts as a standby; only once it is ready does an old one stop (and, if it led,
    # release the Lease to a standby).
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    settings = load_settings([], _env(_container(objects)))
    assert settings.leader_election
    assert (settings.identity, settings.lease_namespace) == (POD["metadata.name"], NAMESPACE)
    assert settings.lease_name == one(objects, "Deployment")["metadata"]["name"]
    assert settings.lease == LeaseTimings()
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert _container(objects)["securityContext"]["readOnlyRootFilesystem"] is True


def test_one_replica_without_leader_election_is_replaced_with_recreate():
    objects = render({"replicaCount": 1, "leaderElection": {"enabled": False}})
    spec = one(objects, "Deployment")["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert not load_settings([], _env(_container(objects))).leader_election
    assert not by_kind(objects, "PodDisruptionBudget")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"leaderElection": {"enabled": False}}, "replicaCount > 1 needs leaderElection.enabled"),
        ({"leaderElection": {"enabled": True, "leaseDuration": 10}}, "leaseDuration > renewDeadline"),
        ({"leaderElection": {"enabled": True, "retryPeriod": 9}}, "renewDeadline > 1.2 x retryPeriod"),
        ({"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}}, "needs metrics.service"),
    ],
)
def test_unsafe_replica_settings_are_refused(values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render_files(values)


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_call_the_operator_s_own_health_server(variant):
    container = _container(render(VARIANTS[variant]))
    settings = load_settings([], _env(container))
    assert settings.liveness_endpoint is None  # kopf's would serve only on the leader
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.health_port, "webhook": settings.webhook_port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def _metrics_services(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("-metrics")]


def test_metrics_service_selects_the_operator_pods():
    objects = render()
    (service,) = _metrics_services(objects)
    deployment = one(objects, "Deployment")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    (port,) = service["spec"]["ports"]
    assert (port["name"], port["targetPort"], port["port"]) == ("http-metrics", "http", 8080)
    assert not by_kind(objects, "ServiceMonitor")  # only when asked for
    assert not _metrics_services(render({"metrics": {"service": {"enabled": False}}}))


def test_service_monitor_when_enabled():
    objects = render(
        {"metrics": {"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prometheus"}}}}
    )
    monitor = one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (service,) = _metrics_services(objects)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [
        {"port": "http-metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]


def test_pod_disruption_budget_keeps_a_standby(tmp_path):
    objects = render()
    budget = one(objects, "PodDisruptionBudget")
    assert budget["apiVersion"] == "policy/v1"  # offline, Helm assumes a cluster that serves it
    selector = one(objects, "Deployment")["spec"]["selector"]
    assert budget["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector["matchLabels"]}}
    assert not by_kind(render({"podDisruptionBudget": {"enabled": False}}), "PodDisruptionBudget")
    # A cluster without policy/v1 (Kubernetes 1.20): the same budget as policy/v1beta1.
    chart = tmp_path / "rldock"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("charts", "Chart.lock"))
    template = chart / "templates" / "poddisruptionbudget.yaml"
    template.write_text(template.read_text().replace('.Capabilities.APIVersions.Has "policy/v1"', "false"))
    old = one(render(chart=chart), "PodDisruptionBudget")
    assert old["apiVersion"] == "policy/v1beta1" and old["spec"] == budget["spec"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_operator_settings_read_back_from_the_deployment(variant):
    """The Deployment's environment, parsed by the operator's own settings code, gives the values."""
    values = _values(**VARIANTS[variant])
    container = _container(render(VARIANTS[variant]))
    assert container["command"] == OPERATOR_COMMAND
    settings = load_settings([], _env(container))  # no flags: what `python -m rldock.operator` sees
    operator = values["operator"]
    assert settings.namespaces == tuple(operator["watchNamespaces"])
    assert settings.clusterwide == (not operator["watchNamespaces"])
    assert settings.poll_interval == operator["pollInterval"]
    assert settings.log_level == operator["logLevel"]
    assert settings.dashboard_address.value == operator["dashboardAddress"]
    assert settings.ray_timeout == operator["rayTimeout"]


def test_default_runtime_image_and_device_resource_are_the_operator_defaults():
    assert load_settings([], _env(_container(render()))).pod_defaults == PodDefaults()
    custom = load_settings([], _env(_container(render(VARIANTS["cluster-wide-custom"])))).pod_defaults
    assert custom == PodDefaults(
        image="registry.example.com/rl/runtime:0.1.0-cuda",
        image_pull_policy=ImagePullPolicy.ALWAYS,
        device_resource="nvidia.com/gpu",
    )


def test_every_variable_the_chart_sets_changes_the_operator_settings():
    """Each RLDOCK_* variable of the Deployment, left out, gives other settings: none is ignored."""
    custom = copy.deepcopy(VARIANTS["cluster-wide-custom"])
    custom["operator"]["watchNamespaces"] = ["team-a"]  # every knob away from its default
    custom["leaderElection"] = {
        "enabled": True,
        "leaseName": "rl-lease",
        "leaseDuration": 20,
        "renewDeadline": 12,
        "retryPeriod": 3,
    }
    custom["policy"] = {"hostPathPrefixes": ["/mnt/shared"]}
    custom["networkPolicy"] = {"enabled": False}
    env = _env(_container(render(custom)))
    assert {name for name in env if name.startswith("RLDOCK_")} == CHART_VARIABLES
    rendered = load_settings([], env)
    for name in CHART_VARIABLES - REQUIRED_VARIABLES:
        without = {k: v for k, v in env.items() if k != name}
        assert load_settings([], without) != rendered, f"{name} is set by the chart but not read by the operator"
    for name in REQUIRED_VARIABLES:  # the token key; the webhook's certificate, once its port is set
        with pytest.raises(SystemExit):
            load_settings([], {k: v for k, v in env.items() if k != name})


def test_operator_image_defaults_to_the_app_version():
    assert _container(render())["image"] == f"ghcr.io/rldock/rldock-operator:{__version__}"
    assert _container(render({"image": {"tag": "dev"}}))["image"].endswith(":dev")


# --- The values schema agrees with the operator -----------------------------------------------


def test_schema_bounds_and_enums_are_the_operator_settings():
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())["properties"]["operator"]["properties"]
    assert (schema["pollInterval"]["minimum"], schema["pollInterval"]["maximum"]) == (
        MIN_POLL_INTERVAL,
        MAX_POLL_INTERVAL,
    )
    assert schema["dashboardAddress"]["enum"] == [d.value for d in DashboardAddress]
    for level in schema["logLevel"]["enum"]:
        assert load_settings(["--log-level", level], {"RLDOCK_TOKEN_KEY": TOKEN_KEY}).log_level == level


# --- The CRD ----------------------------------------------------------------------------------


def test_chart_copy_of_the_crd_is_identical():
    source = REPO / "crds" / "rljobs.rldock.io.yaml"
    copy_ = CHART / "files" / source.name
    assert copy_.read_bytes() == source.read_bytes(), (
        f"the chart's copy of the CRD is stale: make crd (or cp {source.relative_to(REPO)} {copy_.relative_to(REPO)})"
    )


def test_rendered_crd_is_the_generated_one_kept_on_uninstall():
    generated = yaml.safe_load((REPO / "crds" / "rljobs.rldock.io.yaml").read_text())
    rendered = one(render(), "CustomResourceDefinition")
    assert rendered["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert rendered["metadata"].pop("labels")["app.kubernetes.io/managed-by"] == "Helm"
    assert rendered == generated and rendered["metadata"]["name"] == CRD_NAME


def test_crd_can_be_left_out_or_not_kept():
    assert not by_kind(render({"crds": {"install": False}}), "CustomResourceDefinition")
    crd = one(render({"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]


# --- Bad values are refused at install time, naming the field ----------------------------------


@pytest.mark.parametrize(
    "values, field",
    [
        ({"operator": {"pollInterval": 30}}, "/operator/pollInterval"),  # status would lag > 10 s
        ({"operator": {"pollInterval": 0}}, "/operator/pollInterval"),
        ({"operator": {"pollInterval": "5s"}}, "/operator/pollInterval"),
        ({"operator": {"rayTimeout": 0}}, "/operator/rayTimeout"),
        ({"operator": {"logLevel": "chatty"}}, "/operator/logLevel"),
        ({"operator": {"dashboardAddress": "dns"}}, "/operator/dashboardAddress"),
        ({"operator": {"watchNamespaces": ["team-*"]}}, "/operator/watchNamespaces/0"),  # no patterns
        ({"operator": {"watchNamespaces": ["a", "a"]}}, "/operator/watchNamespaces"),
        ({"operator": {"watchNamespaces": "team-a"}}, "/operator/watchNamespaces"),
        ({"operator": {"healthPort": 80}}, "/operator/healthPort"),
        ({"operator": {"namespaces": ["a"]}}, "/operator"),  # a misspelt key
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"image": {"repository": ""}}, "/image/repository"),
        ({"image": None}, "image"),  # required
        ({"runtime": {"deviceResource": "Ascend910"}}, "/runtime/deviceResource"),
        ({"crds": {"install": "yes"}}, "/crds/install"),
        ({"rbac": {"create": 1}}, "/rbac/create"),
        ({"kuberay-operator": {"enabled": "false"}}, "/kuberay-operator/enabled"),
        ({"replicaCount": 0}, "/replicaCount"),
        ({"leaderElection": {"enabled": True, "leaseName": "Not_A_Name"}}, "/leaderElection/leaseName"),
        ({"leaderElection": {"enabled": True, "retryPeriod": 0}}, "/leaderElection/retryPeriod"),
        ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "/metrics/serviceMonitor/interval"),
        ({"podDisruptionBudget": {"maxUnavailable": 0}}, "/podDisruptionBudget/maxUnavailable"),
        # The admin policy (policy.py checks the same again when the operator starts).
        ({"policy": {"imagePrefixes": ["https://registry.example.com"]}}, "/policy/imagePrefixes/0"),
        ({"policy": {"imagePrefixes": [""]}}, "/policy/imagePrefixes/0"),
        ({"policy": {"imagePrefixes": ["registry.example.com /ml"]}}, "/policy/imagePrefixes/0"),
        ({"policy": {"nfsServers": ["nfs.example.com"]}}, "/policy/nfsServers"),  # replaced by nfsExports
        ({"policy": {"nfsExports": [{"server": "nfs.example.com"}]}}, "/policy/nfsExports/0"),
        ({"policy": {"nfsExports": [{"server": "*", "path": "/"}]}}, "/policy/nfsExports/0/server"),
        ({"policy": {"nfsExports": [{"server": "nfs", "path": "exports"}]}}, "/policy/nfsExports/0/path"),
        ({"policy": {"protectedTaints": [""]}}, "/policy/protectedTaints/0"),
        ({"policy": {"environments": {"maxReplicas": 0}}}, "/policy/environments/maxReplicas"),
        ({"policy": {"environments": {"maxMemory": "16 GB"}}}, "/policy/environments/maxMemory"),
        ({"policy": {"environments": {"egress": [{"to": [{}]}]}}}, "/policy/environments/egress/0/to/0"),
        ({"policy": {"environments": {"maxPods": 0}}}, "/policy/environments/maxPods"),
        ({"policy": {"environments": {"maxGpus": 3}}}, "/policy/environments"),
    ],
)
def test_bad_values_are_refused_naming_the_field(values, field):
    with pytest.raises(helm.HelmValuesError, match="values don't meet the specifications") as refused:
        render_files(values)
    assert field in str(refused.value)


@pytest.mark.parametrize(
    "values",
    [
        {"operator": {"pollInterval": MIN_POLL_INTERVAL}},
        {"operator": {"pollInterval": MAX_POLL_INTERVAL}},
        {"operator": {"rayTimeout": 0.1}},
        {"runtime": {"deviceResource": "nvidia.com/gpu"}},
        {"operator": {"watchNamespaces": ["default"]}},
    ],
)
def test_edge_values_are_accepted(values):
    assert render(values)


@pytest.mark.parametrize(
    "name",
    [
        "huawei.com/Ascend910",
        "nvidia.com/gpu",
        "example.org/my_npu.v2",
        "npu/x",
        "Ascend910",
        "Huawei.com/Ascend910",
        "huawei.com/",
        "huawei.com/Ascend 910",
        "example.com/-x",
        "kubernetes.io/npu",
        "foo.kubernetes.io/npu",
        "requests.example.com/x",
        "example.com/" + "x" * 64,
    ],
)
def test_device_resource_is_refused_by_the_schema_exactly_when_the_operator_refuses_it(name):
    """Refused at `helm install`, not later by an operator that exits at start (settings.py)."""
    try:
        render_files({"runtime": {"deviceResource": name}})
        refused_by_chart = False
    except helm.HelmValuesError as refused:
        assert "/runtime/deviceResource" in str(refused)
        refused_by_chart = True
    assert refused_by_chart == (device_resource_error(name) is not None)


def test_missing_service_account_name_is_refused():
    with pytest.raises(helm.HelmError, match="serviceAccount.name is required"):
        render_files({"serviceAccount": {"create": False}})


# --- NOTES.txt --------------------------------------------------------------------------------


def test_notes_say_what_to_do_next():
    notes = render_files(VARIANTS["per-namespace"])["rldock/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} rollout status deployment/rldock" in notes
    assert f"run\n   {PodDefaults().image} and request {PodDefaults().device_resource}." in notes
    assert "team-a, team-b" in notes and "kubectl apply -n team-a -f examples/rljob-tiny.yaml" in notes
    notes_paths = ("examples/rljob-tiny.yaml", "examples/rljob-cpu.yaml", "docs/install.md", "docs/rljob-reference.md")
    for path in (*notes_paths, "docs/troubleshooting.md"):
        assert path in notes and (REPO / path).is_file(), path


# --- The install docs follow the chart --------------------------------------------------------


@pytest.mark.parametrize("doc", ["docs/install.md", "README.md", "helm/rldock/README.md"])
def test_documented_helm_commands_need_no_chart_repository(doc):
    """The KubeRay subchart is vendored, so the documented install and upgrade from the checkout
    fetch nothing (Helm would refuse a chart whose declared dependency is missing from charts/)."""
    text = (REPO / doc).read_text()
    commands = re.findall(r"^helm (?:install|upgrade) rldock helm/rldock.*$", text, re.MULTILINE)
    assert commands, doc
    assert not [c for c in commands if "--dependency-update" in c], commands
    assert "--set kuberay-operator.enabled=true" in text


def test_every_variable_the_chart_sets_is_documented():
    table = (REPO / "docs" / "operator.md").read_text().split("## Running the operator", 1)[1]
    for name in CHART_VARIABLES:
        assert f"`{name}" in table, name


# --- Shared-cluster readiness (docs/security.md) ---------------------------------------------------


def test_rljob_rights_aggregate_into_the_built_in_roles():
    roles = {r["metadata"]["name"]: r for r in by_kind(render(), "ClusterRole")}
    edit, view = roles["rldock-edit"], roles["rldock-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {"create", "delete", "patch", "update"} <= set(edit["rules"][0]["verbs"])
    assert all(set(rule["verbs"]) == {"get", "list", "watch"} for rule in view["rules"])


def test_the_token_key_is_a_kept_secret_the_operator_reads_from_its_environment():
    objects = render()
    (secret,) = [s for s in by_kind(objects, "Secret") if s["metadata"]["name"].endswith("-token-key")]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(secret["data"]["key"])) == 64
    (var,) = [v for v in _container(objects)["env"] if v["name"] == "RLDOCK_TOKEN_KEY"]
    assert var["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "key"}


def test_an_admins_own_token_key_secret_replaces_the_charts():
    objects = render({"tokenKey": {"existingSecret": "my-key"}})
    assert "rldock-token-key" not in {o["metadata"]["name"] for o in by_kind(objects, "Secret")}
    (var,) = [v for v in _container(objects)["env"] if v["name"] == "RLDOCK_TOKEN_KEY"]
    assert var["valueFrom"]["secretKeyRef"] == {"name": "my-key", "key": "key"}


def test_policy_and_network_policy_reach_the_operator():
    values = {
        "policy": {
            "hostPathPrefixes": ["/mnt/shared"],
            "imagePrefixes": ["registry.example.com/ml/"],
            "nfsExports": [{"server": "nfs.example.com", "path": "/exports/team-a"}],
            "schedulerNames": ["default-scheduler", "volcano"],
            "queues": ["research"],
            "tolerations": [{"key": "huawei.com/Ascend910", "operator": "Exists"}],
            "protectedTaints": ["node.kubernetes.io/unschedulable"],
            "podDefaults": {"imagePullSecrets": ["regcred"], "priorityClassName": "research"},
            "environments": {
                "maxReplicas": 4,
                "maxPods": 6,
                "maxCpu": "500m",
                "maxMemory": "64Gi",
                "maxEphemeralStorage": "2Gi",
                "egress": [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 443}]}],
            },
        },
        "networkPolicy": {"enabled": False},
    }
    settings = load_settings([], _env(_container(render(values))))
    environments = settings.policy.environments
    assert (environments.max_replicas, environments.max_cpu, environments.max_memory) == (4, "500m", "64Gi")
    assert environments.max_ephemeral_storage == "2Gi" and environments.max_pods == 6
    assert [rule.manifest() for rule in environments.egress] == [
        {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 443}]}
    ]
    assert settings.policy.host_path_prefixes == ["/mnt/shared"]
    assert [(e.server, e.path) for e in settings.policy.nfs_exports] == [("nfs.example.com", "/exports/team-a")]
    assert settings.policy.scheduler_names == ["default-scheduler", "volcano"] and settings.policy.queues == [
        "research"
    ]
    assert settings.policy.tolerations[0].key == "huawei.com/Ascend910"
    assert settings.policy.protected_taints == ["node.kubernetes.io/unschedulable"]
    assert settings.pod_defaults.image_pull_secrets == ("regcred",)
    assert settings.pod_defaults.priority_class_name == "research" and not settings.network_policy
    defaults = load_settings([], _env(_container(render())))
    assert defaults.policy.host_path_prefixes == [] and defaults.network_policy
    # The chart's defaults are the operator's own secure defaults (AdminPolicy()).
    assert defaults.policy == AdminPolicy()
    # The operator's own pods, which the RLJobs' NetworkPolicies admit to the Jobs API.
    deployment = one(render(), "Deployment")
    assert dict(defaults.operator_pod_labels) == deployment["spec"]["selector"]["matchLabels"]
    assert defaults.operator_namespace == NAMESPACE


# --- The admission webhook (operator/src/rldock/operator/admission.py) ---------------------------

WEBHOOK_SECRET_KEYS = {"ca.crt", "tls.crt", "tls.key"}


def _webhook(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (hook,) = one(objects, "ValidatingWebhookConfiguration")["webhooks"]
    return hook


def _webhook_secret(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (secret,) = [s for s in by_kind(objects, "Secret") if s["metadata"]["name"].endswith("-webhook-cert")]
    return secret


def _webhook_service(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (service,) = [s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("-webhook")]
    return service


def test_the_api_server_sends_rljob_writes_to_every_replica_s_webhook():
    objects = render()
    hook = _webhook(objects)
    assert hook["rules"] == [
        {
            "apiGroups": ["rldock.io"],
            "apiVersions": ["v1alpha1"],
            "resources": ["rljobs"],
            "operations": ["CREATE", "UPDATE"],
            "scope": "Namespaced",
        }
    ]
    assert (hook["sideEffects"], hook["admissionReviewVersions"], hook["failurePolicy"]) == ("None", ["v1"], "Fail")
    assert hook["timeoutSeconds"] == REQUEST_DEADLINE_S == 10  # the server cuts a connection off then too
    assert "namespaceSelector" not in hook  # cluster-wide: every namespace
    # The Service it calls selects every replica, on the port each one's operator serves.
    service = _webhook_service(objects)
    reference = hook["clientConfig"]["service"]
    assert reference == {"name": service["metadata"]["name"], "namespace": NAMESPACE, "path": WEBHOOK_PATH, "port": 443}
    (port,) = service["spec"]["ports"]
    assert port["port"] == 443
    deployment = one(objects, "Deployment")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    container = _container(objects)
    settings = load_settings([], _env(container))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == settings.webhook_port == 9443
    # ... with the certificate of the Secret, mounted where the operator reads it.
    secret = _webhook_secret(objects)
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    files = {f"{mount['mountPath']}/{item['path']}": item["key"] for item in volume["secret"]["items"]}
    assert files == {settings.webhook_cert_file: "tls.crt", settings.webhook_key_file: "tls.key"}


def test_the_webhook_covers_only_the_watched_namespaces():
    hook = _webhook(render(VARIANTS["per-namespace"]))
    assert hook["namespaceSelector"] == {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}]
    }


def test_the_chart_issues_a_certificate_the_api_server_accepts(tmp_path):
    """The caBundle is the Secret's CA, which signed a certificate for <service>.<namespace>.svc,
    and the operator's server with that certificate passes the check the API server makes."""
    objects = render()
    hook, secret = _webhook(objects), _webhook_secret(objects)
    assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == WEBHOOK_SECRET_KEYS
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    pem = {key: base64.b64decode(value) for key, value in secret["data"].items()}
    ca = x509.load_pem_x509_certificate(pem["ca.crt"])
    cert = x509.load_pem_x509_certificate(pem["tls.crt"])
    ca.public_key().verify(
        cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), cert.signature_hash_algorithm
    )
    server_name = f"{_webhook_service(objects)['metadata']['name']}.{NAMESPACE}.svc"
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert server_name in names
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days >= 3649  # kept ten years
    key = serialization.load_pem_private_key(pem["tls.key"], password=None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    # TLS as the API server speaks it: the caBundle as the only root, the Service's DNS name checked.
    for name, data in pem.items():
        (tmp_path / name).write_bytes(data)
    server = WebhookServer(
        functools.partial(
            review,
            settings=load_settings([], {"RLDOCK_TOKEN_KEY": "k" * 32}),
            access=lambda user, namespace: lambda resource, name: False,  # a double; only the handshake runs
        ),
        port=0,
        host="127.0.0.1",
        cert_file=str(tmp_path / "tls.crt"),
        key_file=str(tmp_path / "tls.key"),
    ).start()
    try:
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        with (
            socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname=server_name) as tls,
        ):
            assert tls.getpeercert()["subject"]
    finally:
        server.stop()


LOOKUP = 'lookup "v1" "Secret" .Release.Namespace $secretName'


def _chart_whose_lookup_finds(tmp_path, data: dict[str, str]):
    """A copy of the chart whose lookup of the webhook Secret finds one holding `data` (what
    `helm upgrade` sees; offline, lookup finds nothing)."""
    chart = tmp_path / "rldock"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("charts", "Chart.lock"))
    template = chart / "templates" / "webhook.yaml"
    text = template.read_text()
    assert text.count(LOOKUP) == 1
    found = "(dict " + " ".join(f'"{k}" "{v}"' for k, v in data.items()) + ")"
    template.write_text(text.replace(LOOKUP, f'dict "data" {found}'))
    return chart


def test_an_upgrade_keeps_the_certificate_and_the_ca_bundle_in_step(tmp_path):
    kept = {"ca.crt": "Q0E=", "tls.crt": "Q0VSVA==", "tls.key": "S0VZ"}
    objects = render(chart=_chart_whose_lookup_finds(tmp_path / "whole", kept))
    assert _webhook_secret(objects)["data"] == kept
    assert _webhook(objects)["clientConfig"]["caBundle"] == kept["ca.crt"]
    # A Secret missing a key is no certificate: a new pair is issued, and the bundle follows it.
    partial = render(chart=_chart_whose_lookup_finds(tmp_path / "partial", {"ca.crt": "Q0E="}))
    data = _webhook_secret(partial)["data"]
    assert set(data) == WEBHOOK_SECRET_KEYS and data["ca.crt"] != "Q0E="
    assert _webhook(partial)["clientConfig"]["caBundle"] == data["ca.crt"]


def test_the_webhook_can_be_turned_off_or_made_to_fail_open():
    objects = render({"webhook": {"enabled": False}})
    assert not by_kind(objects, "ValidatingWebhookConfiguration")
    assert not [o for o in objects if "-webhook" in o["metadata"]["name"]]
    container = _container(objects)
    assert load_settings([], _env(container)).webhook_port is None
    assert "webhook" not in {p["name"] for p in container["ports"]}
    assert _webhook(render({"webhook": {"failurePolicy": "Ignore"}}))["failurePolicy"] == "Ignore"


@pytest.mark.parametrize(
    "values, field",
    [
        ({"webhook": {"failurePolicy": "Sometimes"}}, "/webhook/failurePolicy"),
        ({"webhook": {"port": 443}}, "/webhook/port"),  # below 1024: the non-root container cannot bind it
        ({"webhook": {"enabled": "yes"}}, "/webhook/enabled"),
        ({"webhook": {"timeoutSeconds": 30}}, "/webhook"),  # fixed at the operator's own deadline
    ],
)
def test_bad_webhook_values_are_refused_naming_the_field(values, field):
    with pytest.raises(helm.HelmValuesError, match="values don't meet the specifications") as refused:
        render_files(values)
    assert field in str(refused.value)


def test_the_webhook_and_health_ports_must_differ():
    with pytest.raises(helm.HelmError, match="webhook.port and operator.healthPort must differ"):
        render_files({"webhook": {"port": 8080}})


def test_notes_say_which_replica_leads_and_where_the_metrics_are():
    notes = render_files()["rldock/templates/NOTES.txt"]
    assert f"kubectl -n {NAMESPACE} get lease rldock -o jsonpath='{{.spec.holderIdentity}}'" in notes
    assert "Service rldock-metrics, port 8080, path /metrics" in notes
    single = render_files({"replicaCount": 1, "leaderElection": {"enabled": False}})["rldock/templates/NOTES.txt"]
    assert "get lease" not in single
