"""The KubeRay RayCluster (ray.io/v1) that runs one RLJob.

Shape: a head group (trainer driver, dock controllers; CPU only) and ONE worker group with exactly
`job.resources.num_nodes` pods (replicas = min = max, no autoscaling), at most one per node through
pod anti-affinity, each taking the node's `devices_per_node` devices through the device plugin's
extended resource and advertising them to Ray as `job.resources.accelerator_resource`. The
runtime places one dock warehouse per such Ray node; the head advertises no devices, so none
lands there. A job with a rollout pool (`job.rollout.pool`) has a second worker group, `pool`:
`replicas` pods of one device each (sized by `pool_pod_resources`), their Ray nodes labelled for the
pool (rldock.contract.pool_nodes), where the runtime starts the pool's engines and nothing else. Its
replicas are left out of the spec hash: the operator scales the group in place when the spec's replicas
change, also while the job runs (`pool_group_replicas`, actions.ScalePool), except under Kueue
(`scales_under_kueue`). How the devices are asked for, by the job's `resources`:
- `accelerator_resource: NPU` (or any custom name): each worker pod requests `devices_per_node`
  of the device resource, and its `ray start` gets `--resources='{"NPU": n}'`;
- `accelerator_resource: GPU`: the pods request the same of a GPU device plugin's resource
  (`nvidia.com/gpu` unless set, `device_resource`), and Ray's built-in `--num-gpus=n` counts them
  (the head gets `--num-gpus=0`);
- `device: cpu` (a CPU-only cluster): no device resource at all; `--resources='{"NPU": n}'` still
  gives Ray n emulated devices, the slots the runtime places its workers on.

Every pod meets the `restricted` Pod Security Standard (docs/security.md): it runs as uid 10001 with
runAsNonRoot, the runtime's default seccomp profile, no privilege escalation and no capabilities;
its writable paths (/tmp for Ray's session, /dev/shm) are emptyDirs; and it gets no service-account
token, since nothing in it calls the Kubernetes API (the operator submits the job and reads its
progress through the Jobs API). The volumes `restricted` forbids (hostPath, NFS) are there only
when the admin's policy allowed them (policy.py). The admin's pod defaults (labels, annotations,
priority class, pull secrets) are added to every pod.

The RLJob's own `volumes`, `volumeMounts`, `env` and `envFrom` go into the head and every worker
alike, after the operator's own (whose names validation keeps them from reusing): the head runs the
job driver, which reads the model and data as much as the workers do. No other pod needs them: the
operator submits the job through the Jobs API itself, with no submitter pod.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import posixpath
import shlex
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from rldock.contract.pool_nodes import POOL_NODE_LABEL, POOL_NODE_VALUE, POOL_NODES_ENV
from rldock.contract.runtime_cli import PREEMPT_NOTICE_FILE, preempt_argv
from rldock.operator import naming
from rldock.operator.api import PodDefaults, PodResources, RLJobSpec, cpu_cores
from rldock.operator.builders.common import RLJobRef, child_labels, child_metadata
from rldock.operator.builders.ray_job import output_dir
from rldock.operator.constants import (
    ANNOTATION_SPEC_HASH,
    ASCEND_RESOURCE_DOMAIN,
    AUTH_SECRET_KEY,
    CONFIG_MOUNT_PATH,
    ENV_ENVIRONMENT_TOKEN,
    ENV_JOB_CONFIG,
    ENV_RAY_AUTH_MODE,
    ENV_RAY_AUTH_TOKEN,
    ENVIRONMENT_TOKEN_KEY,
    GPU_DEVICE_RESOURCE,
    HEAD_CONTAINER,
    JOB_CONFIG_PATH,
    LABEL_KUEUE_QUEUE,
    LABEL_RAY_SCHEDULER_NAME,
    LABEL_RLJOB,
    LABEL_ROLE,
    LABEL_VOLCANO_QUEUE,
    POOL_GROUP,
    PREEMPT_MARGIN_S,
    RAY_API_VERSION,
    RAY_AUTH_MODE_TOKEN,
    RAY_CLUSTER_KIND,
    RAY_GPU,
    RAY_POD_GID,
    RAY_POD_UID,
    ROLE_HEAD,
    ROLE_POOL,
    ROLE_WORKER,
    SHM_MOUNT_PATH,
    TMP_MOUNT_PATH,
    VOLCANO_SCHEDULER,
    VOLUME_CHECKPOINTS,
    VOLUME_JOB_CONFIG,
    VOLUME_SHM,
    VOLUME_TMP,
    WORKER_CONTAINER,
    WORKER_GROUP,
    GangScheduler,
)

_HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


def build_ray_cluster(*, job: RLJobRef, spec: RLJobSpec, defaults: PodDefaults = PodDefaults()) -> dict[str, Any]:
    """The desired RayCluster; `spec` must be free of validation problems. `defaults` fill in what
    the spec leaves to the installation (the operator passes its settings' pod defaults)."""
    resources = spec.job.resources
    num_workers = resources.num_nodes
    cluster_spec: dict[str, Any] = {
        "rayVersion": spec.cluster.ray_version,
        # KubeRay deletes every pod and keeps the object. A cluster for Kueue is created suspended,
        # as Kueue's convention for the jobs it manages: Kueue unsuspends it once it admits it.
        "suspend": spec.suspend or spec.scheduling.gang is GangScheduler.KUEUE,
        "enableInTreeAutoscaling": False,  # the job's shape is fixed; the dock needs every node
        "headGroupSpec": {
            "serviceType": "ClusterIP",
            "rayStartParams": _head_start_params(spec),
            "template": _pod_template(job, spec, defaults, role=ROLE_HEAD),
        },
        "workerGroupSpecs": [
            {
                "groupName": WORKER_GROUP,
                "replicas": num_workers,
                "minReplicas": num_workers,
                "maxReplicas": num_workers,
                "rayStartParams": _device_start_params(spec, devices=resources.devices_per_node),
                "template": _pod_template(job, spec, defaults, role=ROLE_WORKER),
            }
        ],
    }
    pool = spec.job.rollout.pool
    if pool is not None:
        cluster_spec["workerGroupSpecs"].append(
            {
                "groupName": POOL_GROUP,
                **pool_replicas(pool.replicas),
                "rayStartParams": _device_start_params(spec, devices=1),
                # the Ray node labels (`ray start --labels`): KubeRay >= 1.5 takes them here only
                "labels": {POOL_NODE_LABEL: POOL_NODE_VALUE},
                "template": _pod_template(job, spec, defaults, role=ROLE_POOL),
            }
        )
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": RAY_CLUSTER_KIND,
        "metadata": child_metadata(
            job,
            naming.ray_cluster_name(job.name),
            labels=_gang_labels(spec),
            # Kueue admits a workload of fixed pod sets: its pool is resized by a new cluster, as other changes
            annotations={ANNOTATION_SPEC_HASH: _spec_hash(cluster_spec, pool_in_place=not scales_under_kueue(spec))},
        ),
        "spec": cluster_spec,
    }


