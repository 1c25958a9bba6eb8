"""The operator installed as a real Helm release (e2e/src/rldock_e2e/helm_release.py: Helm's own
install, upgrade and uninstall through helm_python) on the kind-style cluster, its pod run by a
real kubelet in the operator image that images/build.sh built: installed, upgraded (a new
revision rolls the pod), uninstalled with the CRD kept as docs/install.md says."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from rldock_e2e.controlplane import ControlPlane, wait_for
from rldock_e2e.helm_release import (
    RELEASE_NAMESPACE,
    HelmRelease,
    chart_without_optional_dependencies,
)
from rldock_e2e.operator_process import chart_available

pytestmark = pytest.mark.e2e

CRD = "rljobs.rldock.io"
DEPLOYMENT = "rldock"


@pytest.fixture(scope="module")
def release(kind_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelmRelease]:
    reason = chart_available()
    if reason:
        pytest.skip(reason)
    plane, _, _ = kind_cluster
    chart = chart_without_optional_dependencies(tmp_path_factory.mktemp("chart"))
    helm = HelmRelease(plane, chart)
    try:
        yield helm
    finally:
        helm.close()


def _deployment(plane: ControlPlane) -> dict:
    return plane.kubectl_json("get", "deployment", DEPLOYMENT, "-n", RELEASE_NAMESPACE)


def _rolled_out(plane: ControlPlane) -> bool:
    status = _deployment(plane)["status"]
    return (status.get("observedGeneration") == _deployment(plane)["metadata"]["generation"]
            and status.get("updatedReplicas") == 1 and status.get("availableReplicas") == 1
            and status.get("replicas") == 1)


def _env(plane: ControlPlane, name: str) -> str:
    (container,) = _deployment(plane)["spec"]["template"]["spec"]["containers"]
    return next(e["value"] for e in container["env"] if e["name"] == name)


def test_install_upgrade_uninstall_keeps_the_crd(kind_cluster, release: HelmRelease):
    plane, _, _ = kind_cluster
    watched = "team-a"
    plane.kubectl("create", "namespace", watched)
    release.install({"operator": {"watchNamespaces": [watched]}})
    # the operator's pod runs in a real container, its readiness probe answered by the operator
    wait_for("the operator rolled out", lambda: _rolled_out(plane), timeout=300, interval=2.0)
    pods = plane.kubectl_json("get", "pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/name=rldock")
    (pod,) = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
    assert pod["spec"]["nodeName"].startswith("kind-")
    assert plane.kubectl("logs", "-n", RELEASE_NAMESPACE, pod["metadata"]["name"]).stdout.strip()
    assert plane.kubectl_json("get", "crd", CRD)["metadata"]["annotations"]["meta.helm.sh/release-name"] == "rldock"

    release.upgrade({"operator": {"watchNamespaces": [watched], "logLevel": "DEBUG"}})
    assert _env(plane, "RLDOCK_LOG_LEVEL") == "DEBUG"
    wait_for("the upgraded operator rolled out", lambda: _rolled_out(plane), timeout=300, interval=2.0)
    history = release.history()  # as `helm history -o json`
    assert [(r["revision"], r["status"]) for r in history] == [(1, "superseded"), (2, "deployed")], history

    release.uninstall()
    wait_for("the release's objects gone", lambda: not plane.kubectl(
        "get", "deployment,serviceaccount,role,rolebinding", "-n", RELEASE_NAMESPACE, "-l",
        "app.kubernetes.io/instance=rldock", "-o", "name").stdout.strip(), timeout=120, interval=1.0)
    # helm.sh/resource-policy: keep -- the RLJobs (and their checkpoints) outlive the release
    assert json.loads(plane.kubectl("get", "crd", CRD, "-o", "json").stdout)["metadata"]["name"] == CRD
