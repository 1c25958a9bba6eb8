"""The RLJob resource as pydantic models: its spec and its status.

The spec embeds the runtime's `JobConfig` unchanged under `job`, so there is one definition of a
job: `rldock train` reads the same model from YAML, the CRD schema (crd.py) is generated from these
models, and the cluster shape is `job.resources.num_nodes` x `job.resources.devices_per_node`,
never repeated here. What the runtime does not need to know (image, device plugin, pod sizes,
scheduling, storage, lifecycle) is added around it.

Kubernetes-facing fields are camelCase (aliases); the embedded job config keeps its own snake_case
fields, exactly as `rldock train` reads them. Cross-field rules live in validation.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, DecimalException
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from rldock.config import JobConfig
from rldock.config.agent_environment import EnvironmentServersSpec
from rldock.operator.constants import (
    DEFAULT_AGENT_EPHEMERAL_STORAGE,
    DEFAULT_BACKOFF_LIMIT,
    DEFAULT_CHECKPOINT_MOUNT_PATH,
    DEFAULT_DEVICE_RESOURCE,
    DEFAULT_ENVIRONMENT_EPHEMERAL_STORAGE,
    DEFAULT_ENVIRONMENT_PORT,
    DEFAULT_IMAGE,
    DEFAULT_IMAGE_PULL_POLICY,
    DEFAULT_RAY_VERSION,
    DNS_LABEL_PATTERN,
    ENVIRONMENT_HEALTH_PATH,
    IMAGE_PATTERN,
    MANAGED_BY_RLDOCK,
    MAX_AGENTS,
    MAX_ARGUMENTS,
    MAX_DNS_LABEL_LENGTH,
    MAX_ENV_NAME_LENGTH,
    MAX_ENV_VALUE_LENGTH,
    MAX_ENVIRONMENTS,
    MAX_IMAGE_LENGTH,
    MAX_KEY_LENGTH,
    MAX_LABEL_VALUE_LENGTH,
    MAX_NAME_LENGTH,
    MAX_PATH_LENGTH,
    MAX_POD_INPUTS,
    MAX_VERSION_LENGTH,
    ConditionType,
    GangScheduler,
    ImagePullPolicy,
    Phase,
    Reason,
)

# Kubernetes resource.Quantity, as the API server parses it ("4", "500m", "64Gi", 4). Integers
# are accepted because people write `cpu: 4`; fractions must be quoted ("0.5" or "500m"); negative
# amounts are refused.
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
QUANTITY_HINT = 'a whole number >= 0 such as 4, or a quoted amount such as "500m", "0.5" or "64Gi"'


def _one_quantity_error(value: object, handler: ValidatorFunctionWrapHandler) -> object:
    """One message naming valid values, instead of pydantic's error per union branch
    (`cpu.constrained-int ...; cpu.constrained-str ...`)."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "quantity", "{value} is not a quantity: use " + QUANTITY_HINT, {"value": repr(value)}
        ) from None


_QUANTITY_SUFFIXES = {
    **{suffix: Decimal(1024) ** power for power, suffix in enumerate(("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{suffix: Decimal(10) ** power for suffix, power in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6))},
    **{suffix: Decimal(10) ** power for suffix, power in (("G", 9), ("T", 12), ("P", 15), ("E", 18))},
}


def quantity_amount(quantity: Quantity) -> Decimal:
    """The amount a quantity stands for, exactly ("500m" is 0.5, "1Gi" 1073741824, "1e3" 1000), as
    the API server reads it; ValueError for text that is no quantity."""
    text = str(quantity)
    if not re.match(QUANTITY_PATTERN, text):
        raise ValueError(f"{quantity!r} is not a quantity: use {QUANTITY_HINT}")
    number = re.match(r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))", text)
    assert number is not None  # the pattern above starts so
    digits, suffix = number.group(0), text[number.end() :]
    # The known suffixes first: "E" and "Ei" are exa and exbi, not an exponent with no digits.
    if suffix in _QUANTITY_SUFFIXES:
        return Decimal(digits) * _QUANTITY_SUFFIXES[suffix]
    try:  # "1e3"; an exponent past what Decimal holds ("1e99999999999") overflows
        return Decimal(digits) * Decimal(10) ** Decimal(suffix[1:])
    except DecimalException:
        raise ValueError(f"{quantity!r} is too large an amount: use {QUANTITY_HINT}") from None


def _an_amount(quantity: int | str) -> int | str:
    """A quantity the pattern accepts but whose amount is out of range is refused where it is
    read, so the error names its field (the webhook and the reconcile report parse problems)."""
    quantity_amount(quantity)
    return quantity


Quantity = Annotated[
    Annotated[int, Field(ge=0)] | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN, max_length=64)],
    WrapValidator(_one_quantity_error),
    AfterValidator(_an_amount),
]


