"""What the RLJob's own pods beside the Ray cluster have in common: the pods of `spec.environments`
(builders/environments.py) and of `spec.agents` (builders/agents.py) are both "pod sets", entries of a
spec list that each become a Deployment of restricted pods and a NetworkPolicy.

A `PodSetKind` is what tells the two apart (the spec's list, the labels, the container's name, the
names of the children); everything else is here, once:

- the **Deployment**: `replicas` pods (0 while the RLJob is suspended; the reconciler keeps 0 until the
  job is admitted: `with_replicas`), each one container meeting the `restricted` Pod Security Standard
  as the Ray pods do (the same security contexts, builders/ray_cluster.py) with a read-only root
  filesystem and `/tmp` its only writable path, an emptyDir of `ephemeralStorage`; run as the RLJob's
  own ServiceAccount for such pods (no token mounted, no RoleBinding names it), without Service links,
  in the job's queue and scheduler. The pods carry `<kind>-of` instead of `rldock.io/rljob`, so the Ray
  pods' NetworkPolicy (builders/network_policy.py), which admits every pod labelled `rldock.io/rljob`,
  does not let them in; and the RLJob's uid, which a stray pod copying the readable labels does not carry;
- the **DNS egress rule** every such pod's NetworkPolicy starts with;
- the patches the reconciler sends to put a stored child back to what was built.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from rldock.operator import naming
from rldock.operator.api import EnvVar, PodDefaults, PodResources, Quantity, RLJobSpec
from rldock.operator.builders.common import RLJobRef, child_metadata
from rldock.operator.builders.ray_cluster import CONTAINER_SECURITY_CONTEXT, POD_SECURITY_CONTEXT
from rldock.operator.constants import (
    AGENT_CONTAINER,
    ANNOTATION_SPEC_HASH,
    ANNOTATION_VOLCANO_QUEUE,
    APP_NAME,
    DNS_NAMESPACE,
    DNS_POD_LABELS,
    DNS_PORT,
    ENVIRONMENT_CONTAINER,
    LABEL_AGENT,
    LABEL_AGENT_OF,
    LABEL_AGENT_UID,
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
    ROLE_AGENT,
    ROLE_ENVIRONMENT,
    ROLE_HEAD,
    ROLE_POOL,
    ROLE_WORKER,
    TMP_MOUNT_PATH,
    VOLCANO_SCHEDULER,
    VOLUME_TMP,
    EventReason,
    GangScheduler,
)

# Keys of the Deployment's pod template that a builder may leave out: a merge patch must remove
# them explicitly (null), or a value the desired object no longer has would stay (deployment_patch).
_OPTIONAL_POD_FIELDS = ("imagePullSecrets", "priorityClassName", "schedulerName")


class PodSetEntry(Protocol):
    """What an entry of spec.environments and of spec.agents both have."""

    @property
    def name(self) -> str: ...
    @property
    def image(self) -> str | None: ...
    @property
    def replicas(self) -> int: ...
    @property
    def resources(self) -> PodResources: ...
    @property
    def ephemeral_storage(self) -> Quantity: ...
    @property
    def env(self) -> list[EnvVar]: ...


@dataclass(frozen=True)
class PodSetKind:
    """One kind of pod set: where its entries are in the spec and how its children are told apart."""

    section: str  # the spec's list (`environments`, `agents`) and the admin policy's section
    role: str  # the pods' `rldock.io/role`
    entry_label: str  # on the children and pods: the entry's name
    owner_label: str  # on the pods instead of `rldock.io/rljob`: the RLJob's name
    uid_label: str  # on the pods: the RLJob's uid
    container: str
    child_name: Callable[[str, str], str]  # (rljob, entry) -> the children's name (naming.py)
    created: EventReason
    deleted: EventReason

    def entries(self, spec: RLJobSpec) -> Sequence[PodSetEntry]:
        return list(getattr(spec, self.section))

    def pod_selector(self, job: RLJobRef, entry_name: str) -> dict[str, str]:
        """The labels that pick one entry's pods (the Deployment's immutable selector): the RLJob's uid
        among them, so that only this RLJob's pods match."""
        return {self.owner_label: naming.label_value(job.name), self.entry_label: entry_name, self.uid_label: job.uid}

    def job_pods(self, job: RLJobRef) -> dict[str, Any]:
        """A podSelector of every pod of this kind of the RLJob, whichever entry."""
        return {"matchLabels": {self.owner_label: naming.label_value(job.name), self.uid_label: job.uid}}


ENVIRONMENTS = PodSetKind(
    section="environments",
    role=ROLE_ENVIRONMENT,
    entry_label=LABEL_ENVIRONMENT,
    owner_label=LABEL_ENVIRONMENT_OF,
    uid_label=LABEL_ENVIRONMENT_UID,
    container=ENVIRONMENT_CONTAINER,
    child_name=naming.environment_name,
    created=EventReason.CREATED_ENVIRONMENT,
    deleted=EventReason.DELETED_ENVIRONMENT,
)
AGENTS = PodSetKind(
    section="agents",
    role=ROLE_AGENT,
    entry_label=LABEL_AGENT,
    owner_label=LABEL_AGENT_OF,
    uid_label=LABEL_AGENT_UID,
    container=AGENT_CONTAINER,
    child_name=naming.agent_name,
    created=EventReason.CREATED_AGENT,
    deleted=EventReason.DELETED_AGENT,
)
POD_SET_KINDS = (ENVIRONMENTS, AGENTS)


