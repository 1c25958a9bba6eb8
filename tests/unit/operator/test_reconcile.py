"""Reconciler rounds against in-memory fakes of the Kubernetes API and the Jobs API: which objects
are written, which Events posted, what status results. (The same flows against a real API server:
tests/integration/test_operator.py.)"""

from __future__ import annotations

import base64
import copy
import json
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from rljob_testing import spec_dict

from rldock.contract.failure import FailureReason, FieldProblem, JobFailure, format_failure
from rldock.operator import handlers, naming
from rldock.operator.api import RLJobSpec
from rldock.operator.builders import RLJobRef, build_environment
from rldock.operator.constants import AUTH_SECRET_KEY, JOB_METADATA_WORKER_PODS, LABEL_KUEUE_QUEUE
from rldock.operator.kube import CreateRefused, StatusRejected
from rldock.operator.policy import AdminPolicy, NFSExport
from rldock.operator.rayjobs import RayJobsError, TokenRefused
from rldock.operator.reconcile import Reconciler
from rldock.operator.settings import DashboardAddress, OperatorSettings
from rldock.operator.status import status_changed
from rldock.operator.tokens import job_token

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
NAME, NS, UID = "grpo", "team-a", "0f5c2a6e-1111-2222-3333-444455556666"
KEY = b"k" * 32


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
    """The Kube adapter's interface over a dict; records every write and every read."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: list[dict[str, Any]] = []
        self.writes: list[tuple[str, str, str]] = []
        self.reads: list[tuple[str, str]] = []  # (verb, kind)
        self.refuse: dict[str, CreateRefused] = {}  # kind -> what the API server answers a create with
        self.status_limit: int | None = None  # a status whose JSON is longer is refused (422)
        self.statuses: list[dict[str, Any]] = []  # status patches, in order
        self._uids = 0

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append(("get", kind))
        obj = self.objects.get((kind, name))
        return copy.deepcopy(obj) if obj is not None else None

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
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

    def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        self.writes.append(("delete", kind, name))
        return self.objects.pop((kind, name), None) is not None or kind == "RLJob"

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        self.reads.append(("list", "Pod"))
        return [p for p in self.pods if labels.items() <= p["metadata"]["labels"].items()]

    def list_deployments(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        self.reads.append(("list", "Deployment"))
        return [
            copy.deepcopy(obj)
            for (kind, _), obj in self.objects.items()
            if kind == "Deployment" and labels.items() <= obj["metadata"]["labels"].items()
        ]

    def patch_rljob_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        if self.status_limit is not None and len(json.dumps(patch)) > self.status_limit:
            raise StatusRejected('HTTP 422: RLJob.rldock.io "grpo" is invalid: status: Too long')
        self.statuses.append(dict(patch))


class FakeJobs:
    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.logs: dict[str, str] = {}
        self.tokens: list[str | None] = []
        self.down = False

    def client(self, url: str, token: str | None) -> FakeJobs:
        self.tokens.append(token)
        return self

    def _check(self) -> None:
        if self.down:
            raise RayJobsError("GET http://10.0.0.9:8265/api/jobs/x: connection refused")

    def get_job(self, submission_id: str) -> dict[str, Any] | None:
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


_GENERATIONS: dict[str, int] = {}  # each distinct spec's generation, as the API server counts them


def generation_of(spec: Mapping[str, Any]) -> int:
    """A generation per distinct spec: the same spec has the same one, another spec another (the
    reconciler works a generation's spec out once, desired.py)."""
    return _GENERATIONS.setdefault(json.dumps(spec, sort_keys=True), len(_GENERATIONS) + 1)


def body(*, status: dict | None = None, **sections: Any) -> dict[str, Any]:
    spec = spec_dict(**sections)
    return {
        "apiVersion": "rldock.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": NAME, "namespace": NS, "uid": UID, "generation": generation_of(spec)},
        "spec": spec,
        "status": status or {},
    }


def make_world(**settings: Any) -> tuple[Reconciler, FakeKube, FakeJobs]:
    kube, jobs = FakeKube(), FakeJobs()
    settings = OperatorSettings(dashboard_address=DashboardAddress.POD_IP, token_key=KEY, **settings)
    return Reconciler(kube, settings, jobs_client=jobs.client, clock=lambda: NOW), kube, jobs


@pytest.fixture
def world() -> tuple[Reconciler, FakeKube, FakeJobs]:
    return make_world()


def make_ready(kube: FakeKube, num_workers: int = 2) -> None:
    """What KubeRay and the kubelets do: pods Running and Ready, the RayCluster's status."""
    cluster = kube.objects[("RayCluster", NAME)]
    cluster["status"] = {"state": "ready", "head": {"podIP": "10.0.0.9"}, "endpoints": {"dashboard": "8265"}}
    owner = [{"uid": cluster["metadata"]["uid"], "controller": True}]
    ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    kube.pods = [
        {
            "metadata": {
                "name": f"{NAME}-{role}-{i}",
                "ownerReferences": owner,
                "labels": {"ray.io/cluster": NAME, "ray.io/node-type": role},
            },
            "status": ready,
        }
        for role, count in (("head", 1), ("worker", num_workers))
        for i in range(count)
    ]


def test_first_round_creates_the_children_and_says_pending(world):
    reconciler, kube, _ = world
    outcome = reconciler.reconcile(body())
    assert [w for w in kube.writes if w[0] == "create"] == [
        ("create", "Secret", naming.auth_secret_name(NAME, UID)),
        ("create", "ConfigMap", naming.config_map_name(NAME)),
        ("create", "NetworkPolicy", naming.network_policy_name(NAME)),
        ("create", "RayCluster", NAME),
    ]
    assert outcome.status["phase"] == "Pending"
    assert [e.reason.value for e in outcome.events] == [
        "CreatedAuthSecret",
        "CreatedConfigMap",
        "CreatedNetworkPolicy",
        "CreatedRayCluster",
    ]
    token = base64.b64decode(kube.objects[("Secret", naming.auth_secret_name(NAME, UID))]["data"][AUTH_SECRET_KEY])
    assert token.decode() == job_token(KEY, RLJobRef(NAME, NS, UID)) and len(token) == 64
    # Later rounds create the Secret no more and never read it.
    reconciler.reconcile(body(status=outcome.status))
    assert kube.writes.count(("create", "Secret", naming.auth_secret_name(NAME, UID))) == 1