def cpu_cores(quantity: Quantity) -> float:
    """CPU cores of a quantity ("4", 4, "0.5", "500m"); ValueError for other suffixes."""
    text = str(quantity)
    try:
        return int(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        raise ValueError(f'{quantity!r} is not a CPU amount such as 4, "0.5" or "500m"') from None


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


class PodResources(_Model):
    """CPU and memory of one pod (request = limit, so Ray's view of the pod is what it gets)."""

    cpu: Quantity = Field(description='CPU cores, e.g. 16 or "500m".')
    memory: Quantity = Field(description='Memory, e.g. "64Gi".')


class Toleration(_Model):
    """A core/v1 Toleration, copied onto every Ray pod."""

    key: str | None = Field(
        default=None, max_length=MAX_KEY_LENGTH, description="Taint key; empty with `Exists` tolerates every taint."
    )
    operator: Literal["Exists", "Equal"] | None = Field(default=None, description="Default `Equal`.")
    value: str | None = Field(
        default=None, max_length=MAX_LABEL_VALUE_LENGTH, description="Taint value; must be empty with `Exists`."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; empty tolerates all effects."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a `NoExecute` taint is tolerated before eviction."
    )


# --- What the job needs to reach its model and data: core/v1 volumes, mounts and env ------------
# Typed models of the common parts of core/v1 Volume, VolumeMount, EnvVar and EnvFromSource, not
# pass-through objects: the CRD schema then names every field, so `kubectl apply` refuses a typo
# (`persistentVolumeClam`) with its path before anything runs, `kubectl explain` documents them,
# and the operator's own checks (validation.py) see typed values. A pass-through object would
# accept the typo at apply time and fail later, in the operator or when KubeRay creates the pods.
# Sources beyond these (csi, projected, ...) are left out on purpose; a PVC or NFS share holds
# models and data, a Secret or ConfigMap holds tokens and reward code.


class PersistentVolumeClaimSource(_Model):
    claim_name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="PersistentVolumeClaim in the RLJob's namespace (ReadOnlyMany or ReadWriteMany for several nodes).",
    )
    read_only: bool | None = Field(default=None, description="Mount the claim read-only.")


class NFSSource(_Model):
    server: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, description="NFS server host name or address.")
    path: str = Field(min_length=1, max_length=MAX_PATH_LENGTH, description="Exported directory, an absolute path.")
    read_only: bool | None = Field(default=None, description="Mount the export read-only.")


class HostPathSource(_Model):
    path: str = Field(
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="Directory (or file) on every node, e.g. a shared filesystem mount; an absolute path.",
    )
    type: (
        Literal["DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"] | None
    ) = Field(default=None, description="What must be at `path`; unset checks nothing.")


class KeyToPath(_Model):
    key: str = Field(min_length=1, max_length=MAX_KEY_LENGTH, description="Key in the ConfigMap or Secret.")
    path: str = Field(
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="File name for the key, relative to the mount path (no `..`).",
    )
    mode: int | None = Field(
        default=None, ge=0, le=0o777, description="File mode bits (decimal in JSON, e.g. 292 = 0444)."
    )


class ConfigMapSource(_Model):
    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, description="ConfigMap in the RLJob's namespace.")
    items: list[KeyToPath] | None = Field(
        default=None, max_length=MAX_POD_INPUTS, description="Keys to project, and their file names; unset: every key."
    )
    default_mode: int | None = Field(default=None, ge=0, le=0o777, description="Mode bits of the files.")
    optional: bool | None = Field(default=None, description="Start even when the ConfigMap is missing.")