def device_resource(spec: RLJobSpec, defaults: PodDefaults) -> str | None:
    """The extended resource each worker pod requests `devices_per_node` of; None for a job that
    runs on the CPU (`job.resources.device: cpu`), whose pods request no device.

    `spec.cluster.deviceResource` when set, else the installation's default; a GPU job
    (`accelerator_resource: GPU`) on an installation whose default is an Ascend resource gets
    NVIDIA's `nvidia.com/gpu` instead, so a few GPU jobs on an Ascend cluster need not name it."""
    if spec.job.resources.device == "cpu":
        return None
    if spec.cluster.device_resource:
        return spec.cluster.device_resource
    if spec.job.resources.accelerator_resource == RAY_GPU and is_ascend_resource(defaults.device_resource):
        return GPU_DEVICE_RESOURCE
    return defaults.device_resource


def is_ascend_resource(name: str) -> bool:
    return name.partition("/")[0] == ASCEND_RESOURCE_DOMAIN


def _head_start_params(spec: RLJobSpec) -> dict[str, str]:
    params = {
        # CPU for the driver's helpers; no accelerator resource, so no device worker or warehouse
        # is placed on the head.
        "num-cpus": str(math.floor(cpu_cores(spec.cluster.head.cpu))),
        "dashboard-host": "0.0.0.0",  # the operator reaches the Jobs API via the Service
    }
    if spec.job.resources.accelerator_resource == RAY_GPU:
        # Ray counts the GPUs it can see; a head in a CUDA image may see the node's GPUs without
        # asking for any (NVIDIA's images set NVIDIA_VISIBLE_DEVICES=all), and must offer none.
        params["num-gpus"] = "0"
    return params


