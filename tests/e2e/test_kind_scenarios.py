"""Issue 4's happy path on the kind-style cluster (issue 17): real containers end to end.

The operator is installed as a Helm release (helm_release.py, Helm's own install action) and runs
in the operator image on a real kubelet; the KubeRay double (doubles/kuberay.py, the one piece
that cannot be built here) turns the RayCluster into KubeRay's head and worker pods, which the
real scheduler places and the real kubelets run in the CPU runtime image that images/build.sh
built, with the emulated Ascend devices of the device plugin. What stands in for the rest of a
cluster, and why (e2e/README.md, "Real nodes"):

- cluster DNS and Service routing: nodes/service_dns.py, on the node network's gateway, answers
  `<svc>.<ns>.svc.cluster.local` with the ready pod behind the Service (from the real Endpoints);
- storage: the checkpoint claim is bound to a hostPath volume under the folder every node mounts
  (nodes.cluster.SHARED_STORAGE_PATH), as doubles/storage.py binds it for the node agent;
- the pods' sizes: a kind-style node has the machine's 2 CPUs, so the example's cluster sizes
  (4 and 16 CPUs) are cut to what fits (`_fitted_example`), and one data-parallel rank (one vLLM
  engine) as in the other scenarios.

The lost-worker, operator-restart and suspend scenarios of tests/e2e/test_scenarios.py run here
too, sharing job starts as there: a worker pod deleted (what a node loss or an eviction does to
it) is retried by the operator from the last checkpoint; on another job, the operator's process is
SIGKILLed through its node's containerd and restarted by its kubelet, then the job is suspended
and resumed from the checkpoint. Where the node-agent version checks local processes, these check
the pods' containers in the nodes' containerd (nodes/containers.py).

Opt-in with the other container tests (the `kind_cluster` fixture skips with the reason).
"""

from __future__ import annotations

import statistics
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rldock_e2e.doubles.kuberay import KubeRayDouble
from rldock_e2e.doubles.storage import bind_shared_claim, delete_shared_claim
from rldock_e2e.helm_release import (
    HelmRelease,
    ReleasedOperator,
)
from rldock_e2e.nodes.cluster import SHARED_STORAGE_PATH, KindNodes
from rldock_e2e.nodes.containers import container_ids, container_processes, running_containers
from rldock_e2e.nodes.service_dns import ServiceDNS
from rldock_e2e.operator_process import chart_available
from rldock_e2e.repo import REPO_ROOT
from rldock_e2e.scenario import JobHold, Scenario, assert_resumed, checkpoint_iteration, sample

pytestmark = pytest.mark.e2e

EXAMPLE = REPO_ROOT / "examples" / "rljob-tiny.yaml"
NAME = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
CPU_EXAMPLE = REPO_ROOT / "examples" / "rljob-cpu.yaml"  # the quick start's: no device requested
CHECKPOINT_CLAIM = "rl-checkpoints"  # what the examples mount
# Pods in the 3.7 GB runtime image, `ray start`, the model build and a vLLM engine on two shared cores.
RUNTIME_UID = 10001  # images/runtime-cpu.Dockerfile's user, and the operator's runAsUser/runAsGroup
SECCOMP_FILTER = "2"  # /proc/<pid>/status Seccomp: 0 none, 1 strict, 2 filter
START_TIMEOUT = 1200
RUN_TIMEOUT = 1200


def _fitted_example(
    devices: int,
    *,
    example: Path = EXAMPLE,
    name: str | None = None,
    iterations: int | None = None,
    checkpoint_interval: int | None = None,
) -> dict:
    """An example RLJob (examples/rljob-tiny.yaml unless `example`) with pods that fit the 2-CPU
    kind-style nodes: head and worker 1500m each, so never on one node, either beside the
    operator's 100m (the operator gives the head's Ray floor(1.5) = 1 CPU, KubeRay the worker's
    ceil(1.5) = 2, what one actor and one reference rank take); one data-parallel rank; `devices`
    NPUs for a job that asks for devices (the CPU example asks for none and keeps its own). The
    head gets that much because its CPU quota is real here: with 500m its raylet missed Ray's fixed
    30 s window to register with the GCS (`The current node timed out during startup`) on the
    loaded machine. `name`, `iterations` and `checkpoint_interval`, when given, rename it and change
    its length."""
    manifest = yaml.safe_load(example.read_text())
    name = name or manifest["metadata"]["name"]
    manifest["metadata"]["name"] = name
    job = manifest["spec"]["job"]
    job["name"] = name
    job["iterations"] = iterations or job["iterations"]
    job["checkpoint"]["interval"] = checkpoint_interval or job["checkpoint"]["interval"]
    job["training"]["data_parallel_size"] = 1
    if job["resources"].get("device") != "cpu":
        job["resources"]["devices_per_node"] = devices
    manifest["spec"]["cluster"].update(head={"cpu": "1500m", "memory": "4Gi"}, worker={"cpu": "1500m", "memory": "8Gi"})
    return manifest


