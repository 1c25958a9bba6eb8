"""Problems of an RLJob spec that the CRD schema cannot catch, each naming the field to change.

The job's own cross-field rules come from the runtime (`rldock.config.find_problems`, so
`rldock train` and the operator refuse the same configs), re-rooted under
`spec.job.`; the rest are about the cluster: storage, device resource name, tolerations, node
selector and scheduling. The handlers turn a non-empty list into phase Failed, a condition and an
Event, and create nothing.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from rldock.config import Problem, find_problems
from rldock.config.problem import field_path
from rldock.contract.agent_pods import GATEWAY_ENV
from rldock.operator.api import Agent, Environment, EnvVar, RLJobSpec, Toleration, Volume, cpu_cores
from rldock.operator.builders.agents import with_agent_pods
from rldock.operator.builders.config_map import render_job_config
from rldock.operator.builders.ray_cluster import is_ascend_resource
from rldock.operator.constants import (
    CONFIG_MAP_MAX_BYTES,
    CONFIG_MOUNT_PATH,
    ENV_ENVIRONMENT_TOKEN,
    IMAGE_PATTERN,
    OPERATOR_ENV,
    OPERATOR_ENVIRONMENTS_ENV,
    OPERATOR_VOLUMES,
    RAY_GPU,
    RAY_RESERVED_RESOURCES,
    SHM_MOUNT_PATH,
    TMP_MOUNT_PATH,
    VOLCANO_SCHEDULER,
    GangScheduler,
)

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# core/v1 env names (Kubernetes 1.20-1.29): a C identifier that may also hold '-' and '.'.
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_VOLUME_SOURCES = {
    "persistentVolumeClaim": "persistent_volume_claim",
    "nfs": "nfs",
    "hostPath": "host_path",
    "configMap": "config_map",
    "secret": "secret",
    "emptyDir": "empty_dir",
}  # field: attribute


def parse_spec(raw: Mapping[str, Any]) -> tuple[RLJobSpec | None, list[Problem]]:
    """The parsed spec and every problem with it; the spec is None when it does not parse.

    The API server has already checked the schema, so parse errors are rare (e.g. a status
    written by an older CRD version), but they are reported the same way, never raised.
    """
    try:
        spec = RLJobSpec.model_validate(raw)
    except ValidationError as error:
        return None, [_problem_from_error(item) for item in error.errors()]
    return spec, find_spec_problems(spec)


_PATTERN_HINTS = {
    IMAGE_PATTERN: "an image reference such as ghcr.io/org/image:tag or image@sha256:<digest> (no spaces)",
}


def _problem_from_error(item: Mapping[str, Any]) -> Problem:
    # List indexes as `[i]`, as the other problems write them (`spec.volumes[0].persistentVolumeClam`).
    path = field_path(["spec", *item["loc"]])
    if item["type"] == "extra_forbidden":
        return Problem(path, "unknown field (see docs/operator.md)")
    if item["type"] == "missing":
        return Problem(path, "required field is missing")
    if item["type"] == "string_pattern_mismatch" and item.get("ctx", {}).get("pattern") in _PATTERN_HINTS:
        return Problem(path, f"{item['input']!r} is not {_PATTERN_HINTS[item['ctx']['pattern']]}")
    if item["type"] == "string_too_long":
        return Problem(
            path,
            f"{len(item['input'])} characters is too long: at most "
            f"{item['ctx']['max_length']} (see docs/operator.md, Limits)",
        )
    return Problem(path, item["msg"])


def find_spec_problems(spec: RLJobSpec) -> list[Problem]:
    """Every problem of a parsed spec (the runtime's job rules first, over the job as the runtime reads it
    where the agent pods run its episodes), in field order."""
    job = with_agent_pods(spec.job) if spec.agents else spec.job
    job_problems = find_problems(job)
    problems = [Problem(f"spec.job.{p.path}", p.message) for p in job_problems]
    problems += _device_problems(spec)
    for role in ("head", "worker", "pool"):
        pod = getattr(spec.cluster, role)
        try:
            if pod is not None:
                cpu_cores(pod.cpu)
        except ValueError as error:
            problems.append(Problem(f"spec.cluster.{role}.cpu", str(error)))
    if spec.cluster.pool is not None and spec.job.rollout.pool is None:
        problems.append(
            Problem(
                "spec.cluster.pool",
                "sizes the rollout pool's pods, but the job has none: set spec.job.rollout.pool or remove this",
            )
        )
    problems += _node_selector_problems(spec.cluster.node_selector)
    for index, toleration in enumerate(spec.cluster.tolerations):
        problems += _toleration_problems(toleration, f"spec.cluster.tolerations[{index}]")
    problems += _scheduling_problems(spec)
    problems += _checkpoint_problems(spec)
    problems += _volume_problems(spec)
    problems += _env_problems(spec)
    problems += environment_problems(spec)
    problems += job_config_size_problems(spec)
    return problems


def _device_problems(spec: RLJobSpec) -> list[Problem]:
    """The devices the pods ask Kubernetes and Ray for (builders/ray_cluster.py's docstring): GPU is Ray's
    built-in GPU count, any other name but Ray's built-ins a custom resource, and a job on the CPU
    (`resources.device: cpu`) asks for no device plugin's resource."""
    resources, device_resource = spec.job.resources, spec.cluster.device_resource
    accelerator = resources.accelerator_resource
    if accelerator in RAY_RESERVED_RESOURCES and accelerator != RAY_GPU:
        return [
            Problem(
                "spec.job.resources.accelerator_resource",
                f"{accelerator!r} is a Ray built-in resource and cannot name the devices; "
                "use NPU (Ascend, or devices emulated on a CPU-only cluster) or GPU (NVIDIA)",
            )
        ]
    problems = []
    if device_resource is not None:  # unset: the operator's default, checked at its start
        error = device_resource_error(device_resource)
        if error:
            problems.append(Problem("spec.cluster.deviceResource", error))
    if resources.device == "cpu":
        if accelerator == RAY_GPU:
            problems.append(
                Problem(
                    "spec.job.resources.accelerator_resource",
                    "GPU asks the pods for GPUs while resources.device cpu runs the job on the CPU; "
                    "on a CPU-only cluster leave accelerator_resource at NPU (emulated devices)",
                )
            )
        if device_resource is not None:
            problems.append(
                Problem(
                    "spec.cluster.deviceResource",
                    f"a job with spec.job.resources.device cpu requests no device, so {device_resource!r} "
                    "would never be asked for; leave it unset (or set resources.device to auto)",
                )
            )
    elif accelerator == RAY_GPU and device_resource is not None and is_ascend_resource(device_resource):
        problems.append(
            Problem(
                "spec.cluster.deviceResource",
                f"{device_resource!r} is an Ascend NPU resource, and accelerator_resource GPU would have Ray "
                "count those NPUs as GPUs; name your GPU device plugin's resource (e.g. nvidia.com/gpu) or "
                "leave it unset",
            )
        )
    return problems


def job_config_size_problems(spec: RLJobSpec, *, limit: int = CONFIG_MAP_MAX_BYTES) -> list[Problem]:
    """The job config must fit the ConfigMap the runtime reads it from (the API server refuses a
    larger one, and the job would wait for ever)."""
    size = len(render_job_config(spec.job).encode())
    if size <= limit:
        return []
    return [
        Problem(
            "spec.job",
            f"the job config is {size} bytes as YAML; a ConfigMap holds at most {limit}: shorten its longest values",
        )
    ]


def device_resource_error(name: str) -> str | None:
    """What is wrong with an extended resource name (`domain/name`, outside the kubernetes.io
    domain); None when nothing is. Also checks the operator's default (settings.py)."""
    domain, slash, resource = name.partition("/")
    if not slash or not domain or not resource:
        return f"{name!r} is not an extended resource name `domain/name` (e.g. huawei.com/Ascend910, nvidia.com/gpu)"
    if not _DNS_SUBDOMAIN.match(domain) or len(domain) > 253:
        return f"domain {domain!r} of {name!r} is not a DNS subdomain"
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io") or name.startswith("requests."):
        return f"{name!r} is reserved by Kubernetes; device plugins use their own domain"
    if len(resource) > 63 or not _QUALIFIED_NAME.match(resource):
        return (
            f"name {resource!r} of {name!r} must be at most 63 alphanumerics, "
            "'-', '_' or '.', starting and ending with an alphanumeric"
        )
    return None


def _is_label_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))