def test_a_ready_cluster_gets_the_job_with_the_rljobs_token(world):
    reconciler, kube, jobs = world
    reconciler.reconcile(body())
    make_ready(kube)
    outcome = reconciler.reconcile(body())
    submission_id = naming.ray_job_submission_id(NAME, UID, attempt=0)
    assert jobs.jobs[submission_id]["metadata"][JOB_METADATA_WORKER_PODS] == f"{NAME}-worker-0,{NAME}-worker-1"
    secret = kube.objects[("Secret", naming.auth_secret_name(NAME, UID))]
    assert jobs.tokens[-1] == base64.b64decode(secret["data"][AUTH_SECRET_KEY]).decode()
    # Any replica or restart of the operator derives the same token from its key.
    assert jobs.tokens[-1] == make_world()[0]._token(RLJobRef(NAME, NS, UID))
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


def test_a_worker_pod_drained_alone_ends_the_attempt_as_a_preemption_counting_no_restart(world):
    """maxRestarts 0: a worker pod of the running attempt is deleted (its preStop hook has the driver save the
    iteration under way): Preempted=True (WorkerPodDeleted) while it goes; once it is gone the attempt is stopped
    and the next one (attempt 1, a new submission id on the same head) submitted with no restart counted, and
    Preempted=False (Resumed) once it runs. A worker lost with no deletion seen still counts a restart."""
    reconciler, kube, jobs = world
    first = reconciler.reconcile(body())
    make_ready(kube)
    submitted = reconciler.reconcile(body(status=first.status))
    job_id = submitted.status["rayJobId"]
    jobs.jobs[job_id]["status"] = "RUNNING"
    running = reconciler.reconcile(body(status=submitted.status))
    drained = f"{NAME}-worker-1"
    pod = next(p for p in kube.pods if p["metadata"]["name"] == drained)
    pod["metadata"]["deletionTimestamp"] = "2026-03-01T12:00:00Z"  # its hook keeps it up while the driver saves
    draining = reconciler.reconcile(body(status=running.status))
    preempted = {c["type"]: c for c in draining.status["conditions"]}["Preempted"]
    assert (draining.status["phase"], preempted["status"], preempted["reason"]) == (
        "Running",
        "True",
        "WorkerPodDeleted",
    )
    assert drained in preempted["message"] and ("Warning", "Preempted") in [
        (e.type, e.reason.value) for e in draining.events
    ]
    assert jobs.jobs[job_id]["status"] == "RUNNING"  # the driver is left to save the iteration under way

    kube.pods.remove(pod)  # gone; KubeRay's replacement comes up under a new name
    kube.pods.append({**pod, "metadata": {**pod["metadata"], "name": f"{NAME}-worker-2", "deletionTimestamp": None}})
    ended = reconciler.reconcile(body(status=draining.status))
    assert jobs.jobs[job_id]["status"] == "STOPPED"
    assert (ended.status["restartCount"], ended.status["attempt"]) == (0, 1)
    assert ended.status["phase"] == "Provisioning" and "Retrying" not in [e.reason.value for e in ended.events]
    resubmitted = reconciler.reconcile(body(status=ended.status))
    next_id = naming.ray_job_submission_id(NAME, UID, attempt=1)
    assert resubmitted.status["rayJobId"] == next_id and resubmitted.status["restartCount"] == 0
    # That attempt failing before a round saw it run is a failure, counted: no retry without end.
    jobs.jobs[next_id]["status"] = "FAILED"
    failed_at_once = reconciler.reconcile(body(status=resubmitted.status))
    assert (failed_at_once.status["restartCount"], failed_at_once.status["attempt"]) == (1, 2)
    jobs.jobs[next_id]["status"] = "RUNNING"
    resumed = reconciler.reconcile(body(status=resubmitted.status))
    preempted = {c["type"]: c for c in resumed.status["conditions"]}["Preempted"]
    assert (resumed.status["phase"], preempted["status"], preempted["reason"]) == ("Running", "False", "Resumed")

    # The next attempt's worker lost with no deletion seen: a failure, counted (restart 1, attempt 2).
    kube.pods = [p for p in kube.pods if p["metadata"]["name"] != f"{NAME}-worker-0"]
    lost = reconciler.reconcile(body(status=resumed.status))
    assert (lost.status["phase"], lost.status["restartCount"], lost.status["attempt"]) == ("Retrying", 1, 2)


def test_a_job_that_refused_its_inputs_fails_at_once(world):
    """The runtime's failure line in the failed job's log: Failed with its reason, no restart."""
    reconciler, kube, jobs = world
    first = reconciler.reconcile(body())
    make_ready(kube)
    submitted = reconciler.reconcile(body(status=first.status))
    job_id = submitted.status["rayJobId"]
    jobs.jobs[job_id]["status"] = "FAILED"
    jobs.logs[job_id] = (
        "invalid job config:\n"
        + format_failure(
            JobFailure(FailureReason.PATH_NOT_FOUND, (FieldProblem("model.path", "/models/x does not exist"),))
        )
        + "\n"
    )
    outcome = reconciler.reconcile(body(status=submitted.status))
    assert outcome.status["phase"] == "Failed" and outcome.status["restartCount"] == 0
    failed = {c["type"]: c for c in outcome.status["conditions"]}["Failed"]
    assert failed["reason"] == "PathNotFound" and "spec.job.model.path: /models/x does not exist" in failed["message"]
    assert ("Warning", "PathNotFound") in [(e.type, e.reason.value) for e in outcome.events]
    assert ("delete", "RayCluster", NAME) in kube.writes


def test_an_unowned_child_is_reported_never_adopted(world):
    """A ConfigMap of the job config's name, labelled as this RLJob's but made by someone else: taking
    it over would let whoever made it choose what the job reads. The round reports it instead."""
    reconciler, kube, _ = world
    name = naming.config_map_name(NAME)
    planted = {
        "kind": "ConfigMap",
        "metadata": {"name": name, "uid": "cm", "labels": {"rldock.io/rljob": NAME}},
        "data": {"job.yaml": "planted"},
    }
    kube.objects[("ConfigMap", name)] = copy.deepcopy(planted)
    outcome = reconciler.reconcile(body())
    assert kube.objects[("ConfigMap", name)] == planted  # neither adopted nor brought up to date
    ready = {c["type"]: c for c in outcome.status["conditions"]}["ClusterReady"]
    assert ready["reason"] == "NameConflict" and f"ConfigMap {name}" in ready["message"]
    assert "not adopted" in ready["message"] and "no controller" in ready["message"]
    assert ("RayCluster", NAME) not in kube.objects


FOREIGN_OWNER = [{"kind": "RLJob", "name": NAME, "uid": "older-rljob", "controller": True}]


