"""Issue 4's user scenarios on the real control plane: the operator as its own process, KubeRay's
and the kubelets' test doubles, real Ray clusters and the real runtime (vLLM, torch) running in
pod sandboxes on emulated Ascend nodes. Every assertion is on what a user sees through kubectl,
or on the files the job writes to its checkpoint volume.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from rldock.contract.runtime_cli import DRAIN_REQUESTS_DIR
from rldock_e2e.operator_process import ChartOperator
from rldock_e2e.scenario import JobHold, Scenario, sample

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "examples" / "rljob-tiny.yaml"
NAME = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
CPU_EXAMPLE = REPO_ROOT / "examples" / "rljob-cpu.yaml"  # the quick start's: no device requested
CHECKPOINT_CLAIM = "rl-checkpoints"  # what the examples mount (the `scenario` fixture binds it)
START_TIMEOUT = 420  # a Ray head and worker, the driver's model build and warm-up, four engines
RUN_TIMEOUT = 600


def _iteration(row: dict[str, str]) -> int:
    done = row.get("ITERATION", "<none>")
    return int(done.split("/")[0]) if "/" in done else 0


def _manifest(name: str, *, iterations: int = 40, checkpoint_interval: int = 5, **resources: int) -> dict[str, Any]:
    """The example RLJob renamed, with fewer iterations or another shape, one data-parallel rank
    (one vLLM engine to start instead of two: engine start-up is most of a scenario's time on two
    shared cores), on pods with just the CPUs the job asks Ray for: a Ray node starts one idle
    Python worker per CPU it has, which the example's real-cluster sizes make costly here."""
    manifest = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    manifest["metadata"]["name"] = name
    job = manifest["spec"]["job"]
    job.update(name=name, iterations=iterations)
    job["training"]["data_parallel_size"] = 1
    job["checkpoint"]["interval"] = checkpoint_interval
    job["resources"].update(resources)
    manifest["spec"]["cluster"].update(head={"cpu": 1, "memory": "4Gi"}, worker={"cpu": 4, "memory": "16Gi"})
    return manifest


def _code_under_test() -> list[dict[str, str]]:
    """spec.env giving the pods the test run's PYTHONPATH, so that they run the code under test (the
    node agent's "image" is the venv, whose editable install may be another checkout's)."""
    return [{"name": "PYTHONPATH", "value": os.environ["PYTHONPATH"]}] if os.environ.get("PYTHONPATH") else []


def _held(scenario: Scenario, manifest: dict[str, Any], *, before: int) -> JobHold:
    """Hold the job of `manifest` before iteration `before` (runtime/driver/iteration_hold.py): its
    driver waits there until the test moves the hold or releases it, so an interruption lands at
    an iteration the test chose, however fast the job runs. The pods run the code under test."""
    name = manifest["metadata"]["name"]
    hold = scenario.hold(name, claim=CHECKPOINT_CLAIM).before(before)
    manifest["spec"]["env"] = [*manifest["spec"].get("env", []), *hold.env, *_code_under_test()]
    return hold


def _apply(scenario: Scenario, manifest: dict[str, Any], *, check: bool = True):
    return scenario.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=check)


def _checkpoint_iteration(status: dict[str, Any]) -> int:
    """`status.lastCheckpoint` (.../checkpoints/iter-000008) as an iteration number; 0 when none."""
    last = status.get("lastCheckpoint") or ""
    return int(last.rsplit("iter-", 1)[1]) if "iter-" in last else 0


def _assert_resumed(
    final: list[dict[str, Any]], before: list[dict[str, Any]], *, checkpoint: int, iterations: int
) -> None:
    """Every iteration exactly once, and those up to the checkpoint the interruption left are the
    very records written before it (kept, not recomputed from scratch)."""
    assert [m["iteration"] for m in final] == list(range(1, iterations + 1)), [m["iteration"] for m in final]
    assert checkpoint >= 1 and final[:checkpoint] == before[:checkpoint]


def _node_names(scenario: Scenario) -> list[str]:
    return [node["metadata"]["name"] for node in scenario.plane.kubectl_json("get", "nodes")["items"]]


def _cpu_only_node(scenario: Scenario) -> str:
    """A CPU-only node (no device resource at all) that takes the next pods: every other node is
    cordoned until the caller's pods are bound (`_back_to_the_device_nodes`)."""
    for node in _node_names(scenario):
        scenario.plane.kubectl("cordon", node)
    name = f"cpu-{scenario.namespace}"
    scenario.agent.add_node(name, device_resource=None)
    return name


def _back_to_the_device_nodes(scenario: Scenario, cpu_node: str) -> None:
    """The other nodes schedulable again, the CPU-only one not (its pods run on), so that the
    module's later scenarios are placed as before."""
    for node in _node_names(scenario):
        scenario.plane.kubectl("cordon" if node == cpu_node else "uncordon", node)


