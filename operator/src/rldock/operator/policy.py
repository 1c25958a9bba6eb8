"""The cluster admin's policy: what an RLJob may ask of the cluster beyond the secure default.

Whoever may create an RLJob chooses the image its pods run, the volumes they mount and where they
are scheduled. Left open, that is a node's root filesystem mounted into a container of their
choosing. So the operator enforces a policy that the admin sets once, in the chart's `policy`
values (passed to the operator as JSON in RLDOCK_POLICY, settings.py):

- volumes: hostPath (in spec.volumes and spec.checkpoint.hostPath) and NFS are refused unless the
  admin lists the allowed path prefixes and servers; PVCs, ConfigMaps, Secrets and emptyDirs are
  always allowed (they are what the `restricted` Pod Security Standard allows);
- images: spec.image must be the installation's default runtime image or start with an allowed
  prefix;
- scheduling: scheduler names, queues, tolerations and node selectors, each either unrestricted
  (null) or a list of what is allowed; a toleration of every taint is refused unless listed;
- pod defaults the admin adds to every Ray pod: labels, annotations, a priority class and
  imagePullSecrets.

`policy_problems` is pure: spec and policy in, problems (each naming the field and the policy
value) out. The operator refuses a spec with problems at admission (admission.py) and, for specs
that got past admission (no webhook, or a policy changed later), fails the RLJob with reason
PolicyDenied and creates nothing for it (reconcile.py).
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from rldock.config import Problem
from rldock.operator.api import RLJobSpec, Toleration
from rldock.operator.constants import MAX_LABEL_VALUE_LENGTH, MAX_NAME_LENGTH

# The chart value each rule reads, as a person would write it in `helm install --set`.
CHART_PREFIX = "policy"
ANY_NFS_SERVER = "*"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class AllowedToleration(_Model):
    """A toleration RLJobs may carry; an RLJob's toleration must equal one of these field by field
    (unset fields of the RLJob's toleration compare as their Kubernetes defaults)."""

    key: str | None = None
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None


class AdminPodDefaults(_Model):
    """What the admin adds to every Ray pod (settings.py puts them into api.PodDefaults)."""

    labels: dict[str, str] = Field(
        default_factory=dict, description="Labels of every Ray pod (the operator's own win)."
    )
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations of every Ray pod.")
    priority_class_name: str | None = Field(
        default=None, max_length=MAX_NAME_LENGTH, description="priorityClassName of every Ray pod."
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Secrets (in the RLJob's namespace) to pull the runtime image with."
    )


class AdminPolicy(_Model):
    """The chart's `policy` values. Defaults are the secure ones: no hostPath, no NFS, only the
    default runtime image, no toleration of every taint."""

    host_path_prefixes: list[str] = Field(
        default_factory=list, description="Absolute path prefixes hostPath volumes may mount; `/` allows any path."
    )
    nfs_servers: list[str] = Field(
        default_factory=list, description=f"NFS servers volumes may mount; `{ANY_NFS_SERVER}` allows any."
    )
    image_prefixes: list[str] = Field(
        default_factory=list,
        description="Prefixes spec.image may start with (e.g. `registry.example.com/ml/`); "
        "the installation's default runtime image is always allowed.",
    )
    scheduler_names: list[str] | None = Field(
        default=None, description="Allowed spec.scheduling.schedulerName values; null: any."
    )
    queues: list[str] | None = Field(default=None, description="Allowed spec.scheduling.queue values; null: any.")
    tolerations: list[AllowedToleration] | None = Field(
        default=None, description="Allowed tolerations; null: any but a toleration of every taint."
    )
    node_selectors: dict[str, list[str]] | None = Field(
        default=None, description="Allowed nodeSelector keys, each with its allowed values; null: any."
    )
    pod_defaults: AdminPodDefaults = Field(default_factory=AdminPodDefaults)

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        for index, prefix in enumerate(self.host_path_prefixes):
            if not posixpath.isabs(prefix):
                raise ValueError(f"{CHART_PREFIX}.hostPathPrefixes[{index}]: {prefix!r} must be an absolute path")
        for value in self.pod_defaults.labels.values():
            if len(value) > MAX_LABEL_VALUE_LENGTH:
                raise ValueError(f"{CHART_PREFIX}.podDefaults.labels: value {value!r} is longer than 63 characters")


def parse_policy(text: str) -> AdminPolicy:
    """The policy from its JSON (RLDOCK_POLICY); empty text is the default policy. ValueError
    naming the chart value on anything else."""
    if not text.strip():
        return AdminPolicy()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{CHART_PREFIX}: not JSON ({error})") from None
    if raw is None:
        return AdminPolicy()
    try:
        return AdminPolicy.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in (CHART_PREFIX, *first["loc"]))
        raise ValueError(f"{where}: {first['msg']}") from None


def _denied(path: str, what: str, value: str, rule: str, allowed: Any) -> Problem:
    return Problem(
        path,
        f"{what} {value!r} is not allowed by the cluster's policy ({CHART_PREFIX}.{rule}: "
        f"{json.dumps(allowed)}); use an allowed value or ask the cluster admin to allow it",
    )


def _under(path: str, prefix: str) -> bool:
    path, prefix = posixpath.normpath(path), posixpath.normpath(prefix)
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def policy_problems(spec: RLJobSpec, policy: AdminPolicy, *, default_image: str) -> list[Problem]:
    """Every way `spec` reaches beyond `policy`, each naming the field and the policy value."""
    problems: list[Problem] = []
    if spec.checkpoint.host_path is not None:
        problems += _host_path_problem("spec.checkpoint.hostPath", spec.checkpoint.host_path, policy)
    for index, volume in enumerate(spec.volumes):
        path = f"spec.volumes[{index}]"
        if volume.host_path is not None:
            problems += _host_path_problem(f"{path}.hostPath.path", volume.host_path.path, policy)
        if (
            volume.nfs is not None
            and ANY_NFS_SERVER not in policy.nfs_servers
            and volume.nfs.server not in policy.nfs_servers
        ):
            problems.append(
                _denied(f"{path}.nfs.server", "NFS server", volume.nfs.server, "nfsServers", policy.nfs_servers)
            )
    if (
        spec.image is not None
        and spec.image != default_image
        and not any(spec.image.startswith(prefix) for prefix in policy.image_prefixes)
    ):
        problems.append(_denied("spec.image", "image", spec.image, "imagePrefixes", policy.image_prefixes))
    scheduling = spec.scheduling
    if (
        scheduling.scheduler_name is not None
        and policy.scheduler_names is not None
        and scheduling.scheduler_name not in policy.scheduler_names
    ):
        problems.append(
            _denied(
                "spec.scheduling.schedulerName",
                "scheduler",
                scheduling.scheduler_name,
                "schedulerNames",
                policy.scheduler_names,
            )
        )
    if scheduling.queue is not None and policy.queues is not None and scheduling.queue not in policy.queues:
        problems.append(_denied("spec.scheduling.queue", "queue", scheduling.queue, "queues", policy.queues))
    for index, toleration in enumerate(spec.cluster.tolerations):
        problems += _toleration_problem(f"spec.cluster.tolerations[{index}]", toleration, policy)
    for key, value in spec.cluster.node_selector.items():
        if policy.node_selectors is None:
            continue
        if value not in policy.node_selectors.get(key, ()):
            problems.append(
                _denied(
                    f"spec.cluster.nodeSelector[{key}]",
                    "node selector",
                    f"{key}={value}",
                    "nodeSelectors",
                    policy.node_selectors,
                )
            )
    return problems


def _host_path_problem(path: str, host_path: str, policy: AdminPolicy) -> list[Problem]:
    if any(_under(host_path, prefix) for prefix in policy.host_path_prefixes):
        return []
    return [_denied(path, "hostPath", host_path, "hostPathPrefixes", policy.host_path_prefixes)]


def _toleration_problem(path: str, toleration: Toleration, policy: AdminPolicy) -> list[Problem]:
    asked = AllowedToleration(
        key=toleration.key or None,
        operator=toleration.operator or "Equal",
        value=toleration.value or None,
        effect=toleration.effect,
    )
    described = json.dumps(asked.model_dump(by_alias=True, exclude_none=True))
    if policy.tolerations is None:
        if asked.key is None and asked.operator == "Exists":
            return [
                Problem(
                    path,
                    "a toleration of every taint (empty key, operator Exists) is not allowed by the "
                    f"cluster's policy ({CHART_PREFIX}.tolerations: null); name the taint's key, or ask "
                    "the cluster admin to list this toleration",
                )
            ]
        return []
    if asked in policy.tolerations:
        return []
    allowed = [t.model_dump(by_alias=True, exclude_none=True) for t in policy.tolerations]
    return [_denied(path, "toleration", described, "tolerations", allowed)]