def _assert_restricted(nodes: KindNodes, pod: dict) -> None:
    """Every process of the pod's Ray container, as its node's kernel shows it (/proc/<pid>/status
    through the node's containerd), runs as the `restricted` profile the operator's pods ask for:
    uid and gid 10001 (not root), no capability in any set, no_new_privs (allowPrivilegeEscalation
    false), a seccomp filter (RuntimeDefault); and Ray runs there (the raylet, on the head the GCS)."""
    container = pod["spec"]["containers"][0]["name"]
    processes = container_processes(nodes, pod, container)
    where = f"pod {pod['metadata']['name']}, container {container}"
    for pid, status in processes.items():
        process = f"{where}, pid {pid} ({status.get('Name')})"
        assert set(status["Uid"].split()) == {str(RUNTIME_UID)}, (process, status["Uid"])
        assert set(status["Gid"].split()) == {str(RUNTIME_UID)}, (process, status["Gid"])
        for capabilities in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status[capabilities], 16) == 0, (process, capabilities, status[capabilities])
        assert status["NoNewPrivs"] == "1", (process, status["NoNewPrivs"])
        assert status["Seccomp"] == SECCOMP_FILTER, (process, status["Seccomp"])
    names = {status.get("Name") for status in processes.values()}
    ray = {"raylet", "gcs_server"} if pod["metadata"]["labels"]["ray.io/node-type"] == "head" else {"raylet"}
    assert ray <= names, (where, names)


def _iteration(row: dict[str, str]) -> int:
    done = row.get("ITERATION", "<none>")
    return int(done.split("/")[0]) if "/" in done else 0


