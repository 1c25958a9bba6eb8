"""ServiceDNS: cluster DNS and Service routing for the pods of the kind-style nodes, in one TEST
DOUBLE, because neither CoreDNS nor kube-proxy runs here (CoreDNS is a Go program with no image
we can build; kube-proxy would build, but its ClusterIPs would also need the DNS).

Every node's kubelet writes `nameserver <node network's gateway>` into its pods' resolv.conf
(`clusterDNS`, nodes/node-entrypoint.sh), with the ClusterFirst search path. On that address
this serves the cluster DNS double (doubles/cluster_dns.py), fed every `interval` seconds from
the real Endpoints objects that the real endpoints controller keeps from the real pods' readiness:
`<service>.<namespace>.svc.cluster.local` answers the first ready address behind the Service, so
a client connects straight to the pod on the Service's port (KubeRay's head Service maps each port
to the same port on the pod, so nothing is lost by skipping the ClusterIP), and a headless
Service's name (`clusterIP: None`, read from the Services) every ready address, as CoreDNS does.
The only Service this cannot serve is one whose port differs from its targetPort; the kind
scenarios use none.

The node network is created without podman's own DNS (NodeNetwork.create), so the port is free.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from typing import Any

from kubernetes import client

from rldock_e2e.doubles._poller import Poller
from rldock_e2e.doubles.cluster_dns import ClusterDNS

log = logging.getLogger(__name__)


def ready_addresses(
    endpoints: list[dict[str, Any]], headless: Collection[tuple[str, str]] = ()
) -> dict[tuple[str, str], str | tuple[str, ...]]:
    """(namespace, service) -> the first ready pod IP, or every one for the `headless` Services,
    from a list of Endpoints objects (which list only ready addresses under `addresses`)."""
    addresses: dict[tuple[str, str], str | tuple[str, ...]] = {}
    for item in endpoints:
        ips = [address["ip"] for subset in item.get("subsets") or () for address in subset.get("addresses") or ()]
        key = (item["metadata"]["namespace"], item["metadata"]["name"])
        if ips:
            addresses[key] = tuple(ips) if key in headless else ips[0]
    return addresses


def headless_services(services: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(namespace, name) of the Services with `clusterIP: None`."""
    return {
        (item["metadata"]["namespace"], item["metadata"]["name"])
        for item in services
        if (item.get("spec") or {}).get("clusterIP") == "None"
    }


class ServiceDNS:
    """The cluster DNS double on `address`:53, answering from the Endpoints of every namespace."""

    def __init__(self, api_client: client.ApiClient, *, address: str, interval: float = 0.5) -> None:
        self.core = client.CoreV1Api(api_client)
        self.dns = ClusterDNS(address)
        self._poller = Poller("service-dns-double", self.refresh, interval=interval)

    @property
    def errors(self) -> list[BaseException]:
        return self._poller.errors

    def refresh(self) -> None:
        endpoints = json.loads(self.core.list_endpoints_for_all_namespaces(_preload_content=False).data)["items"]
        services = json.loads(self.core.list_service_for_all_namespaces(_preload_content=False).data)["items"]
        self.dns.set_services(ready_addresses(endpoints, headless_services(services)))

    def __enter__(self) -> ServiceDNS:
        self.refresh()
        self.dns.start()
        self._poller.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._poller.stop()
        self.dns.stop()