class SecretSource(_Model):
    secret_name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, description="Secret in the RLJob's namespace.")
    items: list[KeyToPath] | None = Field(
        default=None, max_length=MAX_POD_INPUTS, description="Keys to project, and their file names; unset: every key."
    )
    default_mode: int | None = Field(default=None, ge=0, le=0o777, description="Mode bits of the files.")
    optional: bool | None = Field(default=None, description="Start even when the Secret is missing.")


class EmptyDirSource(_Model):
    medium: Literal["Memory"] | None = Field(default=None, description="`Memory` for a tmpfs; unset: the node's disk.")
    size_limit: Quantity | None = Field(default=None, description='Largest size, e.g. "10Gi".')


class Volume(_Model):
    """A core/v1 Volume of every Ray pod; set exactly one source."""

    name: str = Field(
        min_length=1,
        max_length=MAX_DNS_LABEL_LENGTH,
        description="Volume name (a DNS label), referred to by `volumeMounts[].name`.",
    )
    persistent_volume_claim: PersistentVolumeClaimSource | None = Field(
        default=None, description="A PersistentVolumeClaim."
    )
    nfs: NFSSource | None = Field(default=None, description="An NFS export.")
    host_path: HostPathSource | None = Field(default=None, description="A path on the node.")
    config_map: ConfigMapSource | None = Field(default=None, description="A ConfigMap's keys as files.")
    secret: SecretSource | None = Field(default=None, description="A Secret's keys as files.")
    empty_dir: EmptyDirSource | None = Field(
        default=None, description="A scratch directory that lives as long as the pod."
    )


class VolumeMount(_Model):
    """A core/v1 VolumeMount of the Ray container of every pod (head and workers)."""

    name: str = Field(min_length=1, max_length=MAX_DNS_LABEL_LENGTH, description="Name of a volume in `spec.volumes`.")
    mount_path: str = Field(
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="Where the volume appears in the container, an absolute path; the job "
        "config's paths (e.g. `job.model.path`) point below it.",
    )
    sub_path: str | None = Field(
        default=None,
        max_length=MAX_PATH_LENGTH,
        description="Path inside the volume to mount instead of its root (relative, no `..`).",
    )
    read_only: bool | None = Field(default=None, description="Mount read-only.")


class KeySelector(_Model):
    name: str = Field(
        min_length=1, max_length=MAX_NAME_LENGTH, description="Secret or ConfigMap in the RLJob's namespace."
    )
    key: str = Field(min_length=1, max_length=MAX_KEY_LENGTH, description="The key whose value to take.")
    optional: bool | None = Field(default=None, description="Start even when the object or key is missing.")


class FieldSelector(_Model):
    field_path: str = Field(
        min_length=1,
        max_length=MAX_KEY_LENGTH,
        description="A field of the pod, e.g. `metadata.name` or `status.podIP`.",
    )
    api_version: str | None = Field(default=None, max_length=MAX_VERSION_LENGTH, description="Default `v1`.")


class EnvVarSource(_Model):
    """Where an env value comes from; set exactly one."""

    secret_key_ref: KeySelector | None = Field(default=None, description="A key of a Secret (e.g. a reward API token).")
    config_map_key_ref: KeySelector | None = Field(default=None, description="A key of a ConfigMap.")
    field_ref: FieldSelector | None = Field(default=None, description="A field of the pod.")


class EnvVar(_Model):
    """A core/v1 EnvVar of the Ray container of every pod; the job driver (on the head) and every
    worker process inherit it."""

    name: str = Field(min_length=1, max_length=MAX_ENV_NAME_LENGTH, description="Variable name.")
    value: str | None = Field(
        default=None, max_length=MAX_ENV_VALUE_LENGTH, description="Literal value; use `valueFrom` for secrets."
    )
    value_from: EnvVarSource | None = Field(
        default=None, description="Take the value from a Secret, ConfigMap or the pod."
    )


