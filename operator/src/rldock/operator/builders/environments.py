"""The children of one `spec.environments` entry, and the job config that points the runtime at them.

An environment (an OpenEnv server: `/health`, `/reset`, `/step`, `/ws`) runs code the job's author
may not have written, and, for the python sandbox, code the model wrote. So its pods get as little
as a pod can have, and what they get is bounded by the admin's policy (policy.py, `environments`):

- a **Deployment** of `replicas` pods, each one container of the entry's image serving on `port`,
  ready when `GET /health` answers there. The pods meet the `restricted` Pod Security Standard as the
  Ray pods do (the same security contexts, builders/ray_cluster.py), with a read-only root
  filesystem: `/tmp` is their only writable path, an emptyDir of `ephemeralStorage`, which is also the
  pod's ephemeral-storage request and limit. They run as the job's own **ServiceAccount** for
  environments (no token mounted, no RoleBinding names it), get no Service links, nothing of the Ray
  pods' volumes or env, and only the job's environment token (RLDOCK_ENV_TOKEN, builders/secret.py)
  that their server asks every client for. They carry the job's scheduler and queue (the Kueue
  queue label, Volcano's scheduler and queue annotation), so a queue counts them, and the reconciler
  scales them up only once the job is admitted (`replicas` here; reconcile.py sets 0 before);
- a **headless Service** (`clusterIP: None`), so the cluster's DNS answers the name with one
  address per ready pod and the runtime's client spreads its sessions over the replicas itself
  (a ClusterIP would pin each WebSocket session to whichever pod kube-proxy picked, unseen). It
  and the Deployment select the pods by the RLJob's uid too, which a stray pod copying the readable
  labels does not carry;
- a **NetworkPolicy** admitting connections to the pods on `port` from the job's Ray pods only, and
  letting the pods connect nowhere but the cluster's DNS and what the admin's policy lists
  (`policy.environments.egress`): not the cloud's metadata address, the API server or the internet.

The Deployment, Service and NetworkPolicy are named `<rljob>-env-<name>-<16 hex>`
(naming.environment_name), the ServiceAccount one per RLJob; all are owned by the RLJob, so they go
with it. The pods carry `rldock.io/environment-of` instead of `rldock.io/rljob`, so the Ray pods'
own NetworkPolicy (builders/network_policy.py), which admits every pod labelled `rldock.io/rljob`,
does not let an environment reach the Ray cluster's ports; the Ray pods' egress is open, so they
reach the environments.

In the job config, `servers.service: <name>` names an entry; `runtime_job_config` replaces it by
the Service's URL and the entry's sessions per replica, so the runtime never sees `service`.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel

from rldock.config import JobConfig
from rldock.config.job import EnvironmentServersSpec
from rldock.operator import naming
from rldock.operator.api import Environment, PodDefaults, RLJobSpec
from rldock.operator.builders.common import RLJobRef, child_metadata
from rldock.operator.builders.ray_cluster import (
    CONTAINER_SECURITY_CONTEXT,
    POD_SECURITY_CONTEXT,
    environment_token_env,
)
from rldock.operator.constants import (
    ANNOTATION_SPEC_HASH,
    ANNOTATION_VOLCANO_QUEUE,
    APP_NAME,
    CLUSTER_DOMAIN,
    DNS_NAMESPACE,
    DNS_POD_LABELS,
    DNS_PORT,
    ENVIRONMENT_CONTAINER,
    ENVIRONMENT_HEALTH_PATH,
    ENVIRONMENT_PORT_NAME,
    LABEL_APP_NAME,
    LABEL_ENVIRONMENT,
    LABEL_ENVIRONMENT_OF,
    LABEL_ENVIRONMENT_UID,
    LABEL_KUEUE_QUEUE,
    LABEL_MANAGED_BY,
    LABEL_NAMESPACE_NAME,
    LABEL_RLJOB,
    LABEL_ROLE,
    MANAGED_BY,
    ROLE_ENVIRONMENT,
    ROLE_HEAD,
    ROLE_WORKER,
    TMP_MOUNT_PATH,
    VOLCANO_SCHEDULER,
    VOLUME_TMP,
    GangScheduler,
)

# Keys of the Deployment's pod template that a builder may leave out: a merge patch must remove
# them explicitly (null), or a value the desired object no longer has would stay (deployment_patch).
_OPTIONAL_POD_FIELDS = ("imagePullSecrets", "priorityClassName", "schedulerName")


class EnvironmentChildren(NamedTuple):
    """What one spec.environments entry becomes, in the order they are created: the pods are never
    up before the policy that guards them, nor unnamed. (The ServiceAccount they run as is the RLJob's,
    one for all entries, made before any: build_environment_service_account.)"""

    network_policy: dict[str, Any]
    service: dict[str, Any]
    deployment: dict[str, Any]


def service_host(job: RLJobRef, environment: Environment) -> str:
    """The Service's name in the cluster's DNS."""
    return f"{naming.environment_name(job.name, environment.name)}.{job.namespace}.svc.{CLUSTER_DOMAIN}"


def service_url(job: RLJobRef, environment: Environment) -> str:
    """What the runtime's client connects to: `http://<rljob>-env-<name>.<namespace>.svc.cluster.local:<port>`."""
    return f"http://{service_host(job, environment)}:{environment.port}"


