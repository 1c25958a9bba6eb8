"""Every name the operator shares with the cluster: API coordinates, labels, annotations, env,
paths, KubeRay and scheduler keys, phases, condition types and reasons, event reasons.

Kept in one module (as KubeRay does) so builders, status and handlers cannot drift apart on a
string, and so tests can refer to the same values the code writes.
"""

from __future__ import annotations

from enum import Enum

from rldock.config.job import MAX_NAME_LENGTH as JOB_MAX_NAME_LENGTH
from rldock.config.job import MAX_PATH_LENGTH as JOB_MAX_PATH_LENGTH
from rldock.contract.failure import FailureReason
from rldock.contract.runtime_cli import ENVIRONMENT_TOKEN_ENV, JOB_CONFIG_ENV
from rldock.contract.version import __version__

# --- The RLJob API --------------------------------------------------------------------------
GROUP = "rldock.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
LIST_KIND = "RLJobList"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ("rlj",)
CRD_NAME = f"{PLURAL}.{GROUP}"

# Added on every RLJob so deletion waits until the Ray job is stopped and the children are gone.
FINALIZER = f"{GROUP}/cleanup"

# --- Defaults of the spec -------------------------------------------------------------------
# The image and device resource of RLJobs that leave them unset, unless the operator is given its
# own (settings.py: RLDOCK_DEFAULT_IMAGE, RLDOCK_DEFAULT_DEVICE_RESOURCE; the chart's runtime.* values).
DEFAULT_IMAGE = f"ghcr.io/rldock/rldock-runtime:{__version__}"
DEFAULT_DEVICE_RESOURCE = "huawei.com/Ascend910"
# The device resource of GPU jobs (job.resources.accelerator_resource GPU) that leave
# spec.cluster.deviceResource unset where the installation's default is an Ascend one (its domain):
# NVIDIA's device plugin's. An installation configured with another resource gives them that one.
GPU_DEVICE_RESOURCE = "nvidia.com/gpu"
ASCEND_RESOURCE_DOMAIN = "huawei.com"
# The Ray version baked into the runtime image (requirements/cpu.lock pins ray==2.60.0).
DEFAULT_RAY_VERSION = "2.60.0"
DEFAULT_CHECKPOINT_MOUNT_PATH = "/checkpoints"
DEFAULT_BACKOFF_LIMIT = 3


class ImagePullPolicy(str, Enum):
    """core/v1 Container.imagePullPolicy of the Ray pods, one for the whole installation."""

    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


DEFAULT_IMAGE_PULL_POLICY = ImagePullPolicy.IF_NOT_PRESENT

# --- Bounds that keep an RLJob and what it makes within the API server's limits ---------------
# A ConfigMap's data may hold at most 1 MiB (core/v1 validation, MaxSecretSize alike).
CONFIG_MAP_MAX_BYTES = 1024 * 1024
# Condition messages are cut to this length (metav1.Condition allows 32768): a message that
# quotes a huge spec value must not make every status patch too large for the API server.
CONDITION_MESSAGE_MAX = 2048
# maxLength of the spec's free strings, in the CRD schema and the models alike (the embedded job
# config bounds its own: rldock.config.job).
MAX_PATH_LENGTH = JOB_MAX_PATH_LENGTH  # PATH_MAX: hostPath, mountPath (and job.model.path)
MAX_NAME_LENGTH = JOB_MAX_NAME_LENGTH  # a DNS subdomain: claim, scheduler and queue names
MAX_KEY_LENGTH = 253 + 1 + 63  # `prefix/name`: extended resource names, taint keys
MAX_LABEL_VALUE_LENGTH = 63  # label values (nodeSelector) and taint values
MAX_IMAGE_LENGTH = 512  # registry host, repository, tag and digest together
MAX_VERSION_LENGTH = 64  # rayVersion
MAX_DNS_LABEL_LENGTH = 63  # volume names
MAX_ENV_NAME_LENGTH = 253  # env var names and envFrom prefixes (a bound; core/v1 sets none)
MAX_ENV_VALUE_LENGTH = 32 * 1024  # a literal env value; larger values belong in a Secret or ConfigMap
MAX_POD_INPUTS = 64  # entries of each of spec.volumes, volumeMounts, env, envFrom
MAX_ENVIRONMENTS = 16  # entries of spec.environments
MAX_ARGUMENTS = 256  # entries of an environment's command and args
# A DNS-1123 label: volume names, spec.environments[].name (the job config's servers.service).
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# An image reference: [host[:port]/]path[:tag][@digest], without spaces or other characters a
# registry would refuse (the full grammar is docker/distribution's reference package; the runtime's
# pull reports what this lets through).
IMAGE_PATTERN = (
    r"^([A-Za-z0-9][A-Za-z0-9.-]*(:[0-9]+)?/)?[A-Za-z0-9][A-Za-z0-9._/-]*"
    r"(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?(@[A-Za-z0-9_+.-]+:[A-Fa-f0-9]{32,})?$"
)

