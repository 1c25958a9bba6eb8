"""The children of one `spec.agents` entry, and the two children all the job's agents share.

An agent pod runs the user's harness (docs/agentic.md, Agents as pods), code the platform did not
write and that a model steers. It is a pod set (builders/pod_sets.py: restricted pods, no token, read-only
root, the job's queue), and what sets it apart is where it may connect:

- a **NetworkPolicy** per entry: no ingress at all; egress to the cluster's DNS, to the job's Ray pods
  on the gateway port only (`rldock.contract.agent_pods.GATEWAY_PORT`: the OpenAI-compatible sessions and
  the episode dispatcher), to the job's environment pods on their ports (a harness may use them), and to
  what the admin lists (`policy.agents.egress`); the Ray pods' policy admits the agents on that one port
  (builders/network_policy.py), the environments' on theirs (builders/environments.py);
- a **Deployment** per entry: `replicas` pods, each running the runner (`rldock.contract.agent_runner`,
  mounted read-only from the job's runner ConfigMap) with the entry's `command` after `--`, the gateway's
  `host:port` in `RLDOCK_GATEWAY` and the job's pod token in `RLDOCK_ENV_TOKEN`;
- per RLJob, the **runner ConfigMap** (`<rljob>-agent-runner-<16 hex>`) and the **gateway Service**
  (`<rljob>-gateway-<16 hex>`), headless over the job's Ray pods on the gateway port, so the runner finds
  every Ray pod by one name.

All are owned by the RLJob, so they go with it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any, NamedTuple

from rldock.config import JobConfig
from rldock.config.agent import AgentSpec
from rldock.contract.agent_pods import GATEWAY_ENV, GATEWAY_PORT
from rldock.operator import naming
from rldock.operator.api import Agent, PodDefaults, RLJobSpec
from rldock.operator.builders.common import RLJobRef, child_metadata
from rldock.operator.builders.pod_sets import (
    AGENTS,
    ENVIRONMENTS,
    base_container,
    build_deployment,
    child_meta,
    dns_egress,
    ray_pods,
    spec_hash,
)
from rldock.operator.builders.ray_cluster import environment_token_env
from rldock.operator.constants import (
    AGENT_RUNNER_FILE,
    AGENT_RUNNER_MOUNT_PATH,
    ANNOTATION_SPEC_HASH,
    CLUSTER_DOMAIN,
    GATEWAY_PORT_NAME,
    LABEL_RLJOB,
    VOLUME_AGENT_RUNNER,
)

# The runner's source, as the operator's package has it: what every agent pod runs.
RUNNER_SOURCE = resources.files("rldock.contract").joinpath(AGENT_RUNNER_FILE).read_text()


class AgentChildren(NamedTuple):
    """What one spec.agents entry becomes, in the order they are created: the pods are never up before
    the policy that guards them. (The ServiceAccount, runner ConfigMap and gateway Service are the
    RLJob's, one for all entries, made before any.)"""

    network_policy: dict[str, Any]
    deployment: dict[str, Any]


def with_agent_pods(job_config: JobConfig) -> JobConfig:
    """`job_config` whose episodes the agent pods run (`agent.harness_pods`; an agent section made where it has
    none): what the runtime reads and what the spec is checked as."""
    agent = job_config.agent or AgentSpec()
    return job_config.model_copy(update={"agent": agent.model_copy(update={"harness_pods": True})})


def gateway_address(job: RLJobRef) -> str:
    """`host:port` of the gateway Service, what the runner reads from `RLDOCK_GATEWAY`."""
    return f"{naming.gateway_service_name(job.name)}.{job.namespace}.svc.{CLUSTER_DOMAIN}:{GATEWAY_PORT}"


def build_agent(
    *,
    job: RLJobRef,
    spec: RLJobSpec,
    agent: Agent,
    defaults: PodDefaults = PodDefaults(),
    egress: Sequence[Mapping[str, Any]] = (),
) -> AgentChildren:
    """The NetworkPolicy and Deployment of `agent`, an entry of `spec.agents`; `egress`: the admin's
    egress rules (policy.agents.egress)."""
    return AgentChildren(
        network_policy=build_agent_network_policy(job=job, spec=spec, agent=agent, egress=egress),
        deployment=build_agent_deployment(job=job, spec=spec, agent=agent, defaults=defaults),
    )


def build_agent_deployment(
    *, job: RLJobRef, spec: RLJobSpec, agent: Agent, defaults: PodDefaults = PodDefaults()
) -> dict[str, Any]:
    """`replicas` runner pods. No readiness probe: a runner serves nothing; it is ready once running."""
    container = base_container(
        kind=AGENTS,
        spec=spec,
        entry=agent,
        defaults=defaults,
        env=[{"name": GATEWAY_ENV, "value": gateway_address(job)}, environment_token_env(job)],
    )
    container["command"] = ["python3", f"{AGENT_RUNNER_MOUNT_PATH}/{AGENT_RUNNER_FILE}"]
    container["args"] = ["--episodes", str(agent.episodes_per_replica), "--", *agent.command]
    container["volumeMounts"].append(
        {"name": VOLUME_AGENT_RUNNER, "mountPath": AGENT_RUNNER_MOUNT_PATH, "readOnly": True}
    )
    runner = {"name": VOLUME_AGENT_RUNNER, "configMap": {"name": naming.agent_runner_config_map_name(job.name)}}
    return build_deployment(
        kind=AGENTS, job=job, spec=spec, entry=agent, container=container, volumes=[runner], defaults=defaults
    )


def build_agent_network_policy(
    *, job: RLJobRef, spec: RLJobSpec, agent: Agent, egress: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """No ingress; egress to DNS, the job's gateway port on its Ray pods, its environments' ports, and
    `egress` (the admin's rules). Enforced where the cluster's network plugin enforces NetworkPolicies."""
    rules: list[dict[str, Any]] = [
        dns_egress(),
        {"to": [{"podSelector": ray_pods(job)}], "ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]},
    ]
    ports = sorted({environment.port for environment in spec.environments})
    if ports:
        rules.append(
            {
                "to": [{"podSelector": ENVIRONMENTS.job_pods(job)}],
                "ports": [{"protocol": "TCP", "port": port} for port in ports],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_meta(AGENTS, job, agent.name),
        "spec": {
            "podSelector": {"matchLabels": AGENTS.pod_selector(job, agent.name)},
            # Ingress listed with no rule admits nothing; no empty `ingress` list, which the API server drops
            # (a stored policy must compare equal to the built one: network_policy_patch).
            "policyTypes": ["Ingress", "Egress"],
            "egress": [*rules, *(copy.deepcopy(dict(rule)) for rule in egress)],
        },
    }


def build_agent_runner_config_map(*, job: RLJobRef) -> dict[str, Any]:
    """The runner's source, mounted read-only into every agent pod of the job."""
    data = {AGENT_RUNNER_FILE: RUNNER_SOURCE}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(
            job, naming.agent_runner_config_map_name(job.name), annotations={ANNOTATION_SPEC_HASH: spec_hash(data)}
        ),
        "data": data,
    }


def build_gateway_service(*, job: RLJobRef) -> dict[str, Any]:
    """Headless over the job's Ray pods on the gateway port: the name resolves to every ready Ray pod."""
    service_spec = {
        "clusterIP": "None",
        "selector": {LABEL_RLJOB: naming.label_value(job.name)},
        "ports": [{"name": GATEWAY_PORT_NAME, "port": GATEWAY_PORT, "targetPort": GATEWAY_PORT, "protocol": "TCP"}],
        "publishNotReadyAddresses": False,
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(
            job, naming.gateway_service_name(job.name), annotations={ANNOTATION_SPEC_HASH: spec_hash(service_spec)}
        ),
        "spec": service_spec,
    }


def config_map_patch(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any] | None:
    """A runner edited by hand (or of an older operator) is put back."""
    return {"data": dict(desired["data"])} if existing.get("data") != desired["data"] else None