class EnvFromRef(_Model):
    name: str = Field(
        min_length=1, max_length=MAX_NAME_LENGTH, description="Secret or ConfigMap in the RLJob's namespace."
    )
    optional: bool | None = Field(default=None, description="Start even when it is missing.")


class EnvFromSource(_Model):
    """A core/v1 EnvFromSource: every key of a Secret or ConfigMap as a variable; set exactly one."""

    prefix: str | None = Field(default=None, max_length=MAX_ENV_NAME_LENGTH, description="Prepended to every key.")
    secret_ref: EnvFromRef | None = Field(default=None, description="A Secret.")
    config_map_ref: EnvFromRef | None = Field(default=None, description="A ConfigMap.")


class ClusterSpec(_Model):
    """How the Ray cluster's pods are made. Its size comes from `job.resources`."""

    device_resource: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_KEY_LENGTH,
        description="Extended resource that the device plugin advertises; each worker pod of an NPU or GPU job "
        "requests `job.resources.devices_per_node` of it (e.g. `huawei.com/Ascend910`, `nvidia.com/gpu`); a "
        "`job.resources.device: cpu` job requests none (and may not set it). "
        f"Unset: the operator's default (chart value `runtime.deviceResource`, `{DEFAULT_DEVICE_RESOURCE}` "
        "unless changed; a GPU job with an Ascend default requests `nvidia.com/gpu`).",
    )
    head: PodResources = Field(
        default_factory=lambda: PodResources(cpu=8, memory="32Gi"),
        description="The head pod, which runs the trainer driver and the dock's controllers. "
        "Default: cpu 8, memory 32Gi.",
    )
    worker: PodResources = Field(
        default_factory=lambda: PodResources(cpu=32, memory="256Gi"),
        description="Each worker pod (one per node), besides its devices. Default: cpu 32, memory 256Gi.",
    )
    pool: PodResources | None = Field(
        default=None,
        description="Each rollout pool pod (`job.rollout.pool`: one device and one generation engine), besides "
        "its device. Unset: `worker`'s. Its memory must hold the engine's process and, in Ray's object store "
        "(about 30% of the pod's memory), one published policy version: the model's parameters in the "
        "generation dtype.",
    )
    node_selector: dict[str, Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE_LENGTH)]] = Field(
        default_factory=dict, description="Node labels every Ray pod requires."
    )
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations of every Ray pod.")
    ray_version: str = Field(
        default=DEFAULT_RAY_VERSION,
        min_length=1,
        max_length=MAX_VERSION_LENGTH,
        description="Ray version of the image, for KubeRay.",
    )


class SchedulingSpec(_Model):
    scheduler_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="Pod schedulerName; unset uses the cluster default.",
    )
    gang: GangScheduler = Field(
        default=GangScheduler.NONE,
        description="All-or-nothing start of the head and every worker: `volcano` (KubeRay's "
        "Volcano integration, a PodGroup per cluster) or `kueue` (Kueue admits the RayCluster).",
    )
    queue: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="Volcano queue, or Kueue LocalQueue (required for `kueue`).",
    )


class CheckpointStorage(_Model):
    """Where checkpoints and metrics live: a volume every Ray pod mounts (set exactly one source).

    The run writes to `<mountPath>/<namespace>/<name>/<uid>` (a re-created RLJob of the same name
    starts fresh); `job.checkpoint` sets how often.
    """

    claim_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="PersistentVolumeClaim in the RLJob's namespace (ReadWriteMany for several nodes).",
    )
    host_path: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="Directory on every node, e.g. a shared filesystem mount.",
    )
    mount_path: str = Field(
        default=DEFAULT_CHECKPOINT_MOUNT_PATH,
        min_length=1,
        max_length=MAX_PATH_LENGTH,
        description="Where the volume is mounted in the pods.",
    )


Argument = Annotated[str, StringConstraints(max_length=MAX_PATH_LENGTH)]
# One default for `rldock train`'s servers and an RLJob's environment pods alike.
DEFAULT_SESSIONS_PER_REPLICA: int = EnvironmentServersSpec.model_fields["sessions_per_replica"].default


