"""The cluster DNS double's headless Services, without a control plane: a headless Service's name
answers every ready pod's address (one A record each), from the node agent's pods and from the
Endpoints the kind nodes' ServiceDNS reads, and a client resolving the name over UDP sees them all
(what the runtime's environment client does with `servers.url` of an RLJob's environment)."""

from __future__ import annotations

import socket
import struct
from typing import Any

import pytest

from rldock_e2e.controlplane.processes import free_ports
from rldock_e2e.doubles.cluster_dns import ClusterDNS
from rldock_e2e.doubles.node_agent import service_addresses
from rldock_e2e.nodes.service_dns import headless_services, ready_addresses

NAME = "demo-env-cabinet.team-a.svc.cluster.local"


def _query(name: str, qtype: int = 1) -> bytes:
    question = b"".join(bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + question + struct.pack("!HH", qtype, 1)


def _addresses(reply: bytes, name: str) -> tuple[int, list[str]]:
    """The rcode and A addresses of a reply to _query(name), parsed as a resolver would."""
    _, flags, _, count = struct.unpack("!HHHH", reply[:8])
    offset = 12 + len(_query(name)) - 12  # the question, echoed
    addresses = []
    for _ in range(count):
        pointer, rtype, rclass, _, length = struct.unpack("!HHHIH", reply[offset : offset + 12])
        assert (pointer, rtype, rclass, length) == (0xC00C, 1, 1, 4)
        addresses.append(socket.inet_ntoa(reply[offset + 12 : offset + 16]))
        offset += 16
    assert offset == len(reply) and len(reply) <= 512
    return flags & 0xF, addresses


@pytest.mark.parametrize(
    "published, rcode, answered",
    [
        (
            {("team-a", "demo-env-cabinet"): ("10.244.1.2", "10.244.1.3", "10.244.2.4")},
            0,
            ["10.244.1.2", "10.244.1.3", "10.244.2.4"],
        ),
        ({("team-a", "demo-env-cabinet"): "10.244.1.2"}, 0, ["10.244.1.2"]),  # a ClusterIP Service: one
        ({("team-a", "demo-env-cabinet"): ()}, 3, []),  # headless with no ready pod: no name
        ({("team-a", "demo-env-cabinet"): tuple(f"10.0.{i // 250}.{i % 250 + 1}" for i in range(100))}, 0, 28),
    ],
    ids=["headless", "cluster-ip", "none-ready", "more-than-a-udp-message-holds"],
)
def test_a_headless_name_answers_one_a_record_per_ready_pod(published, rcode, answered):
    dns = ClusterDNS("127.0.0.1")
    dns.set_services(published)
    got_rcode, addresses = _addresses(dns.answer(_query(NAME)), NAME)
    assert got_rcode == rcode
    if isinstance(answered, int):  # as many as fit 512 bytes, without the truncation bit
        assert len(addresses) == answered and addresses == list(published[("team-a", "demo-env-cabinet")])[:answered]
    else:
        assert addresses == answered
    _, flags, _, count = struct.unpack("!HHHH", dns.answer(_query(NAME, qtype=28))[:8])
    assert count == 0  # AAAA: none


def test_a_client_resolving_over_udp_gets_every_address():
    (port,) = free_ports(1)
    dns = ClusterDNS("127.0.0.1", port=port)
    dns.set_services({("team-a", "demo-env-cabinet"): ("10.244.1.2", "10.244.1.3")})
    dns.start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.settimeout(5)
            client.sendto(_query(NAME), ("127.0.0.1", port))
            reply, _ = client.recvfrom(512)
    finally:
        dns.stop()
    assert _addresses(reply, NAME) == (0, ["10.244.1.2", "10.244.1.3"])


def _pod(name: str, ip: str, *, ready: bool, labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "team-a", "name": name, "uid": name, "labels": labels or {"app": "cabinet"}, **meta},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _service(name: str, *, headless: bool, **spec: Any) -> dict[str, Any]:
    cluster_ip = {"clusterIP": "None"} if headless else {"clusterIP": "10.96.0.10"}
    return {
        "metadata": {"namespace": "team-a", "name": name},
        "spec": {"selector": {"app": "cabinet"}, **cluster_ip, **spec},
    }


PODS = [
    _pod("cabinet-b", "10.244.1.3", ready=True),
    _pod("cabinet-a", "10.244.1.2", ready=True),
    _pod("cabinet-c", "10.244.1.4", ready=False),  # its readiness probe fails yet
    _pod("cabinet-d", "10.244.1.5", ready=True, deletionTimestamp="2026-01-01T00:00:00Z"),
    _pod("other", "10.244.1.9", ready=True, labels={"app": "other"}),
]


@pytest.mark.parametrize(
    "service, answer",
    [
        (_service("env", headless=True), ("10.244.1.2", "10.244.1.3")),
        (_service("env", headless=True, publishNotReadyAddresses=True), ("10.244.1.2", "10.244.1.3", "10.244.1.4")),
        (_service("env", headless=False), "10.244.1.2"),  # one pod stands in for the Service's IP
    ],
    ids=["headless", "headless-publishing-unready", "cluster-ip"],
)
def test_the_node_agent_publishes_every_ready_pod_of_a_headless_service(service, answer):
    addresses = service_addresses([service], PODS, ip_of=lambda pod: pod["status"]["podIP"])
    assert addresses == {("team-a", "env"): answer}


def test_no_ready_pod_of_a_headless_service_publishes_no_name():
    unready = [_pod("cabinet-c", "10.244.1.4", ready=False)]
    assert service_addresses([_service("env", headless=True)], unready, ip_of=lambda p: p["status"]["podIP"]) == {}


def test_the_kind_nodes_dns_answers_a_headless_service_from_its_endpoints():
    services = [_service("env", headless=True), _service("head-svc", headless=False)]
    endpoints = [
        {"metadata": {"namespace": "team-a", "name": name}, "subsets": [{"addresses": [{"ip": a} for a in ips]}]}
        for name, ips in (("env", ["10.244.1.2", "10.244.1.3"]), ("head-svc", ["10.244.2.7", "10.244.2.8"]))
    ]
    assert headless_services(services) == {("team-a", "env")}
    assert ready_addresses(endpoints, headless_services(services)) == {
        ("team-a", "env"): ("10.244.1.2", "10.244.1.3"),
        ("team-a", "head-svc"): "10.244.2.7",
    }
