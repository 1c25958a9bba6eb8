"""ClusterDNS: a TEST DOUBLE of the cluster's DNS (CoreDNS) for the pods the node agent runs.

Pods find a Service by name: KubeRay's workers join `<cluster>-head-svc.<ns>.svc.cluster.local`.
/etc/hosts is not enough: Ray's C++ gRPC client resolves names with c-ares, which asks the
nameservers of /etc/resolv.conf. So, as in a cluster, every pod's /etc/resolv.conf names this
server (on the pod network's gateway, port 53) with the kubelet's search path, and it answers A
queries for `<svc>.<ns>.svc.cluster.local` with the address of a pod behind the Service (DNS and
kube-proxy in one: there are no Service IPs that route here), and for a headless Service's name
with every ready pod's address, one A record each, as CoreDNS does (a client that spreads its
connections over the replicas, like the runtime's environment client, sees them all). Everything
else is NXDOMAIN (no upstream: nothing here leaves the machine); AAAA of a known name is an empty
NOERROR.

Minimal DNS over UDP (RFC 1035): one question per query, no compression in questions, no EDNS, no
TCP: an answer holds as many A records as fit the 512 bytes of a UDP message (27 for a name of 50
characters), without the truncation bit, which would send the client to TCP.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

DOMAIN = "cluster.local"
_TYPE_A, _TYPE_AAAA, _CLASS_IN = 1, 28, 1
_NOERROR, _FORMERR, _NXDOMAIN = 0, 1, 3
_TTL = 5
_UDP_MAX = 512
_A_RECORD = 16  # name pointer 2, type 2, class 2, TTL 4, length 2, address 4


def resolv_conf(nameserver: str, namespace: str) -> str:
    """A pod's /etc/resolv.conf under dnsPolicy ClusterFirst, as the kubelet writes it."""
    return f"search {namespace}.svc.{DOMAIN} svc.{DOMAIN} {DOMAIN}\nnameserver {nameserver}\noptions ndots:5\n"


class ClusterDNS:
    def __init__(self, address: str, port: int = 53) -> None:
        self.address, self.port = address, port
        self._records: dict[str, tuple[str, ...]] = {}
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def set_services(self, addresses: Mapping[tuple[str, str], str | Sequence[str]]) -> None:
        """(namespace, service) -> its pod's IP, or every IP of a headless Service (none: no name);
        replaces every record."""
        records = {
            f"{name}.{namespace}.svc.{DOMAIN}": (ips,) if isinstance(ips, str) else tuple(ips)
            for (namespace, name), ips in addresses.items()
            if ips
        }
        with self._lock:
            self._records = records

    def start(self) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind((self.address, self.port))
        self._socket.settimeout(0.2)
        self._thread = threading.Thread(target=self._serve, name="cluster-dns-double", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        sock, self._socket = self._socket, None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if sock is not None:
            sock.close()

    def resolve(self, name: str) -> tuple[str, ...]:
        """The addresses of `name`; empty when it is not a Service's."""
        with self._lock:
            return self._records.get(name.lower().rstrip("."), ())

    def _serve(self) -> None:
        while self._socket is not None:
            sock = self._socket
            try:
                query, client = sock.recvfrom(512)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                sock.sendto(self.answer(query), client)
            except (OSError, ValueError, IndexError, struct.error) as error:
                log.debug("cluster DNS: bad query from %s: %s", client, error)

    def answer(self, query: bytes) -> bytes:
        ident, flags, qdcount = struct.unpack("!HHH", query[:6])
        if qdcount != 1:
            return struct.pack("!HHHHHH", ident, 0x8000 | (flags & 0x0100) | _FORMERR, 0, 0, 0, 0)
        labels, offset = [], 12
        while query[offset]:
            length = query[offset]
            labels.append(query[offset + 1 : offset + 1 + length].decode("ascii"))
            offset += 1 + length
        qtype, qclass = struct.unpack("!HH", query[offset + 1 : offset + 5])
        question = query[12 : offset + 5]
        addresses = self.resolve(".".join(labels))
        records: list[bytes] = []
        if qtype == _TYPE_A and qclass == _CLASS_IN:
            room = (_UDP_MAX - 12 - len(question)) // _A_RECORD
            # Name: a pointer to the question's name at offset 12.
            records = [
                struct.pack("!HHHIH", 0xC00C, _TYPE_A, _CLASS_IN, _TTL, 4) + socket.inet_aton(address)
                for address in addresses[:room]
            ]
        rcode = _NOERROR if addresses else _NXDOMAIN
        # QR, AA, RD copied, RA.
        response_flags = 0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | rcode
        header = struct.pack("!HHHHHH", ident, response_flags, 1, len(records), 0, 0)
        return header + question + b"".join(records)
