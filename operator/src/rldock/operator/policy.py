"""The cluster admin's policy: what an RLJob may ask of the cluster beyond the secure default.

Whoever may create an RLJob chooses the image its pods run, the volumes they mount and where they
are scheduled. Left open, that is a node's root filesystem mounted into a container of their
choosing. So the operator enforces a policy that the admin sets once, in the chart's `policy`
values (passed to the operator as JSON in RLDOCK_POLICY, settings.py):

- volumes: hostPath (in spec.volumes and spec.checkpoint.hostPath) and NFS are refused unless the
  admin lists the allowed path prefixes and exports (server and path prefix); PVCs, ConfigMaps,
  Secrets and emptyDirs are allowed here (they are what the `restricted` Pod Security Standard
  allows), and the webhook asks whether the requesting user may read them (references.py);
- images: spec.image must be the installation's default runtime image or lie under an allowed
  prefix, matched at a boundary (`image_allowed`, the one image matcher);
- scheduling: scheduler names (default: only the cluster's default scheduler), queues (default:
  none), tolerations and node selectors, each either unrestricted (null) or a list of what is
  allowed; by default a toleration of every taint, a toleration of a protected taint (control-plane
  nodes and the node lifecycle's: cordoned, not ready, unreachable, under pressure; the table
  PROTECTED_TAINTS, the chart's `policy.protectedTaints`) and a node selector of control-plane nodes
  are refused unless listed;
- pod defaults the admin adds to every Ray pod: labels, annotations, a priority class and
  imagePullSecrets;
- environments (spec.environments) and agents (spec.agents), one mechanism for both (PodSetPolicy):
  bounds on each entry's replicas, cpu, memory and ephemeral storage and on their pods in all, and the
  egress the pods get besides what the operator allows them (none by default; builders/pod_sets.py).

`policy_problems` is pure: spec and policy in, problems (each naming the field and the policy
value) out. The operator refuses a spec with problems at admission (admission.py) and, for specs
that got past admission (no webhook, or a policy changed later), fails the RLJob with reason
PolicyDenied and creates nothing for it (reconcile/).
"""

from __future__ import annotations

import ipaddress
import json
import posixpath
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from rldock.config import Problem
from rldock.operator.api import Agent, Environment, NFSSource, Quantity, RLJobSpec, Toleration, quantity_amount
from rldock.operator.constants import (
    IMAGE_PATTERN,
    MAX_LABEL_VALUE_LENGTH,
    MAX_NAME_LENGTH,
    VOLCANO_SCHEDULER,
    GangScheduler,
)

# The chart value each rule reads, as a person would write it in `helm install --set`.
CHART_PREFIX = "policy"
# kube-scheduler's name: what a pod without a schedulerName gets.
DEFAULT_SCHEDULER = "default-scheduler"
# The label and taint keys kubeadm (and most installers) put on control-plane nodes; `master` is
# the name before Kubernetes 1.20 and still found on older clusters.
CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
# The taints a toleration may not reach while `policy.tolerations` is null, unless the admin takes
# the key out of `policy.protectedTaints` (whose default is this table's keys): the nodes each
# marks. The node lifecycle's taints are the ones the node controller, kubelet and `kubectl cordon`
# set (Kubernetes' well-known taints): a pod that tolerates them lands on nodes an admin is
# draining or that are failing, and stays there.
PROTECTED_TAINTS: dict[str, str] = {
    CONTROL_PLANE_KEYS[0]: "control-plane nodes",
    CONTROL_PLANE_KEYS[1]: "control-plane nodes",
    "node.kubernetes.io/unschedulable": "cordoned nodes (an admin is draining them)",
    "node.kubernetes.io/not-ready": "nodes that are not ready",
    "node.kubernetes.io/unreachable": "nodes the node controller cannot reach",
    "node.kubernetes.io/memory-pressure": "nodes short of memory",
    "node.kubernetes.io/disk-pressure": "nodes short of disk",
    "node.kubernetes.io/pid-pressure": "nodes short of process ids",
    "node.kubernetes.io/network-unavailable": "nodes whose network is not set up",
    "node.kubernetes.io/out-of-service": "nodes an admin marked out of service",
}
# Where an image reference's repository part ends: a path separator, the tag, the digest.
IMAGE_BOUNDARIES = ("/", ":", "@")
_IMAGE = re.compile(IMAGE_PATTERN)
_NFS_SERVER = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$|^\[?[0-9A-Fa-f:.]+\]?$")  # a name, IPv4 or IPv6


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class AllowedToleration(_Model):
    """A toleration RLJobs may carry; an RLJob's toleration must equal one of these field by field
    (unset fields of the RLJob's toleration compare as their Kubernetes defaults)."""

    key: str | None = None
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None