def _node_selector_problems(selector: Mapping[str, str]) -> list[Problem]:
    problems = []
    for key, value in selector.items():
        path = f"spec.cluster.nodeSelector[{key}]"
        if not _is_label_key(key):
            problems.append(Problem(path, f"{key!r} is not a valid label key"))
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            problems.append(Problem(path, f"{value!r} is not a valid label value"))
    return problems


def _toleration_problems(toleration: Toleration, path: str) -> list[Problem]:
    """The rules the API server applies to pods, checked here so they fail before KubeRay's pods do."""
    problems = []
    operator = toleration.operator or "Equal"
    if toleration.key and not _is_label_key(toleration.key):
        problems.append(Problem(f"{path}.key", f"{toleration.key!r} is not a valid taint key"))
    if not toleration.key and operator != "Exists":
        problems.append(Problem(f"{path}.operator", "an empty key needs operator Exists (tolerate all taints)"))
    if operator == "Exists" and toleration.value:
        problems.append(Problem(f"{path}.value", "must be empty when operator is Exists"))
    if toleration.toleration_seconds is not None and toleration.effect != "NoExecute":
        problems.append(Problem(f"{path}.tolerationSeconds", "only applies to effect NoExecute"))
    return problems


def _scheduling_problems(spec: RLJobSpec) -> list[Problem]:
    scheduling = spec.scheduling
    if scheduling.gang is GangScheduler.KUEUE and not scheduling.queue:
        return [Problem("spec.scheduling.queue", "gang scheduling through kueue needs the LocalQueue name")]
    if scheduling.gang is GangScheduler.NONE and scheduling.queue:
        return [Problem("spec.scheduling.queue", "a queue needs gang: volcano or gang: kueue")]
    if (
        scheduling.gang is GangScheduler.VOLCANO
        and scheduling.scheduler_name
        and scheduling.scheduler_name != VOLCANO_SCHEDULER
    ):
        return [
            Problem(
                "spec.scheduling.schedulerName",
                f"gang: volcano schedules pods with {VOLCANO_SCHEDULER!r}; leave schedulerName unset",
            )
        ]
    return []