def runtime_job_config(*, job: RLJobRef, spec: RLJobSpec) -> JobConfig:
    """`spec.job` as the runtime reads it: every `servers.service` (`agent.environment.servers`,
    `agent.sandbox.servers`) replaced by the Service's `url` and the entry's `sessions_per_replica`.
    `spec` must be free of validation problems (every service names an entry)."""
    agent = spec.job.agent
    if agent is None:
        return spec.job
    entries = {environment.name: environment for environment in spec.environments}

    def resolved(servers: EnvironmentServersSpec) -> EnvironmentServersSpec:
        entry = entries[servers.service or ""]
        return servers.model_copy(
            update={"service": None, "url": service_url(job, entry), "sessions_per_replica": entry.sessions_per_replica}
        )

    updates: dict[str, Any] = {}
    environment = agent.environment
    if environment is not None and environment.servers is not None and environment.servers.service is not None:
        updates["environment"] = environment.model_copy(update={"servers": resolved(environment.servers)})
    if agent.sandbox.servers is not None and agent.sandbox.servers.service is not None:
        updates["sandbox"] = agent.sandbox.model_copy(update={"servers": resolved(agent.sandbox.servers)})
    if not updates:
        return spec.job
    return spec.job.model_copy(update={"agent": agent.model_copy(update=updates)})


def pod_selector(job: RLJobRef, environment: Environment) -> dict[str, str]:
    """The labels that pick one entry's pods (the Deployment's immutable selector, the Service's): the
    RLJob's uid among them, so that only this RLJob's pods match."""
    return {
        LABEL_ENVIRONMENT_OF: naming.label_value(job.name),
        LABEL_ENVIRONMENT: environment.name,
        LABEL_ENVIRONMENT_UID: job.uid,
    }


def environment_image(spec: RLJobSpec, environment: Environment, defaults: PodDefaults) -> str:
    return environment.image or defaults.image_of(spec)


def build_environment(
    *,
    job: RLJobRef,
    spec: RLJobSpec,
    environment: Environment,
    defaults: PodDefaults = PodDefaults(),
    egress: Sequence[Mapping[str, Any]] = (),
) -> EnvironmentChildren:
    """The NetworkPolicy, Service and Deployment of `environment`, an entry of `spec.environments`;
    `egress`: the admin's egress rules besides DNS (policy.environments.egress)."""
    return EnvironmentChildren(
        network_policy=build_environment_network_policy(job=job, environment=environment, egress=egress),
        service=build_environment_service(job=job, environment=environment),
        deployment=build_environment_deployment(job=job, spec=spec, environment=environment, defaults=defaults),
    )


