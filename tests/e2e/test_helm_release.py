"""The operator installed as a real Helm release (e2e/src/rldock_e2e/helm_release.py: Helm's own
install, upgrade and uninstall through helm_python) on the kind-style cluster, its pods run by
real kubelets in the operator image that images/build.sh built: installed with the chart's
defaults (two replicas, one holding the leader-election Lease), upgraded (a new revision rolls the
pods), uninstalled with the CRD kept as docs/install.md says."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from rldock_e2e.controlplane import ControlPlane, wait_for
from rldock_e2e.helm_release import (
    RELEASE_NAMESPACE,
    HelmRelease,
    diagnosis,
)
from rldock_e2e.operator_process import chart_available

pytestmark = pytest.mark.e2e

CRD = "rljobs.rldock.io"
DEPLOYMENT = "rldock"
SELECTOR = "app.kubernetes.io/name=rldock"


@pytest.fixture(scope="module")
def release(kind_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HelmRelease]:
    reason = chart_available()
    if reason:
        pytest.skip(reason)
    plane, _, _ = kind_cluster
    helm = HelmRelease(plane)  # helm/rldock as it is, as docs/install.md installs it
    try:
        yield helm
    finally:
        helm.uninstall_if_present()  # a failed test left it: the scenarios install the same name
        helm.close()


def _deployment(plane: ControlPlane) -> dict:
    return plane.kubectl_json("get", "deployment", DEPLOYMENT, "-n", RELEASE_NAMESPACE)


def _rolled_out(plane: ControlPlane) -> bool:
    """Every replica of the chart's default (two, with leader election) updated and available."""
    deployment = _deployment(plane)
    status, wanted = deployment["status"], deployment["spec"]["replicas"]
    return (
        status.get("observedGeneration") == deployment["metadata"]["generation"]
        and status.get("updatedReplicas") == wanted
        and status.get("availableReplicas") == wanted
        and status.get("replicas") == wanted
    )


def _wait_rolled_out(plane: ControlPlane, what: str) -> None:
    try:
        wait_for(what, lambda: _rolled_out(plane), timeout=300, interval=2.0)
    except TimeoutError as error:
        raise TimeoutError(f"{error}\n{diagnosis(plane, RELEASE_NAMESPACE, SELECTOR)}") from None


def _live_pods(plane: ControlPlane) -> list[dict]:
    pods = plane.kubectl_json("get", "pods", "-n", RELEASE_NAMESPACE, "-l", SELECTOR)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _leader(plane: ControlPlane) -> str | None:
    """The Lease's holder (a pod name), once one replica leads."""
    leases = plane.kubectl_json("get", "leases", "-n", RELEASE_NAMESPACE)["items"]
    holders = [lease["spec"].get("holderIdentity") for lease in leases]
    return next((holder for holder in holders if holder), None)


def _env(plane: ControlPlane, name: str) -> str:
    (container,) = _deployment(plane)["spec"]["template"]["spec"]["containers"]
    return next(e["value"] for e in container["env"] if e["name"] == name)


def test_install_upgrade_uninstall_keeps_the_crd(kind_cluster, release: HelmRelease):
    plane, _, _ = kind_cluster
    watched = "team-a"
    plane.kubectl("create", "namespace", watched)
    release.install({"operator": {"watchNamespaces": [watched]}})
    # The chart's defaults: its replicas (two) each in a real container, their readiness probes
    # answered by the operator, one of them holding the leader-election Lease.
    _wait_rolled_out(plane, "the operator rolled out")
    pods = _live_pods(plane)
    assert len(pods) == _deployment(plane)["spec"]["replicas"], pods
    for pod in pods:
        assert pod["spec"]["nodeName"].startswith("kind-")
        assert plane.kubectl("logs", "-n", RELEASE_NAMESPACE, pod["metadata"]["name"]).stdout.strip()
    leader = wait_for("a replica leading", lambda: _leader(plane), timeout=120, interval=2.0)
    assert leader in {p["metadata"]["name"] for p in pods}, (leader, pods)
    assert plane.kubectl_json("get", "crd", CRD)["metadata"]["annotations"]["meta.helm.sh/release-name"] == "rldock"

    release.upgrade({"operator": {"watchNamespaces": [watched], "logLevel": "DEBUG"}})
    assert _env(plane, "RLDOCK_LOG_LEVEL") == "DEBUG"
    _wait_rolled_out(plane, "the upgraded operator rolled out")
    history = release.history()  # as `helm history -o json`
    assert [(r["revision"], r["status"]) for r in history] == [(1, "superseded"), (2, "deployed")], history

    release.uninstall()
    wait_for(
        "the release's objects gone",
        lambda: (
            not plane.kubectl(
                "get",
                "deployment,serviceaccount,role,rolebinding",
                "-n",
                RELEASE_NAMESPACE,
                "-l",
                "app.kubernetes.io/instance=rldock",
                "-o",
                "name",
            ).stdout.strip()
        ),
        timeout=120,
        interval=1.0,
    )
    # helm.sh/resource-policy: keep -- the RLJobs (and their checkpoints) outlive the release
    assert json.loads(plane.kubectl("get", "crd", CRD, "-o", "json").stdout)["metadata"]["name"] == CRD