def _checkpoint_problems(spec: RLJobSpec) -> list[Problem]:
    storage, path = spec.checkpoint, "spec.checkpoint"
    problems = []
    if (storage.claim_name is None) == (storage.host_path is None):
        problems.append(
            Problem(
                path, "set exactly one of claimName (a PersistentVolumeClaim) or hostPath (a directory on every node)"
            )
        )
    if storage.host_path is not None and not posixpath.isabs(storage.host_path):
        problems.append(Problem(f"{path}.hostPath", f"{storage.host_path!r} must be an absolute path"))
    mount = posixpath.normpath(storage.mount_path)
    if not posixpath.isabs(storage.mount_path) or mount == "/":
        problems.append(Problem(f"{path}.mountPath", f"{storage.mount_path!r} must be an absolute path below /"))
    for taken in (CONFIG_MOUNT_PATH, SHM_MOUNT_PATH):
        if mount == taken or mount.startswith(taken + "/") or taken.startswith(mount + "/"):
            problems.append(
                Problem(
                    f"{path}.mountPath", f"{storage.mount_path!r} overlaps {taken}, which the operator mounts itself"
                )
            )
    if mount == TMP_MOUNT_PATH:
        problems.append(
            Problem(
                f"{path}.mountPath",
                f"{TMP_MOUNT_PATH} is Ray's scratch space, which the operator mounts itself; choose another path",
            )
        )
    return problems


