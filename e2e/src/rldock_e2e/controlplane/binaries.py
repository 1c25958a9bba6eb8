"""Where the control-plane binaries are, building them with build.sh when they are not there yet."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

K8S_VERSION = "1.20.2"
BUILD_SCRIPT = Path(__file__).resolve().parent / "build.sh"
SERVER_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")


class BinariesUnavailable(RuntimeError):
    """The binaries are not cached and this machine cannot build them (the message says why)."""


class BuildFailed(RuntimeError):
    """build.sh could run here but failed: a real error, not a reason to skip."""


# build.sh's exit status for "this machine cannot build" (no root, no apt, no Debian mirror).
EXIT_UNAVAILABLE = 2


@dataclass(frozen=True)
class Binaries:
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    etcd: Path
    kubectl: Path


def cache_dir() -> Path:
    """${RLDOCK_CACHE:-~/.cache/rldock}/k8s-1.20.2, the folder build.sh fills."""
    root = Path(os.environ.get("RLDOCK_CACHE", Path.home() / ".cache" / "rldock"))
    return root / f"k8s-{K8S_VERSION}"


def _find() -> Binaries | None:
    directory = cache_dir()
    servers = [directory / name for name in SERVER_BINARIES]
    etcd, kubectl = shutil.which("etcd"), shutil.which("kubectl")
    if not (all(os.access(p, os.X_OK) for p in servers) and etcd and kubectl):
        return None
    return Binaries(*servers, etcd=Path(etcd), kubectl=Path(kubectl))


def find_binaries(*, build: bool = True) -> Binaries:
    """The cached binaries; with `build`, runs build.sh first when any is missing (~12 min cold).

    Raises BinariesUnavailable (cannot build on this machine) or BuildFailed, with build.sh's
    own explanation.
    """
    found = _find()
    if found is not None or not build:
        if found is None:
            raise BinariesUnavailable(
                f"control-plane binaries not in {cache_dir()} (or etcd/kubectl not on PATH); run {BUILD_SCRIPT}"
            )
        return found
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True)
    if result.returncode == EXIT_UNAVAILABLE:
        raise BinariesUnavailable(result.stderr.strip()[-3000:])
    if result.returncode != 0:
        raise BuildFailed(f"{BUILD_SCRIPT} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    found = _find()
    if found is None:
        raise BuildFailed(
            f"{BUILD_SCRIPT} succeeded but binaries are still missing from {cache_dir()} (or kubectl is not on PATH)"
        )
    return found
