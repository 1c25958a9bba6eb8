"""Reconciler rounds against in-memory fakes of the Kubernetes API and the Jobs API: which objects
are written, which Events posted, what status results. (The same flows against a real API server:
tests/integration/test_operator.py.)"""

from __future__ import annotations

import base64
import copy
import json
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping, Optional

import pytest
from rljob_testing import spec_dict

from rldock.contract.failure import FailureReason, FieldProblem, JobFailure, format_failure
from rldock.operator import naming
from rldock.operator.constants import AUTH_SECRET_KEY, JOB_METADATA_WORKER_PODS
from rldock.operator.kube import CreateRefused, StatusRejected
from rldock.operator.rayjobs import RayJobsError
from rldock.operator.reconcile import Reconciler
from rldock.operator.settings import DashboardAddress, OperatorSettings

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
NAME, NS, UID = "grpo", "team-a", "0f5c2a6e-1111-2222-3333-444455556666"


def _merge(target: dict, patch: Mapping) -> dict:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


class FakeKube:
    """The Kube adapter's interface over a dict; records every write."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: list[dict[str, Any]] = []
        self.writes: list[tuple[str, str, str]] = []
        self.refuse: dict[str, CreateRefused] = {}  # kind -> what the API server answers a create with
        self.status_limit: Optional[int] = None  # a status whose JSON is longer is refused (422)
        self.statuses: list[dict[str, Any]] = []  # status patches, in order
        self._uids = 0

    def get(self, kind: str, namespace: str, name: str) -> Optional[dict[str, Any]]:
        obj = self.objects.get((kind, name))
        return copy.deepcopy(obj) if obj is not None else None

    def create(self, manifest: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        key = (manifest["kind"], manifest["metadata"]["name"])
        if key in self.objects:
            return None
        if manifest["kind"] in self.refuse:
            raise self.refuse[manifest["kind"]]
        obj = copy.deepcopy(dict(manifest))
        self._uids += 1
        obj["metadata"]["uid"] = f"uid-{self._uids}"
        if obj["kind"] == "Secret":  # the API server turns stringData into base64 data
            obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in obj.pop("stringData").items()}
        self.objects[key] = obj
        self.writes.append(("create", *key))
        return copy.deepcopy(obj)

    def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        self.writes.append(("patch", kind, name))
        return copy.deepcopy(_merge(self.objects[(kind, name)], patch))

    def delete(self, kind: str, namespace: str, name: str, *, uid: Optional[str] = None) -> bool:
        self.writes.append(("delete", kind, name))
        return self.objects.pop((kind, name), None) is not None or kind == "RLJob"

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        return [p for p in self.pods if labels.items() <= p["metadata"]["labels"].items()]

    def patch_rljob_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        if self.status_limit is not None and len(json.dumps(patch)) > self.status_limit:
            raise StatusRejected("HTTP 422: RLJob.rldock.io \"grpo\" is invalid: status: Too long")
        self.statuses.append(dict(patch))


class FakeJobs:
    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.logs: dict[str, str] = {}
        self.tokens: list[Optional[str]] = []
        self.down = False

    def client(self, url: str, token: Optional[str]) -> "FakeJobs":
        self.tokens.append(token)
        return self

    def _check(self) -> None:
        if self.down:
            raise RayJobsError("GET http://10.0.0.9:8265/api/jobs/x: connection refused")

    def get_job(self, submission_id: str) -> Optional[dict[str, Any]]:
        self._check()
        return self.jobs.get(submission_id)

    def get_logs(self, submission_id: str) -> str:
        self._check()
        return self.logs.get(submission_id, "")

    def submit_job(self, request: Mapping[str, Any]) -> str:
        self._check()
        self.jobs.setdefault(request["submission_id"], {"status": "PENDING", "metadata": request["metadata"]})
        return request["submission_id"]

    def stop_job(self, submission_id: str) -> bool:
        self._check()
        self.jobs[submission_id]["status"] = "STOPPED"
        return True


def body(*, status: Optional[dict] = None, **sections: Any) -> dict[str, Any]:
    return {"apiVersion": "rldock.io/v1alpha1", "kind": "RLJob",
            "metadata": {"name": NAME, "namespace": NS, "uid": UID, "generation": 1},
            "spec": spec_dict(**sections), "status": status or {}}


@pytest.fixture
def world() -> tuple[Reconciler, FakeKube, FakeJobs]:
    kube, jobs = FakeKube(), FakeJobs()
    settings = OperatorSettings(dashboard_address=DashboardAddress.POD_IP)
    return Reconciler(kube, settings, jobs_client=jobs.client, clock=lambda: NOW), kube, jobs


def make_ready(kube: FakeKube, num_workers: int = 2) -> None:
    """What KubeRay and the kubelets do: pods Running and Ready, the RayCluster's status."""
    cluster = kube.objects[("RayCluster", NAME)]
    cluster["status"] = {"state": "ready", "head": {"podIP": "10.0.0.9"}, "endpoints": {"dashboard": "8265"}}
    owner = [{"uid": cluster["metadata"]["uid"], "controller": True}]
    ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    kube.pods = [{"metadata": {"name": f"{NAME}-{role}-{i}", "ownerReferences": owner,
                               "labels": {"ray.io/cluster": NAME, "ray.io/node-type": role}}, "status": ready}
                 for role, count in (("head", 1), ("worker", num_workers)) for i in range(count)]