# --- Labels and annotations on the children --------------------------------------------------
LABEL_RLJOB = f"{GROUP}/rljob"  # value: the RLJob name, label-safe (naming.label_value)
LABEL_ROLE = f"{GROUP}/role"  # value: ROLE_HEAD or ROLE_WORKER, on pod templates
LABEL_APP_NAME = "app.kubernetes.io/name"
# Set by the API server on every namespace (Kubernetes >= 1.21): NetworkPolicies select by it.
LABEL_NAMESPACE_NAME = "kubernetes.io/metadata.name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "rldock"
MANAGED_BY = "rldock-operator"
ROLE_HEAD = "head"
ROLE_WORKER = "worker"
ROLE_POOL = "pool"  # the pods of the rollout pool's worker group (spec.job.rollout.pool)
ROLE_ENVIRONMENT = "environment"  # the pods of spec.environments
# On an environment's Deployment, Service and NetworkPolicy (beside `rldock.io/rljob`) and its pods:
# the spec.environments entry's name.
LABEL_ENVIRONMENT = f"{GROUP}/environment"
# On an environment's pods instead of `rldock.io/rljob` (value alike: naming.label_value of the
# RLJob's name). They must not carry `rldock.io/rljob`: the Ray pods' NetworkPolicy admits every pod
# with it on every port, and an environment runs code the job's author did not write.
LABEL_ENVIRONMENT_OF = f"{GROUP}/environment-of"
ROLE_AGENT = "agent"  # the pods of spec.agents
# The same three labels for an agent's pods (spec.agents) and children: the entry's name, the RLJob's
# (instead of `rldock.io/rljob`, as for environments: an agent pod runs the user's harness, hostile to
# the Ray pods) and its uid.
LABEL_AGENT = f"{GROUP}/agent"
LABEL_AGENT_OF = f"{GROUP}/agent-of"
LABEL_AGENT_UID = f"{GROUP}/agent-of-uid"
# Hash of the desired RayCluster spec: the handler replaces a cluster whose hash differs instead of
# diffing KubeRay's defaulted spec field by field.
ANNOTATION_SPEC_HASH = f"{GROUP}/spec-hash"
# On a RayCluster the operator suspended itself (spec.suspend of the RLJob): only such a cluster is
# unsuspended by the operator. A cluster suspended by anyone else (an admin; Kueue, whose suspend of a
# `gang: kueue` job reads as waiting for admission) is left suspended until they resume it.
ANNOTATION_SUSPENDED_BY = f"{GROUP}/suspended-by"
# The value of spec.managedBy (Kueue's convention for job CRDs) that this operator reconciles;
# an RLJob naming another manager (e.g. MultiKueue's) is left to it.
MANAGED_BY_RLDOCK = f"{GROUP}/rljob-operator"
# Ray job metadata: the worker pods an attempt was submitted on, so a worker that KubeRay replaced
# mid-run (new pod name) is recognised as lost, also by a restarted operator.
JOB_METADATA_WORKER_PODS = f"{GROUP}/worker-pods"

