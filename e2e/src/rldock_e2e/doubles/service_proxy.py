"""ServiceProxy: a TEST DOUBLE of kube-proxy for one Service: the API server's (`default/kubernetes`).

A pod reaches the API server at `$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`, the ClusterIP
of Service `kubernetes` (the first address of the service range, which the API server's serving
certificate names). The e2e API server listens on 127.0.0.1 only, out of a pod's reach, so the node
agent puts that ClusterIP on the pod network's bridge and this proxy forwards TCP from it to the
API server, byte for byte (TLS stays end to end).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading

log = logging.getLogger(__name__)


class ServiceProxy:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen, self.target = listen, target
        self._server: socket.socket | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(self.listen)
        self._server.listen(64)
        self._server.settimeout(0.2)
        thread = threading.Thread(target=self._accept, name="service-proxy-double", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._server is not None:
            self._server.close()

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                downstream, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError as error:
                log.warning("service proxy: %s:%d unreachable: %s", *self.target, error)
                downstream.close()
                continue
            threading.Thread(
                target=self._pump, args=(downstream, upstream), daemon=True, name="service-proxy-conn"
            ).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        selector.register(a, selectors.EVENT_READ, b)
        selector.register(b, selectors.EVENT_READ, a)
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.5):
                    data = key.fileobj.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            selector.close()
            a.close()
            b.close()
