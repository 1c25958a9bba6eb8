"""KubeRayDouble: a TEST DOUBLE of the KubeRay operator (ray-operator, ray.io/v1 RayCluster).

KubeRay is a Go program that cannot run here. This double does the part of it an RLJob's life
depends on, the way KubeRay v1.x does it, for RayClusters in one namespace:

- a head Service `<cluster>-head-svc` (ClusterIP; ports client 10001, dashboard, gcs-server 6379,
  metrics 8080, serve 8000);
- one head Pod (generateName `<cluster>-head-`) and `replicas` worker Pods per group (generateName
  `<cluster>-<group>-worker-`), from the group templates, labelled `ray.io/cluster`,
  `ray.io/node-type`, `ray.io/group`, `ray.io/is-ray-node`, owned by the RayCluster, built as
  KubeRay builds them (kuberay_pods.py: the `ray start` line from `rayStartParams` and the
  container's limits, KubeRay's env, the workers' wait-gcs-ready init container, the health
  probes); failed pods are deleted and replaced, missing pods recreated (a lost worker comes back
  under a new name; a deleted head once it is gone, not while it terminates);
- `spec.suspend: true` deletes every pod (state `suspended`), false brings them back;
- `.status`: `state: ready` once the head and all workers are Running and Ready (it stays ready,
  as in KubeRay >= 1.2), conditions HeadPodReady / RayClusterProvisioned / RayClusterSuspended,
  `head.{podIP,podName,serviceIP,serviceName}`, `endpoints` from the head Service's ports,
  ready/available/desired worker counts.

It knows nothing about RLJobs. It polls (every `interval` s) instead of watching: simpler, and
fast enough for tests. What it does not do: autoscaling, GCS fault tolerance, Volcano/Kueue
integration, NodePort/LoadBalancer services, RayJob/RayService.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rldock_e2e.doubles._poller import Poller
from rldock_e2e.doubles.kuberay_pods import build_pod

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"
MERGE_PATCH = "application/merge-patch+json"
DEFAULT_PORTS = {"client": 10001, "dashboard": 8265, "gcs-server": 6379, "metrics": 8080, "serve": 8000}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or ()}
    return pod.get("status", {}).get("phase") == "Running" and conditions.get("Ready") == "True"


def _alive(pod: Mapping[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and pod.get("status", {}).get("phase") not in (
        "Failed",
        "Succeeded",
    )


class KubeRayDouble:
    """Reconciles the RayClusters of `namespace` every `interval` seconds in a background thread."""

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        namespace: str,
        interval: float = 0.3,
        dashboard_port: int = DEFAULT_PORTS["dashboard"],
    ) -> None:
        self.namespace = namespace
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.ports = {**DEFAULT_PORTS, "dashboard": dashboard_port}
        self._poller = Poller("kuberay-double", self.reconcile_all, interval=interval)

    def __enter__(self) -> KubeRayDouble:
        self._poller.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._poller.stop()

    @property
    def errors(self) -> list[BaseException]:
        return self._poller.errors

    # ------------------------------------------------------------------------------------------
    def reconcile_all(self) -> None:
        clusters = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)["items"]
        pods = json.loads(
            self.core.list_namespaced_pod(self.namespace, label_selector="ray.io/cluster", _preload_content=False).data
        )["items"]
        for cluster in clusters:
            if not cluster["metadata"].get("deletionTimestamp"):
                uid = cluster["metadata"]["uid"]
                mine = [p for p in pods if any(r["uid"] == uid for r in p["metadata"].get("ownerReferences") or ())]
                self.reconcile(cluster, mine)

    def reconcile(self, cluster: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        name = cluster["metadata"]["name"]
        service = self._ensure_service(cluster)
        spec = cluster["spec"]
        if spec.get("suspend"):
            for pod in pods:
                self._delete_pod(pod)
            self._write_status(cluster, service, pods=[], suspended=True)
            return
        for pod in pods:
            if pod.get("status", {}).get("phase") == "Failed" and not pod["metadata"].get("deletionTimestamp"):
                log.info("deleting failed pod %s", pod["metadata"]["name"])
                self._delete_pod(pod)
        live = [p for p in pods if _alive(p)]
        # As KubeRay does, no second head while one is still terminating (its preStop hook may run for minutes).
        heads = [
            p
            for p in pods
            if p["metadata"]["labels"].get("ray.io/node-type") == "head"
            and p.get("status", {}).get("phase") not in ("Failed", "Succeeded")
        ]
        if not heads:
            self._create_pod(cluster, spec["headGroupSpec"], head=True)
        for group in spec.get("workerGroupSpecs") or ():
            members = [
                p
                for p in live
                if p["metadata"]["labels"].get("ray.io/group") == group["groupName"]
                and p["metadata"]["labels"].get("ray.io/node-type") == "worker"
            ]
            wanted = 0 if group.get("suspend") else int(group.get("replicas", group.get("minReplicas", 0)))
            for _ in range(wanted - len(members)):
                self._create_pod(cluster, group, head=False)
            for extra in sorted(members, key=lambda p: p["metadata"]["name"])[wanted:]:
                self._delete_pod(extra)
        self._write_status(cluster, service, pods=live, suspended=False)
        log.debug("reconciled RayCluster %s", name)

    # ------------------------------------------------------------------------------------------
    def _owner(self, cluster: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "RayCluster",
            "name": cluster["metadata"]["name"],
            "uid": cluster["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def _ensure_service(self, cluster: Mapping[str, Any]) -> dict[str, Any]:
        name = f"{cluster['metadata']['name']}-head-svc"
        try:
            return json.loads(self.core.read_namespaced_service(name, self.namespace, _preload_content=False).data)
        except ApiException as error:
            if error.status != 404:
                raise
        manifest = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "ownerReferences": [self._owner(cluster)],
                "labels": {
                    "ray.io/cluster": cluster["metadata"]["name"],
                    "ray.io/node-type": "head",
                    "app.kubernetes.io/created-by": "kuberay-operator",
                },
            },
            "spec": {
                "type": "ClusterIP",
                "selector": {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"},
                "ports": [
                    {"name": port_name, "port": port, "targetPort": port, "protocol": "TCP"}
                    for port_name, port in self.ports.items()
                ],
            },
        }
        return json.loads(self.core.create_namespaced_service(self.namespace, manifest, _preload_content=False).data)

    def _create_pod(self, cluster: Mapping[str, Any], group_spec: Mapping[str, Any], *, head: bool) -> None:
        manifest = build_pod(cluster, group_spec, head=head)
        created = self.core.create_namespaced_pod(self.namespace, manifest, _preload_content=False)
        log.info("created pod %s", json.loads(created.data)["metadata"]["name"])

    def _delete_pod(self, pod: Mapping[str, Any]) -> None:
        if pod["metadata"].get("deletionTimestamp"):
            return
        try:
            self.core.delete_namespaced_pod(pod["metadata"]["name"], self.namespace, _preload_content=False)
        except ApiException as error:
            if error.status != 404:
                raise

    def _write_status(
        self, cluster: Mapping[str, Any], service: Mapping[str, Any], *, pods: list[dict[str, Any]], suspended: bool
    ) -> None:
        previous = cluster.get("status") or {}
        groups = cluster["spec"].get("workerGroupSpecs") or ()
        desired = sum(0 if g.get("suspend") else int(g.get("replicas", 0)) for g in groups)
        head = next((p for p in pods if p["metadata"]["labels"].get("ray.io/node-type") == "head"), None)
        workers = [p for p in pods if p["metadata"]["labels"].get("ray.io/node-type") == "worker"]
        ready_workers = sum(_ready(p) for p in workers)
        head_ready = head is not None and _ready(head)
        all_ready = head_ready and ready_workers >= desired
        was_provisioned = any(
            c.get("type") == "RayClusterProvisioned" and c.get("status") == "True"
            for c in previous.get("conditions") or ()
        )
        provisioned = (all_ready or was_provisioned) and not suspended
        if suspended:
            state = "suspended"
        elif all_ready or previous.get("state") == "ready":
            state = "ready"  # KubeRay keeps `ready` once reached
        else:
            state = None
        conditions = [
            self._condition(
                previous,
                "HeadPodReady",
                head_ready,
                "HeadPodRunningAndReady" if head_ready else "HeadPodNotFound",
                "the head pod is ready" if head_ready else "the head pod is not ready",
            ),
            self._condition(
                previous,
                "RayClusterProvisioned",
                provisioned,
                "AllPodRunningAndReadyFirstTime" if provisioned else "RayClusterPodsProvisioning",
                "all pods were ready once" if provisioned else "waiting for all pods to be ready",
            ),
            self._condition(
                previous,
                "RayClusterSuspended",
                suspended,
                "Suspended" if suspended else "NotSuspended",
                "suspended" if suspended else "not suspended",
            ),
        ]
        status: dict[str, Any] = {
            "state": state,
            "desiredWorkerReplicas": desired,
            "minWorkerReplicas": sum(int(g.get("minReplicas", 0)) for g in groups),
            "maxWorkerReplicas": sum(int(g.get("maxReplicas", 0)) for g in groups),
            "readyWorkerReplicas": ready_workers,
            "availableWorkerReplicas": ready_workers,
            "conditions": conditions,
            "endpoints": {port["name"]: str(port["port"]) for port in service["spec"]["ports"]},
            "head": {
                "serviceName": service["metadata"]["name"],
                "serviceIP": service["spec"].get("clusterIP"),
                "podName": head["metadata"]["name"] if head else None,
                "podIP": head.get("status", {}).get("podIP") if head else None,
            },
            "observedGeneration": cluster["metadata"].get("generation"),
        }
        status["head"] = {k: v for k, v in status["head"].items() if v}
        status = {k: v for k, v in status.items() if v is not None}
        comparable = {k: v for k, v in previous.items() if k not in ("lastUpdateTime", "stateTransitionTimes")}
        if comparable == status:
            return
        status["lastUpdateTime"] = _now()
        removed = {k: None for k in previous if k not in status and k != "stateTransitionTimes"}
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                cluster["metadata"]["name"],
                {"status": {**removed, **status}},
                _content_type=MERGE_PATCH,
            )
        except ApiException as error:
            # Deleted since this round listed it (its RLJob deleted: the garbage collector removes it
            # within the round): there is nothing left to write to, as for KubeRay's controller.
            if error.status != 404:
                raise

    @staticmethod
    def _condition(previous: Mapping[str, Any], type_: str, value: bool, reason: str, message: str) -> dict[str, Any]:
        status = "True" if value else "False"
        old = next((c for c in previous.get("conditions") or () if c.get("type") == type_), None)
        moved = old is None or old.get("status") != status
        return {
            "type": type_,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": _now() if moved else old["lastTransitionTime"],
        }