@pytest.mark.parametrize(
    "kind, name",
    [
        ("ConfigMap", naming.config_map_name(NAME)),
        ("NetworkPolicy", naming.network_policy_name(NAME)),
        ("RayCluster", naming.ray_cluster_name(NAME)),
    ],
)
def test_a_name_taken_by_someone_else_is_a_condition_and_a_warning(world, kind, name):
    """Before: the round was skipped, so the RLJob waited forever with no phase, condition or Event."""
    reconciler, kube, _ = world
    if kind == "RayCluster":
        reconciler.reconcile(body())  # the ConfigMap and NetworkPolicy are this RLJob's
    kube.objects[(kind, name)] = {
        "kind": kind,
        "metadata": {"name": name, "uid": "x", "ownerReferences": FOREIGN_OWNER},
    }
    outcome = reconciler.reconcile(body())
    ready = {c["type"]: c for c in outcome.status["conditions"]}["ClusterReady"]
    assert outcome.status["phase"] == "Pending"
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict")
    assert f"{kind} {name}" in ready["message"] and "older-rljob" in ready["message"]
    assert [(e.type, e.reason.value) for e in outcome.events if e.type == "Warning"] == [("Warning", "NameConflict")]
    assert kube.objects[(kind, name)]["metadata"]["ownerReferences"] == FOREIGN_OWNER  # left alone
    again = reconciler.reconcile(body(status=outcome.status))
    assert again.status == outcome.status and again.events == []  # one Event, not one per round


QUOTA = (
    'rayclusters.ray.io "grpo" is forbidden: exceeded quota: team-quota, requested: '
    "count/rayclusters.ray.io=1, used: count/rayclusters.ray.io=1, limited: count/rayclusters.ray.io=1"
)


@pytest.mark.parametrize(
    "kind, status, message",
    [
        ("RayCluster", 403, QUOTA),
        ("ConfigMap", 403, 'configmaps "grpo-config" is forbidden: exceeded quota: cm-quota'),
        ("ConfigMap", 422, 'ConfigMap "grpo-config" is invalid: []: Too long: must have at most 1048576 bytes'),
    ],
)
def test_a_refused_create_quotes_the_api_server(world, kind, status, message):
    reconciler, kube, _ = world
    kube.refuse[kind] = CreateRefused(kind, "x", status, message)
    outcome = reconciler.reconcile(body())
    ready = {c["type"]: c for c in outcome.status["conditions"]}["ClusterReady"]
    assert (ready["reason"], outcome.status["phase"]) == ("CreateRefused", "Pending")
    assert message in ready["message"] and f"HTTP {status}" in ready["message"]
    assert ("Warning", "CreateRefused", ready["message"]) in [
        (e.type, e.reason.value, e.message) for e in outcome.events
    ]
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
    line = {
        "iteration": 10,
        "iterations": 40,
        "reward_mean": 0.5,
        "tokens_per_s_per_device": 900.0,
        "checkpoint": 10,
        "val_iteration": 10,
        "val_reward": 0.75,
        "val_accuracy": 0.5,
    }
    jobs.logs[submission_id] = "starting\n" + format_progress(line) + "\n"
    running = reconciler.reconcile(body(status=submitted.status))
    assert running.status["lastEvaluation"] == {"iteration": 10, "reward": 0.75, "accuracy": 0.5}
    # the next iteration did not evaluate: its line carries the same evaluation, the status keeps it
    jobs.logs[submission_id] += format_progress({**line, "iteration": 11}) + "\n"
    later = reconciler.reconcile(body(status=running.status))
    assert later.status["iteration"] == 11 and later.status["lastEvaluation"] == running.status["lastEvaluation"]


def test_a_spec_outside_the_admins_policy_fails_naming_the_field_and_creates_nothing():
    host_root = {
        "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
        "volumeMounts": [{"name": "root", "mountPath": "/host"}],
    }
    reconciler, kube, _ = make_world()
    outcome = reconciler.reconcile(body(**host_root))
    assert outcome.status["phase"] == "Failed" and kube.writes == []
    failed = {c["type"]: c for c in outcome.status["conditions"]}["Failed"]
    assert failed["reason"] == "PolicyDenied"
    assert "spec.volumes[0].hostPath.path" in failed["message"] and "policy.hostPathPrefixes" in failed["message"]
    assert [(e.type, e.reason.value) for e in outcome.events] == [("Warning", "PolicyDenied")]

    # The admin allows the prefix: the same RLJob (its Failed status as it was) goes ahead.
    allowed, kube, _ = make_world(policy=AdminPolicy(host_path_prefixes=["/"]))
    resumed = allowed.reconcile(body(status=outcome.status, **host_root))
    assert resumed.status["phase"] == "Pending" and ("create", "RayCluster", NAME) in kube.writes
    (volume,) = [
        v
        for v in kube.objects[("RayCluster", NAME)]["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
        if v["name"] == "root"
    ]
    assert volume["hostPath"] == {"path": "/"}


@pytest.mark.parametrize(
    "sections, field, setting",
    [
        ({"image": "registry.example.com/ml-evil/x:1"}, "spec.image", "policy.imagePrefixes"),
        (
            {
                "volumes": [{"name": "data", "nfs": {"server": "nfs.example.com", "path": "/"}}],
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            },
            "spec.volumes[0].nfs",
            "policy.nfsExports",
        ),
        (
            {"cluster": {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]}},
            "spec.cluster.tolerations[0]",
            "policy.tolerations",
        ),
        ({"scheduling": {"gang": "volcano"}}, "spec.scheduling.gang", "policy.schedulerNames"),
    ],
)
def test_without_the_webhook_the_new_rules_fail_the_rljob_naming_the_field(sections, field, setting):
    """The webhook off: the image-prefix, NFS-export, control-plane and scheduler rules surface as
    every policy refusal does, a PolicyDenied condition and Warning Event, with nothing created."""
    reconciler, kube, _ = make_world(
        policy=AdminPolicy(
            image_prefixes=["registry.example.com/ml"],
            nfs_exports=[NFSExport(server="nfs.example.com", path="/exports/team-a")],
        )
    )
    outcome = reconciler.reconcile(body(**sections))
    assert outcome.status["phase"] == "Failed" and kube.writes == []
    failed = {c["type"]: c for c in outcome.status["conditions"]}["Failed"]
    assert failed["reason"] == "PolicyDenied" and f"{field}: " in failed["message"] and setting in failed["message"]
    assert [(e.type, e.reason.value) for e in outcome.events] == [("Warning", "PolicyDenied")]
    assert field in outcome.events[0].message


def _running(reconciler: Reconciler, kube: FakeKube, jobs: FakeJobs) -> dict[str, Any]:
    first = reconciler.reconcile(body())
    make_ready(kube)
    submitted = reconciler.reconcile(body(status=first.status))
    jobs.jobs[submitted.status["rayJobId"]]["status"] = "RUNNING"
    running = reconciler.reconcile(body(status=submitted.status))
    assert running.status["phase"] == "Running"
    return running.status