class Environment(_Model):
    """The server pods of one environment (an OpenEnv server image): a Deployment of `replicas` pods
    and a headless Service, named `<rljob>-env-<name>-<16 hex>`, reachable only from the job's Ray pods
    and reaching only the cluster's DNS (and what the cluster's policy lists), started once the job is
    admitted. The job config names it with `servers.service: <name>` (`job.agent.environment.servers`
    or `job.agent.sandbox.servers`)."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="The environment's name (a DNS label), which `servers.service` in the job config names.",
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_IMAGE_LENGTH,
        pattern=IMAGE_PATTERN,
        description="The server's image, under the cluster's allowed image prefixes (chart value "
        "`policy.imagePrefixes`). Unset: the RLJob's runtime image (`spec.image`, else the operator's default), "
        "whose `rldock env serve <module:Class>` serves an environment class (set `command`).",
    )
    command: list[Argument] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_ARGUMENTS,
        description="The container's command (replaces the image's entrypoint); the server must listen on all "
        "addresses at `port`, e.g. `[rldock, env, serve, rldock.runtime.agent.sandbox_service:PythonSandbox, --host, "
        "0.0.0.0, --port, '8000']`.",
    )
    args: list[Argument] | None = Field(
        default=None, max_length=MAX_ARGUMENTS, description="The container's arguments (replace the image's CMD)."
    )
    port: int = Field(
        default=DEFAULT_ENVIRONMENT_PORT,
        ge=1,
        le=65535,
        description=f"The TCP port the server listens on; it must answer `GET {ENVIRONMENT_HEALTH_PATH}` there "
        "(the readiness probe) and serve the OpenEnv protocol.",
    )
    replicas: int = Field(default=1, ge=1, le=256, description="Server pods; episodes are spread over them.")
    sessions_per_replica: int = Field(
        default=DEFAULT_SESSIONS_PER_REPLICA,
        ge=1,
        le=4096,
        description="Sessions (episodes) one pod holds at once; the operator writes it into the job config's "
        "`servers.sessions_per_replica`.",
    )
    resources: PodResources = Field(
        default_factory=lambda: PodResources(cpu=1, memory="1Gi"),
        description="CPU and memory of each pod (request = limit). Default: cpu 1, memory 1Gi.",
    )
    ephemeral_storage: Quantity = Field(
        default=DEFAULT_ENVIRONMENT_EPHEMERAL_STORAGE,
        description="Local disk of each pod (request = limit of `ephemeral-storage`), and the size of its `/tmp`, "
        "the only path it may write (the root filesystem is read-only). The kubelet evicts a pod that writes more. "
        f"Default: {DEFAULT_ENVIRONMENT_EPHEMERAL_STORAGE}.",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_POD_INPUTS,
        description="Environment variables of the server container (only these and the job's environment token, "
        "`RLDOCK_ENV_TOKEN`, which the server asks every client for: the pods get nothing of the Ray pods' `env`, "
        "volumes or Ray token).",
    )


class Agent(_Model):
    """The harness pods of one agent (docs/agentic.md, Agents as pods): a Deployment of `replicas` pods,
    named `<rljob>-agent-<name>-<16 hex>`, each running the operator's episode runner, which leases the
    job's episodes from its Ray pods' gateway and runs `command` once per episode with the episode's
    `OPENAI_BASE_URL`, `OPENAI_API_KEY` and `RLDOCK_TASK` in its environment (as `agent.harness_command`
    does on the Ray pods). The pods reach only their job's gateway, its environments' pods and the
    cluster's DNS (and what the cluster's policy lists), and start once the job is admitted."""

    name: str = Field(
        min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN, description="The agent's name (a DNS label)."
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_IMAGE_LENGTH,
        pattern=IMAGE_PATTERN,
        description="The harness's image, under the cluster's allowed image prefixes (chart value "
        "`policy.imagePrefixes`); it must have `python3` (the runner is mounted from a ConfigMap and uses only "
        "the standard library). Unset: the RLJob's runtime image (`spec.image`, else the operator's default).",
    )
    command: list[Argument] = Field(
        min_length=1,
        max_length=MAX_ARGUMENTS,
        description="The command run once per episode (not the container's entrypoint), e.g. `[python, "
        "/app/agent.py]`; its last printed line is the episode's reward (a number, or a JSON object with "
        "`reward`), unless it posts rewards to the session; exit status non-zero ends the episode "
        "`harness_exit`.",
    )
    replicas: int = Field(default=1, ge=1, le=256, description="Harness pods; each leases episodes on its own.")
    episodes_per_replica: int = Field(
        default=1, ge=1, le=256, description="Episodes one pod runs at once (processes of `command`)."
    )
    resources: PodResources = Field(
        default_factory=lambda: PodResources(cpu=1, memory="1Gi"),
        description="CPU and memory of each pod (request = limit). Default: cpu 1, memory 1Gi.",
    )
    ephemeral_storage: Quantity = Field(
        default=DEFAULT_AGENT_EPHEMERAL_STORAGE,
        description="Local disk of each pod (request = limit of `ephemeral-storage`), and the size of its `/tmp`, "
        f"the only path it may write (the root filesystem is read-only). Default: {DEFAULT_AGENT_EPHEMERAL_STORAGE}.",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_POD_INPUTS,
        description="Environment variables of the harness container, passed on to `command` besides the "
        "episode's (the pods get nothing of the Ray pods' `env`, volumes or Ray token).",
    )


class LocalObjectReference(_Model):
    name: str = Field(
        min_length=1, max_length=MAX_NAME_LENGTH, description="Name of an object in the RLJob's namespace."
    )


class PreemptionSpec(_Model):
    """The head's preStop hook (`rldock preempt`) stops the driver as SIGTERM does: the iteration under way
    finishes, is checkpointed, and the next attempt resumes right after it (docs/operator.md)."""

    grace_period_seconds: int = Field(
        default=300,
        ge=30,
        le=86_400,
        description="The Ray pods' terminationGracePeriodSeconds: the time the driver has to finish its iteration "
        "and save the checkpoint before the pod is killed. Longer than an iteration plus a checkpoint's save; "
        "a driver still running 15 s before it ends is left to the kill, and the last checkpoint saved stands.",
    )


class RLJobSpec(_Model):
    job: JobConfig = Field(description="The runtime job config, exactly what `rldock train` reads.")
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_IMAGE_LENGTH,
        pattern=IMAGE_PATTERN,
        description="Runtime image of every Ray pod, an image reference `[registry/]repository[:tag][@digest]` "
        "without spaces. Unset: the operator's default (chart value "
        "`runtime.image`, `ghcr.io/rldock/rldock-runtime:<rldock version>` unless changed).",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        max_length=MAX_POD_INPUTS,
        description="Secrets (type kubernetes.io/dockerconfigjson) in the RLJob's namespace to pull `image` with, "
        "besides those the cluster admin adds to every Ray pod.",
    )
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Pods of the Ray cluster.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="Scheduler and gang scheduling.")
    checkpoint: CheckpointStorage = Field(description="Checkpoint storage shared by all Ray pods.")
    volumes: list[Volume] = Field(
        default_factory=list,
        max_length=MAX_POD_INPUTS,
        description="Volumes of every Ray pod (head and workers), as in a pod spec: the PVC or NFS share "
        "with the model and data, a ConfigMap with a reward function file. Mount them with `volumeMounts`.",
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=MAX_POD_INPUTS,
        description="Mounts of `volumes` into the Ray container of every pod; the job config's paths "
        "refer to these mount paths. The runtime checks every configured path before it starts.",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_POD_INPUTS,
        description="Environment of the Ray container of every pod, e.g. a remote reward's token from a "
        "Secret (`valueFrom.secretKeyRef`).",
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list,
        max_length=MAX_POD_INPUTS,
        description="Every key of a Secret or ConfigMap as environment variables of every Ray container; "
        "`env` and the operator's own variables win over keys of the same name.",
    )
    environments: list[Environment] = Field(
        default_factory=list,
        max_length=MAX_ENVIRONMENTS,
        description="Environment servers the operator runs as pods for this job (docs/agentic.md, Environments "
        "in an RLJob); `servers.service: <name>` in the job config points the runtime at one.",
    )
    agents: list[Agent] = Field(
        default_factory=list,
        max_length=MAX_AGENTS,
        description="Harness pods the operator runs for this job (docs/agentic.md, Agents as pods): they lease "
        "the job's episodes and run the user's agent against the gateway; the operator sets the job config's "
        "`agent.harness_pods`.",
    )
    suspend: bool = Field(
        default=False,
        description="Free the cluster and keep the checkpoint (the environments' and agents' pods are scaled to 0); "
        "unset to "
        "resume from it.",
    )
    backoff_limit: int = Field(
        default=DEFAULT_BACKOFF_LIMIT,
        ge=0,
        description="Restarts (failed Ray job or lost worker pod) before the RLJob fails.",
    )
    max_restarts: int = Field(
        default=0,
        ge=0,
        le=100,
        description="Restarts inside one Ray job attempt: when a worker process or its pod dies, the runtime "
        "restarts its workers from the last checkpoint and, where the dock survived, the iteration in flight "
        "(`rldock train --max-restarts`). A lost pod takes the dock's warehouse on its node with it, so its "
        "iteration is redone from the checkpoint; the restart waits for KubeRay's replacement pod to join "
        "(up to 10 minutes). While this budget lasts a lost worker pod is the runtime's to recover, not a "
        "failed attempt (no restartCount, the same Ray job); once it is spent the Ray job fails and "
        "backoffLimit applies. 0: every lost worker fails the attempt at once, save one whose pod the operator saw "
        "deleted alone while the job ran (a drain): that attempt ends as a preemption, no restart counted.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="Delete the RLJob this long after it succeeds or fails."
    )
    preemption: PreemptionSpec = Field(
        default_factory=lambda: PreemptionSpec(),
        description="How a job stops when its pods are taken (deleted, a node drained, Kueue's preemption).",
    )
    managed_by: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description=f"The controller that reconciles this RLJob (Kueue's convention for job resources, e.g. "
        f"MultiKueue's `kueue.x-k8s.io/multikueue`). Unset or `{MANAGED_BY_RLDOCK}`: this operator; any other "
        "value: the operator leaves the RLJob, its status and its children alone. Set it at creation only.",
    )

    @property
    def has_pod_sets(self) -> bool:
        """Whether the job runs pods of its own beside the Ray cluster (spec.environments or spec.agents),
        which share the job's pod token (RLDOCK_ENV_TOKEN) with its Ray pods."""
        return bool(self.environments or self.agents)


