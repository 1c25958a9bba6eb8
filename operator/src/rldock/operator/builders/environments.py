"""The children of one `spec.environments` entry, and the job config that points the runtime at them.

An environment (an OpenEnv server: `/health`, `/reset`, `/step`, `/ws`) runs code the job's author
may not have written, and, for the python sandbox, code the model wrote. So its pods get as little
as a pod can have, and what they get is bounded by the admin's policy (policy.py, `environments`).
An entry is a pod set (builders/pod_sets.py, which builds what environments and agents share):

- a **Deployment** of `replicas` pods, each one container of the entry's image serving on `port`,
  ready when `GET /health` answers there. The pods meet the `restricted` Pod Security Standard as the
  Ray pods do (the same security contexts, builders/ray_cluster.py), with a read-only root
  filesystem: `/tmp` is their only writable path, an emptyDir of `ephemeralStorage`, which is also the
  pod's ephemeral-storage request and limit. They run as the job's own **ServiceAccount** for
  environments (no token mounted, no RoleBinding names it), get no Service links, nothing of the Ray
  pods' volumes or env, and only the job's environment token (RLDOCK_ENV_TOKEN, builders/secret.py)
  that their server asks every client for. They carry the job's scheduler and queue (the Kueue
  queue label, Volcano's scheduler and queue annotation), so a queue counts them, and the reconciler
  scales them up only once the job is admitted (`replicas` here; reconcile/ sets 0 before);
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
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from rldock.config import JobConfig
from rldock.config.agent_environment import EnvironmentServersSpec
from rldock.operator import naming
from rldock.operator.api import Environment, PodDefaults, RLJobSpec
from rldock.operator.builders.agents import with_agent_pods
from rldock.operator.builders.common import RLJobRef
from rldock.operator.builders.pod_sets import (
    AGENTS,
    ENVIRONMENTS,
    base_container,
    build_deployment,
    child_meta,
    dns_egress,
    ray_pods,
)
from rldock.operator.builders.ray_cluster import environment_token_env
from rldock.operator.constants import (
    CLUSTER_DOMAIN,
    ENVIRONMENT_HEALTH_PATH,
    ENVIRONMENT_PORT_NAME,
)


class EnvironmentChildren(NamedTuple):
    """What one spec.environments entry becomes, in the order they are created: the pods are never
    up before the policy that guards them, nor unnamed. (The ServiceAccount they run as is the RLJob's,
    one for all entries and the agents', made before any: pod_sets.build_pod_service_account.)"""

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
    `agent.sandbox.servers`) replaced by the Service's `url` and the entry's `sessions_per_replica`; with
    spec.agents, `agent.harness_pods` set (builders/agents.py: with_agent_pods). `spec` must be free of
    validation problems (every service names an entry)."""
    job_config = with_agent_pods(spec.job) if spec.agents else spec.job
    agent = job_config.agent
    if agent is None:
        return job_config
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
        return job_config
    return job_config.model_copy(update={"agent": agent.model_copy(update=updates)})


def pod_selector(job: RLJobRef, environment: Environment) -> dict[str, str]:
    """The labels that pick one entry's pods (the Deployment's immutable selector, the Service's)."""
    return ENVIRONMENTS.pod_selector(job, environment.name)


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
        network_policy=build_environment_network_policy(
            job=job, environment=environment, egress=egress, agents=bool(spec.agents)
        ),
        service=build_environment_service(job=job, environment=environment),
        deployment=build_environment_deployment(job=job, spec=spec, environment=environment, defaults=defaults),
    )


def build_environment_deployment(
    *, job: RLJobRef, spec: RLJobSpec, environment: Environment, defaults: PodDefaults = PodDefaults()
) -> dict[str, Any]:
    """`replicas` server pods (builders/pod_sets.py), ready once the server answers its health check."""
    container = base_container(
        kind=ENVIRONMENTS, spec=spec, entry=environment, defaults=defaults, env=[environment_token_env(job)]
    )
    if environment.command is not None:
        container["command"] = list(environment.command)
    if environment.args is not None:
        container["args"] = list(environment.args)
    container["ports"] = [{"name": ENVIRONMENT_PORT_NAME, "containerPort": environment.port, "protocol": "TCP"}]
    # Ready (and so in the Service's DNS answer) once the server answers its health check; no liveness
    # probe: a server busy with long steps must not be restarted mid-episode, and one that exits is
    # restarted by the kubelet anyway.
    container["readinessProbe"] = {
        "httpGet": {"path": ENVIRONMENT_HEALTH_PATH, "port": ENVIRONMENT_PORT_NAME},
        "periodSeconds": 5,
        "timeoutSeconds": 2,
        "failureThreshold": 3,
    }
    return build_deployment(
        kind=ENVIRONMENTS, job=job, spec=spec, entry=environment, container=container, defaults=defaults
    )


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
        "metadata": child_meta(ENVIRONMENTS, job, environment.name, hashed=service_spec),
        "spec": service_spec,
    }


def build_environment_network_policy(
    *, job: RLJobRef, environment: Environment, egress: Sequence[Mapping[str, Any]] = (), agents: bool = False
) -> dict[str, Any]:
    """Ingress to the entry's pods on its port from the job's Ray pods (head and workers) only, and from
    its agents' pods where it has `agents` (spec.agents: a harness may use the job's environments);
    egress from them to the cluster's DNS and to `egress` (the admin's rules) only. Enforced where the
    cluster's network plugin enforces NetworkPolicies (docs/security.md)."""
    peers: list[dict[str, Any]] = [{"podSelector": ray_pods(job)}]
    if agents:
        peers.append({"podSelector": AGENTS.job_pods(job)})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_meta(ENVIRONMENTS, job, environment.name),
        "spec": {
            "podSelector": {"matchLabels": pod_selector(job, environment)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": environment.port}]}],
            "egress": [dns_egress(), *(copy.deepcopy(dict(rule)) for rule in egress)],
        },
    }
