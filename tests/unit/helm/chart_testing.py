"""Shared helpers for the chart's tests: render helm/rldock with the Helm library (helm-python-sdk,
no helm binary, no cluster) and load the result as Kubernetes objects. Imported, not a conftest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm" / "rldock"
RELEASE = "rldock"
NAMESPACE = "rldock-system"
# The oldest and the newest Kubernetes API schemas kubernetes-validate carries.
KUBERNETES_VERSIONS = ("1.25", "1.37")

# Values of the variants the tests render: the defaults, per-namespace watching, and cluster-wide
# watching with every other knob turned.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "per-namespace": {"operator": {"watchNamespaces": ["team-a", "team-b"]}},
    "cluster-wide-custom": {
        "image": {"tag": "0.1.0-rc1", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "runtime": {
            "image": {"repository": "registry.example.com/rl/runtime", "tag": "0.1.0-cuda", "pullPolicy": "Always"},
            "deviceResource": "nvidia.com/gpu",
        },
        "operator": {
            "pollInterval": 0.5,
            "logLevel": "DEBUG",
            "dashboardAddress": "service-ip",
            "rayTimeout": 2.5,
            "healthPort": 9090,
            "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
        },
        "crds": {"keep": False},
        "serviceAccount": {"name": "rl-operator", "annotations": {"team": "rl"}},
        "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
        "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"prometheus.io/scrape": "false"},
        "fullnameOverride": "rl-operator",
    },
}


def render_files(
    values: dict[str, Any] | None = None, *, chart: Path = CHART, namespace: str = NAMESPACE
) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would print it (NOTES.txt included)."""
    with helm.Chart.load(chart) as loaded:
        return loaded.render(values or {}, name=RELEASE, namespace=namespace, is_install=True)


def render(
    values: dict[str, Any] | None = None, *, chart: Path = CHART, namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    """Every object the chart renders with `values`, in template order."""
    objects = []
    for path, text in sorted(render_files(values, chart=chart, namespace=namespace).items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = by_kind(objects, kind)
    return found