@dataclass(frozen=True)
class PodDefaults:
    """What the Ray pods of an RLJob get where its spec leaves it to the installation.

    One value per operator (settings.py reads it from RLDOCK_DEFAULT_IMAGE, RLDOCK_IMAGE_PULL_POLICY,
    RLDOCK_DEFAULT_DEVICE_RESOURCE and RLDOCK_POLICY, which the chart sets from its `runtime` and
    `policy` values) and passed
    to the builders explicitly: a cluster admin picks the runtime build and the device plugin once,
    and RLJobs need not name them.
    """

    image: str = DEFAULT_IMAGE
    image_pull_policy: ImagePullPolicy = DEFAULT_IMAGE_PULL_POLICY
    device_resource: str = DEFAULT_DEVICE_RESOURCE
    # What the cluster admin adds to every Ray pod (the chart's policy.podDefaults, policy.py).
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    priority_class_name: str | None = None
    image_pull_secrets: tuple[str, ...] = ()

    def image_of(self, spec: RLJobSpec) -> str:
        return spec.image or self.image

    def device_resource_of(self, spec: RLJobSpec) -> str:
        return spec.cluster.device_resource or self.device_resource

    def image_pull_secrets_of(self, spec: RLJobSpec) -> list[str]:
        """The admin's pull secrets, then the RLJob's own, each once."""
        return list(dict.fromkeys([*self.image_pull_secrets, *(ref.name for ref in spec.image_pull_secrets)]))


