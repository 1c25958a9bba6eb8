"""The KubeRay double (e2e/src/rldock_e2e/doubles/kuberay.py) against the real API server, where its
rounds race with deletions: a RayCluster deleted by the garbage collector while a round works on it
(its RLJob deleted) leaves nothing to write to, which is no error, as for KubeRay's controller. The
double's poller records every exception of a round, and a scenario fails on the first one."""

from __future__ import annotations

from typing import Any

import pytest

from rldock_e2e.controlplane import ControlPlane
from rldock_e2e.doubles.kuberay import GROUP, PLURAL, VERSION, KubeRayDouble

pytestmark = pytest.mark.e2e


def _ray_cluster(name: str) -> dict[str, Any]:
    container = {"name": "ray-head", "image": "rayproject/ray:2.60.0"}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [container]}}}},
    }


def test_a_cluster_deleted_during_a_round_ends_the_round_without_an_error(
    control_plane: ControlPlane, kuberay_crds: list[str], namespace: str
) -> None:
    name = "deleted-mid-round"
    with control_plane.api_client() as api:
        double = KubeRayDouble(api, namespace=namespace)  # not started: the test runs its rounds
        custom = double.custom
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _ray_cluster(name))
        double.reconcile_all()  # the head Service and Pod, and a status
        assert custom.get_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name)["status"]

        patch_status = custom.patch_namespaced_custom_object_status
        deleted: list[str] = []

        def delete_then_patch(*args: Any, **kwargs: Any) -> Any:
            # The deletion lands after the round listed the cluster and before it writes the status.
            custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            deleted.append(name)
            return patch_status(*args, **kwargs)

        custom.patch_namespaced_custom_object_status = delete_then_patch  # type: ignore[method-assign]
        # This round lists the head pod the first one created, so it has a new status to write.
        double.reconcile_all()
        assert deleted == [name]
        assert custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"] == []