class NFSExport(_Model):
    """An NFS export RLJobs may mount: a server and a path prefix on it."""

    server: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, description="NFS server host name or address.")
    path: str = Field(
        min_length=1,
        description="Absolute path prefix on the server; a volume's path must equal it or lie below it. "
        "`/` allows the whole server.",
    )


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


class LabelSelector(_Model):
    """A NetworkPolicy peer's selector: pods or namespaces with all these labels."""

    match_labels: dict[str, str] = Field(default_factory=dict)


class IPBlock(_Model):
    """A NetworkPolicy peer's address range, e.g. {cidr: 10.20.0.0/16}."""

    cidr: str = Field(min_length=1)
    except_: list[str] = Field(default_factory=list, alias="except")


class EgressPeer(_Model):
    """Where environment pods may connect: an address range, or pods (in namespaces) by label, as in a
    NetworkPolicy's `egress[].to[]`."""

    ip_block: IPBlock | None = None
    namespace_selector: LabelSelector | None = None
    pod_selector: LabelSelector | None = None


class EgressPort(_Model):
    protocol: Literal["TCP", "UDP", "SCTP"] = "TCP"
    port: int | str | None = None


class EgressRule(_Model):
    """One NetworkPolicy egress rule, written as in Kubernetes: `{to: [...], ports: [...]}`."""

    to: list[EgressPeer] = Field(default_factory=list)
    ports: list[EgressPort] = Field(default_factory=list)

    def manifest(self) -> dict[str, Any]:
        """The rule as the API server stores it (no empty lists or maps: it leaves them out), so that a
        stored policy compares equal to a built one."""
        return _without_empty(self.model_dump(by_alias=True, exclude_none=True))


def _without_empty(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_empty(item) for key, item in value.items() if item not in ([], {})}
    if isinstance(value, list):
        return [_without_empty(item) for item in value]
    return value


class PodSetPolicy(_Model):
    """What the pods of an RLJob's spec.environments (or spec.agents) may have, each entry's pods and all
    of them together, and where they may connect beyond what the operator lets them (the cluster's DNS;
    an agent also its job's gateway and environments). No bound can be lifted with null: Helm drops a null
    value and the default would come back; an admin raises it instead."""

    max_replicas: int = Field(default=16, ge=1, description="Largest replicas of an entry.")
    max_cpu: Quantity = Field(default="4", description="Largest resources.cpu of an entry.")
    max_memory: Quantity = Field(default="16Gi", description="Largest resources.memory of an entry.")
    max_ephemeral_storage: Quantity = Field(default="10Gi", description="Largest ephemeralStorage of an entry.")
    max_pods: int = Field(
        default=32,
        ge=1,
        description="Most pods of one RLJob's entries in all (their replicas summed): the per-entry bounds "
        "alone would allow 16 entries x maxReplicas.",
    )
    egress: list[EgressRule] = Field(
        default_factory=list,
        description="Egress rules (NetworkPolicy `egress` items) of every pod of the section, besides what the "
        "operator allows; empty: nothing more.",
    )