def build_environment_service_account(*, job: RLJobRef) -> dict[str, Any]:
    """The identity the environments' pods run as instead of the namespace's `default` (and whatever
    RoleBindings name it): one per RLJob, bound to nothing, its token never mounted."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_metadata(job, naming.environment_service_account_name(job.name)),
        "automountServiceAccountToken": False,
    }


def build_environment_deployment(
    *, job: RLJobRef, spec: RLJobSpec, environment: Environment, defaults: PodDefaults = PodDefaults()
) -> dict[str, Any]:
    """`replicas` pods, none while the RLJob is suspended (and none before it is admitted: the
    reconciler's `with_replicas`); annotated with the hash of everything but the replica count, which
    the reconciler compares to decide on a patch."""
    selector = pod_selector(job, environment)
    queue_labels, queue_annotations = _queue(spec)
    template_labels = {
        **defaults.labels,  # the admin's, under the operator's own
        LABEL_APP_NAME: APP_NAME,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_ROLE: ROLE_ENVIRONMENT,
        **queue_labels,
        **selector,
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": naming.environment_service_account_name(job.name),
        "automountServiceAccountToken": False,
        # No `<SERVICE>_HOST`/`_PORT` variables of every Service in the namespace: the pods learn
        # nothing of their neighbours they were not given.
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "containers": [_container(job, spec, environment, defaults)],
        # The only writable path, sized: a full /tmp is ENOSPC to the server, not the node's disk.
        "volumes": [{"name": VOLUME_TMP, "emptyDir": {"sizeLimit": str(environment.ephemeral_storage)}}],
    }
    scheduler = _scheduler(spec)
    if scheduler is not None:
        pod_spec["schedulerName"] = scheduler
    pull_secrets = defaults.image_pull_secrets_of(spec)
    if pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in pull_secrets]
    if defaults.priority_class_name:
        pod_spec["priorityClassName"] = defaults.priority_class_name
    template_metadata: dict[str, Any] = {"labels": template_labels}
    annotations = {**defaults.annotations, **queue_annotations}
    if annotations:
        template_metadata["annotations"] = annotations
    deployment_spec: dict[str, Any] = {
        "replicas": 0 if spec.suspend else environment.replicas,
        "selector": {"matchLabels": selector},
        "template": {"metadata": template_metadata, "spec": pod_spec},
    }
    metadata = _metadata(job, environment, hashed={k: v for k, v in deployment_spec.items() if k != "replicas"})
    metadata["labels"].update(queue_labels)  # Kueue reads a Deployment's queue from its own labels
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata, "spec": deployment_spec}


def with_replicas(deployment: Mapping[str, Any], replicas: int) -> dict[str, Any]:
    """`deployment` asking for `replicas` pods (the hash leaves the count out, so it stays valid)."""
    scaled = copy.deepcopy(dict(deployment))
    scaled["spec"]["replicas"] = replicas
    return scaled


def _scheduler(spec: RLJobSpec) -> str | None:
    """The scheduler of the job's pods: its own, else Volcano's for a Volcano gang (KubeRay sets that
    on the Ray pods), else the cluster's default."""
    if spec.scheduling.scheduler_name:
        return spec.scheduling.scheduler_name
    return VOLCANO_SCHEDULER if spec.scheduling.gang is GangScheduler.VOLCANO else None


def _queue(spec: RLJobSpec) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and pod annotations that put the environments' pods in the job's queue: Kueue's
    queue label (its pod and Deployment integrations admit them against the same quota), Volcano's
    queue annotation (the PodGroup Volcano makes for a lone pod takes the queue from it)."""
    queue = spec.scheduling.queue
    if not queue:
        return {}, {}
    if spec.scheduling.gang is GangScheduler.KUEUE:
        return {LABEL_KUEUE_QUEUE: queue}, {}
    if _scheduler(spec) == VOLCANO_SCHEDULER:
        return {}, {ANNOTATION_VOLCANO_QUEUE: queue}
    return {}, {}


def _container(job: RLJobRef, spec: RLJobSpec, environment: Environment, defaults: PodDefaults) -> dict[str, Any]:
    amounts = {
        "cpu": str(environment.resources.cpu),
        "memory": str(environment.resources.memory),
        "ephemeral-storage": str(environment.ephemeral_storage),
    }
    container: dict[str, Any] = {
        "name": ENVIRONMENT_CONTAINER,
        "image": environment_image(spec, environment, defaults),
        "imagePullPolicy": defaults.image_pull_policy.value,
    }
    if environment.command is not None:
        container["command"] = list(environment.command)
    if environment.args is not None:
        container["args"] = list(environment.args)
    container.update(
        {
            "ports": [{"name": ENVIRONMENT_PORT_NAME, "containerPort": environment.port, "protocol": "TCP"}],
            # The operator's token last: it wins over a variable of the same name (validation refuses one).
            "env": [*(_dump(var) for var in environment.env), environment_token_env(job)],
            "resources": {"requests": dict(amounts), "limits": dict(amounts)},
            "securityContext": {**copy.deepcopy(CONTAINER_SECURITY_CONTEXT), "readOnlyRootFilesystem": True},
            # Ready (and so in the Service's DNS answer) once the server answers its health check;
            # no liveness probe: a server busy with long steps must not be restarted mid-episode,
            # and one that exits is restarted by the kubelet anyway.
            "readinessProbe": {
                "httpGet": {"path": ENVIRONMENT_HEALTH_PATH, "port": ENVIRONMENT_PORT_NAME},
                "periodSeconds": 5,
                "timeoutSeconds": 2,
                "failureThreshold": 3,
            },
            "volumeMounts": [{"name": VOLUME_TMP, "mountPath": TMP_MOUNT_PATH}],
        }
    )
    return container


def build_environment_service(*, job: RLJobRef, environment: Environment) -> dict[str, Any]:
    """Headless: the name resolves to every ready pod's address (one A record each)."""
    service_spec = {
        "clusterIP": "None",
        "selector": pod_selector(job, environment),
        "ports": [
            {
                "name": ENVIRONMENT_PORT_NAME,
                "port": environment.port,
                "targetPort": environment.port,
                "protocol": "TCP",
            }
        ],
        "publishNotReadyAddresses": False,
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, environment, hashed=service_spec),
        "spec": service_spec,
    }


