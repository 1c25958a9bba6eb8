"""Operator settings from command-line flags, with environment variables as defaults.

    python -m rldock.operator [--namespace NS ...] [--poll-interval S] [--log-level LEVEL]
                              [--dashboard-address service-dns|service-ip|pod-ip]
                              [--default-image IMAGE] [--image-pull-policy P] [--default-device-resource R]

Every flag has an environment variable (RLDOCK_NAMESPACES=a,b, RLDOCK_POLL_INTERVAL,
RLDOCK_LOG_LEVEL, RLDOCK_DASHBOARD_ADDRESS, RLDOCK_RAY_TIMEOUT, RLDOCK_LIVENESS, RLDOCK_DEFAULT_IMAGE,
RLDOCK_IMAGE_PULL_POLICY, RLDOCK_DEFAULT_DEVICE_RESOURCE, RLDOCK_NETWORK_POLICY), which is what the
chart's Deployment sets; a flag wins over its variable. No namespace means cluster-wide (and a
ClusterRole, builders/rbac.py). The image, pull policy and device resource are the pod defaults
(api.PodDefaults) of RLJobs that leave them unset.

Some settings come from the environment only: RLDOCK_TOKEN_KEY (a secret, never a flag, which `ps`
would show), RLDOCK_POLICY (the admin policy as JSON, policy.py) and where the operator's own pods
are (RLDOCK_OPERATOR_NAMESPACE or POD_NAMESPACE, RLDOCK_OPERATOR_POD_LABELS).

Replicas and health (docs/operator.md): --leader-election [RLDOCK_LEADER_ELECTION], --lease-name
[RLDOCK_LEASE_NAME], --lease-namespace [RLDOCK_LEASE_NAMESPACE, else POD_NAMESPACE], --identity
[POD_NAME], --lease-duration/--renew-deadline/--retry-period [RLDOCK_LEASE_DURATION,
RLDOCK_RENEW_DEADLINE, RLDOCK_RETRY_PERIOD] and --health-port [RLDOCK_HEALTH_PORT].

The admission webhook (admission.py, served by every replica): --webhook-port [RLDOCK_WEBHOOK_PORT]
with --webhook-cert-file and --webhook-key-file [RLDOCK_WEBHOOK_CERT_FILE, RLDOCK_WEBHOOK_KEY_FILE].
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from rldock.operator.api import PodDefaults
from rldock.operator.constants import ImagePullPolicy
from rldock.operator.leader import LeaseTimings
from rldock.operator.policy import AdminPolicy, parse_policy
from rldock.operator.validation import device_resource_error

# Status may lag the runtime by at most 10 s (issue 3): one poll interval plus a round's own time.
MAX_POLL_INTERVAL = 5.0
MIN_POLL_INTERVAL = 0.2
# The job tokens are HMAC-SHA256 values under this key: at least as many bytes as the digest.
MIN_TOKEN_KEY_BYTES = 32


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
    liveness_endpoint: str | None = None  # e.g. http://0.0.0.0:8080/healthz, for a livenessProbe
    pod_defaults: PodDefaults = PodDefaults()  # image, pull policy, device resource of the Ray pods
    policy: AdminPolicy = AdminPolicy()  # what RLJobs may ask beyond the secure default (policy.py)
    # The key each RLJob's Ray token is derived from (tokens.py): the operator never reads a token
    # back from the Secret it creates. RLDOCK_TOKEN_KEY; required to reconcile.
    token_key: bytes | None = field(default=None, repr=False)
    # Each RLJob gets a NetworkPolicy (builders/network_policy.py) unless the cluster's network
    # plugin enforces none (chart value networkPolicy.enabled).
    network_policy: bool = True
    # Where the operator's own pods are, for the NetworkPolicy rule that lets them reach the Jobs
    # API: their namespace (RLDOCK_OPERATOR_NAMESPACE, else POD_NAMESPACE) and pod labels
    # (RLDOCK_OPERATOR_POD_LABELS=k=v,k=v). Unset (an operator outside the cluster): no such rule.
    operator_namespace: str | None = None
    operator_pod_labels: tuple[tuple[str, str], ...] = ()
    # Leader election (leader.py): each replica competes for the Lease `lease_name` in
    # `lease_namespace` (RLDOCK_LEASE_NAMESPACE, else POD_NAMESPACE) as `identity` (POD_NAME); only
    # the holder runs kopf. Off: this process reconciles at once, so run one replica.
    leader_election: bool = False
    lease_name: str = "rldock-operator"
    lease_namespace: str | None = None
    identity: str | None = None
    lease: LeaseTimings = LeaseTimings()
    # Port of the operator's own /metrics, /healthz and /readyz (metrics.HealthServer), served by
    # every replica, standby included; None: not served.
    health_port: int | None = None
    # Port of the RLJob admission webhook (admission.WebhookServer, HTTPS with this certificate and
    # key), served by every replica; None: not served.
    webhook_port: int | None = None
    webhook_cert_file: str | None = None
    webhook_key_file: str | None = None

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    def __post_init__(self) -> None:
        if not MIN_POLL_INTERVAL <= self.poll_interval <= MAX_POLL_INTERVAL:
            raise ValueError(
                f"poll interval must be in [{MIN_POLL_INTERVAL}, {MAX_POLL_INTERVAL}] s "
                f"(status must stay within 10 s of the job), got {self.poll_interval}"
            )
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
        if self.leader_election and not (self.lease_namespace and self.identity and self.lease_name):
            raise ValueError(
                "leader election needs a lease name, its namespace (--lease-namespace or POD_NAMESPACE) "
                "and an identity (--identity or POD_NAME)"
            )
        if self.health_port is not None and not 1 <= self.health_port <= 65535:
            raise ValueError(f"health port must be in [1, 65535], got {self.health_port}")
        if self.webhook_port is not None and not (
            1 <= self.webhook_port <= 65535 and self.webhook_cert_file and self.webhook_key_file
        ):
            raise ValueError(
                "the webhook port must be in [1, 65535] and needs a certificate and key file "
                "(--webhook-cert-file, --webhook-key-file)"
            )
        if self.token_key is not None and len(self.token_key) < MIN_TOKEN_KEY_BYTES:
            raise ValueError(
                f"RLDOCK_TOKEN_KEY must hold at least {MIN_TOKEN_KEY_BYTES} bytes, got {len(self.token_key)}"
            )


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    # String defaults go through `type` too, so a bad variable is reported like a bad flag.
    parser = argparse.ArgumentParser(
        prog="python -m rldock.operator", description="The rldock operator: RLJob -> KubeRay RayCluster + Ray job."
    )
    namespaces = [n.strip() for n in env.get("RLDOCK_NAMESPACES", "").split(",") if n.strip()]
    parser.add_argument(
        "-n",
        "--namespace",
        dest="namespaces",
        action="append",
        default=None,
        help="watch this namespace (repeatable); none: cluster-wide [RLDOCK_NAMESPACES]",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=env.get("RLDOCK_POLL_INTERVAL", str(MAX_POLL_INTERVAL)),
        help=f"seconds between rounds per RLJob, at most {MAX_POLL_INTERVAL} [RLDOCK_POLL_INTERVAL]",
    )
    parser.add_argument("--log-level", default=env.get("RLDOCK_LOG_LEVEL", "INFO"), help="[RLDOCK_LOG_LEVEL]")
    parser.add_argument(
        "--dashboard-address",
        choices=[d.value for d in DashboardAddress],
        default=env.get("RLDOCK_DASHBOARD_ADDRESS", DashboardAddress.SERVICE_DNS.value),
        help="how to reach the Ray Jobs API [RLDOCK_DASHBOARD_ADDRESS]",
    )
    parser.add_argument(
        "--ray-timeout",
        type=float,
        default=env.get("RLDOCK_RAY_TIMEOUT", "5"),
        help="seconds per Jobs API request [RLDOCK_RAY_TIMEOUT]",
    )
    parser.add_argument(
        "--liveness",
        dest="liveness_endpoint",
        default=env.get("RLDOCK_LIVENESS") or None,
        help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz [RLDOCK_LIVENESS]",
    )
    # An empty variable counts as unset, as a chart value rendered empty would be.
    defaults = PodDefaults()
    parser.add_argument(
        "--default-image",
        default=env.get("RLDOCK_DEFAULT_IMAGE") or defaults.image,
        help="runtime image of RLJobs without spec.image [RLDOCK_DEFAULT_IMAGE]",
    )
    parser.add_argument(
        "--image-pull-policy",
        choices=[p.value for p in ImagePullPolicy],
        default=env.get("RLDOCK_IMAGE_PULL_POLICY") or defaults.image_pull_policy.value,
        help="imagePullPolicy of every Ray pod [RLDOCK_IMAGE_PULL_POLICY]",
    )
    parser.add_argument(
        "--default-device-resource",
        default=env.get("RLDOCK_DEFAULT_DEVICE_RESOURCE") or defaults.device_resource,
        help="device plugin resource of RLJobs without spec.cluster.deviceResource [RLDOCK_DEFAULT_DEVICE_RESOURCE]",
    )
    parser.add_argument(
        "--network-policy",
        action=argparse.BooleanOptionalAction,
        default=env.get("RLDOCK_NETWORK_POLICY", "true").lower() not in ("false", "0", "no", "off"),
        help="give each RLJob a NetworkPolicy [RLDOCK_NETWORK_POLICY]",
    )
    _leader_election_arguments(parser, env)
    parser.add_argument(
        "--webhook-port",
        type=int,
        default=env.get("RLDOCK_WEBHOOK_PORT") or None,
        help="serve the RLJob admission webhook over HTTPS on this port [RLDOCK_WEBHOOK_PORT]",
    )
    parser.add_argument(
        "--webhook-cert-file",
        default=env.get("RLDOCK_WEBHOOK_CERT_FILE") or None,
        help="the webhook's certificate, PEM [RLDOCK_WEBHOOK_CERT_FILE]",
    )
    parser.add_argument(
        "--webhook-key-file",
        default=env.get("RLDOCK_WEBHOOK_KEY_FILE") or None,
        help="the webhook's private key, PEM [RLDOCK_WEBHOOK_KEY_FILE]",
    )
    parser.set_defaults(env_namespaces=namespaces)
    return parser


def _leader_election_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    timings = LeaseTimings()
    parser.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=env.get("RLDOCK_LEADER_ELECTION", "false").lower() in ("true", "1", "yes", "on"),
        help="run only while holding the Lease, so several replicas can run [RLDOCK_LEADER_ELECTION]",
    )
    parser.add_argument(
        "--lease-name", default=env.get("RLDOCK_LEASE_NAME") or "rldock-operator", help="[RLDOCK_LEASE_NAME]"
    )
    parser.add_argument(
        "--lease-namespace",
        default=env.get("RLDOCK_LEASE_NAMESPACE") or env.get("POD_NAMESPACE"),
        help="the operator's own namespace [RLDOCK_LEASE_NAMESPACE, else POD_NAMESPACE]",
    )
    parser.add_argument(
        "--identity",
        default=env.get("POD_NAME"),
        help="this replica's name in the Lease [POD_NAME; else host name and pid]",
    )
    parser.add_argument(
        "--lease-duration",
        type=float,
        default=env.get("RLDOCK_LEASE_DURATION", str(timings.lease_duration)),
        help="seconds a standby waits for an unrenewed Lease [RLDOCK_LEASE_DURATION]",
    )
    parser.add_argument(
        "--renew-deadline",
        type=float,
        default=env.get("RLDOCK_RENEW_DEADLINE", str(timings.renew_deadline)),
        help="seconds the leader tries to renew before it exits [RLDOCK_RENEW_DEADLINE]",
    )
    parser.add_argument(
        "--retry-period",
        type=float,
        default=env.get("RLDOCK_RETRY_PERIOD", str(timings.retry_period)),
        help="seconds between Lease reads and renewals [RLDOCK_RETRY_PERIOD]",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=env.get("RLDOCK_HEALTH_PORT") or None,
        help="serve /metrics, /healthz and /readyz on this port [RLDOCK_HEALTH_PORT]",
    )


def load_settings(argv: Sequence[str] | None, env: Mapping[str, str]) -> OperatorSettings:
    """Settings from `argv` (without the program name) and `env`; SystemExit on bad flags."""
    parser = _parser(env)
    args = parser.parse_args(argv)
    token_key = env.get("RLDOCK_TOKEN_KEY", "")
    if not token_key:
        parser.error(
            "RLDOCK_TOKEN_KEY is not set: the key every RLJob's Ray token is derived from. The chart "
            "sets it from its Secret; for an operator of your own export one that stays the same across "
            "restarts, e.g. RLDOCK_TOKEN_KEY=$(openssl rand -hex 32)"
        )
    try:
        policy = parse_policy(env.get("RLDOCK_POLICY", ""))
        return OperatorSettings(
            namespaces=tuple(dict.fromkeys(args.namespaces if args.namespaces else args.env_namespaces)),
            poll_interval=args.poll_interval,
            log_level=args.log_level.upper(),
            dashboard_address=DashboardAddress(args.dashboard_address),
            ray_timeout=args.ray_timeout,
            liveness_endpoint=args.liveness_endpoint,
            pod_defaults=_pod_defaults(args, policy),
            policy=policy,
            token_key=token_key.encode(),
            network_policy=args.network_policy,
            operator_namespace=env.get("RLDOCK_OPERATOR_NAMESPACE") or env.get("POD_NAMESPACE") or None,
            operator_pod_labels=_labels(env.get("RLDOCK_OPERATOR_POD_LABELS", "")),
            leader_election=args.leader_election,
            lease_name=args.lease_name,
            lease_namespace=args.lease_namespace or None,
            identity=args.identity or (f"{socket.gethostname()}-{os.getpid()}" if args.leader_election else None),
            lease=LeaseTimings(
                lease_duration=args.lease_duration, renew_deadline=args.renew_deadline, retry_period=args.retry_period
            ),
            health_port=args.health_port,
            webhook_port=args.webhook_port,
            webhook_cert_file=args.webhook_cert_file,
            webhook_key_file=args.webhook_key_file,
        )
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits


def _pod_defaults(args: argparse.Namespace, policy: AdminPolicy) -> PodDefaults:
    additions = policy.pod_defaults
    return PodDefaults(
        image=args.default_image,
        image_pull_policy=ImagePullPolicy(args.image_pull_policy),
        device_resource=args.default_device_resource,
        labels=dict(additions.labels),
        annotations=dict(additions.annotations),
        priority_class_name=additions.priority_class_name,
        image_pull_secrets=tuple(additions.image_pull_secrets),
    )


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    """`k=v,k=v` as pairs; ValueError naming the variable on anything else."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise ValueError(f"RLDOCK_OPERATOR_POD_LABELS: {item!r} is not key=value")
        pairs.append((key, value))
    return tuple(pairs)