class AdminPolicy(_Model):
    """The chart's `policy` values. Defaults are the secure ones: no hostPath, no NFS, only the
    default runtime image, no toleration of every taint or of a protected taint."""

    host_path_prefixes: list[str] = Field(
        default_factory=list, description="Absolute path prefixes hostPath volumes may mount; `/` allows any path."
    )
    nfs_exports: list[NFSExport] = Field(
        default_factory=list,
        description="NFS exports volumes may mount, each a server and a path prefix on it.",
    )
    nfs_servers: list[str] = Field(
        default_factory=list,
        description="Replaced by nfsExports; must be empty (a bare server would not say which paths).",
    )
    image_prefixes: list[str] = Field(
        default_factory=list,
        description="Prefixes spec.image may lie under (e.g. `registry.example.com/ml`), matched at a `/`, `:` "
        "or `@`; the installation's default runtime image is always allowed.",
    )
    scheduler_names: list[str] | None = Field(
        default_factory=lambda: [DEFAULT_SCHEDULER],
        description="Allowed schedulers (spec.scheduling.schedulerName, `volcano` for gang: volcano); "
        "an RLJob without one always gets the cluster's default; null: any.",
    )
    queues: list[str] | None = Field(
        default_factory=list, description="Allowed spec.scheduling.queue values; empty: none; null: any."
    )
    tolerations: list[AllowedToleration] | None = Field(
        default=None,
        description="Allowed tolerations; null: any but a toleration of every taint or of a protected taint "
        "(protectedTaints).",
    )
    protected_taints: list[str] = Field(
        default_factory=lambda: list(PROTECTED_TAINTS),
        description="Taint keys an RLJob may not tolerate while tolerations is null: control-plane nodes and the "
        "node lifecycle's taints (cordoned, not ready, unreachable, memory/disk/pid pressure, network unavailable, "
        "out of service); remove a key to allow tolerating it.",
    )
    node_selectors: dict[str, list[str]] | None = Field(
        default=None,
        description="Allowed nodeSelector keys, each with its allowed values; null: any but a control-plane label.",
    )
    pod_defaults: AdminPodDefaults = Field(default_factory=AdminPodDefaults)
    environments: PodSetPolicy = Field(default_factory=PodSetPolicy)
    agents: PodSetPolicy = Field(default_factory=PodSetPolicy)

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        for index, prefix in enumerate(self.host_path_prefixes):
            if not posixpath.isabs(prefix):
                raise ValueError(f"{CHART_PREFIX}.hostPathPrefixes[{index}]: {prefix!r} must be an absolute path")
        for index, prefix in enumerate(self.image_prefixes):
            error = image_prefix_error(prefix)
            if error:
                raise ValueError(f"{CHART_PREFIX}.imagePrefixes[{index}]: {prefix!r} {error}")
        for index, export in enumerate(self.nfs_exports):
            if not _NFS_SERVER.match(export.server):
                raise ValueError(
                    f"{CHART_PREFIX}.nfsExports[{index}].server: {export.server!r} is not a host name or address "
                    "(no wildcards: list each server)"
                )
            error = _export_path_error(export.path)
            if error:
                raise ValueError(f"{CHART_PREFIX}.nfsExports[{index}].path: {export.path!r} {error}")
        if self.nfs_servers:
            # Refused rather than read as "any path": that is the reading that hands out a server's
            # whole tree, and an admin who wrote it may have meant one export.
            listed = ", ".join(f"{{server: {server}, path: /<export>}}" for server in self.nfs_servers)
            raise ValueError(
                f"{CHART_PREFIX}.nfsServers: {json.dumps(self.nfs_servers)} is replaced by {CHART_PREFIX}.nfsExports, "
                f"which names each export's path: list [{listed}] there (path `/` for the whole server) "
                f"and set {CHART_PREFIX}.nfsServers to []"
            )
        for index, key in enumerate(self.protected_taints):
            if not key or any(c.isspace() for c in key):
                raise ValueError(f"{CHART_PREFIX}.protectedTaints[{index}]: {key!r} is not a taint key")
        for section, pod_set in (("environments", self.environments), ("agents", self.agents)):
            _check_egress(f"{CHART_PREFIX}.{section}", pod_set.egress)
        for value in self.pod_defaults.labels.values():
            if len(value) > MAX_LABEL_VALUE_LENGTH:
                raise ValueError(f"{CHART_PREFIX}.podDefaults.labels: value {value!r} is longer than 63 characters")


def _check_egress(where_policy: str, egress: list[EgressRule]) -> None:
    """ValueError naming the chart value of a peer that names nothing or a bad CIDR."""
    for index, rule in enumerate(egress):
        for peer_index, peer in enumerate(rule.to):
            where = f"{where_policy}.egress[{index}].to[{peer_index}]"
            if peer.ip_block is None and peer.namespace_selector is None and peer.pod_selector is None:
                raise ValueError(f"{where}: names no ipBlock, namespaceSelector or podSelector")
            cidrs = [peer.ip_block.cidr, *peer.ip_block.except_] if peer.ip_block else []
            for cidr in cidrs:
                try:
                    ipaddress.ip_network(cidr, strict=False)
                except ValueError:
                    raise ValueError(f"{where}.ipBlock: {cidr!r} is not a CIDR such as 10.0.0.0/8") from None


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
        if first["type"] == "value_error" and not first["loc"]:  # AdminPolicy's own checks name the value
            raise ValueError(str(first["ctx"]["error"])) from None
        where = ".".join(str(part) for part in (CHART_PREFIX, *first["loc"]))
        raise ValueError(f"{where}: {first['msg']}") from None


def _denied(path: str, what: str, value: str, rule: str, allowed: Any) -> Problem:
    return Problem(
        path,
        f"{what} {value!r} is not allowed by the cluster's policy ({CHART_PREFIX}.{rule}: "
        f"{json.dumps(allowed)}); use an allowed value or ask the cluster admin to allow it",
    )


# --- Images ----------------------------------------------------------------------------------


def image_prefix_error(prefix: str) -> str | None:
    """What is wrong with an admin's image prefix (`registry[:port][/repository...]`, optionally
    ending in `/`, `:` or `@`); None when nothing is."""
    if not prefix:
        return "is empty, which would allow every image; remove it"
    if any(c.isspace() for c in prefix):
        return "contains whitespace; an image reference has none"
    if "://" in prefix:
        return "has a scheme; image references name no scheme: write e.g. 'registry.example.com/ml'"
    stem = prefix[:-1] if prefix[-1] in IMAGE_BOUNDARIES else prefix
    if not stem or "//" in stem or not _IMAGE.match(stem):
        return (
            "is not the start of an image reference `registry[:port][/repository...]`, e.g. 'registry.example.com/ml'"
        )
    return None


def image_allowed(image: str, prefixes: list[str]) -> bool:
    """Whether `image` lies under one of `prefixes`: it equals one, or continues after it with `/`,
    `:` or `@` (a prefix ending in one of those matches as is). So `registry.example.com/ml` admits
    `registry.example.com/ml/rt:1` and `registry.example.com/ml:2`, never `registry.example.com/ml-evil/x`;
    `registry.example.com` never admits `registry.example.com.evil.io/x`."""
    for prefix in prefixes:
        if prefix[-1] in IMAGE_BOUNDARIES:
            if image.startswith(prefix):
                return True
        elif image == prefix or (image.startswith(prefix) and image[len(prefix)] in IMAGE_BOUNDARIES):
            return True
    return False


# --- Paths -----------------------------------------------------------------------------------


def _under(path: str, prefix: str) -> bool:
    path, prefix = posixpath.normpath(path), posixpath.normpath(prefix)
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def _normal_path(path: str) -> str:
    # normpath keeps a leading `//` (POSIX leaves its meaning to the system); an NFS server does not.
    return "/" + posixpath.normpath(path).lstrip("/")


def _export_path_error(path: str) -> str | None:
    if not posixpath.isabs(path):
        return "must be an absolute path"
    if ".." in path.split("/"):
        return "must not contain '..'"
    return None


