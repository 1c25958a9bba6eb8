"""A real Kubernetes 1.20 control plane on loopback (etcd, apiserver, controller manager, scheduler)."""

from .binaries import BinariesUnavailable, BuildFailed, cache_dir, find_binaries
from .cluster import ControlPlane, ControlPlaneError, KubectlError, wait_for
from .credentials import ADMIN_USER, DEVELOPER_USER, TENANT_USER
from .processes import pid_alive

__all__ = [
    "ADMIN_USER",
    "BinariesUnavailable",
    "BuildFailed",
    "ControlPlane",
    "ControlPlaneError",
    "DEVELOPER_USER",
    "KubectlError",
    "TENANT_USER",
    "cache_dir",
    "find_binaries",
    "pid_alive",
    "wait_for",
]
