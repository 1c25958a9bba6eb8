"""Where the checkout and its neighbours are. The tooling is only ever installed editable from a
checkout (it is never shipped), so the repository is a fixed number of folders above this file.

KubeRay's CRDs are read from `../shared/kuberay` beside the checkout (the KubeRay operator cannot
be built here, but its CRDs are real), or from $RLDOCK_KUBERAY_CRDS. When they are missing, tests
skip with the reason on a developer's machine and fail under CI (CI=true), where a skip would hide
that the operator's RayClusters were never checked against KubeRay's schema.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]  # e2e/src/rldock_e2e/repo.py
CHART_DIR = REPO_ROOT / "helm" / "rldock"
KUBERAY_CRDS_ENV = "RLDOCK_KUBERAY_CRDS"


def kuberay_crd_dir() -> Path:
    override = os.environ.get(KUBERAY_CRDS_ENV)
    return Path(override) if override else REPO_ROOT.parent / "shared" / "kuberay"


def missing_kuberay_crds_reason(path: Path) -> str | None:
    """Why KubeRay's CRDs at `path` cannot be used, or None when they are there."""
    if path.exists():
        return None
    return (
        f"KubeRay's CRDs are read from {path} (../shared/kuberay beside the checkout, or "
        f"${KUBERAY_CRDS_ENV}), which is absent here"
    )


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_kuberay_crds(path: Path) -> None:
    """In a test: skip (developer machine) or fail (CI) when KubeRay's CRDs at `path` are missing."""
    import pytest

    reason = missing_kuberay_crds_reason(path)
    if reason is not None:
        if under_ci():
            pytest.fail(reason)
        pytest.skip(reason)