def _settled(reconciler: Reconciler, kube: FakeKube, raw: dict[str, Any]) -> dict[str, Any]:
    """Rounds of `raw`, each status written as the handlers write it, until a round changes nothing
    in the status; the body the next round would get."""
    for _ in range(5):
        status = reconciler.reconcile(raw).status
        if status is None or not status_changed(raw["status"], status):
            return raw
        reconciler.write_status(raw, status)
        raw = {**raw, "status": status}
    raise AssertionError(f"the status never settled: {raw['status']}")


def _provisioning(reconciler: Reconciler, kube: FakeKube, jobs: FakeJobs) -> dict[str, Any]:
    return _settled(reconciler, kube, body())


def _running_body(reconciler: Reconciler, kube: FakeKube, jobs: FakeJobs) -> dict[str, Any]:
    status = _running(reconciler, kube, jobs)
    return _settled(reconciler, kube, body(status=status))


def _suspended(reconciler: Reconciler, kube: FakeKube, jobs: FakeJobs) -> dict[str, Any]:
    raw = _settled(reconciler, kube, body())
    return _settled(reconciler, kube, body(status=raw["status"], suspend=True))


def _invalid(reconciler: Reconciler, kube: FakeKube, jobs: FakeJobs) -> dict[str, Any]:
    return _settled(reconciler, kube, body(job=spec_dict()["job"] | {"training": {"data_parallel_size": 3}}))


def _with_environments(reconciler: Reconciler, kube: FakeKube, jobs: FakeJobs) -> dict[str, Any]:
    sections = {"job": _agent_job(), "environments": [CABINET, SANDBOX]}
    raw = _settled(reconciler, kube, body(**sections))
    _ready(kube, "cabinet", 2)
    return _settled(reconciler, kube, body(status=raw["status"], **sections))


IDLE_READS = [("get", "ConfigMap"), ("get", "NetworkPolicy"), ("get", "RayCluster"), ("list", "Pod")]


@pytest.mark.parametrize(
    "reach, reads",
    [
        (_provisioning, IDLE_READS),  # waiting for its cluster, as the 100 jobs of operator_idle
        (_running_body, IDLE_READS),  # and the Jobs API, which FakeJobs answers
        (_suspended, IDLE_READS),
        (_invalid, [("get", "RayCluster")]),
        (
            _with_environments,
            [
                ("get", "ConfigMap"),
                ("get", "NetworkPolicy"),
                ("get", "RayCluster"),
                ("list", "Pod"),
                *[("get", "NetworkPolicy"), ("get", "Service"), ("get", "Deployment")] * 2,
                ("list", "Deployment"),
            ],
        ),
    ],
)
def test_a_round_of_an_unchanged_rljob_writes_nothing_and_works_nothing_out_again(reach, reads):
    """Issue 52: a round of an RLJob whose observed state did not change makes no API write (no
    create, patch or delete of a child, no status patch: the round goes through the handlers'
    `reconcile`, which patches the status only when it changed), does not parse its spec or build
    its children again, and reads only what it must look at for a change."""
    reconciler, kube, jobs = make_world(policy=ENV_POLICY)
    raw = reach(reconciler, kube, jobs)
    writes, statuses, worked_out = len(kube.writes), len(kube.statuses), reconciler.desired.worked_out
    kube.reads.clear()
    for _ in range(3):
        status = handlers.reconcile(copy.deepcopy(raw), reconciler, logging.getLogger("test"))
        assert status is not None and not status_changed(raw["status"], status)
    assert kube.writes[writes:] == [] and len(kube.statuses) == statuses
    assert reconciler.desired.worked_out == worked_out
    assert kube.reads == reads * 3


def test_a_spec_is_worked_out_once_per_generation_and_forgotten_with_the_rljob(world):
    reconciler, kube, jobs = world
    raw = _settled(reconciler, kube, body())
    assert reconciler.desired.worked_out == 1 and len(reconciler.desired) == 1
    changed = body(status=raw["status"], job=spec_dict()["job"] | {"iterations": 80})  # a new generation
    reconciler.reconcile(changed)
    reconciler.reconcile(changed)
    assert reconciler.desired.worked_out == 2 and len(reconciler.desired) == 1
    reconciler.stop_for_deletion(changed)
    assert len(reconciler.desired) == 0


def _suspend_from_outside(kube: FakeKube, jobs: FakeJobs, suspend: bool) -> None:
    """What Kueue (preempting) or an admin does: spec.suspend, and KubeRay deleting the pods."""
    kube.objects[("RayCluster", NAME)]["spec"]["suspend"] = suspend
    if suspend:
        kube.pods, jobs.jobs = [], {}  # the head went, and its job table with it


def test_a_suspend_by_someone_else_counts_no_restart_and_is_not_undone(world):
    reconciler, kube, jobs = world
    status = _running(reconciler, kube, jobs)
    _suspend_from_outside(kube, jobs, True)
    suspended = reconciler.reconcile(body(status=status))
    assert suspended.status["phase"] == "Suspended" and suspended.status["restartCount"] == 0
    condition = {c["type"]: c for c in suspended.status["conditions"]}["Suspended"]
    assert condition["reason"] == "SuspendedExternally"
    assert ("Warning", "SuspendedExternally") in [(e.type, e.reason.value) for e in suspended.events]
    again = reconciler.reconcile(body(status=suspended.status))
    assert kube.objects[("RayCluster", NAME)]["spec"]["suspend"] is True  # theirs to undo
    assert not [w for w in kube.writes if w[:2] == ("patch", "RayCluster")]

    _suspend_from_outside(kube, jobs, False)
    make_ready(kube)
    resumed = reconciler.reconcile(body(status=again.status))
    assert resumed.status["restartCount"] == 0
    assert resumed.status["rayJobId"] == naming.ray_job_submission_id(NAME, UID, attempt=0)  # the same attempt
    assert "Resumed" in [e.reason.value for e in resumed.events]


def test_the_operator_undoes_only_its_own_suspend(world):
    reconciler, kube, jobs = world
    status = _running(reconciler, kube, jobs)
    suspended = reconciler.reconcile(body(status=status, suspend=True))
    cluster = kube.objects[("RayCluster", NAME)]
    assert cluster["spec"]["suspend"] is True and cluster["metadata"]["annotations"]["rldock.io/suspended-by"]
    kube.pods, jobs.jobs = [], {}
    resumed = reconciler.reconcile(body(status=suspended.status))
    assert cluster["spec"]["suspend"] is False and "rldock.io/suspended-by" not in cluster["metadata"]["annotations"]
    assert resumed.status["restartCount"] == 0


