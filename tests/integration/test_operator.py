"""The operator against a real kube-apiserver (e2e/controlplane): KubeRay's real RayCluster CRD and
our generated RLJob CRD installed, the operator as its own process (`python -m rldock.operator`)
running as a non-admin user with exactly the RBAC that builders/rbac.py generates, and three test
doubles for what this control plane lacks: KubeRay (e2e/src/rldock_e2e/doubles/kuberay.py), the kubelets
(e2e/src/rldock_e2e/doubles/kubelet.py) and the Ray heads' Jobs API (e2e/src/rldock_e2e/doubles/ray_jobs.py). The real
scheduler places the pods on emulated Ascend nodes; the real garbage collector removes children.

The full user scenarios with the real runtime are the e2e suite's (issue 4); these pin the
operator's decisions: status, retries, scheduling messages, deletion, restart, suspend.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from rldock.contract.failure import FailureReason, FieldProblem, JobFailure, format_failure
from rldock.contract.progress import format_progress
from rldock.operator import naming
from rldock.operator.builders.rbac import build_rbac
from rldock_e2e.controlplane import DEVELOPER_USER, ControlPlane, wait_for
from rldock_e2e.controlplane.processes import free_ports
from rldock_e2e.doubles.kubelet import KubeletDouble
from rldock_e2e.doubles.kuberay import KubeRayDouble
from rldock_e2e.doubles.ray_jobs import FakeJob, RayJobsDouble
from rldock_e2e.doubles.storage import bind_shared_claim, delete_shared_claim
from rldock_e2e.operator_process import OperatorProcess
from rldock_e2e.pod_security import restricted_violations

pytestmark = [
    pytest.mark.integration,
    # the test control plane serves a self-signed certificate (insecure-skip-tls-verify)
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

DEVICE = "huawei.com/Ascend910"
NODE_DEVICES = 4
POLL = 1.0  # the operator's poll interval here (production: 5 s)
TIMEOUT = 60.0
# The admin policy of the operator under test: the chart's default, the secure one (no hostPath).
POLICY: dict[str, Any] = {}
CHECKPOINT_CLAIM = "rl-checkpoints"  # bound by the `world` fixture


def rljob(name: str, **spec: Any) -> dict[str, Any]:
    """A small valid RLJob: 1 node x 2 devices, 4 iterations; keyword arguments replace spec keys."""
    job = {
        "name": name,
        "iterations": 4,
        "model": {"path": "/models/tiny", "builder": "tiny-qwen2"},
        "algorithm": {
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "learning_rate": 3e-4,
        },
        "training": {"data_parallel_size": 2},
        "resources": {"num_nodes": 1, "devices_per_node": 2},
        "checkpoint": {"interval": 2},
    }
    body = {
        "job": job,
        "checkpoint": {"claimName": CHECKPOINT_CLAIM},
        "cluster": {"head": {"cpu": 1, "memory": "1Gi"}, "worker": {"cpu": 1, "memory": "1Gi"}},
        "backoffLimit": 2,
        **spec,
    }
    return {"apiVersion": "rldock.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": body}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:5]}"


class World:
    """The namespace under test and what acts in it, with the reads the tests make."""

    def __init__(
        self,
        plane: ControlPlane,
        namespace: str,
        operator: OperatorProcess,
        jobs: RayJobsDouble,
        kubelet: KubeletDouble,
    ) -> None:
        self.plane, self.namespace, self.operator = plane, namespace, operator
        self.jobs, self.kubelet = jobs, kubelet
        self.api = plane.api_client()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def apply(self, manifest: dict[str, Any], *, check: bool = True):
        return self.plane.kubectl("apply", "-n", self.namespace, "-f", "-", input=yaml.safe_dump(manifest), check=check)

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.plane.kubectl(
            "patch", "rljob", name, "-n", self.namespace, "--type=merge", "-p", json.dumps({"spec": spec})
        )

    def get(self, plural: str, name: str) -> dict[str, Any] | None:
        group, version = {"rljobs": ("rldock.io", "v1alpha1"), "rayclusters": ("ray.io", "v1")}[plural]
        try:
            return self.custom.get_namespaced_custom_object(group, version, self.namespace, plural, name)
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def core_object(self, kind: str, name: str) -> dict[str, Any] | None:
        read = {"ConfigMap": self.core.read_namespaced_config_map, "Secret": self.core.read_namespaced_secret}[kind]
        try:
            return json.loads(read(name, self.namespace, _preload_content=False).data)
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def pods(self, cluster: str) -> list[dict[str, Any]]:
        return json.loads(
            self.core.list_namespaced_pod(
                self.namespace, label_selector=f"ray.io/cluster={cluster}", _preload_content=False
            ).data
        )["items"]

    def events(self, name: str) -> list[dict[str, Any]]:
        return json.loads(
            self.core.list_namespaced_event(
                self.namespace, field_selector=f"involvedObject.name={name}", _preload_content=False
            ).data
        )["items"]

    def wait(self, what: str, probe: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
        return wait_for(what, probe, timeout=timeout, interval=0.25, check=self.operator.check)

    def wait_status(
        self, name: str, what: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = TIMEOUT
    ) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            obj = self.get("rljobs", name)
            return obj if obj is not None and predicate(obj.get("status") or {}) else None

        try:
            return self.wait(f"RLJob {name}: {what}", probe, timeout)
        except TimeoutError:
            obj = self.get("rljobs", name)
            raise AssertionError(
                f"RLJob {name}: no {what}; status now:\n"
                f"{json.dumps((obj or {}).get('status'), indent=1)}\noperator log:\n"
                f"{_tail(self.operator.log_path)}"
            ) from None

    def submission_id(self, name: str, attempt: int) -> str:
        return naming.ray_job_submission_id(name, self.get("rljobs", name)["metadata"]["uid"], attempt=attempt)

    def running(self, name: str, attempt: int = 0) -> tuple[dict[str, Any], FakeJob]:
        """Wait until attempt `attempt` runs and the RLJob says Running; its Ray job (fake)."""
        obj = self.wait_status(
            name, "phase Running", lambda s: s.get("phase") == "Running" and s.get("restartCount", 0) == attempt
        )
        return obj, self.jobs.find(self.submission_id(name, attempt))

    def progress(self, submission_id: str, iteration: int, *, checkpoint: int | None = None, **figures: Any) -> None:
        """The runtime's progress line for `iteration`; `figures`: more keys on it (`mismatch_kl`)."""
        self.jobs.print_line(submission_id, f"(TrainerDriver) iteration {iteration} done")
        self.jobs.print_line(
            submission_id,
            format_progress(
                {
                    "iteration": iteration,
                    "iterations": 4,
                    "reward_mean": 0.1 * iteration,
                    "kl": 0.01,
                    "loss": 0.5,
                    "response_length_mean": 5.0,
                    "tokens_per_s_per_device": 100.0 + iteration,
                    "checkpoint": checkpoint,
                    **figures,
                }
            ),
        )


