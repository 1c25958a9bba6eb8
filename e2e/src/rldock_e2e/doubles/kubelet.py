"""KubeletDouble: a TEST DOUBLE of the kubelets of emulated nodes.

The control plane has no kubelet, so a pod the scheduler binds would stay Pending forever and a
deleted bound pod would stay Terminating. This double plays the kubelet's API-side part for pods
of one namespace, and runs nothing:

- a pod bound to a node (spec.nodeName) that is still Pending becomes Running and Ready, with a
  pod IP from 127.0.0.2, .3, ... (each pod its own loopback address) and container statuses;
  `on_start(pod, ip, env)` is called first (env: the first container's, resolved as the kubelet
  would, pod_env.py), so a test can start what the pod would run;
- a pod being deleted is confirmed gone (grace period 0) after `on_stop(pod)`;
- `fail(pod_name)` marks a pod Failed, as when its node or container dies.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rldock_e2e.doubles._poller import Poller
from rldock_e2e.doubles.pod_env import container_env

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
StartHook = Callable[[Mapping[str, Any], str, dict[str, str]], None]
StopHook = Callable[[Mapping[str, Any]], None]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeletDouble:
    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        namespace: str,
        interval: float = 0.3,
        on_start: StartHook | None = None,
        on_stop: StopHook | None = None,
    ) -> None:
        self.namespace = namespace
        self.core = client.CoreV1Api(api_client)
        self._on_start, self._on_stop = on_start, on_stop
        self._next_ip = 2
        self._lock = threading.Lock()
        self._poller = Poller("kubelet-double", self.sync, interval=interval)

    def __enter__(self) -> KubeletDouble:
        self._poller.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._poller.stop()

    @property
    def errors(self) -> list[BaseException]:
        return self._poller.errors

    def sync(self) -> None:
        with self._lock:
            pods = json.loads(self.core.list_namespaced_pod(self.namespace, _preload_content=False).data)["items"]
            for pod in pods:
                meta, status = pod["metadata"], pod.get("status", {})
                if meta.get("deletionTimestamp"):
                    self._remove(pod)
                elif pod["spec"].get("nodeName") and status.get("phase", "Pending") == "Pending":
                    self._run(pod)

    def fail(self, pod_name: str, *, reason: str = "Error", message: str = "the container exited with 1") -> None:
        """Mark a running pod Failed (its process died and restartPolicy does not bring it back)."""
        with self._lock:
            now = _now()
            self.core.patch_namespaced_pod_status(
                pod_name,
                self.namespace,
                {
                    "status": {
                        "phase": "Failed",
                        "reason": reason,
                        "message": message,
                        "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
                    }
                },
                _content_type=MERGE_PATCH,
            )

    # ------------------------------------------------------------------------------------------
    def _run(self, pod: Mapping[str, Any]) -> None:
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip = 2 + (self._next_ip - 1) % 253
        if self._on_start is not None:
            self._on_start(pod, ip, self._environment(pod))
        now = _now()
        containers = pod["spec"]["containers"]
        status = {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "hostIP": "127.0.0.1",
            "startTime": now,
            "conditions": [
                {"type": t, "status": "True", "lastTransitionTime": now}
                for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
            ],
            "containerStatuses": [
                {
                    "name": c["name"],
                    "image": c["image"],
                    "imageID": "",
                    "ready": True,
                    "restartCount": 0,
                    "started": True,
                    "state": {"running": {"startedAt": now}},
                }
                for c in containers
            ],
        }
        self.core.patch_namespaced_pod_status(
            pod["metadata"]["name"], self.namespace, {"status": status}, _content_type=MERGE_PATCH
        )
        log.info("pod %s running at %s", pod["metadata"]["name"], ip)

    def _remove(self, pod: Mapping[str, Any]) -> None:
        if self._on_stop is not None and pod.get("status", {}).get("phase") == "Running":
            self._on_stop(pod)
        try:
            self.core.delete_namespaced_pod(
                pod["metadata"]["name"], self.namespace, grace_period_seconds=0, _preload_content=False
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def _environment(self, pod: Mapping[str, Any]) -> dict[str, str]:
        return container_env(
            pod, pod["spec"]["containers"][0], config_map=self._config_map_data, secret=self._secret_data
        )

    def _config_map_data(self, name: str) -> dict[str, str] | None:
        return self._read("config_map", name)

    def _secret_data(self, name: str) -> dict[str, str] | None:
        return self._read("secret", name)

    def _read(self, kind: str, name: str) -> dict[str, str] | None:
        read = getattr(self.core, f"read_namespaced_{kind}")
        try:
            return json.loads(read(name, self.namespace, _preload_content=False).data).get("data") or {}
        except ApiException as error:
            if error.status == 404:
                return None
            raise
