"""The few Kubernetes calls the reconciler makes, on the official client, returning plain dicts.

Objects come back exactly as the API server sends them (camelCase JSON, `_preload_content=False`),
the same shape the builders produce and the pure layers read; no client models in between.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, cast

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rldock.operator.constants import (
    GROUP,
    PLURAL,
    RAY_API_VERSION,
    RAY_CLUSTER_PLURAL,
    VERSION,
)

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
_RAY_GROUP, _RAY_VERSION = RAY_API_VERSION.split("/")


def _load(response: Any) -> dict[str, Any]:
    return json.loads(response.data)


class CreateRefused(Exception):
    """The API server refused to create an object: 403 (a ResourceQuota, RBAC, an admission
    webhook) or 422 (invalid, e.g. too large). `message` is the server's own (its Status body)."""

    def __init__(self, kind: str, name: str, status: int, message: str) -> None:
        super().__init__(f"creating {kind} {name} was refused (HTTP {status}): {message}")
        self.kind, self.name, self.status, self.message = kind, name, status, message


class StatusRejected(Exception):
    """The API server refused a status patch (400, 413, 422, or etcd's "request is too large")."""


def api_message(error: ApiException) -> str:
    """The `message` of the Status the API server answered with, else its reason."""
    try:
        body = json.loads(error.body or "")
    except (TypeError, ValueError):  # no body, or not JSON (a proxy's HTML page)
        return str(error.reason or error.status)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return str(error.reason or error.status)


class Kube:
    """Namespaced reads and writes of the RLJob's children, the RLJob itself, and pods."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)

    # --- the children (ConfigMap, Secret, NetworkPolicy, Service, ServiceAccount, Deployment, RayCluster) ---
    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            if kind == "RayCluster":
                return cast(
                    dict[str, Any],
                    self.custom.get_namespaced_custom_object(
                        _RAY_GROUP, _RAY_VERSION, namespace, RAY_CLUSTER_PLURAL, name
                    ),
                )
            # No Secret: the operator never reads one back (tokens.py), and its role cannot.
            read = {
                "ConfigMap": self.core.read_namespaced_config_map,
                "NetworkPolicy": self.networking.read_namespaced_network_policy,
                "Service": self.core.read_namespaced_service,
                "Deployment": self.apps.read_namespaced_deployment,
                "ServiceAccount": self.core.read_namespaced_service_account,
            }[kind]
            return _load(read(name, namespace, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create; None when an object of that name already exists (the next round reads it);
        CreateRefused when the API server forbids or refuses it."""
        kind, namespace = manifest["kind"], manifest["metadata"]["namespace"]
        try:
            if kind == "RayCluster":
                return cast(
                    dict[str, Any],
                    self.custom.create_namespaced_custom_object(
                        _RAY_GROUP, _RAY_VERSION, namespace, RAY_CLUSTER_PLURAL, dict(manifest)
                    ),
                )
            create: Any = {
                "ConfigMap": self.core.create_namespaced_config_map,
                "Secret": self.core.create_namespaced_secret,
                "NetworkPolicy": self.networking.create_namespaced_network_policy,
                "Service": self.core.create_namespaced_service,
                "Deployment": self.apps.create_namespaced_deployment,
                "ServiceAccount": self.core.create_namespaced_service_account,
            }[kind]
            return _load(create(namespace, dict(manifest), _preload_content=False))
        except ApiException as error:
            if error.status == 409:
                log.info("%s %s/%s already exists", kind, namespace, manifest["metadata"]["name"])
                return None
            if error.status in (403, 422):
                raise CreateRefused(kind, manifest["metadata"]["name"], error.status, api_message(error)) from None
            raise

    def patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """JSON merge patch (RFC 7386): lists are replaced, null removes a key."""
        if kind == "RayCluster":
            return cast(
                dict[str, Any],
                self.custom.patch_namespaced_custom_object(
                    _RAY_GROUP,
                    _RAY_VERSION,
                    namespace,
                    RAY_CLUSTER_PLURAL,
                    name,
                    dict(patch),
                    _content_type=MERGE_PATCH,
                ),
            )
        method = {
            "ConfigMap": self.core.patch_namespaced_config_map,
            "NetworkPolicy": self.networking.patch_namespaced_network_policy,
            "Service": self.core.patch_namespaced_service,
            "Deployment": self.apps.patch_namespaced_deployment,
        }[kind]
        return _load(method(name, namespace, dict(patch), _content_type=MERGE_PATCH, _preload_content=False))

    def patch_rljob_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """JSON merge patch of the RLJob's status subresource; StatusRejected when the API server
        refuses that status (it would refuse it again next round), ApiException otherwise."""
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": dict(patch)}, _content_type=MERGE_PATCH
            )
        except ApiException as error:
            message = api_message(error)
            if error.status in (400, 413, 422) or (error.status == 500 and "too large" in message):
                raise StatusRejected(f"HTTP {error.status}: {message}") from None
            raise

    def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        """Delete (in the background); with `uid`, only that very object. False when absent."""
        body = client.V1DeleteOptions(
            propagation_policy="Background", preconditions=client.V1Preconditions(uid=uid) if uid else None
        )
        try:
            if kind == "RayCluster":
                self.custom.delete_namespaced_custom_object(
                    _RAY_GROUP, _RAY_VERSION, namespace, RAY_CLUSTER_PLURAL, name, body=body
                )
            elif kind == "RLJob":
                self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body=body)
            else:  # an environment's children, once its entry left the spec
                remove: Any = {
                    "Deployment": self.apps.delete_namespaced_deployment,
                    "Service": self.core.delete_namespaced_service,
                    "NetworkPolicy": self.networking.delete_namespaced_network_policy,
                }.get(kind)
                if remove is None:
                    raise ValueError(f"the operator does not delete {kind}s")
                remove(name, namespace, body=body)
        except ApiException as error:
            if error.status in (404, 409):  # gone, or a newer object of the same name (uid mismatch)
                return False
            raise
        return True

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{key}={value}" for key, value in labels.items())
        response = self.core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
        return _load(response).get("items") or []

    def list_deployments(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        selector = ",".join(f"{key}={value}" for key, value in labels.items())
        response = self.apps.list_namespaced_deployment(namespace, label_selector=selector, _preload_content=False)
        return _load(response).get("items") or []