def _selects(selector: dict[str, Any], obj: dict[str, Any]) -> bool:
    """Whether a LabelSelector (matchLabels only, as the operator writes them) selects `obj`."""
    labels = obj["metadata"].get("labels") or {}
    return set(selector) <= {"matchLabels"} and selector["matchLabels"].items() <= labels.items()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


@pytest.fixture(scope="module")
def plane(control_plane: ControlPlane, kuberay_crds: list[str], rljob_crd: list[str]) -> Iterator[ControlPlane]:
    """The session's control plane (tests/conftest.py) with this module's two emulated nodes."""
    nodes = [unique("npu") for _ in range(2)]
    for node in nodes:
        control_plane.create_node(node, devices=NODE_DEVICES)
    yield control_plane
    # Nodes are cluster-scoped: later tests must not see them.
    control_plane.kubectl("delete", "nodes", *nodes, "--wait=false", check=False)


@pytest.fixture(scope="module")
def world(plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    namespace = unique("op")
    plane.create_namespace(namespace)
    bind_shared_claim(plane, namespace=namespace, claim=CHECKPOINT_CLAIM, host_path="/mnt/rl")
    # Least privilege, checked: the operator runs as a user that has only the generated Role.
    for manifest in build_rbac(
        name="rldock-operator",
        namespaces=[namespace],
        subject={"kind": "User", "name": DEVELOPER_USER, "apiGroup": "rbac.authorization.k8s.io"},
    ):
        plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    work = tmp_path_factory.mktemp("operator")
    kubeconfig = yaml.safe_load(plane.kubeconfig.read_text())
    kubeconfig["current-context"] = DEVELOPER_USER
    (work / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    # A short Jobs API timeout: the Jobs API here is a local double that answers at once.
    operator = OperatorProcess(
        namespaces=[namespace],
        kubeconfig=work / "kubeconfig",
        log_dir=work,
        poll_interval=POLL,
        ray_timeout=2.0,
        env={**plane.env, "RLDOCK_POLICY": json.dumps(POLICY)},
    )
    (dashboard_port,) = free_ports(1)
    jobs = RayJobsDouble(port=dashboard_port, start_delay=0.3)
    api = plane.api_client()
    kubelet = KubeletDouble(api, namespace=namespace, on_start=jobs.on_start, on_stop=jobs.on_stop)
    with kubelet, KubeRayDouble(api, namespace=namespace, dashboard_port=dashboard_port):
        operator.start()
        try:
            yield World(plane, namespace, operator, jobs, kubelet)
        finally:
            operator.stop()
            jobs.close()
            plane.kubectl("delete", "rljobs", "--all", "-n", namespace, "--wait=false", check=False)
            delete_shared_claim(plane, namespace=namespace, claim=CHECKPOINT_CLAIM)


def test_rljob_runs_to_success_with_live_status(world: World):
    name = unique("happy")
    world.apply(rljob(name, ttlSecondsAfterFinished=3))
    uid = world.wait("the RLJob", lambda: world.get("rljobs", name))["metadata"]["uid"]

    cluster = world.wait("the RayCluster", lambda: world.get("rayclusters", name))
    # Every pod template, as the API server stored it (defaults applied), passes `restricted`.
    for template in [
        cluster["spec"]["headGroupSpec"]["template"],
        *(group["template"] for group in cluster["spec"]["workerGroupSpecs"]),
    ]:
        assert restricted_violations(template["spec"], template["metadata"].get("annotations")) == []
    config_map = world.wait("the ConfigMap", lambda: world.core_object("ConfigMap", naming.config_map_name(name)))
    secret = world.core_object("Secret", naming.auth_secret_name(name, uid))
    for child in (cluster, config_map, secret):
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("RLJob", uid, True)
    assert "iterations: 4" in config_map["data"]["job.yaml"]

    obj, job = world.running(name)
    # The job's NetworkPolicy exists and selects every pod of its cluster (head and worker).
    policy = json.loads(
        client.NetworkingV1Api(world.api)
        .read_namespaced_network_policy(naming.network_policy_name(name), world.namespace, _preload_content=False)
        .data
    )
    assert policy["metadata"]["ownerReferences"][0]["uid"] == uid
    pods = world.pods(name)
    assert len(pods) == 2 and all(_selects(policy["spec"]["podSelector"], pod) for pod in pods)
    own_pods = policy["spec"]["ingress"][0]["from"][0]["podSelector"]
    assert all(_selects(own_pods, pod) for pod in pods)
    # The head's Jobs API took the submission only with the RLJob's own token (token auth).
    assert world.jobs.head_of(name).token and world.jobs.head_of(name).unauthorized == 0
    assert "--resume" in job.entrypoint and job.submission_id == world.submission_id(name, 0)
    assert obj["status"]["rayJobId"] == job.submission_id and obj["status"]["progress"] == "0/4"

    for iteration in (1, 2, 3):
        printed = time.monotonic()
        world.progress(job.submission_id, iteration, checkpoint=2 if iteration >= 2 else None)
        world.wait_status(name, f"iteration {iteration}", lambda s, i=iteration: s.get("iteration") == i)
        assert time.monotonic() - printed < 10, "status lags the runtime by more than 10 s"
    status = world.get("rljobs", name)["status"]
    assert status["progress"] == "3/4" and status["reward"] == pytest.approx(0.3)
    assert status["tokensPerSecondPerDevice"] == pytest.approx(103.0)
    uid = world.get("rljobs", name)["metadata"]["uid"]  # the run's directory is this object's own
    assert status["lastCheckpoint"] == f"/checkpoints/{world.namespace}/{name}/{uid}/checkpoints/iter-000002"
    table = world.plane.kubectl("get", "rlj", name, "-n", world.namespace).stdout
    assert "Running" in table and "3/4" in table and "103" in table, table

    world.progress(job.submission_id, 4, checkpoint=4)
    world.jobs.finish(job.submission_id, "SUCCEEDED")
    status = world.wait_status(name, "phase Succeeded", lambda s: s.get("phase") == "Succeeded")["status"]
    assert status["progress"] == "4/4" and status["completionTime"]
    world.wait("the RayCluster released after success", lambda: world.get("rayclusters", name) is None)
    expected = {"CreatedRayCluster", "SubmittedRayJob", "Succeeded", "ReleasedRayCluster"}
    # A round posts its Events after it writes the status and deletes the cluster: wait for them.
    world.wait("the round's Events", lambda: expected <= {e["reason"] for e in world.events(name)})
    world.wait("ttlSecondsAfterFinished to delete the RLJob", lambda: world.get("rljobs", name) is None)


def test_invalid_spec_fails_with_the_field_named_and_creates_nothing(world: World):
    name = unique("invalid")
    manifest = rljob(name)
    manifest["spec"]["job"]["training"]["data_parallel_size"] = 3  # G*N = 8 is not divisible by 3
    world.apply(manifest)
    status = world.wait_status(name, "phase Failed", lambda s: s.get("phase") == "Failed")["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidSpec" and "spec.job.training.data_parallel_size" in failed["message"]
    event = world.wait(
        "the InvalidSpec event", lambda: next((e for e in world.events(name) if e["reason"] == "InvalidSpec"), None)
    )
    assert event["type"] == "Warning" and "spec.job.training.data_parallel_size" in event["message"]
    time.sleep(2 * POLL)  # a few more rounds: still nothing created, status unchanged
    assert world.get("rayclusters", name) is None
    assert world.core_object("ConfigMap", naming.config_map_name(name)) is None
    assert world.get("rljobs", name)["status"] == status

    # Fixing the spec undoes the failure: the job goes on to provision its cluster.
    world.patch_spec(name, {"job": {**manifest["spec"]["job"], "training": {"data_parallel_size": 2}}})
    world.wait_status(name, "the fixed spec accepted", lambda s: s.get("phase") in ("Provisioning", "Running"))
    world.wait("the RayCluster", lambda: world.get("rayclusters", name))


def test_schema_violations_are_refused_by_the_apiserver(world: World):
    name = unique("schema")
    bad = rljob(name, backoffLimit=-1)
    result = world.apply(bad, check=False)
    assert result.returncode != 0 and "spec.backoffLimit" in result.stderr, result.stderr
    bad = rljob(name)
    bad["spec"]["job"]["iterations"] = "many"
    result = world.apply(bad, check=False)
    assert result.returncode != 0 and "spec.job.iterations" in result.stderr, result.stderr
    assert world.get("rljobs", name) is None


def test_failed_ray_job_is_retried_from_the_checkpoint_then_fails_at_the_backoff_limit(world: World):
    name = unique("retry")
    world.apply(rljob(name, backoffLimit=1))
    _, first = world.running(name)
    world.progress(first.submission_id, 2, checkpoint=2)
    world.jobs.finish(first.submission_id, "FAILED", "driver exited with 1")
    status = world.wait_status(name, "restartCount 1", lambda s: s.get("restartCount") == 1)["status"]
    assert status["phase"] in ("Retrying", "Running")
    _, second = world.running(name, attempt=1)
    assert second.submission_id.endswith("-1") and "--resume" in second.entrypoint
    assert world.get("rljobs", name)["status"]["iteration"] == 2  # kept until the new attempt reports
    assert any(e["reason"] == "Retrying" for e in world.events(name))

    world.jobs.finish(second.submission_id, "FAILED", "driver exited with 1 again")
    status = world.wait_status(name, "phase Failed", lambda s: s.get("phase") == "Failed")["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and status["restartCount"] == 1
    world.wait("the RayCluster released after failure", lambda: world.get("rayclusters", name) is None)


def test_a_mismatch_budget_is_a_condition_with_an_event_and_its_stop_fails_the_job_unretried(world: World):
    """spec.job.monitoring.mismatch (docs/algorithms/rollout-correction.md#a-budget-on-the-gap): the progress
    line's mismatch_kl against max_kl, then the runtime's failure line when the budget's action stopped it."""
    name = unique("mismatch")
    manifest = rljob(name)
    manifest["spec"]["job"]["monitoring"] = {"mismatch": {"max_kl": 0.01, "action": "stop"}}
    world.apply(manifest)
    _, job = world.running(name)

    def mismatch(status: dict[str, Any]) -> dict[str, Any] | None:
        return next((c for c in status.get("conditions", []) if c["type"] == "RolloutMismatch"), None)

    world.progress(job.submission_id, 1, mismatch_kl=0.002)
    status = world.wait_status(name, "the mismatch within budget", lambda s: s.get("rolloutMismatchKl") == 0.002)
    assert (mismatch(status["status"]) or {}).get("reason") == "WithinBudget"
    world.progress(job.submission_id, 2, checkpoint=2, mismatch_kl=0.05)
    status = world.wait_status(name, "the mismatch over budget", lambda s: (mismatch(s) or {}).get("status") == "True")
    condition = mismatch(status["status"])
    assert condition is not None and condition["reason"] == "OverBudget"
    assert "iteration 2: mismatch/kl 0.05 is over spec.job.monitoring.mismatch.max_kl 0.01" in condition["message"]
    event = world.wait(
        "the RolloutMismatch Event",
        lambda: next((e for e in world.events(name) if e["reason"] == "RolloutMismatch"), None),
    )
    assert event["type"] == "Warning" and event["message"] == condition["message"]

    # action stop: the runtime checkpointed iteration 2 and printed its failure line, then exited 1
    failure = JobFailure(
        FailureReason.ROLLOUT_MISMATCH, (FieldProblem("monitoring.mismatch.max_kl", "iteration 2: mismatch/kl 0.05"),)
    )
    world.jobs.print_line(job.submission_id, format_failure(failure))
    world.jobs.finish(job.submission_id, "FAILED", "driver exited with 1")
    status = world.wait_status(name, "phase Failed", lambda s: s.get("phase") == "Failed")["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "RolloutMismatch" and status["restartCount"] == 0  # not retried
    assert "spec.job.monitoring.mismatch.max_kl: iteration 2" in failed["message"]
    world.wait("the RayCluster released after failure", lambda: world.get("rayclusters", name) is None)


def test_lost_worker_pod_restarts_the_attempt(world: World):
    name = unique("lost")
    world.apply(rljob(name))
    _, first = world.running(name)
    (worker,) = [p for p in world.pods(name) if p["metadata"]["labels"]["ray.io/node-type"] == "worker"]
    # Gone at once (grace period 0, as a node's death ends in): a pod deleted gracefully is a drain
    # instead, recorded Preempted with no restart counted, if a round sees it terminating.
    world.core.delete_namespaced_pod(worker["metadata"]["name"], world.namespace, grace_period_seconds=0)
    status = world.wait_status(name, "restartCount 1", lambda s: s.get("restartCount") == 1)["status"]
    retrying = next(c for c in status["conditions"] if c["type"] == "Retrying")
    assert retrying["reason"] == "WorkerPodLost", retrying
    _, second = world.running(name, attempt=1)
    assert first.status == "STOPPED" and first.stop_requests >= 1  # never two drivers at once
    assert second.status == "RUNNING"


def test_unschedulable_pods_show_the_schedulers_message(world: World):
    name = unique("big")
    manifest = rljob(name)
    manifest["spec"]["job"]["resources"]["devices_per_node"] = 2 * NODE_DEVICES  # more than any node has
    world.apply(manifest)
    status = world.wait_status(
        name,
        "a PodsScheduled=False condition",
        lambda s: any(c["type"] == "PodsScheduled" and c["status"] == "False" for c in s.get("conditions") or ()),
    )["status"]
    condition = next(c for c in status["conditions"] if c["type"] == "PodsScheduled")
    assert condition["reason"] == "Unschedulable"
    assert f"Insufficient {DEVICE}" in condition["message"], condition["message"]  # the scheduler's words
    assert status["phase"] == "Provisioning"
    assert any(e["reason"] == "Unschedulable" for e in world.events(name))

    # A node big enough arrives: the scheduler places the worker and the job starts.
    big_node = unique("npu-big")
    world.plane.create_node(big_node, devices=2 * NODE_DEVICES)
    try:
        world.running(name)
        status = world.get("rljobs", name)["status"]
        assert next(c for c in status["conditions"] if c["type"] == "PodsScheduled")["status"] == "True"
    finally:
        world.plane.kubectl("delete", "rljob", name, "-n", world.namespace, "--wait=false")
        world.plane.kubectl("delete", "node", big_node, "--wait=false", check=False)


def test_deletion_stops_the_job_and_the_children_are_collected(world: World):
    name = unique("delete")
    world.apply(rljob(name))
    _, job = world.running(name)
    rljob_obj = world.get("rljobs", name)
    assert "rldock.io/cleanup" in rljob_obj["metadata"]["finalizers"]
    world.plane.kubectl("delete", "rljob", name, "-n", world.namespace, "--wait=false")
    world.wait("the Ray job stopped", lambda: job.status == "STOPPED")
    world.wait("the RLJob gone", lambda: world.get("rljobs", name) is None)
    world.wait(
        "the children garbage-collected",
        lambda: (
            world.get("rayclusters", name) is None
            and not world.pods(name)
            and world.core_object("ConfigMap", naming.config_map_name(name)) is None
            and world.core_object("Secret", naming.auth_secret_name(name, rljob_obj["metadata"]["uid"])) is None
        ),
    )


def test_operator_restart_resumes_tracking_without_a_second_cluster(world: World):
    name = unique("restart")
    world.apply(rljob(name))
    _, job = world.running(name)
    cluster_uid = world.get("rayclusters", name)["metadata"]["uid"]
    world.operator.kill()
    world.progress(job.submission_id, 1)  # the runtime goes on while the operator is away
    world.operator.start()
    world.wait_status(name, "iteration 1 read by the new operator", lambda s: s.get("iteration") == 1)
    time.sleep(2 * POLL)
    clusters = world.custom.list_namespaced_custom_object(
        "ray.io", "v1", world.namespace, "rayclusters", label_selector=f"rldock.io/rljob={name}"
    )["items"]
    assert [c["metadata"]["uid"] for c in clusters] == [cluster_uid]
    assert list(world.jobs.head_of(name).jobs) == [job.submission_id]  # found, not resubmitted
    assert world.get("rljobs", name)["status"]["restartCount"] == 0
    world.plane.kubectl("delete", "rljob", name, "-n", world.namespace, "--wait=false")


def test_suspend_releases_the_cluster_and_unsuspend_resumes(world: World):
    name = unique("suspend")
    world.apply(rljob(name))
    _, job = world.running(name)
    world.progress(job.submission_id, 2, checkpoint=2)
    world.patch_spec(name, {"suspend": True})
    status = world.wait_status(name, "phase Suspended", lambda s: s.get("phase") == "Suspended")["status"]
    world.wait(
        "the RayCluster suspended and its pods gone",
        lambda: world.get("rayclusters", name)["spec"]["suspend"] is True and not world.pods(name),
    )
    # Not stopped through the Jobs API, whose stop kills the driver 3 s after its SIGTERM: the pods' preStop
    # hooks stop it after its iteration's checkpoint (the e2e suite runs them).
    assert job.stop_requests == 0 and "StoppedRayJob" not in {e["reason"] for e in world.events(name)}
    assert status["iteration"] == 2 and status["restartCount"] == 0

    world.patch_spec(name, {"suspend": False})
    _, resumed = world.running(name)  # the same attempt, on a new head, resuming from the checkpoint
    assert resumed is not job and "--resume" in resumed.entrypoint
    status = world.get("rljobs", name)["status"]
    suspended = next(c for c in status["conditions"] if c["type"] == "Suspended")
    assert (suspended["status"], suspended["reason"]) == ("False", "Resumed")
    reasons = {e["reason"] for e in world.events(name)}
    assert {"Suspended", "Resumed"} <= reasons, reasons
    world.plane.kubectl("delete", "rljob", name, "-n", world.namespace, "--wait=false")


def test_a_host_path_outside_the_policy_is_refused_then_allowed_by_the_admin(world: World):
    """Whoever may create an RLJob must not mount a node's root: refused by default, naming the
    field and the policy value, with nothing created; allowed once the admin allows the prefix."""
    name = unique("root")
    world.apply(
        rljob(
            name,
            volumes=[{"name": "root", "hostPath": {"path": "/"}}],
            volumeMounts=[{"name": "root", "mountPath": "/host"}],
        )
    )
    status = world.wait_status(name, "phase Failed", lambda s: s.get("phase") == "Failed")["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PolicyDenied", failed
    assert "spec.volumes[0].hostPath.path" in failed["message"] and "policy.hostPathPrefixes" in failed["message"]
    event = world.wait(
        "the PolicyDenied event", lambda: next((e for e in world.events(name) if e["reason"] == "PolicyDenied"), None)
    )
    assert event["type"] == "Warning"
    time.sleep(2 * POLL)
    assert world.get("rayclusters", name) is None
    assert world.core_object("ConfigMap", naming.config_map_name(name)) is None

    # The admin allows every path (helm upgrade --set policy.hostPathPrefixes={/}): the operator
    # restarts with the new policy and the same RLJob goes ahead.
    world.operator.stop()
    world.operator.env["RLDOCK_POLICY"] = json.dumps({"hostPathPrefixes": ["/"]})
    try:
        world.operator.start()
        world.wait_status(name, "the spec allowed", lambda s: s.get("phase") in ("Provisioning", "Running"))
        cluster = world.wait("the RayCluster", lambda: world.get("rayclusters", name))
        volumes = cluster["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
        assert {"name": "root", "hostPath": {"path": "/"}} in volumes
    finally:
        world.plane.kubectl("delete", "rljob", name, "-n", world.namespace, "--wait=false")
        world.operator.stop()
        world.operator.env["RLDOCK_POLICY"] = json.dumps(POLICY)
        world.operator.start()


def test_the_operator_cannot_read_secrets_and_still_reaches_the_jobs_api(world: World):
    """Least privilege: the operator's identity has exactly the generated role, which may create
    Secrets and not read them; the jobs above ran with tokens it derived, never read back."""
    for verb in ("get", "list", "watch"):
        answer = world.plane.kubectl(
            "auth", "can-i", verb, "secrets", "-n", world.namespace, "--as", DEVELOPER_USER, check=False
        )
        assert answer.stdout.strip() == "no", (verb, answer.stdout, answer.stderr)
    assert (
        world.plane.kubectl(
            "auth", "can-i", "create", "secrets", "-n", world.namespace, "--as", DEVELOPER_USER
        ).stdout.strip()
        == "yes"
    )
    name = unique("token")
    world.apply(rljob(name))
    _, job = world.running(name)  # submitted with the derived token: the head refuses any other
    head = world.jobs.head_of(name)
    assert head.token and head.unauthorized == 0
    world.plane.kubectl("delete", "rljob", name, "-n", world.namespace, "--wait=false")


def test_a_suspend_by_kueue_or_an_admin_costs_no_restart_and_is_not_undone(world: World):
    name = unique("preempt")
    world.apply(rljob(name, backoffLimit=1))
    _, job = world.running(name)
    world.progress(job.submission_id, 2, checkpoint=2)
    # What Kueue does when it preempts the job's workload (or an admin does by hand).
    world.plane.kubectl(
        "patch",
        "raycluster",
        name,
        "-n",
        world.namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"suspend": True}}),
    )
    status = world.wait_status(name, "phase Suspended", lambda s: s.get("phase") == "Suspended")["status"]
    suspended = next(c for c in status["conditions"] if c["type"] == "Suspended")
    assert suspended["reason"] == "SuspendedExternally" and status["restartCount"] == 0
    world.wait("the pods gone", lambda: not world.pods(name))
    time.sleep(3 * POLL)  # rounds go by: the operator leaves the suspend in place
    assert world.get("rayclusters", name)["spec"]["suspend"] is True
    assert world.get("rljobs", name)["status"]["restartCount"] == 0

    world.plane.kubectl(
        "patch",
        "raycluster",
        name,
        "-n",
        world.namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"suspend": False}}),
    )  # admitted again
    _, resumed = world.running(name)  # the same attempt 0, on a new head, from the checkpoint
    assert resumed is not job and "--resume" in resumed.entrypoint
    status = world.get("rljobs", name)["status"]
    assert status["restartCount"] == 0 and status["rayJobId"] == world.submission_id(name, 0)
    assert {"SuspendedExternally", "Resumed"} <= {e["reason"] for e in world.events(name)}
    world.plane.kubectl("delete", "rljob", name, "-n", world.namespace, "--wait=false")