def build_environment_network_policy(
    *, job: RLJobRef, environment: Environment, egress: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """Ingress to the entry's pods on its port from the job's Ray pods (head and workers) only; egress
    from them to the cluster's DNS and to `egress` (the admin's rules) only. Enforced where the
    cluster's network plugin enforces NetworkPolicies (docs/security.md)."""
    ray_pods = {
        "matchLabels": {LABEL_RLJOB: naming.label_value(job.name)},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": [ROLE_HEAD, ROLE_WORKER]}],
    }
    dns = {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {LABEL_NAMESPACE_NAME: DNS_NAMESPACE}},
                "podSelector": {"matchLabels": dict(DNS_POD_LABELS)},
            }
        ],
        "ports": [{"protocol": protocol, "port": DNS_PORT} for protocol in ("UDP", "TCP")],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, environment),
        "spec": {
            "podSelector": {"matchLabels": pod_selector(job, environment)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": [{"podSelector": ray_pods}], "ports": [{"protocol": "TCP", "port": environment.port}]}
            ],
            "egress": [dns, *(copy.deepcopy(dict(rule)) for rule in egress)],
        },
    }


def network_policy_patch(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any] | None:
    """A policy edited by hand (or made by an older operator) is put back."""
    return {"spec": desired["spec"]} if existing.get("spec") != desired["spec"] else None


def service_patch(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any] | None:
    """The API server defaults a stored Service's spec, so the builder's hash tells a change; clusterIP
    stays out of the patch (it is immutable)."""
    if _spec_hash(existing) == _spec_hash(desired):
        return None
    spec = {key: value for key, value in desired["spec"].items() if key != "clusterIP"}
    return {"metadata": {"annotations": dict(desired["metadata"]["annotations"])}, "spec": spec}


def deployment_patch(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any] | None:
    """A JSON merge patch from the stored Deployment to `desired`, or None when none is needed.

    When the builder's hash differs (a new image, port, env...: the Deployment rolls its pods), the
    hash and the whole spec, with the pod template's optional fields `desired` leaves out set to null
    (a merge patch keeps what it does not name); when only the replica count differs (suspend,
    resume, a new count), that alone."""
    if _spec_hash(existing) == _spec_hash(desired):
        if existing["spec"].get("replicas") == desired["spec"]["replicas"]:
            return None
        return {"spec": {"replicas": desired["spec"]["replicas"]}}
    spec = copy.deepcopy(desired["spec"])
    template = spec["template"]
    for key in _OPTIONAL_POD_FIELDS:
        template["spec"].setdefault(key, None)
    template["metadata"].setdefault("annotations", None)
    return {"metadata": {"annotations": dict(desired["metadata"]["annotations"])}, "spec": spec}


def _spec_hash(obj: Mapping[str, Any]) -> str | None:
    return (obj["metadata"].get("annotations") or {}).get(ANNOTATION_SPEC_HASH)


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(by_alias=True, exclude_none=True)


def _metadata(job: RLJobRef, environment: Environment, *, hashed: dict[str, Any] | None = None) -> dict[str, Any]:
    """An environment child's metadata: its name and label, and the hash of the spec it was built from
    (`hashed`: what a change of rolls it) where the reconciler compares one."""
    annotations = None if hashed is None else {ANNOTATION_SPEC_HASH: _hash(hashed)}
    return child_metadata(
        job,
        naming.environment_name(job.name, environment.name),
        labels={LABEL_ENVIRONMENT: environment.name},
        annotations=annotations,
    )


def _hash(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
