"""`python -m rldock.operator`: run the operator (settings.py lists the flags and variables).

Start-up: settings; the health and metrics server, the API client and the admission webhook
(admission.py, asking the API server about the objects an RLJob names through access_review.py;
both servers in every replica, standby included); the RLJob CRD check; with leader election, wait for the Lease
(leader.py) and keep renewing it in a thread; then kopf, until SIGTERM. A leader that cannot renew
exits at once (exit code 3) and the kubelet restarts it as a standby; after kopf stops, the Lease is
released so a standby takes over at once.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Sequence

import kopf
from kubernetes import client, config

from rldock.operator.access_review import AccessReviewer
from rldock.operator.admission import WebhookServer, review
from rldock.operator.constants import CRD_NAME, GROUP, VERSION
from rldock.operator.handlers import configure_kopf, register
from rldock.operator.kube import Kube
from rldock.operator.leader import LeaderElector, LeaseApi
from rldock.operator.metrics import HealthServer, Metrics
from rldock.operator.reconcile import Reconciler
from rldock.operator.settings import OperatorSettings, load_settings

log = logging.getLogger("rldock.operator")

EXIT_LEASE_LOST = 3


def _api_client() -> client.ApiClient:
    """In a pod: its service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _require_crd(api: client.ApiClient) -> None:
    """Fail fast (the Deployment restarts us) while the RLJob CRD is not served: kopf, which does
    not watch CRDs here, would otherwise serve nothing."""
    groups = client.ApisApi(api).get_api_versions().groups  # discovery: open to every user
    if not any(g.name == GROUP and any(v.version == VERSION for v in g.versions) for g in groups):
        raise SystemExit(
            f"the {CRD_NAME} CustomResourceDefinition ({GROUP}/{VERSION}) is not installed; apply crds/ first"
        )


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(argv, os.environ)
    logging.basicConfig(
        level=settings.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if settings.log_level != "DEBUG":  # kopf logs every event and daemon step at INFO
        logging.getLogger("kopf").setLevel(logging.WARNING)
    metrics = Metrics()
    if settings.health_port is not None:
        HealthServer(metrics, port=settings.health_port).start()
    api = _api_client()
    if settings.webhook_port is not None:  # every replica: the webhook's Service picks any ready one
        assert settings.webhook_cert_file and settings.webhook_key_file, "checked by OperatorSettings"
        WebhookServer(
            functools.partial(review, settings=settings, access=AccessReviewer(api)),
            port=settings.webhook_port,
            cert_file=settings.webhook_cert_file,
            key_file=settings.webhook_key_file,
        ).start()
    _require_crd(api)
    elector = _lead(api, settings, metrics)
    reconciler = Reconciler(Kube(api), settings, metrics=metrics)
    defaults = settings.pod_defaults
    log.info(
        "watching %s; poll interval %.1f s; Jobs API via %s; RLJobs without their own get image %s "
        "(pull policy %s) and device resource %s",
        ", ".join(settings.namespaces) or "all namespaces",
        settings.poll_interval,
        settings.dashboard_address.value,
        defaults.image,
        defaults.image_pull_policy.value,
        defaults.device_resource,
    )
    try:
        kopf.run(
            registry=register(kopf.OperatorRegistry(), settings),
            settings=configure_kopf(kopf.OperatorSettings(), settings),
            # No kopf peering (its objects need RBAC of their own): replicas are kept apart by the
            # Lease, and only the holder gets here.
            standalone=True,
            clusterwide=settings.clusterwide,
            namespaces=settings.namespaces,
            memo=kopf.Memo(reconciler=reconciler),
            liveness_endpoint=settings.liveness_endpoint,
        )
    finally:
        if elector is not None:
            elector.release()  # kopf has stopped: a standby may reconcile now
    return 0


def _lead(api: client.ApiClient, settings: OperatorSettings, metrics: Metrics) -> LeaderElector | None:
    """Without leader election, None at once; with it, block until this replica holds the Lease
    and keep renewing it; losing it ends the process."""
    if not settings.leader_election:
        metrics.set_leader(True)
        return None
    assert settings.lease_namespace and settings.identity, "checked by OperatorSettings"
    elector = LeaderElector(
        LeaseApi(api),
        namespace=settings.lease_namespace,
        name=settings.lease_name,
        identity=settings.identity,
        timings=settings.lease,
        on_change=metrics.set_leader,
    )
    elector.acquire()
    elector.keep_leading(on_lost=_lost)
    return elector


def _lost() -> None:
    """Stop reconciling at once: another replica may hold the Lease already (kube-controller-manager
    does the same). No clean-up runs; the kubelet starts this container again as a standby."""
    log.critical("lost the leader Lease: exiting so that only the new leader reconciles")
    sys.stderr.flush()
    os._exit(EXIT_LEASE_LOST)


if __name__ == "__main__":
    sys.exit(main())