def _overlaps(a: str, b: str) -> bool:
    """Whether one of two normalised absolute paths is the other or lies below it."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def _relative_inside(path: str) -> bool:
    """A path that stays inside the directory it is relative to (no leading `/`, no `..`)."""
    return not posixpath.isabs(path) and ".." not in path.split("/")


def _volume_problems(spec: RLJobSpec) -> list[Problem]:
    """spec.volumes and spec.volumeMounts: one source per volume, names and mount paths apart from
    the operator's own (job config, checkpoints, /dev/shm) and from each other, every mount naming
    a volume of the spec and every volume mounted."""
    problems: list[Problem] = []
    names: set[str] = set()
    for index, volume in enumerate(spec.volumes):
        path = f"spec.volumes[{index}]"
        if volume.name in OPERATOR_VOLUMES:
            problems.append(
                Problem(
                    f"{path}.name",
                    f"{volume.name!r} is a volume the operator mounts itself "
                    f"({', '.join(OPERATOR_VOLUMES)}); choose another name",
                )
            )
        elif not _DNS_LABEL.match(volume.name):
            problems.append(
                Problem(
                    f"{path}.name",
                    f"{volume.name!r} is not a DNS label (lowercase letters, "
                    "digits and '-', starting and ending with a letter or digit)",
                )
            )
        elif volume.name in names:
            problems.append(Problem(f"{path}.name", f"{volume.name!r} names an earlier volume too"))
        names.add(volume.name)
        problems += _volume_source_problems(volume, path)
    mount_paths: dict[str, int] = {}
    mounted: set[str] = set()
    taken = {
        CONFIG_MOUNT_PATH: "the job config",
        SHM_MOUNT_PATH: "shared memory",
        posixpath.normpath(spec.checkpoint.mount_path): "the checkpoints (spec.checkpoint.mountPath)",
    }
    for index, mount in enumerate(spec.volume_mounts):
        path = f"spec.volumeMounts[{index}]"
        mounted.add(mount.name)
        if mount.name in OPERATOR_VOLUMES:
            problems.append(
                Problem(
                    f"{path}.name",
                    f"{mount.name!r} is a volume the operator mounts itself; mount a volume of spec.volumes",
                )
            )
        elif mount.name not in names:
            problems.append(
                Problem(
                    f"{path}.name",
                    f"no volume {mount.name!r} in spec.volumes"
                    + (f" (there are: {', '.join(sorted(names))})" if names else ""),
                )
            )
        target = posixpath.normpath(mount.mount_path)
        if not posixpath.isabs(mount.mount_path) or target == "/":
            problems.append(Problem(f"{path}.mountPath", f"{mount.mount_path!r} must be an absolute path below /"))
            continue
        for other, what in taken.items():
            if _overlaps(target, other):
                problems.append(
                    Problem(
                        f"{path}.mountPath", f"{mount.mount_path!r} overlaps {other}, where the operator mounts {what}"
                    )
                )
        if target == TMP_MOUNT_PATH:  # a mount below /tmp is fine; /tmp itself is Ray's emptyDir
            problems.append(
                Problem(
                    f"{path}.mountPath",
                    f"{TMP_MOUNT_PATH} is where the operator mounts Ray's scratch space; mount below it or elsewhere",
                )
            )
        if target in mount_paths:
            problems.append(
                Problem(
                    f"{path}.mountPath",
                    f"{mount.mount_path!r} is also the mount path of spec.volumeMounts[{mount_paths[target]}]",
                )
            )
        mount_paths.setdefault(target, index)
        if mount.sub_path is not None and not _relative_inside(mount.sub_path):
            problems.append(Problem(f"{path}.subPath", f"{mount.sub_path!r} must be a relative path without '..'"))
    for index, volume in enumerate(spec.volumes):
        if volume.name not in mounted and volume.name not in OPERATOR_VOLUMES:
            problems.append(
                Problem(
                    f"spec.volumes[{index}]",
                    f"volume {volume.name!r} is not mounted: add a spec.volumeMounts entry with name {volume.name!r}",
                )
            )
    return problems


def _volume_source_problems(volume: Volume, path: str) -> list[Problem]:
    sources = [name for name, attribute in _VOLUME_SOURCES.items() if getattr(volume, attribute) is not None]
    if len(sources) != 1:
        return [
            Problem(
                path,
                f"set exactly one source of {', '.join(_VOLUME_SOURCES)}"
                + (f" (found {', '.join(sources)})" if sources else ""),
            )
        ]
    problems = []
    for source, absolute in (("hostPath", volume.host_path), ("nfs", volume.nfs)):
        if absolute is not None and not posixpath.isabs(absolute.path):
            problems.append(Problem(f"{path}.{source}.path", f"{absolute.path!r} must be an absolute path"))
    projected = volume.config_map or volume.secret
    source = "configMap" if volume.config_map is not None else "secret"
    for index, item in enumerate((projected.items or []) if projected is not None else []):
        if not _relative_inside(item.path):
            problems.append(
                Problem(f"{path}.{source}.items[{index}].path", f"{item.path!r} must be a relative path without '..'")
            )
    return problems


def _env_problems(spec: RLJobSpec) -> list[Problem]:
    """spec.env and spec.envFrom: valid names, none the operator sets itself, one value each."""
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for index, var in enumerate(spec.env):
        path = f"spec.env[{index}]"
        if var.name in OPERATOR_ENV:
            problems.append(
                Problem(
                    f"{path}.name",
                    f"{var.name!r} is set by the operator in every Ray pod "
                    f"({', '.join(OPERATOR_ENV)}); choose another name",
                )
            )
        elif var.name in OPERATOR_ENVIRONMENTS_ENV and spec.has_pod_sets:
            problems.append(
                Problem(
                    f"{path}.name",
                    f"{var.name!r} is set by the operator in every Ray pod of a job with spec.environments or "
                    "spec.agents (the token of the job's own pods); remove it, or choose another name",
                )
            )
        elif not _ENV_NAME.match(var.name):
            problems.append(
                Problem(
                    f"{path}.name",
                    f"{var.name!r} is not a valid variable name (letters, digits, "
                    "'_', '-' and '.', not starting with a digit)",
                )
            )
        elif var.name in seen:
            problems.append(Problem(f"{path}.name", f"{var.name!r} is also set by spec.env[{seen[var.name]}]"))
        seen.setdefault(var.name, index)
        problems += _env_value_problems(var, path)
    for index, source in enumerate(spec.env_from):
        path = f"spec.envFrom[{index}]"
        if (source.secret_ref is None) == (source.config_map_ref is None):
            problems.append(Problem(path, "set exactly one of secretRef or configMapRef"))
        if source.prefix and not _ENV_NAME.match(source.prefix):
            problems.append(Problem(f"{path}.prefix", f"{source.prefix!r} is not a valid variable name prefix"))
    return problems


def _env_value_problems(var: EnvVar, path: str) -> list[Problem]:
    if var.value_from is None:
        return []
    if var.value is not None:
        return [Problem(path, "set value or valueFrom, not both")]
    sources = [
        s
        for s in (var.value_from.secret_key_ref, var.value_from.config_map_key_ref, var.value_from.field_ref)
        if s is not None
    ]
    if len(sources) != 1:
        return [Problem(f"{path}.valueFrom", "set exactly one of secretKeyRef, configMapKeyRef or fieldRef")]
    return []


# --- spec.environments and the job config's servers that name them ----------------------------------
_SERVERS = ("environment", "sandbox")  # job.agent.<section>.servers


def environment_problems(spec: RLJobSpec) -> list[Problem]:
    """spec.environments and spec.agents (names once each, valid env, a CPU amount), every `servers` of the
    job config: `service` names an entry, and no `command`, which in an RLJob would start the servers in
    the Ray head pod, beside the job's credentials and Ray session; and spec.agents' job config (no
    harness of the Ray pods' besides them)."""
    problems: list[Problem] = []
    for section in ("environments", "agents"):
        problems += _pod_set_entry_problems(section, getattr(spec, section))
    entries = {environment.name: index for index, environment in enumerate(spec.environments)}
    agent = spec.job.agent
    for section in _SERVERS if agent is not None else ():
        owner = getattr(agent, section)
        servers = owner.servers if owner is not None else None
        if servers is None:
            continue
        path = f"spec.job.agent.{section}.servers"
        if servers.command is not None:
            problems.append(
                Problem(
                    f"{path}.command",
                    "in an RLJob a command would start the servers inside the Ray head pod, beside the job's "
                    "credentials, model and Ray session; run them as pods: add a spec.environments entry and name "
                    "it with servers.service",
                )
            )
        if servers.service is not None and servers.service not in entries:
            problems.append(
                Problem(
                    f"{path}.service",
                    f"{servers.service!r} is not in spec.environments ({', '.join(entries) or 'none'})",
                )
            )
        if servers.service is not None and "sessions_per_replica" in servers.model_fields_set:
            problems.append(
                Problem(
                    f"{path}.sessions_per_replica",
                    "a service's sessions per replica are its spec.environments entry's sessionsPerReplica; set "
                    "them there",
                )
            )
    return problems + _agents_job_problems(spec)


# Set by the operator in the environments' and agents' pods; an entry's env must not reuse them.
_OPERATOR_POD_ENV = {
    ENV_ENVIRONMENT_TOKEN: "the job's environment token, which the operator sets from a Secret of its own; remove "
    "it (the server reads it as given)",
    GATEWAY_ENV: "the job's gateway address, which the operator sets in the agents' pods; remove it",
}


def _pod_set_entry_problems(section: str, entries: Sequence[Environment | Agent]) -> list[Problem]:
    """The entries of spec.<section>: names once each, a CPU amount, valid env that leaves the operator's
    variables alone."""
    problems: list[Problem] = []
    names: dict[str, int] = {}
    for index, entry in enumerate(entries):
        path = f"spec.{section}[{index}]"
        if entry.name in names:
            problems.append(Problem(f"{path}.name", f"{entry.name!r} also names spec.{section}[{names[entry.name]}]"))
        names.setdefault(entry.name, index)
        try:
            cpu_cores(entry.resources.cpu)
        except ValueError as error:
            problems.append(Problem(f"{path}.resources.cpu", str(error)))
        seen: dict[str, int] = {}
        for number, var in enumerate(entry.env):
            at = f"{path}.env[{number}]"
            if not _ENV_NAME.match(var.name):
                problems.append(Problem(f"{at}.name", f"{var.name!r} is not a valid variable name"))
            elif var.name in _OPERATOR_POD_ENV:
                problems.append(Problem(f"{at}.name", f"{var.name} is {_OPERATOR_POD_ENV[var.name]}"))
            elif var.name in seen:
                problems.append(Problem(f"{at}.name", f"{var.name!r} is also set by {path}.env[{seen[var.name]}]"))
            seen.setdefault(var.name, number)
            problems += _env_value_problems(var, at)
    return problems


def _agents_job_problems(spec: RLJobSpec) -> list[Problem]:
    """agent.harness_pods without spec.agents: nothing would lease the episodes it waits for. (With them, the
    job config is checked as the runtime reads it, harness_pods set: find_spec_problems.)"""
    agent = spec.job.agent
    if spec.agents or agent is None or not agent.harness_pods:
        return []
    return [
        Problem(
            "spec.job.agent.harness_pods",
            "no pod would run the episodes: the operator sets it for spec.agents; add a spec.agents entry, "
            "or remove it",
        )
    ]