def _nfs_problem(path: str, nfs: NFSSource, policy: AdminPolicy) -> list[Problem]:
    exports = [export.model_dump() for export in policy.nfs_exports]
    if ".." in nfs.path.split("/"):
        return [
            Problem(
                f"{path}.path",
                f"NFS path {nfs.path!r} contains '..'; name the export's directory itself "
                f"({CHART_PREFIX}.nfsExports: {json.dumps(exports)})",
            )
        ]
    asked = _normal_path(nfs.path)
    for export in policy.nfs_exports:
        # Host names compare without case, as DNS does; an address and a name of the same host do not
        # match (the admin lists what they mean).
        if export.server.lower() != nfs.server.lower():
            continue
        prefix = _normal_path(export.path)
        if asked == prefix or asked.startswith(prefix.rstrip("/") + "/"):
            return []
    return [_denied(path, "NFS export", f"{nfs.server}:{nfs.path}", "nfsExports", exports)]


def _host_path_problem(path: str, host_path: str, policy: AdminPolicy) -> list[Problem]:
    if any(_under(host_path, prefix) for prefix in policy.host_path_prefixes):
        return []
    return [_denied(path, "hostPath", host_path, "hostPathPrefixes", policy.host_path_prefixes)]


# --- The whole spec --------------------------------------------------------------------------


def policy_problems(spec: RLJobSpec, policy: AdminPolicy, *, default_image: str) -> list[Problem]:
    """Every way `spec` reaches beyond `policy`, each naming the field and the policy value."""
    problems: list[Problem] = []
    if spec.checkpoint.host_path is not None:
        problems += _host_path_problem("spec.checkpoint.hostPath", spec.checkpoint.host_path, policy)
    for index, volume in enumerate(spec.volumes):
        path = f"spec.volumes[{index}]"
        if volume.host_path is not None:
            problems += _host_path_problem(f"{path}.hostPath.path", volume.host_path.path, policy)
        if volume.nfs is not None:
            problems += _nfs_problem(f"{path}.nfs", volume.nfs, policy)
    if spec.image is not None and spec.image != default_image and not image_allowed(spec.image, policy.image_prefixes):
        problems.append(_denied("spec.image", "image", spec.image, "imagePrefixes", policy.image_prefixes))
    for section, entries, pod_set in (
        ("environments", spec.environments, policy.environments),
        ("agents", spec.agents, policy.agents),
    ):
        problems += _pod_set_problems(section, entries, pod_set, policy, default_image=default_image)
    problems += _scheduling_problems(spec, policy)
    for index, toleration in enumerate(spec.cluster.tolerations):
        problems += _toleration_problem(f"spec.cluster.tolerations[{index}]", toleration, policy)
    for key, value in spec.cluster.node_selector.items():
        problems += _node_selector_problem(f"spec.cluster.nodeSelector[{key}]", key, value, policy)
    return problems


def _pod_set_problems(
    section: str,
    entries: Sequence[Environment | Agent],
    pod_set: PodSetPolicy,
    policy: AdminPolicy,
    *,
    default_image: str,
) -> list[Problem]:
    """What `spec.<section>` (environments or agents) asks beyond the policy: an image outside the prefixes
    (unset: the runtime image, checked with spec.image), an entry's pods beyond `policy.<section>.max*`,
    their pods in all beyond `maxPods`; each naming the field and the chart value."""
    problems: list[Problem] = []
    for index, entry in enumerate(entries):
        path = f"spec.{section}[{index}]"
        image = entry.image
        if image is not None and image != default_image and not image_allowed(image, policy.image_prefixes):
            problems.append(_denied(f"{path}.image", "image", image, "imagePrefixes", policy.image_prefixes))
        asked: list[tuple[str, str, int | str, int | str]] = [
            ("replicas", "maxReplicas", entry.replicas, pod_set.max_replicas),
            ("resources.cpu", "maxCpu", entry.resources.cpu, pod_set.max_cpu),
            ("resources.memory", "maxMemory", entry.resources.memory, pod_set.max_memory),
            ("ephemeralStorage", "maxEphemeralStorage", entry.ephemeral_storage, pod_set.max_ephemeral_storage),
        ]
        problems += [
            Problem(
                f"{path}.{field}",
                f"{field} {value!r} is more than the cluster's policy allows ({CHART_PREFIX}.{section}.{rule}: "
                f"{json.dumps(bound)}); ask for at most {bound!s} or ask the cluster admin to raise it",
            )
            for field, rule, value, bound in asked
            if quantity_amount(value) > quantity_amount(bound)
        ]
    total = sum(entry.replicas for entry in entries)
    if total > pod_set.max_pods:
        problems.append(
            Problem(
                f"spec.{section}",
                f"the entries' replicas add up to {total} pods, more than the cluster's policy allows "
                f"({CHART_PREFIX}.{section}.maxPods: {pod_set.max_pods}); ask for at most {pod_set.max_pods} in all "
                "(fewer replicas or entries) or ask the cluster admin to raise it",
            )
        )
    return problems


