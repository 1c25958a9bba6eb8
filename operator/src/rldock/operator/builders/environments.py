"""The children of one `spec.environments` entry, and the job config that points the runtime at them.

An environment (an OpenEnv server: `/health`, `/reset`, `/step`, `/ws`) runs as:

- a **Deployment** of `replicas` pods (0 while the RLJob is suspended), each one container of the
  entry's image serving on `port`, ready when `GET /health` answers there. The pods meet the
  `restricted` Pod Security Standard exactly as the Ray pods do (the same security contexts,
  builders/ray_cluster.py), get no service-account token and no Service links, and have only
  `/tmp` writable (an emptyDir): an environment runs code the job's author may not have written,
  and, for the python sandbox, code the model wrote, so it gets nothing of the Ray pods' volumes,
  env or token;
- a **headless Service** (`clusterIP: None`), so the cluster's DNS answers the name with one
  address per ready pod and the runtime's client spreads its sessions over the replicas itself
  (a ClusterIP would pin each WebSocket session to whichever pod kube-proxy picked, unseen);
- a **NetworkPolicy** admitting connections to the pods on `port` from the job's Ray pods only.

All three are named `<rljob>-env-<name>` (naming.environment_name) and owned by the RLJob, so they
go with it. The pods carry `rldock.io/environment-of` instead of `rldock.io/rljob`, so the Ray
pods' own NetworkPolicy (builders/network_policy.py), which admits every pod labelled
`rldock.io/rljob`, does not let an environment reach the Ray cluster's ports; the Ray pods' egress
is open, so they reach the environments.

In the job config, `servers.service: <name>` names an entry; `runtime_job_config` replaces it by
the Service's URL and the entry's sessions per replica, so the runtime never sees `service`.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel

from rldock.config import JobConfig
from rldock.config.job import EnvironmentServersSpec
from rldock.operator import naming
from rldock.operator.api import Environment, PodDefaults, RLJobSpec
from rldock.operator.builders.common import RLJobRef, child_metadata
from rldock.operator.builders.ray_cluster import CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT
from rldock.operator.constants import (
    ANNOTATION_SPEC_HASH,
    APP_NAME,
    CLUSTER_DOMAIN,
    ENVIRONMENT_CONTAINER,
    ENVIRONMENT_HEALTH_PATH,
    ENVIRONMENT_PORT_NAME,
    LABEL_APP_NAME,
    LABEL_ENVIRONMENT,
    LABEL_ENVIRONMENT_OF,
    LABEL_MANAGED_BY,
    LABEL_RLJOB,
    LABEL_ROLE,
    MANAGED_BY,
    ROLE_ENVIRONMENT,
    ROLE_HEAD,
    ROLE_WORKER,
    TMP_MOUNT_PATH,
    VOLUME_TMP,
)

# Keys of the Deployment's pod template that a builder may leave out: a merge patch must remove
# them explicitly (null), or a value the desired object no longer has would stay (deployment_patch).
_OPTIONAL_POD_FIELDS = ("imagePullSecrets", "priorityClassName")


class EnvironmentChildren(NamedTuple):
    """What one spec.environments entry becomes, in the order they are created: the pods are never
    up before the policy that guards them, nor unnamed."""

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
    """The labels that pick one entry's pods (the Deployment's immutable selector)."""
    return {LABEL_ENVIRONMENT_OF: naming.label_value(job.name), LABEL_ENVIRONMENT: environment.name}


def environment_image(spec: RLJobSpec, environment: Environment, defaults: PodDefaults) -> str:
    return environment.image or defaults.image_of(spec)


def build_environment(
    *, job: RLJobRef, spec: RLJobSpec, environment: Environment, defaults: PodDefaults = PodDefaults()
) -> EnvironmentChildren:
    """The NetworkPolicy, Service and Deployment of `environment`, an entry of `spec.environments`."""
    return EnvironmentChildren(
        network_policy=build_environment_network_policy(job=job, environment=environment),
        service=build_environment_service(job=job, environment=environment),
        deployment=build_environment_deployment(job=job, spec=spec, environment=environment, defaults=defaults),
    )


def build_environment_deployment(
    *, job: RLJobRef, spec: RLJobSpec, environment: Environment, defaults: PodDefaults = PodDefaults()
) -> dict[str, Any]:
    """`replicas` pods, none while the RLJob is suspended; annotated with the hash of everything but
    the replica count, which the reconciler compares to decide on a patch."""
    selector = pod_selector(job, environment)
    template_labels = {
        **defaults.labels,  # the admin's, under the operator's own
        LABEL_APP_NAME: APP_NAME,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_ROLE: ROLE_ENVIRONMENT,
        **selector,
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        # No `<SERVICE>_HOST`/`_PORT` variables of every Service in the namespace: the pods learn
        # nothing of their neighbours they were not given.
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "containers": [_container(spec, environment, defaults)],
        "volumes": [{"name": VOLUME_TMP, "emptyDir": {}}],
    }
    pull_secrets = defaults.image_pull_secrets_of(spec)
    if pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in pull_secrets]
    if defaults.priority_class_name:
        pod_spec["priorityClassName"] = defaults.priority_class_name
    template_metadata: dict[str, Any] = {"labels": template_labels}
    if defaults.annotations:
        template_metadata["annotations"] = dict(defaults.annotations)
    deployment_spec: dict[str, Any] = {
        "replicas": 0 if spec.suspend else environment.replicas,
        "selector": {"matchLabels": selector},
        "template": {"metadata": template_metadata, "spec": pod_spec},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(job, environment, hashed={k: v for k, v in deployment_spec.items() if k != "replicas"}),
        "spec": deployment_spec,
    }


def _container(spec: RLJobSpec, environment: Environment, defaults: PodDefaults) -> dict[str, Any]:
    amounts = {"cpu": str(environment.resources.cpu), "memory": str(environment.resources.memory)}
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
            "env": [_dump(var) for var in environment.env],
            "resources": {"requests": dict(amounts), "limits": dict(amounts)},
            "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
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


def build_environment_network_policy(*, job: RLJobRef, environment: Environment) -> dict[str, Any]:
    """Ingress to the entry's pods on its port from the job's Ray pods (head and workers) only."""
    ray_pods = {
        "matchLabels": {LABEL_RLJOB: naming.label_value(job.name)},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": [ROLE_HEAD, ROLE_WORKER]}],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, environment),
        "spec": {
            "podSelector": {"matchLabels": pod_selector(job, environment)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": ray_pods}], "ports": [{"protocol": "TCP", "port": environment.port}]}
            ],
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