@pytest.mark.parametrize(
    "example",
    [
        pytest.param(EXAMPLE, id="rljob-tiny"),
        # The quick start's CPU-only RLJob as it is, on a node without any device: one more job
        # start (about 7 minutes here), so opt-in (README, "slow").
        pytest.param(CPU_EXAMPLE, id="rljob-cpu", marks=pytest.mark.slow),
    ],
)
def test_happy_path_from_apply_to_success(scenario: Scenario, example: Path) -> None:
    name = yaml.safe_load(example.read_text())["metadata"]["name"]
    cpu_node = _cpu_only_node(scenario) if example == CPU_EXAMPLE else None
    try:
        applied = scenario.kubectl("apply", "-f", str(example))
        assert f"rljob.rldock.io/{name} created" in applied.stdout
        scenario.wait_phase(name, "Running", timeout=START_TIMEOUT)
    finally:
        if cpu_node:
            _back_to_the_device_nodes(scenario, cpu_node)
    assert scenario.row(name)["PHASE"] == "Running"
    if cpu_node:  # both pods on the node without devices, asking for none
        pods = scenario.ray_pods(name)
        assert len(pods) == 2 and {p["spec"]["nodeName"] for p in pods} == {cpu_node}, pods
        for pod in pods:
            (container,) = pod["spec"]["containers"]
            assert set(container["resources"]["limits"]) == {"cpu", "memory"}, container["resources"]
    _runs_to_success(scenario, name)


def _runs_to_success(scenario: Scenario, name: str) -> None:
    # While it runs, `kubectl get rljobs` shows the iteration count rising, a reward and a TPS.
    rows = sample(
        2.0, lambda: scenario.status(name).get("phase") != "Running", lambda: scenario.row(name), timeout=RUN_TIMEOUT
    )
    running = [r for r in rows if r["PHASE"] == "Running" and _iteration(r) > 0]
    iterations = [_iteration(r) for r in running]
    assert len(set(iterations)) >= 3, rows
    assert iterations == sorted(iterations), rows
    assert all(r["REWARD"] != "<none>" and r["TPS"] != "<none>" for r in running), rows
    assert all(0 <= float(r["REWARD"]) <= 1 and float(r["TPS"]) > 0 for r in running), rows

    status = scenario.wait_phase(name, "Succeeded", timeout=60)
    final = scenario.row(name)
    assert final["PHASE"] == "Succeeded" and final["ITERATION"] == "40/40", final
    assert status["restartCount"] == 0 and status["completionTime"]

    # It learned: the mean reward of the last five iterations is well above the first five's.
    metrics = scenario.metrics(name)
    assert [m["iteration"] for m in metrics] == list(range(1, 41))
    first = statistics.mean(m["reward_mean"] for m in metrics[:5])
    last = statistics.mean(m["reward_mean"] for m in metrics[-5:])
    assert last - first >= 0.2, (first, last)

    # The cluster is released at once; the RLJob itself stays (ttlSecondsAfterFinished: a day).
    scenario.wait(
        "the RayCluster released",
        lambda: "No resources found" in scenario.kubectl("get", "rayclusters").stderr,
        timeout=60,
    )
    scenario.wait(
        "its pods and processes gone", lambda: not scenario.ray_pods(name) and not scenario.processes(), timeout=60
    )
    reasons = {e["reason"] for e in scenario.events(name)}
    assert {"CreatedRayCluster", "SubmittedRayJob", "Succeeded", "ReleasedRayCluster"} <= reasons, reasons
    assert scenario.get("rljob", name) is not None


