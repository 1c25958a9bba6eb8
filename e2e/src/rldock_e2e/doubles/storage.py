"""Shared storage for emulated nodes: a PersistentVolume and a claim bound to it, as the PV
controller would bind them (it is off in the e2e control plane: it needs a cloud or a provisioner).

`bind_shared_claim` creates a ReadWriteMany hostPath PersistentVolume and the claim, pre-bound to
each other (`spec.claimRef` with the claim's uid, which a real kubelet checks before mounting /
`spec.volumeName`, the `pv.kubernetes.io/bind-completed` annotation
the scheduler's VolumeBinding plugin looks for, `status.phase: Bound`). The node agent double mounts
a hostPath volume from its `host_root`, the one filesystem every emulated node shares (as an NFS
export mounted on every node would be), so every pod of every node sees the same files.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client

from rldock_e2e.controlplane import ControlPlane

MERGE_PATCH = "application/merge-patch+json"


def bind_shared_claim(
    plane: ControlPlane, *, namespace: str, claim: str, host_path: str, size: str = "10Gi"
) -> dict[str, Any]:
    """Create PersistentVolume `<namespace>-<claim>` (hostPath `host_path`) and claim `claim` in
    `namespace`, bound; returns the claim."""
    volume = f"{namespace}-{claim}"
    with plane.api_client() as api:
        core = client.CoreV1Api(api)
        created = core.create_namespaced_persistent_volume_claim(
            namespace,
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {
                    "name": claim,
                    "annotations": {
                        "pv.kubernetes.io/bind-completed": "yes",
                        "pv.kubernetes.io/bound-by-controller": "yes",
                    },
                },
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": "",
                    "volumeName": volume,
                    "resources": {"requests": {"storage": size}},
                },
            },
        )
        core.create_persistent_volume(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": volume, "annotations": {"pv.kubernetes.io/bound-by-controller": "yes"}},
                "spec": {
                    "capacity": {"storage": size},
                    "accessModes": ["ReadWriteMany"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "hostPath": {"path": host_path, "type": "DirectoryOrCreate"},
                    "claimRef": {
                        "apiVersion": "v1",
                        "kind": "PersistentVolumeClaim",
                        "namespace": namespace,
                        "name": claim,
                        "uid": created.metadata.uid,
                    },
                },
            }
        )
        core.patch_persistent_volume_status(volume, {"status": {"phase": "Bound"}}, _content_type=MERGE_PATCH)
        bound = core.patch_namespaced_persistent_volume_claim_status(
            claim,
            namespace,
            {"status": {"phase": "Bound", "accessModes": ["ReadWriteMany"], "capacity": {"storage": size}}},
            _content_type=MERGE_PATCH,
        )
        return api.sanitize_for_serialization(bound)


def delete_shared_claim(plane: ControlPlane, *, namespace: str, claim: str) -> None:
    """Remove the PersistentVolume (cluster-scoped: the namespace's deletion does not take it)."""
    plane.kubectl("delete", "pv", f"{namespace}-{claim}", "--wait=false", check=False)
