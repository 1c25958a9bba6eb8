"""Operator settings from command-line flags, with environment variables as defaults.

    python -m rldock.operator [--namespace NS ...] [--poll-interval S] [--log-level LEVEL]
                              [--dashboard-address service-dns|service-ip|pod-ip]
                              [--default-image IMAGE] [--image-pull-policy P] [--default-device-resource R]

Every flag has an environment variable (RLDOCK_NAMESPACES=a,b, RLDOCK_POLL_INTERVAL,
RLDOCK_LOG_LEVEL, RLDOCK_DASHBOARD_ADDRESS, RLDOCK_RAY_TIMEOUT, RLDOCK_LIVENESS, RLDOCK_DEFAULT_IMAGE,
RLDOCK_IMAGE_PULL_POLICY, RLDOCK_DEFAULT_DEVICE_RESOURCE), which is what the chart's Deployment sets;
a flag wins over its variable. No namespace means cluster-wide (and a ClusterRole, builders/rbac.py).
The last three are the pod defaults (api.PodDefaults) of RLJobs that leave image or device resource unset.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Optional, Sequence

from rldock.operator.api import PodDefaults
from rldock.operator.constants import ImagePullPolicy
from rldock.operator.validation import device_resource_error

# Status may lag the runtime by at most 10 s (issue 3): one poll interval plus a round's own time.
MAX_POLL_INTERVAL = 5.0
MIN_POLL_INTERVAL = 0.2


class DashboardAddress(str, Enum):
    """How the operator reaches each cluster's Ray Jobs API (the head's dashboard)."""

    SERVICE_DNS = "service-dns"  # <cluster>-head-svc.<ns>.svc: the operator runs in the cluster
    SERVICE_IP = "service-ip"  # RayCluster .status.head.serviceIP: in-cluster, no DNS
    POD_IP = "pod-ip"  # .status.head.podIP: out-of-cluster development, test harnesses


@dataclass(frozen=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    poll_interval: float = MAX_POLL_INTERVAL  # seconds between reconcile rounds of one RLJob
    log_level: str = "INFO"
    dashboard_address: DashboardAddress = DashboardAddress.SERVICE_DNS
    ray_timeout: float = 5.0  # seconds for one Jobs API request
    liveness_endpoint: Optional[str] = None  # e.g. http://0.0.0.0:8080/healthz, for a livenessProbe
    pod_defaults: PodDefaults = PodDefaults()  # image, pull policy, device resource of the Ray pods

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    def __post_init__(self) -> None:
        if not MIN_POLL_INTERVAL <= self.poll_interval <= MAX_POLL_INTERVAL:
            raise ValueError(f"poll interval must be in [{MIN_POLL_INTERVAL}, {MAX_POLL_INTERVAL}] s "
                             f"(status must stay within 10 s of the job), got {self.poll_interval}")
        if self.ray_timeout <= 0:
            raise ValueError(f"ray timeout must be positive, got {self.ray_timeout}")
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(f"unknown log level {self.log_level!r}")
        # Checked here, once, because RLJobs that leave these unset are not checked against them.
        image = self.pod_defaults.image
        if not image or any(c.isspace() for c in image):
            raise ValueError(f"default image must be an image reference without spaces, got {image!r}")
        error = device_resource_error(self.pod_defaults.device_resource)
        if error:
            raise ValueError(f"default device resource: {error}")


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    # String defaults go through `type` too, so a bad variable is reported like a bad flag.
    parser = argparse.ArgumentParser(prog="python -m rldock.operator",
                                     description="The rldock operator: RLJob -> KubeRay RayCluster + Ray job.")
    namespaces = [n.strip() for n in env.get("RLDOCK_NAMESPACES", "").split(",") if n.strip()]
    parser.add_argument("-n", "--namespace", dest="namespaces", action="append", default=None,
                        help="watch this namespace (repeatable); none: cluster-wide [RLDOCK_NAMESPACES]")
    parser.add_argument("--poll-interval", type=float, default=env.get("RLDOCK_POLL_INTERVAL", str(MAX_POLL_INTERVAL)),
                        help=f"seconds between rounds per RLJob, at most {MAX_POLL_INTERVAL} [RLDOCK_POLL_INTERVAL]")
    parser.add_argument("--log-level", default=env.get("RLDOCK_LOG_LEVEL", "INFO"), help="[RLDOCK_LOG_LEVEL]")
    parser.add_argument("--dashboard-address", choices=[d.value for d in DashboardAddress],
                        default=env.get("RLDOCK_DASHBOARD_ADDRESS", DashboardAddress.SERVICE_DNS.value),
                        help="how to reach the Ray Jobs API [RLDOCK_DASHBOARD_ADDRESS]")
    parser.add_argument("--ray-timeout", type=float, default=env.get("RLDOCK_RAY_TIMEOUT", "5"),
                        help="seconds per Jobs API request [RLDOCK_RAY_TIMEOUT]")
    parser.add_argument("--liveness", dest="liveness_endpoint", default=env.get("RLDOCK_LIVENESS") or None,
                        help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz [RLDOCK_LIVENESS]")
    # An empty variable counts as unset, as a chart value rendered empty would be.
    defaults = PodDefaults()
    parser.add_argument("--default-image", default=env.get("RLDOCK_DEFAULT_IMAGE") or defaults.image,
                        help="runtime image of RLJobs without spec.image [RLDOCK_DEFAULT_IMAGE]")
    parser.add_argument("--image-pull-policy", choices=[p.value for p in ImagePullPolicy],
                        default=env.get("RLDOCK_IMAGE_PULL_POLICY") or defaults.image_pull_policy.value,
                        help="imagePullPolicy of every Ray pod [RLDOCK_IMAGE_PULL_POLICY]")
    parser.add_argument("--default-device-resource",
                        default=env.get("RLDOCK_DEFAULT_DEVICE_RESOURCE") or defaults.device_resource,
                        help="device plugin resource of RLJobs without spec.cluster.deviceResource "
                             "[RLDOCK_DEFAULT_DEVICE_RESOURCE]")
    parser.set_defaults(env_namespaces=namespaces)
    return parser


def load_settings(argv: Optional[Sequence[str]], env: Mapping[str, str]) -> OperatorSettings:
    """Settings from `argv` (without the program name) and `env`; SystemExit on bad flags."""
    parser = _parser(env)
    args = parser.parse_args(argv)
    try:
        return OperatorSettings(
            namespaces=tuple(dict.fromkeys(args.namespaces if args.namespaces else args.env_namespaces)),
            poll_interval=args.poll_interval,
            log_level=args.log_level.upper(),
            dashboard_address=DashboardAddress(args.dashboard_address),
            ray_timeout=args.ray_timeout,
            liveness_endpoint=args.liveness_endpoint,
            pod_defaults=PodDefaults(image=args.default_image,
                                     image_pull_policy=ImagePullPolicy(args.image_pull_policy),
                                     device_resource=args.default_device_resource),
        )
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits
