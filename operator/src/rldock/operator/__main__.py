"""`python -m rldock.operator`: run the operator (settings.py lists the flags and variables)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional, Sequence

import kopf
from kubernetes import client, config

from rldock.operator.constants import CRD_NAME, GROUP, VERSION
from rldock.operator.handlers import configure_kopf, register
from rldock.operator.kube import Kube
from rldock.operator.reconcile import Reconciler
from rldock.operator.settings import load_settings

log = logging.getLogger("rldock.operator")


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
        raise SystemExit(f"the {CRD_NAME} CustomResourceDefinition ({GROUP}/{VERSION}) is not installed; "
                         "apply crds/ first")


def main(argv: Optional[Sequence[str]] = None) -> int:
    settings = load_settings(argv, os.environ)
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.log_level != "DEBUG":  # kopf logs every round of every timer at INFO
        logging.getLogger("kopf").setLevel(logging.WARNING)
    api = _api_client()
    _require_crd(api)
    reconciler = Reconciler(Kube(api), settings)
    defaults = settings.pod_defaults
    log.info("watching %s; poll interval %.1f s; Jobs API via %s; RLJobs without their own get image %s "
             "(pull policy %s) and device resource %s",
             ", ".join(settings.namespaces) or "all namespaces", settings.poll_interval,
             settings.dashboard_address.value, defaults.image, defaults.image_pull_policy.value,
             defaults.device_resource)
    kopf.run(
        registry=register(kopf.OperatorRegistry(), settings),
        settings=configure_kopf(kopf.OperatorSettings(), settings),
        standalone=True,  # no peering objects (nor RBAC for them); run one replica
        clusterwide=settings.clusterwide,
        namespaces=settings.namespaces,
        memo=kopf.Memo(reconciler=reconciler),
        liveness_endpoint=settings.liveness_endpoint,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