def test_kueue_preemption_while_running_counts_no_restart():
    # The default policy lists no queue (policy.queues: []): the admin allows this one.
    reconciler, kube, jobs = make_world(policy=AdminPolicy(queues=["team-a"]))
    kueue = {"scheduling": {"gang": "kueue", "queue": "team-a"}}
    first = reconciler.reconcile(body(**kueue))
    assert kube.objects[("RayCluster", NAME)]["spec"]["suspend"] is True  # created for Kueue to admit
    _suspend_from_outside(kube, jobs, False)  # admitted
    make_ready(kube)
    submitted = reconciler.reconcile(body(status=first.status, **kueue))
    jobs.jobs[submitted.status["rayJobId"]]["status"] = "RUNNING"
    running = reconciler.reconcile(body(status=submitted.status, **kueue))
    _suspend_from_outside(kube, jobs, True)  # preempted
    preempted = reconciler.reconcile(body(status=running.status, **kueue))
    ready = {c["type"]: c for c in preempted.status["conditions"]}["ClusterReady"]
    assert (preempted.status["phase"], ready["reason"]) == ("Pending", "WaitingForAdmission")
    assert preempted.status["restartCount"] == 0
    _suspend_from_outside(kube, jobs, False)  # admitted again
    make_ready(kube)
    again = reconciler.reconcile(body(status=preempted.status, **kueue))
    assert again.status["restartCount"] == 0 and again.status["rayJobId"].endswith("-0")


def test_a_spec_change_while_kueue_holds_the_cluster_replaces_it_before_admission():
    """A cluster Kueue holds suspended is a job waiting for admission, for the status and the actions
    alike: a spec edited meanwhile replaces the queued cluster (the actions once read it as someone
    else's suspend and did nothing, so Kueue admitted the old cluster, which was replaced only then)."""
    reconciler, kube, jobs = make_world(policy=AdminPolicy(queues=["team-a"], image_prefixes=["registry.example/"]))
    kueue = {"scheduling": {"gang": "kueue", "queue": "team-a"}}
    first = reconciler.reconcile(body(**kueue))
    queued = kube.objects[("RayCluster", NAME)]
    assert queued["spec"]["suspend"] is True  # created for Kueue to admit
    edited = reconciler.reconcile(body(status=first.status, image="registry.example/rldock:edited", **kueue))
    ready = {c["type"]: c for c in edited.status["conditions"]}["ClusterReady"]
    assert (edited.status["phase"], ready["reason"]) == ("Pending", "WaitingForAdmission")
    assert ("delete", "RayCluster", NAME) in kube.writes
    assert "ReplacedRayCluster" in [e.reason.value for e in edited.events]
    again = reconciler.reconcile(body(status=edited.status, image="registry.example/rldock:edited", **kueue))
    assert kube.objects[("RayCluster", NAME)]["spec"]["suspend"] is True  # queued again, with the new spec
    assert "CreatedRayCluster" in [e.reason.value for e in again.events]


def test_a_queue_change_while_kueue_holds_the_cluster_moves_it_to_the_new_queue():
    """The queue is a label of the RayCluster, outside the spec-hash: moving a queued job to another
    queue replaces its cluster too, or Kueue admits it from the old queue, under the old quota."""
    reconciler, kube, _ = make_world(
        policy=AdminPolicy(queues=["team-a", "team-b"], image_prefixes=["registry.example/"])
    )
    first = reconciler.reconcile(body(scheduling={"gang": "kueue", "queue": "team-a"}))
    assert kube.objects[("RayCluster", NAME)]["metadata"]["labels"][LABEL_KUEUE_QUEUE] == "team-a"
    moved = reconciler.reconcile(body(status=first.status, scheduling={"gang": "kueue", "queue": "team-b"}))
    assert ("delete", "RayCluster", NAME) in kube.writes
    assert "ReplacedRayCluster" in [e.reason.value for e in moved.events]
    reconciler.reconcile(body(status=moved.status, scheduling={"gang": "kueue", "queue": "team-b"}))
    queued = kube.objects[("RayCluster", NAME)]
    assert (queued["metadata"]["labels"][LABEL_KUEUE_QUEUE], queued["spec"]["suspend"]) == ("team-b", True)


def test_an_rljob_managed_by_another_controller_is_left_alone(world):
    reconciler, kube, _ = world
    outcome = reconciler.reconcile(body(managedBy="kueue.x-k8s.io/multikueue"))
    assert outcome.status is None and outcome.events == [] and kube.writes == []
    assert reconciler.reconcile(body(managedBy="rldock.io/rljob-operator")).status["phase"] == "Pending"


def test_the_network_policy_is_put_back_when_edited_and_skipped_when_off():
    reconciler, kube, _ = make_world(
        operator_namespace="rldock-system", operator_pod_labels=(("app.kubernetes.io/name", "rldock"),)
    )
    reconciler.reconcile(body())
    policy = kube.objects[("NetworkPolicy", naming.network_policy_name(NAME))]
    assert len(policy["spec"]["ingress"]) == 2
    policy["spec"]["ingress"] = [{}]  # someone opened it to everything
    reconciler.reconcile(body())
    assert len(kube.objects[("NetworkPolicy", naming.network_policy_name(NAME))]["spec"]["ingress"]) == 2

    off, kube, _ = make_world(network_policy=False)
    off.reconcile(body())
    assert ("NetworkPolicy", naming.network_policy_name(NAME)) not in kube.objects


def test_a_head_that_refuses_the_derived_token_is_a_condition_and_the_secret_is_made_again(world):
    """The Secret held another token (made before the RLJob, or under an earlier key): the operator,
    which cannot read it, says what to do, and makes it again once someone deleted it."""
    reconciler, kube, jobs = world
    first = reconciler.reconcile(body())
    make_ready(kube)

    def refuse(submission_id):
        raise TokenRefused("GET http://10.0.0.9:8265/api/jobs/x: 401, the Ray cluster refused the auth token")

    jobs.get_job = refuse
    outcome = reconciler.reconcile(body(status=first.status))
    ready = {c["type"]: c for c in outcome.status["conditions"]}["ClusterReady"]
    assert (
        ready["reason"] == "TokenRefused" and f"Delete Secret {naming.auth_secret_name(NAME, UID)}" in ready["message"]
    )
    assert ("Warning", "TokenRefused") in [(e.type, e.reason.value) for e in outcome.events]
    del kube.objects[("Secret", naming.auth_secret_name(NAME, UID))]  # what the message says to do
    reconciler.reconcile(body(status=outcome.status))
    assert kube.writes.count(("create", "Secret", naming.auth_secret_name(NAME, UID))) == 2


# --- spec.environments ---------------------------------------------------------------------------------