def test_first_round_creates_the_children_and_says_pending(world):
    reconciler, kube, _ = world
    outcome = reconciler.reconcile(body())
    assert [w for w in kube.writes if w[0] == "create"] == [
        ("create", "Secret", naming.auth_secret_name(NAME)), ("create", "ConfigMap", naming.config_map_name(NAME)),
        ("create", "RayCluster", NAME)]
    assert outcome.status["phase"] == "Pending"
    assert [e.reason.value for e in outcome.events] == ["CreatedAuthSecret", "CreatedConfigMap", "CreatedRayCluster"]
    token = base64.b64decode(kube.objects[("Secret", naming.auth_secret_name(NAME))]["data"][AUTH_SECRET_KEY])
    assert len(token) == 64


def test_a_ready_cluster_gets_the_job_with_the_rljobs_token(world):
    reconciler, kube, jobs = world
    reconciler.reconcile(body())
    make_ready(kube)
    outcome = reconciler.reconcile(body())
    submission_id = naming.ray_job_submission_id(NAME, UID, attempt=0)
    assert jobs.jobs[submission_id]["metadata"][JOB_METADATA_WORKER_PODS] == f"{NAME}-worker-0,{NAME}-worker-1"
    secret = kube.objects[("Secret", naming.auth_secret_name(NAME))]
    assert jobs.tokens[-1] == base64.b64decode(secret["data"][AUTH_SECRET_KEY]).decode()
    assert outcome.status["rayJobId"] == submission_id and outcome.status["phase"] == "Provisioning"
    assert "SubmittedRayJob" in [e.reason.value for e in outcome.events]

    jobs.jobs[submission_id]["status"] = "RUNNING"
    running = reconciler.reconcile(body(status=outcome.status))
    assert running.status["phase"] == "Running" and running.status["startTime"]
    # Nothing changed: the same status again, so the handler patches nothing and posts no Event.
    again = reconciler.reconcile(body(status=running.status))
    assert again.status == running.status and again.events == []


def test_an_unreachable_jobs_api_decides_nothing(world):
    reconciler, kube, jobs = world
    reconciler.reconcile(body())
    make_ready(kube)
    jobs.down = True
    writes = len(kube.writes)
    outcome = reconciler.reconcile(body(status={"phase": "Running", "rayJobId": "x"}))
    assert outcome.status is None and len(kube.writes) == writes


def test_a_failed_job_counts_a_restart(world):
    reconciler, kube, jobs = world
    first = reconciler.reconcile(body())
    make_ready(kube)
    submitted = reconciler.reconcile(body(status=first.status))
    jobs.jobs[submitted.status["rayJobId"]]["status"] = "FAILED"
    outcome = reconciler.reconcile(body(status=submitted.status))
    assert outcome.status["phase"] == "Retrying" and outcome.status["restartCount"] == 1
    assert "Retrying" in [e.reason.value for e in outcome.events]
    resubmitted = reconciler.reconcile(body(status=outcome.status))
    assert resubmitted.status["rayJobId"] == naming.ray_job_submission_id(NAME, UID, attempt=1)


