"""Builders: RLJob -> RayCluster, ConfigMap, Ray job submission. The core types they embed are
checked with kubernetes-validate, the RayCluster with KubeRay's own CRD schema."""

from __future__ import annotations

import json
import re
import shlex

import kubernetes_validate
import pytest
import yaml
from rljob_testing import KUBERNETES_VERSION, error_paths, kuberay_raycluster_validator, spec_dict

from rldock.config import load_job_config, parse_job_config
from rldock.contract.pool_nodes import POOL_NODE_LABEL, POOL_NODE_VALUE, POOL_NODES_ENV
from rldock.operator import naming
from rldock.operator.api import RLJobSpec
from rldock.operator.builders import (
    RLJobRef,
    build_auth_secret,
    build_config_map,
    build_entrypoint,
    build_job_submission,
    build_ray_cluster,
    output_dir,
)
from rldock.operator.builders.ray_cluster import pool_group_replicas, with_pool_replicas
from rldock.operator.constants import (
    ANNOTATION_SPEC_HASH,
    ENV_JOB_CONFIG,
    JOB_CONFIG_PATH,
    LABEL_KUEUE_QUEUE,
    LABEL_RAY_SCHEDULER_NAME,
    LABEL_RLJOB,
    LABEL_ROLE,
    LABEL_VOLCANO_QUEUE,
    POOL_GROUP,
    ROLE_POOL,
    WORKER_GROUP,
)
from rldock.runtime.cli import build_parser

JOB = RLJobRef(name="grpo-demo", namespace="team-a", uid="0f5c2a6e-1111-2222-3333-444455556666")


def _spec(**sections) -> RLJobSpec:
    return RLJobSpec.model_validate(spec_dict(**sections))


def _resources(num_nodes: int, devices_per_node: int, accelerator: str = "NPU") -> dict:
    job = spec_dict()["job"]
    job["resources"] = {
        "num_nodes": num_nodes,
        "devices_per_node": devices_per_node,
        "accelerator_resource": accelerator,
    }
    return job