# --- What the runtime sees inside the pods ---------------------------------------------------
# The job config's path; the runtime CLI reads it when no config is given (rldock.contract.runtime_cli).
ENV_JOB_CONFIG = JOB_CONFIG_ENV
# Ray 2.60 token authentication (ray/_private/authentication): every Ray process of the cluster,
# the job driver included, reads the mode and the shared token from these variables; HTTP clients
# of the dashboard (the Jobs API) send `Authorization: Bearer <token>`.
ENV_RAY_AUTH_MODE = "RAY_AUTH_MODE"
ENV_RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
RAY_AUTH_MODE_TOKEN = "token"
AUTH_SECRET_KEY = "auth_token"  # key of the token in the per-RLJob Secret
# The job's environment token (docs/security.md): the operator makes one random token per RLJob with
# environments, in a Secret (builders/secret.py) that both sides read as RLDOCK_ENV_TOKEN
# (rldock.contract.runtime_cli): the servers ask every client for it, the Ray pods' clients send it.
ENV_ENVIRONMENT_TOKEN = ENVIRONMENT_TOKEN_ENV
ENVIRONMENT_TOKEN_KEY = "token"  # key of the token in that Secret
CONFIG_MOUNT_PATH = "/etc/rldock"
JOB_CONFIG_FILE = "job.yaml"
JOB_CONFIG_PATH = f"{CONFIG_MOUNT_PATH}/{JOB_CONFIG_FILE}"
SHM_MOUNT_PATH = "/dev/shm"
VOLUME_JOB_CONFIG = "job-config"
VOLUME_CHECKPOINTS = "checkpoints"
VOLUME_SHM = "dshm"
# Ray writes its session directory (sockets, logs, spilled objects) under /tmp: a pod-lifetime
# emptyDir, so the pod needs no writable image layer for it and the writes count against the pod.
TMP_MOUNT_PATH = "/tmp"
VOLUME_TMP = "tmp"
# What the operator itself puts into every Ray pod; an RLJob's own spec.volumes / spec.env must not
# reuse these names (validation.py), or the pod would have two volumes or two values of one name.
# The environment token only goes in when the job has spec.environments: without them, a job may set
# RLDOCK_ENV_TOKEN itself (the token of an environment server it reaches elsewhere).
OPERATOR_VOLUMES = (VOLUME_JOB_CONFIG, VOLUME_CHECKPOINTS, VOLUME_SHM, VOLUME_TMP)
OPERATOR_ENV = (ENV_JOB_CONFIG, ENV_RAY_AUTH_MODE, ENV_RAY_AUTH_TOKEN)
OPERATOR_ENVIRONMENTS_ENV = (ENV_ENVIRONMENT_TOKEN,)

# --- The pod security profile of every Ray pod ---------------------------------------------------
# The `restricted` Pod Security Standard (docs/security.md): non-root, no privilege escalation, no
# capabilities, the runtime's default seccomp profile. The runtime images run as this uid
# (images/README.md); setting it in the pod also keeps an image that would run as root non-root.
RAY_POD_UID = 10001
RAY_POD_GID = 10001