def entry_image(spec: RLJobSpec, entry: PodSetEntry, defaults: PodDefaults) -> str:
    return entry.image or defaults.image_of(spec)


def build_pod_service_account(*, job: RLJobRef) -> dict[str, Any]:
    """The identity the environments' and agents' pods run as instead of the namespace's `default` (and
    whatever RoleBindings name it): one per RLJob, bound to nothing, its token never mounted."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": child_metadata(job, naming.environment_service_account_name(job.name)),
        "automountServiceAccountToken": False,
    }


def base_container(
    *, kind: PodSetKind, spec: RLJobSpec, entry: PodSetEntry, defaults: PodDefaults, env: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The entry's container without its command, ports or probes: image, `env` (the entry's first, then
    the operator's, which win), sized resources, the restricted security context, `/tmp`."""
    amounts = {
        "cpu": str(entry.resources.cpu),
        "memory": str(entry.resources.memory),
        "ephemeral-storage": str(entry.ephemeral_storage),
    }
    return {
        "name": kind.container,
        "image": entry_image(spec, entry, defaults),
        "imagePullPolicy": defaults.image_pull_policy.value,
        "env": [*(_dump(var) for var in entry.env), *(dict(var) for var in env)],
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        "securityContext": {**copy.deepcopy(CONTAINER_SECURITY_CONTEXT), "readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": VOLUME_TMP, "mountPath": TMP_MOUNT_PATH}],
    }


def build_deployment(
    *,
    kind: PodSetKind,
    job: RLJobRef,
    spec: RLJobSpec,
    entry: PodSetEntry,
    container: dict[str, Any],
    volumes: Sequence[Mapping[str, Any]] = (),
    defaults: PodDefaults = PodDefaults(),
) -> dict[str, Any]:
    """`replicas` pods of `container` (base_container's, completed by the kind), none while the RLJob is
    suspended; annotated with the hash of everything but the replica count, which the reconciler compares
    to decide on a patch. `volumes`: besides `/tmp`'s."""
    selector = kind.pod_selector(job, entry.name)
    queue_labels, queue_annotations = _queue(spec)
    template_labels = {
        **defaults.labels,  # the admin's, under the operator's own
        LABEL_APP_NAME: APP_NAME,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_ROLE: kind.role,
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
        "containers": [container],
        # The only writable path, sized: a full /tmp is ENOSPC to the program, not the node's disk.
        "volumes": [
            {"name": VOLUME_TMP, "emptyDir": {"sizeLimit": str(entry.ephemeral_storage)}},
            *(copy.deepcopy(dict(volume)) for volume in volumes),
        ],
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
        "replicas": 0 if spec.suspend else entry.replicas,
        "selector": {"matchLabels": selector},
        "template": {"metadata": template_metadata, "spec": pod_spec},
    }
    metadata = child_meta(kind, job, entry.name, hashed={k: v for k, v in deployment_spec.items() if k != "replicas"})
    metadata["labels"].update(queue_labels)  # Kueue reads a Deployment's queue from its own labels
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata, "spec": deployment_spec}


def ray_pods(job: RLJobRef) -> dict[str, Any]:
    """A podSelector of the job's Ray pods (head, workers, the rollout pool's): only they carry `rldock.io/rljob`."""
    return {
        "matchLabels": {LABEL_RLJOB: naming.label_value(job.name)},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": [ROLE_HEAD, ROLE_WORKER, ROLE_POOL]}],
    }


def dns_egress() -> dict[str, Any]:
    """The egress rule to the cluster's DNS (CoreDNS's pods in kube-system, port 53, UDP and TCP)."""
    return {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {LABEL_NAMESPACE_NAME: DNS_NAMESPACE}},
                "podSelector": {"matchLabels": dict(DNS_POD_LABELS)},
            }
        ],
        "ports": [{"protocol": protocol, "port": DNS_PORT} for protocol in ("UDP", "TCP")],
    }


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
    """The labels and pod annotations that put the pods in the job's queue: Kueue's queue label (its pod
    and Deployment integrations admit them against the same quota), Volcano's queue annotation (the
    PodGroup Volcano makes for a lone pod takes the queue from it)."""
    queue = spec.scheduling.queue
    if not queue:
        return {}, {}
    if spec.scheduling.gang is GangScheduler.KUEUE:
        return {LABEL_KUEUE_QUEUE: queue}, {}
    if _scheduler(spec) == VOLCANO_SCHEDULER:
        return {}, {ANNOTATION_VOLCANO_QUEUE: queue}
    return {}, {}


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


def child_meta(
    kind: PodSetKind, job: RLJobRef, entry_name: str, *, hashed: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A pod set child's metadata: its name and entry label, and the hash of the spec it was built from
    (`hashed`: what a change of rolls it) where the reconciler compares one."""
    annotations = None if hashed is None else {ANNOTATION_SPEC_HASH: spec_hash(hashed)}
    return child_metadata(
        job, kind.child_name(job.name, entry_name), labels={kind.entry_label: entry_name}, annotations=annotations
    )


def spec_hash(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