def _device_start_params(spec: RLJobSpec, *, devices: int) -> dict[str, str]:
    """A worker's `ray start` parameters that advertise its `devices` to Ray."""
    resources = spec.job.resources
    if resources.accelerator_resource == RAY_GPU:
        # Ray's built-in GPU count: `--resources='{"GPU": n}'` Ray refuses ("GPU cannot be a
        # custom resource"), and the workers ask for GPUs as `num_gpus` (runtime workers/ray_devices.py).
        return {"num-gpus": str(devices)}
    # KubeRay pastes every value into the container's `bash -lc` line as `--key=value` without
    # quoting (common/pod.go convertParamMap), so the JSON carries its own shell quotes, as KubeRay
    # writes its own accelerator resources: --resources='{"NPU": 8}'.
    return {"resources": shlex.quote(json.dumps({resources.accelerator_resource: devices}))}


def pool_replicas(replicas: int) -> dict[str, int]:
    """The pool's worker group fields that say how many pods it has (min = max: no autoscaling)."""
    return {"replicas": replicas, "minReplicas": replicas, "maxReplicas": replicas}


def pool_group_replicas(cluster: Mapping[str, Any]) -> int | None:
    """The replicas of a RayCluster's pool worker group as stored; None: it has none."""
    for group in cluster.get("spec", {}).get("workerGroupSpecs") or ():
        if group.get("groupName") == POOL_GROUP:
            return int(group.get("replicas", 0))
    return None


def with_pool_replicas(cluster: Mapping[str, Any], replicas: int) -> list[dict[str, Any]]:
    """The RayCluster's worker groups with the pool's scaled to `replicas` (a merge patch replaces the list)."""
    groups = copy.deepcopy(list(cluster["spec"]["workerGroupSpecs"]))
    for group in groups:
        if group.get("groupName") == POOL_GROUP:
            group.update(pool_replicas(replicas))
    return groups


def _gang_labels(spec: RLJobSpec) -> dict[str, str]:
    """Labels on the RayCluster that hand it to a gang scheduler, as KubeRay documents them."""
    scheduling = spec.scheduling
    if scheduling.gang is GangScheduler.VOLCANO:
        labels = {LABEL_RAY_SCHEDULER_NAME: VOLCANO_SCHEDULER}
        if scheduling.queue:
            labels[LABEL_VOLCANO_QUEUE] = scheduling.queue
        return labels
    if scheduling.gang is GangScheduler.KUEUE:
        assert scheduling.queue, "validation requires a queue for kueue"
        return {LABEL_KUEUE_QUEUE: scheduling.queue}
    return {}


def scales_under_kueue(spec: RLJobSpec) -> bool:
    """Whether the job's cluster is Kueue's to admit (`scheduling.gang: kueue`): an admitted workload's pod sets
    are fixed, and a worker group resized under it makes Kueue stop the job and queue it again, so its rollout
    pool is not scaled in place (a change applies with the next cluster, as any spec change)."""
    return spec.scheduling.gang is GangScheduler.KUEUE


def _spec_hash(cluster_spec: dict[str, Any], *, pool_in_place: bool) -> str:
    # `suspend` is left out: toggling it is a patch of the running cluster, not a new cluster; so are the pool's
    # replicas where the operator scales them in place.
    stable = {k: v for k, v in cluster_spec.items() if k != "suspend"}
    stable["workerGroupSpecs"] = [
        {
            k: v
            for k, v in group.items()
            if not (pool_in_place and group["groupName"] == POOL_GROUP and k in pool_replicas(0))
        }
        for group in cluster_spec["workerGroupSpecs"]
    ]
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]