# --- The pods of spec.environments (builders/environments.py) -----------------------------------
ENVIRONMENT_CONTAINER = "environment"
ENVIRONMENT_PORT_NAME = "http"
# OpenEnv's servers answer GET /health with {"status": "healthy"}: the readiness probe.
ENVIRONMENT_HEALTH_PATH = "/health"
DEFAULT_ENVIRONMENT_PORT = 8000  # OpenEnv's (and uvicorn's) default port
DEFAULT_ENVIRONMENT_EPHEMERAL_STORAGE = "1Gi"  # each pod's local disk and its /tmp
# On an environment's pods and in its Service's and Deployment's selectors: the RLJob's uid, which a
# stray pod copying the readable labels (`environment-of`, `environment`) does not carry by accident,
# and which no other RLJob (nor a re-created one of the same name) has.
LABEL_ENVIRONMENT_UID = f"{GROUP}/environment-of-uid"
# --- The pods of spec.agents (builders/agents.py) --------------------------------------------------
AGENT_CONTAINER = "agent"
DEFAULT_AGENT_EPHEMERAL_STORAGE = "1Gi"  # each pod's local disk and its /tmp
MAX_AGENTS = 16  # entries of spec.agents
# The runner every agent pod runs (rldock.contract.agent_runner, stdlib Python only): mounted from a
# ConfigMap, so an image needs `python3` and nothing of rldock's.
AGENT_RUNNER_FILE = "agent_runner.py"
AGENT_RUNNER_MOUNT_PATH = "/etc/rldock-agent"
VOLUME_AGENT_RUNNER = "agent-runner"
GATEWAY_PORT_NAME = "gateway"
# Volcano reads a pod's queue from this annotation when the pod is in no PodGroup of its own.
ANNOTATION_VOLCANO_QUEUE = "scheduling.volcano.sh/queue-name"
# Where the environments' pods may send DNS queries (their only egress unless the admin's policy
# lists more): the cluster DNS's pods, as kubeadm, kops and most installers label CoreDNS.
DNS_NAMESPACE = "kube-system"
DNS_POD_LABELS = {"k8s-app": "kube-dns"}
DNS_PORT = 53
# What every Kubernetes Service name resolves under in the cluster's DNS.
CLUSTER_DOMAIN = "cluster.local"

# --- KubeRay (ray.io/v1) ---------------------------------------------------------------------
RAY_API_VERSION = "ray.io/v1"
RAY_CLUSTER_KIND = "RayCluster"
RAY_CLUSTER_PLURAL = "rayclusters"
HEAD_CONTAINER = "ray-head"
WORKER_CONTAINER = "ray-worker"
WORKER_GROUP = "workers"
POOL_GROUP = "pool"  # the rollout pool's worker group (shorter than WORKER_GROUP: naming.RAY_CLUSTER_NAME_MAX)
DASHBOARD_PORT = 8265  # the Ray Jobs API is served by the head's dashboard
DASHBOARD_ENDPOINT = "dashboard"  # key of the dashboard port in RayCluster .status.endpoints
# Labels KubeRay puts on every pod of a RayCluster.
LABEL_RAY_CLUSTER = "ray.io/cluster"
LABEL_RAY_NODE_TYPE = "ray.io/node-type"  # "head" or "worker"
LABEL_RAY_GROUP = "ray.io/group"  # a worker pod's groupName (WORKER_GROUP, POOL_GROUP)
RAY_NODE_TYPE_HEAD = "head"
RAY_NODE_TYPE_WORKER = "worker"
# RayCluster.status as KubeRay writes it.
RAY_STATE_READY = "ready"
RAY_STATE_SUSPENDED = "suspended"
RAY_CONDITION_PROVISIONED = "RayClusterProvisioned"
RAY_CONDITION_SUSPENDED = "RayClusterSuspended"
# Ray resource names that `ray start --resources` refuses: they have their own flags.
RAY_RESERVED_RESOURCES = frozenset({"CPU", "GPU", "TPU", "memory", "object_store_memory"})
# Ray's built-in GPU resource: a GPU job's workers start with `--num-gpus` (rayStartParams
# `num-gpus`), the one reserved name an RLJob's accelerator_resource may take.
RAY_GPU = "GPU"

# --- Gang scheduling, the way a KubeRay user sets it -----------------------------------------
LABEL_RAY_SCHEDULER_NAME = "ray.io/scheduler-name"  # KubeRay's batch-scheduler switch
VOLCANO_SCHEDULER = "volcano"
LABEL_VOLCANO_QUEUE = "volcano.sh/queue-name"
LABEL_KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
# The RayCluster's labels that hand it to a gang scheduler (builders/ray_cluster.py): outside its
# spec, so outside the spec-hash; a cluster without the ones the spec sets is replaced as one whose
# hash differs (actions.py), or a moved queue would never reach it.
SCHEDULING_LABELS = (LABEL_RAY_SCHEDULER_NAME, LABEL_VOLCANO_QUEUE, LABEL_KUEUE_QUEUE)


