"""Pure builders: an RLJob (its identity and parsed spec) in, Kubernetes manifests out.

No I/O, clock or environment: the handlers apply what these return, and the unit tests check it
against Kubernetes' and KubeRay's own schemas.
"""

from rldock.operator.builders.agents import (
    AgentChildren,
    build_agent,
    build_agent_runner_config_map,
    build_gateway_service,
)
from rldock.operator.builders.common import RLJobRef, child_labels, owner_reference
from rldock.operator.builders.config_map import build_config_map, render_job_config
from rldock.operator.builders.environments import (
    EnvironmentChildren,
    build_environment,
    runtime_job_config,
    service_url,
)
from rldock.operator.builders.network_policy import build_network_policy
from rldock.operator.builders.pod_sets import build_pod_service_account
from rldock.operator.builders.ray_cluster import build_ray_cluster, device_resource
from rldock.operator.builders.ray_job import build_entrypoint, build_job_submission, output_dir
from rldock.operator.builders.rbac import build_rbac
from rldock.operator.builders.secret import build_auth_secret, build_environment_token_secret

__all__ = [
    "AgentChildren",
    "EnvironmentChildren",
    "RLJobRef",
    "build_agent",
    "build_agent_runner_config_map",
    "build_auth_secret",
    "build_config_map",
    "build_entrypoint",
    "build_environment",
    "build_environment_token_secret",
    "build_job_submission",
    "build_gateway_service",
    "build_network_policy",
    "build_pod_service_account",
    "build_ray_cluster",
    "device_resource",
    "build_rbac",
    "child_labels",
    "owner_reference",
    "output_dir",
    "render_job_config",
    "runtime_job_config",
    "service_url",
]