CABINET = {"name": "cabinet", "image": "registry.example.com/envs/cabinet:1", "port": 9000, "replicas": 2}
SANDBOX = {"name": "sandbox", "command": ["rldock", "env", "serve", "m:C", "--port", "8000"]}
ENV_POLICY = AdminPolicy(image_prefixes=["registry.example.com/envs/"])


def _agent_job() -> dict[str, Any]:
    job = spec_dict()["job"]
    job["data"] = {"generator": {"name": "addition"}, "chat_template": "model"}
    job["algorithm"]["max_response_length"] = 512
    job["agent"] = {
        "tools": [{"name": "python"}],
        "environment": {"name": "openenv", "servers": {"service": "cabinet"}},
        "sandbox": {"servers": {"service": "sandbox"}},
    }
    return job


def _env(name: str) -> str:
    return naming.environment_name(NAME, name)


def _ready(kube: FakeKube, name: str, ready: int) -> None:
    """What the Deployment controller writes once `ready` pods pass their readiness probe."""
    kube.objects[("Deployment", _env(name))]["status"] = {"readyReplicas": ready}


def test_each_environment_gets_its_policy_service_and_deployment_and_pods_once_admitted():
    reconciler, kube, _ = make_world(policy=ENV_POLICY)
    outcome = reconciler.reconcile(body(job=_agent_job(), environments=[CABINET, SANDBOX]))
    created = [w[1:] for w in kube.writes if w[0] == "create"]
    assert created == [
        ("Secret", naming.auth_secret_name(NAME, UID)),
        ("Secret", naming.environment_token_secret_name(NAME, UID)),  # before any pod that reads it
        ("ConfigMap", naming.config_map_name(NAME)),
        ("NetworkPolicy", naming.network_policy_name(NAME)),
        ("ServiceAccount", naming.environment_service_account_name(NAME)),
        ("NetworkPolicy", _env("cabinet")),
        ("Service", _env("cabinet")),
        ("Deployment", _env("cabinet")),
        ("NetworkPolicy", _env("sandbox")),
        ("Service", _env("sandbox")),
        ("Deployment", _env("sandbox")),
        ("RayCluster", NAME),
    ]
    # No pod before the job is admitted: here its RayCluster did not exist yet.
    assert [kube.objects[("Deployment", _env(n))]["spec"]["replicas"] for n in ("cabinet", "sandbox")] == [0, 0]
    assert outcome.status["environmentsReady"] == "0/0"
    events = [e for e in outcome.events if e.reason.value == "CreatedEnvironment"]
    assert len(
        events
    ) == 2 and "2 pod(s) of registry.example.com/envs/cabinet:1 on port 9000, started once the job is admitted" in (
        events[0].message
    )
    assert "CreatedEnvironmentToken" in [e.reason.value for e in outcome.events]
    job_yaml = kube.objects[("ConfigMap", naming.config_map_name(NAME))]["data"]["job.yaml"]
    assert f"url: http://{_env('cabinet')}.{NS}.svc.cluster.local:9000" in job_yaml
    assert f"url: http://{_env('sandbox')}.{NS}.svc.cluster.local:8000" in job_yaml

    # The cluster is there and not suspended: admitted; the pods are asked for, nothing else is written.
    writes = len(kube.writes)
    admitted = reconciler.reconcile(body(job=_agent_job(), environments=[CABINET, SANDBOX], status=outcome.status))
    assert [w for w in kube.writes[writes:] if w[0] != "patch" or w[1] != "Deployment"] == []
    assert [kube.objects[("Deployment", _env(n))]["spec"]["replicas"] for n in ("cabinet", "sandbox")] == [2, 1]
    assert admitted.status["environmentsReady"] == "0/3"

    _ready(kube, "cabinet", 2)
    _ready(kube, "sandbox", 1)
    writes = len(kube.writes)
    again = reconciler.reconcile(body(job=_agent_job(), environments=[CABINET, SANDBOX], status=admitted.status))
    assert again.status["environmentsReady"] == "3/3"
    assert again.status["environments"] == [
        {"name": "cabinet", "replicas": 2, "readyReplicas": 2},
        {"name": "sandbox", "replicas": 1, "readyReplicas": 1},
    ]
    assert kube.writes[writes:] == []  # nothing differs: nothing patched


@pytest.mark.parametrize(
    "scheduling, cluster_suspended, head_node, pods",
    [
        ({}, False, None, 2),
        ({"gang": "kueue", "queue": "team-a"}, True, None, 0),  # waiting in Kueue's queue
        ({"gang": "kueue", "queue": "team-a"}, False, None, 2),  # Kueue admitted (unsuspended) it
        ({"gang": "volcano", "queue": "q1"}, False, None, 0),  # the gang's pods wait for Volcano
        ({"gang": "volcano", "queue": "q1"}, False, "node-1", 2),  # Volcano bound them
    ],
    ids=["default", "kueue-queued", "kueue-admitted", "volcano-queued", "volcano-admitted"],
)
def test_the_environments_hold_no_pod_while_the_job_is_queued(scheduling, cluster_suspended, head_node, pods):
    policy = AdminPolicy(image_prefixes=["registry.example.com/envs/"], queues=None, scheduler_names=None)
    reconciler, kube, _ = make_world(policy=policy)
    sections = {"environments": [CABINET], "scheduling": scheduling}
    first = reconciler.reconcile(body(**sections))
    cluster = kube.objects[("RayCluster", NAME)]
    cluster["spec"]["suspend"] = cluster_suspended  # as Kueue keeps it until it admits it
    head = {"name": f"{NAME}-head-0", "labels": {"ray.io/cluster": NAME, "ray.io/node-type": "head"}}
    head["ownerReferences"] = [{"uid": cluster["metadata"]["uid"], "controller": True}]
    kube.pods = [{"metadata": head, "spec": {"nodeName": head_node} if head_node else {}, "status": {}}]
    outcome = reconciler.reconcile(body(status=first.status, **sections))
    assert kube.objects[("Deployment", _env("cabinet"))]["spec"]["replicas"] == pods
    assert outcome.status["environments"] == [{"name": "cabinet", "replicas": pods, "readyReplicas": 0}]


def test_without_network_policies_the_environments_get_none():
    reconciler, kube, _ = make_world(policy=ENV_POLICY, network_policy=False)
    reconciler.reconcile(body(environments=[CABINET]))
    assert [w[1] for w in kube.writes if w[0] == "create"] == [
        "Secret",
        "Secret",
        "ConfigMap",
        "ServiceAccount",
        "Service",
        "Deployment",
        "RayCluster",
    ]