def test_a_job_that_refused_its_inputs_fails_at_once(world):
    """The runtime's failure line in the failed job's log: Failed with its reason, no restart."""
    reconciler, kube, jobs = world
    first = reconciler.reconcile(body())
    make_ready(kube)
    submitted = reconciler.reconcile(body(status=first.status))
    job_id = submitted.status["rayJobId"]
    jobs.jobs[job_id]["status"] = "FAILED"
    jobs.logs[job_id] = "invalid job config:\n" + format_failure(JobFailure(
        FailureReason.PATH_NOT_FOUND, (FieldProblem("model.path", "/models/x does not exist"),))) + "\n"
    outcome = reconciler.reconcile(body(status=submitted.status))
    assert outcome.status["phase"] == "Failed" and outcome.status["restartCount"] == 0
    failed = {c["type"]: c for c in outcome.status["conditions"]}["Failed"]
    assert failed["reason"] == "PathNotFound" and "spec.job.model.path: /models/x does not exist" in failed["message"]
    assert ("Warning", "PathNotFound") in [(e.type, e.reason.value) for e in outcome.events]
    assert ("delete", "RayCluster", NAME) in kube.writes


def test_an_orphan_child_is_adopted(world):
    reconciler, kube, _ = world
    name = naming.config_map_name(NAME)
    kube.objects[("ConfigMap", name)] = {"kind": "ConfigMap", "metadata": {
        "name": name, "uid": "cm", "labels": {"rldock.io/rljob": NAME}}, "data": {}}
    reconciler.reconcile(body())
    (owner,) = kube.objects[("ConfigMap", name)]["metadata"]["ownerReferences"]
    assert owner["uid"] == UID and owner["controller"]
    assert kube.objects[("ConfigMap", name)]["data"]  # and brought up to date


FOREIGN_OWNER = [{"kind": "RLJob", "name": NAME, "uid": "older-rljob", "controller": True}]


@pytest.mark.parametrize("kind, name", [
    ("ConfigMap", naming.config_map_name(NAME)),
    ("Secret", naming.auth_secret_name(NAME)),
    ("RayCluster", naming.ray_cluster_name(NAME)),
])
def test_a_name_taken_by_someone_else_is_a_condition_and_a_warning(world, kind, name):
    """Before: the round was skipped, so the RLJob waited forever with no phase, condition or Event."""
    reconciler, kube, _ = world
    if kind == "RayCluster":
        reconciler.reconcile(body())  # the ConfigMap and Secret are this RLJob's
    kube.objects[(kind, name)] = {"kind": kind, "metadata": {"name": name, "uid": "x", "ownerReferences": FOREIGN_OWNER}}
    outcome = reconciler.reconcile(body())
    ready = {c["type"]: c for c in outcome.status["conditions"]}["ClusterReady"]
    assert outcome.status["phase"] == "Pending"
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict")
    assert f"{kind} {name}" in ready["message"] and "older-rljob" in ready["message"]
    assert [(e.type, e.reason.value) for e in outcome.events if e.type == "Warning"] == [("Warning", "NameConflict")]
    assert kube.objects[(kind, name)]["metadata"]["ownerReferences"] == FOREIGN_OWNER  # left alone
    again = reconciler.reconcile(body(status=outcome.status))
    assert again.status == outcome.status and again.events == []  # one Event, not one per round


QUOTA = ('rayclusters.ray.io "grpo" is forbidden: exceeded quota: team-quota, requested: '
         'count/rayclusters.ray.io=1, used: count/rayclusters.ray.io=1, limited: count/rayclusters.ray.io=1')


@pytest.mark.parametrize("kind, status, message", [
    ("RayCluster", 403, QUOTA),
    ("ConfigMap", 403, 'configmaps "grpo-config" is forbidden: exceeded quota: cm-quota'),
    ("ConfigMap", 422, 'ConfigMap "grpo-config" is invalid: []: Too long: must have at most 1048576 bytes'),
])
def test_a_refused_create_quotes_the_api_server(world, kind, status, message):
    reconciler, kube, _ = world
    kube.refuse[kind] = CreateRefused(kind, "x", status, message)
    outcome = reconciler.reconcile(body())
    ready = {c["type"]: c for c in outcome.status["conditions"]}["ClusterReady"]
    assert (ready["reason"], outcome.status["phase"]) == ("CreateRefused", "Pending")
    assert message in ready["message"] and f"HTTP {status}" in ready["message"]
    assert ("Warning", "CreateRefused", ready["message"]) in [(e.type, e.reason.value, e.message) for e in outcome.events]
    del kube.refuse[kind]  # the quota freed: the next round goes on by itself
    assert reconciler.reconcile(body(status=outcome.status)).status["conditions"][1]["reason"] == "RayClusterCreating"