# The `restricted` profile (docs/security.md). The uid is the runtime images' (images/README.md);
# fsGroup makes the checkpoint volume writable for it.
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": RAY_POD_UID,
    "runAsGroup": RAY_POD_GID,
    "fsGroup": RAY_POD_GID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def _pod_template(job: RLJobRef, spec: RLJobSpec, defaults: PodDefaults, *, role: str) -> dict[str, Any]:
    is_worker = role == ROLE_WORKER
    labels = {**defaults.labels, **child_labels(job), LABEL_ROLE: role}  # the operator's labels win
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        # the driver's time to finish its iteration and checkpoint it (the head's preStop hook, _container)
        "terminationGracePeriodSeconds": spec.preemption.grace_period_seconds,
        "containers": [_container(job, spec, defaults, role=role)],
        "volumes": _volumes(job, spec) + [_dump(volume) for volume in spec.volumes],
    }
    pull_secrets = defaults.image_pull_secrets_of(spec)
    if pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in pull_secrets]
    if defaults.priority_class_name:
        pod_spec["priorityClassName"] = defaults.priority_class_name
    if is_worker:
        pod_spec["affinity"] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        # One worker of this job per node: each worker pod owns its node's devices and its
                        # node's dock warehouse. Pods of other jobs are not excluded here; their device
                        # requests keep them off a node that is full.
                        "labelSelector": {"matchLabels": {LABEL_RLJOB: labels[LABEL_RLJOB], LABEL_ROLE: ROLE_WORKER}},
                        "topologyKey": _HOSTNAME_TOPOLOGY,
                    }
                ]
            }
        }
    if spec.cluster.node_selector:
        pod_spec["nodeSelector"] = dict(spec.cluster.node_selector)
    if spec.cluster.tolerations:
        pod_spec["tolerations"] = [
            toleration.model_dump(by_alias=True, exclude_none=True) for toleration in spec.cluster.tolerations
        ]
    if spec.scheduling.scheduler_name:
        pod_spec["schedulerName"] = spec.scheduling.scheduler_name
    metadata: dict[str, Any] = {"labels": labels}
    if defaults.annotations:
        metadata["annotations"] = dict(defaults.annotations)
    return {"metadata": metadata, "spec": pod_spec}


def _container(job: RLJobRef, spec: RLJobSpec, defaults: PodDefaults, *, role: str) -> dict[str, Any]:
    if role in (ROLE_WORKER, ROLE_POOL):
        amounts = _cpu_memory(spec.cluster.worker if role == ROLE_WORKER else pool_pod_resources(spec))
        devices = device_resource(spec, defaults)
        if devices is not None:
            amounts[devices] = str(spec.job.resources.devices_per_node if role == ROLE_WORKER else 1)
        name = WORKER_CONTAINER
    else:
        amounts, name = _cpu_memory(spec.cluster.head), HEAD_CONTAINER
    container: dict[str, Any] = {
        "name": name,
        "image": defaults.image_of(spec),
        "imagePullPolicy": defaults.image_pull_policy.value,
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
        # Requests equal limits: extended resources require it, and Ray sizes itself from limits.
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        "env": [
            {"name": ENV_JOB_CONFIG, "value": JOB_CONFIG_PATH},
            # Every Ray process (and the job driver, which inherits the raylet's environment)
            # authenticates with the RLJob's own token; see builders/secret.py.
            {"name": ENV_RAY_AUTH_MODE, "value": RAY_AUTH_MODE_TOKEN},
            {
                "name": ENV_RAY_AUTH_TOKEN,
                "valueFrom": {
                    "secretKeyRef": {"name": naming.auth_secret_name(job.name, job.uid), "key": AUTH_SECRET_KEY}
                },
            },
            *(_dump(var) for var in spec.env),
            # The job's environment token, which its clients send the environments' servers; only a
            # job with spec.environments or spec.agents has one (builders/secret.py).
            *([environment_token_env(job)] if spec.has_pod_sets else []),
            # where the runtime finds the rollout pool's nodes (rldock.contract.pool_nodes)
            *([{"name": POOL_NODES_ENV, "value": POOL_NODE_VALUE}] if spec.job.rollout.pool is not None else []),
        ],
        "volumeMounts": [
            {"name": VOLUME_JOB_CONFIG, "mountPath": CONFIG_MOUNT_PATH, "readOnly": True},
            {"name": VOLUME_CHECKPOINTS, "mountPath": spec.checkpoint.mount_path},
            {"name": VOLUME_SHM, "mountPath": SHM_MOUNT_PATH},
            {"name": VOLUME_TMP, "mountPath": TMP_MOUNT_PATH},
            *(_dump(mount) for mount in spec.volume_mounts),
        ],
    }
    if spec.env_from:
        # Kubernetes gives `env` precedence over `envFrom`, so the operator's variables above win
        # over a Secret's key of the same name.
        container["envFrom"] = [_dump(source) for source in spec.env_from]
    container["lifecycle"] = {"preStop": {"exec": {"command": preempt_command(job, spec, role=role)}}}
    return container