SPECS = {
    "default": {},
    "four-nodes-gpu": {
        "job": _resources(4, 16, "GPU_DEVICE"),
        "cluster": {
            "deviceResource": "nvidia.com/gpu",
            "head": {"cpu": "500m", "memory": "2Gi"},
            "worker": {"cpu": 8, "memory": "64Gi"},
        },
    },
    "placed": {
        "cluster": {
            "nodeSelector": {"accelerator": "ascend-910b"},
            "tolerations": [
                {"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}
            ],
        },
        "scheduling": {"schedulerName": "my-scheduler"},
    },
    "volcano": {"scheduling": {"gang": "volcano", "queue": "research"}},
    "kueue": {"scheduling": {"gang": "kueue", "queue": "team-a-queue"}},
    "host-path": {"checkpoint": {"hostPath": "/mnt/shared/rl", "mountPath": "/data"}},
    "suspended": {"suspend": True},
}


def _groups(cluster: dict) -> tuple[dict, dict]:
    (worker,) = cluster["spec"]["workerGroupSpecs"]
    return cluster["spec"]["headGroupSpec"], worker


def _as_pod(template: dict, name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": name, "namespace": JOB.namespace},
        "spec": template["spec"],
    }


@pytest.mark.parametrize("case", SPECS)
def test_pod_templates_are_valid_pods(case):
    head, worker = _groups(build_ray_cluster(job=JOB, spec=_spec(**SPECS[case])))
    for group, name in ((head, "head"), (worker, "worker")):
        kubernetes_validate.validate(_as_pod(group["template"], name), KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("case", SPECS)
def test_ray_cluster_matches_kuberays_crd(case):
    validator = kuberay_raycluster_validator()
    cluster = build_ray_cluster(job=JOB, spec=_spec(**SPECS[case]))
    assert error_paths(validator, cluster) == []


def test_kuberay_schema_check_has_teeth():
    validator = kuberay_raycluster_validator()
    cluster = build_ray_cluster(job=JOB, spec=_spec())
    cluster["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 8
    cluster["spec"]["workerGroupSpecs"][0]["groupNmae"] = "typo"
    assert set(error_paths(validator, cluster)) == {
        "spec.workerGroupSpecs.0.replicas",
        "spec.headGroupSpec.rayStartParams.num-cpus",
        "spec.workerGroupSpecs.0",
    }


@pytest.mark.parametrize(
    "num_nodes, devices, accelerator, device_resource",
    [
        (1, 8, "NPU", "huawei.com/Ascend910"),
        (4, 8, "NPU", "huawei.com/Ascend910"),
        (2, 16, "GPU_DEVICE", "nvidia.com/gpu"),
    ],
)
def test_cluster_shape_comes_from_the_job(num_nodes, devices, accelerator, device_resource):
    spec = _spec(job=_resources(num_nodes, devices, accelerator), cluster={"deviceResource": device_resource})
    head, worker = _groups(build_ray_cluster(job=JOB, spec=spec))
    assert worker["replicas"] == worker["minReplicas"] == worker["maxReplicas"] == num_nodes
    # KubeRay writes `--resources=<value>` into a bash command line as it is: the value must be
    # one shell word that bash turns into the JSON.
    (word,) = shlex.split(f"--resources={worker['rayStartParams']['resources']}")
    assert json.loads(word.removeprefix("--resources=")) == {accelerator: devices}
    (container,) = worker["template"]["spec"]["containers"]
    assert container["resources"]["requests"][device_resource] == str(devices)
    assert container["resources"]["limits"] == container["resources"]["requests"]
    # The head runs the driver and controllers: CPUs for Ray, no devices at all.
    (head_container,) = head["template"]["spec"]["containers"]
    assert device_resource not in head_container["resources"]["limits"]
    assert "resources" not in head["rayStartParams"] and head["rayStartParams"]["num-cpus"] == "8"


def test_one_worker_pod_per_node():
    head, worker = _groups(build_ray_cluster(job=JOB, spec=_spec()))
    anti_affinity = worker["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti_affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= worker["template"]["metadata"]["labels"].items()
    assert worker["template"]["metadata"]["labels"][LABEL_ROLE] == "worker"
    assert "affinity" not in head["template"]["spec"]


@pytest.mark.parametrize(
    "case, labels, scheduler_name",
    [
        ("default", {}, None),
        ("volcano", {LABEL_RAY_SCHEDULER_NAME: "volcano", LABEL_VOLCANO_QUEUE: "research"}, None),
        ("kueue", {LABEL_KUEUE_QUEUE: "team-a-queue"}, None),
        ("placed", {}, "my-scheduler"),
    ],
)
def test_scheduling(case, labels, scheduler_name):
    cluster = build_ray_cluster(job=JOB, spec=_spec(**SPECS[case]))
    gang_keys = {LABEL_RAY_SCHEDULER_NAME, LABEL_VOLCANO_QUEUE, LABEL_KUEUE_QUEUE}
    assert {k: v for k, v in cluster["metadata"]["labels"].items() if k in gang_keys} == labels
    for group in _groups(cluster):
        assert group["template"]["spec"].get("schedulerName") == scheduler_name


def test_placement_is_copied_to_every_pod():
    for group in _groups(build_ray_cluster(job=JOB, spec=_spec(**SPECS["placed"]))):
        pod = group["template"]["spec"]
        assert pod["nodeSelector"] == {"accelerator": "ascend-910b"}
        assert pod["tolerations"] == [
            {"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}
        ]


@pytest.mark.parametrize(
    "case, source, mount_path",
    [
        ("default", {"persistentVolumeClaim": {"claimName": "rl-checkpoints"}}, "/checkpoints"),
        ("host-path", {"hostPath": {"path": "/mnt/shared/rl", "type": "DirectoryOrCreate"}}, "/data"),
    ],
)
def test_every_pod_mounts_config_and_checkpoints(case, source, mount_path):
    for group in _groups(build_ray_cluster(job=JOB, spec=_spec(**SPECS[case]))):
        pod = group["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["checkpoints"] == {"name": "checkpoints", **source}
        assert volumes["job-config"]["configMap"]["name"] == naming.config_map_name(JOB.name)
        (container,) = pod["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts == {"job-config": "/etc/rldock", "checkpoints": mount_path, "dshm": "/dev/shm", "tmp": "/tmp"}
        assert {"name": ENV_JOB_CONFIG, "value": JOB_CONFIG_PATH} in container["env"]


def test_children_are_owned_and_labelled():
    spec = _spec()
    for child in (build_ray_cluster(job=JOB, spec=spec), build_config_map(job=JOB, spec=spec)):
        meta = child["metadata"]
        (owner,) = meta["ownerReferences"]
        assert owner == {
            "apiVersion": "rldock.io/v1alpha1",
            "kind": "RLJob",
            "name": JOB.name,
            "uid": JOB.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert meta["namespace"] == JOB.namespace and meta["labels"][LABEL_RLJOB] == JOB.name
    assert build_ray_cluster(job=JOB, spec=spec)["metadata"]["name"] == naming.ray_cluster_name(JOB.name)


def test_builders_are_deterministic_and_hash_what_needs_a_new_cluster():
    spec = _spec()
    cluster = build_ray_cluster(job=JOB, spec=spec)
    assert cluster == build_ray_cluster(job=JOB, spec=_spec())
    suspended = build_ray_cluster(job=JOB, spec=_spec(suspend=True))
    assert suspended["spec"]["suspend"] is True and cluster["spec"]["suspend"] is False
    hashes = {c["metadata"]["annotations"][ANNOTATION_SPEC_HASH] for c in (cluster, suspended)}
    assert len(hashes) == 1, "suspending patches the cluster; it does not replace it"
    other_image = build_ray_cluster(job=JOB, spec=_spec(image="registry.local/rldock:dev"))
    assert other_image["metadata"]["annotations"][ANNOTATION_SPEC_HASH] not in hashes


def test_config_map_holds_the_job_config_the_runtime_accepts():
    spec = _spec()
    config_map = build_config_map(job=JOB, spec=spec)
    kubernetes_validate.validate(config_map, KUBERNETES_VERSION, strict=True)
    assert config_map["metadata"]["name"] == naming.config_map_name(JOB.name)
    text = config_map["data"]["job.yaml"]
    assert parse_job_config(yaml.safe_load(text)) == spec.job
    assert "clip_ratio: 0.2" in text, "defaults are written out, so the runtime runs what was validated"


def test_the_pod_expands_the_paths_the_operator_passed_on_as_written(tmp_path, monkeypatch):
    """The operator's HOME and environment are not the pods': the ConfigMap holds `~` and `$VARS` as
    the RLJob wrote them, and the runtime in the pod expands them with its own, through the loader
    `rldock train` calls anywhere (RLDOCK_JOB_CONFIG names the mounted file: the parser's default)."""
    job = spec_dict()["job"]
    job["model"]["path"] = "$MODELS/tiny"
    job["data"] = {"train_files": ["~/data/train.jsonl"], "chat_template": "none"}
    spec = _spec(job=job)
    text = build_config_map(job=JOB, spec=spec)["data"]["job.yaml"]
    assert "path: $MODELS/tiny" in text and "- ~/data/train.jsonl" in text
    (tmp_path / "job.yaml").write_text(text)
    monkeypatch.setenv(ENV_JOB_CONFIG, str(tmp_path / "job.yaml"))
    monkeypatch.setenv("HOME", "/home/ray")
    monkeypatch.setenv("MODELS", "/mnt/models")
    args = build_parser().parse_args(["train", "--output", str(tmp_path / "run")])
    assert args.config == str(tmp_path / "job.yaml")
    loaded = load_job_config(args.config, check_local=False)
    assert loaded.model.path == "/mnt/models/tiny"
    assert loaded.data.train_files == ["/home/ray/data/train.jsonl"]


def test_entrypoint_is_a_valid_rldock_command():
    spec = _spec(checkpoint={"claimName": "ckpt", "mountPath": "/data/ckpt"})
    argv = shlex.split(build_entrypoint(job=JOB, spec=spec))
    assert argv == [
        "rldock",
        "train",
        "/etc/rldock/job.yaml",
        "--output",
        "/data/ckpt/team-a/grpo-demo/0f5c2a6e-1111-2222-3333-444455556666",
        "--resume",
        "--no-progress",
        "--max-restarts",
        "0",
    ]
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.config, args.resume, args.no_progress) == ("train", JOB_CONFIG_PATH, True, True)
    assert args.max_restarts == 0  # the operator owns retries (restartCount, backoffLimit)
    assert args.output == output_dir(job=JOB, spec=spec)


@pytest.mark.parametrize(
    ("preemption", "grace", "timeout"), [({}, 300, "285"), ({"gracePeriodSeconds": 900}, 900, "885")]
)
def test_the_pods_prestop_hooks_stop_the_driver_within_the_pods_grace_period(preemption, grace, timeout):
    """spec.preemption: the driver finishes its iteration and checkpoints it before Ray's processes stop; the
    head's hook posts a notice in the job's output folder meanwhile, which keeps the workers' Ray nodes up."""
    spec = _spec(preemption=preemption)
    head, worker = _groups(build_ray_cluster(job=JOB, spec=spec))
    notice = f"{output_dir(job=JOB, spec=spec)}/preempting.json"
    for group, follow in ((head, []), (worker, ["--follow"])):
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] == grace
        (container,) = group["template"]["spec"]["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command == ["rldock", "preempt", "--timeout", timeout, "--notice", notice, *follow]
        args = build_parser().parse_args(command[1:])  # a command the runtime's CLI takes
        assert (args.command, args.timeout, args.notice, args.follow) == (
            "preempt",
            float(timeout),
            notice,
            bool(follow),
        )


@pytest.mark.parametrize("max_restarts", [1, 3])
def test_entrypoint_passes_the_in_job_restart_budget(max_restarts):
    spec = _spec(maxRestarts=max_restarts)
    argv = shlex.split(build_entrypoint(job=JOB, spec=spec))
    assert argv[-2:] == ["--max-restarts", str(max_restarts)]
    assert build_parser().parse_args(argv[1:]).max_restarts == max_restarts


@pytest.mark.parametrize(
    "other, same_dir",
    [
        (JOB, True),  # a retry, suspend or unsuspend of the same object: it resumes
        (RLJobRef(name=JOB.name, namespace=JOB.namespace, uid="9e8d7c6b-0000-0000-0000-000000000000"), False),
        (RLJobRef(name="other", namespace=JOB.namespace, uid=JOB.uid), False),
        (RLJobRef(name=JOB.name, namespace="team-b", uid=JOB.uid), False),
    ],
)
def test_output_dir_belongs_to_one_rljob_object(other, same_dir):
    """A re-created RLJob of the same name (a new uid) must not resume the old run's checkpoints."""
    spec = _spec()
    assert (output_dir(job=other, spec=spec) == output_dir(job=JOB, spec=spec)) is same_dir
    assert output_dir(job=other, spec=spec) == f"/checkpoints/{other.namespace}/{other.name}/{other.uid}"


def test_each_attempt_gets_its_own_submission():
    spec = _spec()
    first, retry = (build_job_submission(job=JOB, spec=spec, attempt=a) for a in (0, 1))
    assert first["entrypoint"] == retry["entrypoint"]
    assert first["submission_id"] != retry["submission_id"]
    assert first["submission_id"] == build_job_submission(job=JOB, spec=spec, attempt=0)["submission_id"]
    assert retry["metadata"]["rldock.io/attempt"] == "1"


def test_ref_from_body():
    body = {"metadata": {"name": "a", "namespace": "b", "uid": "c", "generation": 3}, "spec": {}}
    assert RLJobRef.from_body(body) == RLJobRef(name="a", namespace="b", uid="c")


def test_every_ray_pod_authenticates_with_the_rljobs_token():
    """Ray 2.60 turns token auth on by default; every Ray process reads RAY_AUTH_MODE/RAY_AUTH_TOKEN."""
    for group in _groups(build_ray_cluster(job=JOB, spec=_spec())):
        env = {var["name"]: var for var in group["template"]["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": naming.auth_secret_name(JOB.name, JOB.uid),
            "key": "auth_token",
        }


def test_auth_secret_is_owned_and_valid():
    secret = build_auth_secret(job=JOB, token="f" * 64)
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    assert secret["metadata"]["name"] == naming.auth_secret_name(JOB.name, JOB.uid)
    assert re.fullmatch(r"grpo-demo-ray-auth-[0-9a-f]{16}", secret["metadata"]["name"])
    assert secret["stringData"] == {"auth_token": "f" * 64}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
    with pytest.raises(ValueError):
        build_auth_secret(job=JOB, token="")


def test_a_cluster_for_kueue_is_created_suspended_for_kueue_to_admit():
    cluster = build_ray_cluster(job=JOB, spec=_spec(**SPECS["kueue"]))
    assert cluster["spec"]["suspend"] is True
    assert cluster["metadata"]["labels"][LABEL_KUEUE_QUEUE] == "team-a-queue"
    assert build_ray_cluster(job=JOB, spec=_spec())["spec"]["suspend"] is False


def _with_pool(replicas: int, **sections) -> RLJobSpec:
    job = spec_dict()["job"]
    job["rollout"] = {"pool": {"replicas": replicas}}
    return _spec(job=job, **sections)


def test_a_rollout_pool_is_a_worker_group_of_one_device_pods_on_labelled_ray_nodes():
    """The pool's group beside the trainer's: `replicas` pods (min = max), one device each advertised to Ray,
    each Ray node labelled for the pool, no anti-affinity (several pool pods may share a node), the job's pods
    told where the pool is; valid pods and a valid RayCluster by KubeRay's schema."""
    cluster = build_ray_cluster(job=JOB, spec=_with_pool(3))
    workers, pool = cluster["spec"]["workerGroupSpecs"]
    assert workers["groupName"] == WORKER_GROUP and pool["groupName"] == POOL_GROUP
    assert (pool["replicas"], pool["minReplicas"], pool["maxReplicas"]) == (3, 3, 3)
    params = pool["rayStartParams"]
    assert json.loads(shlex.split(params["resources"])[0]) == {"NPU": 1}
    # the group's top-level labels: KubeRay >= 1.5 refuses them in rayStartParams
    assert pool["labels"] == {POOL_NODE_LABEL: POOL_NODE_VALUE} and "labels" not in params
    template = pool["template"]
    assert template["metadata"]["labels"][LABEL_ROLE] == ROLE_POOL and "affinity" not in template["spec"]
    (container,) = template["spec"]["containers"]
    assert {"name": POOL_NODES_ENV, "value": POOL_NODE_VALUE} in container["env"]
    # its hook keeps its engine up for the driver's last iteration, but a pool pod deleted alone drains nothing
    assert container["lifecycle"]["preStop"]["exec"]["command"][-2:] == ["--follow", "--no-drain"]
    for group in (cluster["spec"]["headGroupSpec"], workers):  # the driver reads it on the head
        assert {"name": POOL_NODES_ENV, "value": POOL_NODE_VALUE} in group["template"]["spec"]["containers"][0]["env"]
    kubernetes_validate.validate(_as_pod(template, "pool"), KUBERNETES_VERSION, strict=True)
    assert error_paths(kuberay_raycluster_validator(), cluster) == []
    plain = build_ray_cluster(job=JOB, spec=_spec())
    assert len(plain["spec"]["workerGroupSpecs"]) == 1
    assert all(
        e["name"] != POOL_NODES_ENV for e in plain["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    )


def test_a_pool_pod_takes_the_workers_cpu_and_memory_unless_sized():
    """A pool pod holds one device and `spec.cluster.pool`'s CPU and memory, else a worker pod's."""

    def amounts(spec: RLJobSpec) -> tuple[dict, dict]:
        workers, pool = build_ray_cluster(job=JOB, spec=spec)["spec"]["workerGroupSpecs"]
        return tuple(group["template"]["spec"]["containers"][0]["resources"]["limits"] for group in (workers, pool))

    worker, pool = amounts(_with_pool(2, cluster={"worker": {"cpu": 32, "memory": "256Gi"}}))
    assert (worker["cpu"], worker["memory"], worker["huawei.com/Ascend910"]) == ("32", "256Gi", "8")
    assert pool == {"cpu": "32", "memory": "256Gi", "huawei.com/Ascend910": "1"}
    worker, sized = amounts(_with_pool(2, cluster={"pool": {"cpu": 6, "memory": "48Gi"}}))
    assert (sized["cpu"], sized["memory"], sized["huawei.com/Ascend910"]) == ("6", "48Gi", "1")
    assert worker["memory"] != sized["memory"]


def test_the_pools_replicas_are_scaled_in_place_and_a_pool_added_needs_a_new_cluster():
    one, two, none = (build_ray_cluster(job=JOB, spec=spec) for spec in (_with_pool(1), _with_pool(2), _spec()))
    hashes = [c["metadata"]["annotations"][ANNOTATION_SPEC_HASH] for c in (one, two, none)]
    assert hashes[0] == hashes[1] != hashes[2]
    # Kueue admits fixed pod sets: under it the pool's size is the cluster's, as any other change
    kueue = {"gang": "kueue", "queue": "q"}
    one_k, two_k = (build_ray_cluster(job=JOB, spec=_with_pool(n, scheduling=kueue)) for n in (1, 2))
    assert (
        one_k["metadata"]["annotations"][ANNOTATION_SPEC_HASH] != two_k["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    )
    assert (pool_group_replicas(one), pool_group_replicas(two), pool_group_replicas(none)) == (1, 2, None)
    scaled = with_pool_replicas(one, 2)
    assert scaled == two["spec"]["workerGroupSpecs"] and pool_group_replicas(one) == 1  # a copy