def _scheduling_problems(spec: RLJobSpec, policy: AdminPolicy) -> list[Problem]:
    scheduling, problems = spec.scheduling, []
    # gang: volcano hands the pods to Volcano's scheduler (KubeRay sets their schedulerName), so it
    # is a choice of scheduler too; validation.py keeps an explicit schedulerName consistent with it.
    scheduler, path = scheduling.scheduler_name, "spec.scheduling.schedulerName"
    if scheduler is None and scheduling.gang is GangScheduler.VOLCANO:
        scheduler, path = VOLCANO_SCHEDULER, "spec.scheduling.gang"
    if scheduler is not None and policy.scheduler_names is not None and scheduler not in policy.scheduler_names:
        problems.append(_denied(path, "scheduler", scheduler, "schedulerNames", policy.scheduler_names))
    if scheduling.queue is not None and policy.queues is not None and scheduling.queue not in policy.queues:
        problems.append(_denied("spec.scheduling.queue", "queue", scheduling.queue, "queues", policy.queues))
    return problems


def _node_selector_problem(path: str, key: str, value: str, policy: AdminPolicy) -> list[Problem]:
    if policy.node_selectors is None:
        if key in CONTROL_PLANE_KEYS:
            return [
                Problem(
                    path,
                    f"node selector {key}={value!r} places the pods on control-plane nodes, which the cluster's "
                    f"policy does not allow ({CHART_PREFIX}.nodeSelectors: null); remove it, or ask the cluster "
                    f"admin to list it in {CHART_PREFIX}.nodeSelectors",
                )
            ]
        return []
    if value in policy.node_selectors.get(key, ()):
        return []
    return [_denied(path, "node selector", f"{key}={value}", "nodeSelectors", policy.node_selectors)]


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
                    "a toleration of every taint (empty key, operator Exists), control-plane and node-lifecycle "
                    f"taints included, is not allowed by the cluster's policy ({CHART_PREFIX}.tolerations: null); "
                    "name the taint's key, or ask the cluster admin to list this toleration in "
                    f"{CHART_PREFIX}.tolerations",
                )
            ]
        if asked.key in policy.protected_taints:
            nodes = PROTECTED_TAINTS.get(asked.key, f"nodes tainted {asked.key}")
            return [
                Problem(
                    path,
                    f"toleration {described} lets the pods onto {nodes}, which the cluster's policy does not allow "
                    f"({CHART_PREFIX}.protectedTaints lists {asked.key}); remove it, or ask the cluster admin to "
                    f"take {asked.key} out of {CHART_PREFIX}.protectedTaints or to list this toleration in "
                    f"{CHART_PREFIX}.tolerations",
                )
            ]
        return []
    if asked in policy.tolerations:
        return []
    allowed = [t.model_dump(by_alias=True, exclude_none=True) for t in policy.tolerations]
    return [_denied(path, "toleration", described, "tolerations", allowed)]