def preempt_command(job: RLJobRef, spec: RLJobSpec, *, role: str) -> list[str]:
    """The pods' preStop hook, within the grace period, before Ray's processes get their SIGTERM
    (rldock.runtime.driver.preemption). The head's stops the pod's driver as SIGTERM does (its iteration
    finished and checkpointed) and waits for it, posting a notice in the job's output folder meanwhile; a
    worker's (and a pool pod's) keeps its Ray node up while that notice is posted, for the iteration the
    driver finishes; a worker's deleted alone asks the driver for a checkpoint (a drain), a pool pod's does not."""
    return preempt_argv(
        timeout_s=spec.preemption.grace_period_seconds - PREEMPT_MARGIN_S,
        notice=posixpath.join(output_dir(job=job, spec=spec), PREEMPT_NOTICE_FILE),
        follow=role != ROLE_HEAD,  # a pool pod's engine too: the driver's last iteration may need it
        drain=role != ROLE_POOL,  # but a pool pod deleted alone costs its engine, not the attempt
    )


def environment_token_env(job: RLJobRef) -> dict[str, Any]:
    """RLDOCK_ENV_TOKEN from the job's environment token Secret, in the Ray pods and the environments'."""
    secret = naming.environment_token_secret_name(job.name, job.uid)
    return {
        "name": ENV_ENVIRONMENT_TOKEN,
        "valueFrom": {"secretKeyRef": {"name": secret, "key": ENVIRONMENT_TOKEN_KEY}},
    }


def _dump(model: BaseModel) -> dict[str, Any]:
    """A spec model as the core/v1 object it mirrors (camelCase, unset fields left out)."""
    return model.model_dump(by_alias=True, exclude_none=True)


def pool_pod_resources(spec: RLJobSpec) -> PodResources:
    """A rollout pool pod's CPU and memory: `spec.cluster.pool`, else a worker pod's. The operator cannot size it
    from the model (it never reads it), and a pod too small for a published version spills it from its object
    store or is killed at the first update, so the default errs large and the spec may size it down."""
    return spec.cluster.pool if spec.cluster.pool is not None else spec.cluster.worker


def _cpu_memory(pod: PodResources) -> dict[str, str]:
    return {"cpu": str(pod.cpu), "memory": str(pod.memory)}


def _volumes(job: RLJobRef, spec: RLJobSpec) -> list[dict[str, Any]]:
    storage = spec.checkpoint
    if storage.claim_name is not None:
        checkpoints = {"persistentVolumeClaim": {"claimName": storage.claim_name}}
    else:
        assert storage.host_path is not None, "validation requires claimName or hostPath"
        checkpoints = {"hostPath": {"path": storage.host_path, "type": "DirectoryOrCreate"}}
    return [
        {"name": VOLUME_JOB_CONFIG, "configMap": {"name": naming.config_map_name(job.name)}},
        {"name": VOLUME_CHECKPOINTS, **checkpoints},
        # Ray's object store and the engines' worker processes use shared memory; the container
        # runtime's default /dev/shm is 64 MiB.
        {"name": VOLUME_SHM, "emptyDir": {"medium": "Memory"}},
        {"name": VOLUME_TMP, "emptyDir": {}},
    ]