def test_suspend_scales_the_environments_to_zero_and_resume_restores_them():
    reconciler, kube, _ = make_world(policy=ENV_POLICY)
    first = reconciler.reconcile(body(environments=[CABINET, SANDBOX]))
    running = reconciler.reconcile(body(environments=[CABINET, SANDBOX], status=first.status))
    assert [kube.objects[("Deployment", _env(n))]["spec"]["replicas"] for n in ("cabinet", "sandbox")] == [2, 1]
    suspended = reconciler.reconcile(body(environments=[CABINET, SANDBOX], suspend=True, status=running.status))
    assert [kube.objects[("Deployment", _env(n))]["spec"]["replicas"] for n in ("cabinet", "sandbox")] == [0, 0]
    assert suspended.status["phase"] == "Suspended" and suspended.status["environmentsReady"] == "0/0"
    # Only the count changed: the pods' template (and so its pods' identity) is left as it was.
    assert kube.objects[("Deployment", _env("cabinet"))]["metadata"]["annotations"] == first_annotations(kube)
    # Resumed: the cluster is unsuspended first, then (the next round) the environments follow.
    resumed = reconciler.reconcile(body(environments=[CABINET, SANDBOX], status=suspended.status))
    resumed = reconciler.reconcile(body(environments=[CABINET, SANDBOX], status=resumed.status))
    assert [kube.objects[("Deployment", _env(n))]["spec"]["replicas"] for n in ("cabinet", "sandbox")] == [2, 1]
    assert resumed.status["environmentsReady"] == "0/3"


def first_annotations(kube: FakeKube) -> dict[str, str]:
    spec = RLJobSpec.model_validate(spec_dict(environments=[CABINET]))
    return build_environment(job=RLJobRef(NAME, NS, UID), spec=spec, environment=spec.environments[0]).deployment[
        "metadata"
    ]["annotations"]


def test_a_changed_entry_rolls_its_pods_and_a_removed_one_is_deleted():
    reconciler, kube, _ = make_world(policy=ENV_POLICY)
    first = reconciler.reconcile(body(environments=[CABINET, SANDBOX]))
    newer = {**CABINET, "image": "registry.example.com/envs/cabinet:2"}
    outcome = reconciler.reconcile(body(environments=[newer], status=first.status))
    deployment = kube.objects[("Deployment", _env("cabinet"))]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == newer["image"]
    assert ("patch", "Deployment", _env("cabinet")) in kube.writes
    for kind in ("NetworkPolicy", "Service", "Deployment"):
        assert ("delete", kind, _env("sandbox")) in kube.writes and (kind, _env("sandbox")) not in kube.objects
    (deleted,) = [e for e in outcome.events if e.reason.value == "DeletedEnvironment"]
    assert "'sandbox' is no longer in spec.environments" in deleted.message
    assert [e["name"] for e in outcome.status["environments"]] == ["cabinet"]
    # The last entry gone: the status says no more of environments.
    last = reconciler.reconcile(body(status=outcome.status))
    assert "environments" not in last.status and "environmentsReady" not in last.status
    assert not [key for key in kube.objects if key[0] in ("Deployment", "Service")]


def test_an_older_operator_s_environment_children_are_replaced_by_the_hashed_ones():
    """Before names ended in a hash, an entry's children were `<rljob>-env-<entry>`; left alone, their pods
    would run on beside the new ones with open egress."""
    reconciler, kube, _ = make_world(policy=ENV_POLICY)
    spec = RLJobSpec.model_validate(spec_dict(environments=[CABINET]))
    old = build_environment(job=RLJobRef(NAME, NS, UID), spec=spec, environment=spec.environments[0])
    old_name = f"{NAME}-env-cabinet"
    for child in old:
        child["metadata"]["name"] = old_name
        kube.objects[(child["kind"], old_name)] = dict(
            child, metadata={**child["metadata"], "uid": f"old-{child['kind']}"}
        )
    outcome = reconciler.reconcile(body(environments=[CABINET]))
    for kind in ("NetworkPolicy", "Service", "Deployment"):
        assert (kind, old_name) not in kube.objects and (kind, _env("cabinet")) in kube.objects
    (deleted,) = [e for e in outcome.events if e.reason.value == "DeletedEnvironment"]
    assert f"{old_name}: environment 'cabinet' has children of another name now" in deleted.message
    assert [e["name"] for e in outcome.status["environments"]] == ["cabinet"]


def test_a_finished_job_scales_its_environments_to_zero():
    reconciler, kube, jobs = make_world(policy=ENV_POLICY)
    first = reconciler.reconcile(body(environments=[CABINET]))
    make_ready(kube)
    submitted = reconciler.reconcile(body(environments=[CABINET], status=first.status))
    jobs.jobs[submitted.status["rayJobId"]]["status"] = "SUCCEEDED"
    done = reconciler.reconcile(body(environments=[CABINET], status=submitted.status))
    assert done.status["phase"] == "Succeeded"
    assert kube.objects[("Deployment", _env("cabinet"))]["spec"]["replicas"] == 0  # with the cluster
    later = reconciler.reconcile(body(environments=[CABINET], status=done.status))
    assert later.status["environmentsReady"] == "0/0" and later.status["phase"] == "Succeeded"


def test_an_environment_image_outside_the_policy_is_denied_and_nothing_is_created():
    reconciler, kube, _ = make_world()  # the default policy: only the runtime image
    outcome = reconciler.reconcile(body(environments=[SANDBOX, CABINET]))
    failed = {c["type"]: c for c in outcome.status["conditions"]}["Failed"]
    assert failed["reason"] == "PolicyDenied"
    assert failed["message"].startswith("spec.environments[1].image: image 'registry.example.com/envs/cabinet:1'")
    assert "policy.imagePrefixes" in failed["message"]
    assert ("Warning", "PolicyDenied") in [(e.type, e.reason.value) for e in outcome.events]
    assert [w for w in kube.writes if w[0] == "create"] == []


def test_a_spec_refused_after_it_ran_scales_the_environments_to_zero():
    reconciler, kube, _ = make_world(policy=ENV_POLICY)
    first = reconciler.reconcile(body(environments=[CABINET]))
    refused = {**CABINET, "image": "elsewhere.example.com/cabinet:1"}
    outcome = reconciler.reconcile(body(environments=[refused], status=first.status))
    assert outcome.status["phase"] == "Failed"
    assert kube.objects[("Deployment", _env("cabinet"))]["spec"]["replicas"] == 0
    assert outcome.status["environmentsReady"] == "0/0"


def test_an_environment_name_taken_by_another_object_blocks_the_round():
    reconciler, kube, _ = make_world(policy=ENV_POLICY)
    kube.objects[("Service", _env("cabinet"))] = {
        "kind": "Service",
        "metadata": {"name": _env("cabinet"), "uid": "x", "labels": {}, "ownerReferences": []},
        "spec": {},
    }
    outcome = reconciler.reconcile(body(environments=[CABINET]))
    ready = {c["type"]: c for c in outcome.status["conditions"]}["ClusterReady"]
    assert ready["reason"] == "NameConflict" and f"Service {_env('cabinet')}" in ready["message"]
    assert ("Deployment", _env("cabinet")) not in kube.objects