@pytest.fixture(scope="module")
def kind_scenario(kind_cluster, runtime_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    reason = chart_available()
    if reason:
        pytest.skip(reason)
    plane, nodes, operator_image = kind_cluster
    plane.install_kuberay_crds()
    namespace = f"kind-{uuid.uuid4().hex[:6]}"
    plane.kubectl("create", "namespace", namespace)
    bind_shared_claim(
        plane, namespace=namespace, claim=CHECKPOINT_CLAIM, host_path=f"{SHARED_STORAGE_PATH}/{namespace}"
    )
    (nodes.storage_root / SHARED_STORAGE_PATH.lstrip("/") / namespace).mkdir(mode=0o777)
    (nodes.storage_root / SHARED_STORAGE_PATH.lstrip("/") / namespace).chmod(0o777)  # past the umask
    runtime_repository, runtime_tag = runtime_image.rsplit(":", 1)
    operator_repository, operator_tag = operator_image.rsplit(":", 1)
    values = {
        "image": {"repository": operator_repository, "tag": operator_tag, "pullPolicy": "Never"},
        "runtime": {"image": {"repository": runtime_repository, "tag": runtime_tag, "pullPolicy": "Never"}},
        "operator": {"watchNamespaces": [namespace], "pollInterval": 1},
        # One replica: the restart scenario SIGKILLs the operator and watches its kubelet restart
        # it (the chart's two replicas with a standby taking over: test_helm_release.py).
        "replicaCount": 1,
        # The admission webhook off: the API server runs on the host, outside the pod network,
        # with no kube-proxy to route the webhook Service's ClusterIP to a pod, so every RLJob
        # write would fail (failurePolicy Fail). The webhook itself is tested on the real control
        # plane (tests/integration); the operator still refuses a bad spec at its first round.
        "webhook": {"enabled": False},
    }
    release = HelmRelease(plane)  # helm/rldock as it is, as docs/install.md installs it
    operator = ReleasedOperator(plane, release, values, nodes=nodes)
    with (
        plane.api_client() as api,
        ServiceDNS(api, address=nodes.network.gateway) as dns,
        KubeRayDouble(api, namespace=namespace, interval=1.0) as kuberay,
    ):
        world = Scenario(
            plane=plane,
            namespace=namespace,
            agent=None,
            kuberay=kuberay,
            operator=operator,
            api=api,
            host_root=nodes.storage_root,
            doubles=[dns],
        )
        try:
            operator.start()
            yield world
        finally:
            (tmp_path_factory.mktemp("kind-final-state") / "report.txt").write_text(world.report())
            world.kubectl("delete", "rljobs", "--all", "--wait=true", "--timeout=120s", check=False)
            operator.stop()
            release.close()
            world.kubectl("delete", "rayclusters,pods", "--all", "--wait=false", check=False)
            plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
            delete_shared_claim(plane, namespace=namespace, claim=CHECKPOINT_CLAIM)
    assert not kuberay.errors, f"the KubeRay double failed: {kuberay.errors[-1]!r}"
    assert not dns.errors, f"the service DNS double failed: {dns.errors[-1]!r}"


@pytest.mark.parametrize("example", [pytest.param(EXAMPLE, id="rljob-tiny"), pytest.param(CPU_EXAMPLE, id="rljob-cpu")])
def test_happy_path_in_real_containers(
    kind_cluster, runtime_image: str, kind_scenario: Scenario, tmp_path: Path, example: Path
) -> None:
    """The example RLJobs (the emulated-NPU one, and the quick start's CPU-only one, whose pods ask
    for no device) to Succeeded; the tests of this module run one job at a time (2-CPU nodes)."""
    _, nodes, _ = kind_cluster
    scenario = kind_scenario
    fitted = _fitted_example(max(n.devices for n in nodes.nodes.values()), example=example)
    NAME = fitted["metadata"]["name"]  # noqa: N806 (each example's own name)
    manifest = tmp_path / example.name
    manifest.write_text(yaml.safe_dump(fitted))
    applied = scenario.kubectl("apply", "-f", str(manifest))
    assert f"rljob.rldock.io/{NAME} created" in applied.stdout
    scenario.wait_phase(NAME, "Running", timeout=START_TIMEOUT)

    # KubeRay's pods, placed by the scheduler on the kind-style nodes, in the runtime image.
    pods = scenario.ray_pods(NAME)
    assert {p["metadata"]["labels"]["ray.io/node-type"] for p in pods} == {"head", "worker"}, pods
    for pod in pods:
        assert pod["spec"]["nodeName"] in nodes.nodes and pod["status"]["phase"] == "Running", pod
        assert pod["spec"]["containers"][0]["image"] == runtime_image
        _assert_restricted(nodes, pod)
        if example == CPU_EXAMPLE:  # the real kubelet admitted it without any device
            assert set(pod["spec"]["containers"][0]["resources"]["limits"]) == {"cpu", "memory"}, pod["spec"]

    rows = sample(
        2.0, lambda: scenario.status(NAME).get("phase") != "Running", lambda: scenario.row(NAME), timeout=RUN_TIMEOUT
    )
    running = [r for r in rows if r["PHASE"] == "Running" and _iteration(r) > 0]
    iterations = [_iteration(r) for r in running]
    assert len(set(iterations)) >= 3, rows
    assert iterations == sorted(iterations), rows
    assert all(0 <= float(r["REWARD"]) <= 1 and float(r["TPS"]) > 0 for r in running), rows

    status = scenario.wait_phase(NAME, "Succeeded", timeout=60)
    final = scenario.row(NAME)
    assert final["PHASE"] == "Succeeded" and final["ITERATION"] == "40/40", final
    assert status["restartCount"] == 0 and status["completionTime"]

    # It learned (metrics.jsonl on the storage the nodes share, written by the worker's container).
    metrics = scenario.metrics(NAME)
    assert [m["iteration"] for m in metrics] == list(range(1, 41))
    first = statistics.mean(m["reward_mean"] for m in metrics[:5])
    last = statistics.mean(m["reward_mean"] for m in metrics[-5:])
    assert last - first >= 0.2, (first, last)

    scenario.wait(
        "the RayCluster released",
        lambda: "No resources found" in scenario.kubectl("get", "rayclusters").stderr,
        timeout=120,
    )
    scenario.wait("its pods gone", lambda: not scenario.ray_pods(NAME), timeout=180)
    reasons = {e["reason"] for e in scenario.events(NAME)}
    assert {"CreatedRayCluster", "SubmittedRayJob", "Succeeded", "ReleasedRayCluster"} <= reasons, reasons


def _apply(
    scenario: Scenario, nodes: KindNodes, name: str, *, iterations: int, checkpoint_interval: int, hold_before: int
) -> JobHold:
    """Apply the fitted example, held before iteration `hold_before` (runtime/driver/iteration_hold.py: the
    driver waits there until the test moves the hold or releases it), so an interruption lands at an
    iteration the test chose, however fast the job runs; the hold file is on the checkpoint volume."""
    manifest = _fitted_example(
        max(n.devices for n in nodes.nodes.values()),
        name=name,
        iterations=iterations,
        checkpoint_interval=checkpoint_interval,
    )
    hold = scenario.hold(name, claim=CHECKPOINT_CLAIM).before(hold_before)
    manifest["spec"]["env"] = hold.env
    scenario.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    return hold


def _wait_released(scenario: Scenario, name: str) -> None:
    """The finished job's pods gone, so that the next test's pods fit on the 2-CPU nodes."""
    scenario.wait("its pods gone", lambda: not scenario.pods_now(f"ray.io/cluster={name}"), timeout=180)


def test_operator_restart_keeps_the_one_cluster_and_suspend_resumes_from_the_checkpoint(
    kind_cluster, kind_scenario: Scenario
) -> None:
    """Two scenarios on one job (one job start), as on the node agent: the operator's process
    SIGKILLed mid-run is restarted by its kubelet and carries on with the same cluster and Ray job;
    then a suspend releases the cluster (its pods' containers gone from the nodes) and an unsuspend
    resumes from the last checkpoint."""
    _, nodes, _ = kind_cluster
    scenario = kind_scenario
    # Held where each step needs the job (runtime/driver/iteration_hold.py), not left to its speed: before
    # iteration 3 while the operator is killed and restarted, then before 9 (past the checkpoint of
    # 8) until the suspend; unheld, 60 iterations finished before the suspend landed on a quiet
    # machine (`assert 60 < 60`).
    name, iterations = "restart", 16
    hold = _apply(scenario, nodes, name, iterations=iterations, checkpoint_interval=4, hold_before=3)
    scenario.wait(
        f"RLJob {name} held after iteration 2",
        lambda: scenario.status(name).get("iteration", 0) == 2,
        timeout=START_TIMEOUT,
    )
    cluster = scenario.get("raycluster", name)
    killed = scenario.operator.kill()
    scenario.operator.start()  # waits for the kubelet's restart of the container and its readiness
    # `kubectl get pods` shows the restart of the killed container.
    (container,) = scenario.operator.pod()["status"]["containerStatuses"]
    assert container["restartCount"] == 1 and container["containerID"] != f"containerd://{killed}", container
    assert container["lastState"]["terminated"]["exitCode"] == 137, container  # 128 + SIGKILL
    # Progress the restarted operator itself reads from the Ray job (the first one's last report is older).
    restarted_at = scenario.status(name)["iteration"]
    hold.before(9)  # the job runs on
    scenario.wait(
        "the restarted operator reporting progress",
        lambda: scenario.status(name).get("iteration", 0) > restarted_at,
        timeout=300,
    )
    assert scenario.get("raycluster", name)["metadata"]["uid"] == cluster["metadata"]["uid"]
    counts = {
        reason: sum(e.get("count", 1) for e in scenario.events(name) if e["reason"] == reason)
        for reason in ("CreatedRayCluster", "SubmittedRayJob")
    }
    assert counts == {"CreatedRayCluster": 1, "SubmittedRayJob": 1}, counts

    # Suspend, the job held after the checkpoint of 8: the cluster is released (suspended, no pods,
    # their containers gone), the progress kept.
    scenario.wait(
        "the job held after the checkpoint of iteration 8",
        lambda: (s := scenario.status(name)).get("iteration") == 8 and checkpoint_iteration(s) == 8,
        timeout=RUN_TIMEOUT,
    )
    containers = {cid for pod in scenario.ray_pods(name) for cid in container_ids(pod).values()}
    assert containers and containers <= running_containers(nodes), containers
    scenario.kubectl("patch", "rljob", name, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    status = scenario.wait_phase(name, "Suspended", timeout=120)
    assert scenario.row(name)["PHASE"] == "Suspended"
    scenario.wait(
        "the cluster released: suspended, no pods, their containers gone from the nodes",
        lambda: (
            scenario.get("raycluster", name)["spec"]["suspend"] is True
            and not scenario.ray_pods(name)
            and not containers & running_containers(nodes)
        ),
        timeout=180,
    )
    before = scenario.metrics(name)
    checkpoint = checkpoint_iteration(scenario.status(name))
    assert status["iteration"] == checkpoint == len(before) == 8, (status["iteration"], checkpoint, len(before))

    hold.release()  # the resumed job runs to the end
    scenario.kubectl("patch", "rljob", name, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    scenario.wait_phase(name, ("Provisioning", "Running", "Succeeded"), timeout=120)
    status = scenario.wait_phase(name, "Succeeded", timeout=START_TIMEOUT + RUN_TIMEOUT)
    assert status["restartCount"] == 0 and scenario.row(name)["ITERATION"] == f"{iterations}/{iterations}"
    assert_resumed(scenario.metrics(name), before, checkpoint=checkpoint, iterations=iterations)
    reasons = {e["reason"] for e in scenario.events(name)}
    assert {"Suspended", "Resumed"} <= reasons, reasons
    _wait_released(scenario, name)


def test_lost_worker_pod_is_retried_from_the_checkpoint(
    kind_cluster, runtime_image: str, kind_scenario: Scenario
) -> None:
    """The worker pod deleted mid-run, as a drain or an eviction deletes it: its preStop hook asks the driver to
    stop and keeps its Ray node up, so the iteration under way finishes and is saved; then the operator counts a
    retry, KubeRay's replacement pod joins, and the next attempt resumes right after the saved iteration."""
    _, nodes, _ = kind_cluster
    scenario = kind_scenario
    # Held before iteration 5, past the checkpoint of 4: the deletion lands while the job runs, however fast.
    name, iterations = "lost-worker", 12
    hold = _apply(scenario, nodes, name, iterations=iterations, checkpoint_interval=4, hold_before=5)
    status = scenario.wait(
        "the job held after the checkpoint of iteration 4",
        lambda: (s := scenario.status(name)) and checkpoint_iteration(s) == 4 and s.get("phase") == "Running" and s,
        timeout=START_TIMEOUT,
    )
    (worker,) = scenario.pods_now(f"ray.io/cluster={name},ray.io/node-type=worker")
    lost = worker["metadata"]["name"]
    containers = set(container_ids(worker).values())
    assert containers and containers <= running_containers(nodes), containers
    scenario.kubectl("delete", "pod", lost, "--wait=false")
    checkpoint = checkpoint_iteration(scenario.status(name))
    before = scenario.metrics(name)
    assert checkpoint == checkpoint_iteration(status) == 4 and len(before) == 4, (checkpoint, len(before))
    hold.release()  # iteration 5 finishes on the worker its hook keeps up, and is saved
    scenario.wait(
        "the stopped driver's checkpoint of iteration 5",
        lambda: checkpoint_iteration(scenario.status(name)) == 5,
        timeout=RUN_TIMEOUT,
    )
    checkpoint, before = 5, scenario.metrics(name)
    retrying = scenario.wait(
        "the retry",
        lambda: scenario.status(name).get("restartCount") == 1 and scenario.condition(name, "Retrying"),
        timeout=180,
    )
    assert retrying["reason"] in ("WorkerPodLost", "RayJobFailed"), retrying  # whichever the operator saw first
    scenario.wait(
        "the lost pod's containers gone from its node", lambda: not containers & running_containers(nodes), timeout=180
    )
    # The next attempt runs on KubeRay's replacement, in the runtime image on a kind-style node.
    replacement = scenario.wait(
        "a replacement worker pod running",
        lambda: next(
            (
                p
                for p in scenario.pods_now(f"ray.io/cluster={name},ray.io/node-type=worker")
                if p["metadata"]["name"] != lost and p["status"].get("phase") == "Running"
            ),
            None,
        ),
        timeout=START_TIMEOUT,
    )
    assert replacement["spec"]["nodeName"] in nodes.nodes, replacement["spec"]
    assert replacement["spec"]["containers"][0]["image"] == runtime_image
    status = scenario.wait_phase(name, "Succeeded", timeout=START_TIMEOUT + RUN_TIMEOUT)
    assert scenario.row(name)["ITERATION"] == f"{iterations}/{iterations}" and status["restartCount"] == 1
    assert any(e["reason"] == "Retrying" for e in scenario.events(name))
    assert_resumed(scenario.metrics(name), before, checkpoint=checkpoint, iterations=iterations)
    _wait_released(scenario, name)