def test_invalid_spec_is_refused_or_failed_with_the_field_named(scenario: Scenario) -> None:
    # A schema violation: the API server refuses it, and kubectl names the field.
    bad_type = _manifest("bad-type")
    bad_type["spec"]["job"]["iterations"] = "many"
    refused = _apply(scenario, bad_type, check=False)
    assert refused.returncode != 0 and "spec.job.iterations" in refused.stderr, refused.stderr
    negative = _manifest("bad-limit")
    negative["spec"]["backoffLimit"] = -1
    refused = _apply(scenario, negative, check=False)
    assert refused.returncode != 0 and "spec.backoffLimit" in refused.stderr, refused.stderr
    assert "No resources found" in scenario.kubectl("get", "rljobs").stderr

    # A semantic error (G*N = 128 samples cannot be split over 3 data-parallel ranks): accepted,
    # then Failed with a condition and a Warning event naming the field; nothing is created.
    name = "bad-dp"
    semantic = _manifest(name)
    semantic["spec"]["job"]["training"]["data_parallel_size"] = 3
    _apply(scenario, semantic)
    scenario.wait_phase(name, "Failed", timeout=60)
    assert scenario.row(name)["PHASE"] == "Failed"
    failed = scenario.condition(name, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "InvalidSpec"
    assert "spec.job.training.data_parallel_size" in failed["message"], failed
    event = scenario.wait(
        "the InvalidSpec event",
        lambda: next((e for e in scenario.events(name) if e["reason"] == "InvalidSpec"), None),
        timeout=30,
    )
    assert event["type"] == "Warning" and "spec.job.training.data_parallel_size" in event["message"]
    time.sleep(3)  # several operator rounds later: still no cluster, no pod
    assert "No resources found" in scenario.kubectl("get", "rayclusters").stderr
    assert not scenario.items("pods", "-l", "ray.io/is-ray-node=yes")


def test_a_path_missing_in_the_pods_fails_at_once_with_the_field_named(scenario: Scenario) -> None:
    """Issue 13: spec.volumes/volumeMounts/env reach the pods, and a model path that is not a
    model there fails the RLJob within one attempt (no retries), naming spec.job.model.path."""
    scenario.kubectl("create", "configmap", "model-card", "--from-literal=README.md=not a model")
    scenario.kubectl("create", "secret", "generic", "reward-api", "--from-literal=token=s3cret")
    name = "missing-model"
    manifest = _manifest(name)
    manifest["spec"]["job"]["model"] = {"path": "/models", "dtype": "float32"}  # a ConfigMap, no config.json
    manifest["spec"].update(
        volumes=[{"name": "model-card", "configMap": {"name": "model-card"}}],
        volumeMounts=[{"name": "model-card", "mountPath": "/models"}],
        # A Secret's key as env (a pod whose Secret is missing would never start), and the test
        # run's PYTHONPATH, so that the pods run the code under test, as the tests themselves do.
        env=[
            {"name": "REWARD_API_TOKEN", "valueFrom": {"secretKeyRef": {"name": "reward-api", "key": "token"}}},
            *_code_under_test(),
        ],
    )
    _apply(scenario, manifest)
    scenario.wait_phase(name, "Failed", timeout=START_TIMEOUT)
    status = scenario.get("rljob", name)["status"]
    assert status["restartCount"] == 0 and scenario.row(name)["PHASE"] == "Failed"
    failed = scenario.condition(name, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "PathNotFound", failed
    # What the pod saw at /models is the ConfigMap's file: the volume reached the pod.
    assert "spec.job.model.path: /models has no config.json" in failed["message"], failed
    assert "(it holds: README.md)" in failed["message"], failed
    event = scenario.wait(
        "the PathNotFound event",
        lambda: next((e for e in scenario.events(name) if e["reason"] == "PathNotFound"), None),
        timeout=30,
    )
    assert event["type"] == "Warning" and "spec.job.model.path" in event["message"]
    scenario.wait(
        "the RayCluster released",
        lambda: "No resources found" in scenario.kubectl("get", "rayclusters").stderr,
        timeout=90,
    )


def test_unschedulable_job_waits_until_a_node_fits_and_deleting_it_removes_everything(scenario: Scenario) -> None:
    name = "too-big"
    manifest = _manifest(name, devices_per_node=16)  # the nodes have 8 NPUs
    _held(scenario, manifest, before=2)  # still running when it is deleted past iteration 1
    _apply(scenario, manifest)
    condition = scenario.wait(
        "a PodsScheduled=False condition",
        lambda: (c := scenario.condition(name, "PodsScheduled")) and c["status"] == "False" and c,
        timeout=120,
    )
    assert condition["reason"] == "Unschedulable"
    assert "Insufficient huawei.com/Ascend910" in condition["message"], condition  # the scheduler's words
    assert scenario.row(name)["PHASE"] == "Provisioning"
    (worker,) = [p for p in scenario.ray_pods(name) if p["metadata"]["labels"]["ray.io/node-type"] == "worker"]
    assert worker["status"]["phase"] == "Pending" and not worker["spec"].get("nodeName")
    assert any(e["reason"] == "Unschedulable" and e["type"] == "Warning" for e in scenario.events(name))

    # A node big enough joins: the scheduler places the worker and the job runs.
    scenario.agent.add_node(f"npu16-{scenario.namespace}", devices=16)
    scenario.wait_phase(name, "Running", timeout=START_TIMEOUT)
    assert scenario.condition(name, "PodsScheduled")["status"] == "True"

    # Deleting the running job removes everything it made (one job start serves both scenarios).
    _delete_running_job(scenario, name)


def _delete_running_job(scenario: Scenario, name: str) -> None:
    scenario.wait(
        f"RLJob {name} past its first iteration",
        lambda: scenario.status(name).get("iteration", 0) >= 1,
        timeout=START_TIMEOUT,
    )
    config_map = scenario.items("configmaps", "-l", f"rldock.io/rljob={name}")
    assert [c["metadata"]["name"] for c in config_map] == [f"{name}-config"]
    pods = scenario.ray_pods(name)
    assert len(pods) == 2 and all(p["status"]["phase"] == "Running" for p in pods)
    namespaces = scenario.pod_namespaces()
    assert set(namespaces) == {p["metadata"]["name"] for p in pods} and scenario.processes()

    deleted = scenario.kubectl("delete", "rljob", name, "--timeout=120s")
    assert f'rljob.rldock.io "{name}" deleted' in deleted.stdout
    scenario.wait(
        "the RayCluster, its pods, the ConfigMap and the Secret gone",
        lambda: (
            "No resources found" in scenario.kubectl("get", "rayclusters").stderr
            and not scenario.ray_pods(name)
            and not scenario.items("configmaps", "-l", f"rldock.io/rljob={name}")
            and not scenario.items("secrets", "-l", f"rldock.io/rljob={name}")
        ),
        timeout=90,
    )
    scenario.wait("every local process of the job's pods gone", lambda: not scenario.leftovers(namespaces), timeout=30)


def test_a_deleted_head_pod_then_a_suspended_cluster_are_preemptions_resumed_after_the_iteration_under_way(
    scenario: Scenario,
) -> None:
    """Two preemptions of one job (one job start for both):

    1. The head pod deleted mid-run (a node drain): its preStop hook (`rldock preempt`) stops the driver, which
       finishes the iteration under way and checkpoints it although no periodic checkpoint is due; the operator
       records Preempted and counts no restart; the same attempt resumes on the new head right after it.
    2. The RayCluster suspended mid-run, as Kueue preempts a workload: every pod goes at once, the workers'
       hooks (`rldock preempt --follow`) keep their Ray nodes up while the head's notice says its driver is
       stopping, so the iteration under way finishes with them and is saved; unsuspended (Kueue's admission),
       the same attempt resumes right after it.

    Nothing is redone (the records up to each stop are the stopped attempt's), and the prompt ledger of the
    last checkpoint shows every prompt group trained once."""
    name, iterations = "preempted", 12
    manifest = _manifest(name, iterations=iterations, checkpoint_interval=4)
    hold = _held(scenario, manifest, before=6)  # iteration 5 done, past the periodic checkpoint of 4
    _apply(scenario, manifest)
    scenario.wait(
        "the job held before iteration 6",
        lambda: (s := scenario.status(name)) and s.get("iteration") == 5 and s.get("phase") == "Running" and s,
        timeout=START_TIMEOUT,
    )
    (head,) = [p for p in scenario.ray_pods(name) if p["metadata"]["labels"]["ray.io/node-type"] == "head"]
    scenario.kubectl("delete", "pod", head["metadata"]["name"], "--wait=false")
    preempted = scenario.wait("Preempted", lambda: scenario.condition(name, "Preempted"), timeout=60)
    assert (preempted["status"], preempted["reason"]) == ("True", "HeadPodDeleted"), preempted
    assert head["metadata"]["name"] in preempted["message"] and "the last it reported: 5" in preempted["message"]
    # The driver, stopped while held, finishes iteration 6 (the one under way) and saves it; the resumed
    # attempt runs on to the hold before 10.
    hold.before(10)
    checkpoints = scenario.output_dir(name) / "checkpoints"
    scenario.wait(
        "the stopped driver's checkpoint of iteration 6", (checkpoints / "iter-000006").is_dir, timeout=RUN_TIMEOUT
    )
    before = scenario.metrics(name)  # the stopped attempt's records: the new head is made after the old is gone
    assert [m["iteration"] for m in before] == list(range(1, 7))
    scenario.wait(
        "the resumed job held before iteration 10",
        lambda: (s := scenario.status(name)) and s.get("iteration") == 9 and s,
        timeout=START_TIMEOUT,
    )
    resumed = scenario.condition(name, "Preempted")
    assert resumed is not None and (resumed["status"], resumed["reason"]) == ("False", "Resumed"), resumed
    fits = scenario.condition(name, "GracePeriodSufficient")  # the job's stop, measured, in the default 300 s
    assert fits is not None and (fits["status"], fits["reason"]) == ("True", "StopFits"), fits
    metrics = scenario.metrics(name)
    _assert_resumed(metrics, before, checkpoint=6, iterations=9)

    # What Kueue does to preempt the workload: the RayCluster suspended, KubeRay deleting every pod.
    scenario.kubectl("patch", "raycluster", name, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    notice = scenario.output_dir(name) / "preempting.json"
    scenario.wait("the head's hook posting its notice", notice.is_file, timeout=60)
    workers = [p for p in scenario.ray_pods(name) if p["metadata"]["labels"]["ray.io/node-type"] == "worker"]
    assert workers and all(p["metadata"].get("deletionTimestamp") for p in workers), workers  # kept up, stopping
    hold.release()  # iteration 10, under way when the cluster went, finishes on the workers kept up, and is saved
    scenario.wait(
        "the suspended driver's checkpoint of iteration 10", (checkpoints / "iter-000010").is_dir, timeout=RUN_TIMEOUT
    )
    scenario.wait(
        "the pods gone and the notice taken down",
        lambda: not scenario.ray_pods(name) and not notice.exists(),
        timeout=120,
    )
    suspended = scenario.condition(name, "Suspended")
    assert suspended is not None and suspended["reason"] == "SuspendedExternally", suspended
    before = scenario.metrics(name)
    _assert_resumed(before, metrics, checkpoint=9, iterations=10)

    scenario.kubectl("patch", "raycluster", name, "--type=merge", "-p", '{"spec": {"suspend": false}}')  # admitted
    status = scenario.wait_phase(name, "Succeeded", timeout=START_TIMEOUT + RUN_TIMEOUT)
    assert status["restartCount"] == 0 and scenario.row(name)["ITERATION"] == f"{iterations}/{iterations}"
    _assert_resumed(scenario.metrics(name), before, checkpoint=10, iterations=iterations)
    reasons = [e["reason"] for e in scenario.events(name)]
    assert {"Preempted", "Resumed", "SuspendedExternally"} <= set(reasons) and "Retrying" not in reasons, reasons
    ledger = json.loads((checkpoints / f"iter-{iterations:06d}" / "ledger.json").read_text())
    groups = manifest["spec"]["job"]["algorithm"]["num_prompts_per_iteration"]
    assert ledger["summary"] == {
        "drawn": iterations * groups,
        "trained": iterations * groups,
        "passed_over": 0,
        "open": 0,
        "trained_twice": 0,
    }, ledger["summary"]


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_a_worker_pod_deleted_alone_has_the_iteration_under_way_saved_and_the_next_attempt_resumes_after_it(
    scenario: Scenario,
) -> None:
    """A worker pod deleted alone (a drain of its node): its preStop hook asks the driver for a checkpoint (a
    request in the job's output folder), the driver acknowledges it, and the pod is not lost while its hook
    keeps its Ray node up: the iteration under way finishes on it and is saved, although no periodic checkpoint
    is due. The operator records Preempted (WorkerPodDeleted); once the pod is gone the attempt ends and the
    next (attempt 1, no restart counted) resumes right after the saved iteration."""
    # Held before iteration 5, past the checkpoint of 4: the deletion lands while the job runs, however fast.
    name, iterations = "lost-worker", 12
    manifest = _manifest(name, iterations=iterations, checkpoint_interval=4)
    hold = _held(scenario, manifest, before=5)
    _apply(scenario, manifest)
    status = scenario.wait(
        "the job held after the checkpoint of iteration 4",
        lambda: (s := scenario.status(name)) and _checkpoint_iteration(s) == 4 and s.get("phase") == "Running" and s,
        timeout=START_TIMEOUT,
    )
    (worker,) = [p for p in scenario.ray_pods(name) if p["metadata"]["labels"]["ray.io/node-type"] == "worker"]
    scenario.kubectl("delete", "pod", worker["metadata"]["name"], "--wait=false")
    requests = scenario.output_dir(name) / DRAIN_REQUESTS_DIR
    acknowledged = scenario.wait(
        "the driver taking up the worker's request to stop",
        lambda: [r for r in requests.glob("*.json") if json.loads(r.read_text() or "{}").get("acknowledged")],
        timeout=60,
    )
    before = scenario.metrics(name)
    assert len(before) == 4 and scenario.status(name).get("restartCount", 0) == 0  # the pod is not lost yet
    preempted = scenario.wait("Preempted while the pod goes", lambda: scenario.condition(name, "Preempted"), timeout=60)
    assert (preempted["status"], preempted["reason"]) == ("True", "WorkerPodDeleted"), preempted
    assert worker["metadata"]["name"] in preempted["message"], preempted
    terminating = [p for p in scenario.ray_pods(name) if p["metadata"]["name"] == worker["metadata"]["name"]]
    assert terminating and terminating[0]["metadata"].get("deletionTimestamp"), terminating  # kept up by its hook
    hold.release()  # iteration 5, under way on the worker being deleted, finishes and is saved
    checkpoints = scenario.output_dir(name) / "checkpoints"
    scenario.wait(
        "the stopped driver's checkpoint of iteration 5", (checkpoints / "iter-000005").is_dir, timeout=RUN_TIMEOUT
    )
    scenario.wait("the request answered", lambda: not any(r.exists() for r in acknowledged), timeout=60)
    saved = scenario.metrics(name)  # 1-5 at least (iteration 6 may finish before the pod goes)
    status = scenario.wait_phase(name, "Succeeded", timeout=START_TIMEOUT + RUN_TIMEOUT)
    assert scenario.row(name)["ITERATION"] == f"{iterations}/{iterations}"
    assert status.get("restartCount", 0) == 0 and status["attempt"] == 1
    workers = [p for p in scenario.items("pods", "-l", "ray.io/node-type=worker")]
    assert worker["metadata"]["name"] not in {p["metadata"]["name"] for p in workers}
    _assert_resumed(scenario.metrics(name), saved, checkpoint=5, iterations=iterations)
    reasons = [e["reason"] for e in scenario.events(name)]
    assert "Preempted" in reasons and "Resumed" in reasons and "Retrying" not in reasons


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_operator_restart_keeps_the_one_cluster_and_suspend_resumes_from_the_checkpoint(scenario: Scenario) -> None:
    """Two scenarios on one job (one job start): the operator killed mid-run comes back to the same
    cluster and submission; then a suspend releases the cluster and an unsuspend resumes from the
    last checkpoint."""
    # The job is held where each step needs it (runtime/driver/iteration_hold.py), not left to its speed:
    # before iteration 3 while the operator is killed and restarted, then before 9 (past the
    # checkpoint of 8) until it is suspended; with 300 iterations and no hold a job at ~0.2 s per
    # iteration could finish first (`assert 60 < 60` on the real nodes).
    name, iterations = "restart", 16
    manifest = _manifest(name, iterations=iterations, checkpoint_interval=4)
    hold = _held(scenario, manifest, before=3)
    _apply(scenario, manifest)
    status = scenario.wait(
        f"RLJob {name} held after iteration 2",
        lambda: (s := scenario.status(name)) and s.get("iteration", 0) == 2 and s,
        timeout=START_TIMEOUT,
    )
    (cluster,) = scenario.items("rayclusters")
    scenario.operator.kill()  # SIGKILL: the chart's pod is restarted by its kubelet, a process by us
    time.sleep(3)  # the job goes on without the operator
    scenario.operator.start()
    if isinstance(scenario.operator, ChartOperator):  # `kubectl get pods` shows the restart
        (pod,) = scenario.items("pods", "-l", scenario.operator.selector)
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 1
    hold.before(9)  # the job runs on: progress only the restarted operator can have read
    scenario.wait(
        "the restarted operator reporting progress",
        lambda: scenario.status(name).get("iteration", 0) > status["iteration"],
        timeout=120,
    )
    assert [c["metadata"]["uid"] for c in scenario.items("rayclusters")] == [cluster["metadata"]["uid"]]
    # One cluster, one submission, over both operators' lifetimes.
    counts = {
        reason: sum(e.get("count", 1) for e in scenario.events(name) if e["reason"] == reason)
        for reason in ("CreatedRayCluster", "SubmittedRayJob")
    }
    assert counts == {"CreatedRayCluster": 1, "SubmittedRayJob": 1}, counts

    # Suspend, the job held before iteration 9, past the checkpoint of 8: the pods' preStop hooks stop the
    # driver after iteration 9 (under way once the hold is released) and its checkpoint; then the cluster is
    # released (suspended, no pods, no processes), the progress kept.
    scenario.wait(
        "the job held after the checkpoint of iteration 8",
        lambda: (s := scenario.status(name)).get("iteration") == 8 and _checkpoint_iteration(s) == 8,
        timeout=RUN_TIMEOUT,
    )
    namespaces = scenario.pod_namespaces()
    scenario.kubectl("patch", "rljob", name, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    scenario.wait_phase(name, "Suspended", timeout=60)
    assert scenario.row(name)["PHASE"] == "Suspended"
    hold.release()  # the stopping driver finishes iteration 9; the resumed job then runs to the end
    scenario.wait(
        "the cluster released: suspended, no pods, no processes",
        lambda: (
            scenario.items("rayclusters")[0]["spec"]["suspend"] is True
            and not scenario.ray_pods(name)
            and not scenario.leftovers(namespaces)
        ),
        timeout=RUN_TIMEOUT,
    )
    before = scenario.metrics(name)
    checkpoint = 9  # the iteration under way when the suspend came, saved by the stop
    assert (scenario.output_dir(name) / "checkpoints" / f"iter-{checkpoint:06d}").is_dir()
    assert len(before) == checkpoint, len(before)

    scenario.kubectl("patch", "rljob", name, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    scenario.wait_phase(name, ("Provisioning", "Running", "Succeeded"), timeout=60)
    status = scenario.wait_phase(name, "Succeeded", timeout=START_TIMEOUT + RUN_TIMEOUT)
    assert status["restartCount"] == 0 and scenario.row(name)["ITERATION"] == f"{iterations}/{iterations}"
    _assert_resumed(scenario.metrics(name), before, checkpoint=checkpoint, iterations=iterations)
    reasons = {e["reason"] for e in scenario.events(name)}
    assert {"Suspended", "Resumed"} <= reasons, reasons


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_lost_worker_pod_is_restarted_inside_the_attempt_with_max_restarts(scenario: Scenario) -> None:
    """spec.maxRestarts 1: the runtime, not the operator, recovers a lost worker pod. The pod's hook has the
    driver save the iteration under way first (as without maxRestarts); then the Ray job goes on (one
    submission, no retry counted), KubeRay's replacement pod joins the Ray cluster once the old one is gone
    (it holds the node's devices until then), the runtime restarts its workers on it from that checkpoint,
    and the job ends with every iteration once."""
    # Held before iteration 5, past the checkpoint of 4, until the driver took up the pod's request: the loss
    # lands while the job runs.
    name, iterations = "in-job-restart", 12
    manifest = _manifest(name, iterations=iterations, checkpoint_interval=4)
    manifest["spec"]["maxRestarts"] = 1
    hold = _held(scenario, manifest, before=5)
    _apply(scenario, manifest)
    status = scenario.wait(
        "the job held after the checkpoint of iteration 4",
        lambda: (s := scenario.status(name)) and _checkpoint_iteration(s) == 4 and s.get("phase") == "Running" and s,
        timeout=START_TIMEOUT,
    )
    submission = status["rayJobId"]
    (worker,) = [p for p in scenario.ray_pods(name) if p["metadata"]["labels"]["ray.io/node-type"] == "worker"]
    scenario.kubectl("delete", "pod", worker["metadata"]["name"], "--wait=false")
    before = scenario.metrics(name)
    checkpoint = _checkpoint_iteration(scenario.status(name))
    assert checkpoint == _checkpoint_iteration(status) == 4 and len(before) == 4, (checkpoint, len(before))

    requests = scenario.output_dir(name) / DRAIN_REQUESTS_DIR
    scenario.wait(
        "the driver taking up the worker's request",
        lambda: any(json.loads(r.read_text() or "{}").get("acknowledged") for r in requests.glob("*.json")),
        timeout=60,
    )
    hold.release()  # iteration 5 finishes and is saved; the pod goes, and the runtime restarts inside the attempt
    log = scenario.wait(
        "the runtime resuming after its restart, on the devices of the replacement pod",
        lambda: (
            (text := scenario.driver_log(name))
            and "restart 1 of 1" in text
            and all(line in text.split("restart 1 of 1", 1)[1] for line in ("resuming after iteration", "reserved"))
            and text
        ),
        timeout=START_TIMEOUT,
    )
    assert "a worker died" in log, log[-3000:]
    after_restart = log.split("restart 1 of 1", 1)[1]
    resumed_after = int(after_restart.split("resuming after iteration", 1)[1].split()[0])
    assert checkpoint < 5 <= resumed_after < iterations, (checkpoint, resumed_after)  # the drain's checkpoint
    assert "reserved" in after_restart, after_restart[:3000]  # the devices of the replacement pod
    assert any(  # KubeRay's replacement, on the devices the old pod gave back
        p["metadata"]["name"] != worker["metadata"]["name"] and p["status"].get("phase") == "Running"
        for p in scenario.pods_now(f"ray.io/cluster={name},ray.io/node-type=worker")
    )

    # `kubectl get rljobs` shows the same attempt running on, past where the pod was lost.
    rows = sample(
        2.0, lambda: scenario.status(name).get("phase") != "Running", lambda: scenario.row(name), timeout=RUN_TIMEOUT
    )
    running = [_iteration(r) for r in rows if r["PHASE"] == "Running"]
    assert any(i > len(before) for i in running), (len(before), rows)
    status = scenario.wait_phase(name, "Succeeded", timeout=60)
    assert scenario.row(name)["ITERATION"] == f"{iterations}/{iterations}"
    assert status["restartCount"] == 0 and status["rayJobId"] == submission, status
    assert scenario.condition(name, "Retrying") is None
    _assert_resumed(scenario.metrics(name), before, checkpoint=checkpoint, iterations=iterations)
    events = scenario.events(name)
    counts = {
        reason: sum(e.get("count", 1) for e in events if e["reason"] == reason)
        for reason in ("CreatedRayCluster", "SubmittedRayJob", "Retrying")
    }
    assert counts == {"CreatedRayCluster": 1, "SubmittedRayJob": 1, "Retrying": 0}, counts


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:  # ended since it was listed
        return ""


def _past_in_flight_restart(log: str) -> bool:
    """The runtime's restart (restart 1 of 1) kept the dock of iteration K and has got past it:
    killed mid-iteration, the restart resumes K from that dock; killed between two iterations, the
    dock kept is of one already checkpointed, and the restart resumes after it."""
    if "kept the dock of iteration" not in log or "resuming after iteration" not in log.split("restart 1 of 1")[-1]:
        return False
    kept = int(log.split("kept the dock of iteration", 1)[1].split()[0])
    resumed_after = int(log.split("restart 1 of 1")[-1].split("resuming after iteration", 1)[1].split()[0])
    return resumed_after >= kept or f"iteration {kept} resumes from the dock of its failed attempt" in log


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_killed_worker_process_resumes_from_the_in_flight_dock_with_max_restarts(scenario: Scenario) -> None:
    """spec.maxRestarts 1 and an actor rank's process killed inside its pod (the pod and its node,
    with the dock's warehouse, live): the runtime keeps the dock of the iteration in flight and its
    restart resumes from it, inside the one Ray job."""
    # Held before iteration 3 while the actor is killed, then released: iteration 3 starts with
    # the dead rank and fails in flight, however fast the job ran before.
    name, iterations = "in-flight", 8
    manifest = _manifest(name, iterations=iterations, checkpoint_interval=1)  # the retry starts at the iteration
    manifest["spec"]["maxRestarts"] = 1
    hold = _held(scenario, manifest, before=3)
    _apply(scenario, manifest)
    scenario.wait(
        f"RLJob {name} held after iteration 2",
        lambda: scenario.status(name).get("iteration", 0) == 2,
        timeout=START_TIMEOUT,
    )
    (pids,) = scenario.agent.pids(scenario.namespace, labels={"ray.io/node-type": "worker"}).values()
    # the actor rank's process: a device worker's seat under colocated placement, its own under separate
    actor = next(pid for pid in pids if _cmdline(pid).startswith(("ray::DeviceWorker", "ray::ActorWorker")))
    os.kill(actor, signal.SIGKILL)
    assert len(scenario.metrics(name)) == 2
    hold.release()

    log = scenario.wait(
        "the runtime past its restart",
        lambda: (text := scenario.driver_log(name)) and _past_in_flight_restart(text) and text,
        timeout=START_TIMEOUT,
    )
    assert "a worker died" in log, log[-4000:]
    status = scenario.wait_phase(name, "Succeeded", timeout=RUN_TIMEOUT)
    assert status["restartCount"] == 0 and scenario.row(name)["ITERATION"] == f"{iterations}/{iterations}"
    assert [m["iteration"] for m in scenario.metrics(name)] == list(range(1, iterations + 1))
    assert scenario.condition(name, "Retrying") is None
    assert sum(e.get("count", 1) for e in scenario.events(name) if e["reason"] == "SubmittedRayJob") == 1


def _pool_pods(scenario: Scenario, name: str) -> list[dict[str, Any]]:
    """The RLJob's rollout pool pods (KubeRay's group `pool`) that are not being deleted."""
    pods = scenario.items("pods", "-l", f"ray.io/cluster={name},ray.io/group=pool")
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _pool_ready(scenario: Scenario, name: str, count: int) -> bool:
    pods = _pool_pods(scenario, name)
    return len(pods) == count and all(p["status"].get("phase") == "Running" for p in pods)


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget (100.5 s in the CI at eeb86cb); README, "slow"
def test_the_rollout_pool_grows_and_shrinks_while_the_job_runs_and_a_lost_pool_pod_costs_its_engine(
    scenario: Scenario,
) -> None:
    """A job whose rollout pool alone generates (one device per pool pod), in one job start:

    1. `spec.job.rollout.pool.replicas` 1 -> 2 while it runs: the operator scales the RayCluster's `pool` group in
       place, the runtime starts an engine on the new pod, and the next rollout after it is up admits it (its
       groups in the records by engine);
    2. that engine's pod deleted: the job goes on (the attempt is not restarted), KubeRay makes a new pod, and an
       engine starts there and is admitted the same way;
    3. replicas 2 -> 1: a pod goes, its engine with it, and the job finishes on the other.

    Every iteration is trained once, on all its samples, with no restart. The hold (runtime/driver/iteration_hold.py)
    keeps the job from running out of iterations while an engine starts; the test waits for the driver to say an
    engine is up, then lets three more iterations run and looks at the last."""
    name, iterations = "pool-scaled", 30
    # two devices for the trainer's worker pod, so that the node's 8 leave room for the pool's pods
    manifest = _manifest(name, iterations=iterations, checkpoint_interval=10, devices_per_node=2)
    job = manifest["spec"]["job"]
    job["rollout"] = {"pool": {"replicas": 1, "actors_generate": False}}
    samples = job["algorithm"]["num_prompts_per_iteration"] * job["algorithm"]["num_responses_per_prompt"]
    hold = _held(scenario, manifest, before=3)
    _apply(scenario, manifest)
    scenario.wait("the job held before iteration 3", lambda: len(scenario.metrics(name)) == 2, timeout=START_TIMEOUT)
    (first,) = _pool_pods(scenario, name)

    def scale(replicas: int) -> None:
        patch = {"spec": {"job": {"rollout": {"pool": {"replicas": replicas}}}}}
        scenario.kubectl("patch", "rljob", name, "--type=merge", "-p", json.dumps(patch))

    def admitted(index: int) -> dict[str, Any]:
        """The record of the third iteration after the driver said engine `index` is up, the engine having
        generated in one of those three (a free engine takes whole groups while any are left)."""
        scenario.wait(
            f"rollout pool engine {index} up",
            lambda: f"rollout pool engine {index} is up" in scenario.driver_log(name),
            timeout=START_TIMEOUT,
        )
        done = len(scenario.metrics(name))
        hold.before(done + 4)
        scenario.wait(
            f"iteration {done + 3} done", lambda: len(scenario.metrics(name)) >= done + 3, timeout=RUN_TIMEOUT
        )
        after = scenario.metrics(name)[done : done + 3]
        assert sum(r["rollout/pool_engine_samples"].get(f"engine{index}", 0) for r in after) > 0, after
        return after[-1]

    # 1. Grow.
    scale(2)
    scenario.wait("two pool pods running", lambda: _pool_ready(scenario, name, 2), timeout=START_TIMEOUT)
    hold.before(10)  # launches to come: the one that sees the new Ray node starts its engine
    grown = admitted(1)
    assert set(grown["rollout/pool_engine_samples"]) == {"engine0", "engine1"}, grown

    # 2. The new engine's pod deleted.
    (second,) = [p for p in _pool_pods(scenario, name) if p["metadata"]["name"] != first["metadata"]["name"]]
    scenario.kubectl("delete", "pod", second["metadata"]["name"], "--wait=true")
    scenario.wait("two pool pods running again", lambda: _pool_ready(scenario, name, 2), timeout=START_TIMEOUT)
    hold.before(len(scenario.metrics(name)) + 8)
    replaced = admitted(2)
    assert set(replaced["rollout/pool_engine_samples"]) == {"engine0", "engine2"}, replaced

    # 3. Shrink.
    scale(1)
    scenario.wait("one pool pod left", lambda: len(scenario.items("pods", "-l", "ray.io/group=pool")) == 1, timeout=120)
    hold.release()
    status = scenario.wait_phase(name, "Succeeded", timeout=RUN_TIMEOUT)
    assert status["restartCount"] == 0, status
    metrics = scenario.metrics(name)
    assert [m["iteration"] for m in metrics] == list(range(1, iterations + 1))
    assert all(m["rollout/pool_samples"] == samples for m in metrics), [m["rollout/pool_samples"] for m in metrics]
    assert len(metrics[-1]["rollout/pool_engine_samples"]) == 1, metrics[-1]
    reasons = [e["reason"] for e in scenario.events(name)]
    assert reasons.count("ScaledRolloutPool") == 2 and "Retrying" not in reasons, reasons
