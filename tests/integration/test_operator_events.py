"""The operator reconciles on change, against a real kube-apiserver (e2e/controlplane): a change of
an RLJob's RayCluster or of a pod of it runs the RLJob's round at once, and an RLJob whose cluster
is not running is not polled at the poll interval (handlers.py). The operator runs as its own
process with exactly the generated RBAC (so the watches it opens are allowed by it) and its
metrics endpoint, whose round counter (rldock_reconciles_total) counts the rounds. There is no
KubeRay double: the RayClusters never get pods or a status, so every RLJob stays Provisioning,
waiting, which is what an idle RLJob is.

The slow test runs the CPU benchmark (rldock_benchmarks.operator_idle) briefly: 100 such RLJobs
must cost the operator at most 2% of a core (issue 52).
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from rldock.operator.builders.rbac import build_rbac
from rldock.operator.handlers import RESYNC_INTERVAL
from rldock_benchmarks.operator_idle import TARGET_CORE_SHARE, measure, rljob
from rldock_e2e.controlplane import DEVELOPER_USER, ControlPlane, wait_for
from rldock_e2e.controlplane.processes import free_ports
from rldock_e2e.operator_process import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

POLL = 1.0  # the operator's poll interval here: an idle RLJob polled at it would take a round a second
PROMPT = 5.0  # seconds within which a child's change must have run the round


class World:
    def __init__(self, plane: ControlPlane, namespace: str, operator: OperatorProcess) -> None:
        self.plane, self.namespace, self.operator = plane, namespace, operator
        self.custom = client.CustomObjectsApi(plane.api_client())
        self.core = client.CoreV1Api(plane.api_client())

    def ray_cluster(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object("ray.io", "v1", self.namespace, "rayclusters", name)
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def phase(self, name: str) -> str | None:
        obj = self.custom.get_namespaced_custom_object("rldock.io", "v1alpha1", self.namespace, "rljobs", name)
        return (obj.get("status") or {}).get("phase")

    def idle_rljob(self) -> str:
        """A new RLJob, once it waits (Provisioning) for a RayCluster that never comes up."""
        name = f"idle-{uuid.uuid4().hex[:5]}"
        self.plane.kubectl("apply", "-n", self.namespace, "-f", "-", input=yaml.safe_dump(rljob(name)))
        wait_for(
            f"RLJob {name} Provisioning with its RayCluster",
            lambda: self.ray_cluster(name) is not None and self.phase(name) == "Provisioning",
            timeout=60,
            interval=0.25,
            check=self.operator.check,
        )
        return name

    def settled_rounds(self) -> float:
        """The round count once it stays the same over two poll intervals (the operator has acted
        on everything it was told), waiting as long as a loaded machine needs."""

        def stable() -> list[float] | None:  # a list: a count of 0 is an answer too
            first = self.rounds()
            time.sleep(2 * POLL)
            return [first] if self.rounds() == first else None

        (count,) = wait_for(
            "the operator's rounds to settle", stable, timeout=120, interval=0.1, check=self.operator.check
        )
        return count

    def rounds(self) -> float:
        """Reconcile rounds the operator has run (its metrics endpoint)."""
        with urllib.request.urlopen(self.operator.metrics_url, timeout=10) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "rldock_reconciles_total"
        )


@pytest.fixture(scope="module")
def world(
    control_plane: ControlPlane, kuberay_crds: list[str], rljob_crd: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    namespace = f"ev-{uuid.uuid4().hex[:5]}"
    control_plane.create_namespace(namespace)
    for manifest in build_rbac(
        name="rldock-operator",
        namespaces=[namespace],
        subject={"kind": "User", "name": DEVELOPER_USER, "apiGroup": "rbac.authorization.k8s.io"},
    ):
        control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    work: Path = tmp_path_factory.mktemp("operator-events")
    kubeconfig = yaml.safe_load(control_plane.kubeconfig.read_text())
    kubeconfig["current-context"] = DEVELOPER_USER
    (work / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    (health_port,) = free_ports(1)
    operator = OperatorProcess(
        namespaces=[namespace],
        kubeconfig=work / "kubeconfig",
        log_dir=work,
        poll_interval=POLL,
        env=control_plane.env,
        health_port=health_port,
    )
    operator.start()
    try:
        world = World(control_plane, namespace, operator)
        wait_for("the operator's metrics", lambda: _answers(world), timeout=60, interval=0.5, check=operator.check)
        yield world
    finally:
        control_plane.kubectl("delete", "rljobs", "--all", "-n", namespace, "--wait=false", check=False)
        try:
            wait_for(
                "the RLJobs deleted",
                lambda: not control_plane.kubectl_json("get", "rljobs", "-n", namespace)["items"],
                timeout=60,
                interval=1,
            )
        finally:
            operator.stop()
            control_plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _answers(world: World) -> bool:
    try:
        world.rounds()
        return True
    except OSError:
        return False


def test_a_deleted_raycluster_is_noticed_at_once_and_recreated(world: World):
    name = world.idle_rljob()
    old_uid = world.ray_cluster(name)["metadata"]["uid"]
    deleted = time.monotonic()
    world.plane.kubectl("delete", "raycluster", name, "-n", world.namespace)
    recreated = wait_for(
        "a new RayCluster",
        lambda: (world.ray_cluster(name) or {}).get("metadata", {}).get("uid") not in (None, old_uid),
        timeout=RESYNC_INTERVAL,
        interval=0.1,
    )
    took = time.monotonic() - deleted
    # Only the RayCluster's watch event can have run this round so soon: the RLJob is idle, so its
    # next round without an event would be the resync, minutes away.
    assert recreated and took < PROMPT, f"recreated after {took:.1f} s"


def test_an_idle_rljob_is_not_polled_but_its_pods_changes_run_a_round(world: World):
    name = world.idle_rljob()
    before = world.settled_rounds()  # the events of its creation handled, however slow the machine
    time.sleep(10 * POLL)
    idle_rounds = world.rounds() - before
    # A timer per RLJob would have run about 10 rounds for each RLJob of the namespace here.
    assert idle_rounds <= 1, f"{idle_rounds} rounds in {10 * POLL:.0f} s of nothing happening"

    # A pod KubeRay would make for the cluster (labelled ray.io/cluster) wakes the RLJob's round.
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-head-test", "labels": {"ray.io/cluster": name, "ray.io/node-type": "head"}},
        "spec": {"containers": [{"name": "ray-head", "image": "rayproject/ray:2.9.0"}]},
    }
    before = world.rounds()
    world.plane.kubectl("apply", "-n", world.namespace, "-f", "-", input=json.dumps(pod))
    try:
        wait_for("a round after the pod appeared", lambda: world.rounds() > before, timeout=PROMPT, interval=0.1)
    finally:
        world.plane.kubectl(
            "delete", "pod", pod["metadata"]["name"], "-n", world.namespace, "--grace-period=0", "--force", check=False
        )


@pytest.mark.slow
def test_100_idle_rljobs_cost_the_operator_at_most_2_percent_of_a_core(
    control_plane: ControlPlane, kuberay_crds: list[str], rljob_crd: list[str], tmp_path: Path
):
    # The fast poll interval, the worse case of a timer per RLJob; a short window (the benchmark's
    # default is a whole resync interval, which adds one resync round per RLJob).
    result = measure(control_plane, num_rljobs=100, poll_interval=1.0, window=60.0, settle=10.0, work=tmp_path)
    assert result["phases_after_window"] == {"Provisioning": 100}, result
    assert result["core_share"] <= TARGET_CORE_SHARE, result