class GangScheduler(str, Enum):
    NONE = "none"
    VOLCANO = "volcano"  # KubeRay creates a Volcano PodGroup for head + all workers
    KUEUE = "kueue"  # Kueue admits (unsuspends) the whole RayCluster at once


# --- Status ----------------------------------------------------------------------------------
class Phase(str, Enum):
    PENDING = "Pending"  # nothing running yet: cluster not created, or queued for admission
    PROVISIONING = "Provisioning"  # cluster starting, or Ray job submitted but not running yet
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    RETRYING = "Retrying"  # a failed attempt is being replaced, resuming from the last checkpoint

    @property
    def is_terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class ConditionType(str, Enum):
    SPEC_VALID = "SpecValid"
    CLUSTER_READY = "ClusterReady"
    PODS_SCHEDULED = "PodsScheduled"
    RUNNING = "Running"
    RETRYING = "Retrying"
    SUSPENDED = "Suspended"
    COMPLETE = "Complete"
    FAILED = "Failed"
    # spec.job.monitoring.mismatch: the last iteration's train-inference mismatch against its budget
    ROLLOUT_MISMATCH = "RolloutMismatch"
    # The head pod was deleted while the attempt ran (a drain, a preemption): its preStop hook stopped the
    # driver, which checkpointed the iteration under way; the next attempt resumes after it, no restart counted
    PREEMPTED = "Preempted"
    # Whether a stop (the iteration under way, then a checkpoint), as the last progress line measures it, fits
    # in what spec.preemption.gracePeriodSeconds leaves the driver (PREEMPT_MARGIN_S less)
    GRACE_PERIOD_SUFFICIENT = "GracePeriodSufficient"


# What the head keeps of its grace period after the driver's stop, for Ray's own (`ray start` ends its
# processes on the SIGTERM that follows the head's preStop hook).
PREEMPT_MARGIN_S = 15


class Reason(str, Enum):
    """Machine-readable reasons of conditions (CamelCase, as Kubernetes conditions use)."""

    VALID = "Valid"
    INVALID_SPEC = "InvalidSpec"
    # The spec is valid but outside what the cluster admin allows (the chart's `policy` values).
    POLICY_DENIED = "PolicyDenied"
    RAY_CLUSTER_CREATING = "RayClusterCreating"
    RAY_CLUSTER_PROVISIONING = "RayClusterProvisioning"
    RAY_CLUSTER_READY = "RayClusterReady"
    RAY_CLUSTER_SUSPENDED = "RayClusterSuspended"
    WAITING_FOR_ADMISSION = "WaitingForAdmission"
    UNSCHEDULABLE = "Unschedulable"
    SCHEDULED = "Scheduled"
    RAY_JOB_NOT_SUBMITTED = "RayJobNotSubmitted"
    RAY_JOB_PENDING = "RayJobPending"
    RAY_JOB_RUNNING = "RayJobRunning"
    RAY_JOB_SUCCEEDED = "RayJobSucceeded"
    RAY_JOB_FAILED = "RayJobFailed"
    RAY_JOB_STOPPED = "RayJobStopped"
    WORKER_POD_LOST = "WorkerPodLost"
    RECOVERED = "Recovered"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    SUSPENDED_BY_USER = "SuspendedByUser"
    # The RayCluster was suspended by someone other than this RLJob's spec.suspend or, under
    # `gang: kueue`, Kueue (that reads as WaitingForAdmission): an admin, say. Not a failure: no restart
    # is counted, and the operator does not undo it.
    SUSPENDED_EXTERNALLY = "SuspendedExternally"
    RESUMED = "Resumed"
    # Preempted's: the head pod is being deleted while the Ray job ran
    HEAD_POD_DELETED = "HeadPodDeleted"
    # ... and a worker pod being deleted alone while it ran (maxRestarts 0): its hook has the iteration saved
    WORKER_POD_DELETED = "WorkerPodDeleted"
    # GracePeriodSufficient's: a stop fits in the grace period, or not
    STOP_FITS = "StopFits"
    STOP_TOO_SLOW = "StopTooSlow"
    # A child the round needs cannot be had: its name is taken by an object this RLJob does not
    # control, or the API server refused to create it (a ResourceQuota, RBAC, a too large object).
    NAME_CONFLICT = "NameConflict"
    CREATE_REFUSED = "CreateRefused"
    # The Ray head refused the token the operator derives for this RLJob: its Secret holds another
    # (made by someone else before the RLJob, or under an earlier token key).
    TOKEN_REFUSED = "TokenRefused"
    # The API server refused the status the round computed (422/413); a short status says why.
    STATUS_REJECTED = "StatusRejected"
    # The runtime refused the job's inputs before training (rldock.contract.failure): a configured
    # path is missing in the pods, or the config does not fit the model there. Not retried.
    PATH_NOT_FOUND = FailureReason.PATH_NOT_FOUND.value
    INVALID_JOB_INPUT = FailureReason.INVALID_JOB_INPUT.value
    # The runtime stopped the job on its budget (monitoring.mismatch, action stop). Not retried.
    ROLLOUT_MISMATCH = FailureReason.ROLLOUT_MISMATCH.value
    # RolloutMismatch's: the last iteration's mismatch/kl over spec.job.monitoring.mismatch.max_kl, or not
    OVER_BUDGET = "OverBudget"
    WITHIN_BUDGET = "WithinBudget"