def _known_reason(value: str) -> str:
    """A reason this operator knows as its Reason member (so code compares members), any other
    reason (written by a newer operator) as the string it is."""
    return Reason(value) if value in _REASONS else value


_REASONS = frozenset(reason.value for reason in Reason)
# metav1.Condition's reason: CamelCase, as the API machinery validates it.
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class Condition(_Model):
    """The shape of a Kubernetes metav1.Condition. `reason` is a string in the schema, not an enum:
    a CRD installed by an older release must still accept the status a newer operator writes
    (docs/troubleshooting.md lists the reasons)."""

    model_config = ConfigDict(extra="ignore")  # a status written by another operator version
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: Annotated[
        str,
        StringConstraints(min_length=1, max_length=1024, pattern=CONDITION_REASON_PATTERN),
        AfterValidator(_known_reason),
    ]
    message: str = ""
    last_transition_time: datetime
    observed_generation: int | None = Field(default=None, ge=0)


class LastEvaluation(_Model):
    """The newest held-out evaluation of the policy (job.evaluation)."""

    model_config = ConfigDict(extra="ignore")
    iteration: int = Field(ge=0, description="Iteration whose policy was evaluated; 0 is the initial policy.")
    reward: float = Field(description="Mean reward of the held-out responses.")
    accuracy: float = Field(
        ge=0, le=1, description="Share of held-out responses with reward >= job.evaluation.correct_threshold."
    )


