"""Fixtures of the e2e scenarios. The control-plane fixtures (control_plane, namespace,
kuberay_crds, rljob_crd, emulated_nodes) are in tests/conftest.py, shared with
tests/integration/test_operator.py.

- `node_agent` (one per test module): the node agent double with one emulated node of 8 NPUs;
  its pods run as local processes (e2e/src/rldock_e2e/doubles/node_agent.py). Module-scoped, so its nodes are
  gone before the next module (and tests/integration) runs.
- `kind_cluster` (one per session, tests/e2e/test_kind_nodes.py, test_helm_release.py): a second
  control plane with real kubelets in kind-style node containers (e2e/src/rldock_e2e/nodes) and
  the images of images/build.sh loaded into them.
- `scenario` (one per test): a fresh namespace with the claim examples/rljob-tiny.yaml mounts
  (`rl-checkpoints`, bound to a hostPath volume on the nodes' shared storage), the KubeRay double
  watching it, and the operator deployed from the Helm chart (its pod run by the node agent), or,
  without helm/rldock and helm_python or with RLDOCK_E2E_OPERATOR=process, as a local process
  with a ServiceAccount's token and the generated Role; at the end every RLJob is deleted and
  every pod's processes are gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rldock_e2e.controlplane import BinariesUnavailable, ControlPlane, find_binaries, wait_for
from rldock_e2e.doubles.kuberay import KubeRayDouble
from rldock_e2e.doubles.node_agent import NodeAgentDouble
from rldock_e2e.doubles.sandbox import sandbox_unavailable
from rldock_e2e.doubles.storage import bind_shared_claim, delete_shared_claim
from rldock_e2e.nodes.cluster import KindNodes, NodeNetwork, NodesUnavailable, unavailable_reason
from rldock_e2e.operator_process import ChartOperator, OperatorProcess, chart_available, service_account_kubeconfig
from rldock_e2e.repo import REPO_ROOT
from rldock_e2e.scenario import Scenario

NODE_DEVICES = 8
KIND_NODE_DEVICES = 4
CHECKPOINT_CLAIM = "rl-checkpoints"  # what examples/rljob-tiny.yaml mounts
CONTAINERS_OPT_IN = "RLDOCK_E2E_CONTAINERS"  # the kind-style node tests run only when this is 1


@pytest.fixture(scope="module")
def node_agent(
    control_plane: ControlPlane, kuberay_crds: list[str], rljob_crd: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeAgentDouble]:
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("nodes")
    with NodeAgentDouble(control_plane, workdir=work, host_root=work / "shared-storage", max_grace=3) as agent:
        agent.add_node(f"npu-{uuid.uuid4().hex[:6]}", devices=NODE_DEVICES)
        yield agent
    assert not agent.errors, f"the node agent double failed: {agent.errors[-1]!r}"


@pytest.fixture
def scenario(
    control_plane: ControlPlane, namespace: str, node_agent: NodeAgentDouble, tmp_path: Path
) -> Iterator[Scenario]:
    bind_shared_claim(control_plane, namespace=namespace, claim=CHECKPOINT_CLAIM, host_path="/mnt/rldock")
    operator: ChartOperator | OperatorProcess
    if chart_available() is None and os.environ.get("RLDOCK_E2E_OPERATOR", "chart") == "chart":
        operator = ChartOperator(control_plane, namespace=namespace, agent=node_agent)
    else:
        kubeconfig = service_account_kubeconfig(control_plane, namespace, tmp_path / "kubeconfig")
        operator = OperatorProcess(namespaces=[namespace], kubeconfig=kubeconfig, log_dir=tmp_path)
    with control_plane.api_client() as api, KubeRayDouble(api, namespace=namespace, interval=0.5) as kuberay:
        operator.start()
        world = Scenario(
            plane=control_plane, namespace=namespace, agent=node_agent, kuberay=kuberay, operator=operator, api=api
        )
        try:
            yield world
        finally:
            _save_state(world, tmp_path / "final-state.txt")
            _clean_up(world)
            delete_shared_claim(control_plane, namespace=namespace, claim=CHECKPOINT_CLAIM)
    assert not kuberay.errors, f"the KubeRay double failed: {kuberay.errors[-1]!r}"


def _built_image(name: str) -> tuple[Path, str]:
    """(OCI archive, image reference) of images/build.sh --local-base NAME (cached)."""
    result = subprocess.run(
        [str(REPO_ROOT / "images" / "build.sh"), "--local-base", name],
        check=False,
        text=True,
        capture_output=True,
        cwd=REPO_ROOT,
    )
    if result.returncode == 2:
        pytest.skip(f"images/build.sh cannot build {name} here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr[-3000:]
    archive = Path(result.stdout.strip().splitlines()[-1])
    manifest = subprocess.run(
        ["tar", "-xOf", str(archive), "index.json"], text=True, capture_output=True, check=True
    ).stdout
    reference = json.loads(manifest)["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"]
    return archive, reference


@pytest.fixture(scope="session")
def kind_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, KindNodes, str]]:
    """Its own control plane (node-lifecycle controller on) with two kind-style nodes of
    KIND_NODE_DEVICES emulated NPUs each, the operator image loaded into them and a host folder
    shared by both at nodes.cluster.SHARED_STORAGE_PATH; yields (control plane, nodes, operator
    image reference)."""
    if os.environ.get(CONTAINERS_OPT_IN) != "1":
        pytest.skip(
            f"real containers are opt-in ({CONTAINERS_OPT_IN}=1, or `make test-containers`): their "
            "cold builds (kubelet, images) add about 45 minutes on a 2-core machine, which would "
            "take `make test` past CI's 90 minutes (e2e/README.md, section Real nodes)"
        )
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    try:
        find_binaries(build=True)
    except BinariesUnavailable as error:
        pytest.skip(f"no Kubernetes control-plane binaries and they cannot be built here: {error}")
    archive, operator_image = _built_image("operator")
    index = uuid.uuid4().int % 200 + 20
    with (
        NodeNetwork.create(index) as network,
        ControlPlane(workdir=tmp_path_factory.mktemp("kind-controlplane"), node_address=network.gateway) as plane,
    ):
        try:
            nodes = KindNodes(plane, network, images=[archive], storage_root=tmp_path_factory.mktemp("kind-storage"))
        except NodesUnavailable as error:
            pytest.skip(f"kind-style nodes cannot be built here: {error}")
        with nodes:
            nodes.add("kind-npu-0", devices=KIND_NODE_DEVICES)
            nodes.add("kind-npu-1", devices=KIND_NODE_DEVICES)
            nodes.wait_ready()
            yield plane, nodes, operator_image


@pytest.fixture(scope="session")
def runtime_image(kind_cluster) -> str:
    """The CPU runtime image (images/build.sh --local-base runtime-cpu, ~20 min cold, 3.7 GB)
    loaded into the kind-style nodes; its reference."""
    _, nodes, _ = kind_cluster
    archive, reference = _built_image("runtime-cpu")
    nodes.load_image(archive)
    return reference


def _save_state(world: Scenario, path: Path) -> None:
    """What kubectl showed at the end of the test, kept beside the operator's log for a post-mortem."""
    parts = [world.report()]
    for args in (("get", "rljobs", "-o", "yaml"), ("get", "events", "-o", "wide", "--sort-by=.lastTimestamp")):
        result = world.kubectl(*args, check=False)
        parts.append(f"$ kubectl {' '.join(args)}\n{result.stdout}{result.stderr}")
    path.write_text("\n".join(parts))


def _clean_up(world: Scenario) -> None:
    """Delete the RLJobs while the operator still runs (its finalizer), stop the operator, then
    wait until no pod of the namespace has a process left."""
    if world.operator.process is None:
        world.operator.start()
    world.kubectl("delete", "rljobs", "--all", "--wait=false", check=False)
    try:
        wait_for("the RLJobs deleted", lambda: not world.items("rljobs"), timeout=60, interval=2)
    except TimeoutError:  # the operator is broken: take its finalizer off, the test has failed anyway
        for job in world.items("rljobs"):
            world.kubectl(
                "patch",
                "rljob",
                job["metadata"]["name"],
                "--type=merge",
                "-p",
                '{"metadata":{"finalizers":null}}',
                check=False,
            )
    world.operator.stop()
    world.kubectl("delete", "rayclusters,pods", "--all", "--wait=false", check=False)
    wait_for(
        "every pod's processes gone",
        lambda: not world.agent.pids(world.namespace) or not any(world.agent.pids(world.namespace).values()),
        timeout=60,
    )