def test_a_refused_status_is_replaced_by_a_short_one_that_says_why(world):
    """Before: kopf's status patch failed with 422 after every round (and ended the timer)."""
    reconciler, kube, _ = world
    outcome = reconciler.reconcile(body())
    kube.status_limit = len(json.dumps(outcome.status)) - 1  # e.g. a message quoting a huge value
    events = reconciler.write_status(body(), outcome.status)
    (written,) = kube.statuses
    (cond,) = written["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("SpecValid", "False", "StatusRejected")
    assert "Too long" in cond["message"] and written["phase"] == "Pending"
    assert [(e.type, e.reason.value) for e in events] == [("Warning", "StatusRejected")]
    kube.status_limit = 10  # the short one refused too: logged, nothing raised (the timer lives on)
    assert reconciler.write_status(body(), outcome.status) == [] and len(kube.statuses) == 1
    kube.status_limit = None
    assert reconciler.write_status(body(), outcome.status) == [] and kube.statuses[-1] == outcome.status


def test_a_spec_change_updates_the_config_but_keeps_the_running_cluster(world):
    reconciler, kube, jobs = world
    reconciler.reconcile(body())
    make_ready(kube)
    submitted = reconciler.reconcile(body())
    jobs.jobs[submitted.status["rayJobId"]]["status"] = "RUNNING"
    changed = spec_dict()["job"] | {"iterations": 80}
    outcome = reconciler.reconcile(body(status=submitted.status, job=changed))
    assert "iterations: 80" in kube.objects[("ConfigMap", naming.config_map_name(NAME))]["data"]["job.yaml"]
    assert ("RayCluster", NAME) in kube.objects and outcome.status["phase"] == "Running"


def test_an_invalid_spec_releases_the_cluster(world):
    reconciler, kube, _ = world
    reconciler.reconcile(body())
    bad = spec_dict()["job"] | {"training": {"data_parallel_size": 3}}
    outcome = reconciler.reconcile(body(job=bad))
    assert ("RayCluster", NAME) not in kube.objects
    assert outcome.status["phase"] == "Failed"
    assert [e.reason.value for e in outcome.events] == ["ReleasedRayCluster", "InvalidSpec"]


@pytest.mark.parametrize("age, deleted", [(5, False), (60, True)])
def test_finished_jobs_release_the_cluster_and_expire(world, age, deleted):
    reconciler, kube, _ = world
    reconciler.reconcile(body())
    done = {"phase": "Succeeded", "completionTime": (NOW - timedelta(seconds=age)).isoformat()}
    outcome = reconciler.reconcile(body(status=done, ttlSecondsAfterFinished=30))
    assert ("RayCluster", NAME) not in kube.objects
    assert (("delete", "RLJob", NAME) in kube.writes) is deleted
    assert ("TTLExpired" in [e.reason.value for e in outcome.events]) is deleted


def test_deletion_stops_the_running_job(world):
    reconciler, kube, jobs = world
    reconciler.reconcile(body())
    make_ready(kube)
    submitted = reconciler.reconcile(body())
    jobs.jobs[submitted.status["rayJobId"]]["status"] = "RUNNING"
    assert reconciler.stop_for_deletion(body(status=submitted.status)) == submitted.status["rayJobId"]
    assert jobs.jobs[submitted.status["rayJobId"]]["status"] == "STOPPED"
    jobs.down = True  # unreachable: deletion goes ahead anyway
    assert reconciler.stop_for_deletion(body(status=submitted.status)) is None


def test_the_job_logs_last_evaluation_reaches_the_status(world):
    from rldock.contract.progress import format_progress

    reconciler, kube, jobs = world
    first = reconciler.reconcile(body())
    make_ready(kube)
    submitted = reconciler.reconcile(body(status=first.status))
    submission_id = submitted.status["rayJobId"]
    jobs.jobs[submission_id]["status"] = "RUNNING"
    line = {"iteration": 10, "iterations": 40, "reward_mean": 0.5, "tokens_per_s_per_device": 900.0,
            "checkpoint": 10, "val_iteration": 10, "val_reward": 0.75, "val_accuracy": 0.5}
    jobs.logs[submission_id] = "starting\n" + format_progress(line) + "\n"
    running = reconciler.reconcile(body(status=submitted.status))
    assert running.status["lastEvaluation"] == {"iteration": 10, "reward": 0.75, "accuracy": 0.5}
    # the next iteration did not evaluate: its line carries the same evaluation, the status keeps it
    jobs.logs[submission_id] += format_progress({**line, "iteration": 11}) + "\n"
    later = reconciler.reconcile(body(status=running.status))
    assert later.status["iteration"] == 11 and later.status["lastEvaluation"] == running.status["lastEvaluation"]