class EventReason(str, Enum):
    """Reasons of the Kubernetes Events the handlers emit on an RLJob."""

    INVALID_SPEC = "InvalidSpec"
    POLICY_DENIED = "PolicyDenied"
    CREATED_NETWORK_POLICY = "CreatedNetworkPolicy"
    CREATED_ENVIRONMENT = "CreatedEnvironment"  # the Deployment, Service and NetworkPolicy of one entry
    DELETED_ENVIRONMENT = "DeletedEnvironment"  # an entry left spec.environments
    CREATED_AGENT = "CreatedAgent"  # the Deployment and NetworkPolicy of one spec.agents entry
    DELETED_AGENT = "DeletedAgent"  # an entry left spec.agents
    SUSPENDED_EXTERNALLY = "SuspendedExternally"
    CREATED_CONFIG_MAP = "CreatedConfigMap"
    CREATED_AUTH_SECRET = "CreatedAuthSecret"
    CREATED_ENVIRONMENT_TOKEN = "CreatedEnvironmentToken"  # the Secret of the environments' token
    CREATED_RAY_CLUSTER = "CreatedRayCluster"
    SCALED_ROLLOUT_POOL = "ScaledRolloutPool"  # its worker group's replicas follow spec.job.rollout.pool.replicas
    REPLACED_RAY_CLUSTER = "ReplacedRayCluster"
    RELEASED_RAY_CLUSTER = "ReleasedRayCluster"  # deleted when the job finished, failed or was suspended
    SUBMITTED_RAY_JOB = "SubmittedRayJob"
    STOPPED_RAY_JOB = "StoppedRayJob"
    UNSCHEDULABLE = "Unschedulable"
    RETRYING = "Retrying"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    SUCCEEDED = "Succeeded"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    PREEMPTED = "Preempted"
    GRACE_PERIOD_TOO_SHORT = "GracePeriodTooShort"
    TTL_EXPIRED = "TTLExpired"
    NAME_CONFLICT = "NameConflict"
    CREATE_REFUSED = "CreateRefused"
    TOKEN_REFUSED = "TokenRefused"
    STATUS_REJECTED = "StatusRejected"
    PATH_NOT_FOUND = FailureReason.PATH_NOT_FOUND.value
    INVALID_JOB_INPUT = FailureReason.INVALID_JOB_INPUT.value
    ROLLOUT_MISMATCH = FailureReason.ROLLOUT_MISMATCH.value  # over budget: warned, or the job stopped


class RayJobStatus(str, Enum):
    """Ray's own job states (ray.job_submission.JobStatus), mirrored so the operator needs no Ray."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