# --- spec.agents: the same child reconciler ----------------------------------------------------------

SOLVER = {
    "name": "solver",
    "image": "registry.example.com/envs/solver:1",
    "command": ["python3", "a.py"],
    "replicas": 2,
}
CHECKER = {"name": "checker", "command": ["python3", "b.py"]}


def _agent(name: str) -> str:
    return naming.agent_name(NAME, name)


def _pods_job() -> dict[str, Any]:
    """A job whose episodes the agent pods run: the operator sets agent.harness_pods."""
    job = spec_dict()["job"]
    job["data"] = {"generator": {"name": "addition"}, "chat_template": "model"}
    job["reward"] = {"terms": [{"name": "environment"}]}
    return job


def test_agents_get_their_runner_gateway_policy_and_deployment_and_go_when_they_leave_the_spec():
    reconciler, kube, jobs = make_world(policy=ENV_POLICY)
    outcome = reconciler.reconcile(body(job=_pods_job(), agents=[SOLVER, CHECKER]))
    created = [w[1:] for w in kube.writes if w[0] == "create"]
    assert created == [
        ("Secret", naming.auth_secret_name(NAME, UID)),
        ("Secret", naming.environment_token_secret_name(NAME, UID)),  # the pods' token, before any pod
        ("ConfigMap", naming.config_map_name(NAME)),
        ("NetworkPolicy", naming.network_policy_name(NAME)),
        ("ServiceAccount", naming.environment_service_account_name(NAME)),
        ("ConfigMap", naming.agent_runner_config_map_name(NAME)),
        ("Service", naming.gateway_service_name(NAME)),
        ("NetworkPolicy", _agent("solver")),
        ("Deployment", _agent("solver")),
        ("NetworkPolicy", _agent("checker")),
        ("Deployment", _agent("checker")),
        ("RayCluster", NAME),
    ]
    assert outcome.status["agentsReady"] == "0/0" and "environmentsReady" not in outcome.status
    (event, _) = [e for e in outcome.events if e.reason.value == "CreatedAgent"]
    assert "2 pod(s) of registry.example.com/envs/solver:1, started once the job is admitted" in event.message
    assert "harness_pods: true" in kube.objects[("ConfigMap", naming.config_map_name(NAME))]["data"]["job.yaml"]
    # Admitted: the pods are asked for; then nothing differs, nothing is written (no policy patched back).
    admitted = reconciler.reconcile(body(job=_pods_job(), agents=[SOLVER, CHECKER], status=outcome.status))
    assert admitted.status["agentsReady"] == "0/3"
    kube.objects[("Deployment", _agent("solver"))]["status"] = {"readyReplicas": 2}
    writes = len(kube.writes)
    again = reconciler.reconcile(body(job=_pods_job(), agents=[SOLVER, CHECKER], status=admitted.status))
    assert again.status["agents"] == [
        {"name": "solver", "replicas": 2, "readyReplicas": 2},
        {"name": "checker", "replicas": 1, "readyReplicas": 0},
    ]
    assert [w for w in kube.writes[writes:] if w[1] != "RayCluster"] == []
    # An entry that left the spec goes with its policy; the job's finish scales the rest to 0.
    fewer = reconciler.reconcile(body(job=_pods_job(), agents=[SOLVER], status=again.status))
    for kind in ("NetworkPolicy", "Deployment"):
        assert (kind, _agent("checker")) not in kube.objects and (kind, _agent("solver")) in kube.objects
    (deleted,) = [e for e in fewer.events if e.reason.value == "DeletedAgent"]
    assert "agent 'checker' is no longer in spec.agents" in deleted.message
    make_ready(kube)
    submitted = reconciler.reconcile(body(job=_pods_job(), agents=[SOLVER], status=fewer.status))
    jobs.jobs[submitted.status["rayJobId"]]["status"] = "SUCCEEDED"
    done = reconciler.reconcile(body(job=_pods_job(), agents=[SOLVER], status=submitted.status))
    assert done.status["phase"] == "Succeeded"
    assert kube.objects[("Deployment", _agent("solver"))]["spec"]["replicas"] == 0


def _with_pool(replicas: int) -> dict[str, Any]:
    job = spec_dict()["job"]
    job["rollout"] = {"pool": {"replicas": replicas}}
    return job


def test_the_rollout_pool_is_scaled_in_place_while_the_job_runs_and_a_conflict_waits_for_the_next_round(world):
    """spec.job.rollout.pool.replicas 1 -> 2 on a running job: the RayCluster's `pool` group is patched in place
    (no new cluster, no restart, Event ScaledRolloutPool), on the cluster as read (its resourceVersion); a patch
    the API server refuses as stale (409) is tried again by the next round."""
    reconciler, kube, jobs = world
    first = reconciler.reconcile(body(job=_with_pool(1)))
    make_ready(kube)
    submitted = reconciler.reconcile(body(status=first.status, job=_with_pool(1)))
    jobs.jobs[submitted.status["rayJobId"]]["status"] = "RUNNING"
    running = reconciler.reconcile(body(status=submitted.status, job=_with_pool(1)))
    cluster = kube.objects[("RayCluster", NAME)]
    cluster["metadata"]["resourceVersion"] = "7"
    patched: list[Mapping[str, Any]] = []
    patch = kube.patch

    def stale_once(kind: str, namespace: str, name: str, body_: Mapping[str, Any]) -> dict[str, Any]:
        if kind == "RayCluster":
            patched.append(body_)
            if len(patched) == 1:
                raise ApiException(status=409, reason="Conflict")
        return patch(kind, namespace, name, body_)

    kube.patch = stale_once
    refused = reconciler.reconcile(body(status=running.status, job=_with_pool(2)))
    assert refused.status["phase"] == "Running" and "ScaledRolloutPool" not in [e.reason.value for e in refused.events]
    scaled = reconciler.reconcile(body(status=refused.status, job=_with_pool(2)))
    assert "ScaledRolloutPool" in [e.reason.value for e in scaled.events]
    assert [p["metadata"]["resourceVersion"] for p in patched] == ["7", "7"]
    (pool,) = [g for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == "pool"]
    assert (pool["replicas"], pool["minReplicas"], pool["maxReplicas"]) == (2, 2, 2)
    assert scaled.status["phase"] == "Running" and scaled.status["restartCount"] == 0
    assert ("RayCluster", NAME) in kube.objects and not [w for w in kube.writes if w[0] == "delete"]
