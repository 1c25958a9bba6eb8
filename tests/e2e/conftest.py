"""Fixtures of the e2e scenarios. The control-plane fixtures (control_plane, namespace,
kuberay_crds, rljob_crd, emulated_nodes) are in tests/conftest.py, shared with
tests/integration/test_operator.py.

- `node_agent` (one per test module): the node agent double with one emulated node of 8 NPUs;
  its pods run as local processes (e2e/src/rldock_e2e/doubles/node_agent.py). Module-scoped, so its nodes are
  gone before the next module (and tests/integration) runs.
- `scenario` (one per test): a fresh namespace with the claim examples/rljob-tiny.yaml mounts
  (`rl-checkpoints`, bound to a hostPath volume on the nodes' shared storage), the KubeRay double
  watching it, and the operator deployed from the Helm chart (its pod run by the node agent), or,
  without helm/rldock and helm_python or with RLDOCK_E2E_OPERATOR=process, as a local process
  with a ServiceAccount's token and the generated Role; at the end every RLJob is deleted and
  every pod's processes are gone.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from rldock_e2e.controlplane import ControlPlane, wait_for
from rldock_e2e.doubles.kuberay import KubeRayDouble
from rldock_e2e.doubles.node_agent import NodeAgentDouble
from rldock_e2e.doubles.sandbox import sandbox_unavailable
from rldock_e2e.doubles.storage import bind_shared_claim, delete_shared_claim
from rldock_e2e.operator_process import ChartOperator, OperatorProcess, chart_available, service_account_kubeconfig
from rldock_e2e.scenario import Scenario

NODE_DEVICES = 8
CHECKPOINT_CLAIM = "rl-checkpoints"  # what examples/rljob-tiny.yaml mounts


@pytest.fixture(scope="module")
def node_agent(control_plane: ControlPlane, kuberay_crds: list[str], rljob_crd: list[str],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeAgentDouble]:
    reason = sandbox_unavailable()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("nodes")
    with NodeAgentDouble(control_plane, workdir=work, host_root=work / "shared-storage", max_grace=3) as agent:
        agent.add_node(f"npu-{uuid.uuid4().hex[:6]}", devices=NODE_DEVICES)
        yield agent
    assert not agent.errors, f"the node agent double failed: {agent.errors[-1]!r}"


@pytest.fixture
def scenario(control_plane: ControlPlane, namespace: str, node_agent: NodeAgentDouble,
             tmp_path: Path) -> Iterator[Scenario]:
    bind_shared_claim(control_plane, namespace=namespace, claim=CHECKPOINT_CLAIM, host_path="/mnt/rldock")
    operator: ChartOperator | OperatorProcess
    if chart_available() is None and os.environ.get("RLDOCK_E2E_OPERATOR", "chart") == "chart":
        operator = ChartOperator(control_plane, namespace=namespace, agent=node_agent)
    else:
        kubeconfig = service_account_kubeconfig(control_plane, namespace, tmp_path / "kubeconfig")
        operator = OperatorProcess(namespaces=[namespace], kubeconfig=kubeconfig, log_dir=tmp_path)
    with control_plane.api_client() as api, KubeRayDouble(api, namespace=namespace, interval=0.5) as kuberay:
        operator.start()
        world = Scenario(plane=control_plane, namespace=namespace, agent=node_agent, kuberay=kuberay,
                         operator=operator, api=api)
        try:
            yield world
        finally:
            _save_state(world, tmp_path / "final-state.txt")
            _clean_up(world)
            delete_shared_claim(control_plane, namespace=namespace, claim=CHECKPOINT_CLAIM)
    assert not kuberay.errors, f"the KubeRay double failed: {kuberay.errors[-1]!r}"


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
            world.kubectl("patch", "rljob", job["metadata"]["name"], "--type=merge",
                          "-p", '{"metadata":{"finalizers":null}}', check=False)
    world.operator.stop()
    world.kubectl("delete", "rayclusters,pods", "--all", "--wait=false", check=False)
    wait_for("every pod's processes gone", lambda: not world.agent.pids(world.namespace) or not any(
        world.agent.pids(world.namespace).values()), timeout=60)