class PodSetStatus(_Model):
    """The pods of one spec.environments or spec.agents entry, as its Deployment reports them."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(description="The spec.environments or spec.agents entry.")
    replicas: int = Field(
        ge=0, description="Pods its Deployment asks for now (0 while the RLJob is suspended or finished)."
    )
    ready_replicas: int = Field(default=0, ge=0, description="Pods that answer their readiness probe.")


class RLJobStatus(_Model):
    """Written only by the operator (status subresource)."""

    model_config = ConfigDict(extra="ignore")
    phase: Phase | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        # A list-map keyed by type, as metav1.Condition lists are: one entry per type, and a
        # server-side apply of one condition does not replace the others.
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    iteration: int | None = Field(default=None, ge=0, description="Last finished RL iteration.")
    iterations: int | None = Field(default=None, ge=1, description="RL iterations of the job.")
    progress: str | None = Field(default=None, description="`iteration/iterations`, for kubectl.")
    reward: float | None = Field(
        default=None, description="Mean reward of the last iteration (DPO: the policy's preference accuracy)."
    )
    tokens_per_second_per_device: float | None = Field(
        default=None, description="Throughput of the last iteration, tokens/s per device."
    )
    last_evaluation: LastEvaluation | None = Field(
        default=None, description="The newest held-out evaluation; unset until the job evaluates."
    )
    rollout_mismatch_kl: float | None = Field(
        default=None,
        description="The last iteration's train-inference mismatch (`mismatch/kl`), in a job that measures it "
        "(job.algorithm.rollout_correction or job.monitoring.mismatch).",
    )
    environments: list[PodSetStatus] | None = Field(
        default=None, description="The pods of each spec.environments entry; unset without environments."
    )
    environments_ready: str | None = Field(
        default=None,
        description="`ready/replicas` summed over spec.environments, for kubectl; unset without environments.",
    )
    agents: list[PodSetStatus] | None = Field(
        default=None, description="The pods of each spec.agents entry; unset without agents."
    )
    agents_ready: str | None = Field(
        default=None, description="`ready/replicas` summed over spec.agents, for kubectl; unset without agents."
    )
    last_checkpoint: str | None = Field(default=None, description="Path of the newest complete checkpoint.")
    restart_count: int = Field(default=0, ge=0, description="Restarts so far (at most spec.backoffLimit).")
    attempt: int | None = Field(
        default=None,
        ge=0,
        description="The number of the current Ray job attempt (its submission id ends in it): one more for each "
        "restart and for each attempt stopped by a worker pod deleted alone (a drain), which counts no restart. "
        "Unset on an RLJob whose attempts were numbered by restartCount (written before this field).",
    )
    ray_cluster_name: str | None = None
    ray_job_id: str | None = Field(default=None, description="Submission id of the current Ray job.")
    start_time: datetime | None = None
    completion_time: datetime | None = None
    observed_generation: int | None = Field(default=None, ge=0)

    def condition(self, type_: ConditionType) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)
